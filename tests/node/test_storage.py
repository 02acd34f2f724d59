"""NodeStorage on real SQLite files: round trips, dedup, snapshots, purge, rollback, errors."""

from __future__ import annotations

import sqlite3
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upr_cli.errors import UprError, UsageError
from upr_cli.node.storage import (
    U64_MAX,
    DocRow,
    NodeStorage,
    PartitionRecord,
    StorageError,
)


def doc(
    vb: int,
    key: bytes,
    seq: int,
    *,
    value: bytes = b"v",
    deleted: bool = False,
    delete_time: int = 0,
    cas: int = 1,
) -> DocRow:
    return DocRow(vb, key, seq, 1, cas, 0, 0, 0, deleted, delete_time, value)


def record(vb: int, high: int = 0, purge: int = 0, state: str = "active") -> PartitionRecord:
    return PartitionRecord(vb, state, ((0xABC, 0),), high, purge, high, high)


def read_all(storage: NodeStorage, vb: int, after: int = 0, batch: int = 1000) -> list[DocRow]:
    with storage.open_reader() as reader:
        bf = reader.backfill(vb, after, batch=batch)
        out = []
        while rows := bf.fetch():
            out.extend(rows)
        return out


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[NodeStorage]:
    with NodeStorage(tmp_path, "default") as s:
        yield s


# --- round trips


def test_doc_round_trip_with_extreme_values(storage: NodeStorage) -> None:
    big = DocRow(3, b"k\x00\xff", U64_MAX, U64_MAX, U64_MAX, 2**32 - 1, 2**32 - 1, 7, False, 0, b"")
    mid = DocRow(3, b"m", 2**63, 2**63, 2**63, 1, 2, 3, False, 0, bytes(range(256)))
    small = DocRow(3, b"s", 1, 0, 0, 0, 0, 0, False, 0, b"\x00")
    storage.write_batch([big, mid, small], [])
    assert storage.get(3, b"k\x00\xff") == big
    assert storage.get(3, b"m") == mid
    assert storage.get(3, b"s") == small
    assert storage.get(3, b"absent") is None
    assert storage.get(4, b"s") is None


def test_partition_round_trip_persists_across_reopen(tmp_path: Path) -> None:
    recs = [
        PartitionRecord(0, "active", ((U64_MAX, U64_MAX), (7, 0)), U64_MAX, U64_MAX, 5, U64_MAX),
        PartitionRecord(1, "replica", ((1, 0),), 0, 0, 0, 0),
        PartitionRecord(2, "pending", (), 3, 1, 2, 3),
        PartitionRecord(3, "dead", ((9, 4),), 4, 0, 4, 4),
    ]
    with NodeStorage(tmp_path, "b") as s:
        assert s.load_partitions() == {}
        s.save_partitions(recs)
        s.save_partitions([PartitionRecord(1, "active", ((2, 5), (1, 0)), 5, 0, 5, 5)])
    with NodeStorage(tmp_path, "b") as s:
        loaded = s.load_partitions()
    assert loaded == {
        0: recs[0],
        1: PartitionRecord(1, "active", ((2, 5), (1, 0)), 5, 0, 5, 5),
        2: recs[2],
        3: recs[3],
    }


def test_write_batch_upserts_partition_records(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"a", 1)], [record(0, high=1)])
    storage.write_batch([doc(0, b"b", 2)], [record(0, high=2)])
    assert storage.load_partitions() == {0: record(0, high=2)}
    storage.write_batch([], [record(1, high=0)])
    assert set(storage.load_partitions()) == {0, 1}


def test_invalid_values_are_rejected(storage: NodeStorage) -> None:
    with pytest.raises(ValueError, match="64 bits"):
        storage.write_batch([doc(0, b"a", 2**64)], [])
    with pytest.raises(ValueError, match="negative"):
        storage.write_batch([doc(0, b"a", 1, cas=-1)], [])
    with pytest.raises(ValueError, match="state"):
        storage.save_partitions([record(0, state="zombie")])
    assert storage.doc_count(include_deleted=True) == 0
    assert storage.load_partitions() == {}


# --- dedup and the seq rule


def by_seq_entries(path: Path, vb: int) -> list[int]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute(
            "SELECT seq FROM docs INDEXED BY docs_by_seq WHERE vbucket = ? ORDER BY seq", (vb,)
        ).fetchall()
    conn.close()
    return [r[0] for r in rows]


def test_later_version_replaces_row_and_by_seq_entry(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"k", 1, value=b"one"), doc(0, b"x", 2)], [])
    storage.write_batch([doc(0, b"k", 3, value=b"two")], [])
    assert storage.get(0, b"k") == doc(0, b"k", 3, value=b"two")
    assert by_seq_entries(storage.path, 0) == [2, 3]
    assert [r.seq for r in read_all(storage, 0)] == [2, 3]
    assert storage.doc_count(0) == 2


def test_versions_of_one_key_within_a_batch(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"k", 1, value=b"a"), doc(0, b"k", 2, value=b"b")], [])
    assert storage.get(0, b"k") == doc(0, b"k", 2, value=b"b")
    assert by_seq_entries(storage.path, 0) == [2]


@pytest.mark.parametrize(
    "batch",
    [
        [doc(0, b"new", 6), doc(0, b"k", 5)],  # same seq as stored
        [doc(0, b"new", 6), doc(0, b"k", 4)],  # lower than stored
        [doc(0, b"k", 8), doc(0, b"k", 7)],  # regression within the batch
    ],
)
def test_seq_regression_is_rejected_and_nothing_commits(
    storage: NodeStorage, batch: list[DocRow]
) -> None:
    storage.write_batch([doc(0, b"k", 5, value=b"stored")], [record(0, high=5)])
    with pytest.raises(ValueError, match="not above stored seq"):
        storage.write_batch(batch, [record(0, high=99)])
    assert storage.get(0, b"k") == doc(0, b"k", 5, value=b"stored")
    assert storage.get(0, b"new") is None
    assert storage.load_partitions() == {0: record(0, high=5)}
    storage.write_batch([doc(0, b"k", 9)], [])  # the connection is still usable
    assert storage.get(0, b"k") == doc(0, b"k", 9)


def test_seq_compare_is_unsigned(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"k", U64_MAX)], [])
    with pytest.raises(ValueError, match="not above"):
        storage.write_batch([doc(0, b"k", 5)], [])
    assert storage.get(0, b"k") == doc(0, b"k", U64_MAX)


def test_seq_reused_by_another_key_is_rejected(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"a", 1)], [])
    with pytest.raises(ValueError, match="seq reused"):
        storage.write_batch([doc(0, b"b", 1)], [])
    storage.write_batch([doc(1, b"b", 1)], [])  # seqs are per partition


def test_tombstones(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"a", 1), doc(0, b"b", 2), doc(1, b"c", 1)], [])
    tomb = doc(0, b"a", 3, value=b"", deleted=True, delete_time=1_700_000_000)
    storage.write_batch([tomb], [])
    assert storage.get(0, b"a") == tomb
    assert storage.doc_count() == 2
    assert storage.doc_count(0) == 1
    assert storage.doc_count(0, include_deleted=True) == 2
    assert storage.doc_count(include_deleted=True) == 3
    assert read_all(storage, 0) == [doc(0, b"b", 2), tomb]
    storage.write_batch([doc(0, b"a", 4, value=b"back")], [])
    assert storage.get(0, b"a") == doc(0, b"a", 4, value=b"back")


# --- backfill


def test_backfill_order_batching_filter_and_high_seq(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"k%d" % s, s) for s in (5, 1, 3)], [])
    storage.write_batch([doc(0, b"k%d" % s, s) for s in (2, 7, 4, 6)], [])
    storage.write_batch([doc(1, b"other", 100)], [])
    with storage.open_reader() as reader:
        bf = reader.backfill(0, 0, batch=3)
        assert bf.high_seq == 7
        batches = []
        while rows := bf.fetch():
            batches.append([r.seq for r in rows])
        assert batches == [[1, 2, 3], [4, 5, 6], [7]]
        assert bf.fetch() == []

        bf = reader.backfill(0, 4, batch=2)
        assert bf.high_seq == 7
        assert [r.seq for r in bf.fetch()] == [5, 6]
        assert [r.seq for r in bf.fetch()] == [7]
        assert bf.fetch() == []

        bf = reader.backfill(0, 7)
        assert (bf.high_seq, bf.fetch()) == (7, [])

        bf = reader.backfill(9, 0)
        assert (bf.high_seq, bf.fetch()) == (0, [])


def test_backfill_exact_multiple_of_batch(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"k%d" % s, s) for s in range(1, 5)], [])
    with storage.open_reader() as reader:
        bf = reader.backfill(0, 0, batch=2)
        assert [len(bf.fetch()) for _ in range(4)] == [2, 2, 0, 0]


def test_backfill_sees_one_snapshot_while_a_writer_commits(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"k%d" % s, s, value=b"old") for s in range(1, 11)], [])
    before = read_all(storage, 0)

    def write(step: int) -> None:  # rewrite keys read and not yet read, add new, delete one
        base = 10 + 10 * step
        docs = [doc(0, b"k%d" % (i + 1), base + i + 1, value=b"new") for i in range(9)]
        docs.append(doc(0, b"k10", base + 10, deleted=True, delete_time=1))
        storage.write_batch(docs, [record(0, high=base + 10)])

    with storage.open_reader() as reader, ThreadPoolExecutor(1) as writer:
        bf = reader.backfill(0, 0, batch=3)
        got = bf.fetch()
        step = 0
        while True:
            writer.submit(write, step).result()  # committed before the next fetch
            step += 1
            rows = bf.fetch()
            if not rows:
                break
            got.extend(rows)
        assert got == before
        assert bf.high_seq == 10
        assert step >= 4

    after = read_all(storage, 0)
    assert [r.seq for r in after] == [10 * step + i + 1 for i in range(10)]
    assert after[-1].deleted


def test_one_backfill_at_a_time_per_reader(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"k%d" % s, s) for s in range(1, 5)], [])
    with storage.open_reader() as reader:
        bf = reader.backfill(0, 0, batch=1)
        assert len(bf.fetch()) == 1
        with pytest.raises(RuntimeError, match="already"):
            reader.backfill(0, 0)
        bf.close()
        bf.close()
        assert bf.fetch() == []
        with reader.backfill(0, 2) as bf2:
            assert [r.seq for r in bf2.fetch()] == [3, 4]
        with pytest.raises(ValueError, match="batch"):
            reader.backfill(0, 0, batch=0)
        open_bf = reader.backfill(0, 0, batch=1)
        assert open_bf.fetch()
    assert open_bf.fetch() == []  # closing the reader ended it


def test_readers_on_threads_see_committed_data(storage: NodeStorage) -> None:
    storage.write_batch([doc(v, b"k%d" % s, s) for v in range(4) for s in range(1, 51)], [])
    results: dict[int, list[int]] = {}

    def run(vb: int) -> None:
        results[vb] = [r.seq for r in read_all(storage, vb, batch=7)]

    threads = [threading.Thread(target=run, args=(vb,)) for vb in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {vb: list(range(1, 51)) for vb in range(4)}


# --- maintenance


def test_purge_removes_only_old_tombstones(tmp_path: Path) -> None:
    with NodeStorage(tmp_path, "b") as s:
        s.save_partitions([record(0, high=6), record(1, high=2, purge=9), record(2, high=1)])
        s.write_batch(
            [
                doc(0, b"old1", 1, deleted=True, delete_time=100),
                doc(0, b"live", 2, value=b"keep"),
                doc(0, b"old2", 3, deleted=True, delete_time=200),
                doc(0, b"young", 4, deleted=True, delete_time=900),
                doc(0, b"live2", 5),
                doc(1, b"old", 2, deleted=True, delete_time=100),
                doc(2, b"live", 1),
            ],
            [],
        )
        assert s.purge_tombstones(older_than=500, now=1000) == {0: 3, 1: 9}
        assert s.get(0, b"old1") is None and s.get(0, b"old2") is None
        assert s.get(0, b"young") == doc(0, b"young", 4, deleted=True, delete_time=900)
        assert s.get(0, b"live") == doc(0, b"live", 2, value=b"keep")
        assert s.doc_count(include_deleted=True) == 4
        assert s.purge_tombstones(older_than=500, now=1000) == {}
    with NodeStorage(tmp_path, "b") as s:
        parts = s.load_partitions()
        assert [parts[v].purge_seq for v in range(3)] == [3, 9, 0]
        assert s.purge_tombstones(older_than=0) == {0: 4}
        assert s.load_partitions()[0].purge_seq == 4


def test_rollback(storage: NodeStorage) -> None:
    storage.write_batch([doc(0, b"k%d" % s, s) for s in range(1, 11)], [record(0, high=10)])
    storage.write_batch([doc(1, b"k%d" % s, s) for s in range(1, 11)], [record(1, high=10)])
    storage.write_batch([doc(0, b"k1", 11)], [record(0, high=11)])
    assert storage.rollback(0, 6) == 5  # k7..k10 and k1's latest version
    assert [r.seq for r in read_all(storage, 0)] == [2, 3, 4, 5, 6]
    assert storage.get(0, b"k1") is None
    assert storage.doc_count(1) == 10
    assert storage.load_partitions()[0] == PartitionRecord(0, "active", ((0xABC, 0),), 6, 0, 6, 6)
    assert storage.rollback(0, 6) == 0
    assert storage.rollback(0, 0) == 5


# --- meta


def test_clean_shutdown_marker_persists(tmp_path: Path) -> None:
    with NodeStorage(tmp_path, "b") as s:
        assert not s.clean_shutdown()
        s.set_clean_shutdown(True)
        assert s.clean_shutdown()
    with NodeStorage(tmp_path, "b") as s:
        assert s.clean_shutdown()
        s.set_clean_shutdown(False)
    with NodeStorage(tmp_path, "b", sync_full=True) as s:
        assert not s.clean_shutdown()


def test_bucket_uuid_is_stable_and_per_bucket(tmp_path: Path) -> None:
    with NodeStorage(tmp_path / "data", "b") as s:
        uuid = s.bucket_uuid()
        s.write_batch([doc(0, b"a", 1)], [])
    assert len(uuid) == 32 and int(uuid, 16) >= 0
    with NodeStorage(tmp_path / "data", "b") as s:
        assert s.bucket_uuid() == uuid
        assert s.get(0, b"a") == doc(0, b"a", 1)  # reopening kept the data
    with NodeStorage(tmp_path / "data", "other") as s:
        assert s.bucket_uuid() != uuid
    assert sorted(p.name for p in (tmp_path / "data").glob("*.sqlite3")) == [
        "b.sqlite3",
        "other.sqlite3",
    ]


def test_file_is_in_wal_mode(storage: NodeStorage) -> None:
    conn = sqlite3.connect(storage.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_sync_full_storage_works(tmp_path: Path) -> None:
    with NodeStorage(tmp_path, "b", sync_full=True) as s:
        s.write_batch([doc(0, b"a", 1)], [record(0, high=1)])
        s.save_partitions([record(0, high=1)])
        assert read_all(s, 0) == [doc(0, b"a", 1)]


# --- errors


def test_garbage_file_raises_storage_error(tmp_path: Path) -> None:
    (tmp_path / "b.sqlite3").write_bytes(b"this is not a database\n" * 200)
    with pytest.raises(StorageError, match=r"b\.sqlite3") as info:
        NodeStorage(tmp_path, "b")
    assert isinstance(info.value, UprError)
    assert "\n" not in str(info.value)


def test_foreign_sqlite_database_raises_storage_error(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "b.sqlite3")
    conn.execute("CREATE TABLE something (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StorageError, match="not an upr node database"):
        NodeStorage(tmp_path, "b")


def test_future_schema_version_raises_storage_error(tmp_path: Path) -> None:
    NodeStorage(tmp_path, "b").close()
    conn = sqlite3.connect(tmp_path / "b.sqlite3")
    conn.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(StorageError, match=r"b\.sqlite3.*schema version 999"):
        NodeStorage(tmp_path, "b")


@pytest.mark.parametrize(
    "log",
    ["{not json", '{"uuid": "1", "seq": "0"}', '[{"uuid": 1, "seq": "0"}]', '[{"uuid": "x"}]'],
)
def test_corrupt_failover_log_raises_storage_error(storage: NodeStorage, log: str) -> None:
    storage.save_partitions([record(4)])
    conn = sqlite3.connect(storage.path)
    conn.execute("UPDATE partitions SET failover_log = ?", (log,))
    conn.commit()
    conn.close()
    with pytest.raises(StorageError, match=r"default\.sqlite3: vb 4: corrupt failover log"):
        storage.load_partitions()


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "x" * 101])
def test_bad_bucket_name_is_a_usage_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(UsageError):
        NodeStorage(tmp_path, name)


# --- model test

KEYS = [b"a", b"b", b"c", b"d", b"e", b"f"]
op = st.tuples(
    st.integers(0, 2),  # vbucket
    st.sampled_from(KEYS),
    st.integers(1, 3),  # seq step
    st.booleans(),  # deleted
    st.integers(0, U64_MAX),  # cas
    st.binary(max_size=8),
)
history = st.lists(st.tuples(st.lists(op, max_size=8), st.booleans()), max_size=8)


@settings(max_examples=60, deadline=None)
@given(history, st.integers(0, 30), st.integers(1, 4))
def test_write_batches_match_a_dict_model(
    batches: list[tuple[list[tuple[int, bytes, int, bool, int, bytes]], bool]],
    after: int,
    batch_size: int,
) -> None:
    model: dict[tuple[int, bytes], DocRow] = {}
    seqs = [0, 0, 0]
    with tempfile.TemporaryDirectory() as tmp, NodeStorage(Path(tmp), "m") as s:
        for ops, stale in batches:
            docs = []
            next_seqs = list(seqs)
            for vb, key, step, deleted, cas, value in ops:
                next_seqs[vb] += step
                docs.append(
                    DocRow(vb, key, next_seqs[vb], 1, cas, 0, 0, 0, deleted, int(deleted), value)
                )
            if stale and model:  # a version that does not advance its key: all-or-nothing
                old = next(iter(model.values()))
                with pytest.raises(ValueError):
                    s.write_batch([*docs, old], [])
                continue
            s.write_batch(docs, [])
            seqs = next_seqs
            for d in docs:
                model[(d.vbucket, d.key)] = d
        for vb in range(3):
            expect = sorted(
                (d for d in model.values() if d.vbucket == vb and d.seq > after),
                key=lambda d: d.seq,
            )
            assert read_all(s, vb, after, batch=batch_size) == expect
            assert s.doc_count(vb, include_deleted=True) == sum(k[0] == vb for k in model)
            with s.open_reader() as reader:
                high = max((d.seq for d in model.values() if d.vbucket == vb), default=0)
                assert reader.backfill(vb, after).high_seq == high
        for (vb, key), d in model.items():
            assert s.get(vb, key) == d


def test_get_many_matches_get(tmp_path: Path) -> None:
    """get_many returns exactly what get returns for each pair, absent keys left out."""
    store = NodeStorage(tmp_path, "b")
    docs = [DocRow(vb, f"k{i}".encode(), i + 1, 1, 7, 0, 0, 0, i % 5 == 0, 0, b"v")
            for vb in range(3) for i in range(700)]  # fmt: skip
    store.write_batch(docs, [])
    pairs = [(vb, f"k{i}".encode()) for vb in range(4) for i in range(0, 800, 3)]
    got = store.get_many(pairs)
    assert got == {p: d for p in pairs if (d := store.get(*p)) is not None}
    plan = store._db.execute(
        "EXPLAIN QUERY PLAN SELECT d.key FROM (VALUES (?,?),(?,?)) AS v CROSS JOIN docs AS d "
        "ON d.vbucket = v.column1 AND d.key = v.column2",
        (1, b"a", 2, b"b"),
    ).fetchall()
    assert "SEARCH d USING PRIMARY KEY" in str(plan) and "SCAN d" not in str(plan)
    store.close()


def test_fetch_rows_match_fetch(tmp_path: Path) -> None:
    """The producer's tuple path gives the same rows as DocRows, 64-bit values included."""
    store = NodeStorage(tmp_path, "b")
    docs = [DocRow(0, f"k{i}".encode(), i + 1, 2**64 - 1 - i, 2**63 + i, i, 0, 1, i % 3 == 0,
                   7 if i % 3 == 0 else 0, b"v%d" % i) for i in range(50)]  # fmt: skip
    store.write_batch(docs, [])
    reader = store.open_reader()
    a = reader.backfill(0, 0, batch=7)
    docs_read = []
    while batch := a.fetch():
        docs_read += batch
    b = reader.backfill(0, 0, batch=7)
    rows = []
    while batch2 := b.fetch_rows():
        rows += batch2
    assert [DocRow(*r[:8], bool(r[8]), *r[9:]) for r in rows] == docs_read == docs
    reader.close()
    store.close()
