"""Point-in-time resolution (upr_cli/repo/pitr.py, docs/design.md "Point-in-time
restore"): restore points, coarse stretches, `--at-time`, `--at-seq`, the numbered
failovers and `--before-failover`, on hand-made chains; and the one TIME parser."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from tests.repo.repo_helpers import T0
from tests.repo.test_repo_chain import LOG_A, LOG_B, entry, r, seg
from upr_cli.errors import UsageError
from upr_cli.repo import (
    NO_CUT,
    BackupId,
    CutBack,
    Manifest,
    PartitionEntry,
    RollbackRecord,
    SeqRange,
    Totals,
)
from upr_cli.repo.pitr import (
    AtSeqs,
    Pick,
    PitrRangeError,
    Stretch,
    failovers,
    looks_like_time,
    parse_time,
    resolve_failover,
    resolve_seqs,
    resolve_time,
    restore_points,
    resume_at,
    timeline,
)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def commit(
    ident: float,
    finished: float,
    parent: Manifest | None,
    *entries: PartitionEntry,
    since: float | None = None,
) -> Manifest:
    """A backup with id T0+`ident` s; continuous (watched from `since`) when since is set."""
    b = BackupId(at(ident))
    return Manifest(
        b,
        "b",
        "upr://h/b",
        b.time,
        at(finished),
        parent is None,
        None if parent is None else parent.backup_id,
        tuple(entries),
        Totals.derive(entries, 0),
        continuous=None if since is None else at(since),
    )


def pts(*pairs: tuple[int, float]) -> tuple[tuple[int, datetime], ...]:
    return tuple((s, at(t)) for s, t in pairs)


def with_points(e: PartitionEntry, *pairs: tuple[int, float]) -> PartitionEntry:
    return PartitionEntry(
        e.partition,
        e.uuid,
        e.failover_log,
        e.start_seq,
        e.end_seq,
        e.snap_start,
        e.snap_end,
        e.segments,
        points=pts(*pairs),
    )


# An ordinary full backup, two continuous commits, the follower stopped (180 s to 400 s),
# a third commit whose entry lists no points.
B0 = commit(0, 1, None, entry(0, 0, 10, [r(1, 10)]), entry(1, 0, 5, [r(1, 5)]))
C1 = commit(
    61,
    120,
    B0,
    with_points(entry(0, 10, 30, [r(11, 20), r(21, 30)]), (20, 80), (30, 110)),
    since=60,
)
C2 = commit(
    121,
    180,
    C1,
    with_points(entry(1, 5, 9, [r(6, 9)]), (9, 150)),
    with_points(entry(2, 0, 4, [r(1, 4)]), (4, 170)),
    since=120,
)
C3 = commit(401, 480, C2, entry(0, 30, 40, [r(31, 40)]), since=400)
CHAIN = [B0, C1, C2, C3]


def test_restore_points_in_chain_order() -> None:
    assert [(p.backup_id, p.seq, p.time) for p in restore_points(CHAIN, 0)] == [
        (B0.backup_id, 10, at(1)),
        (C1.backup_id, 20, at(80)),
        (C1.backup_id, 30, at(110)),
        (C3.backup_id, 40, at(480)),
    ]


def test_timeline_range_and_coarse_stretches() -> None:
    tl = timeline(CHAIN)
    assert tl is not None
    assert (tl.oldest, tl.last) == (at(1), at(480))
    assert tl.coarse == (Stretch(at(1), at(60)), Stretch(at(180), at(400)))
    assert tl.stretch_of(at(90)) is None and tl.stretch_of(at(60)) is None
    # an ordinary chain: every moment between two backups is coarse
    plain = timeline([B0, commit(100, 101, B0, entry(0, 10, 12, [r(11, 12)]))])
    assert plain is not None and plain.coarse == (Stretch(at(1), at(101)),)


def test_a_time_inside_a_watched_stretch() -> None:
    res = resolve_time(CHAIN, at(90))
    assert res.picks == {0: Pick(C1.backup_id, 20), 1: Pick(B0.backup_id, 5)}
    assert res.not_restored == [2]  # its first point is at 170 s
    assert res.stretch is None and res.max_lag == 0
    # the clip: C1's second segment (21-30) is not read, B0 is cut at C1's start
    steps = res.picks[0].steps(CHAIN, 0)
    assert [(s.backup_id, s.segment.first_seq, s.max_seq) for s in steps] == [
        (B0.backup_id, 1, 10),
        (C1.backup_id, 11, 20),
    ]
    assert resolve_time(CHAIN, at(115)).picks[0] == Pick(C1.backup_id, 30)
    assert resolve_time(CHAIN, at(480)).picks[0] == Pick(C3.backup_id, 40)


def test_a_time_in_a_coarse_stretch_reports_how_far_before() -> None:
    res = resolve_time(CHAIN, at(300))
    assert res.stretch == Stretch(at(180), at(400))
    assert res.picks == {
        0: Pick(C1.backup_id, 30),
        1: Pick(C2.backup_id, 9),
        2: Pick(C2.backup_id, 4),
    }
    assert res.lag == {0: 120.0, 1: 120.0, 2: 120.0} and res.max_lag == 120.0
    assert "2 min before it" in "\n".join(res.describe())
    early = resolve_time(CHAIN, at(30))
    assert early.picks[0] == Pick(B0.backup_id, 10) and early.max_lag == 29.0


@pytest.mark.parametrize("t", [0.5, 481])
def test_a_time_outside_the_range_is_one_line_naming_it(t: float) -> None:
    with pytest.raises(PitrRangeError) as exc:
        resolve_time(CHAIN, at(t), bucket="b")
    msg = str(exc.value)
    assert "\n" not in msg and "restorable range of bucket b" in msg
    assert "2026-11-21T06:15:01.000000Z to 2026-11-21T06:23:00.000000Z" in msg
    assert exc.value.exit_code == 2


def test_at_seq_rounds_down_to_a_snapshot_boundary() -> None:
    res = resolve_seqs(CHAIN, {0: 25})
    assert res.picks == {0: Pick(C1.backup_id, 20)}
    assert res.notices == [
        "partition 0: seq 25 is inside a snapshot: restored to the snapshot boundary below it, 20"
    ]
    exact = resolve_seqs(CHAIN, {0: 30, 1: 5})
    assert exact.picks == {0: Pick(C1.backup_id, 30), 1: Pick(B0.backup_id, 5)}
    assert exact.notices == []
    assert resolve_seqs(CHAIN, {0: 10}).picks[0] == Pick(B0.backup_id, 10)
    nothing = resolve_seqs(CHAIN, {0: 5}).picks[0]  # below the first boundary: empty
    assert nothing.clip == 0 and nothing.steps(CHAIN, 0) == []
    with pytest.raises(PitrRangeError, match="partition 0 ends at seq 40"):
        resolve_seqs(CHAIN, {0: 45})
    with pytest.raises(PitrRangeError, match="no backup holds partition 7"):
        resolve_seqs(CHAIN, {7: 1})
    assert AtSeqs.parse("3:1500, 0:7").seqs == ((0, 7), (3, 1500))
    for bad in ("3", "a:1", "1:2,1:3"):
        with pytest.raises(UsageError):
            AtSeqs.parse(bad)


def test_at_seq_uses_the_segment_markers_too() -> None:
    def snapshots_of(_b: BackupId, _s: object) -> tuple[tuple[int, int], ...]:
        return ((31, 35), (36, 40))  # C3 received two snapshots

    assert resolve_seqs(CHAIN, {0: 37}).picks[0] == Pick(C1.backup_id, 30)
    assert resolve_seqs(CHAIN, {0: 37}, snapshots_of).picks[0] == Pick(C3.backup_id, 35)


# A chain with failovers: F1 rolls partition 0 back (80 of 100), F2 cut back
# partition 1 in mid-run (66-75 taken back, the run went on from 65).
F0 = commit(0, 1, None, entry(0, 0, 100, [r(1, 100)]), entry(1, 0, 50, [r(1, 50)]))
F1 = commit(
    10,
    11,
    F0,
    entry(0, 80, 150, [r(81, 150)], LOG_B, RollbackRecord(100, 80, 80, 80)),
    entry(1, 50, 60, [r(51, 60)]),
)
_P1 = entry(1, 60, 70, [r(61, 70)])
F2 = commit(
    20,
    21,
    F1,
    PartitionEntry(
        1,
        _P1.uuid,
        LOG_A,
        60,
        70,
        70,
        70,
        _P1.segments,
        cut_backs=(CutBack(75, 65, (seg(1, r(66, 75)),)),),
    ),
)
F3 = commit(30, 31, F2, entry(0, 150, 160, [r(151, 160)], LOG_B))
FAILS = [F0, F1, F2, F3]


def test_failovers_are_numbered_with_their_lost_writes() -> None:
    events = failovers(FAILS)
    assert [(f.number, f.backup_id, f.time, f.partitions) for f in events] == [
        (1, F1.backup_id, at(11), (0,)),
        (2, F2.backup_id, at(21), (1,)),
    ]
    assert events[0].lost == ((0, SeqRange(F0.backup_id, 80, 100)),)
    assert events[1].lost == ((1, SeqRange(F2.backup_id, 65, 75)),)
    assert events[0].to_json()["lost_seq_count"] == 20
    assert failovers(CHAIN) == []


def test_before_failover_gives_the_old_branch() -> None:
    first = resolve_failover(FAILS, 1)
    assert first.picks == {0: Pick(F0.backup_id), 1: Pick(F0.backup_id)}
    # partition 0 on its old branch: all of F0's 1-100, the 81-100 F1 took back included
    assert [(s.segment.first_seq, s.max_seq) for s in first.picks[0].steps(FAILS, 0)] == [(1, 100)]
    second = resolve_failover(FAILS, 2)
    assert second.picks[0] == Pick(F1.backup_id)
    p1 = second.picks[1]
    assert (p1.backup_id, p1.clip) == (F2.backup_id, 65)
    steps = p1.steps(FAILS, 1)
    assert [(s.name, s.max_seq) for s in steps] == [
        (seg(1, r(1, 50)).file, 50),
        (seg(1, r(51, 60)).file, 60),
        (seg(1, r(61, 70)).file, 65),
        ("cut-1/" + seg(1, r(66, 75)).file, NO_CUT),
    ]
    for n in (0, 3):
        with pytest.raises(PitrRangeError, match="failovers 1 to 2"):
            resolve_failover(FAILS, n)
    with pytest.raises(PitrRangeError, match="no failover"):
        resolve_failover(CHAIN, 1)


def test_resume_at_a_clip_is_on_the_branch_that_held_it() -> None:
    pick = resolve_time(CHAIN, at(90)).picks[0]
    rp = resume_at(CHAIN, 0, pick)
    assert rp is not None and (rp.position.seq, rp.position.snap_end) == (20, 20)
    log = LOG_B  # a branch from 80 on: a clip at 70 is on the older one
    e = PartitionEntry(
        0, log.latest.uuid, log, 0, 90, 90, 90, (seg(0, r(1, 90)),), points=pts((70, 5), (90, 6))
    )
    c = commit(0, 7, None, e, since=2)
    rp2 = resume_at([c], 0, Pick(c.backup_id, 70))
    assert rp2 is not None and rp2.position.uuid == 0xA and rp2.failover_log == LOG_A


NOW = datetime(2026, 12, 6, 15, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-12-06T14:37:00Z", datetime(2026, 12, 6, 14, 37, tzinfo=UTC)),
        ("2026-12-06T14:37:00.25Z", datetime(2026, 12, 6, 14, 37, 0, 250000, tzinfo=UTC)),
        ("2026-12-06T15:37:00+01:00", datetime(2026, 12, 6, 14, 37, tzinfo=UTC)),
        ("-15m", NOW - timedelta(minutes=15)),
        ("-2h", NOW - timedelta(hours=2)),
        ("-30s", NOW - timedelta(seconds=30)),
        ("-1d", NOW - timedelta(days=1)),
        ("-1h30m", NOW - timedelta(minutes=90)),
    ],
)
def test_parse_time(text: str, expected: datetime) -> None:
    assert parse_time(text, now=NOW) == expected


def test_parse_time_local_and_bad() -> None:
    local = datetime(2026, 12, 6, 14, 37).astimezone()  # this machine's zone
    assert parse_time("2026-12-06 14:37") == local.astimezone(UTC)
    assert parse_time("2026-12-06T14:37:00") == local.astimezone(UTC)
    off = parse_time("2026-12-06T14:37:00-05:00")
    assert off == datetime(2026, 12, 6, 14, 37, tzinfo=timezone(timedelta(hours=-5)))
    for bad in ("yesterday", "15m", "-15", "2026-13-01", "-5w", ""):
        with pytest.raises(UsageError, match="is not a time"):
            parse_time(bad)
    assert looks_like_time("2026-12-06 14:37") and looks_like_time("-15m")
    assert not looks_like_time("20261206T143700.000000Z") and not looks_like_time("latest")
