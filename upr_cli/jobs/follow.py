"""Continuous backup: `upr backup --follow` (docs/design.md "Continuous backup").

Theory of operation. A follower first catches up with an ordinary backup (`backup`: the
lock, the sweep, the chain checks, rollbacks, an interrupted run's segments, all as
today). Then it opens a **session**: every partition streamed from where the chain now
ends, with no end, into a `FollowStream`. Every `commit_every` seconds, or once
`commit_bytes` have arrived, it **commits**: it takes the bucket's lock, cuts every
partition that moved at its newest snapshot boundary (`FollowStream.checkpoint`), writes
the records up to there as one pack file and a manifest (a version 4 *continuous
commit*: sparse, with each partition's restore points, formats/repository.md §5.11),
and releases the lock. So `prune`, `remove` and readers run between commits, and a
commit is three objects (the pack, the manifest and its copy) whatever the partition
count.

A commit is crash-safe as a backup is (the copy's rename is the commit point): a SIGKILL
loses the uncommitted tail, which the next run streams again. The commit does not
re-read the chain (10,000 commits would make that quadratic): one listing of the bucket
directory shows whether another writer committed or removed the follower's last commit
meanwhile; then the session ends and the follower catches up again from the chain as it
now stands (`ChainMoved`). A stream the source ends, or a run a failover interrupts, ends
the session the same way. SIGINT and SIGTERM commit what the follower holds and end it
(exit 0, a follower's normal end).

The stretch of time a commit watched starts where the previous commit ended (the first
commit of a session: where its catch-up backup ended): a restore to a time inside it is
as fine as the snapshots the follower received; between sessions (the follower stopped
or killed) lies a coarse stretch (docs/design.md "Point-in-time restore").

What else a follower does is told through `FollowHooks` (the CLI's metrics,
upr_cli/metrics.py; this module knows nothing of Prometheus): each catch-up backup,
each rollup published, each link lost and back, each warning by a short kind, and, at
most once per commit interval while a session streams, how many seqs each partition is
behind the source's high seq (one STAT vbucket-seqno per active node, asked only when a
`lag` hook is given, on a task of its own so commits never wait for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from upr_cli import interrupt
from upr_cli.collections import CollectionsManifest
from upr_cli.collections import Path as CollectionPath
from upr_cli.dcp.consumer import DcpConsumer, WireCompression
from upr_cli.dcp.events import Event
from upr_cli.dcp.sink import drive
from upr_cli.dcp.states import partition_states
from upr_cli.errors import UprError
from upr_cli.jobs.backup import (
    BackupSummary,
    _changes,
    _counts,
    _entry,
    _rollbacks,
    backup,
    checked_filter,
    followed_ids,
    now_utc,
)
from upr_cli.jobs.backup_stream import (
    DEFAULT_MEMORY,
    MAX_INFLIGHT,
    BackupInterrupted,
    StreamStats,
    budget,
)
from upr_cli.jobs.follow_stream import Checkpoint, FollowStream
from upr_cli.jobs.rollup import (
    TOO_LARGE,
    Link,
    Prepared,
    Tail,
    absorbed_dirs,
    largest,
    leftover,
    prepare_at,
    publish,
    remove_absorbed,
    sweep_work_dirs,
    unstage,
    work_dir,
    worker_pool,
)
from upr_cli.jobs.worker import Worker
from upr_cli.memory import MemoryLimit
from upr_cli.net.collections_manifest import fetch_collections_manifest
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.repo import (
    BackupId,
    Manifest,
    Repository,
    RepositoryLock,
    RollbackRecord,
    Totals,
    format_segment_name,
    resume_point,
    snapshot_boundaries,
)
from upr_cli.repo.errors import RepositoryError, RepositoryLocked
from upr_cli.repo.manifest import chain_manifest
from upr_cli.repo.manifests import MANIFEST_COPY, MANIFEST_FILE
from upr_cli.repo.names import parse_backup_dir
from upr_cli.repo.pack import PACK_NAME, load_index, write_pack

COMMIT_EVERY = 30.0  # --commit-every's default, seconds
COMMIT_BYTES = 64 << 20  # --commit-bytes' default
HEARTBEAT = 300.0  # an idle follower still commits this often: its range reaches now
RESTARTS = 5  # sessions ended in a row without a commit before the follower gives up


class ChainMoved(UprError):
    """Another writer committed or removed backups since the follower's last commit."""


@dataclass(frozen=True)
class FollowOptions:
    """`upr backup --follow`'s settings (the catch-up backup takes the same)."""

    commit_every: float = COMMIT_EVERY
    commit_bytes: int = COMMIT_BYTES
    heartbeat: float = HEARTBEAT
    full: bool = False
    partitions: list[int] | None = None
    include: tuple[CollectionPath, ...] = ()
    exclude: tuple[CollectionPath, ...] = ()
    wait: float = 120.0
    compression: WireCompression = "auto"
    memory: MemoryLimit = DEFAULT_MEMORY
    encrypt: bool = False


@dataclass(frozen=True)
class CommitReport:
    """One continuous commit, as `on_commit` hears it."""

    backup_id: str
    partitions: int
    items: int
    bytes: int
    points: int
    since: datetime
    finished: datetime
    lag: float  # seconds from the oldest restore point it holds to its commit (0: none)
    rollbacks: int
    lost_seqs: int = 0  # seqs its rollbacks took back (from - to, summed)

    def to_json(self) -> dict[str, Any]:
        """docs/output.md: 64-bit counts as decimal strings, times RFC 3339."""
        return {
            "event": "commit",
            "backup_id": self.backup_id,
            "partition_count": self.partitions,
            "items": self.items,
            "bytes": self.bytes,
            "points": self.points,
            "since": self.since.isoformat().replace("+00:00", "Z"),
            "finished": self.finished.isoformat().replace("+00:00", "Z"),
            "lag_seconds": round(self.lag, 3),
            "rollback_count": self.rollbacks,  # `rollbacks` is a list elsewhere
        }


@dataclass(frozen=True)
class FollowHooks:
    """What a follower tells beside its commits (module docstring); each is optional and
    called on the event loop."""

    catch_up: Callable[[BackupSummary], None] | None = None
    rollup: Callable[[], None] | None = None
    reconnect: Callable[[], None] | None = None
    error: Callable[[str], None] | None = None  # a warning's kind (see `follow`)
    lag: Callable[[dict[int, int]], None] | None = None  # seqs behind, per partition


# a link back (upr_cli/dcp/consumer.py's notice): a reconnect
_BACK = " back after "


@dataclass
class FollowSummary:
    """What a follower did before it stopped."""

    bucket: str = ""
    catch_ups: list[str] = field(default_factory=list)
    commits: int = 0
    items: int = 0
    bytes_written: int = 0
    first_commit: str | None = None
    last_commit: str | None = None
    sessions: int = 0
    rollups: int = 0
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """docs/output.md conventions."""
        return {
            "bucket": self.bucket,
            "catch_ups": self.catch_ups,
            "commits": self.commits,
            "items": self.items,
            "bytes_written": self.bytes_written,
            "first_commit": self.first_commit,
            "last_commit": self.last_commit,
            "sessions": self.sessions,
            "rollups": self.rollups,
            "warnings": self.warnings,
            "seconds": round(self.seconds, 3),
        }


async def follow(
    uri: SourceUri,
    repo_dir: Path,
    opts: FollowOptions,
    *,
    on_commit: Callable[[CommitReport], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    on_progress: Callable[[StreamStats], None] | None = None,
    hooks: FollowHooks | None = None,
) -> FollowSummary:
    """Catch up, then commit continuously until SIGINT or SIGTERM (module docstring).
    The kinds of warnings `hooks.error` hears: backup (a catch-up backup's), session (a
    session ended: catching up again), rollup, stale_lock, lag_poll (a lag poll failed;
    not a warning)."""
    t0 = time.monotonic()
    hooks = hooks or FollowHooks()
    out = FollowSummary()
    stop = asyncio.Event()
    running: list[asyncio.Task[Any]] = []

    def halt(_sig: int) -> None:
        stop.set()
        for task in running:  # a catch-up is a backup: stopped, it keeps what it finished
            task.cancel()

    def warn(text: str, kind: str = "backup") -> None:
        out.warnings.append(text)
        if hooks.error is not None:
            hooks.error(kind)
        if on_warning is not None:
            on_warning(text)

    def notice(text: str) -> None:
        if hooks.reconnect is not None and text.startswith("connection to ") and _BACK in text:
            hooks.reconnect()
        if on_notice is not None:
            on_notice(text)

    idle_sessions = 0
    sweep_work_dirs()  # what a killed follower left in the temporary directory
    with interrupt.on_signals(halt):
        while not stop.is_set():
            catch = asyncio.ensure_future(backup(
                uri, repo_dir, full=opts.full and not out.catch_ups,
                partitions=opts.partitions, on_progress=on_progress, on_warning=warn,
                include=opts.include, exclude=opts.exclude, wait=opts.wait,
                on_notice=notice, compression=opts.compression, memory=opts.memory,
                encrypt=opts.encrypt and not out.catch_ups,
            ))  # fmt: skip
            running.append(catch)
            try:
                caught = await catch
            except asyncio.CancelledError:
                if stop.is_set():
                    break
                raise
            finally:
                running.remove(catch)
            out.bucket = caught.bucket
            out.catch_ups.append(caught.backup_id)
            if hooks.catch_up is not None:
                hooks.catch_up(caught)
            session = _Session(uri, Repository(repo_dir), caught.bucket, opts, warn, notice,
                               hooks)  # fmt: skip
            out.sessions += 1
            before = out.commits
            try:
                await session.run(stop, out, on_commit)
            except (ChainMoved, BackupInterrupted) as exc:
                idle_sessions = 0 if out.commits > before else idle_sessions + 1
                if idle_sessions >= RESTARTS:
                    raise
                warn(f"{exc}; catching up again", "session")
            finally:
                out.rollups += session.rollups
    out.seconds = time.monotonic() - t0
    return out


class _Gated:
    """A `Sink` whose calls wait while a commit cuts the streams (`FollowStream`)."""

    def __init__(self, inner: FollowStream, gate: asyncio.Lock) -> None:
        self.inner, self.gate = inner, gate

    async def records(self, records: list[DcpRecord]) -> None:
        async with self.gate:
            await self.inner.records(records)

    async def event(self, event: Event) -> None:
        async with self.gate:
            await self.inner.event(event)

    async def batch_done(self) -> bool:
        async with self.gate:
            return await self.inner.batch_done()


class _Session:
    """One run of open streams from where the chain ends, and its commits."""

    def __init__(
        self,
        uri: SourceUri,
        repo: Repository,
        bucket: str,
        opts: FollowOptions,
        warn: Callable[[str, str], None],
        on_notice: Callable[[str], None] | None,
        hooks: FollowHooks,
    ) -> None:
        self.uri, self.repo, self.bucket, self.opts = uri, repo, bucket, opts
        self.warn, self.on_notice, self.hooks = warn, on_notice, hooks
        self.positions: dict[int, int] = {}  # where each partition's stream started
        self.polling: asyncio.Task[None] | None = None  # the lag poll at work
        manifests = repo.manifests(bucket)
        newest = manifests[-1]
        self.last: BackupId = newest.backup_id
        self.since: datetime = newest.finished
        self.filter = newest.collection_filter
        self.manifests = manifests
        # an earlier session's tail, rolled once at start
        self.left = [Link.of(m) for m in leftover(manifests)]
        repo.manifest_store.forget(bucket)  # read once: a session keeps no chain
        self.collections: CollectionsManifest | None = None
        # rollups (jobs/rollup.py): the tail of commits, the one rollup at work, the
        # directories it could not remove yet (a reader was there), and the write turn
        # the commits and the rollups take one at a time
        self.tail = Tail()
        self.rolling: asyncio.Task[None] | None = None
        self.pool: ProcessPoolExecutor | None = None  # made at the first rollup
        self.leftover: list[Path] = []
        self.turn = asyncio.Lock()
        self.rollups = 0  # published by this session

    async def run(
        self,
        stop: asyncio.Event,
        out: FollowSummary,
        on_commit: Callable[[CommitReport], None] | None,
    ) -> None:
        """Stream and commit until `stop` (then a last commit) or the session ends."""
        manifests, opts = self.manifests, self.opts
        positions, logs = {}, {}
        for p in sorted({e.partition for m in manifests for e in m.partitions}):
            if opts.partitions is not None and p not in opts.partitions:
                continue
            rp = resume_point(manifests, p)
            if rp is not None:
                positions[p], logs[p] = rp.position, rp.failover_log
        self.positions = {p: pos.seq for p, pos in positions.items()}
        self.collections = await fetch_collections_manifest(self.uri)
        paths = checked_filter(self.bucket, self.filter, self.collections, manifests)
        followed = None if paths is None else followed_ids(manifests, self.filter, positions, {})
        shares = budget(opts.memory)
        consumer = DcpConsumer(self.uri, partitions=sorted(positions), positions=positions,
                               failover_logs=logs,
                               boundaries={p: snapshot_boundaries(manifests, p)
                                           for p in positions},
                               buffer_size=shares.window, name="upr-backup-follow",
                               collections=paths or None, followed_ids=followed,
                               compression=opts.compression, follow_for=opts.wait,
                               on_notice=self.on_notice)  # fmt: skip
        self.manifests = []  # not needed any more: a long session keeps no chain in memory
        work = work_dir("follow")
        try:
            async with Worker("segments", max_queued=MAX_INFLIGHT) as worker:
                stream = FollowStream(consumer, worker, work, bucket=self.bucket,
                                      segment_name=format_segment_name,
                                      memory_budget=shares.held,
                                      queued_bytes=shares.queued)  # fmt: skip
                try:
                    await consumer.open()
                    if self.left:
                        self.rolling = asyncio.ensure_future(self._roll(self.left, tail=False))
                    await self._loop(consumer, stream, stop, out, on_commit)
                finally:
                    if self.rolling is not None:  # its prepared files go; the tail stays
                        self.rolling.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await self.rolling
                    if self.pool is not None:
                        self.pool.shutdown(wait=False, cancel_futures=True)
                    await stream.abort()
                    await consumer.aclose()
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def _loop(
        self,
        consumer: DcpConsumer,
        stream: FollowStream,
        stop: asyncio.Event,
        out: FollowSummary,
        on_commit: Callable[[CommitReport], None] | None,
    ) -> None:
        gate = asyncio.Lock()
        driver = asyncio.ensure_future(drive(consumer, _Gated(stream, gate)))
        opts = self.opts
        tick = max(0.005, min(0.05, opts.commit_every / 4))
        last = last_commit = time.monotonic()
        try:
            while True:
                await asyncio.wait([driver], timeout=tick)
                if driver.done():
                    driver.result()  # its error ends the session
                    raise BackupInterrupted("the streams ended")
                now = time.monotonic()
                final = stop.is_set()
                due = now - last >= opts.commit_every or stream.bytes_since >= opts.commit_bytes
                if not (final or due):
                    continue
                last = now
                self._poll_lag(stream)
                if not stream.pending() and not final and now - last_commit < opts.heartbeat:
                    continue
                report = await self._commit(stream, gate)
                if report is None:
                    continue  # the lock is busy (prune, remove): the next tick tries again
                last_commit = now
                out.commits += 1
                out.items += report.items
                out.bytes_written += report.bytes
                out.first_commit = out.first_commit or report.backup_id
                out.last_commit = report.backup_id
                if on_commit is not None:
                    on_commit(report)
                if final:
                    return
        finally:
            for task in (driver, self.polling):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task

    def _poll_lag(self, stream: FollowStream) -> None:
        """Start a lag poll (hooks.lag), unless none is asked for or one is at work."""
        if self.hooks.lag is None or (self.polling is not None and not self.polling.done()):
            return
        self.polling = asyncio.ensure_future(self._lag(stream))

    async def _lag(self, stream: FollowStream) -> None:
        """Each partition's high seq less the seq the follower received last."""
        assert self.hooks.lag is not None
        try:
            states, _count = await partition_states(self.uri, sorted(self.positions),
                                                    failover_logs=False, name="upr-backup-lag",
                                                    wait_for=0)  # fmt: skip
        except (UprError, OSError):
            if self.hooks.error is not None:
                self.hooks.error("lag_poll")
            return
        received = stream._last  # the seq of the last record taken, per partition
        self.hooks.lag({
            p: max(0, st.high_seq - max(self.positions.get(p, 0), received.get(p, 0)))
            for p, st in states.items()
        })  # fmt: skip

    async def _commit(self, stream: FollowStream, gate: asyncio.Lock) -> CommitReport | None:
        """Take the lock, cut the streams, write the commit; None when the lock is held."""
        async with self.turn:
            lock = RepositoryLock(self.repo, self.bucket, on_stale=self._stale)
            try:
                await asyncio.to_thread(lock.__enter__)
            except RepositoryLocked:
                return None
            try:
                async with gate:
                    cp = await stream.checkpoint()
                report, manifest = await asyncio.to_thread(self._write, stream, cp)
            finally:
                await asyncio.to_thread(lock.__exit__, None, None, None)
        self.tail.add(manifest)
        self._roll_if_due()
        return report

    def _roll_if_due(self) -> None:
        """Start the rollup the tail is ready for, unless one is at work."""
        if self.rolling is not None and not self.rolling.done():
            return
        if self.rolling is not None and not self.rolling.cancelled():
            exc = self.rolling.exception()
            if exc is not None:  # the commits are safe; the next rollup tries again
                self.warn(f"rolling up commits failed: {exc}", "rollup")
                self.tail = Tail()
        group = self.tail.due()
        self.rolling = None if group is None else asyncio.ensure_future(self._roll(group))

    async def _roll(self, group: list[Link], *, tail: bool = True) -> None:
        """Prepare without a lock, publish with it (jobs/rollup.py); cascade upwards.
        A group not from the session's tail (an earlier session's leftover) leaves it be."""
        if self.pool is None:
            self.pool = worker_pool()
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        refs = [(m.backup_id, m.revision) for m in group]
        prepared = await loop.run_in_executor(self.pool, prepare_at, self.repo.path,
                                              self.repo.keyed_access(), self.bucket,
                                              refs)  # fmt: skip
        if prepared == TOO_LARGE:  # its members stay; the tail goes on after them
            if tail:
                self.tail.freeze(group)
            if self.on_notice is not None:
                self.on_notice(f"rollup into {group[-1].backup_id} left out: its manifest "
                               f"would outgrow {largest() >> 20} MiB; its {len(group)} "
                               "backups stay as they are")  # fmt: skip
            self.rolling = None
            self._roll_if_due()
            return
        if isinstance(prepared, str):  # a member is not there as it was: prune, remove
            self._dropped(group, tail)
            return
        try:
            while True:
                async with self.turn:
                    lock = RepositoryLock(self.repo, self.bucket, on_stale=self._stale)
                    try:
                        await asyncio.to_thread(lock.__enter__)
                    except RepositoryLocked:
                        pass  # prune, remove: the next tick
                    else:
                        try:
                            done = await asyncio.to_thread(self._publish, prepared, lock, tail)
                        finally:
                            await asyncio.to_thread(lock.__exit__, None, None, None)
                        break
                await asyncio.sleep(0.2)
        finally:
            prepared.discard()
        if not done:
            self._dropped(group, tail)
            return
        self.rollups += 1
        if self.hooks.rollup is not None:
            self.hooks.rollup()
        if self.on_notice is not None:
            m = prepared.manifest
            self.on_notice(f"rolled up {len(group)} backups into {m.backup_id} "
                           f"(revision {m.revision}, {m.totals.items:,} items) in "
                           f"{time.monotonic() - t0:.1f}s")  # fmt: skip
        # the absorbed directories go in a turn of their own: a commit first
        await asyncio.sleep(min(1.0, self.opts.commit_every / 2))
        await self._remove_absorbed()
        self.rolling = None
        self._roll_if_due()

    def _dropped(self, group: list[Link], tail: bool) -> None:
        """A rollup the chain moved under (nothing of it written): said, and the next."""
        if tail:
            self.tail = Tail()
        if self.on_notice is not None:
            self.on_notice(f"rollup into {group[-1].backup_id} dropped: the chain "
                           "changed under it; its commits stay as they are")  # fmt: skip
        self.rolling = None
        self._roll_if_due()

    def _stale(self, text: str) -> None:
        self.warn(text, "stale_lock")

    def _publish(self, prepared: Prepared, lock: RepositoryLock, tail: bool) -> bool:
        if not publish(self.repo, prepared, lock):
            unstage(self.repo, prepared)
            return False
        if tail:
            self.tail.rolled(prepared.group, prepared.manifest)
        self.leftover += absorbed_dirs(self.repo, prepared.group)
        return True

    async def _remove_absorbed(self) -> None:
        """Remove the directories published rollups absorbed, with the lock (those a
        reader still uses stay for the next try; a busy lock leaves them all)."""
        async with self.turn:
            lock = RepositoryLock(self.repo, self.bucket, on_stale=self._stale)
            try:
                await asyncio.to_thread(lock.__enter__)
            except RepositoryLocked:
                return
            try:
                self.leftover = await asyncio.to_thread(remove_absorbed, self.repo,
                                                        self.bucket, self.leftover)  # fmt: skip
            finally:
                await asyncio.to_thread(lock.__exit__, None, None, None)

    def _newest(self) -> BackupId:
        """The follower's last commit, checked to be still the chain's end (one listing)."""
        storage, bdir = self.repo.storage, self.repo.bucket_dir(self.bucket)
        ids: dict[BackupId, list[str]] = {}
        for entry in storage.list(bdir):
            with contextlib.suppress(RepositoryError):
                if entry.is_dir:
                    ids.setdefault(parse_backup_dir(entry.name)[0], []).append(entry.name)
        if self.last not in ids:
            raise ChainMoved(f"backup {self.last}, the follower's last commit, was removed")
        for bid in sorted(b for b in ids if b > self.last):
            for name in ids[bid]:
                if any(storage.stat(bdir / name / f) is not None
                       for f in (MANIFEST_COPY, MANIFEST_FILE)):  # fmt: skip
                    raise ChainMoved(f"backup {bid} was committed by another run")
        return max(ids)

    def _write(self, stream: FollowStream, cp: Checkpoint) -> tuple[CommitReport, Manifest]:
        """Write the pack and the manifest of one commit (formats/repository.md §4.7)."""
        repo, storage, bucket = self.repo, self.repo.storage, self.bucket
        after = self._newest()
        backup_id = BackupId.now(after=after)
        d = repo.backup_dir(bucket, backup_id)
        storage.make_dir(d)
        storage.sync_dir(repo.bucket_dir(bucket))
        members = [m for _p, r in sorted(cp.results.items()) for m in stream.work_files(r)]
        pack_size = write_pack(storage, d, members) if members else None
        entries, segments, rollbacks, lost, bytes_read = [], [], 0, 0, 0
        for p, r in sorted(cp.results.items()):
            rb = None if r.rollback is None else RollbackRecord(*r.rollback[:2], None,
                                                                r.rollback[2])  # fmt: skip
            entries.append(_entry(r, rb, points=cp.points.get(p, ())))
            segments += [] if r.segment is None else [r.segment]
            met = _rollbacks(p, r, rb)
            rollbacks += len(met)
            lost += sum(max(0, x.from_seq - x.to_seq) for x in met)
            bytes_read += 0 if r.segment is None else r.segment.raw_bytes
        finished = now_utc()
        manifest = Manifest(
            backup_id=backup_id, bucket=bucket, source=self.uri.redacted(),
            started=self.since, finished=max(finished, self.since), full=False,
            parent=self.last, partitions=tuple(entries),
            totals=Totals.derive(entries, bytes_read), collections=self.collections,
            manifest_changes=tuple(_changes(segments)), collection_filter=self.filter,
            collection_items=tuple(_counts(segments)), continuous=self.since,
        )  # fmt: skip
        self._check_sizes(d, manifest, pack_size)
        data = manifest.dumps()
        storage.write(d / MANIFEST_COPY, data)  # the commit point (formats/repository.md §4.3)
        storage.write(d / MANIFEST_FILE, data)
        repo.manifest_store.remember(manifest)  # a rollup's checks need no more of it
        self.last, self.since = backup_id, manifest.finished
        self.collections = chain_manifest([manifest])
        first = min((t for pts in cp.points.values() for _q, t in pts), default=None)
        lag = 0.0 if first is None else (manifest.finished - first).total_seconds()
        report = CommitReport(str(backup_id), len(entries), manifest.totals.items,
                            manifest.totals.bytes_written,
                            sum(len(p) for p in cp.points.values()), manifest.started,
                            manifest.finished, lag, rollbacks, lost)  # fmt: skip
        return report, manifest

    def _check_sizes(self, d: Path, manifest: Manifest, pack_size: int | None) -> None:
        """Every segment the manifest lists is in the pack at its size (read back)."""
        index = None if pack_size is None else load_index(self.repo.storage, d / PACK_NAME,
                                                          pack_size)  # fmt: skip
        for e in manifest.partitions:
            for name, seg in [(s.file, s) for s in e.segments] + e.cut_files():
                m = None if index is None else index.members.get(name)
                if m is None or m.length != seg.bytes:
                    raise RepositoryError(f"{d / PACK_NAME}: {name} is not in it at its size")
