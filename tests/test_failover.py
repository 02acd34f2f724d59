"""FailoverLog and the two rules on the design's worked examples and hand-made cases."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from upr_cli.errors import UsageError
from upr_cli.failover import (
    FailoverEntry,
    FailoverLog,
    ImpossibleHistory,
    InvalidFailoverLog,
    needs_rollback,
    new_uuid,
    rollback_point,
)
from upr_cli.position import StreamPosition

EXAMPLES = json.loads(
    (Path(__file__).parents[1] / "examples" / "seed-rollback-examples.json").read_text()
)["examples"]
C, D, B = 0xCAFEBABE, 0xDEADBEEF, 0xBA5EBA11


def log(*pairs: tuple[int, int]) -> FailoverLog:
    return FailoverLog.of(pairs)


@pytest.mark.parametrize("ex", EXAMPLES, ids=[e["title"] for e in EXAMPLES])
def test_seed_examples(ex: dict[str, object]) -> None:
    server = FailoverLog.from_json(ex["server_log"])
    client = FailoverLog.from_json(ex["client_log"])
    args = (server, client, ex["snapshot_seq"], ex["seen_seq"])
    if ex.get("impossible"):
        with pytest.raises(ImpossibleHistory, match="not possible"):
            rollback_point(*args)  # type: ignore[arg-type]
    else:
        d = rollback_point(*args)  # type: ignore[arg-type]
        assert d.rollback_seq == ex["rollback_seq"]
        assert d.explanation


def test_seed_example_explains_the_elision_and_the_ancestor() -> None:
    d = rollback_point(log((D, 8), (C, 0)), log((B, 7), (C, 0)), 6, 9)
    assert d.rollback_seq == 6 and d.step == "next-entries-smaller"
    assert d.common_ancestor == FailoverEntry(C, 0)
    assert "elided client entries above snapshot 6: ba5eba11@7" in d.explanation[0]
    j = d.to_json()
    assert j["rollback_seq"] == "6" and j["common_ancestor"]["uuid"] == str(C)


def test_seed_rule_rejects_snapshot_above_seen() -> None:
    with pytest.raises(UsageError):
        rollback_point(log((C, 0)), log((C, 0)), 8, 7)


def test_add_entry_drops_entries_above_and_caps_length() -> None:
    lg = log((D, 10), (B, 5), (C, 0))
    assert lg.add_entry(7, 6).pairs() == ((7, 6), (B, 5), (C, 0))
    assert lg.add_entry(7, 5).pairs() == ((7, 5), (B, 5), (C, 0))
    small = FailoverLog.of([(3, 2), (2, 1), (1, 0)], max_entries=3)
    assert small.add_entry(9, 4).pairs() == ((9, 4), (3, 2), (2, 1))
    assert len(FailoverLog.of([(i + 1, 30 - i) for i in range(25)])) == 25
    with pytest.raises(InvalidFailoverLog, match="exceed the maximum of 25"):
        FailoverLog.of([(i + 1, 30 - i) for i in range(26)])


def test_rolled_back_prunes_or_adds_a_fresh_entry() -> None:
    lg = log((D, 10), (C, 0))
    assert lg.rolled_back(4).pairs() == ((C, 0),)
    fresh = log((D, 10)).rolled_back(4, random.Random(1))
    assert len(fresh) == 1 and fresh.latest.seq == 4 and fresh.latest.uuid not in (0, D)
    assert lg.entry_at(9) == FailoverEntry(C, 0) and lg.entry_at(10) == FailoverEntry(D, 10)


@pytest.mark.parametrize(
    ("pairs", "why"),
    [
        ([(0, 0)], "uuid 0"),
        ([(C, 0), (D, 5)], "not newest-first"),
        ([(C, 5), (C, 0)], "appears twice"),
        ([(C, -1)], "outside"),
        ([(C, 2**64)], "outside"),
    ],
)
def test_invalid_logs_are_rejected(pairs: list[tuple[int, int]], why: str) -> None:
    with pytest.raises(InvalidFailoverLog, match=why):
        FailoverLog.of(pairs)


def test_sanitise_drops_corrupt_entries_as_kv_engine_does() -> None:
    table = [(D, 9), (0, 8), (B, 12), (C, 3), (C, 2), (7, 0)]
    assert FailoverLog.sanitised(table).pairs() == ((D, 9), (C, 3), (7, 0))
    assert len(FailoverLog.sanitised([(i + 1, 100 - i) for i in range(40)])) == 25


def test_json_forms() -> None:
    lg = log((D, 8), (C, 0))
    assert lg.to_json() == [{"uuid": str(D), "seq": "8"}, {"uuid": str(C), "seq": "0"}]
    assert FailoverLog.from_json(lg.to_json()) == lg
    assert FailoverLog.from_json([["deadbeef", 8], [C, "0"]]) == lg
    assert FailoverLog.from_json([["0xDEADBEEF", 8], ["0xcafebabe", 0]]) == lg
    assert FailoverLog.from_json({"failover_log": [{"uuid": "0xdeadbeef", "seq": 8},
                                                   {"uuid": C, "seq": 0}]}) == lg  # fmt: skip
    big = FailoverLog.from_json([{"uuid": str(2**64 - 1), "seq": str(2**64 - 1)}])
    assert big.latest == FailoverEntry(2**64 - 1, 2**64 - 1)


@pytest.mark.parametrize(
    "text",
    ['{"a": 1}', "[1, 2]", '[["xyz", 1]]', '[{"uuid": "deadbeef", "seq": 1}]', '[["ab", -1]]',
     '[["ab", 1.5]]', '[["ab", true]]', "[[", '[["0", 1]]', '[{"uuid": 1}]'],
)  # fmt: skip
def test_malformed_json_logs(text: str) -> None:
    with pytest.raises(InvalidFailoverLog):
        FailoverLog.loads(text)


def test_new_uuid_is_48_bits_and_never_zero() -> None:
    class Zeros(random.Random):
        calls = 0

        def getrandbits(self, k: int) -> int:
            self.calls += 1
            return 0 if self.calls < 3 else 0xFFFF_FFFF_FFFF_FFFF

    assert new_uuid(Zeros()) == 0xFFFF_FFFF_FFFF
    assert all(0 < new_uuid() < 2**48 for _ in range(100))


# -- producer rule, docs/protocol.md §4.2: one case per step ---------------------------


def dcp(lg: FailoverLog, **kw: int | bool) -> tuple[bool, int, str]:
    args: dict[str, int | bool] = {"snap_start": kw.get("start", 0), "snap_end": kw.get("start", 0)}
    args.update(kw)
    pos = StreamPosition(
        0, *(int(args.pop(k)) for k in ("uuid", "start", "snap_start", "snap_end"))
    )
    d = needs_rollback(lg, pos, **args)  # type: ignore[arg-type]
    return d.rollback, d.rollback_seq, d.step


def test_producer_rule_steps() -> None:
    lg = log((D, 8), (C, 0))
    assert dcp(lg, start=0, uuid=0, high=12) == (False, 0, "start-zero")
    assert dcp(lg, start=0, uuid=B, high=12) == (False, 0, "start-zero")
    assert dcp(lg, start=0, uuid=B, high=12, strict=True) == (True, 0, "unknown-uuid")
    assert dcp(lg, start=5, uuid=B, high=12) == (True, 0, "unknown-uuid")
    assert dcp(lg, start=3, uuid=D, high=12, purge_seq=4) == (True, 0, "purged")
    assert dcp(lg, start=3, uuid=C, high=12, purge_seq=4, client_purge_seq=4)[0] is False
    assert dcp(lg, start=7, uuid=C, high=12) == (False, 7, "within-branch")
    assert dcp(lg, start=10, uuid=D, high=12) == (False, 10, "within-branch")
    assert dcp(lg, start=9, uuid=C, snap_start=9, snap_end=10, high=12) == (True, 8, "upper-bound")
    assert dcp(lg, start=9, uuid=C, snap_start=7, snap_end=10, high=12) == (True, 7, "snap-start")
    assert dcp(lg, start=10, uuid=C, snap_start=7, snap_end=10, high=12) == (True, 8, "upper-bound")
    assert dcp(lg, start=14, uuid=D, high=12) == (True, 12, "upper-bound")


def test_producer_rule_refuses_inconsistent_snapshots() -> None:
    with pytest.raises(UsageError, match="ERANGE"):
        needs_rollback(log((C, 0)), StreamPosition(0, C, 5, 6, 9), high=10)


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50))
def test_producer_rule_never_rolls_back_above_start(a: int, b: int, c: int) -> None:
    snap_start, start, snap_end = sorted((a, b, c))
    d = needs_rollback(log((D, 20), (C, 0)), StreamPosition(0, C, start, snap_start, snap_end),
                       high=40)  # fmt: skip
    assert d.rollback_seq <= start
