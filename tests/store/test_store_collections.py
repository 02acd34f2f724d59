"""The store with collections (formats/store.md schema version 4): keys by collection,
names, drops through the mutation log, the migration of version 3 stores."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from upr_cli.collections import CollectionsManifest, ManifestChange
from upr_cli.collections import Path as CPath
from upr_cli.errors import UsageError
from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.store import Store, StoreError
from upr_cli.store import schema as store_schema

UUID = 0xFEEDFACE
JSON = 0x01
APP, USERS, ORDERS = 8, 9, 10  # the ids a manifest gives: scope app, app.users, app.orders


def rec(seq: int, key: bytes, value: bytes = b'{"v":1}', *, cid: int = 0, p: int = 0,
        op: int = OP_MUTATION) -> DcpRecord:  # fmt: skip
    return DcpRecord(op, p, seq, 1, seq * 10, 0, 0, 0, JSON, memoryview(key),
                     memoryview(value), 0, cid)  # fmt: skip


def pos(seq: int, p: int = 0) -> StreamPosition:
    return StreamPosition(p, UUID, seq, seq, seq)


def created(seq: int, cid: int, name: str, p: int = 0) -> ManifestChange:
    return ManifestChange(p, seq, "collection-created", seq, APP, cid, name)


def dropped(seq: int, cid: int, p: int = 0) -> ManifestChange:
    return ManifestChange(p, seq, "collection-dropped", seq, APP, cid)


def app_manifest() -> CollectionsManifest:
    return (
        CollectionsManifest()
        .with_scope("app")
        .with_collection("app", "users")
        .with_collection("app", "orders", max_ttl=60)
    )


def live(s: Store, p: int = 0) -> dict[tuple[int, bytes], bytes]:
    return {(d.collection, d.key): d.value for d in s.documents([p], include_deleted=False)}


# --- keys by collection, names and views ---------------------------------------------------


def test_the_manifest_gives_the_ids_this_file_uses() -> None:
    m = app_manifest()
    assert m.scope("app").id == APP  # type: ignore[union-attr]
    assert m.path_of(USERS) == CPath("app", "users")
    assert m.path_of(ORDERS) == CPath("app", "orders")


def test_the_same_key_in_two_collections_is_two_documents(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=10) as s:
        s.record_manifest(app_manifest())
        s.apply(0, [rec(1, b"k", b'{"in":"default"}'), rec(2, b"k", b'{"in":"users"}', cid=USERS)],
                pos(2))  # fmt: skip
        s.apply(0, [rec(3, b"k", b'{"in":"users","v":2}', cid=USERS)], pos(3))
        assert s.get(0, b"k").value == b'{"in":"default"}'  # type: ignore[union-attr]
        assert s.get(0, b"k", USERS).value == b'{"in":"users","v":2}'  # type: ignore[union-attr]
        assert s.get(0, b"k", ORDERS) is None
        assert s.count() == 2
        assert [(d.collection, d.key) for d in s.documents()] == [(0, b"k"), (USERS, b"k")]
        rows = s.db.execute(
            "SELECT id, collection_id, scope, collection, json_extract(doc, '$.in')"
            " FROM json_documents ORDER BY collection_id"
        ).fetchall()
        assert rows == [("k", 0, "_default", "_default", "default"),
                        ("k", USERS, "app", "users", "users")]  # fmt: skip
        named = s.db.execute(
            "SELECT scope, collection, deleted FROM named_documents ORDER BY collection_id"
        ).fetchall()
        assert named == [("_default", "_default", 0), ("app", "users", 0)]
        # the second write of k in users replaced the first: one undo entry, in users
        log = s.db.execute("SELECT seq, collection_id, prev_seq FROM mutation_log").fetchall()
        assert log == [(3, USERS, 2)]
        assert s.rollback(0, 2).restored == 1
        assert s.get(0, b"k", USERS).value == b'{"in":"users"}'  # type: ignore[union-attr]


def test_a_key_changed_in_two_collections_in_one_batch(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=10) as s:
        s.apply(0, [rec(1, b"a"), rec(2, b"a", cid=USERS)], pos(2))
        # both replace a row; same key bytes, different collections: one run, two entries
        s.apply(0, [rec(3, b"a", b"1"), rec(4, b"a", b"2", cid=USERS), rec(5, b"a", b"3")],
                pos(5))  # fmt: skip
        assert live(s) == {(0, b"a"): b"3", (USERS, b"a"): b"2"}
        s.rollback(0, 2)
        assert live(s) == {(0, b"a"): b'{"v":1}', (USERS, b"a"): b'{"v":1}'}


def test_an_unknown_collection_keeps_its_documents_without_names(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.apply(0, [rec(1, b"x", cid=0x77)], pos(1))
        assert s.db.execute("SELECT scope, collection FROM named_documents").fetchall() == [
            (None, None)
        ]


def test_record_manifest_names_ids_and_is_idempotent(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        m = app_manifest()
        s.record_manifest(m)
        s.record_manifest(m)
        got = {cid: (str(c), c.max_ttl, c.dropped) for cid, c in s.collections().items()}
        assert got == {0: ("_default._default", None, False), USERS: ("app.users", None, False),
                       ORDERS: ("app.orders", 60, False)}  # fmt: skip
        assert s.meta()["manifest_uid"] == str(m.uid)
        # a newer manifest without users: dropped; an older one changes nothing back
        newer = m.without(CPath("app", "users"))
        s.record_manifest(newer)
        assert s.collections()[USERS].dropped and not s.collections()[ORDERS].dropped
        s.record_manifest(m)
        assert s.collections()[USERS].dropped and s.meta()["manifest_uid"] == str(newer.uid)


def test_changes_name_collections_and_scopes(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        scope = ManifestChange(0, 1, "scope-created", 1, APP, None, "app")
        s.apply(0, [rec(3, b"u", cid=USERS)], pos(3),
                changes=[scope, created(2, USERS, "users")])  # fmt: skip
        assert str(s.collections()[USERS]) == "app.users"
        assert s.position(0) == pos(3)


def test_changes_are_checked(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.apply(0, [rec(1, b"a")], pos(1))
        bad = [
            ([], [created(1, USERS, "users")], "not above 1"),  # at the held seq
            ([rec(2, b"b")], [created(2, USERS, "users")], "at a row's seq"),
            ([], [created(3, USERS, "u"), created(2, ORDERS, "o")], "out of order"),
            ([], [created(2, USERS, "users", p=1)], "a change of partition 1"),
            ([], [ManifestChange(0, 2, "collection-modified", 2, APP, USERS)], "not a manifest"),
            ([], [ManifestChange(0, 2, "collection-dropped", 2, APP, None)], "not a manifest"),
            ([], [created(9, USERS, "users")], "does not cover seq 9"),
        ]
        for rows, changes, message in bad:
            with pytest.raises(ValueError, match=message):
                s.apply(0, rows, pos(5), changes=changes)
        assert s.position(0) == pos(1) and s.collections().keys() == {0}


# --- a drop goes through the mutation log (formats/store.md §5.5) -------------------------


def test_a_drop_removes_the_collection_in_its_partition_and_a_rollback_brings_it_back(
    tmp_path: Path,
) -> None:
    with Store(tmp_path / "s.db", undo_window=100) as s:
        s.record_manifest(app_manifest())
        s.apply(0, [rec(1, b"a", cid=USERS), rec(2, b"b", cid=USERS), rec(3, b"a"),
                    rec(4, b"c", cid=ORDERS)], pos(4))  # fmt: skip
        s.apply(1, [rec(1, b"z", cid=USERS, p=1)], pos(1, 1))
        # b is updated and deleted, a updated, then users is dropped at 8
        s.apply(0, [rec(5, b"b", b"b2", cid=USERS), rec(6, b"a", b"a2", cid=USERS),
                    rec(7, b"b", b"", cid=USERS, op=OP_DELETION)], pos(8),
                changes=[dropped(8, USERS)])  # fmt: skip
        assert live(s) == {(0, b"a"): b'{"v":1}', (ORDERS, b"c"): b'{"v":1}'}
        assert s.get(0, b"b", USERS) is None  # the tombstone went too
        assert live(s, 1) == {(USERS, b"z"): b'{"v":1}'}  # another partition keeps its own
        assert s.collections()[USERS].dropped
        # the drop logged a and b's tombstone at seq 8
        logged = s.db.execute(
            "SELECT key, prev_seq, prev_deleted FROM mutation_log WHERE seq = 8 ORDER BY key"
        ).fetchall()
        assert logged == [(b"a", 6, 0), (b"b", 7, 1)]
        s.apply(0, [rec(9, b"d", cid=ORDERS)], pos(9))

        before_drop = s.rollback(0, 7)  # the state just before the drop
        assert not before_drop.too_far
        assert s.get(0, b"a", USERS).value == b"a2"  # type: ignore[union-attr]
        assert s.get(0, b"b", USERS).deleted  # type: ignore[union-attr]
        assert s.get(0, b"d", ORDERS) is None
        s.apply(0, [], pos(8), changes=[dropped(8, USERS)])  # the source sends it again
        assert (USERS, b"a") not in live(s)
        s.rollback(0, 4)  # across the drop and the changes before it
        assert live(s) == {(USERS, b"a"): b'{"v":1}', (USERS, b"b"): b'{"v":1}',
                           (0, b"a"): b'{"v":1}', (ORDERS, b"c"): b'{"v":1}'}  # fmt: skip
        assert s.partition_state(0).log_count == 0  # type: ignore[union-attr]


def test_a_drop_with_no_undo_window_cannot_be_rolled_back(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=0) as s:
        s.apply(0, [rec(1, b"a", cid=USERS), rec(2, b"b")], pos(2))
        s.apply_change(0, dropped(3, USERS), pos(3))
        assert live(s) == {(0, b"b"): b'{"v":1}'}
        assert s.partition_state(0).log_floor == 3  # type: ignore[union-attr]
        assert s.rollback(0, 2).too_far


def test_a_drop_larger_than_the_window_trims_past_its_seq(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=2) as s:
        s.apply(0, [rec(i, b"k%d" % i, cid=USERS) for i in range(1, 5)], pos(4))
        s.apply_change(0, dropped(5, USERS), pos(5))
        state = s.partition_state(0)
        assert state is not None and state.log_count == 0 and state.log_floor == 5
        assert s.count() == 0 and s.rollback(0, 4).too_far


def test_a_scope_drop_removes_its_collections(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=10) as s:
        s.record_manifest(app_manifest())
        s.apply(0, [rec(1, b"u", cid=USERS), rec(2, b"o", cid=ORDERS), rec(3, b"d")], pos(3))
        s.apply_change(0, ManifestChange(0, 4, "scope-dropped", 9, APP), pos(4))
        assert live(s) == {(0, b"d"): b'{"v":1}'}
        assert s.collections()[ORDERS].dropped
        s.rollback(0, 3)
        assert len(live(s)) == 3


def test_lost_writes_keep_their_collection(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=10) as s:
        s.apply(0, [rec(1, b"a", cid=USERS)], pos(1))
        s.apply(0, [rec(2, b"a", b"new", cid=USERS)], pos(2))
        s.rollback(0, 1)
        (lw,) = s.lost_writes()
        assert (lw.document.collection, lw.document.key, lw.document.value) == (
            USERS, b"a", b"new")  # fmt: skip


def test_restore_rows_of_either_width(tmp_path: Path) -> None:
    """Plain rows in ROW_FIELDS order with the collection (13 fields) or without it (12,
    as written before collections: the default collection)."""
    with Store(tmp_path / "s.db") as s:
        s.restore_rows([(OP_MUTATION, 0, 1, 1, 1, 0, 0, 0, 0, b"k", b"v", 0)])
        s.restore_rows([(OP_MUTATION, 0, 2, 1, 1, 0, 0, 0, 0, b"k", b"w", 0, USERS)])
        s.restore_rows([rec(3, b"k", b"x", cid=ORDERS)], keep_log=True)
        assert live(s) == {(0, b"k"): b"v", (USERS, b"k"): b"w", (ORDERS, b"k"): b"x"}
        # a cas above 2^63 - 1 takes the i64 retry path, which keeps the collection too
        s.restore_rows([(OP_MUTATION, 1, 4, 1, 1 << 63, 0, 0, 0, 0, b"k", b"z", 0, USERS)])
        doc = s.get(1, b"k", USERS)
        assert doc is not None and doc.cas == 1 << 63 and s.get(1, b"k") is None


def test_apply_many_takes_changes(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=10) as s:
        s.apply_many([(0, [rec(1, b"a", cid=USERS)], pos(1), None),
                      (1, [rec(1, b"b", cid=USERS, p=1)], pos(2, 1), None,
                       [dropped(2, USERS, p=1)])])  # fmt: skip
        assert s.count(partition=0) == 1 and s.count(partition=1) == 0


# --- the filter a store follows ------------------------------------------------------------


def test_a_store_keeps_the_filter_it_was_replayed_with(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.claim_filter("app.users")
        s.claim_filter("")  # no positions yet: anything goes
        s.claim_filter("app.users")
        s.apply(0, [rec(1, b"a", cid=USERS)], pos(1))
        s.claim_filter("app.users")
        with pytest.raises(UsageError, match=r"follows --collections app\.users, not every"):
            s.claim_filter("")
    with Store(tmp_path / "t.db") as s:  # a store replayed before collections
        s.apply(0, [rec(1, b"a")], pos(1))
        with pytest.raises(UsageError, match="follows every collection, not --collections app"):
            s.claim_filter("app")


# --- migration 3 → 4 -----------------------------------------------------------------------


def v3_vector() -> str:
    """The version-3 store of formats/store.md §8 (its "Vector: a version-3 store")."""
    text = (Path(__file__).resolve().parents[2] / "formats" / "store.md").read_text()
    (block,) = re.findall(r"```sql\n-- vector: a version-3 store\n(.*?)```", text, re.S)
    return block


def v3_store(path: Path) -> Path:
    conn = sqlite3.connect(path)
    conn.executescript(v3_vector())
    conn.close()
    return path


def test_a_version_3_store_is_migrated_into_the_default_collection(tmp_path: Path) -> None:
    path = v3_store(tmp_path / "old.db")
    with Store(path, create=False) as s:
        assert s.meta()["schema_version"] == str(store_schema.SCHEMA_VERSION) == "5"
        assert s.meta()["source"] == "upr://old"
        assert live(s, 3) == {(0, b"a"): b'{"a":2}'}
        assert s.get(3, b"b").deleted  # type: ignore[union-attr]
        assert s.position(3) == StreamPosition(3, UUID, 4, 4, 4)
        assert s.failover_log(3) == FailoverLog.of([(UUID, 0)])
        assert s.db.execute(
            "SELECT id, scope, collection, doc, xattrs FROM json_documents"
        ).fetchall() == [("a", "_default", "_default", '{"a":2}', None)]
        (lw,) = s.lost_writes()
        assert (lw.document.collection, lw.document.key) == (0, b"c")
        # the migrated log still undoes: back to 2, a@1 and b@2 return
        assert s.boundaries(3) == {3: [2, 4]}
        res = s.rollback(3, 2)
        assert (res.too_far, res.restored) == (False, 2)
        assert live(s, 3) == {(0, b"a"): b'{"a":1}', (0, b"b"): b"b"}
        # and the migrated store takes collections
        s.apply(3, [rec(3, b"a", cid=USERS, p=3)], pos(3, 3))
        assert s.count(partition=3) == 3


def test_a_failed_migration_leaves_the_version_3_store_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = v3_store(tmp_path / "old.db")
    migrate = store_schema.MIGRATIONS[3]

    def crash(db: object) -> None:
        migrate(db)  # type: ignore[arg-type]
        raise sqlite3.OperationalError("disk I/O error")  # after every step ran

    monkeypatch.setitem(store_schema.MIGRATIONS, 3, crash)
    with pytest.raises(StoreError, match="disk I/O error"):
        Store(path, create=False)
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            "3",
        )
        columns = [r[1] for r in conn.execute("PRAGMA table_info(documents)")]
        assert "collection_id" not in columns
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_schema")}
        assert "collections" not in names and "documents_v4" not in names
        assert conn.execute("SELECT count(*) FROM mutation_log").fetchone() == (2,)
    finally:
        conn.close()
    monkeypatch.setitem(store_schema.MIGRATIONS, 3, migrate)
    with Store(path, create=False) as s:
        assert s.count(include_deleted=True) == 2


def test_migration_2_to_3_records_complete_positions(tmp_path: Path) -> None:
    path = v3_store(tmp_path / "old.db")
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("INSERT INTO partitions VALUES (4, 1, 6, 0, 9, NULL, 0, 0, 'now')")
        conn.execute("DROP TABLE boundaries")
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    conn.close()
    with Store(path) as s:
        assert s.meta()["schema_version"] == "5"
        # partition 3's position ends its snapshot; partition 4's (6 of 0..9) does not
        assert s.boundaries() == {3: [4]}
