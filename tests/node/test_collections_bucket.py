"""The node's collections below the wire: the schema 1 → 2 migration (qualified keys),
the manifest a bucket keeps (uid rules, system event rows, persistence), max TTL, and
dropped collections (unreachable at once, purged later without tombstones)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from upr_cli.collections import CollectionsError, CollectionsManifest, changes_between, decode_event
from upr_cli.collections import Path as CPath
from upr_cli.errors import UsageError
from upr_cli.node import sysevents
from upr_cli.node.bucket import Bucket
from upr_cli.node.collection_state import (
    NodeCollections,
    UnknownCollectionError,
    UnknownScopeError,
    parse_specs,
    with_specs,
)
from upr_cli.node.storage import (
    _SCHEMA,
    _UNDO_SCHEMA,
    SCHEMA_VERSION,
    DocRow,
    NodeStorage,
    StorageError,
)
from upr_cli.protocol.status import InvalidArguments, KeyNotFound, OutOfRange

USERS = (
    CollectionsManifest().with_scope("app").with_collection("app", "users")
)  # uid 2: scope 8, users 9
USERS_ID = 9
APP_ONLY = CollectionsManifest().with_scope("app").dumps().decode()  # uid 1: scope 8


def _run(tmp: Path, body: Callable[[Bucket], Awaitable[None]], partitions: int = 4) -> None:
    async def main() -> None:
        bucket = Bucket(tmp, "default", partitions, flush_interval=3600)
        await bucket.start()
        try:
            await body(bucket)
        finally:
            await bucket.stop()

    asyncio.run(main())


def _rows(bucket: Bucket) -> dict[tuple[int, bytes], tuple[int, bool]]:
    with sqlite3.connect(bucket.storage.path) as c:
        rows = c.execute("SELECT vbucket, key, seq, deleted FROM docs")
        return {(vb, bytes(k)): (s, bool(d)) for vb, k, s, d in rows}


# -- migration -------------------------------------------------------------------------


def _v1_directory(tmp: Path) -> None:
    """A data directory as upr wrote it before collections: schema 1, plain keys (one of
    them equal to another's qualified form), an undo row and a lost write."""
    with sqlite3.connect(tmp / "default.sqlite3") as c:
        for stmt in (*_SCHEMA, *_UNDO_SCHEMA):
            c.execute(stmt)
        c.executemany("INSERT INTO meta VALUES (?, ?)", [("schema_version", "1"),
                      ("bucket_uuid", "ab" * 16), ("clean_shutdown", "1")])  # fmt: skip
        c.execute("INSERT INTO partitions VALUES (0, 'active', '[{\"uuid\": \"7\", \"seq\":"
                  " \"0\"}]', 3, 0, 3, 3)")  # fmt: skip
        row = "0, ?, ?, 1, 5, 0, 0, 0, 0, 0, ?"
        c.executemany(f"INSERT INTO docs VALUES ({row})",
                      [(b"a", 1, b"A"), (b"\x00a", 2, b"ZA"), (b"\xff\x00z", 3, b"F")])  # fmt: skip
        c.execute(f"INSERT INTO undo VALUES (3, {row})", (b"\xff\x00z", 1, b"old"))
        c.execute(f"INSERT INTO lost_writes VALUES (1.5, 2, {row})", (b"gone", 4, b"G"))


def test_a_schema_1_directory_is_migrated_to_qualified_keys(tmp_path: Path) -> None:
    _v1_directory(tmp_path)
    with NodeStorage(tmp_path, "default") as s:
        assert s.meta("schema_version") == str(SCHEMA_VERSION) == "2"
        assert s.get(0, b"\x00a") == DocRow(0, b"\x00a", 1, 1, 5, 0, 0, 0, False, 0, b"A")
        assert s.get(0, b"\x00\x00a").value == b"ZA"  # type: ignore[union-attr]
        assert s.get(0, b"\x00\xff\x00z").value == b"F"  # type: ignore[union-attr]
        assert s.get(0, b"a") is None
        assert [(d.key, d.value) for _, d in s.lost_writes()] == [(b"\x00gone", b"G")]
        undo = s._db.execute("SELECT key, value FROM undo").fetchall()
        assert undo == [(b"\x00\xff\x00z", b"old")]
    with NodeStorage(tmp_path, "default") as s:  # a second open changes nothing
        assert s.get(0, b"\x00a") is not None and s.get(0, b"\x00\x00\x00a") is None

    async def body(bucket: Bucket) -> None:
        assert bucket.get(0, b"\x00a").value == b"A"
        assert bucket.manifest == CollectionsManifest()  # no manifest stored: the default one

    _run(tmp_path, body, partitions=1)


def test_a_failed_migration_leaves_the_version_1_directory_as_it_was(tmp_path: Path) -> None:
    _v1_directory(tmp_path)
    with sqlite3.connect(tmp_path / "default.sqlite3") as c:  # its last step fails
        c.execute("CREATE TRIGGER no_update BEFORE UPDATE ON lost_writes"
                  " BEGIN SELECT RAISE(ABORT, 'refused'); END")  # fmt: skip
    with pytest.raises(Exception, match="refused"):
        NodeStorage(tmp_path, "default")
    with sqlite3.connect(tmp_path / "default.sqlite3") as c:
        version = c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        assert version == ("1",)
        keys = {bytes(k) for (k,) in c.execute("SELECT key FROM docs")}
        assert keys == {b"a", b"\x00a", b"\xff\x00z"}


# -- the manifest ----------------------------------------------------------------------


def test_set_manifest_writes_one_system_row_per_change_per_active_partition(
    tmp_path: Path,
) -> None:
    async def body(bucket: Bucket) -> None:
        await bucket.set_partition_state(3, "replica", cas=bucket.state_cas, rev=0)
        bucket.store("set", 0, b"\x00k", b"v")
        await bucket.set_manifest(USERS)
        assert bucket.manifest == USERS
        rows = _rows(bucket)
        for vb in (0, 1, 2):
            first = 2 if vb == 0 else 1  # partition 0 had a document at seq 1
            events = sorted((s, k) for (v, k), (s, _d) in rows.items()
                            if v == vb and sysevents.is_system_key(k))  # fmt: skip
            assert [s for s, _ in events] == [first, first + 1]
            kinds = []
            for _, key in events:
                doc = bucket.storage.get(vb, key)
                assert doc is not None
                change = decode_event(vb, doc.seq, *sysevents.event_of(doc.flags, doc.expiry,
                                                                       doc.value))  # fmt: skip
                assert change is not None
                kinds.append((change.kind, change.name, change.manifest_uid))
            # only the change's last event carries the new uid, the others the old one, as
            # kv_engine stamps them (formats/wire.md "Collections on DCP")
            assert kinds == [("scope-created", "app", 0), ("collection-created", "users", 2)]
            assert bucket.partitions[vb].persisted_seq == first + 1  # flushed before the answer
        assert not [k for (v, k) in rows if v == 3]  # a replica gets them by replication
        assert bucket.storage.meta("collections_manifest") == USERS.dumps().decode()

    _run(tmp_path, body)


def test_manifest_uid_rules(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        await bucket.set_manifest(USERS)
        high = bucket.partitions[0].high_seq
        await bucket.set_manifest(USERS)  # the same manifest again: nothing happens
        assert bucket.partitions[0].high_seq == high
        with pytest.raises(OutOfRange, match="below"):
            await bucket.set_manifest(CollectionsManifest().with_scope("x"))  # uid 1 < 2
        with pytest.raises(InvalidArguments, match="other content"):
            await bucket.set_manifest(
                CollectionsManifest().with_scope("x").with_scope("y")
            )  # uid 2
        renamed = CollectionsManifest.from_json(USERS.dumps().replace(b'"users"', b'"people"'))
        renamed = CollectionsManifest(3, renamed.scopes)
        with pytest.raises(InvalidArguments, match="cannot change"):
            await bucket.set_manifest(renamed)
        assert bucket.manifest == USERS and bucket.partitions[0].high_seq == high

    _run(tmp_path, body)


def test_the_manifest_survives_a_restart_and_a_crash(tmp_path: Path) -> None:
    async def main() -> None:
        bucket = Bucket(tmp_path, "default", 2, flush_interval=3600)
        await bucket.start()
        await bucket.set_manifest(USERS)
        await bucket.stop(clean=False)  # nothing flushed at the stop: the answer was durable
        again = Bucket(tmp_path, "default", 2, flush_interval=3600)
        await again.start()
        try:
            assert again.manifest == USERS
            assert again.partitions[0].high_seq == 2
        finally:
            await again.stop()

    asyncio.run(main())


# -- KV: keys, max TTL, drops --------------------------------------------------------------


def test_kv_checks_the_collection_of_every_key(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        with pytest.raises(UnknownCollectionError) as err:
            bucket.store("set", 0, b"\x09u", b"v")
        assert err.value.manifest_uid == 0 and err.value.code == 0x88
        await bucket.set_manifest(USERS)
        bucket.store("set", 0, b"\x09u", b"v")
        assert bucket.get(0, b"\x09u").value == b"v"
        with pytest.raises(KeyNotFound):
            bucket.get(0, b"\x00u")  # the same name in another collection
        for call in (lambda: bucket.get(0, b"\x0au"), lambda: bucket.delete(0, b"\x0au"),
                     lambda: bucket.touch(0, b"\x0au", 5), lambda: bucket.get_meta(0, b"\x0au"),
                     lambda: bucket.store_with_meta(0, b"\x0au", b"", deleted=False, flags=0,
                                                    expiry=0, rev_seq=1, item_cas=1,
                                                    datatype=0)):  # fmt: skip
            with pytest.raises(UnknownCollectionError, match="0xa is not in manifest 2"):
                call()

    _run(tmp_path, body)


def test_expiry_is_made_absolute_and_capped_by_the_max_ttl(tmp_path: Path) -> None:
    ttl = USERS.with_collection("app", "short", 100)  # id 10

    async def body(bucket: Bucket) -> None:
        await bucket.set_manifest(ttl)
        now = int(time.time())

        def stored(key: bytes, expiry: int) -> int:
            return bucket.store("set", 0, key, b"v", expiry=expiry).expiry

        assert stored(b"\x00a", 0) == 0
        assert now <= stored(b"\x00b", 50) - 50 <= now + 2  # relative: from now
        assert stored(b"\x00c", 4_000_000_000) == 4_000_000_000  # absolute: as given
        assert now <= stored(b"\x0aa", 0) - 100 <= now + 2  # none given: the max TTL
        assert now <= stored(b"\x0ab", 4_000_000_000) - 100 <= now + 2  # beyond: capped
        assert now <= stored(b"\x0ac", 30) - 30 <= now + 2  # within: kept
        assert now <= bucket.touch(0, b"\x0ac", 0).expiry - 100 <= now + 2
        meta = bucket.store_with_meta(
            0,
            b"\x0ad",
            b"v",
            deleted=False,
            flags=0,
            expiry=4_000_000_000,
            rev_seq=1,
            item_cas=1,
            datatype=0,
        )
        assert meta.expiry == 4_000_000_000  # a restore keeps an item's metadata

    _run(tmp_path, body, partitions=1)


def test_touch_and_get_meta(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        first = bucket.store("set", 0, b"\x00k", b"v", flags=7)
        touched = bucket.touch(0, b"\x00k", 4_000_000_000)
        assert (touched.seq, touched.rev_seq, touched.value, touched.flags) == (2, 2, b"v", 7)
        assert touched.cas > first.cas
        assert bucket.get_meta(0, b"\x00k") == touched
        bucket.delete(0, b"\x00k")
        assert bucket.get_meta(0, b"\x00k").deleted  # a tombstone still has metadata
        with pytest.raises(KeyNotFound):
            bucket.touch(0, b"\x00k", 5)
        with pytest.raises(KeyNotFound):
            bucket.get_meta(0, b"\x00never")
        bucket.store("set", 0, b"\x00exp", b"v", expiry=40 * 86400)  # absolute, long past
        assert bucket.get_meta(0, b"\x00exp").deleted

    _run(tmp_path, body, partitions=1)


def test_a_dropped_collection_is_unreachable_at_once_and_purged_without_tombstones(
    tmp_path: Path,
) -> None:
    both = USERS.with_collection("app", "orders")  # id 10

    async def body(bucket: Bucket) -> None:
        await bucket.set_manifest(both)
        for vb in range(4):
            for i in range(30):
                bucket.store("set", vb, b"\x09u%d" % i, b"v")
                bucket.store("set", vb, b"\x0ao%d" % i, b"v")
        await bucket.flush()
        dropped = both.without(CPath("app", "users"))
        await bucket.set_manifest(dropped)
        with pytest.raises(UnknownCollectionError):
            bucket.get(0, b"\x09u1")
        assert bucket._purger is not None
        await bucket._purger
        rows = _rows(bucket)
        assert not [k for (_vb, k) in rows if k[:1] == b"\x09"]
        assert len([k for (_vb, k) in rows if k[:1] == b"\x0a"]) == 120
        drops = [(vb, d) for (vb, k), (_s, d) in rows.items() if k == b"\x01c\x09"]
        assert sorted(drops) == [(vb, True) for vb in range(4)]  # the drop replaced the create
        assert bucket.collections.dropped == set()
        # nothing left to purge; the highest ids held stay (formats/collections.md §2)
        assert bucket.storage.meta("collections_dropped") == (
            '{"purge":[],"high_collection":10,"high_scope":8}')  # fmt: skip

    _run(tmp_path, body)


def test_a_dropped_id_never_comes_back() -> None:
    # the reviewer's finding: a raw COLLECTIONS_SET_MANIFEST dropping id 9, then one with
    # id 9 again, were both taken, and the lazy purge deleted the new collection's
    # documents
    state = NodeCollections(USERS)
    dropped = USERS.without(CPath("app", "users"))  # uid 3
    state.check(dropped)
    state.replace(dropped)
    back = CollectionsManifest.from_json(USERS.dumps().replace(b'"uid":"2"', b'"uid":"4"', 1))
    assert back.uid == 4 and back.lookup(CPath("app", "users")) is not None
    with pytest.raises(CollectionsError, match=r"collection id 0x9 \(app.users\) was used"):
        state.check(back)
    renamed = CollectionsManifest.from_json(back.dumps().replace(b'"users"', b'"people"'))
    with pytest.raises(CollectionsError, match="0x9"):
        state.check(renamed)  # under another name too
    # a scope id too, once its scope is dropped
    state.replace(dropped.without(CPath("app")))
    with pytest.raises(CollectionsError, match=r"scope id 0x8 \(app\) was used"):
        state.check(CollectionsManifest.from_json(APP_ONLY.replace('"uid":"1"', '"uid":"9"')))
    # new ids above the highest are taken
    state.check(dropped.without(CPath("app")).with_scope("app").with_collection("app", "u"))
    # the default collection, once dropped, does not come back either
    nodefault = NodeCollections(USERS)
    gone = USERS.without(CPath("_default", "_default"))
    nodefault.replace(gone)
    with pytest.raises(CollectionsError, match="0x0"):
        nodefault.check(CollectionsManifest(gone.uid + 1, USERS.scopes))


def test_the_highest_ids_survive_a_restart_and_are_derived_for_older_nodes(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        bucket = Bucket(tmp_path, "default", 1, flush_interval=3600)
        await bucket.start()
        await bucket.set_manifest(USERS)
        await bucket.set_manifest(USERS.without(CPath("app")))
        assert bucket._purger is not None
        await bucket._purger  # the purge done: no dropped id is left to remember it by
        await bucket.stop()
        again = Bucket(tmp_path, "default", 1, flush_interval=3600)
        await again.start()
        try:
            held = again.collections
            assert (held.high_collection, held.high_scope, held.dropped) == (9, 8, set())
            with pytest.raises(CollectionsError, match="0x9"):
                held.check(CollectionsManifest(9, USERS.scopes))
        finally:
            await again.stop()

    asyncio.run(main())
    # a node before the high-water marks stored a bare list of the ids to purge: the
    # marks are derived from it and the manifest
    old = NodeCollections.from_meta(USERS.dumps().decode(), "[12]")
    assert (old.high_collection, old.high_scope, old.dropped) == (12, 8, {12})
    for bad in ('{"purge": [], "high_collection": "9"}', '{"purge": 3}', "[1, 2", '"x"'):
        with pytest.raises(CollectionsError, match="stored dropped"):
            NodeCollections.from_meta(None, bad)


def test_a_purge_cut_short_resumes_at_the_next_start(tmp_path: Path) -> None:
    async def main() -> None:
        bucket = Bucket(tmp_path, "default", 1, flush_interval=3600)
        await bucket.start()
        await bucket.set_manifest(USERS)
        bucket.store("set", 0, b"\x09u", b"v")
        await bucket.flush()
        bucket._schedule_purge = lambda: None  # type: ignore[method-assign]
        await bucket.set_manifest(USERS.without(CPath("app", "users")))
        await bucket.stop(clean=False)
        again = Bucket(tmp_path, "default", 1, flush_interval=3600)
        await again.start()
        try:
            assert again.collections.dropped == {USERS_ID}
            assert again._purger is not None
            await again._purger
            assert (0, b"\x09u") not in _rows(again)
        finally:
            await again.stop()

    asyncio.run(main())


def test_a_replica_purges_what_a_drop_row_from_its_active_drops(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        await bucket.set_partition_state(0, "replica", cas=bucket.state_cas, rev=0)
        create, drop = USERS, USERS.without(CPath("app", "users"))
        bucket.replica_marker(0, 1, 4)
        rows = [*changes_between(CollectionsManifest(), create), *changes_between(create, drop)]
        seq = 0
        for change in rows:
            seq += 1
            key, flags, expiry, value, deleted = sysevents.system_row(change)
            bucket.apply_replica(DocRow(0, key, seq, 1, seq, flags, expiry, 0, deleted, 0,
                                        value))  # fmt: skip
            if change.kind == "collection-created":
                seq += 1
                bucket.apply_replica(DocRow(0, b"\x09doc", seq, 1, seq, 0, 0, 0, False, 0, b"v"))
        assert bucket.collections.dropped == {USERS_ID}
        assert bucket._purger is not None
        await bucket._purger
        assert (0, b"\x09doc") not in _rows(bucket)
        assert _rows(bucket)[(0, b"\x01c\x09")] == (4, True)

    _run(tmp_path, body, partitions=1)


# -- lookups and specs --------------------------------------------------------------------


def test_collection_and_scope_ids_by_path() -> None:
    state = NodeCollections(USERS)
    assert state.collection_id("app.users") == (2, 9)
    assert state.collection_id(".") == state.collection_id("_default._default") == (2, 0)
    assert state.scope_id("app") == state.scope_id("app.whatever") == (2, 8)
    assert state.scope_id("") == (2, 0)
    with pytest.raises(UnknownScopeError) as scope:
        state.collection_id("nope.users")
    assert scope.value.code == 0x8C and scope.value.manifest_uid == 2
    with pytest.raises(UnknownCollectionError) as coll:
        state.collection_id("app.nope")
    assert coll.value.code == 0x88
    for bad in ("app", "a.b.c", "app.$x", "app.a b"):
        with pytest.raises(Exception, match=r"path|name|dot"):
            state.collection_id(bad)


def test_serve_collection_specs(caplog: pytest.LogCaptureFixture) -> None:
    m = with_specs(CollectionsManifest(), ["app.users,app.orders:60", "logs", " "])
    assert [(s.name, [(c.name, c.max_ttl) for c in s.collections]) for s in m.scopes] == [
        ("_default", [("_default", None)]),
        ("app", [("users", None), ("orders", 60)]),
        ("logs", []),
    ]
    assert with_specs(m, ["app.users", "logs"]) == m  # present: kept as they are
    assert with_specs(CollectionsManifest(), ["app.users"]) == with_specs(
        CollectionsManifest(), ["app.users"]
    )
    assert parse_specs(["_default.c:5"]) == ("_default.c:5",)
    for bad in ("app:60", "app.users:x", "a.b.c", "app.users:99999999999", "$x",
                "app.users:3600,app.users:60"):  # fmt: skip
        with pytest.raises(UsageError):
            with_specs(CollectionsManifest(), [bad])
    # a restart with another max TTL: the spec only creates, and says so (it was silent)
    with caplog.at_level(logging.WARNING):
        assert with_specs(m, ["app.orders:3600", "app.users"]) == m
    (warned,) = [r.getMessage() for r in caplog.records]
    assert "app.orders exists with max TTL 60s, not 3600s" in warned


def test_the_key_vectors_of_the_format() -> None:
    """formats/collections.md §1 lists these keys: the document and the code agree."""
    from upr_cli.collections import ManifestChange
    from upr_cli.protocol.leb128 import join_key

    def system(kind: str, ident: int) -> bytes:
        cid = ident if kind.startswith("collection") else None
        return sysevents.system_key(ManifestChange(0, 0, kind, 0, ident, cid))

    vectors = {
        "`a` in the default collection": join_key(0, b"a"),
        "`u1` in collection 0x9": join_key(9, b"u1"),
        "`Hello` in collection 0x555": join_key(0x555, b"Hello"),
        "`k` in collection 0xffffffff": join_key(0xFFFF_FFFF, b"k"),
        "the system row of collection 0x9": system("collection-created", 9),
        "the system row of collection 0x80": system("collection-dropped", 0x80),
        "the system row of scope 0x8": system("scope-created", 8),
    }
    doc = (Path(__file__).parents[2] / "formats" / "collections.md").read_text()
    for what, key in vectors.items():
        assert f"| {what} | `{key.hex(' ')}` |" in doc, what


def test_a_corrupt_stored_manifest_is_a_storage_error(tmp_path: Path) -> None:
    with NodeStorage(tmp_path, "default") as s:
        s.set_meta({"collections_manifest": '{"uid": "zz"}'})

    async def main() -> None:
        bucket = Bucket(tmp_path, "default", 1)
        try:
            with pytest.raises(StorageError, match="stored collections manifest"):
                await bucket.start()
        finally:
            bucket.storage.close()
            bucket._lookup.close()
            bucket._pool.shutdown()

    asyncio.run(main())


def test_the_bucket_refuses_a_dropped_id(tmp_path: Path) -> None:
    """A manifest bringing back a dropped collection id is refused: the lazy purge
    would delete the returning collection's new documents."""

    async def main() -> None:
        bucket = Bucket(tmp_path, "default", 2, flush_interval=3600)
        await bucket.start()
        try:
            await bucket.set_manifest(USERS)
            await bucket.set_manifest(USERS.without(CPath("app", "users")))
            with pytest.raises(InvalidArguments, match=r"collection id 0x9 \(app.users\) was used"):
                await bucket.set_manifest(CollectionsManifest(4, USERS.scopes))
            assert bucket.manifest.lookup(CPath("app", "users")) is None
        finally:
            await bucket.stop()

    asyncio.run(main())
