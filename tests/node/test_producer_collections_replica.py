"""Replication of collections (formats/wire.md "Collections on DCP"): a replica copy fed
by its active over DCP ends with the active's rows, documents under their qualified
keys and collection and scope changes as system rows, at the same seqs, through
creates and drops with writes in between."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from tests.dcp.collections_helpers import create, drop, put
from tests.dcp.inprocess import InProcessNode, nodes, run
from upr_cli.collections import CollectionsManifest
from upr_cli.node.partition import REPLICA
from upr_cli.node.sysevents import is_system_key

VB = 0


def _cluster_map(servers: list[str]) -> dict[str, Any]:
    return {"rev": 1, "name": "default", "nodeLocator": "vbucket",
            "vBucketServerMap": {"hashAlgorithm": "CRC", "numReplicas": 1,
                                 "serverList": servers, "vBucketMap": [[0, 1]]}}  # fmt: skip


def _rows(node: InProcessNode) -> dict[bytes, tuple[object, ...]]:
    """key → the stored row: every column for a document; for a system row all but the
    CAS, rev seq and delete time, which the node stamps itself (no DCP field carries
    them for a system event)."""
    with sqlite3.connect(node.bucket.storage.path) as c:
        rows = c.execute("SELECT key, seq, rev_seq, cas, flags, expiry, datatype, deleted, "
                         "delete_time, value FROM docs WHERE vbucket = ?", (VB,))  # fmt: skip
        out: dict[bytes, tuple[object, ...]] = {}
        for key, seq, rev, cas, flags, expiry, dt, deleted, dtime, value in rows:
            key = bytes(key)
            if is_system_key(key):
                out[key] = (seq, flags, expiry, dt, deleted, bytes(value))
            else:
                out[key] = (seq, rev, cas, flags, expiry, dt, deleted, dtime, bytes(value))
        return out


async def _everywhere(nodes_: tuple[InProcessNode, ...], edit: Any) -> CollectionsManifest:
    """Push a manifest change to every node, as `upr collections` does."""
    m: CollectionsManifest | None = None
    for n in nodes_:
        m = await edit(n.bucket)
    assert m is not None
    return m


def test_a_replica_ends_with_the_active_rows_through_creates_and_drops(tmp_path: Path) -> None:
    a, b = (InProcessNode(tmp_path / n, partitions=1) for n in "ab")

    async def scenario() -> tuple[dict[bytes, tuple[object, ...]], ...]:
        async with nodes(a, b) as both:
            servers = [a.address, b.address]
            for n in both:
                n.bucket.set_cluster_map(n.bucket.state_cas, _cluster_map(servers))
            await b.bucket.set_partition_state(VB, REPLICA, cas=b.bucket.state_cas, rev=1)
            put(a.bucket, VB, "_default._default", "d1")
            await _everywhere(both, lambda bk: create(bk, "app.users", "app.orders"))
            put(a.bucket, VB, "app.users", "u1")
            put(a.bucket, VB, "app.orders", "o1")
            await _everywhere(both, lambda bk: drop(bk, "app.users"))
            put(a.bucket, VB, "app.orders", "o2")
            await _everywhere(both, lambda bk: create(bk, "app.users"))  # a new id
            put(a.bucket, VB, "app.users", "u1")  # the same name, a new collection
            await _everywhere(both, lambda bk: create(bk, "temp.t"))
            await _everywhere(both, lambda bk: drop(bk, "temp"))
            put(a.bucket, VB, "_default._default", "d1", b'{"v":2}')
            high = a.bucket.partitions[VB].high_seq
            replica = b.bucket.partitions[VB]
            await b.wait_for("the replica to persist it all", lambda: replica.complete_seq == high,
                             timeout=5.0)  # fmt: skip

            def purged() -> bool:  # both copies purge the dropped collections lazily
                return not (a.bucket.collections.dropped or b.bucket.collections.dropped)

            await a.wait_for("the purges", purged, timeout=5.0)
            await a.bucket.flush()
            await b.bucket.flush()
            return _rows(a), _rows(b)

    active, replica = run(scenario(), 15.0)
    assert replica == active
    assert sum(map(is_system_key, active)) == 6  # app, orders, users x2, temp's scope and t
    assert len(active) == 6 + 4  # d1, o1, o2, the new u1: the dropped u1 was purged
