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
from tests.e2e.e2e_helpers import background, run, seqnos, spawn
from upr_cli.cluster import spec
from upr_cli.cluster.control import STATE_CODES
from upr_cli.net.bootstrap import connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.messages import (
    Delete,
    ObserveSeqno,
    ObserveSeqnoResponse,
    Set,
    SetVbucket,
)
from upr_cli.protocol.status import Status

Rows = dict[tuple[int, bytes], tuple[Any, ...]]


def _doc_key(key: bytes) -> bytes:
    """A node database's key as tests compare it: a default-collection key without its
    0x00 prefix; other qualified keys (named collections, system rows) as stored."""
    key = bytes(key)
    return key[1:] if key[:1] == b"\x00" else key


class Cluster:
    """`upr cluster init` in a directory, with helpers to disturb and read it."""

    def __init__(self, data: Path, *, nodes: int, replicas: int, partitions: int) -> None:
        self.data = data
        upr("cluster", "init", "--nodes", str(nodes), "--replicas", str(replicas),
            "--data", str(data), "--num-partitions", str(partitions))  # fmt: skip

    @classmethod
    def at(cls, data: Path) -> Cluster:
        """The cluster already initialised in `data` (by a test's own `upr cluster init`)."""
        cl = cls.__new__(cls)
        cl.data = data
        return cl

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
                    out[(part, _doc_key(key))] = (seq, bool(deleted), bytes(value), u64(cas),
                                                  rev, flags, exp)  # fmt: skip
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

    def copy_rows(self, name: str) -> Rows:
        """One node's own copies (any state), read from its database file, in the shape
        of `rows`: persisted data only."""
        cl = self.spec
        db = Path(cl.node(name).data) / f"{cl.bucket}.sqlite3"
        out: Rows = {}
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            for part, key, seq, deleted, value, cas, rev, flags, exp in c.execute(
                "SELECT vbucket, key, seq, deleted, value, cas, rev_seq, flags, expiry FROM docs"
            ):  # fmt: skip
                u64 = lambda v: v + (1 << 64) if v < 0 else v  # noqa: E731
                out[(part, _doc_key(key))] = (seq, bool(deleted), bytes(value), u64(cas), rev,
                                              flags, exp)  # fmt: skip
        return out

    def lost_writes(self, name: str) -> list[tuple[int, int, bytes, int, bool]]:
        """A node's `lost_writes` table: (rolled back to, partition, key, seq, deleted),
        in seq order."""
        cl = self.spec
        db = Path(cl.node(name).data) / f"{cl.bucket}.sqlite3"
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            rows = c.execute("SELECT rolled_back_to, vbucket, key, seq, deleted FROM lost_writes"
                             " ORDER BY vbucket, seq").fetchall()  # fmt: skip
        return [(to, vb, _doc_key(k), seq, bool(d)) for to, vb, k, seq, d in rows]

    def seqnos(self, name: str) -> dict[int, tuple[int, int, int]]:
        """{partition: (uuid, high seq, persisted seq)} of one node (STAT vbucket-seqno)."""
        return dict(run(seqnos(self.uri(name))))

    def stats(self, name: str, group: str) -> dict[str, str]:
        """One STAT group of a node."""

        async def go() -> dict[str, str]:
            s = await connect(SourceUri.parse(self.uri(name)))
            try:
                return await s.conn.stats(group)
            finally:
                await s.conn.aclose()

        return dict(run(go()))

    def wait(self, what: str, done: Any, timeout: float = 30.0) -> None:
        """Poll `done()` until it is true; AssertionError naming `what` after `timeout`."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.05)

    def restart(self, name: str, *extra: str) -> None:
        """Stop a node cleanly and start it again with extra `upr serve` options (e.g.
        `--flush-interval 3600`: it then persists only when told, see `flush`); the
        orchestrator then gives it the map and turns its traffic on."""
        script = (
            "import sys; from pathlib import Path; from upr_cli.cluster import procs, spec\n"
            "d = Path(sys.argv[1]); cl = spec.load(d); node = cl.node(sys.argv[2])\n"
            "procs.stop_node(node); procs.start_node(cl, node, extra=sys.argv[3:])\n"
            "spec.save(d, cl)\n"
        )  # in a child, as `upr cluster start` does: the node outlives it
        subprocess.run([sys.executable, "-c", script, str(self.data), name, *extra],
                       check=True, timeout=120)  # fmt: skip
        self.cli("start")

    def flush(self, name: str) -> None:
        """Make a node persist what it holds now: SET_VBUCKET of one of its partitions
        to the state it already has (a state command flushes first: formats/cluster.md §3),
        with the bucket CAS and the current map revision."""
        cl = self.spec

        async def go() -> None:
            s = await connect(SourceUri.parse(cl.uri(cl.node(name))))
            conn = s.conn
            try:
                held = await conn.stats("vbucket")
                vb, state = next((int(k[3:]), v) for k, v in held.items() if v != "dead")
                value = json.dumps({"rev": cl.rev}).encode()
                cas = 0
                for _ in range(5):
                    resp = await conn.request(SetVbucket(
                        vbucket=vb, state=STATE_CODES[state], cas=cas, value=value,
                        opaque=conn.next_opaque()), check=False)  # fmt: skip
                    if resp.status == Status.SUCCESS:
                        return
                    assert resp.status == Status.KEY_EEXISTS, resp.status
                    cas = resp.cas  # the bucket CAS, as the orchestrator retries
                raise AssertionError(f"{name}: the bucket CAS kept changing")
            finally:
                await conn.aclose()

        run(go())

    def stop(self) -> None:
        """Stop every node (tests call it in `finally`)."""
        if (self.data / spec.CLUSTER_FILE).exists():
            upr("cluster", "stop", "--data", str(self.data), check=False)


def on_terminal(*args: str, columns: int = 80) -> str:
    """`upr ARGS` on a pseudo-terminal `columns` wide (Rich sizes tables to it); its
    output with the escape sequences removed."""
    import pty
    import re

    main, child = pty.openpty()
    env = os.environ | {"COLUMNS": str(columns), "LINES": "50"}
    env.pop("UPR_PASSWORD", None)
    with spawn(sys.executable, "-m", "upr_cli", *args, stdout=child, stderr=child,
               stdin=subprocess.DEVNULL, env=env) as proc:  # fmt: skip
        os.close(child)
        chunks = []
        while True:
            try:
                chunk = os.read(main, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(main)
        proc.wait(timeout=120)
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def popen(*args: str) -> subprocess.Popen[Any]:
    """A background `upr` command."""
    env = os.environ | {"UPR_LOG": "DEBUG"}  # stream moves and reconnects, for failures
    return background(subprocess.Popen([sys.executable, "-m", "upr_cli", *args],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=env))  # fmt: skip


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


async def write(uri: str, ops: list[tuple[bytes, Any]]) -> None:
    """Apply writes in order through one node: (key, JSON-able value) is a SET, (key,
    None) a DELETE. For staged workloads on the node holding the active copies."""
    s = await connect(SourceUri.parse(uri))
    conn = s.conn
    try:
        for key, value in ops:
            vb = partition_of(key, s.num_partitions)
            if value is None:
                msg: Any = Delete(vbucket=vb, key=s.qualify(key), opaque=conn.next_opaque())
            else:
                msg = Set(vbucket=vb, key=s.qualify(key), value=json.dumps(value).encode(),
                          datatype=1, opaque=conn.next_opaque())  # fmt: skip
            await conn.request(msg)
    finally:
        await conn.aclose()


async def observe(uri: str, vb: int, uuid: int) -> ObserveSeqnoResponse:
    """OBSERVE_SEQNO of one copy (formats/cluster.md §5 "What OBSERVE_SEQNO tells a
    client")."""
    s = await connect(SourceUri.parse(uri))
    try:
        resp = await s.conn.request(ObserveSeqno(vbucket=vb, vbucket_uuid=uuid,
                                                 opaque=s.conn.next_opaque()))  # fmt: skip
    finally:
        await s.conn.aclose()
    assert isinstance(resp, ObserveSeqnoResponse), resp
    return resp
