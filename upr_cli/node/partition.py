"""A partition (vbucket) of the node: state, failover log, seqnos and its write queue.

Write queue (the UPR design specification, "How KV mutations flow into ep-engine and
write queue"): the partition's unpersisted items, **one per key**, in seq order. An
update replaces the key's older entry (deduplication). Invariant kept by the bucket: the
queue holds exactly the latest version of every key written above `persisted_seq`;
everything at or below it is on disk. Streams read the queue concurrently through
`items_after`.

Every queue of a bucket counts the bytes it holds (key + value of each queued version,
plus ITEM_OVERHEAD for the objects that hold it) into one `QueueBytes`, shared by the
bucket's partitions: the bucket bounds it with its share of `--memory-limit`
(docs/protocol.md §11, "A full write queue").
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


# what a queued version costs beyond its key and value: the DocRow, its dict entries and
# its seq (measured about 300 bytes), so a million small documents count what they hold
ITEM_OVERHEAD = 300


class QueueBytes:
    """The bytes (key + value) a bucket's write queues hold, together."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


class WriteQueue:
    """Unpersisted items of one partition: one per key, iterable by seq."""

    __slots__ = ("_by_key", "_by_seq", "_seqs", "_start", "held")

    def __init__(self, held: QueueBytes | None = None) -> None:
        self._by_key: dict[bytes, DocRow] = {}
        self._by_seq: dict[int, DocRow] = {}  # insertion order == seq order
        self._seqs: list[int] = []  # every seq ever queued, ascending; stale ones skipped
        self._start = 0
        self.held = QueueBytes() if held is None else held  # shared by the bucket's queues

    def __len__(self) -> int:
        return len(self._by_seq)

    def put(self, doc: DocRow) -> None:
        """Queue a new version; it replaces the key's older unpersisted version."""
        old = self._by_key.get(doc.key)
        held = self.held
        if old is not None:
            del self._by_seq[old.seq]
            held.bytes -= len(old.key) + len(old.value) + ITEM_OVERHEAD
        held.bytes += len(doc.key) + len(doc.value) + ITEM_OVERHEAD
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
        by_seq, by_key = self._by_seq, self._by_key
        gone = 0
        for d in docs:
            if by_seq.get(d.seq) is d:  # then it is its key's entry too
                del by_seq[d.seq]
                del by_key[d.key]
                gone += len(d.key) + len(d.value) + ITEM_OVERHEAD
        self.held.bytes -= gone
        seqs = self._seqs
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
    written: int = field(default=0, compare=False)  # versions appended (serve's metrics)
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
    # the failover log's pairs as last built (a flush records every partition it writes)
    _pairs: tuple[FailoverLog | None, tuple[tuple[int, int], ...]] = field(
        default=(None, ()), repr=False, compare=False
    )

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
        return self.record_at(self.persisted_seq, self.snap_start, self.snap_end)

    def record_at(self, high_seq: int, snap_start: int, snap_end: int) -> PartitionRecord:
        """The persistent record once persisted up to `high_seq`."""
        log, pairs = self._pairs
        if log is not self.failover:  # a FailoverLog is immutable: its pairs are too
            pairs = self.failover.pairs()
            self._pairs = (self.failover, pairs)
        return PartitionRecord(self.vbucket, self.state, pairs, high_seq, self.purge_seq,
                               snap_start, snap_end)  # fmt: skip

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
        self.written += 1
        self.queue.put(doc)
        self.notify()

    def notify(self) -> None:
        """Wake every stream waiting for news of this partition."""
        if not self._waiters:
            return
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
