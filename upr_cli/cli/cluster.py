"""`upr cluster …`: several `upr serve` nodes on one machine under one cluster map."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from upr_cli.cli.options import JsonOutput
from upr_cli.cli.output import print_json, stdout
from upr_cli.cluster.control import NodeStatus
from upr_cli.cluster.spec import ClusterSpec
from upr_cli.errors import UsageError

HELP = """Run a cluster of upr serve nodes on loopback, under one cluster map.

The map (formats/cluster.md) gives each partition an active node and R replica nodes,
balanced; every node holds it, serves it through GET_CLUSTER_CONFIG and attaches it to
NOT_MY_VBUCKET answers. State changes carry the bucket CAS of seed 000 and the map
revision, so a stale or superseded orchestrator is refused. The cluster's nodes,
ports and credentials are kept in DIR/cluster.json (mode 0600).

Not yet: replication into the replica partitions, failover and rebalance (issue 7 in
progress); `status` shows each replica's lag behind its active copy.

Example:

  upr cluster init --nodes 3 --replicas 1 --data /tmp/cl --partitions 64
  upr cluster status --data /tmp/cl
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
the next R nodes.

Example:

  upr cluster init --nodes 3 --replicas 1 --data /tmp/cl --partitions 64 --base-port 12000
""",
)
def init_cmd(
    data: Data,
    nodes: Annotated[int, typer.Option("--nodes", min=1, max=64, help="Nodes to start.")],
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
    if replicas >= nodes:
        raise UsageError(f"--replicas {replicas} needs at least {replicas + 1} nodes")
    cl = spec.ClusterSpec(bucket, partitions, replicas, "admin", spec.new_password())
    for i in range(nodes):
        port = 0 if base_port is None else base_port + i
        cl.nodes.append(spec.NodeSpec(f"n{i}", port, str(data / f"n{i}")))
    data.mkdir(parents=True, exist_ok=True)
    try:
        for node in cl.nodes:
            procs.start_node(cl, node)
            spec.save(data, cl)
        vbmap = balanced_map(partitions, nodes, replicas)
        cl.rev = 1
        config = map_json(cl, vbmap, cl.rev)
        for i, node in enumerate(cl.nodes):
            asyncio.run(push(cl, node, config, states_for(vbmap, i)))
        spec.save(data, cl)
    except BaseException:
        for node in cl.nodes:
            procs.stop_node(node)
        spec.save(data, cl)
        raise
    _show(cl, json_out, f"cluster of {nodes} nodes, {partitions} partitions, {replicas} "
                        f"replicas, map revision {cl.rev}")  # fmt: skip


@app.command(
    "start",
    no_args_is_help=True,
    help="""Start the cluster's stopped nodes.

Each node comes back on its port with its data, partition states and map.

Example:

  upr cluster start --data /tmp/cl
""",
)
def start_cmd(data: Data, json_out: JsonOutput = False) -> None:
    """Start the nodes."""
    from upr_cli.cluster import procs, spec

    cl = spec.load(data)
    started = 0
    for node in cl.nodes:
        if not node.adopted and not procs.alive(node.pid):
            procs.start_node(cl, node)
            spec.save(data, cl)
            started += 1
    _show(cl, json_out, f"started {started} nodes")


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
    help="""Show nodes, partition states, replica lag
and the map revision each node holds.

Example:

  upr cluster status --data /tmp/cl --json
""",
)
def status_cmd(data: Data, json_out: JsonOutput = False) -> None:
    """Show the cluster."""
    from upr_cli.cluster import spec
    from upr_cli.cluster.control import lag, node_status

    cl = spec.load(data)

    async def gather() -> list[NodeStatus]:
        return list(await asyncio.gather(*(node_status(cl, n) for n in cl.nodes)))

    statuses = asyncio.run(gather())
    lags = lag(statuses)
    if json_out:
        print_json({
            "bucket": cl.bucket, "partitions": cl.partitions, "replicas": cl.replicas,
            "rev": cl.rev,
            "nodes": [{"name": s.name, "port": s.port, "up": s.up, "error": s.error,
                       "rev": s.rev, "states": s.states} for s in statuses],
            "lag": {str(p): v for p, v in sorted(lags.items())},
        })  # fmt: skip
        return
    table = Table(title=f"cluster {data} (bucket {cl.bucket}, map revision {cl.rev})")
    for col in ("node", "port", "up", "map rev", "active", "replica", "dead", "max lag"):
        table.add_column(col, justify="right")
    for s in statuses:
        worst = max((v.get(s.name, 0) for v in lags.values()), default=0)
        table.add_row(s.name, str(s.port), "yes" if s.up else f"no: {s.error}",
                      str(s.rev), *(str(s.states.get(k, 0)) for k in ("active", "replica", "dead")),
                      str(worst))  # fmt: skip
    stdout.print(table)


def _show(cl: ClusterSpec, json_out: bool, line: str) -> None:
    if json_out:
        print_json(cl.to_json() | {"password": "***"})
    else:
        stdout.print(line, markup=False, highlight=False)
