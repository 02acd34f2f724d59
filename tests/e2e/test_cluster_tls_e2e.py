"""TLS beyond one node and one command: `upr cluster init --tls-cert/--tls-key` starts a
cluster whose map advertises every node's TLS port as kvSSL, so `upr tail` and
`upr backup` over uprs:// reach every node over TLS; and collections, diff,
rollback-point and salvage take uprs:// sources with --cacert (docs/protocol.md §13)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import trustme

from tests.e2e.conftest import Node, upr
from tests.e2e.test_tls_e2e import Certs, certs, start_tls, tls_uri

__all__ = ["certs"]  # the fixture, for pytest


def one_line(proc: subprocess.CompletedProcess[str], code: int, *parts: str) -> None:
    """Exit `code` and exactly one line on stderr, holding every part, no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("upr: error: "), proc.stderr
    for part in parts:
        assert part in lines[0], (part, proc.stderr)


def other_ca(tmp: Path) -> str:
    """A CA that signed nothing the nodes serve."""
    path = tmp / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    return str(path)


def test_a_tls_cluster_serves_every_partition_over_tls(certs: Certs, tmp_path: Path) -> None:
    from tests.e2e.cluster_helpers import Cluster

    data = tmp_path / "cl"
    cert, key = certs.good[1], certs.good[3]
    init = upr("cluster", "init", "--nodes", "2", "--replicas", "1", "--data", str(data),
               "--num-partitions", "8", "--tls-cert", cert, "--tls-key", key, "--json")  # fmt: skip
    cl = Cluster.at(data)
    try:
        made = json.loads(init.stdout)
        tls_ports = [n["tls_port"] for n in made["nodes"]]
        plain = [n["port"] for n in made["nodes"]]
        assert all(isinstance(p, int) and p not in plain for p in tls_ports), made
        status = cl.cli("status")
        assert f"TLS data ports (uprs://): n0 {tls_ports[0]}, n1 {tls_ports[1]}" in status.stdout
        env = cl.cli("env").stdout
        assert f"UPR_N1_TLS=uprs://admin@127.0.0.1:{tls_ports[1]}/default" in env

        upr("load", cl.uri("n0"), "--docs", "120", "--seed", "1")
        spec = cl.spec
        secret = f"uprs://{spec.user}:{spec.password}@127.0.0.1"
        ca = ["--cacert", str(certs.cafile)]
        # bootstrap from n1's TLS port: half the partitions are active on n0, reached on
        # the kvSSL port the map gives it (its plain port would fail the handshake)
        out = upr("tail", f"{secret}:{tls_ports[1]}/default", "--until-end", "--format", "json",
                  *ca).stdout  # fmt: skip
        rows = [json.loads(line) for line in out.splitlines()]
        assert len({r["key"] for r in rows}) == 120
        assert {r["partition"] for r in rows} == set(range(8))
        repo = tmp_path / "repo"
        upr("backup", f"{secret}:{tls_ports[0]}/default", "--repo", str(repo), *ca)
        info = json.loads(upr("info", "--repo", str(repo), "--json").stdout)
        assert "120" in json.dumps(info), info

        # a restart keeps each node's TLS port, and the map still advertises it
        cl.cli("stop")
        cl.cli("start")
        assert [n.tls_port for n in cl.spec.nodes] == tls_ports
        out = upr("tail", f"{secret}:{tls_ports[0]}/default", "--until-end", "--format", "json",
                  *ca).stdout  # fmt: skip
        assert len({json.loads(line)["key"] for line in out.splitlines()}) == 120

        other = other_ca(tmp_path)
        wrong = upr("tail", f"{secret}:{tls_ports[0]}/default", "--until-end", "--cacert",
                    other, check=False)  # fmt: skip
        one_line(wrong, 1, "certificate verify failed",
                 f"(the CA file {other} does not verify the node's certificate)")  # fmt: skip
    finally:
        cl.stop()


def test_collections_diff_rollback_point_and_salvage_take_tls_sources(
    node_factory: type[Node], certs: Certs, tmp_path: Path
) -> None:
    node = node_factory("--flush-interval", "0.02", *certs.good, partitions=4)
    tls = tls_uri(start_tls(node))
    ca = ["--cacert", str(certs.cafile)]
    upr("load", node.uri, "--docs", "40", "--seed", "3")
    repo = tmp_path / "repo"
    upr("backup", node.uri, "--repo", str(repo))

    diff = json.loads(upr("diff", tls, f"repo:{repo}", "--json", *ca).stdout)
    assert diff["identical"] and len(diff["partitions"]) == 4
    assert diff["a"].startswith("uprs://admin:***@"), diff["a"]  # never the password

    rp = json.loads(upr("rollback-point", "--server", tls, "--client", f"repo:{repo}", "--json",
                        *ca).stdout)["partitions"]  # fmt: skip
    assert len(rp) == 4 and not any(r["must_roll_back"] for r in rp), rp

    salvage = json.loads(upr("salvage", "--repo", str(repo), "--into", tls, "--json", *ca).stdout)
    assert salvage["lost_writes"] == 0 and salvage["target"].startswith("uprs://")

    upr("collections", "create", tls, "app.users", *ca)
    listed = json.loads(upr("collections", "list", tls, "--json", *ca).stdout)
    assert [s["name"] for s in listed["scopes"]] == ["_default", "app"]

    # a wrong CA: one line each (diff and salvage exit 2: their 1 is an answer)
    bad = ["--cacert", other_ca(tmp_path)]
    why = "certificate verify failed"
    one_line(upr("collections", "list", tls, *bad, check=False), 1, why)
    one_line(upr("diff", tls, f"repo:{repo}", *bad, check=False), 2, why)
    one_line(upr("rollback-point", "--server", tls, "--client", f"repo:{repo}", *bad,
                 check=False), 1, why)  # fmt: skip
    one_line(upr("salvage", "--repo", str(repo), "--into", tls, *bad, check=False), 2, why)
    missing = upr("diff", tls, f"repo:{repo}", "--cacert", str(tmp_path / "none.pem"),
                  check=False)  # fmt: skip
    one_line(missing, 2, "--cacert (or UPR_CACERT): cannot read")
    loose = upr("diff", tls, f"repo:{repo}", "--no-verify", check=False)
    # the collection's events: the repo is only behind (exit 5, no rollback needed)
    assert loose.returncode == 5, loose.stderr
    assert "B is behind A" in loose.stderr
    assert loose.stderr.count("upr: warning: --no-verify") == 1


def test_a_tls_cluster_checks_client_certificates(tmp_path: Path) -> None:
    """`init --tls-client-ca CA --tls-client-auth mandatory`: every node's TLS port wants
    a client certificate; one whose CN is the cluster's user (admin) reads every
    partition from both nodes with no password, none is one line (docs/protocol.md §13.5)."""
    from tests.e2e.cluster_helpers import Cluster
    from tests.e2e.test_client_cert_e2e import ClientCerts

    pki = ClientCerts(tmp_path)
    data = tmp_path / "cl"
    cert, key = pki.node_args[1], pki.node_args[3]
    init = upr("cluster", "init", "--nodes", "2", "--replicas", "1", "--data", str(data),
               "--num-partitions", "8", "--tls-cert", cert, "--tls-key", key,
               "--tls-client-ca", str(pki.cafile), "--tls-client-auth", "mandatory",
               "--json")  # fmt: skip
    cl = Cluster.at(data)
    try:
        port = json.loads(init.stdout)["nodes"][1]["tls_port"]
        upr("load", cl.uri("n0"), "--docs", "60", "--seed", "2")  # the plain port: a password
        ca = ["--cacert", str(pki.cafile)]
        out = upr("tail", f"uprs://127.0.0.1:{port}/default", "--until-end", "--format", "json",
                  *ca, *pki.client("admin")).stdout  # fmt: skip
        rows = [json.loads(line) for line in out.splitlines()]
        assert len({r["key"] for r in rows}) == 60
        assert {r["partition"] for r in rows} == set(range(8))  # both nodes, over TLS
        refused = upr("tail", f"uprs://127.0.0.1:{port}/default", "--until-end", *ca,
                      check=False)  # fmt: skip
        one_line(refused, 1, "--cert")
    finally:
        cl.stop()


def test_cluster_client_auth_options_are_checked_first(tmp_path: Path) -> None:
    bad = upr("cluster", "init", "--nodes", "2", "--data", str(tmp_path / "cl"),
              "--tls-client-auth", "mandatory", check=False)  # fmt: skip
    one_line(bad, 2, "--tls-client-auth needs --tls-client-ca")
    assert not (tmp_path / "cl").exists()
