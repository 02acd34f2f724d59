"""A set test in the manner of Jepsen (issue 7): nothing confirmed durable is ever lost.

Writers create documents, update and delete their own recent ones (so snapshots carry
deduplicated keys) through the map-following router, and record each write the cluster
acknowledged, with its (partition, uuid, seq). A confirmer asks every copy of the
partition the map names (the active and each replica) with OBSERVE_SEQNO; a write is
*confirmed* once every copy reports the write's branch as its current one and a
persisted seq at or above it (formats/cluster.md §5 "What OBSERVE_SEQNO tells a
client": a replica's persisted seq is its last complete snapshot). A nemesis meanwhile
SIGKILLs and restarts nodes, fails them over hard (then brings them back with a
rebalance) and rebalances. Afterwards the cluster is healed and settled, a backup is
taken and restored, and, per key (each key has one writer, so its writes are ordered):

* the key ends as its last confirmed write left it, or as a later attempted write did
  (a confirmed write is never lost, nor overwritten by an older one);
* no document holds a value that was never written;
* the restore equals the final cluster (read from the active copies' files).

`make test` runs a short variant; the long one is marked slow (`make test-slow`).
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from tests.e2e.cluster_helpers import Cluster
from tests.e2e.conftest import upr
from tests.e2e.e2e_helpers import store_rows
from upr_cli.errors import UprError
from upr_cli.net.bootstrap import connect
from upr_cli.net.connection import Connection
from upr_cli.net.router import Router
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.fast import encode_set
from upr_cli.protocol.header import Opcode
from upr_cli.protocol.messages import Delete, ObserveSeqno, ObserveSeqnoResponse
from upr_cli.protocol.status import Status

Write = tuple[bytes, int]  # (key, index of the attempt among the key's writes)


@dataclass
class Ledger:
    """What the writers and the confirmer saw."""

    # key → every write attempted, in order: the value set, or None for a delete
    attempted: dict[bytes, list[bytes | None]] = field(default_factory=dict)
    acked: dict[Write, tuple[int, int, int]] = field(default_factory=dict)  # (vb, uuid, seq)
    confirmed: set[Write] = field(default_factory=set)


async def _writer(router: Router, w: int, ledger: Ledger, stop: asyncio.Event,
                  rng: random.Random) -> None:  # fmt: skip
    i = 0
    recent: list[bytes] = []  # this writer's newest keys: updates land in open snapshots
    while not stop.is_set():
        r = rng.random()
        if recent and r < 0.15:
            key, value = recent.pop(rng.randrange(len(recent))), None
        else:
            if recent and r < 0.5:
                key = rng.choice(recent)
            else:
                key = f"set-{w}-{i:06d}".encode()
                recent = [*recent[-7:], key]
            value = json.dumps({"w": w, "i": i}, separators=(",", ":")).encode()
        i += 1
        vb = router.partition(key)
        writes = ledger.attempted.setdefault(key, [])
        writes.append(value)
        if value is None:
            wire = router.qualify(key)
            make = lambda o, k=wire, p=vb: Delete(vbucket=p, key=k, opaque=o).encode()  # noqa: E731
        else:
            wire = router.qualify(key)
            make = lambda o, k=wire, v=value, p=vb: encode_set(  # noqa: E731
                Opcode.SET, p, o, k, v, datatype=1)  # fmt: skip
        try:
            reply = await router.request(vb, make)
        except UprError:
            await asyncio.sleep(0.05)  # the whole cluster was unreachable for a moment
            continue
        if reply.vbucket_or_status == Status.SUCCESS and len(reply.extras) == 16:
            uuid, seq = struct.unpack(">QQ", reply.extras)
            ledger.acked[(key, len(writes) - 1)] = (vb, uuid, seq)


async def _observe(conns: dict[str, Connection], uri: SourceUri, server: str, vb: int,
                   uuid: int) -> tuple[int, int, int] | None:  # fmt: skip
    """(format, current uuid, persisted seq) of one copy, or None if it cannot answer."""
    try:
        conn = conns.get(server)
        if conn is None or conn.closed:
            host, _, port = server.rpartition(":")
            node = replace(uri, host=host, port=int(port))
            conn = (await connect(node, timeout=2.0)).conn
            conns[server] = conn
        resp = await conn.request(ObserveSeqno(vbucket=vb, vbucket_uuid=uuid,
                                               opaque=conn.next_opaque()), timeout=2.0,
                                  check=False)  # fmt: skip
    except (UprError, OSError):
        return None
    if not isinstance(resp, ObserveSeqnoResponse):
        return None
    return resp.format, resp.vbucket_uuid, resp.persisted_seqno


async def _confirmer(router: Router, uri: SourceUri, ledger: Ledger, stop: asyncio.Event) -> None:
    conns: dict[str, Connection] = {}
    try:
        while True:
            done = stop.is_set()
            cfg = router.config.get("vBucketServerMap", {})
            servers, rows = cfg.get("serverList", []), cfg.get("vBucketMap", [])
            pending = [(k, a) for k, a in list(ledger.acked.items()) if k not in ledger.confirmed]
            by_part: dict[tuple[int, int], list[tuple[Write, int]]] = {}
            for key, (vb, uuid, seq) in pending:
                by_part.setdefault((vb, uuid), []).append((key, seq))
            for (vb, uuid), writes in by_part.items():
                row = rows[vb] if vb < len(rows) else []
                if not row or row[0] < 0:
                    continue
                views = [await _observe(conns, uri, servers[i], vb, uuid) for i in row]
                if any(v is None or v[0] != 0 or v[1] != uuid for v in views):
                    continue  # a copy is down, behind on another branch, or not this branch
                floor = min(v[2] for v in views if v is not None)
                ledger.confirmed.update(k for k, seq in writes if seq <= floor)
            if done:
                return
            await asyncio.sleep(0.1)
    finally:
        for c in conns.values():
            await c.aclose()


def _nemesis_step(cl: Cluster, rng: random.Random, log: list[str]) -> None:
    """One fault: a SIGKILL and restart, a hard failover (brought back), or a rebalance."""
    members = [n.name for n in cl.spec.nodes if n.member]
    victim = rng.choice(members)
    op = rng.choice(["kill", "failover", "rebalance"])
    if op == "kill":
        cl.kill(victim)
        time.sleep(rng.uniform(0.1, 0.6))
        cl.cli("start")
    elif op == "failover" and len(members) > 2:
        cl.kill(victim)
        time.sleep(rng.uniform(0.1, 0.4))
        cl.cli("failover", victim)
        cl.cli("rebalance", "--add", victim)
    else:
        cl.cli("rebalance", "--remove", victim)
        cl.cli("rebalance", "--add", victim)
    log.append(f"{op} {victim}")


def _run(tmp: Path, seconds: float, seed: int) -> None:
    cl = Cluster(tmp / "cl", nodes=3, replicas=2, partitions=8)
    rng = random.Random(seed)
    ledger = Ledger()
    nemesis_log: list[str] = []
    try:
        uri = SourceUri.parse(cl.uri("n0"))

        async def workload() -> None:
            router = await Router.open(uri, name="upr-set-test")
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_writer(router, w, ledger, stop, random.Random(seed + w)))
                     for w in range(4)]  # fmt: skip
            confirm = asyncio.create_task(_confirmer(router, uri, ledger, stop))
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                await asyncio.sleep(rng.uniform(0.3, 1.0))
                await asyncio.to_thread(_nemesis_step, cl, rng, nemesis_log)
            # heal: every node up and in the map, replication settled
            await asyncio.to_thread(cl.cli, "start")
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)
            await asyncio.to_thread(cl.settle)
            await confirm  # a last pass over the settled cluster
            await router.aclose()

        asyncio.run(workload())
        cl.settle()
        final = cl.rows()
        live = {k: r[2] for (_p, k), r in final.items() if not r[1] and k.startswith(b"set-")}
        last_confirmed: dict[bytes, int] = {}
        for key, idx in ledger.confirmed:
            last_confirmed[key] = max(idx, last_confirmed.get(key, -1))
        # every key ends as its last confirmed write (persisted on all copies) left it, or
        # as a later attempt did; with none confirmed, as any attempt did or absent
        lost = []
        for key, writes in ledger.attempted.items():
            c = last_confirmed.get(key)
            allowed = writes[c:] if c is not None else [*writes, None]
            if live.get(key) not in allowed:
                lost.append((key, c, writes, live.get(key)))
        assert not lost, (lost[:5], nemesis_log)
        # no value appears that was never written
        invented = [k for k, v in live.items() if v not in ledger.attempted.get(k, [])]
        assert not invented, (invented[:5], nemesis_log)
        assert len(ledger.confirmed) > 100 and nemesis_log, (len(ledger.confirmed), nemesis_log)
        # the workload's updates and deletes were confirmed too, not only creations
        deletes = sum(1 for k, i in ledger.confirmed if ledger.attempted[k][i] is None)
        updates = sum(1 for k, i in ledger.confirmed if i > 0) - deletes
        assert deletes > 5 and updates > 10, (deletes, updates)
        # a backup of the final cluster restores to exactly it
        repo = tmp / "repo"
        upr("backup", cl.uri("n0"), "--repo", str(repo), "--no-progress")
        upr("restore", "--repo", str(repo), f"sqlite:{tmp / 'restored.db'}")
        assert store_rows(tmp / "restored.db") == final
        # no node failed a flush or dropped a connection on an unhandled exception
        assert not cl.node_errors(), (cl.node_errors(), nemesis_log)
    finally:
        cl.stop()


def test_set_short(tmp_path: Path) -> None:
    _run(tmp_path, seconds=6.0, seed=7)


@pytest.mark.slow
def test_set_long(tmp_path: Path) -> None:
    _run(tmp_path, seconds=60.0, seed=11)
