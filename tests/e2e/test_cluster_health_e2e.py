"""`upr cluster status` of a degraded cluster, `cluster env` and the nodes' argv, `rebalance
--add --base-port`, and a node that stays quiet when a DCP client leaves mid-stream."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from tests.cli.json_convention import problems
from tests.e2e.cluster_helpers import Cluster, on_terminal
from tests.e2e.conftest import upr
from tests.e2e.e2e_helpers import spawn_upr
from upr_cli.protocol.messages import DcpOpen, SaslAuth, SelectBucket, StreamRequest


def _free_block(n: int) -> int:
    """The first of n consecutive loopback ports, all free now, below the kernel's
    ephemeral range: a port the kernel hands to some other test's bind(0) or connect in
    the meantime cannot be one of them (a base found with bind(0) failed 1 CI run in 30)."""
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(max(1024, low - 12000), low - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no block of free loopback ports")


def test_status_names_a_dead_node_and_what_to_do(tmp_path: Path) -> None:
    cl = Cluster(tmp_path / "cl", nodes=3, replicas=1, partitions=12)
    try:
        upr("load", cl.uri(), "--docs", "300")
        cl.settle()
        vbmap = cl.spec.vbmap
        cl.kill("n2")
        status = json.loads(cl.cli("status", "--json").stdout)
        assert problems(status) == []  # seqs as decimal strings (docs/output.md)
        n2 = status["nodes"][2]
        assert (n2["state"], n2["reason"], n2["up"]) == ("down", "not running", False)
        assert n2["error"]  # the full text stays in --json
        assert [n["state"] for n in status["nodes"][:2]] == ["up", "up"]
        assert status["unavailable"] == [p for p, row in enumerate(vbmap) if row[0] == 2]
        assert status["unreplicated"] == [p for p, row in enumerate(vbmap) if 2 in row[1:]]
        commands = [a["command"] for a in status["actions"]]
        assert f"upr cluster failover n2 --data {cl.data}" in commands
        # at 80 columns: one line a node, every key column whole, the reason and the
        # repair below the table
        text = on_terminal("cluster", "status", "--data", str(cl.data))
        lines = text.splitlines()
        assert all(len(line) <= 80 for line in lines if str(cl.data) not in line), text
        header = next(line for line in lines if "node" in line and "port" in line)
        for col in ("state", "map rev", "active", "replica", "dead", "max lag"):
            assert col in header, text
        rows = [line.split() for line in lines if line.strip().startswith(("n0 ", "n1 ", "n2 "))]
        ports = [str(n.port) for n in cl.spec.nodes]
        assert [r[:3] for r in rows] == [["n0", ports[0], "up"], ["n1", ports[1], "up"],
                                         ["n2", ports[2], "down"]]  # fmt: skip
        assert "n2: down (not running)" in text
        assert "unavailable: 4 of 12 partitions: " in text
        assert "unreplicated: 4 of 12 partitions: " in text
        assert "upr cluster failover n2 --data" in text
        assert "Connect call failed" not in text
        # after the failover, n2 is out of the map, every partition has an active copy,
        # and the repair is a rebalance
        cl.cli("failover", "n2")
        after = json.loads(cl.cli("status", "--json").stdout)
        assert after["nodes"][2]["state"] == "out, down"
        assert after["unavailable"] == []
        assert len(after["unreplicated"]) == 8
        commands = [a["command"] for a in after["actions"]]
        assert commands == [f"upr cluster rebalance --add n2 --data {cl.data}"]
        text = cl.cli("status").stdout
        assert "out, down" in text and "up" not in text.split("n2", 1)[1].splitlines()[0]
    finally:
        cl.stop()


def test_env_password_argv_and_base_port(tmp_path: Path) -> None:
    data = tmp_path / "cl"
    base = _free_block(3)  # n0, n1 and n2 (added below)
    try:
        # --partitions still works (deprecated) and says so
        r = upr("cluster", "init", "--nodes", "2", "--replicas", "1", "--data", str(data),
                "--partitions", "4", "--base-port", str(base))  # fmt: skip
        assert "--partitions is deprecated" in r.stderr and "use --num-partitions" in r.stderr
        cl = Cluster.at(data)
        assert cl.spec.partitions == 4
        assert [n.port for n in cl.spec.nodes] == [base, base + 1]
        password = cl.spec.password
        for node in cl.spec.nodes:  # the password is in no node's argv (ps shows argv)
            argv = Path(f"/proc/{node.pid}/cmdline").read_bytes().split(b"\0")
            assert password.encode() not in b" ".join(argv) and b"--password" not in argv
            assert b"--user" in argv
        # eval of `cluster env` sets UPR_PASSWORD, replacing a stale one (the cluster's wins)
        script = 'eval "$("$@")"; printf "%s\\n%s\\n" "$UPR_PASSWORD" "$UPR_N1"'
        cmd = ["sh", "-c", script, "sh", sys.executable, "-m", "upr_cli", "cluster", "env",
               "--data", str(data)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "UPR_PASSWORD"}
        fresh = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        assert fresh.stdout.splitlines() == [password, f"upr://admin@127.0.0.1:{base + 1}/default"]
        assert fresh.stderr == ""
        stale = subprocess.run(cmd, env=env | {"UPR_PASSWORD": "mine"}, capture_output=True,
                               text=True, check=True)  # fmt: skip
        assert stale.stdout.splitlines()[0] == password
        assert "replace it with this cluster's" in stale.stderr
        # rebalance --add new honours --base-port: node n2 on base + 2
        cl.cli("rebalance", "--add", "new", "--base-port", str(base))
        assert [(n.name, n.port) for n in cl.spec.nodes][2] == ("n2", base + 2)
        assert json.loads(cl.cli("status", "--json").stdout)["nodes"][2]["state"] == "up"
    finally:
        if (data / "cluster.json").exists():
            upr("cluster", "stop", "--data", str(data), check=False)


def _frame(sock: socket.socket) -> bytes:
    """One response frame (header and body) from a blocking socket."""
    buf = b""
    while len(buf) < 24:
        buf += sock.recv(24 - len(buf))
    (length,) = struct.unpack(">I", buf[8:12])
    while len(buf) < 24 + length:
        buf += sock.recv(24 + length - len(buf))
    return buf


def _leave_mid_stream(port: int, password: str, nbytes: int, partitions: int) -> None:
    """A DCP client that streams every partition, reads `nbytes`, then resets the
    connection (SO_LINGER 0: an RST, as when a client process is killed)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(SaslAuth(mechanism="PLAIN", payload=f"\0admin\0{password}".encode(),
                           opaque=1).encode())  # fmt: skip
        assert _frame(s)[6:8] == b"\0\0"
        s.sendall(SelectBucket(bucket="default", opaque=2).encode())
        _frame(s)
        s.sendall(DcpOpen(name="leaver", flags=1, opaque=3).encode())
        _frame(s)
        # some partitions end soon (their STREAM_END is sent as the client leaves), the
        # others stream on
        reqs = [StreamRequest(vbucket=vb, opaque=10 + vb, end_seqno=20 + vb if vb % 2 else
                              2**64 - 1).encode() for vb in range(partitions)]  # fmt: skip
        s.sendall(b"".join(reqs))
        got = 0
        while got < nbytes:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            got += len(chunk)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_node_logs_no_traceback_when_a_client_leaves(tmp_path: Path) -> None:
    cl = Cluster(tmp_path / "cl", nodes=1, replicas=0, partitions=16)
    try:
        node = cl.spec.nodes[0]
        upr("load", cl.uri(), "--docs", "3000", "--size", "4000")
        for i in range(12):
            _leave_mid_stream(node.port, cl.spec.password, 20_000 * (i + 1) ** 2, 16)
            time.sleep(0.02 * (i % 3))
        # a real consumer killed mid-stream
        with spawn_upr("tail", cl.uri(), "--until-end", "--format", "json",
                       stderr=subprocess.DEVNULL, text=False) as tail:  # fmt: skip
            assert tail.stdout is not None
            tail.stdout.read(300_000)
            tail.send_signal(signal.SIGKILL)
            tail.wait(timeout=30)
        time.sleep(0.5)
        # the node still serves, then stops cleanly (tasks left behind are reported then)
        assert json.loads(cl.cli("status", "--json").stdout)["nodes"][0]["state"] == "up"
        cl.cli("stop")
        log = (Path(node.data) / "serve.log").read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]
        assert "never retrieved" not in log, log[-3000:]
    finally:
        cl.stop()
