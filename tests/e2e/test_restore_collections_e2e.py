"""upr restore with collections and other partition counts: every key rehashed to its
CRC32 partition over the target's count, collections matched by name (never by id),
--map-data, --no-create and --dry-run writing nothing, one-line errors before any write."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.e2e.collections_helpers import create, drop, get_manifest
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import drain, run, wait_persisted
from upr_cli.collections import CollectionsManifest
from upr_cli.collections import Path as CPath
from upr_cli.net.bootstrap import connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.protocol.messages import Get, Set

Docs = dict[tuple[str, bytes], tuple[Any, ...]]


def live_docs(uri: str, partitions: int) -> Docs:
    """(scope.collection, key) → (value, cas, rev seq, flags, expiry) of every live
    document a full stream of the node gives, each checked to sit at its key's CRC32
    partition over `partitions`."""
    rows, _events, _consumer = run(drain(uri))
    names = get_manifest(uri)
    out: Docs = {}
    for r in sorted(rows, key=lambda r: (r.vbucket, r.by_seqno)):
        assert r.vbucket == partition_of(r.key, partitions), (r.key, r.vbucket)
        path = str(names.path_of(r.collection))
        if r.opcode == OP_MUTATION:
            out[(path, r.key)] = (r.value, r.cas, r.rev_seqno, r.flags, r.expiration)
        else:
            out.pop((path, r.key), None)
    return out


async def _get_all(uri: str, docs: Docs) -> None:
    s = await connect(SourceUri.parse(uri))
    try:
        names = await _manifest(s.conn)
        for (path, key), (value, cas, _rev, flags, _exp) in docs.items():
            c = names.lookup(_path(path))
            assert c is not None, path
            vb = partition_of(key, s.num_partitions)
            got = await s.conn.request(Get(vbucket=vb, key=s.qualify(key, c.id),
                                           opaque=s.conn.next_opaque()))  # fmt: skip
            assert (got.value, got.flags, got.cas) == (value, flags, cas), (path, key)
    finally:
        await s.conn.aclose()


async def _manifest(conn: Any) -> CollectionsManifest:
    from upr_cli.net.collections_manifest import get_collections_manifest as read

    m = await read(conn)
    assert m is not None
    return m


def _path(text: str) -> CPath:
    return CPath.parse(text)


async def _set_raw(uri: str, path: str, key: bytes, value: bytes, flags: int, exp: int) -> None:
    s = await connect(SourceUri.parse(uri))
    try:
        c = (await _manifest(s.conn)).lookup(_path(path))
        assert c is not None
        await s.conn.request(Set(vbucket=partition_of(key, s.num_partitions),
                                 key=s.qualify(key, c.id), value=value, flags=flags,
                                 expiration=exp, opaque=s.conn.next_opaque()))  # fmt: skip
    finally:
        await s.conn.aclose()


def restore(repo: Path, target: str, *args: str, check: bool = True) -> Any:
    """`upr restore --json` into `target`: its summary (or the process, unchecked)."""
    proc = upr("restore", "--repo", str(repo), "--json", *args, target, check=check)
    return json.loads(proc.stdout) if check else proc


def loaded_source(node_factory: type[Node], repo: Path, partitions: int = 64) -> Node:
    """A node with documents in app.users, app.orders and the default collection (updates,
    deletes, the same key in two collections, flags and an expiry), backed up."""
    src = node_factory("--flush-interval", "0.02", "--create-collections", "app.users,app.orders",
                       partitions=partitions, name="src").start()  # fmt: skip
    upr("load", src.uri, "--docs", "240", "--collections", "app.users,app.orders",
        "--update-ratio", "0.3", "--delete-ratio", "0.1")  # fmt: skip
    upr("load", src.uri, "--docs", "60", "--prefix", "plain")
    expiry = int(time.time()) + 86_400
    for path, value in (("app.users", b'{"who":"user"}'), ("app.orders", b'{"who":"order"}')):
        run(_set_raw(src.uri, path, b"same-key", value, 0xCAFE, expiry))
    wait_persisted(src.uri)
    upr("backup", src.uri, "--repo", str(repo))
    return src


def test_collections_restore_by_name_into_16_and_128_partitions(
    node_factory: type[Node], tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    src = loaded_source(node_factory, repo)
    want = live_docs(src.uri, 64)
    assert {p for p, _k in want} == {"_default._default", "app.users", "app.orders"}
    assert want[("app.users", b"same-key")] != want[("app.orders", b"same-key")]
    assert want[("app.users", b"same-key")][3] == 0xCAFE and want[("app.users", b"same-key")][4]

    # app.orders exists there already, under another id than in the source
    small = node_factory("--flush-interval", "0.02", "--create-collections", "zz.first,app.orders",
                         partitions=16, name="small").start()  # fmt: skip
    assert get_manifest(small.uri).lookup(_path("app.orders")) != get_manifest(src.uri).lookup(
        _path("app.orders")
    )
    out = restore(repo, small.uri)
    assert (out["source_partitions"], out["target_partitions"], out["rehash"]) == (64, 16, True)
    status = {c["source"]: c["status"] for c in out["collections"]}
    assert status == {"_default._default": "exists", "app.users": "created",
                      "app.orders": "exists"}  # fmt: skip
    assert out["written"] == out["documents"] == len(want) and out["errors"] == 0
    assert live_docs(small.uri, 16) == want  # values, cas, rev seq, flags, expiry
    run(_get_all(small.uri, want))  # a client finds each at its partition, by name

    big = node_factory("--flush-interval", "0.02", partitions=128, name="big").start()
    text = upr("restore", "--repo", str(repo), big.uri).stdout
    assert "rehashed from 64 to 128 partitions" in text
    assert live_docs(big.uri, 128) == want
    run(_get_all(big.uri, want))


def test_map_data_no_create_and_dry_run(node_factory: type[Node], tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    src = loaded_source(node_factory, repo, partitions=16)
    want = live_docs(src.uri, 16)
    dst = node_factory("--flush-interval", "0.02", name="dst").start()
    before = get_manifest(dst.uri)

    plan = restore(repo, dst.uri, "--dry-run")
    assert plan["written"] == 0 and not plan["rehash"] and plan["documents"] == len(want)
    assert {c["source"]: (c["target"], c["status"]) for c in plan["collections"]} == {
        "_default._default": ("_default._default", "exists"),
        "app.users": ("app.users", "create"),
        "app.orders": ("app.orders", "create"),
    }
    counts = {c["source"]: c["documents"] for c in plan["collections"]}
    assert counts == {p: sum(q == p for q, _k in want) for p in counts}
    assert get_manifest(dst.uri) == before and live_docs(dst.uri, 16) == {}  # nothing written

    refused = restore(repo, dst.uri, "--no-create", check=False)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert "app.orders, app.users" in refused.stderr and "Traceback" not in refused.stderr
    assert get_manifest(dst.uri) == before and live_docs(dst.uri, 16) == {}

    # a scope renamed, one collection into the default one: creates only shop.users
    out = restore(repo, dst.uri, "--map-data", "app=shop", "--map-data",
                  "app.orders=_default._default")  # fmt: skip
    assert {c["source"]: (c["target"], c["status"]) for c in out["collections"]} == {
        "_default._default": ("_default._default", "exists"),
        "app.users": ("shop.users", "created"),
        "app.orders": ("_default._default", "exists"),
    }
    renamed = {("shop.users" if p == "app.users" else "_default._default" if p == "app.orders"
                else p, k): v for (p, k), v in want.items()}  # fmt: skip
    assert live_docs(dst.uri, 16) == renamed
    after = get_manifest(dst.uri)
    assert after.lookup(_path("shop.users")) is not None and after.scope("app") is None


def test_a_1024_partition_backup_restores_into_64_partitions(
    node_factory: type[Node], tmp_path: Path
) -> None:
    src = node_factory("--flush-interval", "0.02", partitions=1024, name="src").start()
    dst = node_factory("--flush-interval", "0.02", partitions=64, name="dst").start()
    repo = tmp_path / "repo"
    upr("load", src.uri, "--docs", "120")
    wait_persisted(src.uri)
    upr("backup", src.uri, "--repo", str(repo))
    t0 = time.monotonic()
    proc = upr("restore", "--repo", str(repo), dst.uri)
    assert time.monotonic() - t0 < 30
    assert "rehashed from 1024 to 64 partitions" in proc.stdout
    assert "Future exception" not in proc.stderr and "Traceback" not in proc.stderr
    assert live_docs(dst.uri, 64) == live_docs(src.uri, 1024)


def test_a_target_that_cannot_take_the_restore_fails_before_writing(
    node_factory: type[Node], tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    loaded_source(node_factory, repo, partitions=16)
    dst = node_factory("--flush-interval", "0.02", name="dst").start()
    wrong = dst.uri.replace(":s3cret-pw@", ":wrong@")
    for target in (wrong, "upr://admin:x@127.0.0.1:1/default"):
        bad = upr("restore", "--repo", str(repo), target, check=False)
        assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
        assert bad.stderr.startswith("upr: error: ") and "Traceback" not in bad.stderr
    assert live_docs(dst.uri, 16) == {}


def test_a_collection_dropped_and_created_again_restores_its_final_state(
    node_factory: type[Node], tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    src = loaded_source(node_factory, repo, partitions=16)
    drop(src.uri, "app.users")
    create(src.uri, "app.users")  # the same name: a new id and a new history
    run(_set_raw(src.uri, "app.users", b"reborn", b'{"new":1}', 7, 0))
    wait_persisted(src.uri)
    upr("backup", src.uri, "--repo", str(repo))
    want = live_docs(src.uri, 16)
    assert [k for p, k in want if p == "app.users"] == [b"reborn"]
    dst = node_factory("--flush-interval", "0.02", partitions=64, name="dst").start()
    out = restore(repo, dst.uri)
    assert out["dropped_records"] > 0  # the first app.users's documents, left out
    assert live_docs(dst.uri, 64) == want


def test_a_store_keeps_the_source_partitions_and_records_the_names(
    node_factory: type[Node], tmp_path: Path
) -> None:
    from upr_cli.store import Store

    repo = tmp_path / "repo"
    src = loaded_source(node_factory, repo, partitions=64)
    want = live_docs(src.uri, 64)
    db = tmp_path / "s.db"
    out = restore(repo, f"sqlite:{db}", "--map-data", "app.orders=shop.orders")
    assert (out["source_partitions"], out["target_partitions"], out["rehash"]) == (64, None, False)
    with Store(db) as s:
        names = {cid: str(c) for cid, c in s.collections().items()}
        got = {(names[d.collection], d.key): (d.value, d.cas, d.rev_seq, d.flags, d.expiry)
               for d in s.documents(include_deleted=False)}  # fmt: skip
        # the source's partitions, not a rehash: each where the 64-partition source had it
        assert all(d.partition == partition_of(d.key, 64) for d in s.documents())
    renamed = {("shop.orders" if p == "app.orders" else p, k): v for (p, k), v in want.items()}
    assert got == renamed
