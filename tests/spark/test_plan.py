"""Planning a Spark read (no JVM): byte-balanced groups; options are tested in
tests/e2e/test_spark_e2e.py against a real repository."""

from __future__ import annotations

from upr_cli.spark.plan import Piece, balance


def piece(p: int, size: int, path: str = "") -> Piece:
    return Piece(p, "b", path or f"p{p}", 0, 0, size)


def test_groups_are_balanced_by_bytes_and_deterministic() -> None:
    units = [(piece(p, size),) for p, size in enumerate([90, 10, 40, 40, 30, 30, 20, 20])]
    groups = balance(units, 3, "history")
    assert sorted(g.bytes for g in groups) == [90, 90, 100]
    assert balance(units, 3, "history") == groups
    assert len(balance(units, 100, "history")) == len(units)  # at most one unit per task
    assert [g.bytes for g in balance(units, 1, "history")] == [280]
    assert balance([], 4, "state") == []


def test_a_state_unit_is_never_split() -> None:
    whole = (piece(1, 50, "a"), piece(1, 50, "b"))  # one vbucket: both its segments
    groups = balance([whole, (piece(2, 10),), (piece(3, 10),)], 3, "state")
    assert any(g.pieces == whole for g in groups)
