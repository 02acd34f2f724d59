"""Stream partitions of a bucket into segment files (the data path of `upr backup`).

Theory of operation (docs/design.md "3. Backup"). One `DcpConsumer` streams every
partition over one connection, finite to the high seqnos pinned at start; `drive` feeds
it to a `BackupStream` (a `Sink`). Each partition's records go to its own
`SegmentWriter`; compression and file writes run on one `Worker` thread, in arrival
order, so the event loop (and the network) never waits on zstd: the reader task keeps
filling the flow-control window meanwhile. Memory is bounded in bytes by the command's
`--memory-limit` (docs/design.md "Performance"), shared out by `budget`: the
flow-control window (which also bounds what the consumer has queued), the batches sent
to the worker and not yet written (`MAX_INFLIGHT` of them, and a share in bytes), and
the records held across open segments (raw, or compressed blocks not yet on disk; when
exceeded, the largest are spilled to their body files), plus one shared zstd context.
Segments become durable together (parallel fsyncs, one directory fsync) when every
stream has ended. Every file, the cut-back directories too, is written through the
repository's storage (`storage`; docs/design.md "Storage").

A ROLLBACK met when a stream opens is recorded and the partition continues from the
rollback seq on the new branch (never mixing branches: the segment's failover log is the
one the accepted stream returned). A ROLLBACK met later in the run (the partition's
active failed over and the consumer reopened it on the promoted replica) cuts the open
segment back to the rollback seq, moving what it took back into a cut-back segment (kept
as lost writes, formats/repository.md §5.6), and the partition goes on from there on the
new branch; when the seq is below where this run began, the partition starts again from
it like a first open. Either way the run completes with each partition as its current
active holds it, and the rollback is reported (`cut_back` and `cuts`, or the manifest's
rollback record). Positions the caller passes in say where each partition's previous
backup ended.

Xattrs: the consumer asks for them (HELLO XATTR, DCP IncludeXattrs and
IncludeDeletedUserXattrs where the server grants them) and hands each record out with
its blob split off (`DcpRecord.xattrs`); the segment writer stores the blob in its
block's xattrs column (formats/segment.md "Xattrs"), tombstones' included.

Collections: records keep their collection id into the segments, and a collection or
scope created or dropped (a `ManifestChange`, a DCP system event) is stored in its
partition's segment at its seq, among the records (formats/segment.md "System
events"); each segment then says which changes it holds and how many records of each
collection, which is what the manifest records (formats/repository.md §5.9). A
`collections` filter streams only those collections, on the server side; an incremental
backup also says which ids its chain followed, so that the drop of one that is gone
still reaches its segments.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from upr_cli.collections import ManifestChange
from upr_cli.collections import Path as CollectionPath
from upr_cli.dcp.consumer import DcpConsumer, WireCompression
from upr_cli.dcp.events import Event, Rollback, Snapshot, StreamEnded, StreamOpened
from upr_cli.dcp.sink import drive
from upr_cli.errors import UprError
from upr_cli.failover import FailoverLog
from upr_cli.jobs.worker import Worker
from upr_cli.memory import ByteWindow, MemoryLimit
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import R_BY_SEQNO, R_KEY, R_VALUE, R_VBUCKET, R_XATTRS, DcpRecord
from upr_cli.protocol.messages import STREAM_FOREVER
from upr_cli.segments import SegmentHeader, SegmentInfo, SegmentWriter
from upr_cli.segments.format import event_record
from upr_cli.segments.writer import new_compressor
from upr_cli.storage import LOCAL, Storage

MAX_INFLIGHT = 4  # batches queued on the segment worker before the stream waits
DEFAULT_MEMORY = MemoryLimit()  # --memory-limit's default


@dataclass(frozen=True)
class Budget:
    """A backup's buffers, in bytes: the flow-control window, the batches queued on the
    segment worker, the records held across open segments."""

    window: int
    queued: int
    held: int


def budget(memory: MemoryLimit) -> Budget:
    """`memory` shared out; with the default 192 MB, the window (8 MB) and the held
    records (64 MB) are what they were before the limit existed."""
    return Budget(window=memory.share(1 / 24), queued=memory.share(1 / 8),
                  held=memory.share(1 / 3))  # fmt: skip


class BackupInterrupted(UprError):
    """The run cannot finish consistently (a rollback in mid-stream, a stream refused)."""


@dataclass
class PartitionResult:
    """What one partition's stream produced in this run."""

    partition: int
    failover_log: FailoverLog
    start_seq: int  # where this run's records begin (exclusive)
    end_seq: int  # the end of the range covered (inclusive)
    snapshot: tuple[int, int]  # the last snapshot marker received
    segment: SegmentInfo | None  # None when the partition had nothing new
    # (from, to, asked) when the source rolled us back: `asked` its ROLLBACK seq, `to` the
    # snapshot boundary at or below it where the stream went on
    rollback: tuple[int, int, int] | None = None
    items: int = 0
    # (from, to, asked): a rollback above start_seq mid-run, as `rollback`
    cut_back: tuple[int, int, int] | None = None
    cuts: list[tuple[int, int, SegmentInfo]] = field(default_factory=list)  # see _Open.cuts

    @property
    def position(self) -> StreamPosition:
        """Where the next run resumes."""
        uuid = self.failover_log.latest.uuid if self.failover_log.entries else 0
        return StreamPosition(self.partition, uuid, self.end_seq, *self.snapshot)


@dataclass
class StreamStats:
    """Running totals for progress displays."""

    items: int = 0
    bytes_in: int = 0
    partitions_done: int = 0
    partitions: int = 0
    rollbacks: int = 0
    started: float = field(default_factory=time.monotonic)
    # the seqs the plan covers (each partition's end seq less its start), and how many of
    # them the stream has passed: a bar and an ETA by seqs hold under deduplication,
    # where one version of a key stands for every seq it replaced
    items_total: int = 0
    seqs_done: int = 0


@dataclass
class _Open:
    partition: int
    writer: SegmentWriter | None
    log: FailoverLog
    start: int
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    rollback: tuple[int, int, int] | None = None  # (from, to, asked), as in PartitionResult
    cut_back: tuple[int, int, int] | None = None  # (from, to, asked): a rollback above `start`
    # records mid-run rollbacks took back, kept as lost writes: (from, to, cut-K segment)
    cuts: list[tuple[int, int, SegmentInfo]] = field(default_factory=list)


async def stream_to_segments(
    uri: SourceUri,
    directory: Path,
    *,
    bucket: str,
    positions: dict[int, StreamPosition],
    failover_logs: dict[int, FailoverLog] | None = None,
    partitions: list[int] | None = None,
    segment_name: Callable[[int, int, int], str],
    block_size: int = 1 << 20,
    memory: MemoryLimit = DEFAULT_MEMORY,
    on_progress: Callable[[StreamStats], None] | None = None,
    end_seqs: dict[int, int] | None = None,
    cuts: dict[int, list[tuple[int, int, SegmentInfo]]] | None = None,
    boundaries: dict[int, list[int]] | None = None,
    collections: list[CollectionPath] | None = None,
    followed_ids: dict[int, set[int]] | None = None,
    compression: WireCompression = "auto",
    wait: float = 120.0,
    on_notice: Callable[[str], None] | None = None,
    storage: Storage = LOCAL,
) -> dict[int, PartitionResult]:
    """Stream each partition from its position to the pinned high seqno into a segment.

    `collections` streams only those scopes and collections (a server-side filter);
    None streams every collection. `followed_ids` are, per partition, the collection ids
    the chain's filter followed up to its position: the drops of those the source no
    longer has are streamed too (docs/protocol.md §12.4, "Resuming a filter across
    drops"), where a path of the filter may be gone for good.

    `compression` is the links' Snappy (`--wire-compression`, formats/wire.md "Snappy"):
    values are stored inflated whatever travelled, so the segments' ratio is zstd's.

    `end_seqs` pins the ends instead (a distributed backup pins them once, on the driver,
    so every task stops at the seqs a local run would).

    `wait` is how long a lost node is reconnected (or, in a cluster, a partition waits
    for an active node) before the run fails; `math.inf` waits for ever, and `on_notice`
    hears when a link is lost and when it is back. After a reconnect each end is capped
    at what the node holds then, so a node restarted from a crash ends the run at its new
    branch's high seq, the rollback handled as after a failover (docs/protocol.md §4.5).

    `cuts` are cut-back segments an interrupted run left (each partition's list goes on).
    `boundaries` are the chain's snapshot boundaries per partition, where a rollback in
    mid-run may land (docs/design.md, "Snapshot boundaries").

    `segment_name(partition, first_seq, last_seq)` names each file inside `directory` once
    its records are known (formats/repository.md names segments by their first and last
    record seq).

    `memory` is the budget for the run's buffers (`--memory-limit`), shared by `budget`.

    `storage` is the repository's, which every segment file is written through.
    """
    shares = budget(memory)
    consumer = DcpConsumer(uri, partitions=partitions, positions=positions,
                           failover_logs=failover_logs, boundaries=boundaries,
                           until_end=True, end_seqs=end_seqs,
                           buffer_size=shares.window, name="upr-backup",
                           collections=collections or None,
                           followed_ids=followed_ids, compression=compression, follow_for=wait,
                           on_notice=on_notice)  # fmt: skip
    async with Worker("segments", max_queued=MAX_INFLIGHT) as worker:
        stream = BackupStream(
            consumer, worker, directory, bucket=bucket, segment_name=segment_name,
            block_size=block_size, memory_budget=shares.held, on_progress=on_progress,
            cuts=cuts, queued_bytes=shares.queued, storage=storage,
        )  # fmt: skip
        try:
            await consumer.open()
            stream.stats.partitions = len(consumer.parts)
            stream.plan()
            if on_progress is not None:
                on_progress(stream.stats)  # the total shows before the first batch
            await drive(consumer, stream)
            return await stream.finish()
        except BaseException:
            await stream.abort()
            raise
        finally:
            await consumer.aclose()


def _planned(consumer: DcpConsumer) -> dict[int, tuple[int, int]]:
    """Each partition's (start seq, pinned end seq) (a partition waiting for an active
    node has no end yet and is left out)."""
    return {
        p: (part.seq, part.end)
        for p, part in consumer.parts.items()
        if part.end != STREAM_FOREVER and part.end > part.seq
    }


class BackupStream:
    """A `Sink` writing each partition's records into its own segment, on the worker."""

    def __init__(
        self,
        consumer: DcpConsumer,
        worker: Worker,
        directory: Path,
        *,
        bucket: str,
        segment_name: Callable[[int, int, int], str],
        block_size: int = 1 << 20,
        memory_budget: int = 64 * 1024 * 1024,
        on_progress: Callable[[StreamStats], None] | None = None,
        cuts: dict[int, list[tuple[int, int, SegmentInfo]]] | None = None,
        queued_bytes: int = 24 * 1024 * 1024,
        storage: Storage = LOCAL,
    ) -> None:
        self.consumer = consumer
        self.worker = worker
        self.directory = directory
        self.storage = storage  # the repository's: every segment file goes through it
        self.bucket = bucket
        self.segment_name = segment_name
        self.block_size = block_size
        self.memory_budget = memory_budget
        self.on_progress = on_progress
        self._span: dict[int, tuple[int, int]] = {}  # partition: (start, end) planned
        self.stats = StreamStats()
        self._cuts = cuts or {}
        self._zstd = new_compressor()  # shared: every writer runs on the one worker thread
        self._opened: dict[int, _Open] = {}
        self._finishing: dict[int, asyncio.Future[PartitionResult]] = {}
        self._pending: dict[int, list[DcpRecord]] = {}  # records not yet sent to the worker
        self._pending_bytes = 0
        # the batches on the worker, and their bytes: a batch larger than the whole share
        # goes alone (the records of a document larger than it are never refused)
        self._queued_bytes = ByteWindow(queued_bytes)
        self._queued: deque[tuple[asyncio.Future[None], int]] = deque()
        self._rolled: dict[int, tuple[int, int, int]] = {}  # rollbacks met while opening
        self._last: dict[int, int] = {}  # per partition, the seq of the last record taken
        self._held = [0]  # bytes buffered across writers (worker side), kept incrementally
        now = time.time()
        self._created = (
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1e6) % 10**6:06d}Z"
        )
        self._source = consumer.uri.redacted()

    # -- the Sink ---------------------------------------------------------------------

    def plan(self) -> None:
        """Note each partition's planned seq range once the consumer is open (progress)."""
        self._span = _planned(self.consumer)
        self.stats.items_total = sum(end - start for start, end in self._span.values())

    async def records(self, records: list[DcpRecord]) -> None:
        """Take each record above the partition's last one (a reconnect or a move sends
        some again), to be sent to the worker at the batch's end."""
        last, pending, span = self._last, self._pending, self._span
        n = nbytes = seqs = 0
        for item in records:  # fields by index: a read by name costs a call
            vb, seq = item[R_VBUCKET], item[R_BY_SEQNO]
            before = last.get(vb, -1)
            if seq <= before:
                continue  # sent again after a reconnect or a move: already held
            last[vb] = seq
            rows = pending.get(vb)
            if rows is None:
                rows = pending[vb] = []
            rows.append(item)
            n += 1
            nbytes += 55 + len(item[R_KEY]) + len(item[R_VALUE]) + len(item[R_XATTRS])
            seqs += seq - (before if before >= 0 else span.get(vb, (seq - 1, 0))[0])
        self.stats.items += n
        self.stats.bytes_in += nbytes
        self._pending_bytes += nbytes
        self.stats.seqs_done += seqs

    async def event(self, event: Event) -> None:
        """Follow a stream's life: opened, snapshot markers, rollbacks, collection
        changes, its end."""
        if isinstance(event, ManifestChange):
            await self.records([event_record(event)])  # its seq among the records
        elif isinstance(event, Snapshot):
            st = self._opened.get(event.partition)
            if st is not None:
                st.snapshots.append((event.start, event.end))
        elif isinstance(event, StreamOpened):
            self._stream_opened(event)
        elif isinstance(event, Rollback):
            self.stats.rollbacks += 1
            await self._flush()  # records above the cut go with it, on the worker
            await self._rollback(event)
        elif isinstance(event, StreamEnded):
            await self._stream_ended(event)

    async def batch_done(self) -> bool:
        """Send the batch's records to the worker; the consumer may resume after them."""
        await self._flush()
        self.consumer.commit()
        if self.on_progress is not None:
            self.on_progress(self.stats)
        return False

    # -- after the streams ------------------------------------------------------------

    async def finish(self) -> dict[int, PartitionResult]:
        """Every partition's result, its segment durable (not yet committed)."""
        await self.worker.drain()
        unfinished = sorted(set(self.consumer.parts) - set(self._finishing))
        if unfinished:  # never commit a backup missing a partition it was asked for
            raise BackupInterrupted(
                f"partitions {unfinished[:8]}: the streams stopped without ending; run it again"
            )
        results = {p: fut.result() for p, fut in self._finishing.items()}
        # durable together (parallel fsyncs, one directory fsync), before the caller commits
        paths = [Path(r.segment.path) for r in results.values() if r.segment is not None]
        await asyncio.get_running_loop().run_in_executor(None, self.storage.sync_all, paths)
        return results

    async def abort(self) -> None:
        """Drop every open segment, on the worker after the jobs queued before (they may
        open writers)."""
        await self.worker.run(self._abort_all)

    # -- steps --------------------------------------------------------------------------

    def _stream_opened(self, ev: StreamOpened) -> None:
        p = ev.partition
        log_ = FailoverLog.sanitised(ev.failover_log)
        st = self._opened.get(p)
        if st is None:
            self._opened[p] = _Open(p, None, log_, ev.position.seq,
                                    rollback=self._rolled.pop(p, None),
                                    cuts=list(self._cuts.get(p, [])))  # fmt: skip
            return
        # reopened (a reconnect, or moved to a new active node): the same history goes
        # on, into the same segment; a snapshot the old stream was cut off in is not one
        # the segment holds whole, so its end is no boundary (formats/repository.md §8.4)
        st.log = log_
        at = ev.position.seq
        st.snapshots = [(a, b) for a, b in st.snapshots if b <= at]

    async def _stream_ended(self, ev: StreamEnded) -> None:
        if not self.consumer.parts[ev.partition].done:
            return  # the consumer reopens it (state changed, moved)
        await self._flush()
        st = self._opened.get(ev.partition)
        if st is None:  # ended unopened: its filter follows nothing, no drop is owed
            st = self._opened[ev.partition] = _Open(
                ev.partition, None, self.consumer.parts[ev.partition].log, ev.position.seq,
                rollback=self._rolled.pop(ev.partition, None),
                cuts=list(self._cuts.get(ev.partition, [])),
            )  # fmt: skip
        job = functools.partial(_finish, st, ev, self.directory, self.segment_name,
                                self._held)  # fmt: skip
        # counted once queued: a run interrupted while the worker is busy still writes it
        self.stats.partitions_done += 1
        start, end = self._span.get(ev.partition, (0, 0))
        self.stats.seqs_done += max(0, end - max(self._last.get(ev.partition, -1), start))
        self._finishing[ev.partition] = await self.worker.submit(job)

    async def _flush(self) -> None:
        """Send the records taken so far to the worker (FIFO: per-partition order holds)."""
        if not self._pending:
            return
        work = [(self._opened[p], rows) for p, rows in self._pending.items()]
        nbytes, self._pending, self._pending_bytes = self._pending_bytes, {}, 0
        window, queued = self._queued_bytes, self._queued
        while not window.take(nbytes):  # full: wait for the oldest batch to be written
            fut, n = queued.popleft()
            await asyncio.wait([fut])
            await window.release(n)
        while queued and queued[0][0].done():
            await window.release(queued.popleft()[1])
        fut = await self.worker.submit(functools.partial(self._add_all, work))
        queued.append((fut, nbytes))

    async def _rollback(self, rb: Rollback) -> None:
        """Keep nothing above the rollback's boundary r (the consumer's `to_seq`, at or
        below the source's ROLLBACK seq: docs/design.md, "Snapshot boundaries"); the
        stream goes on from r.

        At the first open the partition simply starts at r. Later in the run (its active
        failed over, the new one's history branches below what was streamed) the open
        segment is cut back to r on the worker (queued after every record already sent
        there), the records above the asked seq moving to a cut-back segment (those
        between r and it come again); when r is below where this run began, all of the
        run's records go and the partition starts again at r like a first open.
        """
        p, r = rb.partition, rb.to_seq
        st = self._opened.get(p)
        self._last[p] = r
        if st is None:
            self._rolled[p] = (rb.previous.seq, r, rb.asked)
            return
        cut = functools.partial(_cut, st, rb.previous.seq, r, rb.asked, self._held,
                                self._open_cut, self.segment_name)  # fmt: skip
        if r >= st.start:
            st.snapshots = [(a, min(b, r)) for a, b in st.snapshots if a <= r]
            was = st.cut_back or (rb.previous.seq, r, rb.asked)  # a second cut: the widest
            st.cut_back = (max(was[0], rb.previous.seq), min(was[1], r), min(was[2], rb.asked))
            await self.worker.submit(cut)
        else:
            origin = st.rollback[0] if st.rollback is not None else st.start
            self._opened[p] = _Open(p, None, st.log, r, rollback=(origin, r, rb.asked),
                                    cuts=st.cuts)  # fmt: skip
            await self.worker.submit(cut)
            await self.worker.submit(functools.partial(_abandon, st, self._held))

    # -- on the worker --------------------------------------------------------------------

    def _open_writer(self, st: _Open) -> SegmentWriter:
        p = st.partition
        header = SegmentHeader(self.bucket, p, st.log, st.start,
                               max(st.start, self.consumer.highs.get(p, 0)), (), self._created,
                               self._source, self.block_size)  # fmt: skip
        return SegmentWriter(self.directory / f"p{p:04x}.open", header, storage=self.storage,
                             compressor=self._zstd)  # fmt: skip

    def _open_cut(self, p: int, log: FailoverLog, r: int, k: int) -> SegmentWriter:
        """The K-th cut-back segment of p: what a mid-run rollback to r took back."""
        header = SegmentHeader(self.bucket, p, log, r, r, (), self._created, self._source,
                               self.block_size)  # fmt: skip
        return SegmentWriter(self.directory / f"p{p:04x}.cut-{k}", header,
                             storage=self.storage, compressor=self._zstd)  # fmt: skip

    def _add_all(self, work: list[tuple[_Open, list[DcpRecord]]]) -> None:
        """Append records, then keep the bytes buffered within the memory budget (the
        largest writers spill to their body files)."""
        held = self._held
        for st, rows in work:
            if st.writer is None:
                st.writer = self._open_writer(st)
            before = st.writer.buffered
            st.writer.add(rows)
            held[0] += st.writer.buffered - before
        if held[0] > self.memory_budget:
            # list(): one step under the GIL, while the loop may add a partition
            opened = list(self._opened.values())
            # a partition whose stream ended keeps its finished writer: not one to spill
            writers = [st.writer for st in opened if st.writer is not None and not st.writer.done]
            for w in sorted(writers, key=lambda w: w.buffered, reverse=True):
                if held[0] <= self.memory_budget // 2:
                    break
                held[0] -= w.buffered
                w.spill()

    def _abort_all(self) -> None:
        for st in self._opened.values():
            if st.writer is not None:
                st.writer.abort()


def _abandon(st: _Open, held: list[int]) -> None:
    """On the worker: drop a partition's open segment (a rollback below the run's start;
    `_cut` has already moved its records to a cut-back segment)."""
    if st.writer is not None:
        held[0] -= st.writer.buffered
        st.writer.abort()


def _cut(
    st: _Open,
    from_seq: int,
    r: int,
    asked: int,
    held: list[int],
    open_cut: Callable[[int, FailoverLog, int, int], SegmentWriter],
    name: Callable[[int, int, int], str],
) -> None:
    """On the worker: cut the partition's open segment back to the boundary r. Its
    records above the source's rollback seq `asked` move into a cut-back segment
    (`cut-K/`, formats/repository.md §5.6), where they stay as lost writes: the backup
    saw them, the history that continued does not have them. Those in (r, asked] are
    dropped: the source has them and streams them again from r."""
    w = st.writer
    if w is None or w.last_seq <= r:
        return
    asked = max(r, asked)
    before = w.buffered
    if w.last_seq <= asked:
        w.truncate(r)
        held[0] += w.buffered - before
        return
    k = len(st.cuts) + 1
    into = open_cut(st.partition, w.header.failover_log, asked, k)
    try:
        w.truncate(asked, into)
        if r < asked:
            w.truncate(r)
        held[0] += w.buffered - before
        cut_dir = w.path.parent / f"cut-{k}"
        into.storage.make_dirs(cut_dir)  # its parent, the backup's directory, is there
        path = cut_dir / name(st.partition, into.first_seq, into.last_seq)
        info = into.finish(end_seq=into.last_seq, sync=False, path=path)
    except BaseException:
        into.abort()
        raise
    st.cuts.append((max(from_seq, info.last_seq), asked, info))


def _finish(
    st: _Open,
    ended: StreamEnded,
    directory: Path,
    name: Callable[[int, int, int], str],
    held: list[int],
) -> PartitionResult:
    """On the worker: finish the partition's segment; what the manifest will record."""
    pos = ended.position
    end = max(pos.seq, st.start)
    info = None
    if st.writer is not None and not st.writer.first_seq:  # a cut took every record back
        held[0] -= st.writer.buffered
        st.writer.abort()
    elif st.writer is not None:
        w = st.writer
        held[0] -= w.buffered
        info = w.finish(end_seq=max(end, w.last_seq), snapshots=tuple(st.snapshots), sync=False,
                        path=directory / name(st.partition, w.first_seq, w.last_seq),
                        failover_log=st.log)  # fmt: skip
        end = info.end_seq
    return PartitionResult(ended.partition, st.log, st.start, end, (pos.snap_start, pos.snap_end),
                           info, st.rollback, info.records if info else 0, st.cut_back,
                           list(st.cuts))  # fmt: skip
