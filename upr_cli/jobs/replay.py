"""`upr replay`: keep a SQLite store in step with a source, as a UPR replica would.

Theory of operation (the UPR design specification, "Client and Mutation Log" and "How
clients roll back changes when seeing a new failover ID"; formats/store.md is the store's
contract)
-----------------------------------------------------------------------------------------
* **Positions live in the store.** A run streams every partition from the position the
  store saved with its documents, so a restart (or a SIGKILL at any point) resumes
  exactly there; rows at or below a saved seq are dropped (the consumer is
  at-least-once after a reconnect).
* **What commits when.** Rows wait in memory per partition until a *commit point*; the
  rows up to it and the position at it are applied in one store transaction (the
  changes of all partitions that reached a point in one batch share it). The point of a
  partition is, by mode:
  - default: the end of its last complete snapshot (a marker's end reached, the next
    marker, or the stream's end: docs/protocol.md "2.7 SNAPSHOT_MARKER");
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
  (a valid resume position, docs/protocol.md "4.4 What a client keeps per partition, and
  how it resumes"), so memory is bounded by configuration.
* **Memory is bounded in bytes** (`--memory-limit`, docs/design.md "Performance"): the
  rows held for commit points, counted by their keys and values, stay within a share of
  the limit (`_BATCH_SHARE`). Past it a checkpoint runs at once; if the complete
  snapshots it takes leave more than the share held, every partition commits inside its
  snapshot as well, as past `max_pending`. The applies in flight on the worker hold at
  most a share too (a larger one waits for those before it), so a run holds about two
  shares of rows, whatever the documents' size; a document larger than the share goes
  alone.
* **Collections.** A collection or scope created or dropped reaches replay as a
  `ManifestChange` at its seq among the records; it waits with them and commits in the
  same transaction, applied between them in seq order. A drop removes the
  collection's documents of that partition through the mutation log, so a rollback
  below it brings them back (formats/store.md §5.5). The source's manifest at the
  start names the ids. `collections` filters on the server side; a store remembers its
  filter, since its positions say nothing of the collections it left out. A resume
  passes the consumer the ids the store followed in each partition (`_followed`), so
  that a collection dropped since (and perhaps created again under its name, with a
  new id) still has its drop applied: by name alone the filter would name only the new
  id, and the old one's documents would stay (docs/protocol.md §12.4).
* **Rollbacks.** The consumer turns ROLLBACK(r) into a `Rollback` event, at the newest
  snapshot boundary at or below r (docs/design.md "Rollback");
  the store undoes its changes above r from its mutation log, keeping the versions it
  takes back in `lost_writes` (for `upr salvage --store`). When r is below what the log
  reaches, the partition is reset and the run restarts its stream from 0. Every rollback
  is reported through `on_event`.
* **One session, one sink.** A `ReplaySession` is one consumer session: a `Sink` that
  `drive` feeds, holding the partitions' state; a rollback below what the store's log
  reaches ends it, and the next session reopens every stream from the store.
* The store runs on one `Worker` thread, so the event loop (and the network) never waits
  on SQLite (docs/design.md "Performance"); at most two applies are in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from bisect import bisect_right
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from upr_cli import interrupt
from upr_cli.collections import ManifestChange
from upr_cli.collections import Path as CollectionPath
from upr_cli.dcp.consumer import DcpConsumer, Item, WireCompression
from upr_cli.dcp.events import (
    BarrierReached,
    Event,
    Rollback,
    Snapshot,
    StreamEnded,
    StreamOpened,
)
from upr_cli.dcp.sink import drive
from upr_cli.errors import UsageError
from upr_cli.failover import FailoverLog
from upr_cli.jobs.worker import Worker, rare_gc
from upr_cli.memory import MemoryLimit
from upr_cli.net.aio import cancel_and_wait
from upr_cli.net.router import Router
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition, boundary_at
from upr_cli.protocol import decode_message
from upr_cli.protocol.decoder import ROW_FIELDS, DcpRecord
from upr_cli.protocol.messages import ObserveSeqno, ObserveSeqnoResponse
from upr_cli.store import DEFAULT_UNDO_WINDOW, Row, Store

if TYPE_CHECKING:
    from upr_cli.repo import Manifest as BackupManifest
    from upr_cli.repo import ResumePoint

_seq_of = attrgetter("by_seqno")
_key_of = itemgetter(ROW_FIELDS.index("key"))  # of a DcpRecord or a plain row alike
_value_of = itemgetter(ROW_FIELDS.index("value"))
_change_seq = attrgetter("seq")
_COMMIT_ROWS = 32_768  # committable rows gathered before a transaction (amortises commits)
_COMMIT_SECONDS = 0.5  # ... or this long since the last one
_MAX_QUEUED = 1  # applies left on the worker when one is queued (two at most meanwhile)
_REPO_BATCH_ROWS = 131_072  # rows per transaction from a repository (best of 32k..1M)
_BATCH_SHARE = 1 / 8  # of --memory-limit: the rows held for commit, in keys and values

#: (partition, rows, the position after them, a failover log to save, the manifest
#: changes among the rows): one store apply
Work = list[tuple[int, list[DcpRecord], StreamPosition, FailoverLog | None, list[ManifestChange]]]


@dataclass
class ReplayStats:
    """Running totals, for progress displays and the summary."""

    source: str = ""
    store: str = ""
    mode: str = "snapshot"
    items: int = 0  # rows received
    applied: int = 0  # rows committed to the store
    bytes: int = 0  # their keys' and values' bytes
    changes: int = 0  # collections and scopes created or dropped, committed
    commits: int = 0
    partitions: int = 0
    partitions_caught_up: int = 0
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    resets: int = 0
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    positions: dict[int, int] = field(default_factory=dict)  # committed seqs (metrics' lag)
    last_apply: float = 0.0  # when the store last committed changes, unix seconds
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """JSON form (counts as numbers; there are no 64-bit values here)."""
        secs = self.seconds or (time.monotonic() - self.started)
        return {
            "source": self.source,
            "store": self.store,
            "mode": self.mode,
            "items": self.items,
            "applied": self.applied,
            "bytes": self.bytes,
            "manifest_changes": self.changes,  # the same name as in backup's summary
            "commits": self.commits,
            "partition_count": self.partitions,
            "rollbacks": self.rollbacks,
            "resets": self.resets,
            "notes": self.notes,
            "interrupted": self.interrupted,
            "seconds": round(secs, 3),
            "items_per_s": round(self.applied / secs) if secs else 0,  # never null
        }


def _nbytes(rows: list[DcpRecord] | list[Row]) -> int:
    """The rows' keys' and values' bytes (C-level passes, no Python per row)."""
    return sum(map(len, map(_key_of, rows))) + sum(map(len, map(_value_of, rows)))


@dataclass(slots=True)
class _Part:
    """One partition's replay state."""

    p: int
    committed: StreamPosition  # durable in the store
    applied: StreamPosition  # written to the store, maybe in the open transaction
    uuid: int = 0
    rows: list[DcpRecord] = field(default_factory=list)  # received, uncommitted, by seq
    changes: list[ManifestChange] = field(default_factory=list)  # the same, of collections
    marks: list[tuple[int, int]] = field(default_factory=list)  # markers not yet passed
    complete: int = 0  # every snapshot up to this seq was received whole
    received: int = 0
    log: FailoverLog | None = None  # a failover log to save with the next commit
    branches: FailoverLog | None = None  # the stream's failover log (names each seq's branch)
    ended: bool = False

    def reset_to(self, pos: StreamPosition) -> None:
        """The stream (re)starts at `pos`: drop what it will send again. A new stream
        begins with a new snapshot marker, so older markers no longer describe it."""
        self.drop_above(pos.seq)
        self.uuid = pos.uuid
        # A reconnect restarts from the consumer's committed position, which may trail a
        # store write still in flight: rows up to what the store has are dropped again.
        self.received = max(pos.seq, self.applied.seq)
        self.complete = min(self.complete, pos.seq)
        # A stream restarting inside a snapshot leaves that snapshot unfinished: a cut at
        # or below `pos.seq` is inside it, never a boundary (docs/design.md).
        self.marks = [(pos.snap_start, pos.snap_end)] if pos.seq < pos.snap_end else []
        self.ended = False

    def drop_above(self, seq: int) -> None:
        """Forget what was received above `seq` (the stream sends it again)."""
        del self.rows[bisect_right(self.rows, seq, key=_seq_of) :]
        del self.changes[bisect_right(self.changes, seq, key=_change_seq) :]

    def take(
        self, upto: int
    ) -> tuple[list[DcpRecord], list[ManifestChange], StreamPosition] | None:
        """Rows and changes ≤ `upto` and the position there; None when nothing would
        change."""
        upto = min(upto, max(self.complete, self.received))
        if upto < self.applied.seq or (upto == self.applied.seq and self.log is None):
            return None
        n = bisect_right(self.rows, upto, key=_seq_of)
        rows, self.rows = self.rows[:n], self.rows[n:]
        n = bisect_right(self.changes, upto, key=_change_seq)
        changes, self.changes = self.changes[:n], self.changes[n:]
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
        return rows, changes, StreamPosition(self.p, uuid, upto, start, end)


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
    collections: list[CollectionPath] | None = None,
    on_progress: Callable[[ReplayStats], None] | None = None,
    on_event: Callable[[str], None] | None = None,
    wait: float = 120.0,
    on_notice: Callable[[str], None] | None = None,
    compression: WireCompression = "auto",
    memory_limit: MemoryLimit | None = None,
) -> ReplayStats:
    """Replay a live source into the store at `db_path` until caught up (or, with
    `follow`, until cancelled: SIGINT/SIGTERM end the run after a last checkpoint).
    `collections` streams only those (scopes or collections) and every run into the
    store must give the same. A lost node is reconnected for up to `wait` seconds
    (`math.inf`: for ever; `on_notice` hears when the link is lost and when it is back).
    `compression` is the link's Snappy (`--wire-compression`, formats/wire.md "Snappy");
    `memory_limit` bounds the rows held in bytes (`--memory-limit`)."""
    mode = "consistent" if consistent else "snapshot"
    mode += " durable-only" if durable_only else ""
    stats = ReplayStats(uri.redacted(), str(db_path), mode)
    options = _Options(
        partitions=partitions, follow=follow, consistent=consistent, max_pending=max_pending,
        barrier_interval=barrier_interval, buffer_size=buffer_size, on_progress=on_progress,
        say=on_event or (lambda _m: None), collections=collections or None,
        wait=wait, notice=on_notice, compression=compression,
        batch_bytes=(memory_limit or MemoryLimit()).share(_BATCH_SHARE),
    )  # fmt: skip
    # the worker keeps young collections rare: rows wait in memory until their commit point
    async with Worker("upr-store", max_queued=_MAX_QUEUED) as worker:
        store = await worker.run(
            lambda: Store(db_path, undo_window=undo_window, source=uri.redacted())
        )
        try:
            await worker.run(
                lambda: store.claim_filter(",".join(sorted(map(str, collections or []))))
            )
        except BaseException:
            await worker.run(store.close)
            raise
        durability = _Durability(uri) if durable_only else None
        try:
            with interrupt.cancel_on_signals() as stopping:
                try:
                    while True:
                        session = await ReplaySession.resume(
                            uri, store, worker, stats, options, durability
                        )
                        try:
                            await session.run()
                            break
                        except _Restart:
                            continue
                except asyncio.CancelledError:
                    if not stopping():
                        raise
                    stats.interrupted = True
        finally:
            if durability is not None:
                await durability.aclose()
            await worker.run(store.close)
    stats.seconds = time.monotonic() - stats.started
    return stats


@dataclass(frozen=True)
class _Options:
    """What `replay_node` was asked, as every session sees it."""

    partitions: list[int] | None
    follow: bool
    consistent: bool
    max_pending: int
    barrier_interval: float
    buffer_size: int
    on_progress: Callable[[ReplayStats], None] | None
    say: Callable[[str], None]
    collections: list[CollectionPath] | None = None  # streamed on the server side
    durable_wait: float = 5.0  # at the end, how long to wait for the source to persist
    wait: float = 120.0  # how long a lost node is reconnected (math.inf: for ever)
    notice: Callable[[str], None] | None = None  # a link lost, and back
    compression: WireCompression = "auto"  # --wire-compression
    batch_bytes: int = MemoryLimit().share(_BATCH_SHARE)  # rows held, in keys and values


class _ReadAhead:
    """The consumer's batches read ahead by a task (so flow control is acknowledged while
    a batch is handled), and an empty batch after `tick` seconds without one: in
    `--follow` the stream may go idle while rows wait for a commit by time, persistence
    must be polled and barriers sent."""

    def __init__(self, consumer: DcpConsumer, tick: float | None) -> None:
        self.tick = tick
        self._queue: asyncio.Queue[list[Item] | BaseException | None] = asyncio.Queue(2)
        self._task = asyncio.create_task(self._pump(consumer), name="upr-replay-pump")

    async def _pump(self, consumer: DcpConsumer) -> None:
        try:
            async for batch in consumer.batches():
                await self._queue.put(batch)
            await self._queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised by `batches`
            await self._queue.put(exc)

    async def batches(self) -> AsyncIterator[list[Item]]:
        """What `drive` iterates: as `DcpConsumer.batches`, plus the empty ticks."""
        while True:
            try:
                async with asyncio.timeout(self.tick):  # not wait_for (net/aio.py)
                    got = await self._queue.get()
            except TimeoutError:
                got = []
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            yield got

    async def aclose(self) -> None:
        """Stop reading."""
        await cancel_and_wait([self._task])


def _followed(
    store: Store, paths: list[CollectionPath], saved: dict[int, StreamPosition]
) -> dict[int, set[int]]:
    """The collection ids the store follows in each partition it holds: those its
    filter covers by name that it does not know dropped, and a dropped one where the
    store still holds its documents (its drop has not reached that partition). Where
    the store holds none, applying the drop would change nothing."""
    mine = [c for c in store.collections().values()
            if c.scope is not None and any(p.covers(c.scope, c.name) for p in paths)]  # fmt: skip
    live = {c.id for c in mine if not c.dropped}
    out = {p: set(live) for p in saved}
    for c in (c for c in mine if c.dropped):
        for p in saved:
            held = store.db.execute(
                "SELECT 1 FROM documents WHERE partition = ? AND collection_id = ? LIMIT 1",
                [p, c.id],
            ).fetchone()
            if held is not None:
                out[p].add(c.id)
    return out


class ReplaySession:
    """One consumer session of `replay_node`: a `Sink` that streams every partition from
    the store's positions, holds rows per partition until a commit point and applies them
    on the store's worker; it ends when the streams do (or raises `_Restart`)."""

    def __init__(
        self,
        consumer: DcpConsumer,
        store: Store,
        worker: Worker,
        stats: ReplayStats,
        options: _Options,
        durability: _Durability | None,
    ) -> None:
        self.consumer = consumer
        self.store = store
        self.worker = worker
        self.stats = stats
        self.opt = options
        self.say = options.say
        self.durability = durability
        self.parts: dict[int, _Part] = {}
        self.consistent_on = False  # barrier cuts are the commit points
        self.catching_up = False  # consistent catch-up: one open store transaction
        self.cuts: list[dict[int, int]] = []  # barrier cuts back, waiting to commit
        self._barrier_out: bytes | None = None  # the cookie asked and not back yet
        self._barrier_sent = 0.0
        self._barrier_n = 0
        self._arrived = 0  # rows taken since the last checkpoint
        self._held = 0  # bytes of the rows held for commit (keys and values)
        self._inflight = 0  # ... and of those handed to the worker, not applied yet
        self._last_commit = time.monotonic()
        self._shown = 0.0  # when progress was last reported

    # -- the session ------------------------------------------------------------------

    @classmethod
    async def resume(
        cls,
        uri: SourceUri,
        store: Store,
        worker: Worker,
        stats: ReplayStats,
        options: _Options,
        durability: _Durability | None,
    ) -> ReplaySession:
        """A session whose consumer resumes each partition where the store stands."""
        saved = await worker.run(store.positions)
        stats.positions.update((p, pos.seq) for p, pos in saved.items())  # a rerun's start
        logs = await worker.run(lambda: {p: store.failover_log(p) for p in saved})
        bounds = await worker.run(store.boundaries)
        paths = options.collections
        followed = await worker.run(lambda: _followed(store, paths, saved)) if paths else None
        consumer = DcpConsumer(
            uri, partitions=options.partitions, positions=saved, boundaries=bounds,
            failover_logs={p: lg for p, lg in logs.items() if lg is not None},
            until_end=not options.follow, barriers=options.consistent,
            buffer_size=options.buffer_size, name="upr-replay", collections=paths,
            followed_ids=followed, follow_for=options.wait, on_notice=options.notice,
            compression=options.compression,
        )  # fmt: skip
        return cls(consumer, store, worker, stats, options, durability)

    async def run(self) -> None:
        """Stream from the store's positions until every finite stream ended (in
        `--follow`, until cancelled: what is committable is kept, then it stops)."""
        consumer = self.consumer
        ahead: _ReadAhead | None = None
        try:
            await consumer.open()
            await self._start(consumer)
            tick = _COMMIT_SECONDS if self.opt.follow or self.durability is not None else None
            ahead = _ReadAhead(consumer, tick)
            # drive reads nothing of its consumer but `batches()`
            await drive(ahead, self)
            await self._finish()
        except asyncio.CancelledError:
            await self._interrupted()
            raise
        except BaseException:
            try:
                await self.worker.discard()
            finally:
                await self.worker.run(self.store.abort)
            raise
        finally:
            if ahead is not None:
                await ahead.aclose()
            await consumer.aclose()

    async def _start(self, consumer: DcpConsumer) -> None:
        """The streams are open: record the source's names, pick the commit mode, set
        each partition's state."""
        manifest, store = consumer.manifest, self.store
        if manifest is not None:
            await self.worker.run(lambda: store.record_manifest(manifest))
        if self.opt.consistent:
            if consumer.barriers_supported:
                self.consistent_on = self.catching_up = True
                await self.worker.run(self.store.begin)
            elif "no-barriers" not in self.stats.notes:
                self.stats.notes.append("no-barriers")
                self.say("the source does not support barrier cookies: committing per snapshot")
        self.stats.partitions = len(consumer.parts)
        for p, part in consumer.parts.items():
            pos = part.position()
            self.parts[p] = _Part(p, pos, pos, pos.uuid, complete=pos.seq, received=pos.seq)

    async def _finish(self) -> None:
        """Every finite stream ended: commit the rest."""
        if self.durability is not None:
            await self._wait_persisted(self.durability)
        if self.catching_up:
            await self._commit_open_transaction()
        else:
            await self._checkpoint(force=True)
        await self.worker.drain()
        left = sum(len(st.rows) for st in self.parts.values())
        if left:
            self.stats.notes.append(f"not-persisted:{left}")
            self.say(
                f"{left} changes the source has not persisted yet were left out (--durable-only)"
            )

    async def _wait_persisted(self, durability: _Durability) -> None:
        """Wait (a bounded time) for the source to persist what was received."""
        deadline = time.monotonic() + self.opt.durable_wait
        while time.monotonic() < deadline and any(
            durability.cap(st) < st.received for st in self.parts.values()
        ):
            await asyncio.sleep(durability.interval)
            await durability.poll(self.parts, force=True)

    async def _interrupted(self) -> None:
        """Ctrl-C in `--follow`: keep what is committable (never a part of a cut)."""
        await self.worker.drain()
        if self.catching_up:
            await self.worker.run(self.store.abort)
        elif not self.consistent_on:
            await self._checkpoint(force=True)
            await self.worker.drain()

    # -- the Sink -----------------------------------------------------------------------

    async def records(self, records: list[DcpRecord]) -> None:
        """Hold each row above what its partition received (a reconnect sends some again)."""
        parts = self.parts
        n = 0
        for item in records:
            st = parts[item.vbucket]
            seq = item.by_seqno
            if seq <= st.received:
                continue  # already held (at-least-once after a reconnect)
            st.rows.append(item)
            n += 1
            st.received = seq
            if st.marks and seq >= st.marks[-1][1]:
                st.complete = seq
        self._arrived += n
        self.stats.items += n
        if n == len(records):  # one C-level pass a batch
            self._held += _nbytes(records)
        else:  # a reconnect's repeats were dropped: count what is held (rare)
            self._held = sum(_nbytes(st.rows) for st in parts.values())

    async def event(self, event: Event) -> None:
        """Markers, stream (re)opens and ends, rollbacks and barrier cuts, in wire order."""
        if isinstance(event, Snapshot):
            st = self.parts[event.partition]
            if st.marks:
                st.complete = max(st.complete, st.marks[-1][1])
            st.marks.append((event.start, event.end))
        elif isinstance(event, StreamOpened):
            await self._stream_opened(event)
        elif isinstance(event, Rollback):
            if self.catching_up:
                await self._restart_open_transaction()
            await self._rollback(event)
        elif isinstance(event, StreamEnded):
            if self.consumer.parts[event.partition].done:
                st = self.parts[event.partition]
                st.ended = True
                st.complete = max(st.complete, event.position.seq)
        elif isinstance(event, BarrierReached) and event.cookie == self._barrier_out:
            self._barrier_out = None
            self.cuts.append(event.cut)
        elif isinstance(event, ManifestChange):
            self._change(event)

    def _change(self, change: ManifestChange) -> None:
        """Hold a collection's creation or drop with the rows, at its seq (a system
        event may be the last item of its snapshot, as a record may)."""
        st = self.parts[change.partition]
        if change.seq <= st.received:
            return  # already held (at-least-once after a reconnect)
        st.changes.append(change)
        st.received = change.seq
        if st.marks and change.seq >= st.marks[-1][1]:
            st.complete = change.seq
        self._arrived += 1

    async def batch_done(self) -> bool:
        """Commit what reached its commit point (by mode), ask for the next barrier, and
        report progress; replay streams on until the streams end."""
        consumer = self.consumer
        if self.catching_up and all(
            st.complete >= consumer.highs.get(p, 0) or st.ended for p, st in self.parts.items()
        ):
            await self._commit_open_transaction()
        await self._checkpoint()
        await self._commit_cuts()
        if self.consistent_on and not self.catching_up:
            await self._send_barrier(consumer)
        if self.opt.on_progress is not None and time.monotonic() - self._shown >= 0.2:
            self._shown = time.monotonic()
            self.stats.partitions_caught_up = sum(
                1 for p, st in self.parts.items() if st.committed.seq >= consumer.highs.get(p, 0)
            )
            self.opt.on_progress(self.stats)
        return False

    # -- events -------------------------------------------------------------------------

    async def _stream_opened(self, ev: StreamOpened) -> None:
        st = self.parts[ev.partition]
        # a reconnect dropped a pending cookie with its connection: ask anew
        self._barrier_out = None
        if self.catching_up and ev.position.seq < st.applied.seq:
            await self._restart_open_transaction()
        before = _nbytes(st.rows)  # one partition's: a session opens one stream a partition
        st.reset_to(ev.position)
        st.log = st.branches = FailoverLog.sanitised(ev.failover_log)
        self._held += _nbytes(st.rows) - before

    async def _rollback(self, ev: Rollback) -> None:
        """Undo the store's changes above the boundary (its log keeps what it takes back);
        too far for the log: reset the partition and restart the session."""
        st = self.parts.get(ev.partition)
        if st is not None:
            # rows up to the boundary stay (they may not be in the store yet)
            before = _nbytes(st.rows)
            st.drop_above(ev.to_seq)
            self._held += _nbytes(st.rows) - before
            st.marks.clear()
            st.complete = min(st.complete, ev.to_seq)
            st.received = ev.to_seq
        await self.worker.drain()
        store, p = self.store, ev.partition
        held = await self.worker.run(lambda: store.position(p))
        entry: dict[str, Any] = {"partition": p, "from": ev.previous.seq, "to": ev.to_seq,
                                 "asked": ev.asked, "lost": 0, "reset": False}  # fmt: skip
        if ev.to_seq > (held.seq if held is not None else 0):
            # a stream that reopened where it stood (a move, a state change) rolled back
            # above what the store holds: only uncommitted rows went, none are lost
            self.stats.rollbacks.append(entry)
            self.say(
                f"partition {p}: rolled back from seq {ev.previous.seq} to "
                f"{ev.to_seq} before the store held it" + _below_asked(ev.asked, ev.to_seq)
            )
            return
        result = await self.worker.run(
            lambda: store.rollback(p, ev.to_seq, uuid=ev.uuid, lost_above=ev.asked)
        )
        entry.update(lost=result.lost, reset=result.too_far)
        if result.too_far:
            await self.worker.run(lambda: store.reset_partition(p, lost_above=ev.asked))
            self.stats.resets += 1
            self.say(f"{result}; partition reset, streaming it again from 0")
            self.stats.rollbacks.append(entry)
            raise _Restart
        self.stats.rollbacks.append(entry)
        if st is not None:
            st.committed = st.applied = result.position or StreamPosition(p)
            self.stats.positions[p] = st.committed.seq
        self.say(str(result) + _below_asked(ev.asked, ev.to_seq))

    # -- commits --------------------------------------------------------------------------

    async def _apply(self, work: Work, *, in_open: bool = False) -> None:
        """Apply (partition, rows, position, log, changes) in one transaction (or the open
        one); a position reaches the consumer only once the store committed it."""
        if not work:
            return
        positions = {p: pos for p, _r, pos, _l, _c in work}
        n = sum(len(r) for _p, r, _pos, _l, _c in work)
        nbytes = sum(_nbytes(r) for _p, r, _pos, _l, _c in work)
        self._held = max(0, self._held - nbytes)
        changes = sum(len(c) for _p, _r, _pos, _l, c in work)
        stats, consumer = self.stats, self.consumer

        def done(_result: None) -> None:
            self._inflight -= nbytes
            stats.applied += n
            stats.bytes += nbytes
            stats.changes += changes
            if not in_open:
                stats.commits += 1
                stats.last_apply = time.time()
                stats.positions.update((p, pos.seq) for p, pos in positions.items())
                consumer.commit(positions)

        job = functools.partial(self.store.apply_many, work)
        for p, _r, pos, _l, _c in work:
            st = self.parts[p]
            st.applied = pos
            st.log = None
            if not in_open:
                st.committed = pos
        if self._inflight + nbytes > self.opt.batch_bytes and self.worker.pending:
            await self.worker.drain()  # the rows on the worker's side bounded in bytes too
        self._inflight += nbytes
        await self.worker.submit(job, done)

    def _take_all(self, targets: dict[int, int]) -> Work:
        """Each partition's rows and changes up to its target, and the position there."""
        out: Work = []
        for p, upto in targets.items():
            st = self.parts.get(p)
            if st is None:
                continue
            log = st.log
            got = st.take(upto)
            if got is not None:
                out.append((p, got[0], got[2], log, got[1]))
        return out

    def _below(self, targets: dict[int, int]) -> int:
        """The bytes of the rows at or below each partition's target."""
        parts = self.parts
        return sum(
            _nbytes(parts[p].rows[: bisect_right(parts[p].rows, t, key=_seq_of)])
            for p, t in targets.items()
            if p in parts
        )

    def _snapshot_targets(
        self, force: bool, whole: bool = False, inside: bool = False
    ) -> dict[int, int]:
        """Default/durable mode: per partition, the newest complete snapshot (capped);
        `whole`: never inside a snapshot, however many rows wait; `inside`: every
        partition to its last row (too many bytes held)."""
        out = {}
        durability, max_pending = self.durability, self.opt.max_pending
        for p, st in self.parts.items():
            t = st.complete
            if (inside or len(st.rows) > max_pending) and not whole:  # too big to hold
                t = max(t, st.received)
            if durability is not None:
                t = min(t, durability.cap(st))
            if t > st.applied.seq or (st.log is not None and force):
                out[p] = max(t, st.applied.seq)
        return out

    async def _checkpoint(self, force: bool = False, whole: bool = False) -> None:
        """Snapshot mode (and the consistent catch-up): commit at snapshot ends, once
        enough rows or time gathered (or `force`)."""
        if self.consistent_on and not self.catching_up:
            return  # commits happen at barrier cuts only
        if self.durability is not None:
            await self.durability.poll(self.parts, force=force)
        now = time.monotonic()
        # rows received since the last commit: cheap to keep, unlike a sum over partitions
        full = self._held >= self.opt.batch_bytes
        soon = (
            self._arrived < min(_COMMIT_ROWS, self.opt.max_pending)
            and now - self._last_commit < _COMMIT_SECONDS
            and not full
        )
        if not force and soon:
            return
        self._arrived = 0
        # During the consistent catch-up too, each partition goes to its newest complete
        # snapshot, even past its pinned high: a cut at the high itself could fall inside
        # a deduplicated snapshot, which is no state the partition had (docs/design.md).
        targets = self._snapshot_targets(force, whole)
        if full and not whole and self._held - self._below(targets) >= self.opt.batch_bytes:
            targets = self._snapshot_targets(force, inside=True)  # still too much held
        work = self._take_all(targets)
        if work:
            await self._apply(work, in_open=self.catching_up)
            self._last_commit = now

    async def _commit_cuts(self) -> None:
        """Barrier cuts back, each committed whole once (`--durable-only`) the source
        persisted all of it."""
        durability = self.durability
        if self.cuts and durability is not None:
            await durability.poll(self.parts)
        while self.cuts and (durability is None or all(
            durability.cap(self.parts[p]) >= seq for p, seq in self.cuts[0].items()
            if p in self.parts
        )):  # fmt: skip
            await self._apply(self._take_all(self.cuts.pop(0)))

    async def _send_barrier(self, consumer: DcpConsumer) -> None:
        """After the catch-up in `--follow`: a barrier every `barrier_interval`, one at
        a time (formats/barrier.md)."""
        if self._barrier_out is not None or self.cuts or not self.opt.follow:
            return
        now = time.monotonic()
        if now - self._barrier_sent < self.opt.barrier_interval:
            return
        self._barrier_n += 1
        self._barrier_out = f"replay-{os.getpid()}-{self._barrier_n}".encode()
        self._barrier_sent = now
        if not await consumer.barrier(self._barrier_out):
            self._barrier_out = None  # the link is down: ask again after the reconnect

    async def _restart_open_transaction(self) -> None:
        """A reconnect or rollback during the consistent catch-up: its rows come again."""
        await self.worker.drain()
        await self.worker.run(self.store.abort)
        for st in self.parts.values():
            st.applied = st.committed
        await self.worker.run(self.store.begin)

    async def _commit_open_transaction(self) -> None:
        """The consistent catch-up reached every pinned high: commit it as one."""
        await self._checkpoint(force=True, whole=True)  # the commit ends on snapshot ends
        await self.worker.drain()
        await self.worker.run(self.store.commit)
        self.stats.commits += 1
        self.stats.last_apply = time.time()
        for p, st in self.parts.items():
            st.committed = st.applied
            self.stats.positions[p] = st.committed.seq
        self.consumer.commit({p: st.committed for p, st in self.parts.items()})
        self.catching_up = False


def check_options(follow: bool, consistent: bool, durable_only: bool, source: str, *,
                  collections: bool = False) -> None:  # fmt: skip
    """Refuse combinations that mean nothing for the source."""
    if source.startswith("repo:") and (follow or consistent or durable_only or collections):
        raise UsageError(
            "--follow, --consistent, --durable-only and --collections apply to a live source,"
            " not a repository"
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
    memory_limit: MemoryLimit | None = None,
) -> ReplayStats:
    """Replay a repository's state at a backup into the store, as a stream would.

    Each partition of the chain is a source whose failover log and position are the
    chain's resume point (formats/repository.md). The store's saved position is checked
    against that log by the producer rule (docs/protocol.md "4.2 The producer's rollback
    rule"), as a server would check a STREAM_REQ; a rollback is applied as for a live
    source; then the state's records above the store's seq are applied as one snapshot (a
    disk backfill) with the backup's position. Replaying into an empty store equals
    restoring to it.
    """
    from upr_cli.jobs.restore import states_ahead
    from upr_cli.jobs.state import select
    from upr_cli.repo import resume_point
    from upr_cli.repo.pitr import resume_at
    from upr_cli.segments import SegmentError
    from upr_cli.segments.format import OP_SYSTEM_EVENT
    from upr_cli.source import open_bucket

    say = on_event or (lambda _m: None)
    with contextlib.ExitStack() as held:
        repo, b, manifests = open_bucket(
            repo_dir, bucket, at, held=held, command="replay", on_warning=on_event
        )
        sel = select(manifests, at, partitions, bucket=b, option="@")
        chain = [m for m in manifests if m.backup_id <= sel.backup_id]
        shown = sel.backup_id if sel.point is None else sel.point.asked
        stats = ReplayStats(f"repo:{repo_dir}@{shown}", str(db_path), "snapshot")
        stats.partitions = len(sel.partitions)
        with Store(db_path, undo_window=undo_window, source=stats.source) as store, rare_gc():
            store.claim_filter("")
            store.record_manifest(sel.collections(chain))
            batch = _RepoBatch(store, stats, on_progress,
                               (memory_limit or MemoryLimit()).share(_BATCH_SHARE))  # fmt: skip
            for p, records in states_ahead(repo, b, manifests, sel):
                if isinstance(records, SegmentError):
                    raise records
                point = None if sel.point is None else sel.point.picks.get(p)
                rp = resume_point(chain, p) if point is None else resume_at(chain, p, point)
                if rp is None:
                    continue
                base = _repo_base(store, p, rp, stats, say, before_rollback=batch.flush)
                # a segment record is (op, seq, rev, cas, flags, exp, delete_time, datatype,
                # key, value, collection, xattrs) (formats/segment.md); a store row has
                # DcpRecord's fields in order. System events come from the manifests' changes.
                rows: list[Row] = [
                    (op, p, seq, rev, cas, flags, exp, dtime, dtype, key, value, 0, cid, xa)
                    for op, seq, rev, cas, flags, exp, dtime, dtype, key, value, cid, xa in records
                    if seq > base and op != OP_SYSTEM_EVENT
                ]
                stats.items += len(rows)
                if rp.position.seq < base:  # nothing newer in the backup than the store holds
                    continue
                data = {r.seq for r in records if r.op != OP_SYSTEM_EVENT}
                mine = _chain_changes(chain, p, base, rp.position.seq, data)
                batch.add(p, rows, rp.position, rp.failover_log, mine)
            batch.flush()
        stats.seconds = time.monotonic() - stats.started
        return stats


def _chain_changes(
    chain: list[BackupManifest], p: int, base: int, top: int, row_seqs: set[int]
) -> list[ManifestChange]:
    """Partition p's collection changes in (base, top] that the chain's history kept, in
    seq order: those a later branch took back (formats/repository.md §8.3, the lost
    ranges) are left out, as their records are."""
    from upr_cli.repo import lost_ranges

    lost = lost_ranges(chain, p)
    found: dict[int, ManifestChange] = {}
    for m in chain:
        cut = [(r.from_seq, r.to_seq) for r in lost if r.backup_id == m.backup_id]
        for c in m.manifest_changes:
            if c.partition == p and not any(lo < c.seq <= hi for lo, hi in cut):
                found[c.seq] = c
    return [found[s] for s in sorted(found) if base < s <= top and s not in row_seqs]


class _RepoBatch:
    """Partitions' rows gathered for one store transaction (bounded by rows and by their
    keys' and values' bytes, so memory does not grow with the backup while the commit is
    amortised over small partitions)."""

    def __init__(
        self, store: Store, stats: ReplayStats, on_progress: Callable[[ReplayStats], None] | None,
        max_bytes: int,
    ) -> None:  # fmt: skip
        self.store = store
        self.stats = stats
        self.on_progress = on_progress
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.work: list[tuple[int, list[Row], StreamPosition, FailoverLog | None,
                              list[ManifestChange]]] = []  # fmt: skip
        self.rows = 0

    def add(self, p: int, rows: list[Row], position: StreamPosition, log: FailoverLog,
            changes: list[ManifestChange]) -> None:  # fmt: skip
        """Take partition p's rows and changes up to `position`; apply the batch once it
        is full."""
        self.work.append((p, rows, position, log, changes))
        self.stats.changes += len(changes)
        self.rows += len(rows)
        self.nbytes += _nbytes(rows)
        if self.rows >= _REPO_BATCH_ROWS or self.nbytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        """Apply what was taken, in one transaction."""
        if not self.work:
            return
        stats = self.stats
        self.store.apply_many(self.work)
        stats.applied += sum(len(w[1]) for w in self.work)
        stats.bytes += self.nbytes
        stats.commits += 1
        stats.partitions_caught_up += len(self.work)
        self.work.clear()
        self.rows = self.nbytes = 0
        if self.on_progress is not None:
            self.on_progress(stats)


def _repo_base(
    store: Store,
    p: int,
    rp: ResumePoint,
    stats: ReplayStats,
    say: Callable[[str], None],
    *,
    before_rollback: Callable[[], None],
) -> int:
    """The seq above which partition p's records are applied: what the store holds,
    unless the backup's branch no longer holds that (the producer rule): then the store
    rolls back, as for a live source, onto a snapshot boundary it holds
    (formats/store.md §5.3), or resets the partition when its log does not reach that far."""
    from upr_cli.failover import needs_rollback

    held = store.partition_state(p)
    if held is None or not (held.position.seq or held.position.uuid):
        return 0
    pos = held.position
    decision = needs_rollback(rp.failover_log, pos, high=rp.position.seq)
    if not decision.rollback:
        return pos.seq
    before_rollback()  # what was gathered for other partitions goes first
    asked = decision.rollback_seq
    r = boundary_at(store.boundaries(p).get(p, ()), asked)
    entry = rp.failover_log.entry_at(r)
    result = store.rollback(p, r, uuid=entry.uuid if entry else None, lost_above=asked)
    stats.rollbacks.append(
        {"partition": p, "from": pos.seq, "to": r, "asked": asked, "lost": result.lost,
         "reset": result.too_far}
    )  # fmt: skip
    if result.too_far:
        store.reset_partition(p, lost_above=asked)
        stats.resets += 1
        say(f"{result}; partition reset, applying it again from 0")
        return 0
    say(str(result) + _below_asked(asked, r))
    return r


def _below_asked(asked: int, to: int) -> str:
    """What to add to a rollback's message when it went below the seq the source asked."""
    if to >= asked:
        return ""
    return (
        f" (the source asked for {asked}, inside a deduplicated snapshot the store"
        f" received; {to} is the newest snapshot boundary below it)"
    )
