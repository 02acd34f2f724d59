"""upr backup with collections end to end: every collection by default, updates and
deletes, a collection dropped between two backups and created again, the include and
exclude filters, and `upr info` / `upr examine` reading it all back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.collections_helpers import create, drop, get_manifest
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import drain, run, wait_persisted
from upr_cli.collections import Path as CPath
from upr_cli.net.bootstrap import connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.protocol.leb128 import join_key
from upr_cli.protocol.messages import Delete, Set
from upr_cli.repo import Repository, plan_state
from upr_cli.repo.manifest import chain_manifest
from upr_cli.segments import Record, SegmentReader

Doc = tuple[str, bytes]  # (scope.collection, key)


async def _write(uri: str, changes: list[tuple[int, bytes, bytes | None]]) -> None:
    """SET (or DELETE, value None) each (collection id, key) over a connection that
    negotiated collections."""
    s = await connect(SourceUri.parse(uri))
    try:
        assert s.collections, "the node did not grant Collections"
        conn = s.conn
        for cid, key, value in changes:
            vb = partition_of(key, s.num_partitions)  # the SDKs hash the document key only
            wire = join_key(cid, key)
            if value is None:
                await conn.request(Delete(vbucket=vb, key=wire, opaque=conn.next_opaque()))
            else:
                await conn.request(Set(vbucket=vb, key=wire, value=value, datatype=1,
                                       opaque=conn.next_opaque()))  # fmt: skip
    finally:
        await conn.aclose()


class Writer:
    """Writes into named collections and keeps the state it expects, by name."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.state: dict[Doc, bytes] = {}

    def put(self, path: str, n: int, tag: str, start: int = 0) -> None:
        m = get_manifest(self.uri)
        c = m.lookup(CPath.parse(path))
        assert c is not None
        changes: list[tuple[int, bytes, bytes | None]] = []
        for i in range(start, start + n):
            key, value = b"k%03d" % i, json.dumps({"c": path, "i": i, "t": tag}).encode()
            changes.append((c.id, key, value))
            self.state[(path, key)] = value
        run(_write(self.uri, changes))

    def delete(self, path: str, keys: list[int]) -> None:
        c = get_manifest(self.uri).lookup(CPath.parse(path))
        assert c is not None
        run(_write(self.uri, [(c.id, b"k%03d" % i, None) for i in keys]))
        for i in keys:
            self.state.pop((path, b"k%03d" % i), None)

    def forget(self, path: str) -> None:
        """A dropped collection's documents are gone."""
        self.state = {d: v for d, v in self.state.items() if d[0] != path}


def repo_state(repo: Path, bucket: str = "default") -> dict[Doc, bytes]:
    """The repository's latest state by collection name (the latest record of each
    (collection, key) over the chain's plan, formats/repository.md §8.2), named by the
    chain's final manifest: a record of a dropped collection id is no document."""
    r = Repository(repo)
    manifests = r.manifests(bucket)
    names = chain_manifest(manifests)
    latest: dict[tuple[int, bytes], Record] = {}
    for p in sorted({e.partition for m in manifests for e in m.partitions}):
        for step in plan_state(manifests, at=manifests[-1].backup_id, partition=p):
            with SegmentReader(r.segment_path(bucket, step.backup_id, step.segment.file)) as s:
                for rec in s.records():
                    if rec.seq <= step.max_seq:
                        latest[(rec.collection, bytes(rec.key))] = rec
    out: dict[Doc, bytes] = {}
    for (cid, key), rec in latest.items():
        path = names.path_of(cid)
        if rec.op == OP_MUTATION and path is not None:
            out[(str(path), key)] = bytes(rec.value)
    return out


def backup(uri: str, repo: Path, *args: str) -> dict[str, Any]:
    out = upr("backup", uri, "--repo", str(repo), "--json", "--no-progress", *args)
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def info_collections(repo: Path) -> dict[str, list[dict[str, Any]]]:
    data = json.loads(upr("info", "--repo", str(repo), "--json").stdout)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for c in data["buckets"][0]["collections"]:
        by_name.setdefault(f"{c['scope']}.{c['collection']}", []).append(c)
    return by_name


@pytest.fixture
def started(node_factory: type[Node]) -> Node:
    return node_factory("--flush-interval", "0.02").start()


def test_every_collection_then_a_drop_and_a_re_create(started: Node, tmp_path: Path) -> None:
    uri, repo = started.uri, tmp_path / "repo"
    create(uri, "app.users", "app.orders")
    w = Writer(uri)
    w.put("_default._default", 20, "a")
    w.put("app.users", 40, "a")
    w.put("app.orders", 30, "a")
    w.put("app.users", 10, "b")  # updates
    w.delete("app.users", [1, 2, 3])
    w.delete("app.orders", [5])
    wait_persisted(uri)

    first = backup(uri, repo)
    assert first["full"] and first["collection_count"] == 3
    assert repo_state(repo) == w.state
    m1 = Repository(repo).manifests("default")[-1]
    assert m1.collections == get_manifest(uri) and m1.collection_filter is None
    orders = get_manifest(uri).lookup(CPath("app", "orders"))
    assert orders is not None
    by_id = {c.id: c for c in m1.collection_items}
    assert by_id[orders.id].items == 29  # the latest version of each key only (from 0)

    drop(uri, "app.orders")  # between two backups
    w.forget("app.orders")
    w.put("app.users", 5, "c", start=100)
    wait_persisted(uri)
    second = backup(uri, repo)
    assert not second["full"] and second["collection_count"] == 2
    assert second["manifest_changes"] == 16  # the drop, once per partition
    m2 = Repository(repo).manifests("default")[-1]
    assert m2.collections is not None and m2.collections.lookup(CPath("app", "orders")) is None
    assert {c.kind for c in m2.manifest_changes} == {"collection-dropped"}
    assert {c.collection_id for c in m2.manifest_changes} == {orders.id}
    assert repo_state(repo) == w.state
    info = info_collections(repo)
    assert [(c["id"], c["dropped"]) for c in info["app.orders"]] == [(orders.id, True)]
    # 37 live and 3 tombstones from 0 (deduplicated), then the 5 new ones
    assert (info["app.users"][0]["items"], info["app.users"][0]["deletions"]) == (42, 3)
    text = upr("info", "--repo", str(repo)).stdout
    assert "app.orders" in text and "dropped" in text

    create(uri, "app.orders")  # the same name again: a new id, a new history
    w.put("app.orders", 2, "new")
    wait_persisted(uri)
    third = backup(uri, repo)
    assert third["manifest_changes"] == 16
    again = get_manifest(uri).lookup(CPath("app", "orders"))
    assert again is not None and again.id != orders.id
    assert repo_state(repo) == w.state
    info = info_collections(repo)
    assert sorted((c["id"], c["dropped"]) for c in info["app.orders"]) == [
        (orders.id, True), (again.id, False)]  # fmt: skip

    # examine: by collection name, the old id's versions marked dropped
    out = json.loads(upr("examine", "--repo", str(repo), "--json", "--collection",
                         "app.orders", "k000").stdout)  # fmt: skip
    ids = [(v["collection_id"], v["dropped"], v["in_latest"]) for v in out["versions"]]
    assert ids == [(orders.id, True, False), (again.id, False, True)]
    users = json.loads(upr("examine", "--repo", str(repo), "--json", "--collection",
                           "app.users", "k001").stdout)  # fmt: skip
    assert [v["op"] for v in users["versions"]][-1] == "deletion"
    default = json.loads(upr("examine", "--repo", str(repo), "--json", "k001").stdout)
    assert [v["value"]["c"] for v in default["versions"]] == ["_default._default"]
    bad = upr("examine", "--repo", str(repo), "--collection", "app.nope", "k1", check=False)
    assert bad.returncode == 2 and "no such collection" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_include_and_exclude_filters(started: Node, tmp_path: Path) -> None:
    uri = started.uri
    create(uri, "app.users", "app.logs", "other.x")
    w = Writer(uri)
    w.put("_default._default", 5, "a")
    w.put("app.users", 6, "a")
    w.put("app.logs", 7, "a")
    w.put("other.x", 8, "a")
    wait_persisted(uri)

    inc = tmp_path / "inc"
    assert backup(uri, inc, "--include-data", "app.users", "--include-data", "other")[
        "collection_count"] == 2  # fmt: skip
    assert set(repo_state(inc)) == {d for d in w.state if d[0] in ("app.users", "other.x")}
    m = Repository(inc).manifests("default")[-1]
    assert m.collection_filter is not None and m.collection_filter.to_json() == {
        "include": ["app.users", "other"]}  # fmt: skip
    assert not m.backed_up("app", "logs") and m.backed_up("other", "x")
    info = info_collections(inc)
    assert info["app.logs"][0]["backed_up"] is False and info["app.logs"][0]["items"] == 0

    exc = tmp_path / "exc"
    backup(uri, exc, "--exclude-data", "app.logs,other")
    assert set(repo_state(exc)) == {
        d for d in w.state if d[0] in ("_default._default", "app.users")}  # fmt: skip

    # the chain keeps its filter; --full starts a new one
    w.put("app.users", 2, "b", start=50)
    wait_persisted(uri)
    refused = upr("backup", uri, "--repo", str(exc), "--no-progress", check=False)
    assert refused.returncode != 0 and "--exclude-data app.logs,other" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    backup(uri, exc, "--exclude-data", "other,app.logs")  # the same filter, in any order
    assert set(repo_state(exc)) == {
        d for d in w.state if d[0] in ("_default._default", "app.users")}  # fmt: skip

    for args, code, says in [
        (("--include-data", "app", "--exclude-data", "other"), 2, "cannot be used together"),
        (("--include-data", "app.nope"), 1, "unknown collection app.nope"),
        (("--include-data", "a.b.c"), 2, "at most one dot"),
        (("--exclude-data", "_default,app,other"), 1, "leaves no collection"),
    ]:
        r = upr("backup", uri, "--repo", str(tmp_path / "bad"), "--no-progress", *args,
                check=False)  # fmt: skip
        assert r.returncode == code and says in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def node_docs(uri: str, paths: set[str]) -> dict[Doc, bytes]:
    """The node's live documents in the collections `paths`, by name (a full stream)."""
    rows, _events, _consumer = run(drain(uri))
    names = get_manifest(uri)
    out: dict[Doc, bytes] = {}
    for r in sorted(rows, key=lambda r: (r.vbucket, r.by_seqno)):
        path = str(names.path_of(r.collection))
        if path not in paths:
            continue
        if r.opcode == OP_MUTATION:
            out[(path, r.key)] = r.value
        else:
            out.pop((path, r.key), None)
    return out


def drops_recorded(repo: Path) -> dict[int, set[int]]:
    """The collection drops the chain recorded: collection id → the partitions."""
    out: dict[int, set[int]] = {}
    for m in Repository(repo).manifests("default"):
        for c in m.manifest_changes:
            if c.kind == "collection-dropped" and c.collection_id is not None:
                out.setdefault(c.collection_id, set()).add(c.partition)
    return out


FILTERS = [("--include-data", "app.users"), ("--exclude-data", "app.logs,_default")]


def filtered_chain(
    node_factory: type[Node], tmp_path: Path, flt: tuple[str, str], *, create_again: bool
) -> None:
    """A full backup of app.users alone (`flt`), app.users dropped (and created again
    with other documents, or not), then an incremental backup with the same filter: the
    chain records the drop on every partition, and restores to the source's final
    state of app.users (the old incarnation's documents gone); the next incremental
    goes on from there."""
    source = node_factory("--flush-interval", "0.02", name="source").start()
    uri, repo = source.uri, tmp_path / "repo"
    create(uri, "app.users", "app.logs")
    w = Writer(uri)
    w.put("app.users", 30, "old")
    w.put("app.logs", 10, "a")
    w.put("_default._default", 5, "a")
    wait_persisted(uri)
    first = backup(uri, repo, *flt)
    assert first["full"] and set(repo_state(repo)) == {d for d in w.state if d[0] == "app.users"}
    old = get_manifest(uri).lookup(CPath("app", "users"))
    assert old is not None

    drop(uri, "app.users")
    w.forget("app.users")
    if create_again:  # the same name: a new id, fewer keys than the old incarnation had
        create(uri, "app.users")
        w.put("app.users", 8, "new")
    w.put("app.logs", 3, "b", start=50)  # writes the filter leaves out, on other seqs
    wait_persisted(uri)
    second = backup(uri, repo, *flt)
    assert not second["full"]
    assert drops_recorded(repo) == {old.id: set(range(16))}  # the drop, on every partition
    want = {d: v for d, v in w.state.items() if d[0] == "app.users"}
    assert node_docs(uri, {"app.users"}) == want
    assert repo_state(repo) == want

    target = node_factory("--flush-interval", "0.02", name="target").start()
    upr("restore", "--repo", str(repo), "--json", target.uri)
    assert node_docs(target.uri, {"app.users", "app.logs", "_default._default"}) == want

    # the next incremental follows what is left (the drop is recorded: not owed again)
    if create_again:
        w.put("app.users", 3, "later", start=20)
    w.put("app.logs", 2, "c", start=70)
    wait_persisted(uri)
    third = backup(uri, repo, *flt)
    assert third["manifest_changes"] == 0 and drops_recorded(repo) == {old.id: set(range(16))}
    want = {d: v for d, v in w.state.items() if d[0] == "app.users"}
    assert repo_state(repo) == want == node_docs(uri, {"app.users"})


@pytest.mark.parametrize("flt", FILTERS)
def test_filtered_incremental_after_a_drop_and_a_re_create(
    node_factory: type[Node], tmp_path: Path, flt: tuple[str, str]
) -> None:
    filtered_chain(node_factory, tmp_path, flt, create_again=True)


@pytest.mark.parametrize("flt", FILTERS)
def test_filtered_incremental_after_a_drop_for_good(
    node_factory: type[Node], tmp_path: Path, flt: tuple[str, str]
) -> None:
    filtered_chain(node_factory, tmp_path, flt, create_again=False)
