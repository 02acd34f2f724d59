"""upr diff over crafted failover logs: every status, both rules, JSON sources, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.json_convention import problems
from upr_cli.failover import FailoverLog
from upr_cli.jobs.diff import STATUSES, compare, diff_sources
from upr_cli.jobs.rollback_point import SourceState
from upr_cli.position import StreamPosition


def st(pairs: list[tuple[int, int]], seq: int, snap: int | None = None) -> SourceState:
    return SourceState(FailoverLog.of(pairs), seq if snap is None else snap, seq)


A, B, C, D = 0xA, 0xB, 0xC, 0xD


@pytest.mark.parametrize(
    ("a", "b", "status", "at", "lost", "seed", "dcp"),
    [
        (st([(A, 0)], 50), st([(A, 0)], 50), "identical", None, None, 50, 50),
        (st([(A, 0)], 50), st([(A, 0)], 30), "behind", None, None, 30, 30),
        # the seed rule never looks at A's high seq; the producer rule caps B at it
        (st([(A, 0)], 30), st([(A, 0)], 50), "ahead", None, None, 50, 30),
        # A failed over at 40; B stopped at 35 on the old branch: it can catch up
        (st([(B, 40), (A, 0)], 60), st([(A, 0)], 35), "behind", None, None, 35, 35),
        # ... B went on to 55 on the old branch: its 41..55 are lost writes
        (st([(B, 40), (A, 0)], 60), st([(A, 0)], 55), "diverged", 40, (40, 55), 40, 40),
        # B is the one that moved on to a new branch at 40; A is behind it
        # (the seed calls a client branch the server never had "not possible"; the
        # producer does not know B's uuid and restarts it from 0)
        (st([(A, 0)], 30), st([(B, 40), (A, 0)], 60), "ahead", None, None, "none", 0),
        (st([(A, 0)], 45), st([(B, 40), (A, 0)], 60), "diverged", 40, (40, 60), "none", 0),
        # both moved on from A: A at 50 (C), B at 70 (D): shared up to 50
        (st([(C, 50), (A, 0)], 90), st([(D, 70), (A, 0)], 80), "diverged", 50, (50, 80), 50, 0),
        (st([(C, 0)], 10), st([(D, 0)], 10), "no-common-history", 0, (0, 10), 0, 0),
    ],
)
def test_every_status_and_both_rules(
    a: SourceState, b: SourceState, status: str, at: int | None,
    lost: tuple[int, int] | None, seed: int | str, dcp: int,
) -> None:  # fmt: skip
    d = compare(3, a, b)
    assert (d.status, d.diverged_at, d.lost_seqs) == (status, at, lost)
    if isinstance(seed, str):
        assert isinstance(d.seed_rule, str) and d.seed_rule.startswith(seed)
    else:
        assert d.seed_rule == seed
    assert d.dcp_rule == dcp
    j = d.to_json()
    assert j["status"] in STATUSES and j["partition"] == 3
    assert not problems(j)  # seqs as decimal strings (docs/output.md §4)
    assert j["diverged_at"] == (None if at is None else str(at))
    assert j["lost_seqs"] == (None if lost is None else [str(x) for x in lost])
    assert j["rollback_seqs"]["dcp"] == str(dcp)
    assert j["rollback_seqs"]["seed"] == (d.seed_rule if isinstance(seed, str) else str(seed))


def test_entries_only_on_each_side_and_the_common_ancestor() -> None:
    d = compare(0, st([(C, 50), (A, 0)], 90), st([(D, 70), (A, 0)], 80))
    assert d.common_ancestor is not None and d.common_ancestor.uuid == A
    assert [e.uuid for e in d.only_in_a] == [C] and [e.uuid for e in d.only_in_b] == [D]


def test_a_position_decides_the_producer_rule() -> None:
    # B's recorded position is mid-snapshot on A's old branch: the dcp rule honours it
    b = SourceState(FailoverLog.of([(A, 0)]), 30, 45, StreamPosition(0, A, 45, 30, 50))
    d = compare(0, st([(B, 40), (A, 0)], 60), b)
    assert d.status == "diverged" and d.dcp_rule == 30 and d.seed_rule == 30


def test_json_sources_partitions_and_exit_codes(tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps({"partitions": {
        "0": {"failover_log": [{"uuid": str(B), "seq": "40"}, {"uuid": str(A), "seq": "0"}],
              "seq": "60"},
        "1": {"failover_log": [{"uuid": str(A), "seq": "0"}], "seq": "9"},
        "2": [{"uuid": str(A), "seq": "0"}],
    }}))  # fmt: skip
    b.write_text(json.dumps({
        "0": {"failover_log": [{"uuid": str(A), "seq": "0"}], "seq": "55"},
        "1": {"failover_log": [{"uuid": str(A), "seq": "0"}], "seq": "9"},
        "3": [{"uuid": str(C), "seq": "0"}],
    }))  # fmt: skip
    report = diff_sources(str(a), f"json:{b}")
    assert [d.status for d in report.partitions] == ["diverged", "identical", "only-in-a",
                                                     "only-in-b"]  # fmt: skip
    assert report.counts["diverged"] == 1 and not report.identical
    assert diff_sources(str(a), str(b), [1]).identical
