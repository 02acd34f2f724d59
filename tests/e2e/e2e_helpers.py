"""Client-side helpers for e2e tests, built on the library (upr_cli.net, upr_cli.dcp)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Rollback
from upr_cli.dcp.position import StreamPosition
from upr_cli.net.bootstrap import connect
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.store import content_hash_of


def run(coro: Any) -> Any:
    """asyncio.run with a test-friendly name."""
    return asyncio.run(coro)


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


async def drain(uri: str, **kw: Any) -> tuple[list[tuple[Any, ...]], list[Any], DcpConsumer]:
    """Stream to the end; return rows (key/value as bytes), events and the closed consumer."""
    kw.setdefault("until_end", True)
    consumer = DcpConsumer(SourceUri.parse(uri), **kw)
    rows: list[tuple[Any, ...]] = []
    events: list[Any] = []
    await consumer.open()
    try:
        async for batch in consumer.batches():
            for it in batch:
                if type(it) is DcpRecord:
                    rows.append(tuple(bytes(v) if isinstance(v, memoryview) else v for v in it))
                else:
                    events.append(it)
            consumer.commit()
    finally:
        await consumer.aclose()
    return rows, events, consumer


class Replica:
    """A client-side copy kept like seed 000's client: history per partition, undone on rollback."""

    def __init__(self) -> None:
        self.history: dict[int, list[tuple[int, bytes, int, bytes]]] = {}
        self.positions: dict[int, StreamPosition] = {}

    def apply(self, rows: list[tuple[Any, ...]], events: list[Any]) -> None:
        """Apply a drain's rows and rollbacks in order (rollbacks come before the re-stream)."""
        for ev in events:
            if isinstance(ev, Rollback):
                h = self.history.get(ev.partition, [])
                self.history[ev.partition] = [e for e in h if e[0] <= ev.to_seq]
        for row in rows:
            op, vb, seq, key, value = row[0], row[1], row[2], row[9], row[10]
            self.history.setdefault(vb, []).append((seq, key, op, value))

    def state(self) -> dict[bytes, bytes]:
        """Latest live value per key."""
        out: dict[bytes, bytes] = {}
        for h in self.history.values():
            for _seq, key, op, value in sorted(h, key=lambda e: e[0]):
                if op == 0x57:
                    out[key] = value
                else:
                    out.pop(key, None)
        return out


def docs(uri: str) -> dict[bytes, tuple[Any, ...]]:
    """key -> (value, cas, rev_seq, flags, expiry) of every live document."""
    rows, _e, _c = run(drain(uri))
    out: dict[bytes, tuple[Any, ...]] = {}
    for r in sorted(rows, key=lambda r: (r[1], r[2])):
        if r[0] == 0x57:
            out[r[9]] = (r[10], r[4], r[3], r[5], r[6])
        else:
            out.pop(r[9], None)
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
    for r in sorted(rows, key=lambda r: (r[1], r[2])):
        out[(r[1], r[9])] = (r[2], r[0] != 0x57, r[10], r[4], r[3], r[5], r[6])
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
                Set(vbucket=p, key=key, value=value, datatype=1, opaque=s.conn.next_opaque())
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
