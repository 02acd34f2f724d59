"""Client-side helpers for e2e tests, built on the library (upr_cli.net, upr_cli.dcp)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Rollback
from upr_cli.net.bootstrap import WANTED, connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.protocol.header import Feature
from upr_cli.protocol.messages import Delete, DelWithMeta, Set, SetWithMeta
from upr_cli.store import content_hash_of

if TYPE_CHECKING:
    from tests.e2e.conftest import Node


def run(coro: Any) -> Any:
    """asyncio.run with a test-friendly name."""
    return asyncio.run(coro)


def reap(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a child if it still runs, wait for it and close its pipes. Run at teardown
    whatever happened: a test that timed out leaves no process (or open pipe, which
    warnings-as-errors would turn into a failure of a later test) behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


_BACKGROUND: list[subprocess.Popen[Any]] = []


def background(proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    """Hand a process started deep in a helper to the test's teardown: the autouse
    fixture in conftest.py reaps it after the test, however the test ended."""
    _BACKGROUND.append(proc)
    return proc


def reap_background() -> None:
    """Reap every process `background` was given (the autouse fixture's teardown)."""
    while _BACKGROUND:
        reap(_BACKGROUND.pop())


@contextlib.contextmanager
def spawn(*cmd: str, **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """Start a process owned by the block: at its end (or on any failure in it) the
    process is killed, waited for and its pipes closed (`reap`)."""
    proc = subprocess.Popen(list(cmd), **popen)
    try:
        yield proc
    finally:
        reap(proc)


def spawn_upr(*args: str, **popen: Any) -> contextlib.AbstractContextManager[
        subprocess.Popen[str]]:  # fmt: skip
    """`spawn` the `upr` CLI (text pipes for stdout and stderr unless told otherwise)."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    popen.setdefault("text", True)
    return spawn(sys.executable, "-m", "upr_cli", *args, **popen)


@dataclass
class Watched:
    """A node whose stderr is drained into `stderr` (a full pipe would block it)."""

    node: Node
    stderr: list[str] = field(default_factory=list)


def _collect(pipe: object, out: list[str]) -> None:
    with contextlib.suppress(Exception):
        for line in pipe:  # type: ignore[attr-defined]
            out.append(line)


@contextlib.contextmanager
def watched_node(node: Node, *, clean_stop: bool = True) -> Iterator[Watched]:
    """Start `node`, drain its stderr, stop it with SIGTERM at the end (SIGKILL after a
    minute) and, unless told otherwise, require that stop to be clean (exit 0)."""
    node.start()
    assert node.proc is not None and node.proc.stderr is not None
    w = Watched(node)
    reader = threading.Thread(target=_collect, args=(node.proc.stderr, w.stderr), daemon=True)
    reader.start()
    code = None
    try:
        yield w
    finally:
        if node.alive():
            node.proc.send_signal(signal.SIGTERM)
            try:
                code = node.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
        reader.join(timeout=10)
        for pipe in (node.proc.stdout, node.proc.stderr):
            if pipe is not None:
                pipe.close()
    if clean_stop:
        assert code == 0, f"the node did not stop cleanly ({code}): {''.join(w.stderr)[-4000:]}"


async def seqnos(uri: str) -> dict[int, tuple[int, int, int]]:
    """{partition: (uuid, high seq, persisted seq)} from STAT vbucket-seqno."""
    s = await connect(SourceUri.parse(uri))
    try:
        st = await s.conn.stats("vbucket-seqno")
    finally:
        await s.conn.aclose()
    out = {}
    for p in range(s.num_partitions):
        out[p] = (int(st[f"vb_{p}:uuid"]), int(st[f"vb_{p}:high_seqno"]),
                  int(st[f"vb_{p}:last_persisted_seqno"]))  # fmt: skip
    return out


def wait_persisted(uri: str, timeout: float = 30.0) -> dict[int, tuple[int, int, int]]:
    """Wait until every partition's persisted seq equals its high seq."""
    deadline = time.monotonic() + timeout
    while True:
        s = run(seqnos(uri))
        if all(high == pers for _, high, pers in s.values()):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"not persisted within {timeout}s")
        time.sleep(0.05)


async def failover_logs(uri: str) -> dict[int, list[tuple[int, int]]]:
    """Every partition's failover log from STAT failovers."""
    s = await connect(SourceUri.parse(uri))
    try:
        st = await s.conn.stats("failovers")
    finally:
        await s.conn.aclose()
    out: dict[int, list[tuple[int, int]]] = {}
    for p in range(s.num_partitions):
        n = int(st[f"vb_{p}:num_entries"])
        out[p] = [(int(st[f"vb_{p}:{i}:id"]), int(st[f"vb_{p}:{i}:seq"])) for i in range(n)]
    return out


async def drain(uri: str, **kw: Any) -> tuple[list[DcpRecord], list[Any], DcpConsumer]:
    """Stream to the end; return records (key/value as bytes), events and the closed
    consumer."""
    kw.setdefault("until_end", True)
    consumer = DcpConsumer(SourceUri.parse(uri), **kw)
    rows: list[DcpRecord] = []
    events: list[Any] = []
    await consumer.open()
    try:
        async for batch in consumer.batches():
            for it in batch:
                if type(it) is DcpRecord:
                    rows.append(it._replace(key=bytes(it.key), value=bytes(it.value)))
                else:
                    events.append(it)
            consumer.commit()
    finally:
        await consumer.aclose()
    return rows, events, consumer


class Replica:
    """A client-side copy kept as a DCP client keeps one: history per partition, undone
    on rollback (docs/design.md "Snapshot boundaries")."""

    def __init__(self) -> None:
        self.history: dict[int, list[tuple[int, bytes, int, bytes]]] = {}
        self.positions: dict[int, StreamPosition] = {}

    def apply(self, rows: Iterable[DcpRecord | tuple[Any, ...]], events: list[Any]) -> None:
        """Apply a drain's records and rollbacks in order (rollbacks come before the
        re-stream). Plain tuples in record order are taken too, as records."""
        for ev in events:
            if isinstance(ev, Rollback):
                h = self.history.get(ev.partition, [])
                self.history[ev.partition] = [e for e in h if e[0] <= ev.to_seq]
        for row in rows:
            rec = row if type(row) is DcpRecord else DcpRecord._make(row)
            self.history.setdefault(rec.vbucket, []).append(
                (rec.by_seqno, bytes(rec.key), rec.opcode, bytes(rec.value))
            )

    def state(self) -> dict[bytes, bytes]:
        """Latest live value per key."""
        out: dict[bytes, bytes] = {}
        for h in self.history.values():
            for _seq, key, op, value in sorted(h, key=lambda e: e[0]):
                if op == OP_MUTATION:
                    out[key] = value
                else:
                    out.pop(key, None)
        return out


def docs(uri: str) -> dict[bytes, tuple[Any, ...]]:
    """key -> (value, cas, rev_seq, flags, expiry) of every live document."""
    rows, _e, _c = run(drain(uri))
    out: dict[bytes, tuple[Any, ...]] = {}
    for r in sorted(rows, key=lambda r: (r.vbucket, r.by_seqno)):
        if r.opcode == OP_MUTATION:
            out[bytes(r.key)] = (r.value, r.cas, r.rev_seqno, r.flags, r.expiration)
        else:
            out.pop(bytes(r.key), None)
    return out


def node_content_hash(uri: str) -> tuple[int, str]:
    """(live documents, content hash) of a node, as formats/store.md defines the hash."""
    live = docs(uri)
    return len(live), content_hash_of((k, v[0], v[1], v[2], v[3], v[4]) for k, v in live.items())


def node_rows(uri: str) -> dict[tuple[int, bytes], tuple[Any, ...]]:
    """(partition, key) -> (seq, deleted, value, cas, rev_seq, flags, expiry) of every
    document a full stream of the node gives, tombstones included."""
    rows, _e, _c = run(drain(uri))
    out: dict[tuple[int, bytes], tuple[Any, ...]] = {}
    for r in sorted(rows, key=lambda r: (r.vbucket, r.by_seqno)):
        out[(r.vbucket, bytes(r.key))] = (r.by_seqno, r.opcode != OP_MUTATION, r.value, r.cas,
                                          r.rev_seqno, r.flags, r.expiration)  # fmt: skip
    return out


def store_rows(path: Any) -> dict[tuple[int, bytes], tuple[Any, ...]]:
    """The same view of a SQLite store (formats/store.md)."""
    from upr_cli.store import Store

    with Store(path, create=False) as s:
        return {
            (d.partition, d.key): (d.seq, d.deleted, d.value, d.cas, d.rev_seq, d.flags, d.expiry)
            for d in s.documents()
        }


async def set_keys(uri: str, values: dict[bytes, bytes]) -> None:
    """SET each key to its value (JSON) through the KV front end."""
    from upr_cli.net.bootstrap import partition_of
    from upr_cli.protocol.messages import Set

    s = await connect(SourceUri.parse(uri))
    try:
        for key, value in values.items():
            p = partition_of(key, s.num_partitions)
            await s.conn.request(
                Set(
                    vbucket=p,
                    key=s.qualify(key),
                    value=value,
                    datatype=1,
                    opaque=s.conn.next_opaque(),
                )
            )
    finally:
        await s.conn.aclose()


def apply_changes(changes: Iterable[tuple[bytes, bytes | None]]) -> dict[bytes, bytes]:
    """The state a sequence of (key, value) changes leaves; value None deletes the key."""
    state: dict[bytes, bytes] = {}
    for key, value in changes:
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    return state


async def write_xattr_ops(uri: str, ops: list[tuple[str, bytes, Any]]) -> None:
    """Writes over one connection that negotiated XATTR (formats/wire.md "Xattrs"):
    ("meta", key, (xattrs, body, rev)) a SET_WITH_META with that blob (flags 0x2A);
    ("set", key, body) a plain SET, flags 7 (the document keeps its xattrs); ("delete",
    key, None) a DELETE (the tombstone keeps its system xattrs); ("delmeta", key,
    (xattrs, rev)) a DEL_WITH_META carrying a blob."""
    s = await connect(SourceUri.parse(uri), features=(*WANTED, Feature.XATTR))
    assert Feature.XATTR in s.features
    try:
        for kind, key, arg in ops:
            vb, k, op = partition_of(key, s.num_partitions), s.qualify(key), s.conn.next_opaque()
            cas = time.time_ns() & ~0xFFFF
            if kind == "meta":
                dt, value = xattrs.join(xattrs.from_json(arg[0]), arg[1], 0x01)
                msg: Any = SetWithMeta(vbucket=vb, key=k, value=value, datatype=dt, flags=0x2A,
                                       rev_seqno=arg[2], item_cas=cas, opaque=op)  # fmt: skip
            elif kind == "set":
                msg = Set(vbucket=vb, key=k, value=arg, datatype=0x01, flags=7, opaque=op)
            elif kind == "delete":
                msg = Delete(vbucket=vb, key=k, opaque=op)
            else:
                msg = DelWithMeta(vbucket=vb, key=k, value=xattrs.from_json(arg[0]),
                                  datatype=xattrs.XATTR, rev_seqno=arg[1], item_cas=cas,
                                  opaque=op)  # fmt: skip
            await s.conn.request(msg)
    finally:
        await s.conn.aclose()
