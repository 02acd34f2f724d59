"""A replica partition's undo and its rollback to a snapshot boundary
(formats/cluster.md §5; the UPR design specification, "How KV mutations flow into
Replicas").

A partition fed by a replication stream (replica or pending) keeps every version it
replaces, from the state it started from (`undo_floor`) on, and the ends of the
snapshots it received whole (`bounds`): the only seqs it can go back to, since inside a
deduplicated snapshot a seq is not a state the source had. A rollback undoes what lies
above the newest such boundary at or below the seq asked, or empties the partition when
its undo reaches none; the flusher keeps about `Bucket.undo_window` seqs of undo.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from upr_cli.failover import FailoverLog
from upr_cli.node.partition import PENDING, REPLICA, Marker, Partition
from upr_cli.node.storage import NodeStorage

if TYPE_CHECKING:
    from upr_cli.node.bucket import Bucket

log = logging.getLogger(__name__)

FED = (REPLICA, PENDING)  # states fed by a replication stream
UNDO_WINDOW = 200_000  # seqs of undo a replica partition keeps (formats/cluster.md §5)


def load(storage: NodeStorage, partitions: dict[int, Partition]) -> None:
    """At start-up, the undo floor and boundaries of every fed partition; one without an
    undo (a node before undo existed) starts it at its persisted seq."""
    floors = storage.undo_floors()
    bounds = storage.boundaries()
    for vb, part in partitions.items():
        if part.state in FED:
            if vb not in floors:
                whole = part.persisted_seq == part.snap_end
                storage.start_undo(vb, part.persisted_seq, boundary=whole)
                bounds[vb] = [part.persisted_seq] if whole else []
            part.undo_floor = floors.get(vb, part.persisted_seq)
            part.bounds = bounds.get(vb, [])


async def follow_state(bucket: Bucket, part: Partition, state: str) -> None:
    """Start or drop a partition's undo as it becomes fed or stops being fed (its records
    persisted by the caller, with the state)."""
    if state in FED and part.state not in FED:
        # from here on every replaced version is kept: a rollback can undo it, back to
        # a snapshot boundary (the state it starts from is one when it is whole: an
        # active's persisted data always is)
        whole = part.complete_seq == part.persisted_seq
        start_undo = functools.partial(bucket.storage.start_undo, boundary=whole)
        await bucket.flusher.call(start_undo, part.vbucket, part.persisted_seq)
        part.undo_floor = part.persisted_seq
        part.bounds = [part.persisted_seq] if whole else []
    elif state not in FED:
        part.undo_floor = None
        part.bounds, part.broken = [], set()


def marker(part: Partition, start: int, end: int) -> None:
    """A snapshot marker for a replica partition: its items up to `end` are one cut.
    A snapshot not received whole before a new one begins (its stream was cut short:
    a pause, a link restarted) never completes: the new stream deduplicates on its
    own, so the old snapshot's end is no boundary (nor a complete snapshot)."""
    markers = part.markers
    while markers and markers[-1].end > part.high_seq:  # only the newest can be cut short
        markers.pop()
    markers.append(Marker(start, end))


def replica_snapshot(part: Partition, top: int) -> tuple[int, int]:
    """(snap_start, snap_end) to record when a replica partition is persisted up to `top`:
    (top, top) if `top` ends a snapshot; else (the last complete snapshot's end, the end
    of the snapshot holding `top`), so `complete_seq` names the last complete snapshot
    (the UPR design specification's walkthrough, "UPR in action on a Cluster": B persisted
    through 7 of snapshot 6-8 and promotes at 5)."""
    complete, current = part.complete_seq, top
    for start, end in part.markers:
        if end <= top:
            complete = max(complete, end)
        elif start <= top:
            current = max(current, end)
    return (top, top) if complete >= top else (complete, current)


async def prune(bucket: Bucket) -> None:
    """Keep about `undo_window` seqs of undo per replica partition (bounded disk)."""
    for vb, part in bucket.partitions.items():
        floor = part.undo_floor
        if floor is not None and part.persisted_seq - floor > 2 * bucket.undo_window:
            new_floor = part.persisted_seq - bucket.undo_window
            part.undo_floor = new_floor  # first: a floor too high is only conservative
            part.bounds = [b for b in part.bounds if b >= new_floor]
            await bucket.flusher.call(bucket.storage.prune_undo, vb, new_floor)


async def rollback(bucket: Bucket, vb: int, to_seq: int, asked: int) -> int | None:
    """Take a replica partition back to the newest snapshot boundary at or below
    `to_seq` that its undo reaches (formats/cluster.md §5: inside a deduplicated
    snapshot a seq is not a state the source had); returns that boundary, `to_seq`
    itself when the stream chose one the undo reaches, else a lower one (the stream
    must restart from it). None when no boundary serves: the partition was emptied
    and must stream from 0. `asked` is the server's rollback seq: the discarded
    versions above it go to `lost_writes`; those at or below it are the source's too
    and come back on the stream."""
    part = bucket.fed_partition(vb)
    await bucket.flush()
    reachable = [b for b in part.boundaries() if b <= to_seq]
    target = reachable[-1] if reachable else None
    if target is not None and target == part.persisted_seq == part.high_seq:
        part.markers.clear()  # nothing to undo: the stream restarts from here
        part.broken.clear()
        return target
    seq = 0 if target is None else target
    part.high_seq = part.persisted_seq = part.snap_start = part.snap_end = seq
    part.markers.clear()
    part.broken.clear()
    part.failover = part.failover.prune_above(seq)
    if not part.failover.entries:
        part.failover = FailoverLog.initial()
    rec = part.record()
    if target is not None:
        part.bounds = sorted({b for b in part.bounds if b < seq} | {seq})
        undo = functools.partial(bucket.storage.rollback_replica, lost_above=asked)
        lost = await bucket.flusher.call(undo, vb, seq, rec)
    else:
        part.undo_floor, part.bounds = 0, []
        reset = functools.partial(bucket.storage.reset_partition, lost_above=asked)
        lost = await bucket.flusher.call(reset, rec)
    log.warning("bucket %s: replica partition %d rolled back to %d (asked %d; %s, %d "
                "versions undone, those above %d kept in lost_writes)", bucket.name, vb, seq,
                asked, "undo" if target is not None else "reset: no snapshot boundary "
                "the undo reaches", lost, asked)  # fmt: skip
    return target
