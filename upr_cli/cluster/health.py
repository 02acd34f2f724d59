"""What `upr cluster status` reports: every node as it answers, and what is degraded.

A partition is unavailable when no answering node holds an active copy of it (clients
get no answer for its keys), and unreplicated when fewer answering nodes hold a replica
copy than the cluster's replica count (one more failure loses its newest writes). Each
degraded state comes with the command that repairs it, so that the operator does not
have to work it out from the map: a member that does not answer is failed over
(its replicas take over) or started again; a cluster short of replicas is rebalanced.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upr_cli.cluster import procs, spec
from upr_cli.cluster.control import NodeStatus, active_of, lag, node_status, rollback_points
from upr_cli.cluster.spec import ClusterSpec


@dataclass
class NodeHealth:
    """One node's line in the status: its state in a word or two, and why."""

    name: str
    port: int
    state: str  # up | traffic off | down | out | out, down
    reason: str = ""  # short: why a node is down
    member: bool = True
    adopted: bool = False
    pid: int | None = None
    tls_port: int | None = None  # its TLS data port (uprs://), when it serves one


@dataclass
class ClusterHealth:
    """The cluster file, every node's answer and the degraded partitions."""

    directory: Path
    cl: ClusterSpec
    statuses: list[NodeStatus]
    nodes: list[NodeHealth] = field(default_factory=list)
    lags: dict[int, dict[str, int]] = field(default_factory=dict)
    rollbacks: dict[int, dict[str, int]] = field(default_factory=dict)
    unavailable: list[int] = field(default_factory=list)  # no answering active copy
    unreplicated: list[int] = field(default_factory=list)  # fewer live replicas than set
    actions: list[tuple[str, str]] = field(default_factory=list)  # (why, command)

    @property
    def degraded(self) -> bool:
        """True when some partition is unavailable or unreplicated or a member is down."""
        return bool(self.unavailable or self.unreplicated or self.actions)

    def worst_lag(self, name: str) -> int:
        """The node's largest replica lag, in seqs."""
        return max((v.get(name, 0) for v in self.lags.values()), default=0)

    def to_json(self, *, logs: bool = False) -> dict[str, Any]:
        """Everything per node and per partition (dead copies only with `logs`)."""
        cl = self.cl
        return {
            "bucket": cl.bucket, "partition_count": cl.partitions, "replicas": cl.replicas,
            "rev": cl.rev, "map": cl.vbmap,
            "nodes": [_node_json(h, s, logs) for h, s in zip(self.nodes, self.statuses,
                                                              strict=True)],
            "lag": {str(p): v for p, v in sorted(self.lags.items())},
            "rollback_points": {str(p): v for p, v in sorted(self.rollbacks.items())},
            "unavailable": self.unavailable,
            "unreplicated": self.unreplicated,
            "actions": [{"why": why, "command": cmd} for why, cmd in self.actions],
        }  # fmt: skip


def _node_json(h: NodeHealth, s: NodeStatus, logs: bool) -> dict[str, Any]:
    parts = [  # one object a partition, with its `partition` (docs/output.md)
        {
            "partition": p,
            "state": s.roles[p],
            # 64-bit seqs as decimal strings (docs/output.md)
            "high_seqno": str(s.highs.get(p, 0)),
            "persisted_seqno": str(s.persisted.get(p, 0)),
            "complete_snapshot_seqno": str(s.complete.get(p, 0)),
            "failover_log": [{"uuid": str(u), "seq": str(q)} for u, q in s.logs.get(p, [])],
        }
        for p in sorted(s.roles)
        if logs or s.roles[p] != "dead"
    ]
    return {
        "name": s.name, "port": s.port, "tls_port": h.tls_port, "pid": h.pid, "state": h.state,
        "member": h.member,
        "up": s.up, "traffic": s.traffic, "reason": h.reason, "error": s.error,
        "rev": s.rev, "states": s.states, "replication": _replication(s.replication),
        "partitions": parts,
        "manifest_uid": str(s.manifest_uid) if s.manifest_uid is not None else None,
    }  # fmt: skip


def _replication(rep: dict[str, Any]) -> dict[str, Any]:
    """A node's replication stats as --json gives them (docs/output.md): a partition's
    pause point a decimal string, under names no other command types otherwise."""
    return {
        "links": rep.get("links", {}),
        "paused_after": {p: str(seq) for p, seq in rep.get("paused", {}).items()},
        "link_errors": rep.get("errors", {}),
    }


def gather(directory: Path) -> ClusterHealth:
    """Ask every node of the cluster in `directory` at once and judge the answers."""
    cl = spec.load(directory)

    async def ask() -> list[NodeStatus]:
        return list(await asyncio.gather(*(node_status(cl, n) for n in cl.nodes)))

    return judge(directory, cl, asyncio.run(ask()))


def judge(directory: Path, cl: ClusterSpec, statuses: list[NodeStatus]) -> ClusterHealth:
    """The health of a cluster from its nodes' answers (no I/O: tests feed it)."""
    h = ClusterHealth(directory, cl, statuses)
    h.lags = lag(statuses)
    h.rollbacks = rollback_points(statuses)
    for node, st in zip(cl.nodes, statuses, strict=True):
        if node.member:
            state = ("up" if st.traffic else "traffic off") if st.up else "down"
        else:
            state = "out" if st.up else "out, down"
        reason = "" if st.up else st.reason
        if not st.up and not node.adopted and not procs.alive(node.pid):
            reason = "not running"  # more telling than the refused connection
        h.nodes.append(NodeHealth(node.name, node.port, state, reason, node.member,
                                  node.adopted, node.pid, node.tls_port))  # fmt: skip
    live = [st for st in statuses if st.up]
    for p in range(cl.partitions):
        if not any(st.roles.get(p) == "active" for st in live):
            h.unavailable.append(p)
        elif sum(st.roles.get(p) == "replica" for st in live) < cl.replicas:
            h.unreplicated.append(p)
    h.actions = _actions(h)
    return h


def _actions(h: ClusterHealth) -> list[tuple[str, str]]:
    """(why, command) pairs that repair what is degraded, most urgent first."""
    cl, d = h.cl, h.directory
    out: list[tuple[str, str]] = []
    down = [n for n in h.nodes if n.member and n.state == "down"]
    for n in down:
        held = sum(active_of(row) == cl.index(n.name) for row in cl.vbmap)
        why = f"its replicas take over its {held} partitions" if held else "it leaves the map"
        out.append((f"fail {n.name} over: {why}", f"upr cluster failover {n.name} --data {d}"))
    stopped = [n.name for n in down if n.reason == "not running"]
    if stopped:
        out.append((f"or start {', '.join(stopped)} again", f"upr cluster start --data {d}"))
    waiting = [n.name for n in h.nodes if n.state == "traffic off"]
    if waiting:
        out.append((f"give {', '.join(waiting)} the map", f"upr cluster start --data {d}"))
    if h.unavailable and not down:
        lost = ranges(h.unavailable, limit=8)
        why = f"no live node holds partitions {lost}: bring back a node that held them"
        out.append((why, f"upr cluster rebalance --add NODE --data {d}"))
    uids = {st.name: st.manifest_uid for node, st in zip(cl.nodes, h.statuses, strict=True)
            if node.member and st.up and st.manifest_uid is not None}  # fmt: skip
    if len(set(uids.values())) > 1:
        listed = ", ".join(f"{name} uid {uid}" for name, uid in uids.items())
        out.append((f"the nodes hold different collections manifests ({listed}): give every "
                    "node the newest", f"upr cluster start --data {d}"))  # fmt: skip
    if h.unreplicated:
        back = next((n.name for n in h.nodes if not n.member), "new")
        out.append(("add a node to restore the replicas",
                    f"upr cluster rebalance --add {back} --data {d}"))  # fmt: skip
    return out


def ranges(parts: list[int], *, limit: int = 0) -> str:
    """`0-3,7,9` (the --partitions syntax); with `limit`, the first `limit` runs and
    "… N more" for the rest."""
    runs: list[tuple[int, int]] = []
    for p in sorted(parts):
        if runs and p == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    text = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    if limit and len(text) > limit:
        shown = ",".join(text[:limit])
        rest = sum(b - a + 1 for a, b in runs[limit:])
        return f"{shown},… {rest} more"
    return ",".join(text)
