"""The SQLite store on real files: round trips, JSON, atomicity, rollback, window, hash."""

from __future__ import annotations

import hashlib
import re
import sqlite3
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upr_cli.collections import CollectionsManifest
from upr_cli.errors import UprError
from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import (
    OP_DELETION,
    OP_EXPIRATION,
    OP_MUTATION,
    ROW_FIELDS,
    DcpRecord,
)
from upr_cli.store import (
    Document,
    Row,
    Store,
    StoreError,
    content_hash_of,
)
from upr_cli.store import schema as store_schema

U64_MAX = (1 << 64) - 1
UUID = 0xFEEDFACE
MUT, DEL, EXP = OP_MUTATION, OP_DELETION, OP_EXPIRATION
JSON, SNAPPY, XATTR = 0x01, 0x02, 0x04


def row(
    p: int,
    seq: int,
    key: bytes,
    value: bytes = b"v",
    *,
    op: int = MUT,
    cas: int | None = None,
    rev: int = 1,
    flags: int = 0,
    expiry: int = 0,
    dtime: int = 0,
    datatype: int = 0,
    blob: bytes = b"",
) -> Row:
    """A data row in ROW_FIELDS order, key and value as memoryviews (as the decoder gives)."""
    cas = seq * 1000 if cas is None else cas
    return DcpRecord(op, p, seq, rev, cas, flags, expiry, dtime, datatype,
                     memoryview(key), memoryview(value), 0xBEEF, 0, blob)  # fmt: skip


def pos(p: int, seq: int, uuid: int = UUID) -> StreamPosition:
    return StreamPosition(p, uuid, seq, seq, seq)


def doc_of(r: Row) -> Document:
    """The document a row leaves behind."""
    deleted = r.opcode != MUT
    return Document(r.vbucket, bytes(r.key), r.by_seqno, r.rev_seqno, r.cas, r.flags,
                    r.expiration, r.delete_time, r.datatype, deleted, bytes(r.value))  # fmt: skip


def state(store: Store) -> dict[tuple[int, bytes], Document]:
    return {(d.partition, d.key): d for d in store.documents()}


def raw_tables(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the data tables, read with a separate connection (committed state)."""
    with sqlite3.connect(path) as conn:
        out = {
            t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall(), key=repr)
            for t in ("documents", "mutation_log", "partitions")
        }
    conn.close()
    return out


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "s.db") as s:
        yield s


def test_row_fields_order_is_what_the_store_binds() -> None:
    assert ROW_FIELDS == (
        "opcode", "vbucket", "by_seqno", "rev_seqno", "cas", "flags", "expiration",
        "delete_time", "datatype", "key", "value", "opaque", "collection", "xattrs",
    )  # fmt: skip


# --- round trips -------------------------------------------------------------------


def test_round_trip_of_every_field_including_u64_max(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    big = row(7, 5, b"\x00k\xff", b"\x00\x01\xfe\xff", cas=U64_MAX, rev=U64_MAX,
              flags=0xFFFFFFFF, expiry=0xFFFFFFFF, datatype=SNAPPY)  # fmt: skip
    small = row(7, 6, b"plain", b"", cas=0, rev=0)
    log = FailoverLog.of([(U64_MAX, 3), (1, 0)])
    position = StreamPosition(7, U64_MAX, 6, 2, 9)
    with Store(path) as s:
        s.apply(7, [big, small], position, log)
    with Store(path, create=False) as s:
        assert s.get(7, b"\x00k\xff") == doc_of(big)
        assert s.get(7, "plain") == doc_of(small)
        assert s.get(7, b"absent") is None
        assert s.get(8, b"plain") is None
        assert s.position(7) == position
        assert s.positions() == {7: position}
        assert s.failover_log(7) == log
        assert s.position(8) is None and s.failover_log(8) is None
        assert s.count() == 2
        meta = s.meta()
        assert meta["format"] == "upr-store" and meta["schema_version"] == str(
            store_schema.SCHEMA_VERSION
        )
        assert meta["created"].endswith("Z")


def test_u64_values_are_stored_as_twos_complement(store: Store) -> None:
    store.apply(1, [row(1, 1, b"k", cas=U64_MAX)], pos(1, 1, uuid=U64_MAX))
    assert store.db.execute("SELECT cas, printf('%u', cas) FROM documents").fetchone() == (
        -1,
        str(U64_MAX),
    )
    assert store.db.execute("SELECT uuid FROM partitions").fetchone() == (-1,)


def test_writable_memoryview_keys_and_bytes_rows(store: Store) -> None:
    buf = bytearray(b"k1k2")
    mv = memoryview(buf)
    rows = [
        (MUT, 0, 1, 1, 1, 0, 0, 0, 0, mv[0:2], mv[2:4], 0),
        (MUT, 0, 2, 1, 2, 0, 0, 0, 0, mv[2:4], b"x", 0),
        (MUT, 0, 3, 1, 3, 0, 0, 0, 0, b"k1", b"y", 0),  # repeats k1: a second run
    ]
    store.apply(0, rows, pos(0, 3))
    assert store.get(0, b"k1") == Document(0, b"k1", 3, 1, 3, 0, 0, 0, 0, False, b"y")
    assert store.get(0, b"k2") == Document(0, b"k2", 2, 1, 2, 0, 0, 0, 0, False, b"x")


# --- JSON ---------------------------------------------------------------------------


def test_json_values_are_text_and_queryable(store: Store) -> None:
    rows = [
        row(3, 1, b"alice", b'{"name": "Alice", "age": 31}', datatype=JSON),
        row(3, 2, b"bob", b'{"name": "Bob", "age": 25}', datatype=JSON),
        row(3, 3, b"bin", b"\x00\x01", datatype=0),
        row(3, 4, b"snappy", b"\x05{}", datatype=JSON | SNAPPY),
        row(3, 5, b"xattr", b"\x00\x00\x00\x00{}", datatype=JSON | XATTR),
        row(3, 6, b"liar", b"{not json", datatype=JSON),
        row(3, 7, b"gone", b'{"name": "Gone"}', datatype=JSON),
        row(3, 8, b"gone", b"", op=DEL, dtime=99),
    ]
    store.apply(3, rows, pos(3, 8))
    q = store.db.execute
    types = dict(q("SELECT CAST(key AS TEXT), typeof(value) FROM documents").fetchall())
    assert types == {"alice": "text", "bob": "text", "bin": "blob", "snappy": "blob",
                     "xattr": "blob", "liar": "text", "gone": "blob"}  # fmt: skip
    assert q(
        "SELECT json_extract(value, '$.name') FROM documents WHERE partition = 3 AND key = ?",
        (b"alice",),
    ).fetchone() == ("Alice",)
    older = q(
        "SELECT id, json_extract(doc, '$.name') FROM json_documents"
        " WHERE json_extract(doc, '$.age') > 30"
    ).fetchall()
    assert older == [("alice", "Alice")]
    # The view never fails on a value that claims JSON but is not: its doc is NULL.
    assert q("SELECT id FROM json_documents WHERE doc IS NULL").fetchall() == [("liar",)]
    for r in rows[:6]:
        assert store.get(3, bytes(r.key)) == doc_of(r)  # exact bytes back, TEXT or BLOB


# --- tombstones -------------------------------------------------------------------------


def test_deletions_and_expirations_keep_tombstones(store: Store) -> None:
    store.apply(2, [row(2, 1, b"a"), row(2, 2, b"b"), row(2, 3, b"c")], pos(2, 3))
    before = store.content_hash()
    store.apply(2, [row(2, 4, b"a", b"", op=DEL, dtime=7), row(2, 5, b"b", b"", op=EXP, dtime=8)],
                pos(2, 5))  # fmt: skip
    a = store.get(2, b"a")
    assert a is not None and a.deleted and a.seq == 4 and a.delete_time == 7
    b = store.get(2, b"b")
    assert b is not None and b.deleted and b.seq == 5
    assert store.count() == 1 and store.count(True) == 3
    assert store.count(partition=2) == 1 and store.count(True, partition=3) == 0
    assert [d.key for d in store.documents(include_deleted=False)] == [b"c"]
    assert store.content_hash() != before
    assert store.content_hash() == content_hash_of([(b"c", b"v", 3000, 1, 0, 0)])


# --- atomicity ------------------------------------------------------------------------


def test_a_failure_mid_batch_commits_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path) as s:
        s.apply(1, [row(1, 1, b"a"), row(1, 2, b"b")], pos(1, 2), FailoverLog.of([(UUID, 0)]))
        before = raw_tables(path)
        bad = [row(1, 3, b"a", b"new"), row(1, 4, b"c"), row(1, 5, b"d"), row(1, 6, b"e")]
        bad[2] = bad[2]._replace(value=None)  # value NULL: NOT NULL fails at row 3
        with pytest.raises(ValueError, match="key and value must be bytes"):
            s.apply(1, bad, pos(1, 6))
        assert raw_tables(path) == before
        assert s.position(1) == pos(1, 2)
        assert s.get(1, b"a") == doc_of(row(1, 1, b"a"))
        s.apply(1, [row(1, 3, b"a", b"new")], pos(1, 3))  # the store is still usable
    assert raw_tables(path) != before


def test_a_failed_apply_in_apply_many_undoes_the_whole_call(tmp_path: Path) -> None:
    # the applies of one apply_many share its transaction without savepoints of their own
    path = tmp_path / "s.db"
    with Store(path) as s:
        s.apply(1, [row(1, 1, b"a")], pos(1, 1))
        before = raw_tables(path)
        with pytest.raises(ValueError, match="opcode"):
            s.apply_many([(1, [row(1, 2, b"b")], pos(1, 2), None),
                          (2, [row(2, 1, b"x", op=0x5A)], pos(2, 1), None)])  # fmt: skip
        assert raw_tables(path) == before
        with s.batch():  # inside an outer batch: that batch goes on
            s.apply(3, [row(3, 1, b"c")], pos(3, 1))
            with pytest.raises(ValueError, match="opcode"):
                s.apply_many([(1, [row(1, 2, b"b")], pos(1, 2), None),
                              (2, [row(2, 1, b"x", op=0x5A)], pos(2, 1), None)])  # fmt: skip
            s.apply_many([(1, [row(1, 2, b"b")], pos(1, 2), None)])
        assert s.positions() == {1: pos(1, 2), 3: pos(3, 1)}
        assert s.get(2, b"x") is None


def test_batch_groups_calls_into_one_transaction(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path) as s:
        s.apply(1, [row(1, 1, b"a")], pos(1, 1))
        before = raw_tables(path)
        with pytest.raises(RuntimeError), s.batch():
            s.apply(1, [row(1, 2, b"b")], pos(1, 2))
            s.apply(2, [row(2, 1, b"x")], pos(2, 1))
            assert s.count() == 3  # visible inside the batch
            raise RuntimeError("crash before commit")
        assert raw_tables(path) == before
        with s.batch():
            s.apply(1, [row(1, 2, b"b")], pos(1, 2))
            assert raw_tables(path) == before  # not committed yet
            with pytest.raises(ValueError):  # a failed inner call undoes only itself
                s.apply(2, [row(2, 1, b"x"), row(2, 1, b"y")], pos(2, 1))
            s.apply_many([(2, [row(2, 1, b"x")], pos(2, 1), None)])
        assert s.positions() == {1: pos(1, 2), 2: pos(2, 1)}
    assert raw_tables(path) != before


@pytest.mark.parametrize(
    ("rows", "position", "message"),
    [
        ([row(2, 3, b"k")], pos(1, 3), "rows of partition"),
        ([row(1, 3, b"k", op=0x5A)], pos(1, 3), "opcode"),
        ([row(1, 4, b"k"), row(1, 4, b"j")], pos(1, 4), "do not increase"),
        ([row(1, 2, b"k")], pos(1, 2), "not above 2"),
        ([row(1, 3, b"k"), row(1, 5, b"j")], pos(1, 4), "does not cover"),
        ([], pos(1, 1), "below the stored"),
        ([], pos(9, 3), "position is of partition 9"),
    ],
)
def test_apply_refuses_inconsistent_input(
    tmp_path: Path, rows: list[Row], position: StreamPosition, message: str
) -> None:
    path = tmp_path / "s.db"
    with Store(path) as s:
        s.apply(1, [row(1, 1, b"a"), row(1, 2, b"b")], pos(1, 2))
        before = raw_tables(path)
        with pytest.raises(ValueError, match=message):
            s.apply(1, rows, position)
        assert raw_tables(path) == before


def test_apply_with_no_rows_saves_the_position(store: Store) -> None:
    store.apply(4, [], StreamPosition(4, UUID, 10, 5, 10), FailoverLog.of([(UUID, 0)]))
    assert store.position(4) == StreamPosition(4, UUID, 10, 5, 10)
    store.apply(4, [], StreamPosition(4, UUID, 12, 11, 12))  # the log is kept
    assert store.failover_log(4) == FailoverLog.of([(UUID, 0)])


# --- rollback -------------------------------------------------------------------------


def test_rollback_restores_replaced_rows_and_deletes_new_ones(store: Store) -> None:
    log = FailoverLog.of([(0xB, 4), (0xA, 0)])
    store.apply(1, [row(1, 1, b"a", b"a1"), row(1, 2, b"b", b"b1")], pos(1, 2, 0xA), log)
    store.apply(1, [row(1, 3, b"a", b"a2"), row(1, 4, b"b", b"", op=DEL)], pos(1, 4, 0xA))
    store.apply(1, [row(1, 5, b"c", b"c1"), row(1, 6, b"a", b"a3"), row(1, 7, b"b", b"b2")],
                pos(1, 7, 0xB))  # fmt: skip
    result = store.rollback(1, 3)
    assert not result.too_far
    # Entries exist for replacements only (b@4, a@6, b@7); c@5 created its key.
    assert (result.from_seq, result.to_seq, result.undone, result.lost) == (7, 3, 3, 3)
    assert (result.restored, result.deleted) == (2, 1)  # a → a2, b → b1; c removed
    lost = store.lost_writes()
    assert [(w.document.key, w.document.seq, w.rolled_back_to, w.uuid) for w in lost] == [
        (b"c", 5, 3, 0xB), (b"a", 6, 3, 0xB), (b"b", 7, 3, 0xB)
    ]  # fmt: skip
    assert lost[1].document == doc_of(row(1, 6, b"a", b"a3")) and lost[1].salvaged is None
    assert "rolled back from seq 7 to 3" in str(result)
    assert state(store) == {
        (1, b"a"): doc_of(row(1, 3, b"a", b"a2")),
        (1, b"b"): doc_of(row(1, 2, b"b", b"b1")),
    }
    # docs/protocol.md §4.4: the newest entry with seq ≤ 3 is 0xA; the log is pruned above 3.
    assert result.position == store.position(1) == StreamPosition(1, 0xA, 3, 3, 3)
    assert store.failover_log(1) == FailoverLog.of([(0xA, 0)])
    assert store.db.execute("SELECT max(seq) FROM mutation_log").fetchone() == (3,)
    # Streaming the new branch from 3 goes on normally.
    store.apply(1, [row(1, 4, b"d", b"d1")], pos(1, 4, 0xC))
    assert store.rollback(1, 1, uuid=0x99).position == StreamPosition(1, 0x99, 1, 1, 1)
    assert state(store) == {(1, b"a"): doc_of(row(1, 1, b"a", b"a1"))}
    assert len(store.lost_writes()) == 6
    store.mark_salvaged([lost[0].id])
    assert [w.id for w in store.lost_writes()] == [w.id for w in store.lost_writes()[:5]]
    assert len(store.lost_writes()) == 5 and len(store.lost_writes(include_salvaged=True)) == 6
    assert store.lost_writes([2]) == []


def test_rollback_edge_cases(store: Store) -> None:
    assert store.rollback(5, 0).position is None  # unknown partition, nothing to undo
    with pytest.raises(ValueError, match="cannot roll back"):
        store.rollback(5, 1)
    store.apply(5, [row(5, 1, b"a")], pos(5, 1))
    with pytest.raises(ValueError, match="holds seq 1"):
        store.rollback(5, 2)
    result = store.rollback(5, 1)  # to the current seq: nothing undone
    assert (result.undone, result.too_far, result.position) == (0, False, pos(5, 1, 0))
    assert store.get(5, b"a") is not None


def test_too_far_rollback_then_reset(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path, undo_window=2) as s:
        s.apply(1, [row(1, i, b"k%d" % (i % 3)) for i in range(1, 6)], pos(1, 5))
        s.apply(2, [row(2, 1, b"other")], pos(2, 1))
        before = raw_tables(path)
        result = s.rollback(1, 2)
        assert result.too_far and result.log_floor == 3 and result.position is None
        assert "reaches back only to seq 3" in str(result)
        assert raw_tables(path) == before
        assert s.rollback(1, 3).to_seq == 3  # the floor itself is reachable
        assert s.reset_partition(1) == 3
        assert s.position(1) is None and s.count(partition=1) == 0
        assert (
            s.db.execute("SELECT count(*) FROM mutation_log WHERE partition = 1").fetchone()[0] == 0
        )
        assert s.get(2, b"other") is not None and s.position(2) == pos(2, 1)
        s.apply(1, [row(1, 1, b"k1")], pos(1, 1))  # restream from 0
        assert s.count(partition=1) == 1


def test_window_trimming(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path, undo_window=3) as s:
        s.apply(1, [row(1, 1, b"a"), row(1, 2, b"b")], pos(1, 2))
        s.apply(1, [row(1, 4, b"a"), row(1, 6, b"c"), row(1, 9, b"b")], pos(1, 9))
        logged = s.db.execute("SELECT seq FROM mutation_log ORDER BY seq").fetchall()
        assert logged == [(4,), (9,)]  # c@6 created its key: no entry
        st_ = s.partition_state(1)
        assert st_ is not None and (st_.log_count, st_.log_floor) == (2, 0)
    with Store(path, undo_window=1) as s:  # a smaller window trims at the next apply
        s.apply(1, [row(1, 10, b"d"), row(1, 11, b"d")], pos(1, 11))
        assert s.db.execute("SELECT seq FROM mutation_log").fetchall() == [(11,)]
        st_ = s.partition_state(1)
        assert st_ is not None and (st_.log_count, st_.log_floor) == (1, 10)
    with Store(path, undo_window=3) as s:  # a batch larger than the window
        big = [row(2, i, b"k%d" % (i % 4), b"v%d" % i) for i in range(1, 11)]
        s.apply(2, big, pos(2, 10))
        assert s.db.execute(
            "SELECT seq FROM mutation_log WHERE partition = 2 ORDER BY seq"
        ).fetchall() == [(8,), (9,), (10,)]
        st_ = s.partition_state(2)
        assert st_ is not None and (st_.log_count, st_.log_floor) == (3, 7)
        assert s.rollback(2, 6).too_far
        s.rollback(2, 7)
        assert {k: v for k, v in state(s).items() if k[0] == 2} == model(big, 7)
    with Store(path, undo_window=0) as s:  # no log at all: nothing can be undone
        s.apply(1, [row(1, 12, b"e"), row(1, 13, b"f")], pos(1, 13))
        st_ = s.partition_state(1)
        assert st_ is not None and (st_.log_count, st_.log_floor) == (0, 13)
        assert s.rollback(1, 12).too_far
        assert not s.rollback(1, 13).too_far


# --- rollback, property -----------------------------------------------------------------

KEYS = [b"k0", b"k1", b"k2", b"k3", b"k4"]
change = st.tuples(
    st.sampled_from([MUT, MUT, MUT, DEL, EXP]),
    st.integers(0, len(KEYS) - 1),
    st.sampled_from([b"", b"v", b'{"n": 1}', b"\xff\x00"]),
    st.sampled_from([0, 1, 1 << 63, U64_MAX]),  # cas
)
branch = st.lists(st.lists(change, max_size=6), min_size=1, max_size=5)


def build(p: int, start: int, batches: list[list[tuple[int, int, bytes, int]]]) -> list[list[Row]]:
    seq, out = start, []
    for batch in batches:
        rows = []
        for op, k, value, cas in batch:
            seq += 1
            rows.append(row(p, seq, KEYS[k], value, op=op, cas=cas, rev=seq,
                            datatype=JSON if value.startswith(b"{") else 0))  # fmt: skip
        out.append(rows)
    return out


def model(rows: Sequence[Row], upto: int) -> dict[tuple[int, bytes], Document]:
    out: dict[tuple[int, bytes], Document] = {}
    for r in rows:
        if r.by_seqno <= upto:
            out[(r.vbucket, bytes(r.key))] = doc_of(r)
    return out


def expected_floor(seqs: list[int], window: int) -> int:
    """The seq of the newest change dropped from a log of `window` entries (0 if none)."""
    dropped = seqs[: max(0, len(seqs) - window)] if window else seqs
    return dropped[-1] if dropped else 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=branch, second=branch, window=st.integers(0, 25), data=st.data())
def test_rollback_equals_the_model_at_the_target_seq(
    first: list[list[tuple[int, int, bytes, int]]],
    second: list[list[tuple[int, int, bytes, int]]],
    window: int,
    data: st.DataObject,
) -> None:
    with tempfile.TemporaryDirectory() as tmp, Store(Path(tmp) / "s.db", undo_window=window) as s:
        s.apply(9, [row(9, 1, b"other")], pos(9, 1))  # another partition is never touched
        other = state(s)
        batches = build(1, 0, first)
        applied: list[Row] = []
        for rows in batches:
            applied += rows
            top = applied[-1][2] if applied else 0
            s.apply(1, rows, pos(1, top))
        high = applied[-1][2] if applied else 0
        seqs = [r.by_seqno for r in applied]
        floor = expected_floor(seqs, window)
        to = data.draw(st.integers(0, high), label="first rollback")
        result = s.rollback(1, to)
        # Creations have no entry, so the log reaches at least as far as a log of every
        # change would (formats/store.md §3.4).
        assert result.log_floor <= floor
        floor = result.log_floor
        if to < floor:
            assert result.too_far
            assert state(s) == {**other, **model(applied, high)}
            return
        assert not result.too_far
        assert state(s) == {**other, **model(applied, to)}
        assert s.position(1) == StreamPosition(1, 0, to, to, to)
        # A new branch from `to`, then a second rollback.
        kept = [r for r in applied if r.by_seqno <= to]
        new = [r for rows in build(1, to, second) for r in rows]
        for rows in build(1, to, second):
            if rows:
                s.apply(1, rows, pos(1, rows[-1][2]))
        history = kept + new
        high = history[-1].by_seqno if history else 0
        floor = max(
            floor, expected_floor([r.by_seqno for r in history if r.by_seqno > floor], window)
        )
        to2 = data.draw(st.integers(0, high), label="second rollback")
        result = s.rollback(1, to2)
        assert result.too_far == (to2 < result.log_floor)
        assert state(s) == {**other, **model(history, high if result.too_far else to2)}


# --- errors, schema ---------------------------------------------------------------------


def test_not_a_store_and_newer_schema_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    newer = tmp_path / "newer.db"
    Store(newer).close()
    with sqlite3.connect(newer) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.close()
    cases = [
        (junk, "not an SQLite database"),
        (other, "no meta table"),
        (newer, "schema version 99 is newer"),
        (tmp_path / "missing.db", "no such store"),
    ]
    for path, message in cases:
        with pytest.raises(StoreError) as info:
            Store(path, create=False)
        assert isinstance(info.value, UprError)
        text = str(info.value)
        assert str(path) in text and message in text and "\n" not in text
    assert not (tmp_path / "missing.db").exists()
    with pytest.raises(StoreError, match="cannot open"):
        Store(tmp_path / "no" / "such" / "dir.db")


def test_migrations_run_once_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.db"
    with Store(path, source="upr://a") as s:
        s.apply(1, [row(1, 1, b"a")], pos(1, 1))
    calls: list[int] = []

    def add_note(db: Any) -> None:
        calls.append(1)
        db.execute("ALTER TABLE documents ADD COLUMN note TEXT")

    v = store_schema.SCHEMA_VERSION
    monkeypatch.setattr(store_schema, "SCHEMA_VERSION", v + 1)
    monkeypatch.setattr(store_schema, "MIGRATIONS", {**store_schema.MIGRATIONS, v: add_note})
    with Store(path) as s:
        assert s.meta()["schema_version"] == str(v + 1) and s.meta()["source"] == "upr://a"
        assert "note" in s.db["documents"].columns_dict
    with Store(path, source="upr://b") as s:
        assert s.meta()["source"] == "upr://b"
    assert calls == [1]
    monkeypatch.setattr(store_schema, "SCHEMA_VERSION", v + 2)
    with pytest.raises(StoreError, match=f"no migration from schema version {v + 1}"):
        Store(path)


def test_closed_store_and_bad_arguments(tmp_path: Path) -> None:
    s = Store(tmp_path / "s.db")
    s.close()
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.count()
    with pytest.raises(UprError, match="undo window"):
        Store(tmp_path / "t.db", undo_window=-1)


# --- content hash ---------------------------------------------------------------------


def test_content_hash_is_stable_and_order_independent(tmp_path: Path) -> None:
    docs = [row(p, s, b"key%03d" % (p * 7 + s), b"val%d" % s, cas=s * 11, datatype=JSON * (s % 2))
            for p in range(4) for s in range(1, 9)]  # fmt: skip
    with Store(tmp_path / "a.db") as a, Store(tmp_path / "b.db") as b:
        for p in range(4):
            mine = [r for r in docs if r.vbucket == p]
            a.apply(p, mine, pos(p, 8))
        b.restore_rows(list(reversed(docs)))
        h = a.content_hash()
        assert h == b.content_hash()
        assert h == content_hash_of(
            [
                (bytes(r.key), bytes(r.value), r.cas, r.rev_seqno, r.flags, r.expiration)
                for r in docs
            ]
        )
        assert a.content_hash([0, 1]) == b.content_hash([1, 0])
        assert a.content_hash([0, 1]) != h
        assert a.content_hash([]) == content_hash_of([])
        # A tombstone does not count; a changed cas does.
        a.apply(0, [row(0, 9, b"zzz"), row(0, 10, b"zzz", b"", op=DEL)], pos(0, 10))
        assert a.content_hash() == h
        a.apply(0, [row(0, 11, b"key001", b"val1", cas=1)], pos(0, 11))
        assert a.content_hash() != h
    with Store(tmp_path / "b.db") as b:
        assert b.content_hash() == h


def test_content_hash_orders_equal_keys_of_different_partitions() -> None:
    docs = [(b"k", b"v2", 1, 1, 0, 0), (b"k", b"v1", 1, 1, 0, 0), (b"a", b"", U64_MAX, 0, 0, 0)]
    assert content_hash_of(docs) == content_hash_of(list(reversed(docs)))
    assert len(content_hash_of(docs)) == 64
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # store.md §6
    assert content_hash_of([]) == empty


def test_content_hash_encoding_is_the_one_the_spec_gives() -> None:
    record = (
        struct.pack(">I", 3) + b"key" + struct.pack(">QQQQ", U64_MAX, 2, 3, 4)
        + struct.pack(">I", 5) + b"value"
    )  # fmt: skip
    expected = hashlib.sha256(record).hexdigest()
    assert content_hash_of([(b"key", b"value", U64_MAX, 2, 3, 4)]) == expected


# --- restore_rows ----------------------------------------------------------------------


def test_restore_rows_fast_path(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path) as s:
        s.apply(1, [row(1, 1, b"a"), row(1, 2, b"b")], pos(1, 2), FailoverLog.of([(UUID, 0)]))
        n = s.restore_rows(
            iter(
                [
                    row(1, 40, b"a", b"x"),
                    row(3, 5, b"z", b"", op=DEL),
                    row(1, 30, b"c", cas=U64_MAX),
                    row(1, 41, b"a", b"y"),
                ]
            )
        )  # mixed partitions: grouped, each partition's rows kept in order
        assert n == 4
        assert s.get(1, b"a") == doc_of(row(1, 41, b"a", b"y"))  # later rows win
        assert s.get(1, b"c") == doc_of(row(1, 30, b"c", cas=U64_MAX))
        z = s.get(3, b"z")
        assert z is not None and z.deleted
        # Positions are left alone (a new partition gets the beginning); undo stops at 41.
        assert s.position(1) == pos(1, 2) and s.position(3) == StreamPosition(3)
        assert s.failover_log(1) == FailoverLog.of([(UUID, 0)])
        st1, st3 = s.partition_state(1), s.partition_state(3)
        assert st1 is not None and (st1.log_count, st1.log_floor) == (0, 41)
        assert st3 is not None and st3.log_floor == 5
        assert s.rollback(1, 2).too_far
        s.set_position(StreamPosition(1, UUID, 41, 41, 41))
        assert s.position(1) == StreamPosition(1, UUID, 41, 41, 41)
        assert s.restore_rows([]) == 0
        before = raw_tables(path)
        with pytest.raises(ValueError, match="opcode 90 is not"):
            s.restore_rows([row(1, 50, b"q"), row(1, 51, b"r", op=0x5A)])
        assert raw_tables(path) == before


# --- contract: apply and restore_rows agree where they overlap ----------------------------

Writer = Callable[[Store, list[list[Row]]], None]


def by_apply(s: Store, batches: list[list[Row]]) -> None:
    for rows in batches:
        if rows:
            s.apply(rows[0][1], rows, pos(rows[0][1], rows[-1][2]))


def by_restore(s: Store, batches: list[list[Row]]) -> None:
    with s.batch():
        for rows in batches:
            s.restore_rows(rows)


def by_restore_logged(s: Store, batches: list[list[Row]]) -> None:
    for rows in batches:
        s.restore_rows(rows, keep_log=True)


WRITERS = {"apply": by_apply, "restore": by_restore, "restore-logged": by_restore_logged}
UNDOABLE = {"apply", "restore-logged"}


@pytest.fixture(params=sorted(WRITERS))
def writer(request: pytest.FixtureRequest) -> tuple[str, Writer]:
    return request.param, WRITERS[request.param]


def contract_batches() -> list[list[Row]]:
    return [
        [row(0, 1, b"a", b'{"x": 1}', datatype=JSON), row(0, 2, b"b", cas=U64_MAX)],
        [row(1, 1, b"c", b"\x00"), row(1, 2, b"c", b"\x01", flags=5, expiry=6)],
        [row(0, 3, b"a", b"", op=DEL, dtime=3), row(0, 4, b"d", b"", op=EXP)],
        [row(0, 5, b"a", b'{"x": 2}', datatype=JSON)],
    ]


def test_contract_same_documents(tmp_path: Path, writer: tuple[str, Writer]) -> None:
    _, write = writer
    with Store(tmp_path / "s.db") as s:
        write(s, contract_batches())
        flat = [r for rows in contract_batches() for r in rows]
        assert state(s) == model(flat, 100)
        assert s.count() == 3 and s.count(True) == 4
        assert s.content_hash() == content_hash_of(
            [(b"a", b'{"x": 2}', 5000, 1, 0, 0), (b"b", b"v", U64_MAX, 1, 0, 0),
             (b"c", b"\x01", 2000, 1, 5, 6)]
        )  # fmt: skip
        json_name = s.db.execute(
            "SELECT json_extract(doc, '$.x') FROM json_documents WHERE id = 'a'"
        ).fetchone()
        assert json_name == (2,)


def test_contract_rollback(tmp_path: Path, writer: tuple[str, Writer]) -> None:
    name, write = writer
    with Store(tmp_path / "s.db") as s:
        write(s, contract_batches())
        if name != "apply":
            s.set_position(pos(0, 5))
            s.set_position(pos(1, 2))
        result = s.rollback(0, 2)
        flat = [r for rows in contract_batches() for r in rows]
        if name in UNDOABLE:
            assert not result.too_far
            expect = {k: v for k, v in model(flat, 100).items() if k[0] == 1}
            expect |= {k: v for k, v in model(flat, 2).items() if k[0] == 0}
            assert state(s) == expect
            restored = s.db.execute(
                "SELECT json_extract(doc, '$.x') FROM json_documents WHERE id = 'a'"
            ).fetchone()
            assert restored == (1,)  # a JSON row comes back as TEXT
        else:
            assert result.too_far and result.log_floor == 5
            assert state(s) == model(flat, 100)


# --- the spec's SQL runs -------------------------------------------------------------------

SPEC = Path(__file__).resolve().parents[2] / "formats" / "store.md"


def sql_blocks() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", SPEC.read_text(), re.S)


@pytest.mark.parametrize(("view", "block"), [("json_documents", 0), ("named_documents", 1)])
def test_spec_view_is_the_view_created(store: Store, view: str, block: int) -> None:
    (created,) = store.db.execute("SELECT sql FROM sqlite_schema WHERE name = ?", [view]).fetchone()
    body = created.split(" AS ", 1)[1]
    assert " ".join(body.split()) == " ".join(sql_blocks()[block].split())


def test_spec_example_queries_run(store: Store) -> None:
    store.apply(5, [row(5, 1, b"user::1", b'{"name": "Ann", "age": 40}', datatype=JSON),
                    row(5, 2, b"bin", b"\x00"), row(5, 3, b"old", b"", op=DEL),
                    row(5, 1001, b"new", b'"n"', datatype=JSON)],
                pos(5, 1001), FailoverLog.of([(UUID, 0)]))  # fmt: skip
    store.apply(5, [row(5, 1002, b"user::2", b'{"name": "Bo"}', datatype=JSON)._replace(
        collection=9)], pos(5, 1002))  # fmt: skip
    store.record_manifest(CollectionsManifest().with_scope("app").with_collection("app", "users"))
    sg = xattrs.encode({"_sync": '{"rev":"2-b"}', "app": "[1]"})
    sync = xattrs.encode({"_sync": '{"rev":"3-c"}'})
    store.apply(5, [row(5, 1003, b"sg", b'{"n": 1}', datatype=JSON, blob=sg),
                    row(5, 1004, b"gone", b"", op=DEL, blob=sync)], pos(5, 1004))  # fmt: skip
    queries = [q for q in sql_blocks()[2].split(";") if q.strip().strip("-")]
    assert len(queries) == 12
    results = [store.db.execute(q).fetchall() for q in queries]
    assert results[0] == [("Ann",)]
    assert results[1] == [("user::1", "Ann")]
    assert results[2] == [(5, 5, 2)]
    assert results[3] == [("bin", "00", "2000")]
    assert results[4] == [(5, str(UUID), 1004, 1004, 1004, str(UUID), 0, 0)]
    assert results[5] == [(1004, "gone", 1), (1003, "sg", 0), (1002, "user::2", 0),
                          (1001, "new", 0)]  # fmt: skip
    # the positions end their snapshots: boundaries
    assert results[6] == [(1001,), (1002,), (1004,)]
    assert results[7] == []
    assert results[8] == [("_default", "_default", 4), ("app", "users", 1)]
    assert results[9] == [("user::2", "Bo")]
    assert results[10] == [("gone", 1, "3-c"), ("sg", 0, "2-b")]
    assert results[11] == [("gone", "_sync"), ("sg", "_sync,app")]


def test_an_open_transaction_commits_or_aborts_as_a_whole(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path) as s:
        s.begin()
        assert s.in_transaction
        s.apply(1, [row(1, 1, b"a")], pos(1, 1))
        s.apply(2, [row(2, 1, b"b")], pos(2, 1))  # both join the open transaction
        with Store(path, create=False) as reader:
            assert reader.count() == 0  # readers see nothing before the commit
        s.abort()
        assert not s.in_transaction and s.count() == 0 and s.positions() == {}
        s.abort()  # nothing open: nothing to do
        s.begin()
        s.apply(1, [row(1, 1, b"a")], pos(1, 1))
        with pytest.raises(ValueError, match="already open"):
            s.begin()
        s.commit()
        with pytest.raises(ValueError, match="no transaction is open"):
            s.commit()
    with Store(path, create=False) as s:
        assert s.count() == 1 and s.position(1) == pos(1, 1)


# --- snapshot boundaries (formats/store.md §3.6, §5.3) -----------------------------------


def test_boundaries_are_the_saved_positions_that_end_their_snapshot(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=100) as s:
        s.apply(0, [row(0, 1, b"K", b"v1"), row(0, 2, b"J")], StreamPosition(0, UUID, 2, 0, 2))
        s.apply(0, [row(0, 3, b"K", b"v3")], StreamPosition(0, UUID, 3, 3, 5))  # partial
        s.apply(0, [row(0, 5, b"J", b"j2")], StreamPosition(0, UUID, 5, 3, 5))
        assert s.boundaries() == {0: [2, 5]} and s.boundaries(0) == {0: [2, 5]}
        res = s.rollback(0, 2, lost_above=4)
        assert not res.too_far and s.boundaries() == {0: [2]}
        # only the version above the asked seq is lost: K@3 the source sends again
        assert [(lw.document.key, lw.rolled_back_to) for lw in s.lost_writes()] == [(b"J", 4)]
        assert state(s)[0, b"K"].value == b"v1"
        s.reset_partition(0)
        assert s.boundaries() == {}


def test_boundaries_below_a_risen_log_floor_are_dropped(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=1) as s:
        for seq in range(1, 6):
            s.apply(0, [row(0, seq, b"K", b"v%d" % seq)], pos(0, seq))
        floor = s.partition_state(0).log_floor  # type: ignore[union-attr]
        assert floor > 1 and s.boundaries()[0] == [b for b in range(1, 6) if b >= floor]
        assert s.rollback(0, floor - 1).too_far


def test_boundaries_kept_per_partition_are_bounded(tmp_path: Path) -> None:
    """New keys write no undo entries, so the log floor never rises: the boundaries are
    trimmed to the newest KEEP_BOUNDARIES (and a few more between trims)."""
    from upr_cli.store.partitions import KEEP_BOUNDARIES

    with Store(tmp_path / "s.db", undo_window=100) as s:
        for seq in range(1, 3 * KEEP_BOUNDARIES + 2):
            s.apply(0, [row(0, seq, b"k%d" % seq)], pos(0, seq))
        kept = s.boundaries()[0]
        assert KEEP_BOUNDARIES <= len(kept) < 2 * KEEP_BOUNDARIES
        assert kept[-1] == 3 * KEEP_BOUNDARIES + 1 and kept == sorted(kept)
