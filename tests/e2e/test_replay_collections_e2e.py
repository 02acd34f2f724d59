"""upr replay of a node with collections: names in the store's views, updates, deletes,
a collection dropped between two runs, and the --collections filter."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from tests.e2e.collections_helpers import create, drop, get_manifest
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import run, wait_persisted
from upr_cli.collections import Path as CPath
from upr_cli.net.bootstrap import connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.messages import Delete, Get, Set
from upr_cli.protocol.status import Status
from upr_cli.store import Store

# (scope.collection, key) -> value: what the node should hold, and the store after a replay
Model = dict[tuple[str, bytes], bytes]


async def _write(uri: str, changes: list[tuple[int, bytes, bytes | None]]) -> None:
    """SET (value) or DELETE (None) each key in its collection (by id), through the KV
    front end with collection-qualified keys."""
    s = await connect(SourceUri.parse(uri))
    try:
        assert s.collections, "the node did not grant Collections"
        for cid, key, value in changes:
            p = partition_of(key, s.num_partitions)
            wire = s.qualify(key, cid)
            o = s.conn.next_opaque()
            msg = (Delete(vbucket=p, key=wire, opaque=o) if value is None else
                   Set(vbucket=p, key=wire, value=value, datatype=1, opaque=o))  # fmt: skip
            await s.conn.request(msg)
    finally:
        await s.conn.aclose()


def write(uri: str, model: Model, changes: list[tuple[str, bytes, bytes | None]]) -> None:
    manifest = get_manifest(uri)
    ids = {p: c.id for p in {c[0] for c in changes} if (c := manifest.lookup(CPath.parse(p)))}
    run(_write(uri, [(ids[path], key, value) for path, key, value in changes]))
    for path, key, value in changes:
        if value is None:
            model.pop((path, key), None)
        else:
            model[path, key] = value


def stored(db: Path) -> Model:
    """The store's live documents by collection name (through the json_documents view)."""
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT scope, collection, key, doc FROM json_documents").fetchall()
    c.close()
    return {(f"{s}.{n}", bytes(k)): d.encode() for s, n, k, d in rows}


def replay(node: Node, db: Path, *args: str) -> dict[str, object]:
    out = upr("replay", node.uri, "--into", str(db), "--json", "--no-progress", *args)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_replay_keeps_collections_apart_and_a_drop_removes_one(node: Node, tmp_path: Path) -> None:
    create(node.uri, "app.users", "app.orders")
    model: Model = {}
    write(node.uri, model, [
        *[("_default._default", b"k%d" % i, b'{"d":%d}' % i) for i in range(6)],
        *[("app.users", b"k%d" % i, b'{"u":%d}' % i) for i in range(4)],  # the same keys
        *[("app.orders", b"o%d" % i, b'{"o":%d}' % i) for i in range(5)],
        ("app.users", b"k1", b'{"u":11}'),  # updates and deletes
        ("_default._default", b"k2", None),
        ("app.users", b"k3", None),
        ("app.orders", b"o4", b'{"o":44}'),
    ])  # fmt: skip
    db = tmp_path / "r.db"
    first = replay(node, db)
    assert (
        first["manifest_changes"] == 3 * 16
    )  # app, app.users, app.orders created in each partition
    assert stored(db) == model
    with Store(db, create=False) as s:
        names = {str(c): c.dropped for c in s.collections().values()}
        assert names == {"_default._default": False, "app.users": False, "app.orders": False}
        assert s.count(include_deleted=True) == len(model) + 2  # the two tombstones

    # a drop between runs: the next run applies it in every partition
    drop(node.uri, "app.orders")
    write(node.uri, model, [("app.users", b"k0", b'{"u":100}'), ("_default._default", b"k9",
                                                                  b'{"d":9}')])  # fmt: skip
    model = {k: v for k, v in model.items() if k[0] != "app.orders"}
    second = replay(node, db)
    assert second["manifest_changes"] == 16 and second["rollbacks"] == []
    assert stored(db) == model
    with Store(db, create=False) as s:
        assert [str(c) for c in s.collections().values() if c.dropped] == ["app.orders"]
        # the drop is in the undo log: each orders document logged at its partition's drop
        logged = s.db.execute(
            "SELECT count(*) FROM mutation_log m JOIN collections c"
            " ON c.id = m.collection_id WHERE c.name = 'orders'"
        ).fetchone()
        assert logged == (5,)  # fmt: skip
    # a rerun has nothing new
    assert replay(node, db)["applied"] == 0


def test_collections_filter_streams_only_those_and_the_store_keeps_it(
    node: Node, tmp_path: Path
) -> None:
    create(node.uri, "app.users", "app.orders")
    model: Model = {}
    write(node.uri, model, [
        *[("_default._default", b"d%d" % i, b"{}") for i in range(3)],
        *[("app.users", b"u%d" % i, b'{"u":%d}' % i) for i in range(4)],
        *[("app.orders", b"o%d" % i, b"{}") for i in range(3)],
    ])  # fmt: skip
    db = tmp_path / "users.db"
    stats = replay(node, db, "--collections", "app.users")
    assert stats["applied"] == 4
    assert stored(db) == {k: v for k, v in model.items() if k[0] == "app.users"}
    write(node.uri, model, [("app.users", b"u9", b'{"u":9}'), ("app.orders", b"o9", b"{}")])
    assert replay(node, db, "--collections", "app.users")["applied"] == 1
    assert stored(db) == {k: v for k, v in model.items() if k[0] == "app.users"}
    # the store's positions cover only app.users: replaying everything into it is refused
    refused = upr("replay", node.uri, "--into", str(db), "--no-progress", check=False)
    assert refused.returncode != 0
    assert "follows --collections app.users, not every collection" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    # an unknown collection is a one-line error too
    bad = upr("replay", node.uri, "--into", str(tmp_path / "x.db"), "--collections", "app.nope",
              "--no-progress", check=False)  # fmt: skip
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_drop_and_a_recreate_inside_one_stream(node: Node, tmp_path: Path) -> None:
    """Writes, the drop of app.users, its re-creation (a new id), more writes: one replay
    from 0 streams all of it, the drop between the rows in each partition."""
    create(node.uri, "app.users")
    model: Model = {}
    write(node.uri, model, [("app.users", b"u%d" % i, b'{"old":%d}' % i) for i in range(8)])
    old_id = get_manifest(node.uri).lookup(CPath("app", "users")).id  # type: ignore[union-attr]
    drop(node.uri, "app.users")
    create(node.uri, "app.users")
    model.clear()
    write(node.uri, model, [("app.users", b"u%d" % i, b'{"new":%d}' % i) for i in range(0, 8, 2)])
    db = tmp_path / "r.db"
    stats = replay(node, db)
    assert stored(db) == model
    with Store(db, create=False) as s:
        coll = s.collections()
        # the old creation was deduplicated into its drop, which carries no name: the
        # store never learns one for the old id, and holds nothing of it
        assert old_id not in coll
        (new,) = [c for c in coll.values() if c.name == "users"]
        assert new.id > old_id and not new.dropped
        assert {d.collection for d in s.documents()} == {new.id}
    # per partition: app created, the old app.users dropped, the new one created
    assert stats["manifest_changes"] == 3 * 16


async def _get(uri: str, keys: list[tuple[int, bytes]]) -> dict[tuple[int, bytes], bytes | None]:
    s = await connect(SourceUri.parse(uri))
    out: dict[tuple[int, bytes], bytes | None] = {}
    try:
        for cid, key in keys:
            p = partition_of(key, s.num_partitions)
            msg = Get(vbucket=p, key=s.qualify(key, cid), opaque=s.conn.next_opaque())
            resp = await s.conn.request(msg, check=False)
            ok = resp.status == Status.SUCCESS
            out[cid, key] = bytes(getattr(resp, "value", b"")) if ok else None
    finally:
        await s.conn.aclose()
    return out


def test_diff_and_salvage_of_a_store_keep_collections_apart(
    node_factory: type[Node], tmp_path: Path
) -> None:
    """The same key written in two collections, then lost in a SIGKILL: `upr diff` names
    both lost keys, `upr salvage --store` writes each back into its own collection."""
    node = node_factory("--flush-interval", "0.02").start()
    create(node.uri, "app.users")
    model: Model = {}
    write(node.uri, model, [("_default._default", b"base", b"{}"), ("app.users", b"base", b"{}")])
    wait_persisted(node.uri)
    node.stop()
    node.start("--flush-interval", "3600")  # from now on nothing is persisted
    write(node.uri, model, [("_default._default", b"k", b'{"in":"default"}'),
                            ("app.users", b"k", b'{"in":"users"}')])  # fmt: skip
    db = tmp_path / "s.db"
    replay(node, db)
    node.kill()
    node.start("--flush-interval", "0.02")
    users = get_manifest(node.uri).lookup(CPath("app", "users"))
    assert users is not None
    assert run(_get(node.uri, [(0, b"k"), (users.id, b"k")])) == {
        (0, b"k"): None,
        (users.id, b"k"): None,
    }

    diff = upr("diff", node.uri, f"sqlite:{db}", "--json", check=False)
    assert diff.returncode == 1
    lost = [k for d in json.loads(diff.stdout)["partitions"] for k in d["lost_keys"]]
    assert sorted((k["scope"], k["collection"], k["key"]) for k in lost) == [
        ("_default", "_default", "k"), ("app", "users", "k")]  # fmt: skip
    assert "app.users:k" in upr("diff", node.uri, f"sqlite:{db}", check=False).stdout

    done = json.loads(upr("salvage", "--store", str(db), "--into", node.uri, "--apply", "--json",
                          check=False).stdout)  # fmt: skip
    items = sorted((it["collection_id"], it["scope"], it["collection"], it["key"], it["outcome"])
                   for it in done["writes"])  # fmt: skip
    assert items == [(0, "_default", "_default", "k", "written"),
                     (users.id, "app", "users", "k", "written")]  # fmt: skip
    assert run(_get(node.uri, [(0, b"k"), (users.id, b"k")])) == {
        (0, b"k"): b'{"in":"default"}', (users.id, b"k"): b'{"in":"users"}'}  # fmt: skip


def test_replay_from_a_repository_applies_the_chain_s_drop(node: Node, tmp_path: Path) -> None:
    """Backup 1 holds app.users and app.orders; app.orders is dropped before backup 2.
    A store replayed from backup 1 and then from the chain's end drops it too, and
    equals a store replayed from the chain's end at once."""
    create(node.uri, "app.users", "app.orders")
    model: Model = {}
    write(node.uri, model, [
        *[("app.users", b"k%d" % i, b'{"u":%d}' % i) for i in range(4)],
        *[("app.orders", b"k%d" % i, b'{"o":%d}' % i) for i in range(4)],
        ("_default._default", b"k0", b"{}"),
    ])  # fmt: skip
    repo = tmp_path / "repo"
    upr("backup", node.uri, "--repo", str(repo))
    stepwise, direct = tmp_path / "step.db", tmp_path / "direct.db"
    first = json.loads(upr("replay", f"repo:{repo}", "--into", str(stepwise), "--json").stdout)
    assert stored(stepwise) == model and first["applied"] == len(model)
    drop(node.uri, "app.orders")
    write(node.uri, model, [("app.users", b"k9", b"{}")])
    model = {k: v for k, v in model.items() if k[0] != "app.orders"}
    upr("backup", node.uri, "--repo", str(repo))
    second = json.loads(upr("replay", f"repo:{repo}", "--into", str(stepwise), "--json").stdout)
    assert second["manifest_changes"] > 0 and second["rollbacks"] == []
    assert stored(stepwise) == model
    upr("replay", f"repo:{repo}", "--into", str(direct))
    assert stored(direct) == model
    with Store(stepwise, create=False) as s:
        assert [str(c) for c in s.collections().values() if c.dropped] == ["app.orders"]


def test_a_filtered_replay_applies_the_drop_of_a_collection_re_created_since(
    node: Node, tmp_path: Path
) -> None:
    """A store following crash.c1; crash.c1 dropped and created again (a new id): the
    next run must apply the old one's drop in every partition, though the filter by
    name now names only the new id. Then crash.c1 is dropped for good: the run after
    applies that drop too, instead of failing on an unknown collection."""
    create(node.uri, "crash.c1")
    model: Model = {}
    write(node.uri, model, [("crash.c1", b"k%d" % i, b'{"old":%d}' % i) for i in range(12)])
    db = tmp_path / "c1.db"
    assert replay(node, db, "--collections", "crash.c1")["applied"] == 12
    drop(node.uri, "crash.c1")
    create(node.uri, "crash.c1")
    model.clear()
    write(node.uri, model, [("crash.c1", b"k1", b'{"new":1}'), ("crash.c1", b"n2", b"{}"),
                            ("_default._default", b"other", b"{}")])  # fmt: skip
    second = replay(node, db, "--collections", "crash.c1")
    assert stored(db) == {k: v for k, v in model.items() if k[0] == "crash.c1"}
    assert second["manifest_changes"] == 2 * 16  # the old one dropped, the new one created
    with Store(db, create=False) as s:
        assert len({d.collection for d in s.documents()}) == 1
    drop(node.uri, "crash.c1")
    third = replay(node, db, "--collections", "crash.c1")
    assert third["manifest_changes"] == 16 and stored(db) == {}
    assert replay(node, db, "--collections", "crash.c1")["manifest_changes"] == 0
