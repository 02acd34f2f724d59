"""`upr merge`: one full backup equal to the chain's state through a backup, on one machine;
and the driver `upr spark merge` shares with it.

Theory of operation (formats/repository.md §8.9; docs/design.md "Data flows" (7.
Merge)). The driver (`run`) resolves `--through` against the chain, checked whole
(formats/repository.md §8.8), takes the bucket's lock, sweeps what interrupted runs
left, picks the new backup's id and directory and plans, for every partition any backup
up to B holds, the pieces of its state at B (`plan_state`) and its resume point at B
(formats/repository.md §8.4: uuid, failover log, end seq and last snapshot): a
`MergeRun`, small and picklable. A writer then turns each partition's pieces into one
segment with `jobs.compact.write_latest` (the latest record of every document,
tombstones kept, system events and the collections dropped by B left out, in two
streamed passes: memory does not grow with the chain). `upr merge` writes
the partitions one after the other here (`write_local`); `upr spark merge` hands them to
Spark tasks (`upr_cli.spark.merge`). Only after every partition is written does the
driver write the manifest (`commit`, the commit point): full, no parent, the collections
at B and the items per collection. Everything goes through the repository's storage
(`repo.storage`). A failed or killed merge leaves an uncommitted directory that the next
backup or merge sweeps; a merge through an older B reuses its own (same id), whose stale
segment files are removed first.

Through the newest backup, the merge is simply the newest backup. Through an older one
B it sorts right after B (B's id plus one microsecond) and records `merged_through: B`:
the backups after B continue from it as they did from B, so the chain's state at every
later backup is unchanged. A later backup that rolled a partition back inside B's
range reads the merge only up to its rollback seq: that partition is written as one
segment per range between such seqs (`_later_cuts`, formats/repository.md §8.9). The
backups merged stay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

from upr_cli.errors import UprError, UsageError
from upr_cli.failover import FailoverLog
from upr_cli.jobs.compact import Piece, Written, write_latest
from upr_cli.repo import (
    BackupId,
    Manifest,
    PartitionEntry,
    Repository,
    RepositoryError,
    RepositoryLock,
    Totals,
    parse_segment_name,
    plan_state,
    resume_point,
)
from upr_cli.repo.manifest import CollectionCount, chain_manifest
from upr_cli.repo.readers import sweep_unless_read
from upr_cli.segments import SegmentHeader

__all__ = ["MergeRun", "MergeSummary", "PartitionWork", "commit", "is_merge_source", "run",
           "write_local", "write_partition"]  # fmt: skip

_log = logging.getLogger(__name__)
_SOURCE = "merge of "  # a merged segment's header `source`: "merge of FIRST..B"


def is_merge_source(source: str) -> bool:
    """True for the header `source` of a segment a merge wrote: a backup that resumes an
    interrupted run's directory never reuses one (a killed merge's is no stream's)."""
    return source.startswith(_SOURCE)


@dataclass(frozen=True, slots=True)
class PartitionWork:
    """One partition of a merge: its pieces and its resume point at B (small, picklable)."""

    partition: int
    failover_log: list[dict[str, str]]  # FailoverLog.to_json()
    end_seq: int
    snapshot: tuple[int, int]
    pieces: tuple[Piece, ...]
    bytes: int  # the segment bytes the pieces read (Spark balances its tasks by them)
    # where later backups cut the merge inside (0, end_seq), ascending (a rollback after B)
    cuts: tuple[int, ...] = ()

    def entry(self, written: Sequence[Written]) -> PartitionEntry:
        """The merged backup's entry for the partition: full (start 0), B's resume point."""
        log = FailoverLog.from_json(self.failover_log)
        return PartitionEntry(self.partition, log.latest.uuid if log.entries else 0, log, 0,
                              self.end_seq, *self.snapshot,
                              tuple(w.entry for w in written))  # fmt: skip


@dataclass(frozen=True, slots=True)
class MergeRun:
    """What the driver decided under the lock; every writer needs only this."""

    repo: Path
    bucket: str
    through: BackupId
    backup_id: BackupId
    after: BackupId | None  # merged_through: B when B is not the newest backup
    directory: Path
    source: str  # "merge of FIRST..B", in each segment header and the manifest
    created: str  # the segment headers' creation time
    keep: frozenset[int]  # the collection ids alive at B
    merged: int  # backups the state is read from
    work: tuple[PartitionWork, ...]


@dataclass
class MergeSummary:
    """What a merge committed."""

    backup_id: str
    through: str
    merged: int  # backups the state was read from
    partitions: int
    records: int
    bytes_written: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md §4: the records written are `items`)."""
        rate = int(self.records / self.seconds) if self.seconds > 0 else 0
        return {"backup_id": self.backup_id, "through": self.through, "merged": self.merged,
                "partition_count": self.partitions, "items": self.records,
                "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3),
                "items_per_s": rate}  # fmt: skip


def write_partition(repo: Repository, run: MergeRun, work: PartitionWork) -> tuple[Written, ...]:
    """Write one partition's merged segments into the run's directory (none: no record).

    One segment, or one per range between the cuts later backups make inside it (a
    rollback after B, formats/repository.md §8.9): each holds the latest record of
    every document among the records of its range, so the merge cut at any of them is
    the chain's state there. The last one's header lists only B's last snapshot: the
    markers inside the pieces are gone with the records between them (jobs/compact.py).
    """
    log = FailoverLog.from_json(work.failover_log)
    bounds = (0, *work.cuts, work.end_seq)
    out = []
    for lo, hi in pairwise(bounds):
        last = hi == work.end_seq
        pieces = [replace(pc, max_seq=min(pc.max_seq, hi), min_seq=lo)
                  for pc in work.pieces if pc.max_seq > lo]  # fmt: skip
        header = SegmentHeader(run.bucket, work.partition, log, lo, hi,
                               (work.snapshot,) if last else (), run.created,
                               run.source)  # fmt: skip
        written = write_latest(repo, run.bucket, work.partition, pieces,
                               keep=run.keep.__contains__, header=header,
                               directory=run.directory)  # fmt: skip
        if written is not None:
            out.append(written)
    return tuple(out)


def write_local(repo: Repository, run: MergeRun,
                progress: Callable[[int, int, int], None] | None = None,
                ) -> Iterator[tuple[int, tuple[Written, ...]]]:  # fmt: skip
    """`upr merge`'s writer: the partitions one after the other, in this process;
    `progress(partitions done, of how many, items written)` after each."""
    items = 0
    for i, work in enumerate(run.work, 1):
        written = write_partition(repo, run, work)
        items += sum(w.entry.records for w in written)
        yield work.partition, written
        if progress is not None:
            progress(i, len(run.work), items)


def _resolve(repo_dir: Path, bucket: str | None, through: str) -> tuple[Repository, str, str]:
    """The repository, bucket and backup id `--through` names, its chain checked whole."""
    from upr_cli.jobs.state import select
    from upr_cli.source import open_bucket

    try:
        repo, name, manifests = open_bucket(repo_dir, bucket, through)
        return repo, name, str(select(manifests, through).backup_id)
    except UsageError as exc:  # the option is --through here
        msg = str(exc)
        raise UsageError(f"--through{msg[4:]}" if msg.startswith("--at") else msg) from None


def _prepare(repo: Repository, bucket: str, through: str, lock: RepositoryLock) -> MergeRun:
    """Under the lock: the new backup's id and directory, swept, and every partition's plan."""
    manifests = [m for m in repo.manifests(bucket) if str(m.backup_id) <= through]
    if not manifests or str(manifests[-1].backup_id) != through:
        raise UsageError(f"--through: backup {through} is no longer committed")
    b_id = manifests[-1].backup_id
    after: BackupId | None = None
    if b_id == repo.committed(bucket)[-1]:
        backup_id = repo.next_backup_id(bucket)
    else:  # right after B, before the backups continuing from B (formats/repository.md §8.9)
        backup_id = BackupId(b_id.time + timedelta(microseconds=1))
        after = b_id
        done = next((m for m in repo.manifests(bucket) if m.backup_id == backup_id), None)
        if done is not None and done.merged_through == b_id:
            raise RepositoryError(
                f"--through {through}: backup {backup_id} already is the merge through it "
                "(a full backup of that state): restore or list that one"
            )
    sweep_unless_read(repo, bucket, backup_id, lock)  # it only adds: readers may go on
    directory = repo.new_backup_dir(bucket, backup_id, after=after)
    _clear(repo, directory)
    work = []
    held = sorted({e.partition for m in manifests for e in m.partitions})
    later = [m for m in repo.manifests(bucket) if m.backup_id > b_id]
    for p in held:
        rp = resume_point(manifests, p)
        if rp is None:
            continue
        steps = plan_state(manifests, at=b_id, partition=p)
        pos = rp.position
        work.append(PartitionWork(
            p, rp.failover_log.to_json(), pos.seq, (pos.snap_start, pos.snap_end),
            tuple(Piece(s.backup_id, s.segment.file, s.max_seq) for s in steps),
            sum(s.segment.bytes for s in steps), _later_cuts(later, p, pos.seq)))  # fmt: skip
    alive = frozenset(coll.id for _scope, coll in chain_manifest(manifests).collections())
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return MergeRun(repo.path, bucket, b_id, backup_id, after, directory,
                    f"{_SOURCE}{manifests[0].backup_id}..{through}", created, alive,
                    len(manifests), tuple(work))  # fmt: skip


def _later_cuts(later: list[Manifest], partition: int, end: int) -> tuple[int, ...]:
    """Where the backups after B cut a merge through B inside (0, end): the lowest start
    seq of the later backups holding the partition, as each one comes, while it is
    above 0 and below B's end (a rollback after B; formats/repository.md §8.9)."""
    cuts, low = [], end
    for m in later:
        e = m.partition(partition)
        if e is None or e.start_seq >= low:
            continue
        low = e.start_seq
        if low == 0:
            break
        cuts.append(low)
    return tuple(sorted(cuts))


def _clear(repo: Repository, directory: Path) -> None:
    """Remove the segment files a killed merge left in the directory it reuses."""
    for entry in repo.storage.list(directory):
        if entry.is_file:
            try:
                parse_segment_name(entry.name)
            except UprError:
                continue
            repo.storage.delete(directory / entry.name)


def commit(repo: Repository, run: MergeRun,
           written: Mapping[int, Sequence[Written]]) -> Manifest:  # fmt: skip
    """Write the manifest (the commit point): full, no parent, `merged_through` B when B
    is not the newest backup, the collections at B and the items written per collection."""
    manifests = [m for m in repo.manifests(run.bucket) if m.backup_id <= run.through]
    entries = [w.entry(written.get(w.partition, ())) for w in run.work]
    segments = [w for ws in written.values() for w in ws]
    per: dict[int, list[int]] = {}
    for w in segments:
        for cid, (items, deleted) in w.collections.items():
            got = per.setdefault(cid, [0, 0])
            got[0], got[1] = got[0] + items, got[1] + deleted
    now = datetime.now(UTC)
    manifest = Manifest(
        backup_id=run.backup_id, bucket=run.bucket, source=run.source, started=now,
        finished=now, full=True, parent=None, partitions=tuple(entries),
        totals=Totals.derive(entries, sum(w.raw_bytes for w in segments)),
        merged_through=run.after, collections=chain_manifest(manifests),
        collection_items=tuple(CollectionCount(cid, *n) for cid, n in sorted(per.items())),
    )  # fmt: skip
    repo.write_manifest(manifest)
    return manifest


def run(repo_dir: Path, *, through: str = "latest", bucket: str | None = None,
        write: Callable[[Repository, MergeRun], Iterable[tuple[int, tuple[Written, ...]]]],
        ) -> MergeSummary:  # fmt: skip
    """Resolve, lock, plan, `write` every partition (in this process or on Spark),
    commit; the summary of the merged backup."""
    t0 = time.monotonic()
    repo, name, at = _resolve(repo_dir, bucket, through)
    with RepositoryLock(repo, name) as lock:
        # a manifest file a killed run left missing is rewritten from its valid twin
        # (formats/repository.md §4.3), as the next backup does
        for path, why in repo.heal(name, lock):
            _log.warning("%s: %s; rewritten from its twin", path, why)
        plan = _prepare(repo, name, at, lock)
        written = dict(write(repo, plan))
        manifest = commit(repo, plan, written)
    records = sum(w.entry.records for ws in written.values() for w in ws)
    return MergeSummary(str(plan.backup_id), at, plan.merged, len(plan.work), records,
                        manifest.totals.bytes_written, time.monotonic() - t0)  # fmt: skip


def merge(repo_dir: Path, *, through: str = "latest", bucket: str | None = None,
          progress: Callable[[int, int, int], None] | None = None) -> MergeSummary:  # fmt: skip
    """`upr merge`: write and commit the merged full backup on this machine."""
    return run(repo_dir, through=through, bucket=bucket,
               write=lambda repo, plan: write_local(repo, plan, progress))  # fmt: skip
