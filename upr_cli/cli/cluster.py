"""`upr cluster …`: several `upr serve` nodes on one machine under one cluster map."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from upr_cli.cli.options import JsonOutput
from upr_cli.cli.output import print_json, stderr, stdout
from upr_cli.cluster.control import NodeStatus
from upr_cli.cluster.orchestrate import Orchestrator, Report
from upr_cli.cluster.spec import ClusterSpec
from upr_cli.errors import UsageError

HELP = """Run a cluster of upr serve nodes on loopback, under one cluster map.

The map (formats/cluster.md) gives each partition an active node and R replica nodes,
balanced; every node holds it, serves it through GET_CLUSTER_CONFIG and attaches it to
NOT_MY_VBUCKET answers. State changes carry the bucket CAS of seed 000 and the map
revision, so a stale or superseded orchestrator is refused. The cluster's nodes,
ports and credentials are kept in DIR/cluster.json (mode 0600).

Each replica partition is fed by a DCP stream from its active node, opened by the
replica's node (formats/cluster.md §5). `failover` promotes replicas (a new failover
entry at the last complete snapshot they persisted), `rebalance` adds and removes nodes
while writes continue, `pause`/`resume` hold replication into a node (to stage the
seed's walkthrough), `status` shows states, lag, failover heads and map revisions.

Example:

  upr cluster init --nodes 3 --replicas 1 --data /tmp/cl --partitions 64
  upr cluster status --data /tmp/cl
  upr cluster failover n0 --data /tmp/cl
  upr cluster rebalance --add new --data /tmp/cl
  upr cluster stop --data /tmp/cl
"""

app = typer.Typer(name="cluster", help=HELP, no_args_is_help=True)
Data = Annotated[Path, typer.Option("--data", help="The cluster's directory.")]


def register(root: typer.Typer) -> None:
    """Add the `cluster` command group to the app."""
    root.add_typer(app, name="cluster")


@app.command(
    "init",
    no_args_is_help=True,
    help="""Start N nodes and give them one map.

Each node gets DIR/nK for its data (its log in DIR/nK/serve.log) and a loopback port
(--base-port, or free ones). Partition p is active on node p mod N and has replicas on
the next R nodes. --adopt URI (repeatable) takes running `upr serve` nodes instead:
they must share one user, password and bucket (replicas stream from their actives with
those credentials); `stop` and `start` leave adopted nodes alone.

Example:

  upr cluster init --nodes 3 --replicas 1 --data /tmp/cl --partitions 64 --base-port 12000
  upr cluster init --adopt upr://admin@127.0.0.1:11210/default \\
      --adopt upr://admin@127.0.0.1:11211/default --replicas 1 --data /tmp/cl
""",
)
def init_cmd(
    data: Data,
    nodes: Annotated[
        int | None, typer.Option("--nodes", min=1, max=64, help="Nodes to start.")
    ] = None,
    adopt: Annotated[
        list[str] | None,
        typer.Option("--adopt", help="A running node to adopt instead (URI, repeatable)."),
    ] = None,
    replicas: Annotated[
        int, typer.Option("--replicas", min=0, max=3, help="Replicas per partition.")
    ] = 1,
    partitions: Annotated[
        int, typer.Option("--partitions", min=1, max=1024, help="Partitions.")
    ] = 64,
    base_port: Annotated[
        int | None,
        typer.Option("--base-port", min=1024, max=65000, help="Port of node 0 (then +1, …)."),
    ] = None,
    bucket: Annotated[str, typer.Option("--bucket", help="Bucket name.")] = "default",
    json_out: JsonOutput = False,
) -> None:
    """Create a cluster."""
    from upr_cli.cluster import procs, spec
    from upr_cli.cluster.control import balanced_map, map_json, push, states_for

    if (data / spec.CLUSTER_FILE).exists():
        raise UsageError(f"{data}: a cluster exists here (use `upr cluster start`)")
    if (nodes is None) == (not adopt):
        raise UsageError("give --nodes N (start new nodes) or --adopt URI… (running nodes)")
    if adopt:
        cl = asyncio.run(_adopted(adopt, replicas))
        nodes, partitions, bucket = len(cl.nodes), cl.partitions, cl.bucket
    else:
        assert nodes is not None
        cl = spec.ClusterSpec(bucket, partitions, replicas, "admin", spec.new_password())
        for i in range(nodes):
            port = 0 if base_port is None else base_port + i
            cl.nodes.append(spec.NodeSpec(f"n{i}", port, str(data / f"n{i}")))
    if replicas >= nodes:
        raise UsageError(f"--replicas {replicas} needs at least {replicas + 1} nodes")
    data.mkdir(parents=True, exist_ok=True)
    try:
        for node in cl.nodes:
            if not node.adopted:
                procs.start_node(cl, node)
            spec.save(data, cl)
        vbmap = balanced_map(partitions, nodes, replicas)
        cl.rev, cl.vbmap = 1, vbmap
        config = map_json(cl, vbmap, cl.rev)
        for i, node in enumerate(cl.nodes):
            want = states_for(vbmap, i)
            asyncio.run(push(cl, node, config, want, full=want))
        spec.save(data, cl)
    except BaseException:
        for node in cl.nodes:
            procs.stop_node(node)
        spec.save(data, cl)
        raise
    _show(cl, json_out, f"cluster of {nodes} nodes, {partitions} partitions, {replicas} "
                        f"replicas, map revision {cl.rev}")  # fmt: skip


async def _adopted(uris: list[str], replicas: int) -> ClusterSpec:
    """A cluster of running nodes: one bucket, partition count and set of credentials."""
    from upr_cli.cluster import spec
    from upr_cli.net.bootstrap import connect
    from upr_cli.net.uri import SourceUri

    parsed = [SourceUri.parse(u) for u in uris]
    first = parsed[0]
    for u in parsed:
        if u.host not in ("127.0.0.1", "localhost"):
            raise UsageError(f"--adopt {u.redacted()}: only loopback nodes are supported")
        if u.seeds:
            raise UsageError(f"--adopt {u.redacted()}: one node per URI")
        if (u.username, u.password, u.bucket) != (first.username, first.password, first.bucket):
            raise UsageError("--adopt: every node needs the same user, password and bucket")
    if not first.username or not first.bucket:
        raise UsageError("--adopt: the URIs need a user and a bucket (upr://user@host:port/b)")
    counts = set()
    for u in parsed:
        s = await connect(u, name="upr-cluster")
        counts.add(s.num_partitions)
        await s.conn.aclose()
    if len(counts) != 1:
        raise UsageError(f"--adopt: the nodes have different partition counts {sorted(counts)}")
    cl = spec.ClusterSpec(first.bucket, counts.pop(), replicas, first.username,
                          first.password or "")  # fmt: skip
    cl.nodes = [spec.NodeSpec(f"n{i}", u.port, adopted=True) for i, u in enumerate(parsed)]
    return cl


@app.command(
    "start",
    no_args_is_help=True,
    help="""Start the cluster's stopped nodes.

Each node comes back on its port with its data, partition states and map, its
front-end traffic off (data requests answer ETMPFAIL; clients retry) until it has been
given the current map and states; then its traffic is turned on (seed 000). A member
found waiting that way (started some other way) is given them too.

Example:

  upr cluster start --data /tmp/cl
""",
)
def start_cmd(data: Data, json_out: JsonOutput = False) -> None:
    """Start the nodes."""
    from upr_cli.cluster import procs, spec

    cl = spec.load(data)
    started = []
    for i, node in enumerate(cl.nodes):
        if not node.adopted and not procs.alive(node.pid):
            procs.start_node(cl, node)
            spec.save(data, cl)
            started.append(i)
    if cl.vbmap:
        # a node restarts in the states it persisted, its traffic off (seed 000): give it
        # the current map and states (a failed-over node holds nothing any more), then
        # traffic on; so too for one started some other way and still waiting
        orch = Orchestrator(data, cl)
        waiting = [i for i, st in enumerate(asyncio.run(orch.statuses()))
                   if st.up and not st.traffic and i not in started]  # fmt: skip
        if started or waiting:
            asyncio.run(orch.publish({i: orch.member_states(i) for i in started + waiting}))
    _show(cl, json_out, f"started {len(started)} nodes")


@app.command(
    "stop",
    no_args_is_help=True,
    help="""Stop the cluster's nodes cleanly (SIGTERM).

Example:

  upr cluster stop --data /tmp/cl
""",
)
def stop_cmd(data: Data, json_out: JsonOutput = False) -> None:
    """Stop the nodes."""
    from upr_cli.cluster import procs, spec

    cl = spec.load(data)
    stopped = sum(procs.stop_node(node) for node in cl.nodes)
    spec.save(data, cl)
    _show(cl, json_out, f"stopped {stopped} nodes")


@app.command(
    "status",
    no_args_is_help=True,
    help="""Show nodes, partition states, replica lag, failover logs and map revisions.

Per node: whether it answers, the map revision it holds, partitions per state and the
worst replica lag (seqs behind the active copy). With --logs, every copy's failover log
and its last complete snapshot. A replica whose history left its active's (it would
roll back if it streamed now, dcp-wire §4.2) is listed with its rollback point. --json
gives all of it per partition.

Example:

  upr cluster status --data /tmp/cl --logs
  upr cluster status --data /tmp/cl --json
""",
)
def status_cmd(
    data: Data,
    logs: Annotated[
        bool, typer.Option("--logs", help="Every copy's failover log (dead ones too in JSON).")
    ] = False,
    json_out: JsonOutput = False,
) -> None:
    """Show the cluster."""
    from upr_cli.cluster import spec
    from upr_cli.cluster.control import lag, node_status, rollback_points

    cl = spec.load(data)

    async def gather() -> list[NodeStatus]:
        return list(await asyncio.gather(*(node_status(cl, n) for n in cl.nodes)))

    statuses = asyncio.run(gather())
    lags = lag(statuses)
    rollbacks = rollback_points(statuses)
    if json_out:
        pids = {n.name: n.pid for n in cl.nodes}
        print_json({
            "bucket": cl.bucket, "partitions": cl.partitions, "replicas": cl.replicas,
            "rev": cl.rev, "map": cl.vbmap,
            "nodes": [{"name": s.name, "port": s.port, "pid": pids.get(s.name), "up": s.up,
                       "traffic": s.traffic, "error": s.error, "rev": s.rev, "states": s.states,
                       "replication": s.replication,
                       "partitions": {str(p): {
                           "state": s.roles[p], "high_seqno": s.highs.get(p, 0),
                           "persisted_seqno": s.persisted.get(p, 0),
                           "complete_snapshot_seqno": s.complete.get(p, 0),
                           "failover_log": [{"uuid": str(u), "seq": q}
                                            for u, q in s.logs.get(p, [])],
                       } for p in sorted(s.roles) if logs or s.roles[p] != "dead"}}
                      for s in statuses],
            "lag": {str(p): v for p, v in sorted(lags.items())},
            "rollback_points": {str(p): v for p, v in sorted(rollbacks.items())},
        })  # fmt: skip
        return
    table = Table(title=f"cluster {data} (bucket {cl.bucket}, map revision {cl.rev})")
    for col in ("node", "port", "up", "map rev", "active", "replica", "dead", "max lag"):
        table.add_column(col, justify="right")
    for s in statuses:
        worst = max((v.get(s.name, 0) for v in lags.values()), default=0)
        up = ("yes" if s.traffic else "yes, traffic off") if s.up else f"no: {s.error}"
        table.add_row(s.name, str(s.port), up,
                      str(s.rev), *(str(s.states.get(k, 0)) for k in ("active", "replica", "dead")),
                      str(worst))  # fmt: skip
    stdout.print(table)
    if logs:
        for s in statuses:
            for p in sorted(s.roles):
                if s.roles[p] == "dead":
                    continue
                entries = ", ".join(f"{u:x}@{q}" for u, q in s.logs.get(p, []))
                stdout.print(f"{s.name} partition {p} ({s.roles[p]}, high {s.highs.get(p, 0)}, "
                             f"complete snapshot {s.complete.get(p, 0)}): failover log "
                             f"[{entries}]", markup=False, highlight=False)  # fmt: skip
    for p, per in sorted(rollbacks.items()):
        for name, seq in sorted(per.items()):
            stdout.print(f"{name} partition {p}: would roll back to {seq} against its active",
                         markup=False, highlight=False)  # fmt: skip


@app.command(
    "env",
    no_args_is_help=True,
    help="""Print shell lines that export the cluster's URIs and password.

UPR_PASSWORD is the nodes' password (upr reads it when a URI has none), and UPR_N0,
UPR_N1, … are the nodes' URIs without it. For scripts and demos:

  eval "$(upr cluster env --data /tmp/cl)"
  upr tail "$UPR_N1" --until-end
""",
)
def env_cmd(data: Data) -> None:
    """Print the cluster's environment."""
    import shlex

    from upr_cli.cluster import spec

    cl = spec.load(data)
    print(f"export UPR_PASSWORD={shlex.quote(cl.password)}")
    for n in cl.nodes:
        uri = f"upr://{cl.user}@127.0.0.1:{n.port}/{cl.bucket}"
        print(f"export UPR_{n.name.upper()}={shlex.quote(uri)}")


Timeout = Annotated[
    float, typer.Option("--timeout", min=1.0, help="Seconds to wait for a catch-up step.")
]


@app.command(
    "failover",
    no_args_is_help=True,
    help="""Fail a node over: its active partitions move to their replicas.

Hard (default; works when NODE is dead): for each partition active on NODE, the replica
with the highest persisted complete snapshot becomes active with a new failover entry at
that snapshot (seed 000); the other replicas re-stream from it and roll back as the
producer rule says. --graceful (NODE must be up) first stops writes on NODE, lets the
replicas persist everything, and promotes without a failover entry. NODE leaves the
map; `upr cluster rebalance` brings capacity back.

Example:

  upr cluster failover n0 --data /tmp/cl
  upr cluster failover n1 --graceful --data /tmp/cl --json
""",
)
def failover_cmd(
    data: Data,
    node: Annotated[str, typer.Argument(help="The node to fail over (n0, n1, …).")],
    graceful: Annotated[
        bool, typer.Option("--graceful", help="Let the replicas catch up first.")
    ] = False,
    to: Annotated[
        str | None,
        typer.Option("--to", help="Promote this node's replicas (staging; default: the best)."),
    ] = None,
    timeout: Timeout = 120.0,
    json_out: JsonOutput = False,
) -> None:
    """Fail a node over."""
    from upr_cli.cluster import spec

    cl = spec.load(data)
    orch = Orchestrator(data, cl, timeout=timeout, progress=_progress(json_out))
    report = asyncio.run(orch.failover(node, graceful=graceful, to=to))
    _report(report, json_out, f"failed over {node}: {len(report.promoted)} partitions promoted")


@app.command(
    "rebalance",
    help="""Add and remove nodes, then balance the map while writes continue.

--add new starts a fresh node (DIR/nK); --add NAME brings back a node that was failed
over or removed (started if needed; its copies that diverged are rolled back or
streamed again); --add URI adopts a running `upr serve` that accepts the cluster's
credentials. Each moving partition follows seed 000: a pending
copy on the new node streams from the old active until caught up, the old active is
set dead, the new one becomes active once it persisted everything, and the map is
republished (clients retry NOT_MY_VBUCKET with the map the answer carries). Removed
nodes are stopped once they hold nothing.

Example:

  upr cluster rebalance --add new --data /tmp/cl
  upr cluster rebalance --remove n2 --data /tmp/cl --json
""",
)
def rebalance_cmd(
    data: Data,
    add: Annotated[
        list[str] | None, typer.Option("--add", help="'new' or a node URI (repeatable).")
    ] = None,
    remove: Annotated[
        list[str] | None, typer.Option("--remove", help="A node to take out (repeatable).")
    ] = None,
    timeout: Timeout = 120.0,
    json_out: JsonOutput = False,
) -> None:
    """Rebalance the cluster."""
    from upr_cli.cluster import procs, spec
    from upr_cli.net.uri import SourceUri

    cl = spec.load(data)
    names = {n.name for n in cl.nodes}
    for name in remove or []:
        cl.node(name)
    added: list[spec.NodeSpec] = []
    readd: list[str] = []
    try:
        for item in add or []:
            k = len(cl.nodes) + len(added)
            while f"n{k}" in names:
                k += 1
            names.add(f"n{k}")
            known = next((n for n in cl.nodes if n.name == item), None)
            if known is not None:  # a failed-over or removed node comes back
                if known.member:
                    raise UsageError(f"--add {item}: the node is in the map already")
                if not known.adopted and not procs.alive(known.pid):
                    procs.start_node(cl, known)
                readd.append(item)
                continue
            if item == "new":
                node = spec.NodeSpec(f"n{k}", 0, str(data / f"n{k}"))
                procs.start_node(cl, node)
            else:
                uri = SourceUri.parse(item)
                if uri.host not in ("127.0.0.1", "localhost"):
                    raise UsageError(f"--add {uri.redacted()}: only loopback nodes are supported")
                if uri.seeds:
                    raise UsageError(f"--add {uri.redacted()}: one node per URI")
                node = spec.NodeSpec(f"n{k}", uri.port, adopted=True)
            added.append(node)
    except BaseException:
        for node in added:
            procs.stop_node(node)
        raise
    orch = Orchestrator(data, cl, timeout=timeout, progress=_progress(json_out))
    report = asyncio.run(orch.rebalance(added, list(remove or []), readd=readd))
    line = (
        f"rebalanced: {len(report.moved)} partitions moved, "
        f"{len(report.added)} nodes added, {len(report.removed)} removed"
    )
    _report(report, json_out, line)


Partitions = Annotated[
    str | None,
    typer.Option("--partitions", help="Partitions, e.g. 0-3,7 (default: all of the node's)."),
]


@app.command(
    "pause",
    no_args_is_help=True,
    help="""Pause replication into a node (for staging failures).

The node's replica partitions apply items up to seq --after (default: what they hold
now), then their streams close. `resume` reopens them from where they stand.

Example:

  upr cluster pause n1 --after 5 --partitions 0 --data /tmp/cl
""",
)
def pause_cmd(
    data: Data,
    node: Annotated[str, typer.Argument(help="The node whose replication pauses.")],
    after: Annotated[
        int | None, typer.Option("--after", min=0, help="Apply up to this seq first.")
    ] = None,
    partitions: Partitions = None,
    json_out: JsonOutput = False,
) -> None:
    """Pause replication."""
    _pause(data, node, partitions, after, json_out, resume=False)


@app.command(
    "resume",
    no_args_is_help=True,
    help="""Resume replication into a node.

Example:

  upr cluster resume n1 --data /tmp/cl
""",
)
def resume_cmd(
    data: Data,
    node: Annotated[str, typer.Argument(help="The node whose replication resumes.")],
    partitions: Partitions = None,
    json_out: JsonOutput = False,
) -> None:
    """Resume replication."""
    _pause(data, node, partitions, None, json_out, resume=True)


def _pause(data: Path, node: str, partitions: str | None, after: int | None, json_out: bool,
           *, resume: bool) -> None:  # fmt: skip
    from upr_cli.cluster import spec
    from upr_cli.jobs.tail import parse_partitions

    cl = spec.load(data)
    vbs = None if partitions is None else parse_partitions(partitions)
    orch = Orchestrator(data, cl)
    done = asyncio.run(orch.pause(node, vbs, after, resume=resume))
    if json_out:
        print_json({"node": node, "resumed" if resume else "paused": done, "after": after})
    else:
        what = "resumed" if resume else "paused"
        stdout.print(f"{node}: replication {what} for {len(done)} partitions", markup=False)


def _progress(json_out: bool) -> Callable[[str], None]:
    def say(line: str) -> None:
        if not json_out:
            stderr.print(line, markup=False, highlight=False)

    return say


def _report(report: Report, json_out: bool, line: str) -> None:
    if json_out:
        print_json(report.to_json())
        return
    stdout.print(f"{line} (map revision {report.rev})", markup=False, highlight=False)
    for p, (uuid, seq) in sorted(report.entries.items()):
        stdout.print(f"  partition {p}: active on {report.promoted[p]}, failover entry "
                     f"{uuid:x} at seq {seq}", markup=False, highlight=False)  # fmt: skip
    if report.lost:
        stdout.print(f"  no replica left for partitions {report.lost}: they are unavailable",
                     markup=False, highlight=False)  # fmt: skip


def _show(cl: ClusterSpec, json_out: bool, line: str) -> None:
    if json_out:
        print_json(cl.to_json() | {"password": "***"})
    else:
        stdout.print(line, markup=False, highlight=False)
