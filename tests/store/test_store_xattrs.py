"""The store with xattrs (formats/store.md schema version 5, §3.9): the `xattrs` column of
documents and tombstones, the views, rollback and lost writes through `prev_xattrs`, a
malformed blob, and the migration of a version-4 store built by the version-4 code."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.store.test_store_collections import v3_store
from upr_cli.collections import ManifestChange
from upr_cli.errors import UprError
from upr_cli.position import StreamPosition
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_EXPIRATION, OP_MUTATION, DcpRecord
from upr_cli.store import Store, StoreError, xattrs_json
from upr_cli.store import schema as store_schema

UUID = 0xFEEDFACE
JSON = 0x01
SYNC = xattrs.encode({"_sync": '{"rev":"1-a","seq":1}'})
BOTH = xattrs.encode({"_sync": '{"rev":"2-b", "seq": 2}', "app": '"blue"'})


def rec(seq: int, key: bytes, value: bytes = b'{"v":1}', blob: bytes = b"", *,
        op: int = OP_MUTATION, p: int = 0, cid: int = 0) -> DcpRecord:  # fmt: skip
    datatype = JSON if value else 0
    return DcpRecord(op, p, seq, 1, seq * 10, 0, 0, 7 if op != OP_MUTATION else 0, datatype,
                     memoryview(key), memoryview(value), 0, cid, blob)  # fmt: skip


def pos(seq: int, p: int = 0) -> StreamPosition:
    return StreamPosition(p, UUID, seq, seq, seq)


def column(s: Store, key: bytes, p: int = 0) -> object:
    row = s.db.execute(
        "SELECT xattrs FROM documents WHERE partition = ? AND key = ?", (p, key)
    ).fetchone()
    return None if row is None else json.loads(row[0]) if row[0] is not None else "NULL"


def test_documents_and_tombstones_keep_their_xattrs_as_json(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.apply(0, [rec(1, b"sg", b'{"n":1}', BOTH), rec(2, b"plain"),
                    rec(3, b"gone", b'{"n":3}', BOTH)], pos(3))  # fmt: skip
        # deletion and expiration carry the system xattrs the server kept
        s.apply(0, [rec(4, b"gone", b"", xattrs.system_only(BOTH), op=OP_DELETION),
                    rec(5, b"plain", b"", SYNC, op=OP_EXPIRATION)], pos(5))  # fmt: skip
        assert column(s, b"sg") == {"_sync": {"rev": "2-b", "seq": 2}, "app": "blue"}
        assert column(s, b"gone") == {"_sync": {"rev": "2-b", "seq": 2}}
        assert column(s, b"plain") == {"_sync": {"rev": "1-a", "seq": 1}}
        # the value's JSON text is kept as it came, names in the blob's order
        (text,) = s.db.execute("SELECT xattrs FROM documents WHERE key = x'7367'").fetchone()
        assert text == '{"_sync":{"rev":"2-b", "seq": 2},"app":"blue"}'
        doc = s.get(0, b"sg")
        assert doc is not None and xattrs.to_json(doc.xattrs) == json.loads(text)
        assert doc.value == b'{"n":1}' and doc.datatype == JSON  # the body stays JSON text
        tomb = s.get(0, b"gone")
        assert tomb is not None and tomb.deleted and tomb.value == b""
        assert xattrs.pairs(tomb.xattrs) == [("_sync", b'{"rev":"2-b","seq":2}')]
        # a change without xattrs replaces them with none
        s.apply(0, [rec(6, b"sg", b'{"n":2}')], pos(6))
        assert column(s, b"sg") == "NULL" and s.get(0, b"sg").xattrs == b""  # type: ignore[union-attr]


def test_the_views_show_xattrs(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.apply(0, [rec(1, b"a", b'{"n":1}', BOTH), rec(2, b"b"),
                    rec(3, b"c", b"", SYNC, op=OP_DELETION)], pos(3))  # fmt: skip
        got = s.db.execute(
            "SELECT id, json_extract(xattrs, '$.app') FROM json_documents ORDER BY id"
        ).fetchall()
        assert got == [("a", "blue"), ("b", None)]
        named = s.db.execute(
            "SELECT CAST(key AS TEXT), deleted, json_extract(xattrs, '$._sync.rev')"
            " FROM named_documents ORDER BY key"
        ).fetchall()
        assert named == [("a", 0, "2-b"), ("b", 0, None), ("c", 1, "1-a")]


def test_a_rollback_puts_the_xattrs_back(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", undo_window=100) as s:
        s.apply(0, [rec(1, b"a", b'{"n":1}', SYNC), rec(2, b"b", b'{"n":2}', BOTH)], pos(2))
        s.apply(0, [rec(3, b"a", b'{"n":3}', BOTH),
                    rec(4, b"b", b"", xattrs.system_only(BOTH), op=OP_DELETION),
                    rec(5, b"a", b'{"n":5}')], pos(5))  # fmt: skip
        logged = s.db.execute(
            "SELECT seq, json_extract(prev_xattrs, '$._sync.rev') FROM mutation_log ORDER BY seq"
        ).fetchall()
        assert logged == [(3, "1-a"), (4, "2-b"), (5, "2-b")]
        res = s.rollback(0, 2)
        assert (res.too_far, res.restored, res.lost) == (False, 2, 2)
        assert column(s, b"a") == {"_sync": {"rev": "1-a", "seq": 1}}
        assert column(s, b"b") == {"_sync": {"rev": "2-b", "seq": 2}, "app": "blue"}
        assert not s.get(0, b"b").deleted  # type: ignore[union-attr]
        # the versions taken back keep theirs: a@5 had none, b's tombstone its _sync
        lost = {w.document.key: xattrs.to_json(w.document.xattrs) for w in s.lost_writes()}
        assert lost == {b"a": {}, b"b": {"_sync": {"rev": "2-b", "seq": 2}}}


def test_a_collection_drop_undone_brings_the_xattrs_back(tmp_path: Path) -> None:
    users = 9
    drop = ManifestChange(0, 3, "collection-dropped", 3, 8, users)
    with Store(tmp_path / "s.db", undo_window=10) as s:
        s.apply(0, [rec(1, b"a", b'{"n":1}', BOTH, cid=users)], pos(1))
        s.apply(0, [rec(2, b"z")], pos(3), changes=[drop])
        assert s.get(0, b"a", users) is None
        s.rollback(0, 1)
        doc = s.get(0, b"a", users)
        assert doc is not None and doc.xattrs == xattrs.from_json(xattrs.to_json(BOTH))


def test_batches_with_and_without_xattrs_and_plain_rows(tmp_path: Path) -> None:
    """Records are bound without their xattrs when a batch has none; plain rows of 14
    fields (a restore of a backup with xattrs) keep them; the i64 retry keeps them too."""
    with Store(tmp_path / "s.db", undo_window=5) as s:
        s.apply(0, [rec(1, b"a"), rec(2, b"b", b'{"n":2}', SYNC), rec(3, b"c")], pos(3))
        assert [column(s, k) for k in (b"a", b"b", b"c")] == ["NULL", {"_sync": {"rev": "1-a",
                                                               "seq": 1}}, "NULL"]  # fmt: skip
        s.restore_rows(
            [
                (OP_MUTATION, 1, 1, 1, 1, 0, 0, 0, 0, b"k", b"v", 0, 0, BOTH),
                (OP_MUTATION, 1, 2, 1, 1, 0, 0, 0, 0, b"l", b"v", 0, 0, b""),
            ]
        )
        s.restore_rows([(OP_MUTATION, 1, 3, 1, 1 << 63, 0, 0, 0, 0, b"m", b"v", 0, 0, SYNC)])
        s.restore_rows([(OP_MUTATION, 1, 4, 1, 1, 0, 0, 0, 0, b"n", b"v", 0, 0, b"")])
        s.restore_rows([rec(5, b"o", b'{"n":5}', SYNC, p=1)], keep_log=True)
        got = {k: column(s, k, 1) for k in (b"k", b"l", b"m", b"n", b"o")}
        assert got == {b"k": xattrs.to_json(BOTH), b"l": "NULL", b"m": xattrs.to_json(SYNC),
                       b"n": "NULL", b"o": xattrs.to_json(SYNC)}  # fmt: skip
        assert s.get(1, b"m").cas == 1 << 63  # type: ignore[union-attr]


def test_a_malformed_blob_is_a_typed_error_naming_the_key(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.apply(0, [rec(1, b"a")], pos(1))
        bad = b"\x00\x00\x00\x06\x00\x00\x00\x02ab"  # a pair without its zero bytes
        with pytest.raises(xattrs.CorruptXattrsError) as info:
            s.apply(0, [rec(2, b"b", b'{"n":2}', SYNC), rec(3, b"evil", b"{}", bad)], pos(3))
        assert isinstance(info.value, UprError) and "'evil'" in str(info.value)
        assert s.position(0) == pos(1) and s.get(0, b"b") is None  # nothing committed
        with pytest.raises(xattrs.CorruptXattrsError, match="'worse'"):
            s.restore_rows([(OP_MUTATION, 0, 9, 1, 1, 0, 0, 0, 0, b"worse", b"v", 0, 0, bad)])
        s.apply(0, [rec(2, b"b", b'{"n":2}', SYNC)], pos(2))  # the store still works
        assert column(s, b"b") == xattrs.to_json(SYNC)


def test_a_value_that_is_not_json_is_kept_as_a_string() -> None:
    blob = xattrs.encode({"a": '1,"b":2', "é": '{"x": [1, 2]}', "c": b"\xff"})
    assert json.loads(xattrs_json(blob)) == {"a": '1,"b":2', "é": {"x": [1, 2]}, "c": "\ufffd"}
    assert xattrs_json(BOTH) == '{"_sync":{"rev":"2-b", "seq": 2},"app":"blue"}'


# --- migration 4 → 5 -----------------------------------------------------------------------


def v4_store(path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A version-4 store written by the version-4 code: the version-3 vector of
    formats/store.md §8 migrated to 4 by `MIGRATIONS[3]`, then a log entry and a lost
    write added as version 4 wrote them."""
    v3_store(path)
    with monkeypatch.context() as m:
        m.setattr(store_schema, "SCHEMA_VERSION", 4)
        Store(path, create=False).close()
    conn = sqlite3.connect(path)
    with conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            "4",
        )
        columns = [r[1] for r in conn.execute("PRAGMA table_info(documents)")]
        assert columns[-1] == "collection_id" and "xattrs" not in columns
        conn.execute(
            "INSERT INTO documents VALUES (3, CAST('u' AS BLOB), 5, 1, 50, 0, 0, 0, 1, 0,"
            " '{\"u\":1}', 9)"
        )
    conn.close()
    return path


def test_a_version_4_store_is_migrated_to_5(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = v4_store(tmp_path / "old.db", monkeypatch)
    with Store(path, create=False) as s:
        assert s.meta()["schema_version"] == str(store_schema.SCHEMA_VERSION) == "5"
        assert s.db.execute("SELECT count(*) FROM documents WHERE xattrs IS NULL").fetchone() == (
            3,
        )
        assert [c for c in s.db["mutation_log"].columns_dict][-1] == "prev_xattrs"
        assert [c for c in s.db["lost_writes"].columns_dict][-1] == "xattrs"
        named = s.db.execute("SELECT * FROM named_documents ORDER BY key").fetchall()
        assert [r[-1] for r in named] == [None, None, None] and len(named[0]) == 15
        (lw,) = s.lost_writes()
        assert (lw.document.key, lw.document.xattrs) == (b"c", b"")
        # the old log entries undo, with no xattrs; new rows keep theirs
        res = s.rollback(3, 2)
        assert (res.too_far, res.restored) == (False, 2)
        assert s.get(3, b"a").value == b'{"a":1}'  # type: ignore[union-attr]
        s.apply(3, [rec(3, b"a", b'{"a":3}', SYNC, p=3)], pos(3, 3))
        assert column(s, b"a", 3) == xattrs.to_json(SYNC)


def test_a_failed_migration_leaves_the_version_4_store_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = v4_store(tmp_path / "old.db", monkeypatch)
    migrate = store_schema.MIGRATIONS[4]

    def crash(db: object) -> None:
        migrate(db)  # type: ignore[arg-type]
        raise sqlite3.OperationalError("disk I/O error")  # after every step ran

    monkeypatch.setitem(store_schema.MIGRATIONS, 4, crash)
    with pytest.raises(StoreError, match="disk I/O error"):
        Store(path, create=False)
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            "4",
        )
        for table in ("documents", "mutation_log", "lost_writes"):
            columns = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
            assert not any("xattrs" in c for c in columns), table
        (view,) = conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'json_documents'")
        assert "xattrs" not in view[0]
    finally:
        conn.close()
    monkeypatch.setitem(store_schema.MIGRATIONS, 4, migrate)
    with Store(path, create=False) as s:
        assert s.meta()["schema_version"] == "5" and s.count(include_deleted=True) == 3
