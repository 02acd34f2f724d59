"""A bucket's collections changes (formats/collections.md): a new manifest woven into
the partitions as system event rows, and the lazy purge of dropped collections.

`set_manifest` gives each change one system event row in every active partition, with
its own seq, and the flush that persists those rows persists the manifest in the same
transaction (the bucket's manifest generation tells the flusher it is due). A dropped
collection's documents are unreachable at once and deleted later by `purge_dropped`,
without tombstones, as kv_engine does (formats/collections.md §3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from upr_cli.collections import CollectionsError, CollectionsManifest, changes_between
from upr_cli.node import sysevents
from upr_cli.node.partition import ACTIVE
from upr_cli.node.storage import DocRow
from upr_cli.protocol.status import InvalidArguments, OutOfRange

if TYPE_CHECKING:
    from upr_cli.node.bucket import Bucket

log = logging.getLogger(__name__)

PURGE_CHUNK = 10_000  # rows of a dropped collection deleted per transaction


async def set_manifest(bucket: Bucket, manifest: CollectionsManifest) -> None:
    """`Bucket.set_manifest` but for the purge it starts: the checks, the system event
    rows, and a flush that puts them and the manifest on disk together.

    As kv_engine does, only the last event of the change carries the new uid; the
    ones before it carry the uid the partition had, since until the last one is
    applied the partition has not taken the new manifest whole."""
    old = bucket.collections.manifest
    if manifest.uid < old.uid:
        raise OutOfRange(f"manifest uid {manifest.uid:x} is below the current {old.uid:x}")
    if manifest.uid == old.uid and manifest != old:
        raise InvalidArguments(f"manifest uid {manifest.uid:x} is current, with other content")
    try:
        bucket.collections.check(manifest)
    except CollectionsError as exc:
        raise InvalidArguments(str(exc)) from None
    changes = changes_between(old, manifest)
    changes[:-1] = [replace(c, manifest_uid=old.uid) for c in changes[:-1]]
    if changes or manifest != old:
        now = int(time.time())
        for vb, part in sorted(bucket.partitions.items()):
            if part.state != ACTIVE:
                continue  # replicas get the rows through replication
            for change in changes:
                key, flags, expiry, value, deleted = sysevents.system_row(change)
                prev = bucket.lookup(vb, key)
                part.append(DocRow(
                    vb, key, part.high_seq + 1, prev.rev_seq + 1 if prev else 1,
                    bucket.next_cas(), flags, expiry, 0, deleted, now if deleted else 0, value,
                ))  # fmt: skip
        bucket.collections.replace(manifest)
        bucket.manifest_gen += 1
    await bucket.flush()
    if bucket.manifest_saved < bucket.manifest_gen:  # another flush took the rows first
        await bucket.flush()


async def purge_dropped(bucket: Bucket) -> None:
    """Delete the documents of dropped collections, partition by partition, in
    small transactions between flushes (kv_engine purges them lazily too, and sends
    no deletions for them: formats/collections.md §3)."""
    try:
        while todo := sorted(bucket.collections.dropped):  # a drop may come meanwhile
            await bucket.flush()  # the rows queued before the drop are on disk first
            for cid in todo:
                for vb in sorted(bucket.partitions):
                    gone = PURGE_CHUNK
                    while gone == PURGE_CHUNK:  # a short chunk: the partition is clean
                        gone = await bucket.flusher.call(bucket.storage.purge_collection, vb,
                                                         cid, PURGE_CHUNK)  # fmt: skip
                bucket.collections.dropped.discard(cid)
                log.info("bucket %s: dropped collection 0x%x purged", bucket.name, cid)
            bucket.manifest_gen += 1  # the shorter list of ids to purge goes to disk
            await bucket.flush()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("bucket %s: purging dropped collections failed", bucket.name)
