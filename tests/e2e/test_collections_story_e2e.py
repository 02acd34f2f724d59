"""Collections end to end, with the official Couchbase SDK as the peer (issue 18).

The SDK writes into the default collection and several named ones (upserts, updates,
removes, documents with an expiry, binary values with their own flags); a collection is
dropped mid-way. `upr backup` then `upr restore` into a node with a different partition
count (64 to 16), and from there again (16 to 128). The SDK reads every document back
from each target through its collection: values, flags and expiry are equal, the dropped
collection is gone, and `upr tail` and `upr replay` see the same final state.
"""

from __future__ import annotations

import datetime
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import PASSWORD, USER, Node, upr

Doc = tuple[str, str, str]  # scope, collection, key
COLLECTIONS = ("app.users", "app.orders", "app.logs", "inventory.items")
HOUR = datetime.timedelta(hours=1)


@pytest.fixture
def sdk() -> Iterator[Any]:
    """Open SDK clusters (closed at the end): `sdk(node)` → Cluster."""
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.options import ClusterOptions

    opened: list[Any] = []

    def open_(node: Node) -> Any:
        c = Cluster(f"couchbase://127.0.0.1:{node.port}=kv",
                    ClusterOptions(PasswordAuthenticator(USER, PASSWORD)))  # fmt: skip
        opened.append(c)
        return c

    yield open_
    for c in opened:
        c.close()


def _coll(cluster: Any, scope: str, name: str) -> Any:
    return cluster.bucket("default").scope(scope).collection(name)


def _write(cluster: Any) -> dict[Doc, Any]:
    """The workload; returns the expected final state: value, or bytes for binary docs."""
    from couchbase.options import UpsertOptions
    from couchbase.transcoder import RawBinaryTranscoder

    raw = RawBinaryTranscoder()
    want: dict[Doc, Any] = {}
    targets = [("_default", "_default"), *(tuple(c.split(".")) for c in COLLECTIONS)]
    for scope, name in targets:
        coll = _coll(cluster, scope, name)
        for i in range(60):
            key = f"doc-{i}"  # the same keys in every collection: they must stay apart
            value = {"where": f"{scope}.{name}", "i": i}
            coll.upsert(key, value)
            want[(scope, name, key)] = value
        for i in range(0, 60, 3):  # updates
            value = {"where": f"{scope}.{name}", "i": i, "v": 2}
            coll.replace(f"doc-{i}", value)
            want[(scope, name, f"doc-{i}")] = value
        for i in range(1, 60, 7):  # removes
            coll.remove(f"doc-{i}")
            del want[(scope, name, f"doc-{i}")]
        coll.upsert("expiring", {"ttl": True}, UpsertOptions(expiry=HOUR))
        want[(scope, name, "expiring")] = {"ttl": True}
        coll.upsert("blob", b"\x00\x01binary", UpsertOptions(transcoder=raw))
        want[(scope, name, "blob")] = b"\x00\x01binary"
        coll.insert("inserted", {"new": 1})
        want[(scope, name, "inserted")] = {"new": 1}
        coll.touch("inserted", HOUR)
    return want


def _read(cluster: Any, docs: dict[Doc, Any]) -> dict[Doc, Any]:
    """Every expected document as the SDK reads it back (bytes for binary ones)."""
    from couchbase.exceptions import DocumentNotFoundException
    from couchbase.options import GetOptions
    from couchbase.transcoder import RawBinaryTranscoder

    got: dict[Doc, Any] = {}
    for scope, name, key in docs:
        coll = _coll(cluster, scope, name)
        try:
            if key == "blob":
                got[(scope, name, key)] = coll.get(key, GetOptions(
                    transcoder=RawBinaryTranscoder())).content_as[bytes]  # fmt: skip
            else:
                got[(scope, name, key)] = coll.get(key).content_as[dict]
        except DocumentNotFoundException:
            pass
    return got


def _expiries(cluster: Any, docs: dict[Doc, Any]) -> dict[Doc, Any]:
    from couchbase.options import GetOptions

    return {d: _coll(cluster, d[0], d[1]).get(d[2], GetOptions(with_expiry=True)).expiry_time
            for d in docs if d[2] in ("expiring", "inserted")}  # fmt: skip


def _tail_state(node: Node) -> dict[Doc, Any]:
    """The bucket as a reader of `upr tail --format json` mirrors it: a change line sets
    or removes its document; a collection's drop (a line with "event") removes that
    collection's documents of its partition."""
    out = upr("tail", node.uri, "--until-end", "--format", "json").stdout
    seen: dict[tuple[int, str | None, str | None, str], Any] = {}
    for line in out.splitlines():
        row = json.loads(line)
        p = row["partition"]
        if row.get("event") == "collection-dropped":
            gone = (p, row.get("scope"), row.get("collection"))
            seen = {d: r for d, r in seen.items() if d[:3] != gone}
        elif "event" not in row:  # a change (events also have an op)
            seen[p, row["scope"], row["collection"], row["key"]] = (
                row if row["op"] == "mutation" else None
            )
    return {(d[1], d[2], d[3]): r for d, r in seen.items() if r is not None}


def test_sdk_collections_backup_and_restore_across_partition_counts(
    node_factory: type[Node], tmp_path: Path, sdk: Any
) -> None:
    src = node_factory(partitions=64, name="src").start(
        "--create-collections", ",".join([*COLLECTIONS[:3], "inventory.items:7200"])
    )
    cluster = sdk(src)
    want = _write(cluster)
    upr("collections", "drop", src.uri, "app.logs")  # mid-way: its documents go with it
    want = {d: v for d, v in want.items() if (d[0], d[1]) != ("app", "logs")}
    _coll(cluster, "app", "users").upsert("after-drop", {"late": True})
    want[("app", "users", "after-drop")] = {"late": True}
    assert _read(cluster, want) == want
    expiries = _expiries(cluster, want)
    src_tail = _tail_state(src)
    assert set(src_tail) == set(want)

    repo = tmp_path / "repo"
    upr("backup", src.uri, "--repo", str(repo))
    mid = node_factory(partitions=16, name="mid").start()
    out = upr("restore", "--repo", str(repo), mid.uri, "--json").stdout
    summary = json.loads(out)
    assert (summary["source_partitions"], summary["target_partitions"]) == (64, 16)
    mid_cluster = sdk(mid)
    assert _read(mid_cluster, want) == want
    assert _expiries(mid_cluster, want) == expiries
    listed = json.loads(upr("collections", "list", mid.uri, "--json").stdout)
    names = {f"{s['name']}.{c['name']}" for s in listed["scopes"] for c in s["collections"]}
    assert "app.logs" not in names and {"app.users", "inventory.items"} <= names

    repo2 = tmp_path / "repo2"
    upr("backup", mid.uri, "--repo", str(repo2))
    dst = node_factory(partitions=128, name="dst").start()
    upr("restore", "--repo", str(repo2), dst.uri)
    dst_cluster = sdk(dst)
    assert _read(dst_cluster, want) == want
    assert _expiries(dst_cluster, want) == expiries

    # tail sees the same documents with the same values, flags and expiry
    dst_tail = _tail_state(dst)
    assert set(dst_tail) == set(want)
    fields = ("value", "value_b64", "flags", "expiry")
    for d, row in src_tail.items():
        assert {f: row.get(f) for f in fields} == {f: dst_tail[d].get(f) for f in fields}, d

    # replay: the store's documents by scope and collection
    db = tmp_path / "replay.db"
    upr("replay", dst.uri, "--into", str(db))
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT scope, collection, key FROM named_documents WHERE NOT deleted")
        replayed = {(s, c, k if isinstance(k, str) else bytes(k).decode()) for s, c, k in rows}
    conn.close()
    assert replayed == set(want)
