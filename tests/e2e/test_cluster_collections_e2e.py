"""Collections on a `upr cluster`: `init --collections` and `upr collections` reach every
node, a change waits for every member, and a node added by a rebalance or started
again gets the newest manifest before it takes partitions (formats/cluster.md
"Collections")."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.cluster_helpers import Cluster, on_terminal
from tests.e2e.collections_helpers import get_manifest, set_manifest
from tests.e2e.conftest import upr
from upr_cli.collections import Manifest
from upr_cli.collections import Path as CPath


def manifests(cl: Cluster, *names: str) -> dict[str, Manifest]:
    spec = cl.spec
    return {n.name: get_manifest(spec.uri(n)) for n in spec.nodes if not names or n.name in names}


def test_every_node_holds_the_manifest(tmp_path: Path) -> None:
    data = tmp_path / "cl"
    upr("cluster", "init", "--nodes", "3", "--replicas", "1", "--data", str(data),
        "--num-partitions", "8", "--collections", "app.users")  # fmt: skip
    cl = Cluster.at(data)
    try:
        first = manifests(cl)
        assert len(set(first.values())) == 1
        assert first["n0"].lookup(CPath("app", "users")) is not None
        # a change through one node reaches all three
        r = upr("collections", "create", cl.uri("n1"), "app.orders")
        assert r.stdout.splitlines()[-1] == "manifest uid 3 on 3 nodes"
        now = manifests(cl)
        assert {m.uid for m in now.values()} == {3}
        assert len(set(now.values())) == 1
        status = json.loads(cl.cli("status", "--json").stdout)
        assert [n["manifest_uid"] for n in status["nodes"]] == ["3", "3", "3"]
        assert status["actions"] == []
        text = on_terminal("cluster", "status", "--data", str(data))
        assert all(len(line) <= 80 for line in text.splitlines() if str(data) not in line), text
        header = next(line for line in text.splitlines() if "node" in line and "port" in line)
        assert "manifest" in header and "max lag" in header, text
        # a node added by a rebalance has it before it holds partitions
        cl.cli("rebalance", "--add", "new")
        assert manifests(cl, "n3")["n3"] == now["n0"]
        # given after its map (every partition dead there), it wrote no system event of
        # its own that its pending copies would have to roll back
        assert cl.lost_writes("n3") == []
        # a member that does not answer: nothing is changed, and the error names it
        cl.kill("n2")
        r = upr("collections", "create", cl.uri("n0"), "app.logs", check=False)
        port2 = cl.spec.node("n2").port
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
        assert "no node changed" in r.stderr and f"127.0.0.1:{port2}" in r.stderr
        assert {m.uid for m in manifests(cl, "n0", "n1", "n3").values()} == {3}
        # failed over, it holds no partition: the change goes on without it, with a warning
        cl.cli("failover", "n2")
        r = upr("collections", "create", cl.uri("n0"), "app.logs")
        assert r.stdout.splitlines()[-1] == "manifest uid 4 on 3 nodes"
        assert f"127.0.0.1:{port2} (holds no partition)" in r.stderr
        # a change that reached one node only (pushed by hand): status names the members
        # that disagree and the repair
        ahead = manifests(cl, "n1")["n1"].with_scope("extra")
        set_manifest(cl.uri("n1"), ahead)
        status = json.loads(cl.cli("status", "--json").stdout)
        why, command = status["actions"][0]["why"], status["actions"][0]["command"]
        assert "different collections manifests" in why and "n1 uid 5" in why
        assert command == f"upr cluster start --data {data}"
        # `start`: n2 (down) is given the newest manifest with the map, before its
        # traffic; n0 and n3, running, are given it too
        cl.cli("start")
        after = manifests(cl)
        assert set(after.values()) == {ahead}
        assert json.loads(cl.cli("status", "--json").stdout)["actions"][-1]["command"] == (
            f"upr cluster rebalance --add n2 --data {data}")  # fmt: skip
        assert cl.node_errors() == {}
    finally:
        cl.stop()
