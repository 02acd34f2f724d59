"""A local cluster for e2e tests: `upr cluster` nodes on loopback, read back independently."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.e2e.conftest import upr
from tests.e2e.e2e_helpers import run, seqnos
from upr_cli.cluster import spec

Rows = dict[tuple[int, bytes], tuple[Any, ...]]


class Cluster:
    """`upr cluster init` in a directory, with helpers to disturb and read it."""

    def __init__(self, data: Path, *, nodes: int, replicas: int, partitions: int) -> None:
        self.data = data
        upr("cluster", "init", "--nodes", str(nodes), "--replicas", str(replicas),
            "--data", str(data), "--partitions", str(partitions))  # fmt: skip

    @property
    def spec(self) -> spec.ClusterSpec:
        """The cluster file as it is now."""
        return spec.load(self.data)

    def uri(self, name: str | None = None) -> str:
        """A member's URI with credentials (the first member's by default)."""
        cl = self.spec
        node = cl.node(name) if name else next(n for n in cl.nodes if n.member)
        return cl.uri(node)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """`upr cluster ARGS --data DIR`."""
        return upr("cluster", *args, "--data", str(self.data), check=check)

    def kill(self, name: str) -> None:
        """SIGKILL a node (its pid stays recorded until `start`)."""
        pid = self.spec.node(name).pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until every member's copies are persisted and every replica holds its
        active's seqs (replication caught up)."""
        deadline = time.monotonic() + timeout
        while True:
            cl = self.spec
            highs = {n.name: run(seqnos(cl.uri(n))) for n in cl.nodes if n.member}
            ok = all(h == p for s in highs.values() for _u, h, p in s.values())
            for part, row in enumerate(cl.vbmap):
                if row and row[0] >= 0:
                    want = highs[cl.nodes[row[0]].name][part][1]
                    ok = ok and all(highs[cl.nodes[i].name][part][1] == want for i in row[1:])
            if ok:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the cluster did not settle in {timeout}s: {highs}")
            time.sleep(0.1)

    def rows(self) -> Rows:
        """The final state, read from each active copy's database file directly:
        (partition, key) → (seq, deleted, value, cas, rev seq, flags, expiry)."""
        cl = self.spec
        out: Rows = {}
        for part, row in enumerate(cl.vbmap):
            db = Path(cl.nodes[row[0]].data) / f"{cl.bucket}.sqlite3"
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
                for key, seq, deleted, value, cas, rev, flags, exp in c.execute(
                    "SELECT key, seq, deleted, value, cas, rev_seq, flags, expiry FROM docs"
                    " WHERE vbucket = ?", (part,)
                ):  # fmt: skip
                    u64 = lambda v: v + (1 << 64) if v < 0 else v  # noqa: E731
                    out[(part, bytes(key))] = (seq, bool(deleted), bytes(value), u64(cas), rev,
                                               flags, exp)  # fmt: skip
        return out

    def node_errors(self) -> dict[str, list[str]]:
        """Per node, the ERROR lines and tracebacks of its serve.log (none expected: a
        node that logs a failed flush or an unhandled exception is broken, even when the
        cluster around it still converges)."""
        out: dict[str, list[str]] = {}
        for node in self.spec.nodes:
            log_path = Path(node.data) / "serve.log"
            if node.data and log_path.exists():
                bad = [line for line in log_path.read_text(errors="replace").splitlines()
                       if " ERROR " in line or line.startswith("Traceback")]  # fmt: skip
                if bad:
                    out[node.name] = bad[:5]
        return out

    def stop(self) -> None:
        """Stop every node (tests call it in `finally`)."""
        if (self.data / spec.CLUSTER_FILE).exists():
            upr("cluster", "stop", "--data", str(self.data), check=False)


def popen(*args: str) -> subprocess.Popen[str]:
    """A background `upr` command."""
    env = os.environ | {"UPR_LOG": "DEBUG"}  # stream moves and reconnects, for failures
    return subprocess.Popen([sys.executable, "-m", "upr_cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def tail_state(lines: str) -> dict[tuple[int, bytes], tuple[int, bool, Any]]:
    """The newest version per key in `upr tail --format json` output: (seq, deleted,
    parsed JSON value or None)."""
    out: dict[tuple[int, bytes], tuple[int, bool, Any]] = {}
    for line in lines.splitlines():
        ev = json.loads(line)
        if "key" not in ev:
            continue
        k = (int(ev["partition"]), ev["key"].encode())
        seq = int(ev["seq"])
        if k not in out or out[k][0] < seq:
            deleted = ev["op"] != "mutation"
            out[k] = (seq, deleted, None if deleted else ev["value"])
    return out


def as_tail(rows: Rows) -> dict[tuple[int, bytes], tuple[int, bool, Any]]:
    """`rows` in the shape `tail_state` gives."""
    return {k: (r[0], r[1], None if r[1] else json.loads(r[2])) for k, r in rows.items()}
