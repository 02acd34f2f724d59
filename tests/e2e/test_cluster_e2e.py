"""`upr cluster init|status|stop|start` on loopback (formats/cluster.md)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.e2e.conftest import upr
from tests.e2e.e2e_helpers import run, seqnos
from upr_cli.cluster import procs, spec
from upr_cli.cluster.control import balanced_map
from upr_cli.net.bootstrap import connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.messages import GetClusterConfig, Set
from upr_cli.protocol.status import Status


async def _probe(uri: str, key: bytes, vb: int) -> tuple[dict[str, object], int, bytes]:
    s = await connect(SourceUri.parse(uri))
    try:
        cfg = await s.conn.request(GetClusterConfig(opaque=s.conn.next_opaque()))
        r = await s.conn.request(Set(vbucket=vb, key=s.qualify(key), value=b"{}", datatype=1,
                                     opaque=s.conn.next_opaque()), check=False)  # fmt: skip
        return json.loads(cfg.value), r.status, getattr(r, "value", b"")
    finally:
        await s.conn.aclose()


def test_init_status_stop_start(tmp_path: Path) -> None:
    data = tmp_path / "cl"
    try:
        upr("cluster", "init", "--nodes", "3", "--replicas", "1", "--data", str(data),
            "--num-partitions", "12")  # fmt: skip
        cl = spec.load(data)
        assert (data / "cluster.json").stat().st_mode & 0o777 == 0o600
        status = json.loads(upr("cluster", "status", "--data", str(data), "--json").stdout)
        assert [n["states"] for n in status["nodes"]] == [
            {"active": 4, "replica": 4, "dead": 4} for _ in range(3)
        ]
        assert all(n["up"] and n["rev"] == 1 for n in status["nodes"])
        vbmap = balanced_map(12, 3, 1)
        key = b"doc-1"
        vb = partition_of(key, 12)
        owner = vbmap[vb][0]
        for i, node in enumerate(cl.nodes):
            config, code, body = run(_probe(cl.uri(node), key, vb))
            servers = config["vBucketServerMap"]["serverList"]  # type: ignore[index]
            assert servers == [f"127.0.0.1:{n.port}" for n in cl.nodes]
            assert config["vBucketServerMap"]["vBucketMap"] == vbmap  # type: ignore[index]
            if i == owner:
                assert code == Status.SUCCESS
            else:  # not active here: NOT_MY_VBUCKET, the map attached
                assert code == Status.NOT_MY_VBUCKET and json.loads(body)["rev"] == 1
        # upr load follows the map: bootstrapped from n1, every write reaches its active
        out = json.loads(upr("load", cl.uri(cl.nodes[1]), "--docs", "600", "--json").stdout)
        assert out["errors"] == 0 and out["items"] == 600
        # replication: each replica copy reaches its active's high seq, and nothing else
        # holds data (dead copies stay empty)
        deadline = time.monotonic() + 30
        while True:
            highs = [run(seqnos(cl.uri(n))) for n in cl.nodes]
            want = [[highs[row[0]][p][1] if i in row else 0 for p, row in enumerate(vbmap)]
                    for i in range(3)]  # fmt: skip
            got = [[h[p][1] for p in range(12)] for h in highs]
            if got == want or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert got == want
        # failover logs follow the map: bootstrapped from any node, diff and rollback-point
        # read each partition from its active copy, so two bootstrap nodes agree
        d = upr("diff", cl.uri(cl.nodes[0]), cl.uri(cl.nodes[2]), "--json", check=False)
        assert d.returncode == 0 and json.loads(d.stdout)["counts"]["identical"] == 12
        logs = run(failover_logs_of(cl.uri(cl.nodes[2])))
        assert logs == {p: run(failover_logs_of(cl.uri(cl.nodes[vbmap[p][0]])))[p]
                        for p in range(12)}  # fmt: skip
        # streams follow the map too: a backup bootstrapped from one node streams every
        # partition from its active copy (docs/protocol.md §2.2 ActiveVbOnly), and a restore into
        # a SQLite store holds all 601 documents (600 loaded, one probe)
        upr("backup", cl.uri(cl.nodes[0]), "--repo", str(tmp_path / "repo"))
        upr("restore", "--repo", str(tmp_path / "repo"), f"sqlite:{tmp_path / 'r.db'}")
        with sqlite3.connect(tmp_path / "r.db") as db:
            assert db.execute("SELECT count(*) FROM documents").fetchone()[0] == 601
        upr("cluster", "stop", "--data", str(data))
        assert not any(procs.alive(n.pid) for n in spec.load(data).nodes)
        down = json.loads(upr("cluster", "status", "--data", str(data), "--json").stdout)
        assert not any(n["up"] for n in down["nodes"])
        upr("cluster", "start", "--data", str(data))
        again = json.loads(upr("cluster", "status", "--data", str(data), "--json").stdout)
        assert [n["states"] for n in again["nodes"]] == [n["states"] for n in status["nodes"]]
        assert [n["port"] for n in again["nodes"]] == [n.port for n in cl.nodes]
        bad = upr("cluster", "init", "--nodes", "2", "--data", str(data), check=False)
        assert bad.returncode == 2 and "a cluster exists here" in bad.stderr
    finally:
        if (data / "cluster.json").exists():
            upr("cluster", "stop", "--data", str(data), check=False)


def test_bad_cluster_arguments(tmp_path: Path) -> None:
    r = upr("cluster", "init", "--nodes", "2", "--replicas", "2", "--data", str(tmp_path / "x"),
            check=False)  # fmt: skip
    assert r.returncode == 2 and "needs at least 3 nodes" in r.stderr
    r = upr("cluster", "status", "--data", str(tmp_path / "none"), check=False)
    assert r.returncode == 2 and "no cluster here" in r.stderr


async def failover_logs_of(uri: str) -> dict[int, list[tuple[int, int]]]:
    """Each partition's failover log as `upr diff` reads it (following the map)."""
    from upr_cli.jobs.rollback_point import node_states

    states, _n = await node_states(SourceUri.parse(uri), None)
    return {p: [(e.uuid, e.seq) for e in st.log.entries] for p, st in states.items()}


def test_init_adopts_running_nodes(node_factory: Any, tmp_path: Path) -> None:
    a = node_factory(name="a").start()
    b = node_factory(name="b").start()
    data = tmp_path / "cl"
    try:
        bad = upr("cluster", "init", "--data", str(data), check=False)
        assert bad.returncode == 2 and "--adopt" in bad.stderr
        upr("cluster", "init", "--adopt", a.uri, "--adopt", b.uri, "--replicas", "1",
            "--data", str(data))  # fmt: skip
        cl = spec.load(data)
        assert [n.adopted for n in cl.nodes] == [True, True] and cl.partitions == 16
        upr("load", b.uri, "--docs", "400")
        # each adopted node feeds the other's replicas with the shared credentials
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ha, hb = run(seqnos(a.uri)), run(seqnos(b.uri))
            if all(ha[p][1] == hb[p][1] > 0 for p in range(16)):
                break
            time.sleep(0.1)
        assert all(ha[p][1] == hb[p][1] > 0 for p in range(16))
        upr("cluster", "stop", "--data", str(data))  # adopted nodes keep running
        assert a.proc is not None and a.proc.poll() is None
    finally:
        a.kill()
        b.kill()


async def _write_to(uri: str, vb: int, n: int) -> int:
    """The status of a SET sent straight to one node (a client with an old map)."""
    s = await connect(SourceUri.parse(uri))
    try:
        key = next(k for k in (b"stale-%d" % i for i in range(10_000))
                   if partition_of(k, n) == vb)  # fmt: skip
        r = await s.conn.request(Set(vbucket=vb, key=s.qualify(key), value=b"{}",
                                     opaque=s.conn.next_opaque()), check=False)  # fmt: skip
        return int(r.status)
    finally:
        await s.conn.aclose()


def test_a_restarted_node_serves_nothing_until_the_orchestrator_turns_traffic_on(
    tmp_path: Path,
) -> None:
    """A node that comes back after it was failed over starts in its persisted states
    (active for partitions that moved away) with front-end traffic off, so a client holding
    the old map cannot write to it; clients bootstrapped from it find the current map
    elsewhere; `upr cluster start` gives it the map and states, then turns traffic on (the
    UPR design specification, "How ns_server and ep-engine guarantee ordering of partition
    state transitions", steps 1-3)."""
    from tests.e2e.cluster_helpers import Cluster

    cl = Cluster(tmp_path / "cl", nodes=2, replicas=1, partitions=4)
    try:
        upr("load", cl.uri("n1"), "--docs", "200", "--seed", "1")
        cl.settle()
        mine = [p for p, row in enumerate(cl.spec.vbmap) if row[0] == 0]
        cl.kill("n0")
        cl.cli("failover", "n0")
        # restarted some other way than `cluster start` (here: the same launcher, alone)
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from upr_cli.cluster import procs, spec; d = Path(sys.argv[1]); "
                        "c = spec.load(d); procs.start_node(c, c.node('n0')); spec.save(d, c)",
                        str(cl.data)], check=True, timeout=60)  # fmt: skip
        assert run(_write_to(cl.uri("n0"), mine[0], 4)) == Status.ETMPFAIL
        status = json.loads(cl.cli("status", "--json").stdout)
        assert [n["traffic"] for n in status["nodes"]] == [False, True]
        # a load bootstrapped from the stale node: its old map routes to it, refused, and
        # the newer map is found on n1: every write lands on the current actives
        out = json.loads(upr("load", cl.uri("n0"), "--docs", "300", "--seed", "2",
                             "--prefix", "after", "--json").stdout)  # fmt: skip
        assert out["errors"] == 0 and out["items"] == 300
        rows = cl.rows()
        assert sum(1 for (_p, k) in rows if k.startswith(b"after-")) == 300
        cl.cli("start")  # the map, dead states, then traffic on
        status = json.loads(cl.cli("status", "--json").stdout)
        assert [n["traffic"] for n in status["nodes"]] == [True, True]
        assert run(_write_to(cl.uri("n0"), mine[0], 4)) == Status.NOT_MY_VBUCKET
    finally:
        cl.stop()


def test_a_uri_with_more_hosts_bootstraps_from_the_first_that_answers(tmp_path: Path) -> None:
    """`upr://user@n0,n1/bucket`: with n0 gone (killed, failed over), every tool
    bootstraps from n1; with none answering, a one-line error naming each host."""
    from tests.e2e.cluster_helpers import Cluster, as_tail, tail_state

    cl = Cluster(tmp_path / "cl", nodes=2, replicas=1, partitions=4)
    try:
        upr("load", cl.uri("n1"), "--docs", "200", "--seed", "1")
        cl.settle()
        cl.kill("n0")
        cl.cli("failover", "n0")
        n1 = cl.spec.node("n1").port
        both = cl.uri("n0").replace("/default", f",127.0.0.1:{n1}/default")
        out = upr("tail", both, "--until-end", "--format", "json")
        assert tail_state(out.stdout) == as_tail(cl.rows())
        upr("load", both, "--docs", "50", "--seed", "2", "--prefix", "more")
        upr("backup", both, "--repo", str(tmp_path / "repo"), "--no-progress")
        assert sum(1 for (_p, k) in cl.rows() if k.startswith(b"more-")) == 50
        cl.kill("n1")
        bad = upr("tail", both, "--until-end", check=False)
        assert bad.returncode != 0 and "no bootstrap host answers" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and cl.spec.password not in bad.stderr
    finally:
        cl.stop()
