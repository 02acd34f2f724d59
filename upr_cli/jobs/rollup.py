"""Rolling up a follower's small commits (formats/repository.md §4.8).

Theory of operation. A follower commits every few seconds, so its chain grows by
thousands of small backups a day; read as they are, each costs a manifest and a segment
per partition it touched, and a restore or `upr info` of ten thousand of them would take
many times what the same data in ten backups takes. So the follower **rolls up**: as
soon as the newest `FANOUT` backups of its session's tail have the same level L (a
commit is level 0), they become one backup of level L + 1: a new revision of the newest
of them (formats/repository.md §4.6) that absorbs the others and holds, per partition,
one segment with every record they held (nothing is dropped: every restore point inside
stays exact) and all their restore points. The chain keeps a few backups per level: a
logarithmic count, each record rewritten once per level.

Only what a commit may hold joins a rollup: continuous commits of one session (each
watching from where the one before ended), without a rollback or a cut-back (those
stay as they are, and the tail starts again after them).

The work is split so that commits never wait for it: `prepare` reads the members and
writes the merged segments into a local work directory without any lock (committed
backups never change), in a worker process of its own (`worker_pool`), so that the
follower's streams never wait for the interpreter lock; `publish` then takes the
follower's write turn and the bucket's lock only to check that the members are still
the chain's (a `prune` or `remove` in between: the rollup is dropped), write the pack
and commit the revision's manifest,
and remove the absorbed directories when no reader is there (else the next sweep does).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from upr_cli.jobs.follow_stream import WorkStorage
from upr_cli.repo import (
    BackupId,
    Manifest,
    PartitionEntry,
    Repository,
    RepositoryLock,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.repo.access import Access
from upr_cli.repo.errors import RepositoryError, RepositoryLocked
from upr_cli.repo.manifest import MAX_MANIFEST_BYTES, CollectionCount, Points
from upr_cli.repo.names import format_backup_dir, format_time, parse_backup_dir
from upr_cli.repo.pack import PACK_NAME, write_pack
from upr_cli.repo.readers import ExclusiveAccess
from upr_cli.segments import SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.storage import LocalStorage

FANOUT = 16
"""Backups of one level rolled into one of the next: 16 commits, 256, 4,096, … (the
environment's UPR_ROLLUP_FANOUT, 2 to 1024, overrides it: `fanout`)."""
_SPILL = 8 << 20  # a merged segment's buffered bytes before it spills to its body file
_PACED = 4 << 20  # a staged pack's bytes between syncs (`write_pack`), local files only
_HELD = 64 << 20
"""Merged segments a rollup keeps in memory for its pack; past this, each is one local
file (creating a file per partition costs more than merging a small one)."""
LARGEST = MAX_MANIFEST_BYTES // 2
"""The largest manifest a rollup makes (the environment's UPR_ROLLUP_MANIFEST_BYTES, at
least 1,024, lowers it: `largest`). A rollup holds every restore point of its members,
about five bytes each, so a high level of a busy bucket would outgrow what readers
accept: its members stay as they are instead (formats/repository.md §4.8)."""
TOO_LARGE = "too large"
MOVED = "moved"


def rollable(m: Manifest) -> bool:
    """Whether a commit may join a rollup (no rollback, no cut-back)."""
    return m.continuous is not None and not any(
        e.rollback is not None or e.cut_backs for e in m.partitions
    )


def fanout() -> int:
    """FANOUT, or UPR_ROLLUP_FANOUT when it is set to an integer in 2..1024."""
    text = os.environ.get("UPR_ROLLUP_FANOUT", "")
    return int(text) if text.isdigit() and 2 <= int(text) <= 1024 else FANOUT


def largest() -> int:
    """LARGEST, or UPR_ROLLUP_MANIFEST_BYTES when it is set to an integer from 1,024 up
    to LARGEST."""
    text = os.environ.get("UPR_ROLLUP_MANIFEST_BYTES", "")
    return int(text) if text.isdigit() and 1024 <= int(text) <= LARGEST else LARGEST


def estimate(group: list[Manifest]) -> int:
    """About how many bytes the manifest of `group`'s rollup takes, without merging:
    every member's points (their compact text, as they join), and an entry's worth
    per partition."""
    size, parts = 0, set()
    for m in group:
        for e in m.partitions:
            parts.add(e.partition)
            if isinstance(e.points, Points):
                size += len(e.points.text(e.start_seq))
    return size + 1024 * len(parts)


def leftover(chain: list[Manifest]) -> list[Manifest]:
    """What an earlier session of the follower left unrolled, to roll into one now.

    A chain a follower resumes ends with its catch-up backup; before it, the earlier
    session's tail (its consecutive continuous commits and rollups) holds up to
    `fanout` - 1 backups of each level, which no later rollup joins (a tail starts
    after the catch-up). Every backup of that tail after its leading ones of the highest
    level (above 0) becomes one backup, so each restart leaves a bounded few, and the big
    rollups already done are not rewritten. Empty when fewer than two would join."""
    run: list[Manifest] = []
    for m in reversed(chain[:-1]):  # the newest is the catch-up
        if not rollable(m) or (run and run[-1].continuous != m.finished):
            break
        run.append(m)
    run.reverse()
    if len(run) < 2:
        return []
    top = max(_level(m) for m in run)
    skip = 0
    while top and skip < len(run) and _level(run[skip]) == top:
        skip += 1
    rest = run[skip:]
    return rest if len(rest) >= 2 else []


def _level(m: Manifest) -> int:
    """How many commits a backup of the tail holds, as a power of the fanout: the commits
    it absorbed and itself."""
    n, level, f = len(m.absorbed) + 1, 0, fanout()
    while n >= f:
        n //= f
        level += 1
    return level


@dataclass(frozen=True)
class Link:
    """What the follower keeps of a backup of its tail: its names and times, not its
    manifest (a rollup's holds megabytes of restore points; the worker reads them)."""

    bucket: str
    backup_id: BackupId
    revision: int
    finished: datetime
    continuous: datetime | None

    @classmethod
    def of(cls, m: Manifest) -> Link:
        return cls(m.bucket, m.backup_id, m.revision, m.finished, m.continuous)


@dataclass
class Tail:
    """The session's backups that can still be rolled up, oldest first, with levels."""

    items: list[tuple[Link, int]] = field(default_factory=list)
    fanout: int = field(default_factory=fanout)

    def add(self, m: Manifest) -> None:
        """A new commit: joins the tail, or (a rollback in it) starts it again."""
        if rollable(m) and (not self.items or self.items[-1][0].finished == m.continuous):
            self.items.append((Link.of(m), 0))
        else:
            self.items = []

    def due(self) -> list[Link] | None:
        """The oldest `fanout` backups of the first run of that many sharing a level
        (oldest first: commits that arrive while a rollup works are never stranded
        between two rollups), else None."""
        start = 0
        for i in range(1, len(self.items) + 1):
            if i == len(self.items) or self.items[i][1] != self.items[start][1]:
                if i - start >= self.fanout:
                    return [m for m, _lv in self.items[start : start + self.fanout]]
                start = i
        return None

    def freeze(self, group: Sequence[Link]) -> None:
        """`group` is not to be rolled (its rollup would be too large): it and what came
        before it leave the tail, which goes on after it."""
        last = group[-1].backup_id
        for i, (m, _lv) in enumerate(self.items):
            if m.backup_id == last:
                self.items = self.items[i + 1 :]
                return
        self.items = []

    def rolled(self, group: Sequence[Link], into: Manifest) -> None:
        """`group` became `into`, one level up (a tail changed meanwhile is dropped)."""
        ids = [m.backup_id for m, _lv in self.items]
        want = [m.backup_id for m in group]
        for i in range(len(ids) - len(want) + 1):
            if ids[i : i + len(want)] == want:
                level = self.items[i][1] + 1
                self.items[i : i + len(want)] = [(Link.of(into), level)]
                return
        self.items = []


@dataclass
class Prepared:
    """A rollup written to local files (or held, `_HELD`), waiting for its publication."""

    group: list[Link]
    manifest: Manifest
    members: list[tuple[str, Path | bytes]]
    work: Path
    staged: Path | None = None  # the revision's directory, its pack written (`stage`)
    data: bytes | None = None  # the manifest's bytes, made where it was prepared

    def discard(self) -> None:
        """Drop the local files."""
        shutil.rmtree(self.work, ignore_errors=True)


def stage(repo: Repository, prepared: Prepared) -> None:
    """Write the revision's directory and pack into the repository ahead of its
    publication, without the lock: nothing reads a revision before its manifest is
    committed, and one never committed is swept (formats/repository.md §4.4). So the
    pack's bytes are written while the follower's commits go on, not under its lock.
    The local files go; a directory already committed there is left alone."""
    manifest = prepared.manifest
    bucket = manifest.bucket
    d = repo.revision_dir(bucket, manifest.backup_id, manifest.revision)
    if repo.manifest_store.committed_mark(d):
        return  # publish finds the chain moved
    repo.storage.make_dirs(d)
    repo.storage.sync_dir(repo.bucket_dir(bucket))
    if prepared.members:
        plain = isinstance(getattr(repo.storage, "inner", None), LocalStorage)
        write_pack(repo.storage, d, prepared.members, paced=_PACED if plain else 0)
    prepared.staged, prepared.members = d, []
    prepared.discard()


def _now() -> str:
    return format_time(datetime.now(UTC))


def prepare(repo: Repository, group: list[Manifest]) -> Prepared:
    """Merge `group` (consecutive commits or rollups of one session) into local files
    and the manifest of its revision; no lock is needed: committed backups never change."""
    k = group[-1]
    work = work_dir("rollup")
    try:
        entries: list[PartitionEntry] = []
        members: list[tuple[str, Path | bytes]] = []
        counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        store, held_bytes, now = WorkStorage(), 0, _now()
        for p in sorted({e.partition for m in group for e in m.partitions}):
            held = [(m, e) for m in group if (e := m.partition(p)) is not None]
            seg = _merge(repo, k, p, held, work, store, now)
            if seg is not None:
                data = store.take(work / seg.file)
                if held_bytes + len(data) <= _HELD:
                    members.append((seg.file, data))
                    held_bytes += len(data)
                else:
                    (work / seg.file).write_bytes(data)
                    members.append((seg.file, work / seg.file))
            first, last = held[0][1], held[-1][1]
            points = Points.joined([(e.points, e.start_seq) for _m, e in held],
                                   first.start_seq, last.end_seq, f"partition {p}")  # fmt: skip
            entries.append(
                PartitionEntry(
                    p,
                    last.uuid,
                    last.failover_log,
                    first.start_seq,
                    last.end_seq,
                    last.snap_start,
                    last.snap_end,
                    () if seg is None else (seg,),
                    points=points,
                )
            )
        for m in group:
            for c in m.collection_items:
                counts[c.id][0] += c.items
                counts[c.id][1] += c.deleted
        absorbed = sorted({b for m in group for b in m.absorbed}
                          | {m.backup_id for m in group[:-1]})  # fmt: skip
        changes = sorted((c for m in group for c in m.manifest_changes),
                         key=lambda c: (c.partition, c.seq))  # fmt: skip
        manifest = Manifest(
            backup_id=k.backup_id, bucket=k.bucket, source=k.source, started=group[0].started,
            finished=k.finished, full=False, parent=group[0].parent, partitions=tuple(entries),
            totals=Totals.derive(entries, sum(m.totals.bytes_read for m in group)),
            collections=group[0].collections, manifest_changes=tuple(changes),
            collection_filter=k.collection_filter,
            collection_items=tuple(CollectionCount(i, a, d)
                                   for i, (a, d) in sorted(counts.items())),
            revision=k.revision + 1, absorbed=tuple(absorbed), continuous=group[0].continuous,
        )  # fmt: skip
        data = manifest.dumps()
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Prepared([Link.of(m) for m in group], manifest, members, work, data=data)


def prepare_at(location: Path, access: Access, bucket: str,
               refs: list[tuple[BackupId, int]]) -> Prepared | str:  # fmt: skip
    """`prepare` and `stage`, in a worker process of its own (`worker_pool`): the
    repository opened from its location with `access` (an encrypted one's data key in
    it), the group read there from its (backup, revision) `refs`. Else why not: MOVED
    when one of them is not its backup's current revision any more (a `prune` or
    `remove`: dropped), TOO_LARGE when its manifest would outgrow `largest()`.

    Only names cross to the worker and only the result comes back, its points in
    compact form and its manifest's bytes made: pickling a group of commits, or
    serialising a rollup's manifest, would take the follower's interpreter lock from
    its streams for a second or more."""
    repo = Repository(location, access=access)
    group = []
    for bid, revision in refs:
        try:
            m = repo.read_manifest(bucket, bid)
        except RepositoryError:
            return MOVED
        if m.revision != revision:
            return MOVED
        group.append(m)
    if estimate(group) > largest():
        return TOO_LARGE
    prepared = prepare(repo, group)
    if len(prepared.data or b"") > largest():
        prepared.discard()
        return TOO_LARGE
    try:
        stage(repo, prepared)
    except BaseException:
        prepared.discard()
        raise
    return prepared


def _quiet() -> None:
    """A rollup worker leaves SIGINT and SIGTERM to the follower, which ends it, and
    yields the processor to it: rollups are background work, the streams are not. A
    follower killed (SIGKILL) cannot end it: it ends itself once its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(10)
    parent = os.getppid()

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)  # its work directory goes with the next follower's sweep

    threading.Thread(target=orphaned, name="upr-rollup-parent", daemon=True).start()


def work_dir(kind: str) -> Path:
    """A local work directory named for this process (`upr-KIND-PID-…`), so that the
    next follower can remove it once the process is gone (`sweep_work_dirs`)."""
    return Path(tempfile.mkdtemp(prefix=f"upr-{kind}-{os.getpid()}-"))


def sweep_work_dirs() -> list[Path]:
    """Remove the work directories of followers and rollup workers that are gone (a
    SIGKILL leaves them); the removed ones are returned."""
    gone = []
    for d in Path(tempfile.gettempdir()).glob("upr-*-*-*"):
        kind, pid = d.name.split("-")[1:3]
        if kind in ("follow", "rollup") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def worker_pool() -> ProcessPoolExecutor:
    """One worker process for rollups: merging thousands of records would otherwise
    share the follower's interpreter lock with its streams (a second core, and no lag)."""
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_quiet)  # fmt: skip


def _merge(repo: Repository, k: Manifest, p: int, held: list[tuple[Manifest, PartitionEntry]],
           work: Path, store: WorkStorage, now: str) -> SegmentEntry | None:  # fmt: skip
    """One segment of every record of partition p in `held`, in seq order, finished
    into `store` (its bytes in memory; a body that spilled was on disk)."""
    pieces = [(m, s) for m, e in held for s in e.segments]
    if not pieces:
        return None
    first, last = held[0][1], held[-1][1]
    header = SegmentHeader(k.bucket, p, last.failover_log, first.start_seq, last.end_seq, (),
                           now, f"rollup: {len(held)} backups into {k.backup_id}")  # fmt: skip
    writer = SegmentWriter(work / f"p{p:04x}.open", header, storage=store)
    snapshots: list[tuple[int, int]] = []
    try:
        for m, s in pieces:
            with SegmentReader(repo.segment_path(k.bucket, m.backup_id, s.file),
                               repo.storage) as r:  # fmt: skip
                snapshots += r.header.snapshots
                for i in range(len(r.blocks)):
                    writer.add([rec.as_dcp(p) for rec in r.block_records(i)])
                    if writer.buffered > _SPILL:
                        writer.spill()
        name = format_segment_name(p, writer.first_seq, writer.last_seq)
        info = writer.finish(end_seq=last.end_seq, snapshots=tuple(snapshots), sync=False,
                             path=work / name)  # fmt: skip
    except BaseException:
        writer.abort()
        raise
    return SegmentEntry(name, info.first_seq, info.last_seq, info.records, info.bytes,
                        info.checksum)  # fmt: skip


def _dirs(repo: Repository, bucket: str) -> dict[BackupId, set[str]]:
    out: dict[BackupId, set[str]] = defaultdict(set)
    for entry in repo.storage.list(repo.bucket_dir(bucket)):
        if entry.is_dir:
            try:
                out[parse_backup_dir(entry.name)[0]].add(entry.name)
            except RepositoryError:
                continue
    return out


def publish(repo: Repository, prepared: Prepared, lock: RepositoryLock) -> bool:
    """Commit a prepared rollup (the bucket's lock held); False when the chain moved
    under it (the members are not all there as they were: dropped, nothing written)."""
    group, manifest = prepared.group, prepared.manifest
    bucket, storage = manifest.bucket, repo.storage
    dirs = _dirs(repo, bucket)
    mine = None if prepared.staged is None else prepared.staged.name
    for m in group:  # each member is still its backup's current revision
        names = dirs.get(m.backup_id, set())
        newer = [n for n in names if parse_backup_dir(n)[1] > m.revision and n != mine]
        if format_backup_dir(m.backup_id, m.revision) not in names or newer:
            return False
    k = group[-1]
    d = repo.revision_dir(bucket, k.backup_id, manifest.revision)
    if prepared.staged is None:
        storage.make_dir(d)
        storage.sync_dir(repo.bucket_dir(bucket))
        if prepared.members:
            write_pack(storage, d, prepared.members)
    elif storage.stat(d / PACK_NAME) is None and any(e.segments for e in manifest.partitions):
        return False  # another writer's sweep took the staged directory: dropped
    repo.manifest_store.write_revision(manifest, lock, prepared.data)  # it remembers
    return True


def unstage(repo: Repository, prepared: Prepared) -> None:
    """Remove a staged revision that will not be published (the chain moved)."""
    if prepared.staged is not None and not repo.manifest_store.committed_mark(prepared.staged):
        repo.sweeper.discard(prepared.staged)


def remove_absorbed(repo: Repository, bucket: str, paths: list[Path]) -> list[Path]:
    """Remove the directories a rollup absorbed when no reader is there (the bucket's
    lock held); those left (a reader came) are returned, for the next try or sweep."""
    if not paths:
        return []
    try:
        with ExclusiveAccess(repo, bucket, wait=0):
            for path in paths:
                if repo.storage.stat(path) is not None:
                    repo.sweeper.discard(path)
            repo.storage.sync_dir(repo.bucket_dir(bucket))
    except RepositoryLocked:
        return paths
    return []


def absorbed_dirs(repo: Repository, group: Sequence[Link | Manifest]) -> list[Path]:
    """The directories a published rollup of `group` made stale: every member's, and the
    older revision of the newest one."""
    bucket = group[-1].bucket
    return [repo.revision_dir(bucket, m.backup_id, m.revision) for m in group]
