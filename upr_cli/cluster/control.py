"""Pushing a cluster map and partition states to nodes (formats/cluster.md), and reading
every node back for `upr cluster status`.

Each node is driven over one authenticated connection, one command at a time: every
accepted command changes the node's bucket CAS, which the response carries; a refused
one (KEY_EEXISTS) carries the current CAS and is retried with it (formats/cluster.md §1;
the UPR design specification, "How ns_server and ep-engine guarantee ordering of
partition state transitions"). A command refused for an older map revision (EINVAL)
means another orchestrator has a newer map: the push stops with that message.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from upr_cli.cluster.spec import HOST, ClusterSpec, NodeSpec
from upr_cli.collections import CollectionsError, CollectionsManifest
from upr_cli.errors import UprError
from upr_cli.net.bootstrap import connect
from upr_cli.net.collections_manifest import get_collections_manifest, give
from upr_cli.net.connection import Connection
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.protocol.messages import (
    EnableTraffic,
    GetClusterConfig,
    SetClusterConfig,
    SetVbucket,
)
from upr_cli.protocol.status import Status

STATE_CODES = {"active": 1, "replica": 2, "pending": 3, "dead": 4}
_RETRIES = 5


def _body(resp: Any) -> bytes:
    """A response's value (every response class here has one, but not the base type)."""
    return bytes(getattr(resp, "value", b""))


class FencedOff(UprError):
    """A node holds a newer map revision: another orchestrator took over."""


def balanced_map(partitions: int, nodes: int, replicas: int) -> list[list[int]]:
    """Partition p: active on node p mod N, replicas on the next R nodes (balanced)."""
    if replicas >= nodes:
        raise UprError(f"{replicas} replicas need at least {replicas + 1} nodes")
    return [[(p + k) % nodes for k in range(replicas + 1)] for p in range(partitions)]


def map_json(spec: ClusterSpec, vbmap: list[list[int]], rev: int) -> dict[str, Any]:
    """The terse bucket config every node serves (docs/protocol.md §5.5). A node with a
    TLS data port has it as `kvSSL` in `nodesExt`, as Couchbase advertises 11207, so a
    TLS client that bootstraps from any node reaches every other one over TLS too
    (docs/protocol.md §13.2)."""
    servers = [f"{HOST}:{n.port}" for n in spec.nodes]
    return {
        "rev": rev, "revEpoch": 1, "name": spec.bucket, "nodeLocator": "vbucket",
        "bucketCapabilities": ["collections", "dcp", "cbhello", "touch", "cccp", "nodesExt"],
        "vBucketServerMap": {"hashAlgorithm": "CRC", "numReplicas": spec.replicas,
                             "serverList": servers, "vBucketMap": vbmap},
        "nodes": [{"hostname": f"{HOST}:8091", "ports": {"direct": n.port}} for n in spec.nodes],
        "nodesExt": [{"hostname": HOST, "services": services(n)} for n in spec.nodes],
    }  # fmt: skip


def services(node: NodeSpec) -> dict[str, int]:
    """A node's data ports as `nodesExt` names them: `kv`, and `kvSSL` when it has one."""
    out = {"kv": node.port}
    if node.tls_port is not None:
        out["kvSSL"] = node.tls_port
    return out


def active_of(row: list[int]) -> int:
    """The node index holding a map row's active copy (-1: none), as vBucketMap lists it."""
    return row[0] if row else -1


def replicas_of(row: list[int]) -> list[int]:
    """The node indices holding a map row's replica copies."""
    return row[1:]


def states_for(vbmap: list[list[int]], index: int) -> dict[int, str]:
    """What node `index` must hold: active, replica or dead, per partition."""
    out = {}
    for p, row in enumerate(vbmap):
        role = "replica" if index in replicas_of(row) else "dead"
        out[p] = "active" if active_of(row) == index else role
    return out


async def push(spec: ClusterSpec, node: NodeSpec, config: dict[str, Any],
               states: dict[int, str], *, failover: Collection[int] = (),
               full: dict[int, str] | None = None,
               manifest: CollectionsManifest | None = None) -> int:  # fmt: skip
    """Give one node the map and the states (those that differ); returns commands sent.

    A partition in `failover` that becomes active gets a new failover entry (a hard
    failover's promotion, formats/cluster.md §3). A node whose front-end traffic is off
    (it restarted) is given every state of `full` (what the map says it holds; `states`
    override) and then ENABLE_TRAFFIC; without `full` its traffic stays off. A node
    holding an older collections manifest than `manifest` is given it after its states
    and before its traffic is on (formats/cluster.md "Collections")."""
    s = await connect(SourceUri.parse(spec.uri(node)), name="upr-cluster")
    conn = s.conn
    cas = 0
    sent = 0
    rev = int(config["rev"])

    async def command(make: Any, what: str) -> None:
        nonlocal cas, sent
        for _ in range(_RETRIES):
            resp = await conn.request(make(cas), check=False)
            if resp.status == Status.SUCCESS:
                cas = resp.cas
                sent += 1
                return
            if resp.status == Status.KEY_EEXISTS:
                cas = resp.cas  # the right CAS, retry with it (formats/cluster.md §1)
                continue
            text = _body(resp).decode(errors="replace")
            if resp.status == Status.EINVAL and "revision" in text:
                raise FencedOff(f"node {node.name}: {what}: {text}")
            raise UprError(f"node {node.name}: {what}: status 0x{resp.status:02x} {text}")
        raise UprError(f"node {node.name}: {what}: the bucket CAS kept changing")

    try:
        waiting = (await conn.stats("")).get("ep_traffic_enabled") == "false"
        if waiting and full is not None:
            states = {**full, **states}
        held = await conn.stats("vbucket")
        current = await conn.request(GetClusterConfig(opaque=conn.next_opaque()), check=False)
        body = _body(current)
        held_map: dict[str, Any] = (
            json.loads(body) if current.status == Status.SUCCESS and body else {}
        )
        held_rev = held_map.get("rev", 0)
        if isinstance(held_rev, int) and held_rev > rev:
            raise FencedOff(f"node {node.name} holds map revision {held_rev} > {rev}")
        if held_map != config:  # (a node never given a map serves a default one)
            new_map = json.dumps(config).encode()
            await command(lambda c: SetClusterConfig(value=new_map, cas=c,
                                                     opaque=conn.next_opaque()),
                          f"map revision {rev}")  # fmt: skip
        for p, state in sorted(states.items()):
            if held.get(f"vb_{p}") == state:
                continue
            code = STATE_CODES[state]
            value = json.dumps({"rev": rev, "failover": p in failover}).encode()
            await command(lambda c, p=p, code=code, value=value: SetVbucket(
                              vbucket=p, state=code, cas=c, value=value,
                                                               opaque=conn.next_opaque()),
                          f"partition {p} → {state}")  # fmt: skip
        if manifest is not None:
            await give(conn, manifest, f"node {node.name}")
        if waiting and full is not None:
            # with the map and every state in place, front-end traffic on (a node that
            # restarted starts with it off): the UPR design specification's state
            # transitions, step 3; formats/cluster.md §3
            await conn.request(EnableTraffic(opaque=conn.next_opaque()))
            sent += 1
    finally:
        await conn.aclose()
    return sent


@dataclass
class NodeStatus:
    """One node as it answers (or does not)."""

    name: str
    port: int
    up: bool
    error: str = ""  # why it did not answer, in full (JSON)
    reason: str = ""  # the same in a few words (the status table)
    rev: int = 0
    states: dict[str, int] = field(default_factory=dict)  # state -> partitions
    highs: dict[int, int] = field(default_factory=dict)
    persisted: dict[int, int] = field(default_factory=dict)
    uuids: dict[int, int] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)
    complete: dict[int, int] = field(default_factory=dict)  # last complete snapshot persisted
    heads: dict[int, tuple[int, int]] = field(default_factory=dict)  # newest failover entry
    logs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # newest first
    snaps: dict[int, tuple[int, int]] = field(default_factory=dict)  # snapshot persisted
    replication: dict[str, Any] = field(default_factory=dict)
    traffic: bool = True  # front-end traffic on (off: restarted, not yet given the map)
    manifest_uid: int | None = None  # its collections manifest's uid (None: no collections)


async def node_status(spec: ClusterSpec, node: NodeSpec) -> NodeStatus:
    """STAT vbucket, vbucket-seqno and the map revision of one node."""
    st = NodeStatus(node.name, node.port, False)
    try:
        s = await connect(SourceUri.parse(spec.uri(node)), name="upr-cluster", timeout=3.0)
    except (UprError, OSError) as exc:
        st.error, st.reason = str(exc), short_reason(exc)
        return st
    try:
        general = await s.conn.stats("")
        roles = await s.conn.stats("vbucket")
        seqnos = await s.conn.stats("vbucket-seqno")
        cfg = await s.conn.request(GetClusterConfig(opaque=s.conn.next_opaque()), check=False)
        repl = await s.conn.stats("replication")
        fails = await s.conn.stats("failovers")
        manifest = await _manifest_of(s.conn)
    except (UprError, OSError) as exc:
        st.error, st.reason = str(exc), short_reason(exc)
        return st
    finally:
        await s.conn.aclose()
    st.up = True
    st.manifest_uid = manifest.uid if manifest is not None else None
    st.traffic = general.get("ep_traffic_enabled", "true") == "true"
    st.rev = json.loads(_body(cfg)).get("rev", 0) if _body(cfg) else 0
    for k, v in roles.items():
        p = int(k.removeprefix("vb_"))
        st.roles[p] = v
        st.states[v] = st.states.get(v, 0) + 1
    for p in st.roles:
        st.highs[p] = int(seqnos.get(f"vb_{p}:high_seqno", 0))
        st.persisted[p] = int(seqnos.get(f"vb_{p}:last_persisted_seqno", 0))
        st.uuids[p] = int(seqnos.get(f"vb_{p}:uuid", 0))
        st.complete[p] = int(repl.get(f"vb_{p}:complete_seqno", 0))
        st.logs[p] = [
            (int(fails[f"vb_{p}:{i}:id"]), int(fails[f"vb_{p}:{i}:seq"]))
            for i in range(int(fails.get(f"vb_{p}:num_entries", 0)))
        ]
        st.heads[p] = next(iter(st.logs[p]), (0, 0))  # the newest entry comes first
        st.snaps[p] = (
            int(seqnos.get(f"vb_{p}:last_persisted_snap_start", 0)),
            int(seqnos.get(f"vb_{p}:last_persisted_snap_end", 0)),
        )
    st.replication = {k: json.loads(v) for k, v in repl.items() if not k.startswith("vb_")}
    return st


async def _manifest_of(conn: Connection) -> CollectionsManifest | None:
    """The node's collections manifest; None without collections or when it is not valid
    (the node answers: `upr collections list` says what is wrong)."""
    try:
        return await get_collections_manifest(conn)
    except CollectionsError:
        return None


def short_reason(exc: BaseException) -> str:
    """Why a node did not answer, in a few words (the full text goes to --json)."""
    text = " ".join(str(exc).split())
    low = text.lower()
    if "refused" in low or "connect call failed" in low:
        return "connection refused"
    if "timed out" in low or "no answer" in low or isinstance(exc, TimeoutError):
        return "no answer (timed out)"
    if "auth" in low:
        return "authentication failed"
    if "closed" in low or "reset" in low:
        return "connection lost"
    return text if len(text) <= 40 else text[:39] + "…"


def _copies(
    statuses: list[NodeStatus], roles: tuple[str, ...]
) -> Iterator[tuple[int, NodeStatus, NodeStatus]]:
    """(partition, a copy in one of `roles`, the active copy) for every reachable pair."""
    actives = {p: st for st in statuses if st.up for p, r in st.roles.items() if r == "active"}
    for st in statuses:
        if not st.up:
            continue
        for p, role in st.roles.items():
            if role in roles and p in actives:
                yield p, st, actives[p]


def lag(statuses: list[NodeStatus]) -> dict[int, dict[str, int]]:
    """Per partition, each replica's lag behind the active copy (seqs)."""
    out: dict[int, dict[str, int]] = {}
    for p, st, act in _copies(statuses, ("replica",)):
        out.setdefault(p, {})[st.name] = max(0, act.highs[p] - st.highs.get(p, 0))
    return out


def rollback_points(statuses: list[NodeStatus]) -> dict[int, dict[str, int]]:
    """Per partition, where each replica copy would roll back to if it streamed from the
    active copy now (the producer rule, docs/protocol.md §4.2); absent when it would not."""
    from upr_cli.failover import FailoverLog, needs_rollback

    out: dict[int, dict[str, int]] = {}
    for p, st, act in _copies(statuses, ("replica", "pending")):
        start = st.persisted.get(p, 0)
        s0, s1 = st.snaps.get(p, (start, start))
        if not s0 <= start <= s1:
            s0 = s1 = start
        decision = needs_rollback(
            FailoverLog.sanitised(tuple(act.logs.get(p, []))),
            StreamPosition(p, st.uuids.get(p, 0), start, s0, s1),
            high=act.highs.get(p, 0),
        )
        if decision.rollback:
            out.setdefault(p, {})[st.name] = decision.rollback_seq
    return out
