"""A partition (vbucket) of the node: state, failover log, seqnos and its write queue.

Write queue (the UPR design specification, "How KV mutations flow into ep-engine and
write queue"): the partition's unpersisted items, **one per key**, in seq order. An
update replaces the key's older entry (deduplication). Invariant kept by the bucket: the
queue holds exactly the latest version of every key written above `persisted_seq`;
everything at or below it is on disk. Streams read the queue concurrently through
`items_after`.
"""

from __future__ import annotations

import asyncio
import contextlib
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

from upr_cli.failover import FailoverLog
from upr_cli.node.storage import DocRow, PartitionRecord

ACTIVE, REPLICA, PENDING, DEAD = "active", "replica", "pending", "dead"
STATE_CODES = {ACTIVE: 1, REPLICA: 2, PENDING: 3, DEAD: 4}  # docs/protocol.md §2.11


class Marker(NamedTuple):
    """A snapshot marker a replica received: its items [start, end] are one snapshot."""

    start: int
    end: int


class WriteQueue:
    """Unpersisted items of one partition: one per key, iterable by seq."""

    __slots__ = ("_by_key", "_by_seq", "_seqs", "_start")

    def __init__(self) -> None:
        self._by_key: dict[bytes, DocRow] = {}
        self._by_seq: dict[int, DocRow] = {}  # insertion order == seq order
        self._seqs: list[int] = []  # every seq ever queued, ascending; stale ones skipped
        self._start = 0

    def __len__(self) -> int:
        return len(self._by_seq)

    def put(self, doc: DocRow) -> None:
        """Queue a new version; it replaces the key's older unpersisted version."""
        old = self._by_key.get(doc.key)
        if old is not None:
            del self._by_seq[old.seq]
        self._by_key[doc.key] = doc
        self._by_seq[doc.seq] = doc
        self._seqs.append(doc.seq)

    def get(self, key: bytes) -> DocRow | None:
        """The key's unpersisted version, if any."""
        return self._by_key.get(key)

    def items_after(self, seq: int, limit: int) -> list[DocRow]:
        """Up to `limit` queued items with seq > `seq`, in seq order."""
        seqs, by_seq = self._seqs, self._by_seq
        i = bisect_right(seqs, seq, lo=self._start)
        out: list[DocRow] = []
        n = len(seqs)
        while i < n and len(out) < limit:
            doc = by_seq.get(seqs[i])
            if doc is not None:
                out.append(doc)
            i += 1
        return out

    def snapshot(self) -> list[DocRow]:
        """Every queued item in seq order (what a flush writes)."""
        return list(self._by_seq.values())

    def remove_flushed(self, docs: list[DocRow]) -> None:
        """Drop items now on disk, unless a newer version replaced them meanwhile."""
        for d in docs:
            if self._by_seq.get(d.seq) is d:
                del self._by_seq[d.seq]
            if self._by_key.get(d.key) is d:
                del self._by_key[d.key]
        seqs, by_seq = self._seqs, self._by_seq
        start = self._start
        while start < len(seqs) and seqs[start] not in by_seq:
            start += 1
        if start > 1024 and start * 2 > len(seqs):
            del seqs[:start]
            start = 0
        self._start = start


@dataclass(slots=True)
class Partition:
    """One vbucket: its persistent state plus the in-memory queue and stream waiters."""

    vbucket: int
    state: str
    failover: FailoverLog
    high_seq: int = 0  # highest seq assigned (in memory)
    persisted_seq: int = 0  # highest seq on disk
    purge_seq: int = 0
    snap_start: int = 0  # last complete snapshot on disk
    snap_end: int = 0
    queue: WriteQueue = field(default_factory=WriteQueue)
    # Replica side (formats/cluster.md §5): markers received and not yet persisted past,
    # the lowest seq the undo table can take the partition back to (None: no undo), the
    # persisted snapshot boundaries it can take it back to (ascending, none below the
    # floor), and the ends of received snapshots the write queue broke: a version at or
    # below one was replaced by a newer one above it before either was persisted, so the
    # state at that end never reaches the disk and no undo can restore it.
    markers: list[Marker] = field(default_factory=list)
    undo_floor: int | None = None
    bounds: list[int] = field(default_factory=list)
    broken: set[int] = field(default_factory=set)
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)

    @classmethod
    def from_record(cls, rec: PartitionRecord) -> Partition:
        """A partition restored from its persistent record (nothing unpersisted survives)."""
        return cls(
            vbucket=rec.vbucket,
            state=rec.state,
            failover=FailoverLog.sanitised(rec.failover_log),
            high_seq=rec.high_seq,
            persisted_seq=rec.high_seq,
            purge_seq=rec.purge_seq,
            snap_start=rec.snap_start,
            snap_end=rec.snap_end,
        )

    def record(self) -> PartitionRecord:
        """The persistent record as of the last flush."""
        return PartitionRecord(
            vbucket=self.vbucket,
            state=self.state,
            failover_log=self.failover.pairs(),
            high_seq=self.persisted_seq,
            purge_seq=self.purge_seq,
            snap_start=self.snap_start,
            snap_end=self.snap_end,
        )

    @property
    def complete_seq(self) -> int:
        """The end of the last complete snapshot persisted (docs/protocol.md §4.3): `snap_end` when
        everything up to it is on disk, else `snap_start` (a replica mid-snapshot)."""
        return self.snap_end if self.persisted_seq == self.snap_end else self.snap_start

    def replaced(self, old_seq: int, new_seq: int) -> None:
        """A replica's queued version at `old_seq` gives way to one at `new_seq`: the ends
        of the snapshots between them are not states the disk will ever hold."""
        # markers are in seq order: only those ending in [old_seq, new_seq) are looked at
        markers = self.markers
        i = bisect_left(markers, old_seq, key=_end_of)
        while i < len(markers) and markers[i].end < new_seq:
            self.broken.add(markers[i].end)
            i += 1

    def boundaries(self) -> list[int]:
        """Snapshot boundaries a replica rollback can take this partition back to now
        (ascending): the persisted ones, the ends of snapshots received whole since (a
        flush persists the state at each, unless the queue broke it), the state
        persisted when whole, and 0 while the undo reaches back to the empty partition."""
        floor = self.undo_floor
        if floor is None:
            return []
        out = set(self.bounds)
        if floor == 0:
            out.add(0)
        if self.persisted_seq == self.snap_end:
            out.add(self.persisted_seq)
        low, high = self.persisted_seq, self.high_seq
        out.update(m.end for m in self.markers if low < m.end <= high and m.end not in self.broken)
        return sorted(out)

    @property
    def uuid(self) -> int:
        """The current branch's uuid."""
        return self.failover.latest.uuid

    def get(self, key: bytes) -> DocRow | None:
        """The key's unpersisted version (the caller falls back to disk)."""
        return self.queue.get(key)

    def append(self, doc: DocRow) -> None:
        """Take a new version (its seq is `high_seq + 1`) and wake the streams."""
        self.high_seq = doc.seq
        self.queue.put(doc)
        self.notify()

    def notify(self) -> None:
        """Wake every stream waiting for news of this partition."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_change(self, timeout: float | None = None) -> None:
        """Wait until a write, a flush or a state change happens (or `timeout`)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):  # not wait_for: it can lose a cancel (net/aio.py)
                await fut


_end_of = attrgetter("end")
