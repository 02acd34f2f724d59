"""A TLS cluster's bookkeeping (upr_cli/cluster): the map advertises each node's TLS data
port as kvSSL (docs/protocol.md §13.2) and a TLS client follows it to every node; the
cluster file keeps the certificate and the TLS ports, and older files still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from upr_cli.cluster import spec
from upr_cli.cluster.control import map_json
from upr_cli.cluster.health import judge
from upr_cli.cluster.lifecycle import create, tls_port_of
from upr_cli.cluster.procs import _listening
from upr_cli.cluster.spec import ClusterSpec, NodeSpec
from upr_cli.errors import UsageError
from upr_cli.net.bootstrap import BootstrapError, map_nodes
from upr_cli.net.uri import SourceUri


def two_nodes(tls: bool) -> ClusterSpec:
    cl = ClusterSpec("default", 4, 1, "admin", "pw")
    cl.nodes = [NodeSpec("n0", 12000, tls_port=13000 if tls else None),
                NodeSpec("n1", 12001, tls_port=13001 if tls else None)]  # fmt: skip
    if tls:
        cl.tls_cert, cl.tls_key = "/c.pem", "/c.key"
    return cl


def test_the_map_advertises_each_tls_port_and_a_tls_client_follows_them() -> None:
    cl = two_nodes(tls=True)
    config = map_json(cl, [[0, 1], [1, 0], [0, 1], [1, 0]], 1)
    assert [n["services"] for n in config["nodesExt"]] == [
        {"kv": 12000, "kvSSL": 13000},
        {"kv": 12001, "kvSSL": 13001},
    ]
    tls_servers, actives = map_nodes(SourceUri.parse("uprs://admin@127.0.0.1:13001/default"),
                                     config)  # fmt: skip
    assert tls_servers == [("127.0.0.1", 13000), ("127.0.0.1", 13001)]
    assert actives == [0, 1, 0, 1]
    plain, _ = map_nodes(SourceUri.parse("upr://admin@127.0.0.1:12000/default"), config)
    assert plain == [("127.0.0.1", 12000), ("127.0.0.1", 12001)]


def test_a_plain_cluster_map_has_no_tls_port_and_a_tls_client_is_told() -> None:
    config = map_json(two_nodes(tls=False), [[0, 1]], 1)
    assert [n["services"] for n in config["nodesExt"]] == [{"kv": 12000}, {"kv": 12001}]
    with pytest.raises(BootstrapError, match="no TLS data port"):
        map_nodes(SourceUri.parse("uprs://admin@127.0.0.1:13001/default"), config)


def test_the_cluster_file_keeps_tls_and_an_older_one_still_loads(tmp_path: Path) -> None:
    cl = two_nodes(tls=True)
    spec.save(tmp_path, cl)
    back = spec.load(tmp_path)
    assert back == cl and back.tls and back.nodes[1].tls_port == 13001
    old = json.loads((tmp_path / spec.CLUSTER_FILE).read_text())
    del old["tls_cert"], old["tls_key"]
    for n in old["nodes"]:
        del n["tls_port"]
    (tmp_path / spec.CLUSTER_FILE).write_text(json.dumps(old))
    older = spec.load(tmp_path)
    assert not older.tls and [n.tls_port for n in older.nodes] == [None, None]


def test_the_node_log_lines_give_both_ports() -> None:
    lines = ["some warning", "listening upr://127.0.0.1:4100/default",
             "listening-tls uprs://127.0.0.1:4101/default"]  # fmt: skip
    assert _listening(lines) == {"listening": 4100, "listening-tls": 4101}
    assert _listening(lines[:2]) == {"listening": 4100}
    assert _listening(["listening on nothing"]) == {}


def test_an_adopted_node_s_tls_port_comes_from_its_own_config() -> None:
    mine = {"nodesExt": [{"thisNode": True, "services": {"kv": 4100, "kvSSL": 4101}}]}
    assert tls_port_of(mine, 4100) == 4101
    assert tls_port_of(mine, 4200) is None
    assert tls_port_of({"nodesExt": [{"services": {"kv": 4100}}]}, 4100) is None
    assert tls_port_of({}, 4100) is None


def test_status_carries_the_tls_ports() -> None:
    from upr_cli.cluster.control import NodeStatus

    cl = two_nodes(tls=True)
    cl.vbmap = [[0, 1], [1, 0], [0, 1], [1, 0]]
    st = [NodeStatus(n.name, n.port, False, reason="connection refused") for n in cl.nodes]
    h = judge(Path("/tmp/cl"), cl, st)
    assert [n.tls_port for n in h.nodes] == [13000, 13001]
    assert [n["tls_port"] for n in h.to_json()["nodes"]] == [13000, 13001]


def test_bad_tls_files_are_a_usage_error_before_any_node_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(UsageError, match="--tls-cert/--tls-key"):
        create(tmp_path / "cl", nodes=2, adopt=[], replicas=1, partitions=4, base_port=None,
               bucket="default", tls=(bad, bad))  # fmt: skip
    with pytest.raises(UsageError, match="cannot read"):
        create(tmp_path / "cl", nodes=2, adopt=[], replicas=1, partitions=4, base_port=None,
               bucket="default", tls=(tmp_path / "no.pem", bad))  # fmt: skip
    with pytest.raises(UsageError, match="adopted node keeps"):
        create(tmp_path / "cl", nodes=None, adopt=["upr://a@127.0.0.1:1/default"], replicas=0,
               partitions=4, base_port=None, bucket="default", tls=(bad, bad))  # fmt: skip
    assert not (tmp_path / "cl").exists()
