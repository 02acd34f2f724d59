"""`upr prune` and `upr remove`: drop backups, keeping what every kept backup restores.

Theory of operation (formats/repository.md §4.6 "Revisions" and §8.10 "Removing
backups"). The backups to remove split into runs: removed backups in a row, followed by
the kept backup K after them, or by nothing (the newest ones).

* A run followed by nothing is dropped outright, newest first (each removal leaves a
  shorter chain that is whole): no kept state ever read it.
* A run followed by K is merged forward into K: a new revision of K is written under
  the same id (directory `K-rNNNNNNNN`), then committed by its manifest, and only then
  are the run's directories and K's older revision removed. A revision of a continuous
  commit (`backup --follow`) stays one (`continuous`, and K's restore points: K's records
  are linked as they were; the run's points go with its compacted records); members of
  K's `segments.pack` are written out as files of the revision
  (formats/repository.md §12). Per partition p the revision holds:
  - the run's records that the state at K takes (seq ≤ cut(R, K),
    formats/repository.md §8.1), compacted to the latest record of every document
    (tombstones kept, events and the collections dropped by K left out), in parts between the
    starts of later backups that rolled back into the range, so the state at each of
    them stays exact; followed by K's own segments, linked (a hard link: nothing is
    copied and K's directory is not touched). Its start is the lowest start of the run
    and K, so every cut of a later backup is what it was, and so is every state at K
    and after;
  - the run's lost writes as cut-back records (formats/repository.md §5.6): records
    above their lost cut at the newest kept backup (formats/repository.md §8.3) and the
    run's own cut-back records, so that `salvage` and `examine` still find them;
    `--drop-lost-writes` is the only way to drop them;
  - a `lost_bound` (formats/repository.md §5.10) that keeps how far K's history agrees
    with the backups before the run: the lowest agreement of the run's entries and K's,
    so their lost writes are unchanged.
  The compacted range has no inner snapshot boundary left (its records are the state at
  its end only), so a later rollback below K's start lands lower, never inside it.
* Crash safety: a revision is invisible until its manifest commits; a run's directories
  are ignored once a committed revision lists them as `absorbed`; a removal renames the
  directory to a temp name first. A SIGKILL anywhere leaves a repository that verifies
  and restores every kept backup as before; the next prune, backup or merge sweeps the
  rest (`Sweeper.sweep`).

Memory stays flat as the repository grows: the plan reads manifests only, and the
merge streams one partition at a time through `write_latest`, which holds the keys of
one partition, never values.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from upr_cli.errors import UsageError
from upr_cli.jobs.compact import Piece, Written, write_latest
from upr_cli.jobs.retention import Decision, KeepRules, decide, local_zone
from upr_cli.repo import (
    NO_CUT,
    BackupId,
    CutBack,
    Manifest,
    PartitionEntry,
    Repository,
    RepositoryLock,
    RollbackRecord,
    SegmentEntry,
    Totals,
    cut,
    format_cut_path,
    format_segment_name,
    lost_cut,
)
from upr_cli.repo.manifest import CollectionCount, chain_manifest
from upr_cli.segments import Record, SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.source import backup_named, open_repo

PruneEvent = Callable[[str], None]
_SPILL_BYTES = 8 << 20
"""A segment being written moves its compressed blocks to its body file beyond this."""


# -- the plan ---------------------------------------------------------------------------


@dataclass
class Step:
    """A run of removed backups merged forward into the kept backup `kept`."""

    kept: Manifest
    run: list[Manifest]
    newest: BackupId | None = None  # the newest backup kept: lost writes are as of it

    @property
    def absorbed(self) -> tuple[BackupId, ...]:
        ids = set(self.kept.absorbed)
        for m in self.run:
            ids.add(m.backup_id)
            ids.update(m.absorbed)
        return tuple(sorted(ids))


@dataclass
class BucketPlan:
    """What pruning one bucket does."""

    bucket: str
    chain: list[Manifest]
    decisions: list[Decision]
    removed: list[Manifest]
    steps: list[Step]
    dropped: list[Manifest]  # removed with nothing kept after them: newest first
    bytes_removed: int  # segment bytes of the removed backups
    lost_writes: int = 0  # records of lost writes the removed backups hold
    drop_lost: bool = False  # --drop-lost-writes: they go instead of moving forward
    written: dict[str, Any] = field(default_factory=dict)  # filled by apply

    @property
    def kept(self) -> list[Manifest]:
        gone = {m.backup_id for m in self.removed}
        return [m for m in self.chain if m.backup_id not in gone]

    def merged_into(self, backup_id: BackupId) -> BackupId | None:
        for s in self.steps:
            if any(m.backup_id == backup_id for m in s.run):
                return s.kept.backup_id
        return None


def _bytes(m: Manifest) -> int:
    return sum(e.bytes + e.cut_bytes for e in m.partitions)


def plan_bucket(repo: Repository, bucket: str, remove: set[BackupId],
                decisions: list[Decision]) -> BucketPlan:  # fmt: skip
    """The runs and steps of removing `remove` from the bucket's chain (checked whole)."""
    chain = repo.chain(bucket)
    removed = [m for m in chain if m.backup_id in remove]
    steps: list[Step] = []
    run: list[Manifest] = []
    for m in chain:
        if m.backup_id in remove:
            run.append(m)
        elif run:
            steps.append(Step(m, run))
            run = []
    dropped = list(reversed(run))
    gone = {m.backup_id for m in removed}
    kept = [m.backup_id for m in chain if m.backup_id not in gone]
    for step in steps:
        step.newest = kept[-1]
    plan = BucketPlan(bucket, chain, decisions, removed, steps, dropped,
                      sum(_bytes(m) for m in removed))  # fmt: skip
    plan.lost_writes = sum(_count_lost(repo, plan, s) for s in steps)
    return plan


def _lost_ranges(chain: Sequence[Manifest], step: Step, p: int) -> list[tuple[Manifest, int]]:
    """(member, low) for each member of the run holding p that has lost writes at the
    newest kept backup: its records in (low, end] (formats/repository.md §8.3), as
    `salvage` and `examine` find them before the prune. (At K they can be fewer: a
    later failover's log can know less of the member's branch than K's did.)"""
    out = []
    upto = step.newest or step.kept.backup_id
    for m in step.run:
        e = m.partition(p)
        if e is None:
            continue
        low = max(lost_cut(chain, p, m.backup_id, upto), e.start_seq)
        if low < e.end_seq and any(s.last_seq > low for s in e.segments):
            out.append((m, low))
    return out


def _count_lost(repo: Repository, plan: BucketPlan, step: Step) -> int:
    """Records of lost writes the run holds: above the lost cut, and cut-back records."""
    n = 0
    parts = {p for m in step.run for p in m.partition_ids}
    for p in sorted(parts):
        for m, low in _lost_ranges(plan.chain, step, p):
            e = m.partition(p)
            assert e is not None
            for s in e.segments:
                if s.first_seq > low:
                    n += s.records
                elif s.last_seq > low:
                    path = repo.segment_path(plan.bucket, m.backup_id, s.file)
                    with SegmentReader(path, repo.storage) as r:
                        n += sum(1 for _ in r.records(low + 1, events=True))
    for m in step.run:
        n += sum(s.records for e in m.partitions for c in e.cut_backs for s in c.segments)
    return n


def resolve_backups(ids: Sequence[BackupId], specs: Sequence[str]) -> set[BackupId]:
    """The backups `upr remove` names: ids, unique prefixes, ranges `A..B`. A range is
    inclusive and its ends are bounds, whole ids or their starts: `202611..202611` is
    every backup of November 2026 (UTC), an open end the oldest or the newest."""
    out: set[BackupId] = set()
    for spec in specs:
        if ".." in spec:
            a, b = spec.split("..", 1)
            got = [i for i in ids if (not a or str(i) >= a) and (not b or str(i)[: len(b)] <= b)]
            if not got:
                raise UsageError(f"{spec}: no backup of this bucket lies in that range")
            out.update(got)
            continue
        found = backup_named(ids, spec, "BACKUP")
        if found is None:
            raise UsageError(f"{spec}: no such backup in this bucket")
        out.add(found)
    return out


# -- applying ---------------------------------------------------------------------------


@dataclass
class _Revision:
    """The new revision of a kept backup, being written."""

    repo: Repository
    step: Step
    chain: list[Manifest]
    directory: Path
    drop_lost: bool
    written: list[Path] = field(default_factory=list)
    bytes_written: int = 0
    bytes_kept: int = 0  # the run's files linked in (its cut-back records): not freed
    lost_dropped: int = 0
    counts: dict[int, list[int]] = field(default_factory=dict)

    @property
    def bucket(self) -> str:
        return self.step.kept.bucket

    def path(self, m: Manifest, file: str) -> Path:
        return self.repo.segment_path(self.bucket, m.backup_id, file)

    def link(self, m: Manifest, file: str, as_file: str | None = None) -> None:
        """K's (or a member's) segment file, linked into the revision."""
        dst = self.directory / (as_file or file)
        if "/" in (as_file or file):
            self.repo.storage.make_dirs(dst.parent)
        self.repo.storage.link(self.path(m, file), dst)
        self.written.append(dst)

    def partition(self, p: int) -> PartitionEntry:
        step, chain = self.step, self.chain
        k = step.kept
        ek = k.partition(p)
        members = [(m, e) for m in step.run if (e := m.partition(p)) is not None]
        if not members:
            assert ek is not None
            self._link_entry(k, ek)
            return ek
        last_e = members[-1][1]
        owner = ek if ek is not None else last_e
        start = min([e.start_seq for _m, e in members] + ([ek.start_seq] if ek else []))
        end_state = ek.start_seq if ek is not None else last_e.end_seq
        header = SegmentHeader(self.bucket, p, last_e.failover_log, start, end_state, (),
                               _now(), f"prune: merged into {k.backup_id}")  # fmt: skip
        alive = {coll.id for _scope, coll in chain_manifest(
            [m for m in chain if m.backup_id <= k.backup_id]).collections()}  # fmt: skip
        # later backups that rolled back into the merged range read it only up to their
        # start: the range is merged in parts between those starts, so that the state at
        # each of them stays exact (as `upr merge` splits, formats/repository.md §8.9)
        later = [e for m in chain if m.backup_id > k.backup_id and (e := m.partition(p))]
        cuts = sorted({e.start_seq for e in later if start < e.start_seq < end_state})
        segments: list[SegmentEntry] = []
        for low, high in itertools.pairwise([start, *cuts, NO_CUT]):
            pieces = []
            for m, e in members:
                c = min(cut(chain, p, m.backup_id, k.backup_id), high)
                for seg in e.segments:
                    if seg.first_seq > c:
                        break
                    if seg.last_seq > low:
                        pieces.append(Piece(m.backup_id, seg.file, min(seg.last_seq, c), low))
            if not pieces:
                continue
            # the collections dropped by K go (ids are never reused): no state restores
            # them, and the chain no longer names them
            got = write_latest(self.repo, self.bucket, p, pieces, keep=alive.__contains__,
                               header=header, directory=self.directory)  # fmt: skip
            if got is not None:
                self._wrote(got)
                segments.append(got.entry)
        cut_backs = self._cut_backs(p, ek)
        if ek is not None:
            segments += ek.segments
            for seg in ek.segments:
                self.link(k, seg.file)
        # K's restore points stay (its own records are linked as they were); the run's
        # go with its compacted records, whose inner states no longer exist
        return PartitionEntry(p, owner.uuid, owner.failover_log, start, owner.end_seq,
                              owner.snap_start, owner.snap_end, tuple(segments),
                              self._rollback(members, ek, start), tuple(cut_backs),
                              self._lost_bound(members, ek, start),
                              ek.points if ek is not None else ())  # fmt: skip

    def _wrote(self, got: Written) -> None:
        # `write_latest` made the file and its directory durable: not synced again
        self.bytes_written += got.entry.bytes
        for cid, (mut, dels) in got.collections.items():
            counts = self.counts.setdefault(cid, [0, 0])
            counts[0] += mut
            counts[1] += dels

    def _link_entry(self, k: Manifest, e: PartitionEntry) -> None:
        for s in e.segments:
            self.link(k, s.file)
        for name, _s in e.cut_files():
            self.link(k, name)

    def _rollback(self, members: list[tuple[Manifest, PartitionEntry]],
                  ek: PartitionEntry | None, start: int) -> RollbackRecord | None:  # fmt: skip
        """The rollback record of the entry the merged range starts with (its `to` is
        that start), when it has one."""
        entries = [e for _m, e in members] + ([ek] if ek is not None else [])
        return next(e for e in entries if e.start_seq == start).rollback

    def _lost_bound(self, members: list[tuple[Manifest, PartitionEntry]],
                    ek: PartitionEntry | None, start: int) -> int | None:  # fmt: skip
        """How far the merged entry may agree with the backups before the run
        (formats/repository.md §8.3):
        no further than the run's and K's entries did, the lowest of them. None when
        the merged entry's own start, rollback record or failover log says as much."""
        entries = [e for _m, e in members] + ([ek] if ek is not None else [])
        bounds = [_agreement(e) for e in entries if e.start_seq > 0]
        bounds += [e.lost_bound for e in entries if e.lost_bound is not None]
        if not bounds:
            return None
        bound = min(bounds)
        if start > 0:
            first = next(e for e in entries if e.start_seq == start)
            if _agreement(replace(first, lost_bound=None)) <= bound:
                return None
        return bound

    def _cut_backs(self, p: int, ek: PartitionEntry | None) -> list[CutBack]:
        """The revision's cut-back records on p, numbered in order: the run's own
        (linked), the run's lost writes at K (written), then K's own (linked)."""
        out: list[CutBack] = []
        lost = dict((m.backup_id, low) for m, low in _lost_ranges(self.chain, self.step, p))
        for m in self.step.run:
            e = m.partition(p)
            if e is None:
                continue
            if self.drop_lost:
                self.lost_dropped += sum(s.records for c in e.cut_backs for s in c.segments)
                if m.backup_id in lost:
                    above = self._records_above(m, e, lost[m.backup_id])
                    self.lost_dropped += sum(1 for _ in above)
                continue
            for i, c in enumerate(e.cut_backs, 1):
                self._link_cut(m, i, c, len(out) + 1)
                out.append(c)
            if m.backup_id in lost:
                seg = self._write_range(m, e, lost[m.backup_id], len(out) + 1)
                if seg is not None:
                    out.append(CutBack(e.end_seq, lost[m.backup_id], (seg,)))
        if ek is not None:
            for i, c in enumerate(ek.cut_backs, 1):
                self._link_cut(self.step.kept, i, c, len(out) + 1)
                out.append(c)
        return out

    def _link_cut(self, m: Manifest, index: int, c: CutBack, k: int) -> None:
        for s in c.segments:
            self.link(m, format_cut_path(index, s.file), format_cut_path(k, s.file))
            if m is not self.step.kept:
                self.bytes_kept += s.bytes

    def _records_above(self, m: Manifest, e: PartitionEntry, low: int) -> Iterator[Record]:
        for s in e.segments:
            if s.last_seq <= low:
                continue
            with SegmentReader(self.path(m, s.file), self.repo.storage) as r:
                yield from r.records(low + 1, events=True)

    def _write_range(self, m: Manifest, e: PartitionEntry, low: int,
                     k: int) -> SegmentEntry | None:  # fmt: skip
        """Cut-back segment `cut-k/…` of member m's records above `low` (all of them:
        lost writes are kept as they were streamed)."""
        p = e.partition
        header = SegmentHeader(self.bucket, p, e.failover_log, low, e.end_seq, (), _now(),
                               f"prune: lost writes of {m.backup_id}")  # fmt: skip
        sub = self.directory / f"cut-{k}"
        self.repo.storage.make_dirs(sub)
        writer = SegmentWriter(sub / f"p{p:04x}.open", header, storage=self.repo.storage)
        try:
            for rec in self._records_above(m, e, low):
                writer.add([rec.as_dcp(p)])
                if writer.buffered > _SPILL_BYTES:
                    writer.spill()
            if writer.first_seq == 0:
                writer.abort()
                return None
            name = format_segment_name(p, writer.first_seq, writer.last_seq)
            info = writer.finish(path=sub / name, sync=False)
        except BaseException:
            writer.abort()
            raise
        self.written.append(sub / name)
        self.bytes_written += info.bytes
        return SegmentEntry(name, info.first_seq, info.last_seq, info.records, info.bytes,
                            info.checksum)  # fmt: skip

    def manifest(self, previous: Manifest | None) -> Manifest:
        k = self.step.kept
        parts = sorted({p for m in [k, *self.step.run] for p in m.partition_ids})
        entries = tuple(self.partition(p) for p in parts)
        full = all(e.start_seq == 0 for e in entries) and (k.full or previous is None)
        if not full and previous is None:
            raise UsageError(
                f"backup {k.backup_id} would have nothing before it and is not full: keep an "
                "older backup"
            )
        counts = {c.id: [c.items, c.deleted] for c in k.collection_items}
        for cid, (mut, dels) in self.counts.items():
            got = counts.setdefault(cid, [0, 0])
            got[0] += mut
            got[1] += dels
        return Manifest(
            backup_id=k.backup_id, bucket=k.bucket, source=k.source, started=k.started,
            finished=k.finished, full=full,
            parent=None if full else previous.backup_id if previous else None,
            partitions=entries, totals=Totals.derive(entries, k.totals.bytes_read),
            merged_through=k.merged_through if full else None, collections=k.collections,
            manifest_changes=k.manifest_changes, collection_filter=k.collection_filter,
            collection_items=tuple(CollectionCount(i, a, d)
                                   for i, (a, d) in sorted(counts.items())),
            revision=k.revision + 1, absorbed=self.step.absorbed,
            continuous=k.continuous,  # a revision of a continuous commit stays one
        )  # fmt: skip


def _agreement(e: PartitionEntry) -> int:
    """How far a backup starting above 0 agrees with the history before it."""
    found = e.start_seq
    if e.rollback is not None:
        found = max(e.start_seq, min(e.rollback.branch_seq, e.rollback.from_seq))
    return found if e.lost_bound is None else min(found, e.lost_bound)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def apply(repo: Repository, plan: BucketPlan, lock: RepositoryLock, *, drop_lost: bool,
          on_event: PruneEvent | None = None) -> dict[str, Any]:  # fmt: skip
    """Write and commit each revision, then remove what it absorbed and the dropped
    backups; returns what was written and freed."""
    say = on_event or (lambda _m: None)
    repo.upgrade()
    kept_before: dict[BackupId, Manifest | None] = {}
    previous: Manifest | None = None
    gone = {m.backup_id for m in plan.removed}
    for m in plan.chain:
        if m.backup_id in gone:
            continue
        kept_before[m.backup_id] = previous
        previous = m
    written = kept_bytes = lost_dropped = 0
    for step in plan.steps:
        k = step.kept
        d = repo.revision_dir(plan.bucket, k.backup_id, k.revision + 1)
        if repo.storage.stat(d) is not None:  # an interrupted prune's: never committed
            repo.sweeper.discard(d)
        repo.storage.make_dir(d)
        repo.storage.sync_dir(d.parent)
        rev = _Revision(repo, step, plan.chain, d, drop_lost)
        say(f"merging {len(step.run)} backup(s) forward into {k.backup_id}")
        manifest = rev.manifest(kept_before[k.backup_id])
        repo.storage.sync_all(rev.written)
        for sub in {p.parent for p in rev.written if p.parent != d}:
            repo.storage.sync_dir(sub)
        repo.storage.sync_dir(d)
        repo.manifest_store.write_revision(manifest, lock)
        written += rev.bytes_written
        kept_bytes += rev.bytes_kept
        lost_dropped += rev.lost_dropped
    removed_dirs = 0
    for step in plan.steps:  # committed: what they absorbed is gone for every reader
        for s in repo.scan_all(plan.bucket):
            if s.backup_id in {m.backup_id for m in step.run} or (
                s.backup_id == step.kept.backup_id and s.revision <= step.kept.revision
            ):
                repo.sweeper.discard(s.path)
                removed_dirs += 1
    for m in plan.dropped:  # newest first: each removal leaves a whole, shorter chain
        for s in repo.scan_all(plan.bucket):
            if s.backup_id == m.backup_id:
                say(f"removing {m.backup_id}")
                repo.sweeper.discard(s.path)
                removed_dirs += 1
    repo.storage.sync_dir(repo.bucket_dir(plan.bucket))
    freed = max(0, plan.bytes_removed - kept_bytes - written)
    return {"bytes_written": written, "bytes_freed": freed,
            "lost_writes_dropped": lost_dropped, "directories_removed": removed_dirs}  # fmt: skip


# -- the commands' entry points ----------------------------------------------------------


@dataclass
class PruneResult:
    """What `upr prune` / `upr remove` planned (and did, with `apply`)."""

    repo: Path
    applied: bool
    rules: str
    time_zone: str
    buckets: list[BucketPlan]
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "repo": str(self.repo), "dry_run": not self.applied, "rules": self.rules,
            "time_zone": self.time_zone,
            "buckets": [_bucket_json(b) for b in self.buckets],
            "seconds": round(self.seconds, 3),
        }  # fmt: skip


def _bucket_json(b: BucketPlan) -> dict[str, Any]:
    reasons = {d.backup_id: d.reasons for d in b.decisions}
    gone = {m.backup_id for m in b.removed}
    backups = []
    for m in b.chain:
        into = b.merged_into(m.backup_id)
        backups.append({
            "backup_id": str(m.backup_id), "finished": _rfc3339(m.finished),
            "action": "remove" if m.backup_id in gone else "keep",
            "reasons": reasons.get(m.backup_id, []),
            "merged_into": None if into is None else str(into),
            "items": sum(e.records for e in m.partitions), "bytes": _bytes(m),
        })  # fmt: skip
    return {
        "bucket": b.bucket, "backups": backups, "kept": len(b.chain) - len(b.removed),
        "backups_removed": len(b.removed),
        "revisions": [{"backup_id": str(s.kept.backup_id), "revision": s.kept.revision + 1,
                       "absorbs": [str(m.backup_id) for m in s.run]} for s in b.steps],
        "bytes_removed": b.bytes_removed, "lost_writes": b.lost_writes,
        "bytes_written": b.written.get("bytes_written"),
        "bytes_freed": b.written.get("bytes_freed"),
        "lost_writes_dropped": b.written.get("lost_writes_dropped"),
    }  # fmt: skip


def _rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def run(repo_dir: Path, *, bucket: str | None, rules: KeepRules | None,
        names: Sequence[str] = (), apply_: bool, drop_lost: bool,
        hold: Callable[[Repository, str], contextlib.AbstractContextManager[Any]] | None = None,
        on_event: PruneEvent | None = None) -> PruneResult:  # fmt: skip
    """Plan (and with `apply_` carry out) a prune by `rules`, or a remove of `names`."""
    t0 = time.monotonic()
    repo = open_repo(repo_dir)
    buckets = [bucket] if bucket else repo.buckets()
    if bucket and bucket not in repo.buckets():
        raise UsageError(f"{repo_dir}: no bucket {bucket!r} (it holds "
                         f"{', '.join(repo.buckets()) or 'none'})")  # fmt: skip
    if rules is None and bucket is None and len(buckets) > 1:
        raise UsageError(f"{repo_dir}: holds buckets {', '.join(buckets)}; give --bucket")
    plans = []
    for b in buckets:
        if apply_:
            with contextlib.ExitStack() as stack:
                lock = stack.enter_context(RepositoryLock(repo, b))
                if hold is not None:  # the readers' side: none may read while we remove
                    stack.enter_context(hold(repo, b))
                _heal(repo, b, lock, on_event)
                plan = _plan(repo, b, rules, names)
                plan.drop_lost = drop_lost
                repo.sweep(b, _sweep_mark(repo, b), lock)
                plan.written = apply(repo, plan, lock, drop_lost=drop_lost, on_event=on_event)
        else:
            plan = _plan(repo, b, rules, names)
            plan.drop_lost = drop_lost
        plans.append(plan)
    desc = rules.describe() if rules is not None else "remove " + " ".join(names)
    return PruneResult(repo.path, apply_, desc, local_zone(), plans, time.monotonic() - t0)


def _heal(repo: Repository, bucket: str, lock: RepositoryLock,
          on_event: PruneEvent | None) -> None:  # fmt: skip
    """Rewrite a manifest file a killed run left missing from its valid twin (a crash
    between the commit point and `manifest.json`, formats/repository.md §4.3), as the
    next backup does: what this prune commits then verifies whole."""
    for path, why in repo.heal(bucket, lock):
        (on_event or (lambda _m: None))(f"{path}: {why}; rewritten from its twin")


def _sweep_mark(repo: Repository, bucket: str) -> BackupId:
    """The id the sweep treats as running: the interrupted backup run the next backup
    resumes survives a prune."""
    resumable = repo.resumable(bucket)
    return resumable if resumable is not None else repo.next_backup_id(bucket)


def _plan(repo: Repository, bucket: str, rules: KeepRules | None,
          names: Sequence[str]) -> BucketPlan:  # fmt: skip
    chain = repo.chain(bucket)
    ids = [m.backup_id for m in chain]
    if rules is not None:
        decisions = decide([(m.backup_id, m.finished) for m in chain], rules)
        remove = {d.backup_id for d in decisions if not d.keep}
    else:
        remove = resolve_backups(ids, names)
        decisions = [
            Decision(m.backup_id, m.finished.astimezone(),
                     [] if m.backup_id in remove else ["not named"])
            for m in chain
        ]  # fmt: skip
    return plan_bucket(repo, bucket, remove, decisions)


__all__ = [
    "BucketPlan",
    "PruneResult",
    "Step",
    "apply",
    "plan_bucket",
    "resolve_backups",
    "run",
]
