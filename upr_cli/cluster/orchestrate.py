"""Failover, rebalance and replication pauses: the orchestrator's side of formats/cluster.md §7.

The UPR design specification, "How ns_server performs failover": for every partition
active on the failed node, the replica with the highest persisted complete snapshot
becomes active with a new failover entry (at that snapshot), in one SET_VBUCKET; the map
is then republished and the remaining replicas re-stream from the new active, rolling
back as the producer rule says. A graceful failover first fences the old active (state
dead: no more writes; its streams send what it holds, then end), waits until the chosen
replica has persisted all of it, and promotes it without a failover entry.

The UPR design specification, "How ns_server performs a partition rebalance": a
partition moves to a new node as pending, streams from the old active until caught up,
the old active is set dead, the new node is promoted once it has persisted the old
active's last seq, and the map is republished (a client that met NOT_MY_VBUCKET
meanwhile retries with the map the answer carries). If the catch-up times out, the old
active is set active again (step 5). Every command carries the bucket CAS and the map
revision (control.push).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upr_cli.cluster import procs, spec
from upr_cli.cluster.control import NodeStatus, map_json, node_status, push, states_for
from upr_cli.cluster.procs import ClusterError
from upr_cli.cluster.spec import ClusterSpec, NodeSpec
from upr_cli.collections import CollectionsManifest
from upr_cli.errors import UprError, UsageError
from upr_cli.net.bootstrap import connect
from upr_cli.net.collections_manifest import newest, read_nodes, spread
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.messages import SetParam

POLL_S = 0.05
MOVE_CHUNK = 64  # partitions moved together in one rebalance step


@dataclass
class Report:
    """What a failover or rebalance did, for the CLI."""

    rev: int = 0
    promoted: dict[int, str] = field(default_factory=dict)  # partition → node
    entries: dict[int, tuple[int, int]] = field(default_factory=dict)  # new failover heads
    lost: list[int] = field(default_factory=list)  # partitions left without an active
    moved: dict[int, tuple[str, str]] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "rev": self.rev,
            "promoted": {str(p): n for p, n in sorted(self.promoted.items())},
            "failover_entries": {str(p): {"uuid": str(u), "seq": str(s)}
                                 for p, (u, s) in sorted(self.entries.items())},
            "lost_partitions": self.lost,
            "moved": {str(p): {"from": a, "to": b} for p, (a, b) in sorted(self.moved.items())},
            "nodes_added": self.added, "nodes_removed": self.removed,
        }  # fmt: skip


class Orchestrator:
    """Drives one cluster (its DIR/cluster.json) through map changes."""

    def __init__(self, directory: Path, cl: ClusterSpec, *, timeout: float = 120.0,
                 progress: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.directory = directory
        self.cl = cl
        self.timeout = timeout
        self.progress = progress or (lambda _line: None)
        self.manifest: CollectionsManifest | None = (
            None  # given to nodes by `publish` (load_manifest)
        )

    # -- reading and publishing ---------------------------------------------------------

    async def statuses(self) -> list[NodeStatus]:
        """Every node as it answers now (in map order)."""
        return list(await asyncio.gather(*(node_status(self.cl, n) for n in self.cl.nodes)))

    def _reachable(self, node: NodeSpec) -> bool:
        return node.adopted or procs.alive(node.pid)

    async def publish(self, states: dict[int, dict[int, str]], *,
                      failover: dict[int, set[int]] | None = None,
                      first: Iterable[int] = ()) -> None:  # fmt: skip
        """A new map revision of `cl.vbmap` to every reachable node with its states;
        nodes in `first` get it first (promotions before the others re-stream)."""
        cl = self.cl
        cl.rev += 1
        spec.save(self.directory, cl)
        config = map_json(cl, cl.vbmap, cl.rev)
        first = list(first)
        order = first + [i for i in range(len(cl.nodes)) if i not in first]
        for i in order:
            node = cl.nodes[i]
            if not self._reachable(node):
                continue
            want = states.get(i, {})
            try:
                await push(cl, node, config, want, failover=(failover or {}).get(i, set()),
                           full=self.member_states(i), manifest=self.manifest)  # fmt: skip
            except (UprError, OSError) as exc:
                if want and i in first:
                    raise
                self.progress(f"node {node.name}: map revision {cl.rev} not delivered: {exc}")

    async def set_states(self, index: int, states: dict[int, str]) -> None:
        """State changes on one node under the current map revision."""
        cl = self.cl
        await push(cl, cl.nodes[index], map_json(cl, cl.vbmap, cl.rev), states,
                   full=self.member_states(index))  # fmt: skip

    def _running(self) -> tuple[list[int], list[SourceUri]]:
        cl = self.cl
        running = [i for i, n in enumerate(cl.nodes) if self._reachable(n)]
        return running, [SourceUri.parse(cl.uri(cl.nodes[i])) for i in running]

    async def load_manifest(self) -> None:
        """Learn the newest collections manifest a running node holds: `publish` gives
        it to every node it reaches that holds an older one."""
        self.manifest = newest(await read_nodes(self._running()[1]))

    async def share_manifest(self, targets: Iterable[int]) -> None:
        """Give the nodes `targets` the newest collections manifest any running node
        holds, when theirs is older (formats/cluster.md "Collections")."""
        running, uris = self._running()
        want = {running.index(i) for i in targets if i in running}
        if want:
            await spread(uris, want)

    def member_states(self, index: int) -> dict[int, str]:
        """What a node must hold under the current map (all dead when not a member)."""
        if not self.cl.nodes[index].member:
            return dict.fromkeys(range(self.cl.partitions), "dead")
        return states_for(self.cl.vbmap, index)

    async def wait(self, what: str, done: Callable[[list[NodeStatus]], bool]) -> list[NodeStatus]:
        """Poll the nodes until `done` holds; ClusterError after the timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            sts = await self.statuses()
            if done(sts):
                return sts
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {self.timeout:g}s waiting for {what}")
            await asyncio.sleep(POLL_S)

    # -- failover -------------------------------------------------------------------

    async def failover(self, name: str, *, graceful: bool, to: str | None = None) -> Report:
        """Fail a node over (see the module docstring); `to` forces the promoted node."""
        cl = self.cl
        x = cl.index(name)
        if not cl.nodes[x].member:
            raise UsageError(f"node {name} is not in the map (already failed over or removed)")
        forced = cl.index(to) if to is not None else None
        sts = await self.statuses()
        if graceful and not sts[x].up:
            raise UsageError(f"node {name} is down: a graceful failover needs it (omit --graceful)")
        report = Report()
        chosen: dict[int, int] = {}
        for p, row in enumerate(cl.vbmap):
            if not row or row[0] != x:
                continue
            cands = [i for i in row[1:] if i != x and sts[i].up
                     and sts[i].roles.get(p) in ("replica", "pending")]  # fmt: skip
            if forced is not None:
                cands = [i for i in cands if i == forced]
            if not cands:
                report.lost.append(p)
                continue
            # the replica with the highest persisted complete snapshot (formats/cluster.md §7;
            # the UPR design specification, "How ns_server performs failover")
            chosen[p] = max(cands, key=lambda i: (sts[i].complete[p], sts[i].persisted[p]))
        if graceful and report.lost:
            raise UsageError(
                f"partitions {report.lost} have no replica to take over from {name}: a "
                "graceful failover would leave them unavailable (rebalance first)"
            )
        if graceful and chosen:
            await self.set_states(x, dict.fromkeys(chosen, "dead"))  # fence: no more writes
            target = {p: (await self.statuses())[x].highs[p] for p in chosen}
            self.progress(f"waiting for {len(chosen)} partitions to catch up")
            # a complete snapshot through it (formats/cluster.md §5: a replica's persisted
            # seqs inside a snapshot are not a state the old active had)
            await self.wait("the replicas to persist the old active's last seqs", lambda s: all(
                s[i].complete.get(p, 0) >= target[p] for p, i in chosen.items()))  # fmt: skip
        elif sts[x].up:  # a hard failover of a live node: fence it first
            try:
                await self.set_states(x, dict.fromkeys(range(cl.partitions), "dead"))
            except (UprError, OSError) as exc:
                self.progress(f"node {name}: could not be fenced ({exc}); failing over anyway")
        for p, row in enumerate(cl.vbmap):
            if p in chosen:
                cl.vbmap[p] = [chosen[p]] + [i for i in row[1:] if i not in (x, chosen[p])]
            elif p in report.lost:
                cl.vbmap[p] = [-1] + [i for i in row[1:] if i != x]
            else:
                cl.vbmap[p] = [row[0]] + [i for i in row[1:] if i != x]
        cl.nodes[x].member = False
        promoted: dict[int, set[int]] = {}
        for p, i in chosen.items():
            promoted.setdefault(i, set()).add(p)
        await self.publish(
            {i: self.member_states(i) for i in range(len(cl.nodes))},
            failover={} if graceful else promoted, first=sorted(promoted),
        )  # fmt: skip
        report.rev = cl.rev
        report.promoted = {p: cl.nodes[i].name for p, i in chosen.items()}
        after = await self.statuses()
        report.entries = {p: after[i].heads.get(p, (0, 0)) for p, i in chosen.items()}
        return report

    # -- rebalance ------------------------------------------------------------------

    async def rebalance(
        self, add: list[NodeSpec], remove: list[str], readd: Sequence[str] = ()
    ) -> Report:
        """Add (or bring back) and remove nodes and balance the map, moving partitions one
        chunk at a time."""
        cl = self.cl
        report = Report()
        gone = {cl.index(n) for n in remove}
        for node in add:
            cl.nodes.append(node)
            report.added.append(node.name)
        for name in readd:
            cl.node(name).member = True
            report.added.append(name)
        spec.save(self.directory, cl)
        members = [i for i in cl.members() if i not in gone]
        if not members:
            raise UsageError("a rebalance must leave at least one node")
        # the collections manifest goes with the first map to the new nodes, before any
        # partition: a pending copy then streams documents into collections it knows
        await self.load_manifest()
        # new nodes learn the map (they stream from the actives it names)
        await self.publish({i: self.member_states(i) for i in range(len(cl.nodes))
                            if cl.nodes[i].name in report.added})  # fmt: skip
        target = plan(cl.vbmap, members, cl.replicas, cl.partitions)
        moves = [p for p in range(cl.partitions) if target[p][0] != cl.vbmap[p][0]]
        for k in range(0, len(moves), MOVE_CHUNK):
            chunk = moves[k : k + MOVE_CHUNK]
            await self._move(chunk, target, report)
        cl.vbmap = target
        for i in gone:
            cl.nodes[i].member = False
        await self.publish({i: self.member_states(i) for i in range(len(cl.nodes))})
        # the new replicas have begun streaming; wait until they hold what the actives held
        now = await self.statuses()
        await self.wait("the new replicas to catch up", lambda s: _caught_up(cl.vbmap, now, s))
        for i in gone:
            report.removed.append(cl.nodes[i].name)
            procs.stop_node(cl.nodes[i])
        spec.save(self.directory, cl)
        report.rev = cl.rev
        return report

    async def _move(self, chunk: list[int], target: list[list[int]], report: Report) -> None:
        """Steps 1-5 of "How ns_server performs a partition rebalance", for some partitions."""
        cl = self.cl
        sts = await self.statuses()
        news: dict[int, dict[int, str]] = {}
        olds: dict[int, dict[int, str]] = {}
        for p in chunk:
            old, new = cl.vbmap[p][0], target[p][0]
            if sts[new].roles.get(p) not in ("replica", "pending"):
                news.setdefault(new, {})[p] = "pending"  # 1. a pending copy streams from old
            olds.setdefault(old, {})[p] = "dead"
        for i, states in news.items():
            await self.set_states(i, states)
        self.progress(f"moving {len(chunk)} partitions: catching up")

        def lagging(s: list[NodeStatus], want: dict[int, int], persisted: bool) -> bool:
            for p in chunk:
                # persisted: the last complete snapshot persisted (formats/cluster.md §5)
                have = s[target[p][0]].complete if persisted else s[target[p][0]].highs
                if have.get(p, 0) < want[p]:
                    return True
            return False

        # 2. caught up with what the old active held when this step began (writes go on)
        now = await self.statuses()
        want = {p: now[cl.vbmap[p][0]].highs.get(p, 0) for p in chunk}
        await self.wait("the new copies to catch up", lambda s: not lagging(s, want, False))
        for i, states in olds.items():
            await self.set_states(i, states)  # 3. the old actives take no more writes
        now = await self.statuses()
        final = {p: now[cl.vbmap[p][0]].highs.get(p, 0) for p in chunk}  # frozen now
        try:
            await self.wait(
                "the new copies to persist everything", lambda s: not lagging(s, final, True)
            )
        except ClusterError:
            for i, states in olds.items():  # 5. give the partitions back to the old actives
                await self.set_states(i, dict.fromkeys(states, "active"))
            raise
        promote: dict[int, dict[int, str]] = {}
        for p in chunk:
            promote.setdefault(target[p][0], {})[p] = "active"
        for i, states in promote.items():
            await self.set_states(i, states)  # 4. the new node is active (no failover entry)
        for p in chunk:
            old, new = cl.vbmap[p][0], target[p][0]
            cl.vbmap[p] = [new] + [old] + [i for i in cl.vbmap[p][1:] if i not in (old, new)]
            report.moved[p] = (cl.nodes[old].name, cl.nodes[new].name)
        # the old copies become replicas of the new actives until the final map says otherwise
        await self.publish({i: self.member_states(i) for i in range(len(cl.nodes))},
                           first=sorted(promote))  # fmt: skip

    # -- replication pauses --------------------------------------------------------

    async def pause(self, name: str, partitions: list[int] | None, after: int | None,
                    *, resume: bool = False) -> list[int]:  # fmt: skip
        """Pause (or resume) replication into a node; returns the partitions affected."""
        import json

        node = self.cl.node(name)
        s = await connect(SourceUri.parse(self.cl.uri(node)), name="upr-cluster")
        try:
            value = json.dumps({"partitions": partitions, "after": after}).encode()
            what = "replication_resume" if resume else "replication_pause"
            resp = await s.conn.request(SetParam(name=what, value=value,
                                                 opaque=s.conn.next_opaque()))  # fmt: skip
            return [int(v) for v in json.loads(getattr(resp, "value", b"[]") or b"[]")]
        finally:
            await s.conn.aclose()


def _caught_up(vbmap: list[list[int]], then: list[NodeStatus], sts: list[NodeStatus]) -> bool:
    """Every replica holds what its active held `then`."""
    for p, row in enumerate(vbmap):
        if not row or row[0] < 0 or not then[row[0]].up:
            continue
        high = then[row[0]].highs.get(p, 0)
        for i in row[1:]:
            if sts[i].up and sts[i].highs.get(p, 0) < high:
                return False
    return True


def plan(current: list[list[int]], members: list[int], replicas: int,
         partitions: int) -> list[list[int]]:  # fmt: skip
    """A balanced map over `members` that keeps as many current placements as it can:
    at most ceil(P/N) actives and ceil(P·R/N) replicas per node."""
    n = len(members)
    r = min(replicas, n - 1)
    cap_a, cap_r = math.ceil(partitions / n), math.ceil(partitions * r / n) if r else 0
    act = dict.fromkeys(members, 0)
    rep = dict.fromkeys(members, 0)
    rows: list[list[int]] = [[] for _ in range(partitions)]
    cur = [row if row else [-1] for row in current] + [[-1]] * (partitions - len(current))
    for p in range(partitions):
        a = cur[p][0]
        if a in act and act[a] < cap_a:
            rows[p], act[a] = [a], act[a] + 1
    for p in range(partitions):
        if not rows[p]:  # prefer a node holding a replica already (no full copy needed)
            a = min(members, key=lambda m: (act[m], m not in cur[p][1:], (m - p) % n))
            rows[p], act[a] = [a], act[a] + 1
    for p in range(partitions):
        keep = [i for i in cur[p][1:] if i in rep and i != rows[p][0] and rep[i] < cap_r][:r]
        for i in keep:
            rep[i] += 1
        while len(keep) < r:
            m = min((m for m in members if m != rows[p][0] and m not in keep),
                    key=lambda m: (rep[m], (m - p) % n))  # fmt: skip
            keep.append(m)
            rep[m] += 1
        rows[p] += keep
    # even out: move replicas from the fullest node to the emptiest where that is allowed
    while r and max(rep.values()) - min(rep.values()) > 1:
        hi = max(members, key=lambda m: rep[m])
        lo = min(members, key=lambda m: rep[m])
        row = next((row for row in rows if hi in row[1:] and lo not in row), None)
        if row is None:
            break
        row[row.index(hi)] = lo
        rep[hi], rep[lo] = rep[hi] - 1, rep[lo] + 1
    return rows
