"""Expiry of a bucket's documents (formats/wire.md "Collections on DCP", point 9).

A live document whose expiry has passed is expired, on an active partition only, by the
first read that finds it (`Bucket.current`) and by the expiry pager, which looks for such
documents every `expiry_pager_interval` seconds, in the write queues and on disk. The
expiration itself (`Bucket.expire`) is a tombstone with a new seq, CAS and rev seq whose
expiry is its delete time, so DCP sends it as an EXPIRATION to a client that asked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from upr_cli.node import sysevents
from upr_cli.node.partition import ACTIVE
from upr_cli.node.storage import DocRow

if TYPE_CHECKING:
    from upr_cli.node.bucket import Bucket

log = logging.getLogger(__name__)

EXPIRY_CHUNK = 10_000  # expired documents the pager looks at per storage query


def expired(doc: DocRow, now: float) -> bool:
    """True for a live document whose expiry has passed (a system row's `expiry` is its
    event version, never an expiry)."""
    return (not doc.deleted and 0 < doc.expiry <= now
            and not sysevents.is_system_key(doc.key))  # fmt: skip


async def pager(bucket: Bucket) -> None:
    """Expire what is due every `expiry_pager_interval` seconds, until cancelled."""
    assert bucket.expiry_pager_interval
    while True:
        await asyncio.sleep(bucket.expiry_pager_interval)
        try:
            await expire_due(bucket)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("bucket %s: the expiry pager failed; will retry", bucket.name)


async def expire_due(bucket: Bucket) -> int:
    """The expiry pager's round: expire every live document of an active partition
    whose expiry has passed, in the write queue or on disk; returns how many."""
    now = time.time()
    count = 0
    for part in bucket.partitions.values():  # unflushed versions first
        if part.state == ACTIVE:
            for queued in part.queue.snapshot():
                if expired(queued, now) and part.get(queued.key) is queued:
                    bucket.expire(part, queued)
                    count += 1
    while True:
        active = [vb for vb, p in bucket.partitions.items() if p.state == ACTIVE]
        if not active:
            return count
        found = await bucket.flusher.call(bucket.storage.expired, active, int(now), EXPIRY_CHUNK)
        done = 0
        for row in found:
            part = bucket.partitions[row.vbucket]
            latest = bucket.lookup(row.vbucket, row.key)  # a newer version may have come
            if part.state == ACTIVE and latest is not None and expired(latest, now):
                bucket.expire(part, latest)
                done += 1
        count += done
        if len(found) < EXPIRY_CHUNK or not done:
            return count
        await bucket.flush()  # the next query must not find these again
