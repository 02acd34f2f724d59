"""Stream partitions of a bucket into segment files (the data path of `upr backup`).

Theory of operation (DESIGN data flow 3). One `DcpConsumer` streams every partition over
one connection, finite to the high seqnos pinned at start. Each partition's records go
to its own `SegmentWriter`; compression and file writes run on one worker thread, in
arrival order, so the event loop (and the network) never waits on zstd: the reader task
keeps filling the flow-control window meanwhile. Memory is bounded by configuration:
the flow-control window, plus `memory_budget` of records held across open segments (raw,
or compressed blocks not yet on disk; when exceeded, the largest are spilled to their
body files), plus one shared zstd context. Segments become durable together
(parallel fsyncs, one directory fsync) when every stream has ended.

A ROLLBACK met when a stream opens is recorded and the partition continues from the
rollback seq on the new branch (never mixing branches: the segment's failover log is the
one the accepted stream returned). A ROLLBACK met later in the run (the partition's
active failed over and the consumer reopened it on the promoted replica) cuts the open
segment back to the rollback seq, moving what it took back into a cut-back segment (kept
as lost writes, formats/repository.md §5.6), and the partition goes on from there on the
new branch; when the seq is below where this run began, the partition starts again from
it like a first open. Either way the run completes with each partition as its current
active holds it, and the rollback is reported (`cut_back` and `cuts`, or the manifest's
rollback record).
Positions the caller passes in say where each partition's
previous backup ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Rollback, Snapshot, StreamEnded, StreamOpened
from upr_cli.dcp.position import StreamPosition
from upr_cli.errors import UprError
from upr_cli.failover import FailoverLog
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.segments import SegmentHeader, SegmentInfo, SegmentWriter
from upr_cli.segments.writer import new_compressor, sync_files

MAX_INFLIGHT = 4  # batches queued on the segment worker before the stream waits


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
    buffer_size: int = 8 * 1024 * 1024,
    memory_budget: int = 64 * 1024 * 1024,
    on_progress: Callable[[StreamStats], None] | None = None,
    end_seqs: dict[int, int] | None = None,
    cuts: dict[int, list[tuple[int, int, SegmentInfo]]] | None = None,
    boundaries: dict[int, list[int]] | None = None,
) -> dict[int, PartitionResult]:
    """Stream each partition from its position to the pinned high seqno into a segment.

    `end_seqs` pins the ends instead (a distributed backup pins them once, on the driver,
    so every task stops at the seqs a local run would).

    `cuts` are cut-back segments an interrupted run left (each partition's list goes on).
    `boundaries` are the chain's snapshot boundaries per partition, where a rollback in
    mid-run may land (docs/design.md, "Snapshot boundaries").

    `segment_name(partition, first_seq, last_seq)` names each file inside `directory` once
    its records are known (formats/repository.md names segments by their first and last
    record seq).
    """
    consumer = DcpConsumer(uri, partitions=partitions, positions=positions,
                           failover_logs=failover_logs, boundaries=boundaries,
                           until_end=True, end_seqs=end_seqs,
                           buffer_size=buffer_size, name="upr-backup")  # fmt: skip
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segments")
    zstd = new_compressor()  # shared: every writer runs on the one worker thread
    stats = StreamStats()
    opened: dict[int, _Open] = {}
    finishing: dict[int, asyncio.Future[PartitionResult]] = {}
    pending: dict[int, list[tuple[Any, ...]]] = {}
    rolled: dict[int, tuple[int, int, int]] = {}  # rollbacks met while a stream opened
    last: dict[int, int] = {}  # per partition, the seq of the last row taken
    now = time.time()
    created = (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1e6) % 10**6:06d}Z"
    )
    source = uri.redacted()

    def open_writer(p: int, st: _Open) -> SegmentWriter:
        header = SegmentHeader(bucket, p, st.log, st.start, max(st.start, consumer.highs.get(p, 0)),
                               (), created, source, block_size)  # fmt: skip
        return SegmentWriter(directory / f"p{p:04x}.open", header, compressor=zstd)

    def open_cut(p: int, log: FailoverLog, r: int, k: int) -> SegmentWriter:
        """The K-th cut-back segment of p: what a mid-run rollback to r took back."""
        header = SegmentHeader(bucket, p, log, r, r, (), created, source, block_size)
        return SegmentWriter(directory / f"p{p:04x}.cut-{k}", header, compressor=zstd)

    held = [0]  # bytes buffered across writers, kept up to date incrementally

    def add_all(work: list[tuple[_Open, list[tuple[Any, ...]]]]) -> None:
        """On the worker: append rows, then keep buffered bytes within the budget."""
        for st, rows in work:
            if st.writer is None:
                st.writer = open_writer(st.partition, st)
            before = st.writer.buffered
            st.writer.add(rows)
            held[0] += st.writer.buffered - before
        if held[0] > memory_budget:
            writers = [st.writer for st in opened.values() if st.writer is not None]
            for w in sorted(writers, key=lambda w: w.buffered, reverse=True):
                if held[0] <= memory_budget // 2:
                    break
                held[0] -= w.buffered
                w.spill()

    inflight: deque[asyncio.Future[Any]] = deque()

    async def submit(fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Queue work on the worker (FIFO: per-partition order holds) without waiting for it,
        unless MAX_INFLIGHT batches are already queued (bounded memory)."""
        fut = loop.run_in_executor(pool, fn)
        inflight.append(fut)
        while len(inflight) > MAX_INFLIGHT or (inflight and inflight[0].done()):
            await inflight.popleft()  # re-raises a worker's failure
        return fut

    async def flush_rows() -> None:
        work = [(opened[p], rows) for p, rows in pending.items()]
        pending.clear()
        if work:
            await submit(lambda: add_all(work))

    async def rollback_open(rb: Rollback) -> None:
        """Keep nothing above the rollback's boundary r (the consumer's `to_seq`, at or
        below the source's ROLLBACK seq: docs/design.md, "Snapshot boundaries"); the
        stream goes on from r.

        At the first open the partition simply starts at r. Later in the run (its active
        failed over, the new one's history branches below what was streamed) the open
        segment is cut back to r on the worker (queued after every row already sent
        there), the records above the asked seq moving to a cut-back segment (those
        between r and it come again); when r is below where this run began, all of the
        run's records go and the partition starts again at r like a first open.
        """
        p, r = rb.partition, rb.to_seq
        st = opened.get(p)
        last[p] = r
        if st is None:
            rolled[p] = (rb.previous.seq, r, rb.asked)
            return
        cut = functools.partial(_cut, st, rb.previous.seq, r, rb.asked, held, open_cut,
                                segment_name)  # fmt: skip
        if r >= st.start:
            st.snapshots = [(a, min(b, r)) for a, b in st.snapshots if a <= r]
            was = st.cut_back or (rb.previous.seq, r, rb.asked)  # a second cut: the widest
            st.cut_back = (max(was[0], rb.previous.seq), min(was[1], r), min(was[2], rb.asked))
            await submit(cut)
        else:
            origin = st.rollback[0] if st.rollback is not None else st.start
            opened[p] = _Open(p, None, st.log, r, rollback=(origin, r, rb.asked), cuts=st.cuts)
            await submit(cut)
            await submit(functools.partial(_abandon, st, held))

    # Rows wait on the worker queue (up to MAX_INFLIGHT batches); they form no cycles, but
    # every gen-0 collection would walk them: measured 4x slower decoding. Collect rarely.
    gc_threshold = gc.get_threshold()
    gc.set_threshold(max(gc_threshold[0], 200_000), *gc_threshold[1:])
    try:
        await consumer.open()
        stats.partitions = len(consumer.parts)
        async for batch in consumer.batches():
            for item in batch:
                if type(item) is DcpRecord:
                    vb = item.vbucket
                    if item.by_seqno <= last.get(vb, -1):
                        continue  # sent again after a reconnect or a move: already held
                    last[vb] = item.by_seqno
                    pending.setdefault(vb, []).append(item)
                    stats.items += 1
                    stats.bytes_in += 55 + len(item.key) + len(item.value)
                elif isinstance(item, Rollback):
                    stats.rollbacks += 1
                    await flush_rows()  # rows above the cut go with it, on the worker
                    await rollback_open(item)
                elif isinstance(item, StreamOpened):
                    p = item.partition
                    log_ = FailoverLog.sanitised(item.failover_log)
                    if p in opened:  # reopened (a reconnect, or moved to a new active node)
                        st0 = opened[p]
                        st0.log = log_  # the same history goes on: same segment
                        # a snapshot the old stream was cut off in is not one the segment
                        # holds whole: its end is no boundary (formats/repository.md §8.4)
                        at = item.position.seq
                        st0.snapshots = [(a, b) for a, b in st0.snapshots if b <= at]
                    else:
                        opened[p] = _Open(p, None, log_, item.position.seq,
                                          rollback=rolled.pop(p, None),
                                          cuts=list((cuts or {}).get(p, [])))  # fmt: skip
                elif isinstance(item, Snapshot):
                    st1 = opened.get(item.partition)
                    if st1 is not None:
                        st1.snapshots.append((item.start, item.end))
                elif isinstance(item, StreamEnded):
                    if not consumer.parts[item.partition].done:
                        continue  # the consumer reopens it (state changed, moved)
                    await flush_rows()
                    job = functools.partial(_finish, opened[item.partition], item,
                                            directory, segment_name, held)  # fmt: skip
                    finishing[item.partition] = await submit(job)
                    stats.partitions_done += 1
            await flush_rows()
            consumer.commit()
            if on_progress is not None:
                on_progress(stats)
        while inflight:
            await inflight.popleft()
        unfinished = sorted(set(consumer.parts) - set(finishing))
        if unfinished:  # never commit a backup missing a partition it was asked for
            raise BackupInterrupted(
                f"partitions {unfinished[:8]}: the streams stopped without ending; run it again"
            )
        results = {p: fut.result() for p, fut in finishing.items()}
        # durable together, once, before the caller commits (STYLE 9)
        paths = [Path(r.segment.path) for r in results.values() if r.segment is not None]
        await loop.run_in_executor(None, sync_files, paths)
        return results
    except BaseException:
        for fut in inflight:
            with contextlib.suppress(BaseException):
                await fut
        for st in opened.values():
            if st.writer is not None:
                await loop.run_in_executor(pool, st.writer.abort)
        raise
    finally:
        gc.set_threshold(*gc_threshold)
        await consumer.aclose()
        pool.shutdown(wait=True)


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
        (w.path.parent / f"cut-{k}").mkdir(exist_ok=True)
        path = w.path.parent / f"cut-{k}" / name(st.partition, into.first_seq, into.last_seq)
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
