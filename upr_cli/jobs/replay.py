"""`upr replay`: keep a SQLite store in step with a source, as a UPR replica would.

Theory of operation (seed 000 "Client and Mutation Log", "How clients roll back changes
when seeing a new failover ID"; formats/store.md is the store's contract)
-----------------------------------------------------------------------------------
* **Positions live in the store.** A run streams every partition from the position the
  store saved with its documents, so a restart (or a SIGKILL at any point) resumes
  exactly there; rows at or below a saved seq are dropped (the consumer is
  at-least-once after a reconnect).
* **What commits when.** Rows wait in memory per partition until a *commit point*; the
  rows up to it and the position at it are applied in one store transaction (the
  changes of all partitions that reached a point in one batch share it). The point of a
  partition is, by mode:
  - default: the end of its last complete snapshot (a marker's end reached, the next
    marker, or the stream's end: dcp-wire §2.4);
  - `--durable-only`: that, capped at the seq the source reports persisted on the
    stream's branch (OBSERVE_SEQNO to each partition's active node, polled on other
    connections), so the store never holds a write a crash of the source can take back;
  - `--consistent` (a source with barrier cookies, formats/barrier.md): the barrier
    cut, for all partitions at once. The catch-up to the high seqnos pinned at the
    start (one GET_ALL_VB_SEQNOS, a consistent cut) is applied in ONE open store
    transaction (memory bounded by SQLite, not by the data) and committed when every
    partition reached its pinned seq; after that a barrier is sent every
    `barrier_interval` and each cut is committed as it comes back. Without barrier
    support the run commits per snapshot and says so once.
  A partition holding more than `max_pending` uncommitted rows (a snapshot that large:
  a disk backfill of a big partition) commits inside the snapshot, at its last row
  (a valid resume position, dcp-wire §4.4), so memory is bounded by configuration.
* **Rollbacks.** The consumer turns ROLLBACK(r) into a `Rollback` event (dcp-wire §4.4);
  the store undoes its changes above r from its mutation log, keeping the versions it
  takes back in `lost_writes` (for `upr salvage --store`). When r is below what the log
  reaches, the partition is reset and the run restarts its stream from 0. Every rollback
  is reported through `on_event`.
* The store runs on one worker thread, so the event loop (and the network) never waits
  on SQLite (DESIGN "Never stall the event loop"); at most two applies are in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import signal
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import BarrierReached, Rollback, Snapshot, StreamEnded, StreamOpened
from upr_cli.dcp.position import StreamPosition, boundary_at
from upr_cli.errors import UprError, UsageError
from upr_cli.failover import FailoverLog
from upr_cli.net.aio import cancel_and_wait
from upr_cli.net.router import Router
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import decode_message
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.protocol.messages import ObserveSeqno, ObserveSeqnoResponse
from upr_cli.store import DEFAULT_UNDO_WINDOW, Row, Store

_seq_of = itemgetter(2)
_COMMIT_ROWS = 32_768  # committable rows gathered before a transaction (amortises commits)
_COMMIT_SECONDS = 0.5  # ... or this long since the last one
_MAX_INFLIGHT = 2  # store transactions queued on the worker
_REPO_BATCH_ROWS = 131_072  # rows per transaction from a repository (best of 32k..1M)


_GC_YOUNG = 200_000  # allocations between young collections while rows are held


@contextlib.contextmanager
def rare_gc() -> Iterator[None]:
    """Collect garbage rarely: rows held for a batch form no cycles, but every young
    collection walks them (measured: 80k -> 130k items/s replaying from a node)."""
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], _GC_YOUNG), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


class ReplayError(UprError):
    """The replay cannot continue (refused stream, unusable source)."""


@dataclass
class ReplayStats:
    """Running totals, for progress displays and the summary."""

    source: str = ""
    store: str = ""
    mode: str = "snapshot"
    items: int = 0  # rows received
    applied: int = 0  # rows committed to the store
    commits: int = 0
    partitions: int = 0
    partitions_caught_up: int = 0
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    resets: int = 0
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """JSON form (STYLE 8: counts as numbers, no 64-bit values here)."""
        secs = self.seconds or (time.monotonic() - self.started)
        return {
            "source": self.source,
            "store": self.store,
            "mode": self.mode,
            "items": self.items,
            "applied": self.applied,
            "commits": self.commits,
            "partitions": self.partitions,
            "rollbacks": self.rollbacks,
            "resets": self.resets,
            "notes": self.notes,
            "interrupted": self.interrupted,
            "seconds": round(secs, 3),
            "items_per_s": round(self.applied / secs) if secs and self.applied else None,
        }


@dataclass(slots=True)
class _Part:
    """One partition's replay state."""

    p: int
    committed: StreamPosition  # durable in the store
    applied: StreamPosition  # written to the store, maybe in the open transaction
    uuid: int = 0
    rows: list[Row] = field(default_factory=list)  # received, uncommitted, seq increasing
    marks: list[tuple[int, int]] = field(default_factory=list)  # markers not yet passed
    complete: int = 0  # every snapshot up to this seq was received whole
    received: int = 0
    log: FailoverLog | None = None  # a failover log to save with the next commit
    branches: FailoverLog | None = None  # the stream's failover log (names each seq's branch)
    ended: bool = False

    def reset_to(self, pos: StreamPosition) -> None:
        """The stream (re)starts at `pos`: drop what it will send again. A new stream
        begins with a new snapshot marker, so older markers no longer describe it."""
        del self.rows[bisect_right(self.rows, pos.seq, key=_seq_of) :]
        self.uuid = pos.uuid
        # A reconnect restarts from the consumer's committed position, which may trail a
        # store write still in flight: rows up to what the store has are dropped again.
        self.received = max(pos.seq, self.applied.seq)
        self.complete = min(self.complete, pos.seq)
        # A stream restarting inside a snapshot leaves that snapshot unfinished: a cut at
        # or below `pos.seq` is inside it, never a boundary (docs/design.md).
        self.marks = [(pos.snap_start, pos.snap_end)] if pos.seq < pos.snap_end else []
        self.ended = False

    def take(self, upto: int) -> tuple[list[Row], StreamPosition] | None:
        """Rows ≤ `upto` and the position there; None when nothing would change."""
        upto = min(upto, max(self.complete, self.received))
        if upto < self.applied.seq or (upto == self.applied.seq and self.log is None):
            return None
        n = bisect_right(self.rows, upto, key=_seq_of)
        rows, self.rows = self.rows[:n], self.rows[n:]
        start, end = upto, upto
        for ms, me in self.marks:
            if ms <= upto:
                start, end = ms, me
        if end < upto:  # the marker holding upto ended at or below it
            start = end = upto
        # the newest marker stays: a later cut inside its snapshot must still see it
        self.marks = [m for m in self.marks if m[1] > upto] or self.marks[-1:]
        # The branch holding `upto`: after a rollback the stream goes on under the newest
        # entry, and a position must name it, or a resume would be rolled back again.
        entry = self.branches.entry_at(upto) if self.branches is not None else None
        uuid = entry.uuid if entry is not None else self.uuid
        return rows, StreamPosition(self.p, uuid, upto, start, end)


class _Durability:
    """`--durable-only`: the persisted seq per partition, polled with OBSERVE_SEQNO."""

    def __init__(self, uri: SourceUri, interval: float = 0.05) -> None:
        self.uri = uri
        self.interval = interval
        self.persisted: dict[int, tuple[int, int]] = {}  # p -> (uuid, persisted seq)
        self._router: Router | None = None
        self._last = 0.0

    async def poll(self, parts: dict[int, _Part], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        want = [st for st in parts.values() if st.rows or st.complete > st.committed.seq]
        if not want:
            return
        if self._router is None:  # each partition asked of its active node (the map)
            self._router = await Router.open(self.uri, name="upr-replay-observe")
        router = self._router
        futs = []
        for st in want:
            make = functools.partial(_observe, st.p, st.uuid)
            futs.append((st.p, router.submit(st.p, make), make))
        router.flush()
        for p, fut, make in futs:
            resp = decode_message(await router.settle(fut, p, make))
            if isinstance(resp, ObserveSeqnoResponse):
                self.persisted[p] = (resp.vbucket_uuid, resp.persisted_seqno)

    def cap(self, st: _Part) -> int:
        """The highest seq of `st`'s branch known persisted (its committed seq if unknown)."""
        uuid, seq = self.persisted.get(st.p, (None, 0))
        if uuid != st.uuid:  # another branch, or not asked yet: nothing new is safe
            return st.committed.seq
        return seq

    async def aclose(self) -> None:
        if self._router is not None:
            await self._router.aclose()


def _observe(p: int, uuid: int, opaque: int) -> bytes:
    return ObserveSeqno(vbucket=p, vbucket_uuid=uuid, opaque=opaque).encode()


class _Restart(Exception):
    """A partition was reset (rollback too far): reopen every stream from the store."""


async def replay_node(
    uri: SourceUri,
    db_path: Path,
    *,
    partitions: list[int] | None = None,
    follow: bool = False,
    consistent: bool = False,
    durable_only: bool = False,
    undo_window: int = DEFAULT_UNDO_WINDOW,
    max_pending: int = 262_144,
    barrier_interval: float = 0.2,
    buffer_size: int = 4 * 1024 * 1024,
    on_progress: Callable[[ReplayStats], None] | None = None,
    on_event: Callable[[str], None] | None = None,
) -> ReplayStats:
    """Replay a live source into the store at `db_path` until caught up (or, with
    `follow`, until cancelled: SIGINT/SIGTERM end the run after a last checkpoint)."""
    mode = "consistent" if consistent else "snapshot"
    mode += " durable-only" if durable_only else ""
    stats = ReplayStats(uri.redacted(), str(db_path), mode)
    say = on_event or (lambda _m: None)
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="upr-store")
    store = await loop.run_in_executor(
        pool, lambda: Store(db_path, undo_window=undo_window, source=uri.redacted())
    )
    task = asyncio.current_task()
    stopping = False

    def stop() -> None:
        nonlocal stopping
        if not stopping and task is not None:
            stopping = True
            task.cancel()

    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        # no handler where the loop cannot install one (not the main thread, not Unix):
        # Ctrl-C then ends the run as any KeyboardInterrupt does
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop)
            handled.append(sig)
    durability = _Durability(uri) if durable_only else None
    gc_rarely = contextlib.ExitStack()
    gc_rarely.enter_context(rare_gc())  # rows wait in memory until their commit point
    try:
        while True:
            try:
                await _round(
                    uri, store, pool, stats, say, partitions=partitions, follow=follow,
                    consistent=consistent, durability=durability, max_pending=max_pending,
                    barrier_interval=barrier_interval, buffer_size=buffer_size,
                    on_progress=on_progress,
                )  # fmt: skip
                break
            except _Restart:
                continue
    except asyncio.CancelledError:
        if not stopping:
            raise
        stats.interrupted = True
    finally:
        gc_rarely.close()
        for sig in handled:
            loop.remove_signal_handler(sig)
        if durability is not None:
            await durability.aclose()
        await loop.run_in_executor(pool, store.close)
        pool.shutdown(wait=True)
    stats.seconds = time.monotonic() - stats.started
    return stats


async def _round(
    uri: SourceUri,
    store: Store,
    pool: ThreadPoolExecutor,
    stats: ReplayStats,
    say: Callable[[str], None],
    *,
    partitions: list[int] | None,
    follow: bool,
    consistent: bool,
    durability: _Durability | None,
    max_pending: int,
    barrier_interval: float,
    buffer_size: int,
    on_progress: Callable[[ReplayStats], None] | None,
    durable_wait: float = 5.0,
) -> None:
    """One consumer session: stream from the store's positions until done (or a restart)."""
    loop = asyncio.get_running_loop()

    def on_store(fn: Callable[[], Any]) -> asyncio.Future[Any]:
        return loop.run_in_executor(pool, fn)

    saved = await on_store(store.positions)
    logs = await on_store(lambda: {p: store.failover_log(p) for p in saved})
    bounds = await on_store(store.boundaries)
    consumer = DcpConsumer(
        uri, partitions=partitions, positions=saved, boundaries=bounds,
        failover_logs={p: lg for p, lg in logs.items() if lg is not None},
        until_end=not follow, barriers=consistent, buffer_size=buffer_size, name="upr-replay",
    )  # fmt: skip
    inflight: list[asyncio.Future[Any]] = []
    parts: dict[int, _Part] = {}
    last_commit = time.monotonic()
    barrier_out: bytes | None = None
    barrier_sent = 0.0
    barrier_n = 0
    arrived = [0]  # rows appended since the last checkpoint
    shown = 0.0  # when progress was last reported
    cuts: list[dict[int, int]] = []  # barrier cuts back, waiting to commit (durable-only)
    catching_up = False  # consistent catch-up: one open store transaction

    async def settle(all_: bool = False) -> None:
        while inflight and (all_ or len(inflight) >= _MAX_INFLIGHT or inflight[0].done()):
            await inflight.pop(0)

    async def apply(work: list[tuple[int, list[Row], StreamPosition, FailoverLog | None]],
                    *, in_open: bool = False) -> None:  # fmt: skip
        """Apply (partition, rows, position, log) in one transaction (or the open one)."""
        if not work:
            return
        positions = {p: pos for p, _r, pos, _l in work}
        n = sum(len(r) for _p, r, _pos, _l in work)

        def run() -> None:
            store.apply_many(work)

        fut = on_store(run)
        inflight.append(fut)

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            stats.applied += n
            if not in_open:
                stats.commits += 1
                consumer.commit(positions)

        fut.add_done_callback(done)
        for p, _r, pos, _l in work:
            parts[p].applied = pos
            parts[p].log = None
            if not in_open:
                parts[p].committed = pos
        await settle()

    def take_all(targets: dict[int, int]) -> list[tuple[int, list[Row], StreamPosition,
                                                         FailoverLog | None]]:  # fmt: skip
        out = []
        for p, upto in targets.items():
            st = parts.get(p)
            if st is None:
                continue
            log = st.log
            got = st.take(upto)
            if got is not None:
                out.append((p, got[0], got[1], log))
        return out

    def snapshot_targets(force: bool, whole: bool = False) -> dict[int, int]:
        """Default/durable mode: per partition, the newest complete snapshot (capped);
        `whole`: never inside a snapshot, however many rows wait."""
        out = {}
        for p, st in parts.items():
            t = st.complete
            if len(st.rows) > max_pending and not whole:  # too big to hold: commit inside
                t = st.received
            if durability is not None:
                t = min(t, durability.cap(st))
            if t > st.applied.seq or (st.log is not None and force):
                out[p] = max(t, st.applied.seq)
        return out

    async def checkpoint(force: bool = False, whole: bool = False) -> None:
        nonlocal last_commit
        if consistent_on and not catching_up:
            return  # commits happen at barrier cuts only
        if durability is not None:
            await durability.poll(parts, force=force)
        now = time.monotonic()
        # rows received since the last commit: cheap to keep, unlike a sum over partitions
        soon = arrived[0] < min(_COMMIT_ROWS, max_pending) and now - last_commit < _COMMIT_SECONDS
        if not force and soon:
            return
        arrived[0] = 0
        # During the consistent catch-up too, each partition goes to its newest complete
        # snapshot, even past its pinned high: a cut at the high itself could fall inside
        # a deduplicated snapshot, which is no state the partition had (docs/design.md).
        work = take_all(snapshot_targets(force, whole))
        if work:
            await apply(work, in_open=catching_up)
            last_commit = now

    async def rollback(ev: Rollback) -> None:
        st = parts.get(ev.partition)
        if st is not None:
            # rows up to the boundary stay (they may not be in the store yet)
            del st.rows[bisect_right(st.rows, ev.to_seq, key=_seq_of) :]
            st.marks.clear()
            st.complete = min(st.complete, ev.to_seq)
            st.received = ev.to_seq
        await settle(all_=True)
        held = await on_store(lambda: store.position(ev.partition))
        if ev.to_seq > (held.seq if held is not None else 0):
            # a stream that reopened where it stood (a move, a state change) rolled back
            # above what the store holds: only uncommitted rows went, none are lost
            stats.rollbacks.append({"partition": ev.partition, "from": ev.previous.seq,
                                    "to": ev.to_seq, "asked": ev.asked, "lost": 0,
                                    "reset": False})  # fmt: skip
            say(
                f"partition {ev.partition}: rolled back from seq {ev.previous.seq} to "
                f"{ev.to_seq} before the store held it" + _below_asked(ev.asked, ev.to_seq)
            )
            return
        result = await on_store(
            lambda: store.rollback(ev.partition, ev.to_seq, uuid=ev.uuid, lost_above=ev.asked)
        )
        entry = {"partition": ev.partition, "from": ev.previous.seq, "to": ev.to_seq,
                 "asked": ev.asked, "lost": result.lost, "reset": result.too_far}  # fmt: skip
        if result.too_far:
            await on_store(lambda: store.reset_partition(ev.partition, lost_above=ev.asked))
            stats.resets += 1
            say(f"{result}; partition reset, streaming it again from 0")
            stats.rollbacks.append(entry)
            raise _Restart
        stats.rollbacks.append(entry)
        if st is not None:
            st.committed = st.applied = result.position or StreamPosition(ev.partition)
        say(str(result) + _below_asked(ev.asked, ev.to_seq))

    async def restart_open_transaction() -> None:
        """A reconnect or rollback during the consistent catch-up: its rows come again."""
        await settle(all_=True)
        await on_store(store.abort)
        for st in parts.values():
            st.applied = st.committed
        await on_store(store.begin)

    async def commit_open_transaction() -> None:
        nonlocal catching_up
        await checkpoint(force=True, whole=True)  # the commit ends on snapshot ends
        await settle(all_=True)
        await on_store(store.commit)
        stats.commits += 1
        for st in parts.values():
            st.committed = st.applied
        consumer.commit({p: st.committed for p, st in parts.items()})
        catching_up = False

    consistent_on = False
    pumping: asyncio.Task[None] | None = None
    try:
        await consumer.open()
        if consistent:
            if consumer.barriers_supported:
                consistent_on = catching_up = True
                await on_store(store.begin)
            elif "no-barriers" not in stats.notes:
                stats.notes.append("no-barriers")
                say("the source does not support barrier cookies: committing per snapshot")
        stats.partitions = len(consumer.parts)
        for p, part in consumer.parts.items():
            pos = part.position()
            parts[p] = _Part(p, pos, pos, pos.uuid, complete=pos.seq, received=pos.seq)
        batches: asyncio.Queue[list[Any] | BaseException | None] = asyncio.Queue(maxsize=2)

        async def pump() -> None:
            """Batches onto a queue, so the loop below can also wake on a timer."""
            try:
                async for b in consumer.batches():
                    await batches.put(b)
                await batches.put(None)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - re-raised by the loop below
                await batches.put(exc)

        pumping = asyncio.create_task(pump(), name="upr-replay-pump")
        # Commits wait for a batch size or a time; in --follow the stream may go idle, so
        # the loop wakes up on a timer too (and to poll persistence, send barriers).
        tick = _COMMIT_SECONDS if follow or durability is not None else None
        while True:
            try:
                async with asyncio.timeout(tick):  # not wait_for (net/aio.py)
                    got = await batches.get()
            except TimeoutError:
                got = []
            if got is None:
                break
            if isinstance(got, BaseException):
                raise got
            batch = got
            for item in batch:
                if type(item) is DcpRecord:
                    st = parts[item[1]]
                    seq: int = item[2]
                    if seq <= st.received:
                        continue  # already held (at-least-once after a reconnect)
                    st.rows.append(item)
                    arrived[0] += 1
                    st.received = seq
                    if st.marks and seq >= st.marks[-1][1]:
                        st.complete = seq
                    stats.items += 1
                elif isinstance(item, Snapshot):
                    st = parts[item.partition]
                    if st.marks:
                        st.complete = max(st.complete, st.marks[-1][1])
                    st.marks.append((item.start, item.end))
                elif isinstance(item, StreamOpened):
                    st = parts[item.partition]
                    # a reconnect dropped a pending cookie with its connection: ask anew
                    barrier_out = None
                    if catching_up and item.position.seq < st.applied.seq:
                        await restart_open_transaction()
                    st.reset_to(item.position)
                    st.log = st.branches = FailoverLog.sanitised(item.failover_log)
                elif isinstance(item, Rollback):
                    if catching_up:
                        await restart_open_transaction()
                    await rollback(item)
                elif isinstance(item, StreamEnded):
                    st = parts[item.partition]
                    if consumer.parts[item.partition].done:
                        st.ended = True
                        st.complete = max(st.complete, item.position.seq)
                elif isinstance(item, BarrierReached) and item.cookie == barrier_out:
                    barrier_out = None
                    cuts.append(item.cut)
            if catching_up and all(
                st.complete >= consumer.highs.get(p, 0) or st.ended for p, st in parts.items()
            ):
                await commit_open_transaction()
            await checkpoint()
            if cuts and durability is not None:
                await durability.poll(parts)
            while cuts and (durability is None or all(
                durability.cap(parts[p]) >= seq for p, seq in cuts[0].items() if p in parts
            )):  # fmt: skip
                await apply(take_all(cuts.pop(0)))
            if consistent_on and not catching_up and barrier_out is None and not cuts:
                now = time.monotonic()
                if now - barrier_sent >= barrier_interval and follow:
                    barrier_n += 1
                    barrier_out = f"replay-{os.getpid()}-{barrier_n}".encode()
                    barrier_sent = now
                    if not await consumer.barrier(barrier_out):
                        barrier_out = None  # the link is down: ask again after the reconnect
            if on_progress is not None and time.monotonic() - shown >= 0.2:
                shown = time.monotonic()
                stats.partitions_caught_up = sum(
                    1 for p, st in parts.items()
                    if st.committed.seq >= consumer.highs.get(p, 0)
                )  # fmt: skip
                on_progress(stats)
        # Every finite stream ended: commit the rest.
        if durability is not None:
            # Wait (a bounded time) for the source to persist what was received.
            deadline = time.monotonic() + durable_wait
            while time.monotonic() < deadline and any(
                durability.cap(st) < st.received for st in parts.values()
            ):
                await asyncio.sleep(durability.interval)
                await durability.poll(parts, force=True)
        if catching_up:
            await commit_open_transaction()
        else:
            await checkpoint(force=True)
        await settle(all_=True)
        left = sum(len(st.rows) for st in parts.values())
        if left:
            stats.notes.append(f"not-persisted:{left}")
            say(f"{left} changes the source has not persisted yet were left out (--durable-only)")
    except asyncio.CancelledError:
        # Ctrl-C in --follow: keep what is committable, then stop.
        await settle(all_=True)
        if catching_up:
            await on_store(store.abort)
        elif not consistent_on:
            await checkpoint(force=True)
            await settle(all_=True)
        raise
    except BaseException:
        try:
            with contextlib.suppress(Exception):  # not a cancel: Ctrl-C must still stop
                await settle(all_=True)
        finally:
            await on_store(store.abort)
        raise
    finally:
        if pumping is not None:
            await cancel_and_wait([pumping])
        await consumer.aclose()


def check_options(follow: bool, consistent: bool, durable_only: bool, source: str) -> None:
    """Refuse combinations that mean nothing for the source."""
    if source.startswith("repo:") and (follow or consistent or durable_only):
        raise UsageError(
            "--follow, --consistent and --durable-only apply to a live source, not a repository"
        )


def replay_repo(
    repo_dir: Path,
    db_path: Path,
    *,
    bucket: str | None = None,
    at: str = "latest",
    partitions: list[int] | None = None,
    undo_window: int = DEFAULT_UNDO_WINDOW,
    on_progress: Callable[[ReplayStats], None] | None = None,
    on_event: Callable[[str], None] | None = None,
) -> ReplayStats:
    """Replay a repository's state at a backup into the store, as a stream would.

    Each partition of the chain is a source whose failover log and position are the
    chain's resume point (formats/repository.md). The store's saved position is checked
    against that log by the producer rule (dcp-wire §4.2), as a server would check a
    STREAM_REQ; a rollback is applied as for a live source; then the state's records
    above the store's seq are applied as one snapshot (a disk backfill) with the
    backup's position. Replaying into an empty store equals restoring to it.
    """
    from upr_cli.failover import needs_rollback
    from upr_cli.jobs.inspect import open_bucket
    from upr_cli.jobs.restore import states_ahead
    from upr_cli.jobs.state import select
    from upr_cli.repo import resume_point
    from upr_cli.segments import SegmentError

    say = on_event or (lambda _m: None)
    repo, b, manifests = open_bucket(repo_dir, bucket)
    sel = select(manifests, at, partitions)
    chain = [m for m in manifests if m.backup_id <= sel.backup_id]
    stats = ReplayStats(f"repo:{repo_dir}@{sel.backup_id}", str(db_path), "snapshot")
    stats.partitions = len(sel.partitions)

    work: list[tuple[int, list[Row], StreamPosition, FailoverLog | None]] = []
    queued = [0]  # rows in `work`
    with Store(db_path, undo_window=undo_window, source=stats.source) as store, rare_gc():

        def flush() -> None:
            store.apply_many(work)
            stats.applied += sum(len(w[1]) for w in work)
            stats.commits += 1
            stats.partitions_caught_up += len(work)
            work.clear()
            queued[0] = 0
            if on_progress is not None:
                on_progress(stats)

        for p, records in states_ahead(repo, b, manifests, sel):
            if isinstance(records, SegmentError):
                raise records
            rp = resume_point(chain, p)
            if rp is None:
                continue
            held = store.partition_state(p)
            base = 0
            if held is not None and (held.position.seq or held.position.uuid):
                pos = held.position
                decision = needs_rollback(
                    rp.failover_log, start=pos.seq, uuid=pos.uuid, snap_start=pos.snap_start,
                    snap_end=pos.snap_end, high=rp.seq,
                )  # fmt: skip
                base = pos.seq
                if decision.rollback:
                    if work:
                        flush()
                    asked = decision.rollback_seq
                    # onto a snapshot boundary the store holds (formats/store.md §5.3)
                    r = boundary_at(store.boundaries(p).get(p, ()), asked)
                    entry = rp.failover_log.entry_at(r)
                    result = store.rollback(
                        p, r, uuid=entry.uuid if entry else None, lost_above=asked
                    )
                    stats.rollbacks.append(
                        {"partition": p, "from": pos.seq, "to": r, "asked": asked,
                         "lost": result.lost, "reset": result.too_far}
                    )  # fmt: skip
                    if result.too_far:
                        store.reset_partition(p, lost_above=asked)
                        stats.resets += 1
                        say(f"{result}; partition reset, applying it again from 0")
                        base = 0
                    else:
                        say(str(result) + _below_asked(asked, r))
                        base = r
            rows: list[Row] = [
                (op, p, seq, rev, cas, flags, exp, dtime, datatype, key, value, 0)
                for op, seq, rev, cas, flags, exp, dtime, datatype, key, value in records
                if seq > base
            ]
            stats.items += len(rows)
            position = StreamPosition(p, rp.uuid, rp.seq, rp.snap_start, rp.snap_end)
            if position.seq < base:  # nothing newer in the backup than the store holds
                continue
            work.append((p, rows, position, rp.failover_log))
            queued[0] += len(rows)
            if queued[0] >= _REPO_BATCH_ROWS:
                flush()
        if work:
            flush()
    stats.seconds = time.monotonic() - stats.started
    return stats


def _below_asked(asked: int, to: int) -> str:
    """What to add to a rollback's message when it went below the seq the source asked."""
    if to >= asked:
        return ""
    return (
        f" (the source asked for {asked}, inside a deduplicated snapshot the store"
        f" received; {to} is the newest snapshot boundary below it)"
    )
