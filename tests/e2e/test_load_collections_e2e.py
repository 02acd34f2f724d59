"""`upr load --collections` against `upr serve`: the workload spread round robin over
the collections, each document read back with GET over a collections connection in the
collection the summary counts it in, and an unknown collection refused before any write."""

from __future__ import annotations

import asyncio
import json

from tests.e2e.collections_helpers import create
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import run, seqnos
from upr_cli.collections import Path
from upr_cli.net.bootstrap import WANTED, connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import leb128
from upr_cli.protocol.header import Feature
from upr_cli.protocol.messages import Get
from upr_cli.protocol.status import Status


async def _found(uri: str, cids: list[int], keys: list[bytes]) -> dict[int, set[bytes]]:
    """{collection id: the keys GET finds in it}, over a connection that negotiated
    Collections (every key prefixed with its collection's LEB128 id)."""
    s = await connect(SourceUri.parse(uri), features=(*WANTED, Feature.COLLECTIONS))
    try:
        assert Feature.COLLECTIONS in s.features
        conn = s.conn

        async def get(cid: int, key: bytes) -> tuple[int, bytes, int]:
            msg = Get(key=leb128.join_key(cid, key), vbucket=partition_of(key, s.num_partitions),
                      opaque=conn.next_opaque())  # fmt: skip
            resp = await conn.request(msg, check=False)
            return cid, key, resp.status

        got = await asyncio.gather(*(get(c, k) for c in cids for k in keys))
    finally:
        await s.conn.aclose()
    out: dict[int, set[bytes]] = {c: set() for c in cids}
    for cid, key, status in got:
        assert status in (Status.SUCCESS, Status.KEY_ENOENT), (cid, key, status)
        if status == Status.SUCCESS:
            out[cid].add(key)
    return out


def test_load_spreads_its_workload_over_collections(node: Node) -> None:
    m = create(node.uri, "app.users", "app.orders")
    users, orders = (m.ids([Path("app", name)]).pop() for name in ("users", "orders"))
    proc = upr("load", node.uri, "--docs", "600", "--update-ratio", "0.3", "--delete-ratio",
               "0.1", "--collections", "app.users,app.orders", "--json")  # fmt: skip
    summary = json.loads(proc.stdout)
    per = {(c["scope"], c["collection"]): c for c in summary["collections"]}
    assert list(per) == [("app", "users"), ("app", "orders")]
    assert [per[k]["collection_id"] for k in per] == [users, orders]
    created = summary["created"]
    # round robin: new key n goes to collection n mod 2
    assert [c["created"] for c in per.values()] == [(created + 1) // 2, created // 2]
    for name in ("created", "updates", "deletes"):
        assert sum(c[name] for c in per.values()) == summary[name] > 0
    assert summary["errors"] == 0

    keys = [f"doc-{i:09d}".encode() for i in range(created)]
    found = run(_found(node.uri, [0, users, orders], keys))
    assert found[0] == set()  # nothing in the default collection
    assert found[users] | found[orders] == found[users] ^ found[orders]  # each key in one
    for cid, index, c in ((users, 0, per["app", "users"]), (orders, 1, per["app", "orders"])):
        assert len(found[cid]) == c["created"] - c["deletes"]
        assert all(int(k.split(b"-")[1]) % 2 == index for k in found[cid])

    # the same workload without --collections goes to the default collection
    plain = json.loads(upr("load", node.uri, "--docs", "50", "--prefix", "plain",
                           "--json").stdout)  # fmt: skip
    assert plain["collections"] == [{"scope": "_default", "collection": "_default",
                                     "collection_id": 0, "items": 50, "created": 50,
                                     "updates": 0, "deletes": 0}]  # fmt: skip
    keys = [f"plain-{i:09d}".encode() for i in range(50)]
    assert run(_found(node.uri, [0, users], keys)) == {0: set(keys), users: set()}


def test_an_unknown_collection_fails_before_any_write(node: Node) -> None:
    create(node.uri, "app.users")
    before = {p: h for p, (_u, h, _ps) in run(seqnos(node.uri)).items()}
    for spec, why in (("app.nope", "collection app.nope does not exist"),
                      ("nope", "scope nope does not exist"),
                      ("app.users,other.x", "scope other does not exist")):  # fmt: skip
        proc = upr("load", node.uri, "--docs", "100", "--collections", spec, check=False)
        assert proc.returncode == 1
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"upr: error: --collections: {why} in ") and "Traceback" not in (
            proc.stderr
        )
        assert last.endswith("nothing was written")
    bad = upr("load", node.uri, "--docs", "10", "--collections", "app.", check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert {p: h for p, (_u, h, _ps) in run(seqnos(node.uri)).items()} == before  # no write
