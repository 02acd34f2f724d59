"""Chain semantics: which records of which backups make up a partition's state.

Theory of operation (the normative statement with examples is formats/repository.md §8
"Chains"; docs/design.md explains positions and rollbacks): backups of one bucket are
ordered by id. For partition p, a backup J holds the records of its stream (start_J,
end_J]. The state at backup K takes from each backup J ≤ K only the records with seq ≤
cut(J, K), where cut(J, K) is the lowest start seq of any backup after J up to K, and ∞
(`NO_CUT`) for J = K. Only backups that hold p take part: a backup without p neither
contributes records nor cuts. Because every later backup starts at or above each cut,
the kept ranges are disjoint and increase with the backup, so "latest seq per key wins"
is also "latest backup wins". Records above a cut are lost writes: a former master
acknowledged them, the new branch does not have them; they stay addressable.

Before any of this is used, a reader checks that the chain it needs is whole
(formats/repository.md §8.8): `needed_from` says which backups the state at K can depend
on, and within them no manifest may be damaged, no parent missing (`broken_parents`), no
seq uncovered (`coverage_gaps`); `Repository.chain` does the checking and names the
missing piece.

Everything here is pure: functions of manifests, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from itertools import pairwise
from typing import NamedTuple

from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition
from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.manifest import Manifest, PartitionEntry, SegmentEntry
from upr_cli.repo.names import BackupId

NO_CUT = 1 << 64
"""cut(K, K): above every 64-bit seq (∞ in formats/repository.md §8.1)."""


class PlanStep(NamedTuple):
    """Read the records of `segment` (of backup `backup_id`) with seq ≤ `max_seq`.

    `file` is the segment's path in the backup directory when it is not `segment.file`
    (a cut-back segment, `cut-K/NAME`, read by `--before-failover`: upr_cli/repo/pitr.py)."""

    backup_id: BackupId
    segment: SegmentEntry
    max_seq: int
    file: str = ""

    @property
    def name(self) -> str:
        """The path of the segment to read, relative to its backup directory."""
        return self.file or self.segment.file


class SeqRange(NamedTuple):
    """The seqs in (`from_seq`, `to_seq`] of one backup's partition (lost or missing)."""

    backup_id: BackupId
    from_seq: int
    to_seq: int


class ResumePoint(NamedTuple):
    """Where the next incremental backup of a partition starts (formats/repository.md §8.4):
    the stream position the newest backup holding it ended at, and its failover log."""

    position: StreamPosition
    failover_log: FailoverLog


class Held(NamedTuple):
    """A backup holding a partition, and the partition's entry in its manifest."""

    backup_id: BackupId
    entry: PartitionEntry


class ParentMismatch(NamedTuple):
    """An incremental backup whose recorded parent is not the backup before it."""

    backup_id: BackupId
    expected: BackupId | None
    recorded: BackupId | None


def ordered(manifests: Sequence[Manifest]) -> list[Manifest]:
    """The manifests sorted by backup id; mixed buckets or a repeated id are errors."""
    # by the id's time (its one field, so the same order), compared in C: a chain of
    # 10,000 commits is ordered once per partition a restore plans
    out = sorted(manifests, key=_id_time)
    for a, b in pairwise(out):
        if a.backup_id.time == b.backup_id.time:
            raise RepositoryError(f"backup {a.backup_id} appears twice in the chain")
        if a.bucket != b.bucket:
            raise RepositoryError(
                f"backups {a.backup_id} and {b.backup_id} belong to different buckets "
                f"({a.bucket!r}, {b.bucket!r})"
            )
    return out


def _id_time(m: Manifest) -> datetime:
    return m.backup_id.time


def _holding(manifests: Sequence[Manifest], partition: int, at: BackupId | None) -> list[Held]:
    """(id, entry) of the backups up to `at` (all when None) that hold `partition`."""
    chain = ordered(manifests)
    when = None if at is None else at.time
    if when is not None and not any(m.backup_id.time == when for m in chain):
        raise RepositoryError(f"backup {at} is not in the chain")
    out = []
    for m in chain:
        if when is not None and m.backup_id.time > when:
            break
        entry = m.partition(partition)
        if entry is not None:
            out.append(Held(m.backup_id, entry))
    return out


def _cuts(held: list[Held]) -> list[int]:
    """cut(J, K) for each J in `held`, K being the last: suffix minima of start seqs."""
    cuts = [NO_CUT] * len(held)
    lowest = NO_CUT
    for i in range(len(held) - 1, -1, -1):
        cuts[i] = lowest
        lowest = min(lowest, held[i].entry.start_seq)
    return cuts


def cut(manifests: Sequence[Manifest], partition: int, j: BackupId, k: BackupId) -> int:
    """cut(J, K): lowest start seq of a backup after J up to K holding p; `NO_CUT` if none."""
    if j > k:
        raise RepositoryError(f"cut({j}, {k}) needs J ≤ K")
    if not any(m.backup_id == j for m in manifests):
        raise RepositoryError(f"backup {j} is not in the chain")
    starts = [e.start_seq for bid, e in _holding(manifests, partition, k) if bid > j]
    return min(starts, default=NO_CUT)


def plan_state(
    manifests: Sequence[Manifest], *, at: BackupId, partition: int, clip: int | None = None
) -> list[PlanStep]:
    """The segments, in order, whose records with seq ≤ max_seq make p's state at `at`.

    With `clip`, `at`'s own records are read only up to seq `clip` (a restore point
    inside the backup: upr_cli/repo/pitr.py); earlier backups are cut as without it."""
    held = _holding(manifests, partition, at)
    cuts = _cuts(held)
    if clip is not None and held and held[-1].backup_id == at:
        cuts[-1] = min(cuts[-1], clip)
    steps = []
    for (bid, entry), c in zip(held, cuts, strict=True):
        for seg in entry.segments:
            if seg.first_seq > c:
                break  # segments are in seq order
            steps.append(PlanStep(bid, seg, min(seg.last_seq, c)))
    return steps


def _agreement(j: PartitionEntry, later: PartitionEntry) -> int:
    """How far `later`'s history agrees with j's (formats/repository.md §8.3).

    A later backup that started above 0 says it exactly: its start is where the source
    put it (the previous end, or a rollback point). One that started at 0 (a full backup,
    a merge, a rollback to 0) says nothing by its start; the two failover logs do: the
    newest branch both hold, followed until either left it (`common_history`). Logs
    that share no branch agree nowhere (0).
    """
    found = _agreement_by_start(j, later)
    # a revision that took over removed backups agrees no further than they did
    # (formats/repository.md §5.10)
    return found if later.lost_bound is None else min(found, later.lost_bound)


def _agreement_by_start(j: PartitionEntry, later: PartitionEntry) -> int:
    if later.start_seq > 0:
        # a rollback onto a snapshot boundary starts below where the histories part:
        # the records up to the rule's answer are streamed again, not lost
        # (formats/repository.md §5.5)
        if later.rollback is not None:
            return max(later.start_seq, min(later.rollback.branch_seq, later.rollback.from_seq))
        return later.start_seq
    return common_history(j.failover_log, later.failover_log)


def common_history(j: FailoverLog, later: FailoverLog) -> int:
    """How far two failover logs share their history: the newest branch (uuid) of `j`'s
    log that `later`'s also holds, followed until either log leaves it (the seq of its
    next newer entry there; for ever while it is a log's latest); 0 when they share none
    (formats/repository.md §8.3)."""
    theirs = {e.uuid: i for i, e in enumerate(later.entries)}
    mine = j.entries
    for i, e in enumerate(mine):
        k = theirs.get(e.uuid)
        if k is None:
            continue
        left_mine = NO_CUT if i == 0 else mine[i - 1].seq
        left_theirs = NO_CUT if k == 0 else later.entries[k - 1].seq
        return min(left_mine, left_theirs)
    return 0


def _lost_cuts(held: list[Held]) -> list[int]:
    """lost_cut(J, K) for each J in `held`, K being the last."""
    return [
        min((_agreement(e, later) for _b, later in held[i + 1 :]), default=NO_CUT)
        for i, (_bid, e) in enumerate(held)
    ]


def lost_cut(manifests: Sequence[Manifest], partition: int, j: BackupId, k: BackupId) -> int:
    """lost_cut(J, K): J's records above it are lost writes at K; `NO_CUT` if none.

    As formats/repository.md §8.3 defines it.
    """
    held = _holding(manifests, partition, k)
    for (bid, _e), c in zip(held, _lost_cuts(held), strict=True):
        if bid == j:
            return c
    return NO_CUT


def lost_ranges(
    manifests: Sequence[Manifest], partition: int, *, at: BackupId | None = None
) -> list[SeqRange]:
    """Per backup, the seqs (from, to] above its lost cut at `at` (default: newest): the
    writes the history that continued does not have (formats/repository.md §8.3)."""
    held = _holding(manifests, partition, at)
    out = []
    for (bid, entry), c in zip(held, _lost_cuts(held), strict=True):
        low = max(c, entry.start_seq)
        if low < entry.end_seq:
            out.append(SeqRange(bid, low, entry.end_seq))
    return out


def snapshot_boundaries(
    manifests: Sequence[Manifest],
    partition: int,
    snapshots_of: Callable[[BackupId, SegmentEntry], Sequence[tuple[int, int]]] | None = None,
) -> list[int]:
    """Snapshot boundaries of p's state at the newest backup, ascending: seqs s where
    the chain's records up to s are a state the source had (formats/repository.md §8.4),
    so that a rollback can land there. Each backup's end when its last snapshot was
    received whole, and not cut by a later backup; with `snapshots_of` (the markers a
    segment's header lists), the ends of the newest holding backup's snapshots too."""
    held = _holding(manifests, partition, None)
    out = {0}
    for (_bid, e), c in zip(held, _cuts(held), strict=True):
        if e.end_seq == e.snap_end and e.end_seq <= c:
            out.add(e.end_seq)
    if held and snapshots_of is not None:
        bid, e = held[-1]
        marks = [(s, end, seg.last_seq) for seg in e.segments for s, end in snapshots_of(bid, seg)]
        # a marker followed by one starting below its end was cut off (the stream
        # restarted inside it), whatever the writer recorded
        later_start = NO_CUT
        for s, end, last in reversed(marks):
            if end <= later_start and e.start_seq <= end <= min(last, e.end_seq):
                out.add(end)
            later_start = min(later_start, s)
    return sorted(out)


def resume_point(manifests: Sequence[Manifest], partition: int) -> ResumePoint | None:
    """Where the next backup streams p from: the newest backup holding p, or None."""
    held = _holding(manifests, partition, None)
    if not held:
        return None
    e = held[-1].entry
    position = StreamPosition(partition, e.uuid, e.end_seq, e.snap_start, e.snap_end)
    return ResumePoint(position, e.failover_log)


def coverage_gaps(
    manifests: Sequence[Manifest], partition: int, *, at: BackupId | None = None
) -> list[SeqRange]:
    """Seqs no backup covers: (previous end, start] where a backup starts above it.

    The first backup holding p has previous end 0. With `at`, only the gaps in the state
    at `at`, clipped to the part that state needs: (previous end, lowest start seq of this
    or any later backup up to `at`].
    """
    held = _holding(manifests, partition, at)
    cuts = _cuts(held) if at is not None else None
    out = []
    prev_end = 0
    for i, (bid, entry) in enumerate(held):
        upper = entry.start_seq if cuts is None else min(entry.start_seq, cuts[i])
        if upper > prev_end:
            out.append(SeqRange(bid, prev_end, upper))
        prev_end = entry.end_seq
    return out


def broken_parents(manifests: Sequence[Manifest]) -> list[ParentMismatch]:
    """Incremental backups whose parent is not the backup just before them in the chain."""
    out = []
    previous: Manifest | None = None
    for m in ordered(manifests):
        # a merge stands in for the backup it merges through (formats/repository.md §8.9)
        allowed = set() if previous is None else {previous.backup_id, previous.merged_through}
        if not m.full and m.parent not in allowed:
            before = None if previous is None else previous.backup_id
            out.append(ParentMismatch(m.backup_id, before, m.parent))
        previous = m
    return out


def needed_from(manifests: Sequence[Manifest], at: BackupId) -> BackupId | None:
    """The oldest backup the state at `at` can depend on (formats/repository.md §8.8):
    the newest full backup up to `at` that holds every partition any backup up to `at`
    holds (it starts them all at 0, so every earlier backup is cut away,
    formats/repository.md §8.1), or None when there is none and the whole chain up to `at`
    counts."""
    upto = [m for m in ordered(manifests) if m.backup_id <= at]
    held = {e.partition for m in upto for e in m.partitions}
    for m in reversed(upto):
        if m.full and held <= set(m.partition_ids):
            return m.backup_id
    return None
