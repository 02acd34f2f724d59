"""The official Couchbase Python SDK (`couchbase` 4.6.3) as a real client of `upr serve`:
it authenticates (SCRAM with its own nonces), writes, updates, removes and reads, and
`upr tail` then shows exactly the final state it left."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.conftest import PASSWORD, USER, Node, upr


def test_the_sdk_writes_and_reads_and_tail_sees_the_final_state(node: Node, tmp_path: Path) -> None:
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.exceptions import DocumentNotFoundException
    from couchbase.options import ClusterOptions

    cluster = Cluster(f"couchbase://127.0.0.1:{node.port}=kv",
                      ClusterOptions(PasswordAuthenticator(USER, PASSWORD)))  # fmt: skip
    try:
        docs = cluster.bucket("default").default_collection()
        for i in range(40):
            docs.upsert(f"k{i}", {"i": i})
        docs.insert("new", {"fresh": True})
        docs.replace("k1", {"i": 100})
        docs.upsert("k2", {"i": 200})
        for i in range(30, 40):
            docs.remove(f"k{i}")
        assert docs.get("k1").content_as[dict] == {"i": 100}
        try:
            docs.get("k35")
            raise AssertionError("a removed document was found")
        except DocumentNotFoundException:
            pass
    finally:
        cluster.close()
    final = {f"k{i}": {"i": i} for i in range(30)} | {"k1": {"i": 100}, "k2": {"i": 200},
                                                       "new": {"fresh": True}}  # fmt: skip
    out = upr("tail", node.uri, "--until-end", "--format", "json").stdout
    seen: dict[str, object] = {}
    for line in out.splitlines():
        row = json.loads(line)
        seen[row["key"]] = row.get("value") if row["op"] == "mutation" else None
    assert {k: v for k, v in seen.items() if v is not None} == final
    assert {k for k, v in seen.items() if v is None} == {f"k{i}" for i in range(30, 40)}
