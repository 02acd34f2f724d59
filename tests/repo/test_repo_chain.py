"""Chain semantics (docs/design.md "Chain semantics"): hand-made chains, a brute-force oracle.

The exact rules are formats/repository.md §8.1 and §8.3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.repo.repo_helpers import bid
from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition
from upr_cli.repo import (
    NO_CUT,
    BackupId,
    Manifest,
    ParentMismatch,
    PartitionEntry,
    PlanStep,
    RepositoryError,
    ResumePoint,
    RollbackRecord,
    SegmentEntry,
    SeqRange,
    Totals,
    broken_parents,
    coverage_gaps,
    cut,
    format_segment_name,
    lost_cut,
    lost_ranges,
    plan_state,
    resume_point,
    snapshot_boundaries,
)

LOG_A = FailoverLog.of([(0xA, 0)])
LOG_B = FailoverLog.of([(0xB, 80), (0xA, 0)])


def seg(p: int, seqs: list[int]) -> SegmentEntry:
    """A segment holding exactly these seqs."""
    name = format_segment_name(p, seqs[0], seqs[-1])
    return SegmentEntry(name, seqs[0], seqs[-1], len(seqs), 100, "0" * 32)


def entry(
    p: int,
    start: int,
    end: int,
    segments: list[list[int]],
    log: FailoverLog = LOG_A,
    rollback: RollbackRecord | None = None,
) -> PartitionEntry:
    segs = tuple(seg(p, s) for s in segments)
    return PartitionEntry(p, log.latest.uuid, log, start, end, end, end, segs, rollback)


def backup(i: int, parent: int | None, *entries: PartitionEntry, bucket: str = "b") -> Manifest:
    return Manifest(
        bid(i),
        bucket,
        "upr://h:11210/b",
        bid(i).time,
        bid(i).time,
        parent is None,
        None if parent is None else bid(parent),
        tuple(entries),
        Totals.derive(entries, 0),
    )


def r(lo: int, hi: int) -> list[int]:
    return list(range(lo, hi + 1))


# The example of formats/repository.md §8.7 (also docs/design.md "Chain semantics"):
# backup 1 covers 0..100; the source fails over, and backup 2 is told to roll back to 80
# and covers 80..150 on the new branch.
B1 = backup(1, None, entry(0, 0, 100, [r(1, 50), r(51, 100)]))
B2 = backup(
    2,
    1,
    entry(0, 80, 150, [r(81, 150)], LOG_B, RollbackRecord(100, 80, 80, 80)),
)


def test_design_example() -> None:
    chain = [B2, B1]  # order of the input does not matter
    s1, s2 = B1.partitions[0].segments
    (s3,) = B2.partitions[0].segments
    assert cut(chain, 0, bid(1), bid(2)) == 80
    assert cut(chain, 0, bid(2), bid(2)) == NO_CUT == cut(chain, 0, bid(1), bid(1))
    assert plan_state(chain, at=bid(2), partition=0) == [
        PlanStep(bid(1), s1, 50),
        PlanStep(bid(1), s2, 80),  # backup 1's records ≤ 80 only
        PlanStep(bid(2), s3, 150),
    ]
    assert plan_state(chain, at=bid(1), partition=0) == [
        PlanStep(bid(1), s1, 50),
        PlanStep(bid(1), s2, 100),
    ]
    assert lost_ranges(chain, 0) == [SeqRange(bid(1), 80, 100)]  # (80, 100]
    assert lost_ranges(chain, 0, at=bid(1)) == []
    assert coverage_gaps(chain, 0) == [] == coverage_gaps(chain, 0, at=bid(2))
    assert resume_point(chain, 0) == ResumePoint(StreamPosition(0, 0xB, 150, 150, 150), LOG_B)
    assert resume_point([B1], 0) == ResumePoint(StreamPosition(0, 0xA, 100, 100, 100), LOG_A)
    assert resume_point(chain, 1) is None and plan_state(chain, at=bid(2), partition=1) == []
    assert broken_parents(chain) == []


def test_a_second_lower_rollback_cuts_both_earlier_backups() -> None:
    b3 = backup(3, 2, entry(0, 50, 200, [r(51, 200)], rollback=RollbackRecord(150, 50, 50, 60)))
    chain = [B1, B2, b3]
    assert cut(chain, 0, bid(1), bid(3)) == 50 == cut(chain, 0, bid(2), bid(3))
    plan = plan_state(chain, at=bid(3), partition=0)
    assert [(s.backup_id, s.max_seq) for s in plan] == [(bid(1), 50), (bid(3), 200)]
    assert lost_ranges(chain, 0) == [SeqRange(bid(1), 50, 100), SeqRange(bid(2), 80, 150)]


def test_a_gap_and_a_full_backup_that_heals_it() -> None:
    b2 = backup(2, 1, entry(0, 120, 130, [r(121, 130)]))
    chain = [B1, b2]
    assert coverage_gaps(chain, 0) == [SeqRange(bid(2), 100, 120)]
    assert coverage_gaps(chain, 0, at=bid(2)) == [SeqRange(bid(2), 100, 120)]
    assert coverage_gaps(chain, 0, at=bid(1)) == []
    b3 = backup(3, None, entry(0, 0, 140, [r(1, 140)]))
    chain.append(b3)
    assert coverage_gaps(chain, 0) == [SeqRange(bid(2), 100, 120)]  # the chain has a hole
    assert coverage_gaps(chain, 0, at=bid(3)) == []  # but the state at 3 does not need it
    assert [s.backup_id for s in plan_state(chain, at=bid(3), partition=0)] == [bid(3)]
    # the full backup carries on the same history: nothing the older ones hold is lost
    assert lost_ranges(chain, 0) == []
    assert lost_cut(chain, 0, bid(1), bid(3)) == 120  # b2 started at 120; b3 agrees for ever
    assert lost_cut(chain, 0, bid(2), bid(3)) == NO_CUT
    # a full backup of a source that failed over at 90 (new branch C): above 90 is lost
    log_c = FailoverLog.of([(0xC, 90), (0xA, 0)])
    chain[-1] = backup(3, None, entry(0, 0, 140, [r(1, 140)], log_c))
    assert lost_ranges(chain, 0) == [SeqRange(bid(1), 90, 100), SeqRange(bid(2), 120, 130)]
    # ... and one whose log does not know the older branch at all: all of it is lost
    chain[-1] = backup(3, None, entry(0, 0, 140, [r(1, 140)], FailoverLog.of([(0xD, 0)])))
    assert lost_ranges(chain, 0) == [SeqRange(bid(1), 0, 100), SeqRange(bid(2), 120, 130)]


def test_first_backup_not_from_zero_is_a_gap() -> None:
    chain = [backup(1, None, entry(0, 0, 0, [])), backup(2, 1, entry(5, 10, 20, [r(11, 20)]))]
    assert coverage_gaps(chain, 5) == [SeqRange(bid(2), 0, 10)]
    chain.append(backup(3, 2, entry(5, 4, 4, [])))  # a later backup starts lower
    assert coverage_gaps(chain, 5) == [SeqRange(bid(2), 0, 10)]
    assert coverage_gaps(chain, 5, at=bid(3)) == [SeqRange(bid(2), 0, 4)]  # clipped


def test_a_backup_without_the_partition_neither_contributes_nor_cuts() -> None:
    b2 = backup(2, 1, entry(1, 0, 10, [r(1, 10)]))  # holds partition 1 only
    b3 = backup(3, 2, entry(0, 100, 120, [r(101, 120)]))
    chain = [B1, b2, b3]
    assert cut(chain, 0, bid(1), bid(2)) == NO_CUT
    assert [s.max_seq for s in plan_state(chain, at=bid(2), partition=0)] == [50, 100]
    assert [s.backup_id for s in plan_state(chain, at=bid(3), partition=0)] == [
        bid(1),
        bid(1),
        bid(3),
    ]
    assert coverage_gaps(chain, 0) == [] and lost_ranges(chain, 0) == []
    assert resume_point(chain, 0) == ResumePoint(StreamPosition(0, 0xA, 120, 120, 120), LOG_A)
    assert resume_point(chain, 1) == ResumePoint(StreamPosition(1, 0xA, 10, 10, 10), LOG_A)


def test_chain_errors() -> None:
    with pytest.raises(RepositoryError, match="appears twice"):
        plan_state([B1, B1], at=bid(1), partition=0)
    with pytest.raises(RepositoryError, match="different buckets"):
        lost_ranges([B1, backup(2, 1, entry(0, 100, 100, []), bucket="c")], 0)
    with pytest.raises(RepositoryError, match="not in the chain"):
        plan_state([B1], at=bid(2), partition=0)
    with pytest.raises(RepositoryError, match="J ≤ K"):
        cut([B1, B2], 0, bid(2), bid(1))
    with pytest.raises(RepositoryError, match="not in the chain"):
        cut([B1], 0, bid(0), bid(1))


def test_broken_parents() -> None:
    b3 = backup(3, 1, entry(0, 100, 100, []))
    assert broken_parents([B1, B2, b3]) == [ParentMismatch(bid(3), bid(2), bid(1))]


# -- the brute-force oracle ----------------------------------------------------------


@dataclass
class Chain:
    manifests: list[Manifest] = field(default_factory=list)
    records: dict[tuple[BackupId, str], list[int]] = field(default_factory=dict)


@st.composite
def chains(draw: st.DrawFn) -> Chain:
    chain = Chain()
    ends: dict[int, int] = {}
    for i in range(draw(st.integers(1, 6))):
        full = i == 0 or draw(st.integers(0, 5)) == 0
        parts = []
        for p in (0, 1):
            if draw(st.integers(0, 4)) == 0:
                continue  # this backup does not hold p
            start = 0 if full else draw(st.integers(0, ends.get(p, 0) + 3))
            end = start + draw(st.integers(0, 12))
            seqs = sorted(draw(st.sets(st.integers(start + 1, end))) if end > start else [])
            cuts = sorted(draw(st.sets(st.integers(1, max(1, len(seqs) - 1)), max_size=3)))
            groups = [seqs[a:b] for a, b in zip([0, *cuts], [*cuts, len(seqs)], strict=True)]
            groups = [g for g in groups if g]
            e = entry(p, start, end, groups)
            for s, g in zip(e.segments, groups, strict=True):
                chain.records[(bid(i), s.file)] = g
            parts.append(e)
            ends[p] = end
        chain.manifests.append(backup(i, None if full else i - 1, *parts))
    return chain


def brute_cut(chain: Chain, p: int, j: int, k: int) -> int | None:
    """formats/repository.md §8.1, literally: None is ∞."""
    starts = [
        e.start_seq
        for m in chain.manifests[j + 1 : k + 1]
        if (e := m.partition(p)) is not None
    ]  # fmt: skip
    return min(starts) if starts else None


def brute_lost_cut(chain: Chain, p: int, j: int, k: int) -> int | None:
    """formats/repository.md §8.3 literally, for these chains (every backup on branch A): a
    later backup that started above 0 agrees up to its start; one from 0 carries branch A
    on (∞)."""
    starts = [
        e.start_seq
        for m in chain.manifests[j + 1 : k + 1]
        if (e := m.partition(p)) is not None and e.start_seq > 0
    ]  # fmt: skip
    return min(starts) if starts else None


def brute_state(chain: Chain, p: int, k: int) -> set[tuple[BackupId, int]]:
    out = set()
    for j, m in enumerate(chain.manifests[: k + 1]):
        e = m.partition(p)
        if e is None:
            continue
        c = brute_cut(chain, p, j, k)
        for s in e.segments:
            out |= {(m.backup_id, x) for x in chain.records[(m.backup_id, s.file)]
                    if c is None or x <= c}  # fmt: skip
    return out


@settings(max_examples=300, deadline=None)
@given(chains(), st.integers(0, 5), st.sampled_from([0, 1]))
def test_plan_state_equals_the_definition(chain: Chain, k: int, p: int) -> None:
    k = min(k, len(chain.manifests) - 1)
    at = chain.manifests[k].backup_id
    plan = plan_state(chain.manifests, at=at, partition=p)
    chosen = {
        (step.backup_id, x)
        for step in plan
        for x in chain.records[(step.backup_id, step.segment.file)]
        if x <= step.max_seq
    }
    assert chosen == brute_state(chain, p, k)
    assert all(step.max_seq >= step.segment.first_seq for step in plan)  # no empty steps
    order = [(s.backup_id, s.segment.first_seq) for s in plan]
    assert order == sorted(order)
    seqs = [x for b, x in sorted(chosen)]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # latest backup = latest seq
    for j, m in enumerate(chain.manifests[: k + 1]):
        expected = brute_cut(chain, p, j, k)
        assert cut(chain.manifests, p, m.backup_id, at) == (
            NO_CUT if expected is None else expected
        )


@settings(max_examples=300, deadline=None)
@given(chains(), st.integers(0, 5), st.sampled_from([0, 1]))
def test_lost_ranges_and_gaps_equal_the_definition(chain: Chain, k: int, p: int) -> None:
    k = min(k, len(chain.manifests) - 1)
    at = chain.manifests[k].backup_id
    held = [(j, e) for j, m in enumerate(chain.manifests[: k + 1]) if (e := m.partition(p))]
    lost, covered = set(), set()
    for j, e in held:
        c = brute_cut(chain, p, j, k)
        lc = brute_lost_cut(chain, p, j, k)
        for x in range(e.start_seq + 1, e.end_seq + 1):
            if c is None or x <= c:
                covered.add(x)
            if lc is not None and x > lc:
                lost.add((chain.manifests[j].backup_id, x))
    got_lost = {
        (r.backup_id, x)
        for r in lost_ranges(chain.manifests, p, at=at)
        for x in range(r.from_seq + 1, r.to_seq + 1)
    }
    assert got_lost == lost
    top = held[-1][1].end_seq if held else 0
    missing = set(range(1, top + 1)) - covered
    gaps = coverage_gaps(chain.manifests, p, at=at)
    got_missing = {x for g in gaps for x in range(g.from_seq + 1, g.to_seq + 1)}
    assert got_missing == missing
    assert all(g.from_seq < g.to_seq for g in gaps)


# --- snapshot boundaries (formats/repository.md §8.4) ------------------------------------


def test_snapshot_boundaries_of_a_chain() -> None:
    b1 = backup(1, None, entry(0, 0, 100, [r(1, 50), r(51, 100)]))
    b2 = backup(2, 1, entry(0, 100, 220, [r(101, 150), r(151, 220)]))
    marks = {
        r(101, 150)[0]: ((101, 120), (121, 150)),
        # the stream restarted at 170 inside [151, 200]: that end is no boundary
        r(151, 220)[0]: ((151, 200), (170, 220)),
    }

    def snapshots_of(_bid: BackupId, segment: SegmentEntry) -> tuple[tuple[int, int], ...]:
        return marks[segment.first_seq]

    assert snapshot_boundaries([b1, b2], 0) == [0, 100, 220]
    assert snapshot_boundaries([b1, b2], 0, snapshots_of) == [0, 100, 120, 150, 220]
    # a rollback to 80 cuts backup 1's end: it is no boundary of the newest state
    b3 = backup(3, 2, entry(0, 80, 90, [r(81, 90)], LOG_B, RollbackRecord(220, 80, 80, 80)))
    assert snapshot_boundaries([b1, b2, b3], 0) == [0, 90]


def test_lost_writes_start_above_the_branch_seq_not_the_boundary() -> None:
    """Backup 2 was told to roll back to 80 (the branch seq) and started at the boundary
    50: backup 1's records in (50, 80] are streamed again, only those above 80 are lost."""
    b1 = backup(1, None, entry(0, 0, 100, [r(1, 50), r(51, 100)]))
    b2 = backup(2, 1, entry(0, 50, 150, [r(51, 150)], LOG_B, RollbackRecord(100, 50, 80, 80)))
    assert lost_cut([b1, b2], 0, bid(1), bid(2)) == 80
    assert lost_ranges([b1, b2], 0) == [SeqRange(bid(1), 80, 100)]
    assert cut([b1, b2], 0, bid(1), bid(2)) == 50  # the state still takes only up to 50
