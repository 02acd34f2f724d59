"""`upr cluster …`: several `upr serve` nodes on one machine under one cluster map.

The commands parse options, call one function of `upr_cli.cluster.lifecycle` (or
`health.gather` for `status`) and render what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from upr_cli.cli.options import (
    AllRows,
    BucketName,
    JsonOutput,
    OldNumPartitions,
    deprecated_alias,
    either,
    num_partitions_option,
    partition_count,
)
from upr_cli.cli.output import first_rows, more_line, plural, print_json, stderr, stdout
from upr_cli.cli.output import table as house_table
from upr_cli.errors import UsageError

if TYPE_CHECKING:
    from upr_cli.cluster.health import ClusterHealth
    from upr_cli.cluster.orchestrate import Report
    from upr_cli.cluster.spec import ClusterSpec

HELP = """Run a cluster of upr serve nodes on loopback, under one cluster map.

The map (formats/cluster.md) gives each partition an active node and R replica nodes,
balanced; every node holds it, serves it through GET_CLUSTER_CONFIG and attaches it to
NOT_MY_VBUCKET answers. State changes carry the bucket CAS and the map revision, so a
stale or superseded orchestrator is refused. The cluster's nodes, ports and
credentials are kept in DIR/cluster.json (mode 0600).

Each replica partition is fed by a DCP stream from its active node, opened by the
replica's node (formats/cluster.md §5). `failover` promotes replicas (a new failover
entry at the last complete snapshot they persisted), `rebalance` adds and removes nodes
while writes continue, `pause`/`resume` hold replication into a node (to stage
failures), `status` shows states, lag, failover heads, map revisions and what is
degraded.

`init --tls-cert F --tls-key F` gives every node a TLS data port too, advertised as
kvSSL in the map so uprs:// clients stay on TLS; replication between the nodes stays
plain on loopback.

Example:

  upr cluster init --nodes 3 --replicas 1 --data /tmp/cl --num-partitions 64
  upr cluster status --data /tmp/cl
  upr cluster failover n0 --data /tmp/cl
  upr cluster rebalance --add new --data /tmp/cl
  upr cluster stop --data /tmp/cl
"""

app = typer.Typer(name="cluster", help=HELP, no_args_is_help=True)
Data = Annotated[Path, typer.Option("--data", metavar="DIR", help="The cluster's directory.")]
BasePort = Annotated[
    int | None,
    typer.Option("--base-port", min=1024, max=65000, metavar="PORT",
                 help="Port of node n0 (node nK gets PORT+K)."),
]  # fmt: skip

TlsCert = Annotated[
    Path | None,
    typer.Option("--tls-cert", metavar="FILE",
                 help="PEM certificate chain: every node serves a TLS data port (with "
                 "--tls-key; replication stays plain on loopback)."),
]  # fmt: skip
TlsKey = Annotated[
    Path | None, typer.Option("--tls-key", metavar="FILE", help="PEM private key of --tls-cert.")
]
TlsClientCa = Annotated[
    Path | None,
    typer.Option("--tls-client-ca", metavar="FILE",
                 help="PEM CA file: the nodes' TLS ports check client certificates; one whose "
                 "subject CN is admin logs in without a password."),
]  # fmt: skip
TlsClientAuth = Annotated[
    str | None,
    typer.Option("--tls-client-auth", metavar="MODE",
                 help="enable (default with --tls-client-ca) or mandatory."),
]  # fmt: skip


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
those credentials); `stop` and `start` leave adopted nodes alone. --partitions N is
the old name of --num-partitions (deprecated). --create-collections creates scopes
and collections on every node once the map is in place (as `upr collections create`
does; the newest manifest an adopted node holds is kept); --collections, its old
spelling, still works, with a warning.

--tls-cert and --tls-key start every node with a TLS data port beside its plain one
(any free port, kept across restarts; `status` lists them), as Couchbase serves 11207:
the map advertises each as kvSSL, so a client that connects with uprs:// to any node
reaches every node over TLS. The certificate must be valid for 127.0.0.1. Replication
between the nodes, and this command's own control connections, stay plain on
loopback: they never leave the machine. --tls-client-ca FILE (with --tls-client-auth
enable|mandatory) makes those TLS ports check client certificates as `upr serve` does:
one whose subject CN is admin, the cluster's user, logs in without a password.

Example:

  upr cluster init --nodes 3 --replicas 1 --data /tmp/cl --num-partitions 64
  upr cluster init --nodes 3 --data /tmp/cl \\
      --create-collections app.users,app.logs:86400
  upr cluster init --adopt upr://admin@127.0.0.1:11210/default \\
      --adopt upr://admin@127.0.0.1:11211/default --replicas 1 --data /tmp/cl

Example (a TLS cluster; clients use uprs:// with the CA that signed node.pem):

  upr cluster init --nodes 2 --data /tmp/cl --tls-cert node.pem --tls-key node.key
  eval "$(upr cluster env --data /tmp/cl)"
  upr tail "$UPR_N0_TLS" --cacert ca.pem --until-end
""",
)
def init_cmd(
    data: Data,
    nodes: Annotated[
        int | None, typer.Option("--nodes", min=1, max=64, metavar="N", help="Nodes to start.")
    ] = None,
    adopt: Annotated[
        list[str] | None,
        typer.Option("--adopt", metavar="URI", help="A running node to adopt (repeatable)."),
    ] = None,
    replicas: Annotated[
        int, typer.Option("--replicas", min=0, max=3, metavar="R", help="Replicas per partition.")
    ] = 1,
    num_partitions: Annotated[int | None, num_partitions_option(64)] = None,
    old_partitions: OldNumPartitions = None,
    base_port: BasePort = None,
    bucket: BucketName = "default",
    create_collections: Annotated[
        str | None,
        typer.Option(
            "--create-collections",
            metavar="SPEC",
            help="Create these on every node: SCOPE, SCOPE.COLLECTION or "
            "SCOPE.COLLECTION:MAXTTL, comma-separated.",
        ),
    ] = None,
    old_collections: Annotated[
        str | None, deprecated_alias("--collections", "--create-collections")
    ] = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_client_ca: TlsClientCa = None,
    tls_client_auth: TlsClientAuth = None,
    json_out: JsonOutput = False,
) -> None:
    """Create a cluster."""
    from upr_cli.cluster import lifecycle
    from upr_cli.net.collections_manifest import parse_specs

    partitions = partition_count(num_partitions, old_partitions, 64)
    specs = parse_specs(either(create_collections, old_collections, None,
                               ("--create-collections", "--collections")))  # fmt: skip
    if (tls_cert is None) != (tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
    cl = lifecycle.create(data, nodes=nodes, adopt=adopt or [], replicas=replicas,
                          partitions=partitions, base_port=base_port, bucket=bucket,
                          collections=specs, tls=tls,
                          client_ca=_client_ca(tls_client_ca, tls_client_auth))  # fmt: skip
    _show(cl, json_out, f"cluster of {plural(len(cl.nodes), 'node')}, "
                        f"{plural(cl.partitions, 'partition')}, "
                        f"{plural(cl.replicas, 'replica')}, map revision {cl.rev}")  # fmt: skip


def _client_ca(ca: Path | None, mode: str | None) -> tuple[Path, str] | None:
    """(CA file, mode) for the nodes' client certificates, checked as `upr serve` does."""
    if mode is not None and mode not in ("enable", "mandatory"):
        raise UsageError(f"--tls-client-auth: {mode!r} is not enable or mandatory")
    if ca is None:
        if mode is not None:
            raise UsageError("--tls-client-auth needs --tls-client-ca")
        return None
    return ca, mode or "enable"


@app.command(
    "start",
    no_args_is_help=True,
    help="""Start the cluster's stopped nodes.

Each node comes back on its port with its data, partition states and map, its
front-end traffic off (data requests answer ETMPFAIL; clients retry) until it has been
given the current map and states, and the newest collections manifest when it holds
an older one; then its traffic is turned on. A member found waiting that way (started
some other way) is given them too, and a running node that missed a collections
change is given the newest manifest.

Example:

  upr cluster start --data /tmp/cl
""",
)
def start_cmd(data: Data, json_out: JsonOutput = False) -> None:
    """Start the nodes."""
    from upr_cli.cluster import lifecycle

    cl, started = lifecycle.start(data)
    _show(cl, json_out, f"started {plural(started, 'node')}")


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
    from upr_cli.cluster import lifecycle

    cl, stopped = lifecycle.stop(data)
    _show(cl, json_out, f"stopped {plural(stopped, 'node')}")


@app.command(
    "status",
    no_args_is_help=True,
    help="""Show nodes, partition states, replica lag, failover logs and map revisions.

Per node: its state (up, traffic off, down, or out of the map after a failover or
removal; a down node with a short reason), the map revision and the collections
manifest uid it holds (nodes that disagree are listed with the repair), partitions per
state and the worst replica lag (seqs behind the active copy). Below: the partitions
that are unavailable (no live active copy) or unreplicated (fewer live replicas than
the cluster's count) and the commands that repair them. With --logs, every copy's
failover log and its last complete snapshot. A replica whose history left its
active's (it would roll back if it streamed now) is listed with its rollback point.
--json gives all of it per partition, with each error in full.

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
    from upr_cli.cluster import health

    h = health.gather(data)
    if json_out:
        print_json(h.to_json(logs=logs))
        return
    _status_table(h)
    if logs:
        _status_logs(h)
    for p, per in sorted(h.rollbacks.items()):
        for name, seq in sorted(per.items()):
            _line(f"{name} partition {p}: would roll back to {seq} against its active")
    _status_problems(h)


def _status_table(h: ClusterHealth) -> None:
    title = f"bucket {h.cl.bucket}, {len(h.nodes)} nodes, map revision {h.cl.rev}"
    table = house_table(title)  # no edges: nine columns fit 80
    cols = ("node", "port", "state", "map rev", "manifest", "active", "replica", "dead", "max lag")
    for col in cols:
        table.add_column(col, justify="left" if col in ("node", "state") else "right",
                         no_wrap=True)  # fmt: skip
    for n, s in zip(h.nodes, h.statuses, strict=True):
        counts = [str(s.states.get(k, 0)) if s.up else "-" for k in ("active", "replica", "dead")]
        uid = str(s.manifest_uid) if s.up and s.manifest_uid is not None else "-"
        table.add_row(n.name, str(n.port), n.state, str(s.rev) if s.up else "-", uid, *counts,
                      str(h.worst_lag(n.name)) if s.up else "-")  # fmt: skip
    stdout.print(table)
    tls = [f"{n.name} {n.tls_port}" for n in h.nodes if n.tls_port is not None]
    if tls:  # below the table, which has no room left in 80 columns
        _line(f"TLS data ports (uprs://): {', '.join(tls)}")


def _status_logs(h: ClusterHealth) -> None:
    for s in h.statuses:
        for p in sorted(s.roles):
            if s.roles[p] == "dead":
                continue
            entries = ", ".join(f"{u:x}@{q}" for u, q in s.logs.get(p, []))
            where = f"high {s.highs.get(p, 0)}, complete snapshot {s.complete.get(p, 0)}"
            _line(f"{s.name} partition {p} ({s.roles[p]}, {where}): failover log [{entries}]")


def _status_problems(h: ClusterHealth) -> None:
    """Down nodes with their reason, degraded partitions (the first few runs), actions."""
    from upr_cli.cluster.health import ranges

    for n in h.nodes:
        if n.reason:
            _line(f"{n.name}: {n.state} ({n.reason})")
    for what, parts in (("unavailable", h.unavailable), ("unreplicated", h.unreplicated)):
        if parts:
            _line(f"{what}: {len(parts)} of {h.cl.partitions} partitions: "
                  f"{ranges(parts, limit=8)}")  # fmt: skip
    if h.actions:
        _line("to repair:")
        for why, command in h.actions:
            _line(f"  {why}:")
            _line(f"    {command}")
    elif not h.degraded:
        _line("every partition has a live active copy and its replicas")


@app.command(
    "env",
    no_args_is_help=True,
    help="""Print shell lines that export the cluster's URIs and password.

UPR_N0, UPR_N1, … are the nodes' URIs without the password (and in a TLS cluster
UPR_N0_TLS, UPR_N1_TLS, … their uprs:// URIs); UPR_PASSWORD (which upr
reads when a URI has none) is set to the cluster's password: the cluster's own password
wins over one left in the shell from before (a note on stderr says when it replaces
another). For scripts and demos:

  eval "$(upr cluster env --data /tmp/cl)"
  upr tail "$UPR_N1" --until-end
""",
)
def env_cmd(data: Data) -> None:
    """Print the cluster's environment."""
    from upr_cli.cluster import lifecycle

    lines, differs = lifecycle.env_lines(data)
    if differs:
        stderr.print(
            "upr: note: UPR_PASSWORD is set to another password; these lines "
            "replace it with this cluster's",
            markup=False,
            highlight=False,
        )
    print("\n".join(lines))


Timeout = Annotated[
    float,
    typer.Option("--timeout", min=1.0, metavar="SECONDS",
                 help="Seconds to wait for a catch-up step."),
]  # fmt: skip


@app.command(
    "failover",
    no_args_is_help=True,
    help="""Fail a node over: its active partitions move to their replicas.

Hard (default; works when NODE is dead): for each partition active on NODE, the replica
with the highest persisted complete snapshot becomes active with a new failover entry at
that snapshot; the other replicas re-stream from it and roll back as the producer rule
says. --graceful (NODE must be up) first stops writes on NODE, lets the replicas
persist everything, and promotes without a failover entry. NODE leaves the map;
`upr cluster rebalance` brings capacity back.

Example:

  upr cluster failover n0 --data /tmp/cl
  upr cluster failover n1 --graceful --data /tmp/cl --json
""",
)
def failover_cmd(
    data: Data,
    node: Annotated[str, typer.Argument(metavar="NODE", help="The node to fail over (n0, …).")],
    graceful: Annotated[
        bool, typer.Option("--graceful", help="Let the replicas catch up first.")
    ] = False,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            metavar="NODE",
            help="Promote this node's replicas (staging; default: the best).",
        ),
    ] = None,
    timeout: Timeout = 120.0,
    show_all: AllRows = False,
    json_out: JsonOutput = False,
) -> None:
    """Fail a node over."""
    from upr_cli.cluster import lifecycle

    report = lifecycle.failover(data, node, graceful=graceful, to=to, timeout=timeout,
                                progress=_progress(json_out))  # fmt: skip
    promoted = plural(len(report.promoted), "partition")
    _report(report, json_out, f"failed over {node}: {promoted} promoted", show_all)


@app.command(
    "rebalance",
    help="""Add and remove nodes, then balance the map while writes continue.

--add new starts a fresh node (DIR/nK, on port --base-port+K when given); --add NAME
brings back a node that was failed over or removed (started if needed; its copies
that diverged are rolled back or streamed again); --add URI adopts a running
`upr serve` that accepts the cluster's credentials. A node added gets the map and the
newest collections manifest before any partition. Each moving partition streams to a
pending copy on the new node until caught up, the old active is set dead, the new one
becomes active once it persisted everything, and the map is republished (clients
retry NOT_MY_VBUCKET with the map the answer carries). Removed nodes are stopped once
they hold nothing.

Example:

  upr cluster rebalance --add new --base-port 12000 --data /tmp/cl
  upr cluster rebalance --remove n2 --data /tmp/cl --json
""",
)
def rebalance_cmd(
    data: Data,
    add: Annotated[
        list[str] | None,
        typer.Option("--add", metavar="new|NAME|URI", help="A node to add (repeatable)."),
    ] = None,
    remove: Annotated[
        list[str] | None,
        typer.Option("--remove", metavar="NAME", help="A node to take out (repeatable)."),
    ] = None,
    base_port: BasePort = None,
    timeout: Timeout = 120.0,
    show_all: AllRows = False,
    json_out: JsonOutput = False,
) -> None:
    """Rebalance the cluster."""
    from upr_cli.cluster import lifecycle

    report = lifecycle.rebalance(data, add=add or [], remove=remove or [], base_port=base_port,
                                 timeout=timeout, progress=_progress(json_out))  # fmt: skip
    line = (
        f"rebalanced: {plural(len(report.moved), 'partition')} moved, "
        f"{plural(len(report.added), 'node')} added, {len(report.removed)} removed"
    )
    _report(report, json_out, line, show_all)


Partitions = Annotated[
    str | None,
    typer.Option("--partitions", metavar="LIST",
                 help="Partitions, e.g. 0-3,7 (default: all of the node's)."),
]  # fmt: skip


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
    node: Annotated[str, typer.Argument(metavar="NODE", help="The node whose replication pauses.")],
    after: Annotated[
        int | None,
        typer.Option("--after", min=0, metavar="SEQ", help="Apply up to this seq first."),
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
    node: Annotated[
        str, typer.Argument(metavar="NODE", help="The node whose replication resumes.")
    ],
    partitions: Partitions = None,
    json_out: JsonOutput = False,
) -> None:
    """Resume replication."""
    _pause(data, node, partitions, None, json_out, resume=True)


def _pause(data: Path, node: str, partitions: str | None, after: int | None, json_out: bool,
           *, resume: bool) -> None:  # fmt: skip
    from upr_cli.cluster import lifecycle
    from upr_cli.source import parse_partitions

    vbs = None if partitions is None else parse_partitions(partitions)
    done = lifecycle.pause(data, node, vbs, after, resume=resume)
    what = "resumed" if resume else "paused"
    if json_out:
        print_json({"node": node, what: done, "after": after})
    else:
        _line(f"{node}: replication {what} for {len(done)} partitions")


def _line(text: str) -> None:
    stdout.print(text, markup=False, highlight=False)


def _progress(json_out: bool) -> Callable[[str], None]:
    def say(line: str) -> None:
        if not json_out:
            stderr.print(line, markup=False, highlight=False)

    return say


def _report(report: Report, json_out: bool, line: str, show_all: bool = False) -> None:
    """The summary line, then each promoted partition's failover entry: the first few
    unless --all (a 1024-partition failover would print 500 lines)."""
    if json_out:
        print_json(report.to_json())
        return
    _line(f"{line} (map revision {report.rev})")
    rows, left_out = first_rows(sorted(report.entries.items()), show_all)
    for p, (uuid, seq) in rows:
        _line(f"  partition {p}: active on {report.promoted[p]}, failover entry "
              f"{uuid:x} at seq {seq}")  # fmt: skip
    more_line(left_out, "partitions")
    if report.lost:
        _line(f"  no replica left for partitions {report.lost}: they are unavailable")


def _show(cl: ClusterSpec, json_out: bool, line: str) -> None:
    if json_out:
        # cluster.json's `partitions` (a count) is `partition_count` in --json, where
        # `partitions` is a list of partitions (docs/output.md)
        spec = {"partition_count" if k == "partitions" else k: v for k, v in cl.to_json().items()}
        print_json(spec | {"password": "***"})
    else:
        _line(line)
