"""Which segments of an interrupted run a resumed backup reuses, and when it streams them
again (formats/repository.md §4.5), on real segment files."""

from __future__ import annotations

from pathlib import Path

from upr_cli.failover import FailoverLog
from upr_cli.jobs.backup import _overtaken_reuse, _reusable
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.repo import format_segment_name
from upr_cli.segments import SegmentHeader, SegmentWriter

OLD = FailoverLog.of([(0xA, 0)])
NEW = FailoverLog.of([(0xB, 150), (0xA, 0)])  # the same history went on at 150
OTHER = FailoverLog.of([(0xC, 0)])  # a history that never held 0xA


def seg(d: Path, p: int, start: int, seqs: list[int], log: FailoverLog, end: int) -> Path:
    hdr = SegmentHeader("default", p, log, start, end, ((seqs[0], end),),
                        "2026-11-21T00:00:00.000000Z", "upr://h/default")  # fmt: skip
    w = SegmentWriter(d / f"p{p:04x}.open", hdr)
    w.add([DcpRecord(OP_MUTATION, p, s, 1, s, 0, 0, 0, 0, f"k{s}".encode(), b"v", 0) for s in seqs])
    return Path(w.finish(path=d / format_segment_name(p, seqs[0], seqs[-1])).path)


def test_a_run_of_segments_from_where_this_run_starts_is_reused(tmp_path: Path) -> None:
    first = seg(tmp_path, 0, 100, [101, 150], OLD, 160)
    follow = seg(tmp_path, 0, 160, [161, 170], NEW, 175)  # a resumed run's follow-on
    stray = seg(tmp_path, 0, 150, [155], OLD, 155)  # starts where no segment ends
    wrong_start = seg(tmp_path, 1, 40, [41], OLD, 50)  # this run starts p1 at 30
    unwanted = seg(tmp_path, 2, 0, [1], OLD, 1)
    other_branch = seg(tmp_path, 3, 0, [1, 2], OLD, 2)
    after_it = seg(tmp_path, 3, 2, [3], OTHER, 3)  # not on the history before it
    positions = {0: StreamPosition(0, 0xA, 100, 100, 100), 1: StreamPosition(1, 0xA, 30, 30, 30)}
    got = _reusable(tmp_path, [0, 1, 3], positions)
    assert sorted(got) == [0, 3]
    r0 = got[0]
    assert [Path(s.path) for s in r0.segments] == [first, follow]
    assert (r0.start_seq, r0.end_seq, r0.snapshot, r0.failover_log) == (100, 175, (161, 175), NEW)
    assert r0.position == StreamPosition(0, 0xB, 175, 161, 175)
    assert [Path(s.path) for s in got[3].segments] == [other_branch]
    for gone in (stray, wrong_start, unwanted, after_it):
        assert not gone.exists()


def test_a_reused_end_the_source_no_longer_holds_is_streamed_again(tmp_path: Path) -> None:
    seg(tmp_path, 0, 0, [1, 50], OLD, 60)
    seg(tmp_path, 1, 0, [1, 50], OLD, 60)
    reused = _reusable(tmp_path, [0, 1], {})
    failed_over = FailoverLog.of([(0xD, 40), (0xA, 0)])  # branched at 40, below the end
    logs = {0: OLD, 1: failed_over}
    highs = {0: (80, 0), 1: (90, 0)}
    assert _overtaken_reuse(reused, logs, highs) == [1]
