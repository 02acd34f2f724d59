"""`upr rollback-point`: compute where a client must roll back to and restart."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from upr_cli.cli.options import (
    CaCert,
    ClientCert,
    ClientKey,
    JsonOutput,
    NoVerify,
    Partitions,
    PasswordFile,
    client_tls,
)
from upr_cli.cli.output import first_rows, hint, keep_whole, more_line, print_json, stdout, table
from upr_cli.errors import UsageError
from upr_cli.failover import RollbackDecision
from upr_cli.jobs.rollback_point import DcpArgs, compare_sources, compute, load_log
from upr_cli.source import selected

if TYPE_CHECKING:
    from upr_cli.net.tls import ClientTls

HELP = """Compute where a client must roll back to and restart streaming a partition.

The seed rule (default) compares the client's failover log and last snapshot with the
server's log: the client-side rule of the UPR design specification ("How UPR
Replicas/Clients find out where to rollback to"). `--rule dcp` runs the check a
producer makes on a STREAM_REQ instead (kv_engine's rollback rule).

A LOG is a JSON array of [uuid, seq] pairs, newest first, the uuid a hex string
("deadbeef") or an integer; or @path to a file holding one.

With --server and --client, --json prints one object: the two sources (passwords
shown as ***), `must_roll_back_count` and `impossible` (partition counts), and
`partitions`, one object a partition with its decision (its `must_roll_back` flag
and `rollback_seq`) or its error.

Exit status: 0 done, 2 malformed input, 3 an impossible history.

Example (the specification's worked example, prints "rollback_seq": "6"):

  upr rollback-point --server-log '[["deadbeef",8],["cafebabe",0]]' \\
      --client-log '[["ba5eba11",7],["cafebabe",0]]' \\
      --snapshot-seq 6 --seen-seq 9 --json

Example (where a repository's next backup must restart, per partition):

  upr rollback-point --server upr://admin@127.0.0.1/default \\
      --client repo:/backups/cb

Example (the same against a node over TLS, trusting the CA that signed its
certificate; --cert and --key present a client certificate):

  upr rollback-point --server uprs://admin@db.example.com/default \\
      --client repo:/backups/cb --cacert ca.pem

Example (producer rule):

  upr rollback-point --rule dcp \\
      --server-log '[["deadbeef",8],["cafebabe",0]]' \\
      --uuid cafebabe --start 9 --snap-start 7 --snap-end 10 --high-seq 12
"""


USAGE = (
    "Usage: upr rollback-point --server-log LOG [--client-log LOG] [OPTIONS]\n"
    "       upr rollback-point --server SOURCE --client SOURCE [OPTIONS]\n"
)
"""The usage lines printed before the error of a run without arguments."""


def _seq(name: str, help: str) -> Any:
    return typer.Option(name, min=0, metavar="SEQ", show_default=False, help=help)


ServerLog = Annotated[
    str | None, typer.Option("--server-log", metavar="LOG", help="The server's failover log.")
]
ClientLog = Annotated[
    str | None, typer.Option("--client-log", metavar="LOG", help="The client's failover log.")
]
SnapshotSeq = Annotated[
    int | None, _seq("--snapshot-seq", "Seed rule: the client's last complete snapshot seq.")
]
SeenSeq = Annotated[
    int | None, _seq("--seen-seq", "Seed rule: the highest seq the client has seen.")
]
Rule = Annotated[
    str,
    typer.Option("--rule", metavar="seed|dcp",
                 help="seed (the client's rule) or dcp (the producer's STREAM_REQ check)."),
]  # fmt: skip
Uuid = Annotated[
    str | None,
    typer.Option("--uuid", metavar="HEX",
                 help="dcp rule: the uuid in the STREAM_REQ (default: newest of --client-log)."),
]  # fmt: skip
Start = Annotated[int | None, _seq("--start", "dcp rule: the start seqno in the STREAM_REQ.")]
SnapStart = Annotated[
    int | None, _seq("--snap-start", "dcp rule: snapshot start (default: --start).")
]
SnapEnd = Annotated[int | None, _seq("--snap-end", "dcp rule: snapshot end (default: --start).")]
HighSeq = Annotated[
    int | None, _seq("--high-seq", "dcp rule: the partition's high seqno on the server.")
]
PurgeSeq = Annotated[int, _seq("--purge-seq", "dcp rule: the server's tombstone purge seqno.")]
ClientPurgeSeq = Annotated[
    int, _seq("--client-purge-seq", "dcp rule: purge_seqno sent in the request value.")
]
Strict = Annotated[bool, typer.Option("--strict", help="dcp rule: the StrictVbUuid stream flag.")]
MaxEntries = Annotated[
    int,
    typer.Option("--max-entries", min=1, metavar="N", help="Maximum failover-log length accepted."),
]
Server = Annotated[
    str | None,
    typer.Option("--server", metavar="SOURCE",
                 help="Server logs from a source: upr://… or uprs://… (live node) or "
                 "repo:URL[@BACKUP]."),
]  # fmt: skip
Client = Annotated[
    str | None,
    typer.Option("--client", metavar="SOURCE",
                 help="Client logs and positions from a source: repo:URL[@BACKUP] or upr://…."),
]  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    # not no_args_is_help: every option is optional, so without any the answer is what
    # is missing (on stderr, exit 2), not the help on stdout
    app.command("rollback-point", help=HELP)(rollback_point_cmd)


def rollback_point_cmd(
    ctx: typer.Context,
    server_log: ServerLog = None,
    client_log: ClientLog = None,
    snapshot_seq: SnapshotSeq = None,
    seen_seq: SeenSeq = None,
    rule: Rule = "seed",
    uuid: Uuid = None,
    start: Start = None,
    snap_start: SnapStart = None,
    snap_end: SnapEnd = None,
    high_seq: HighSeq = None,
    purge_seq: PurgeSeq = 0,
    client_purge_seq: ClientPurgeSeq = 0,
    strict: Strict = False,
    max_entries: MaxEntries = 25,
    server: Server = None,
    client: Client = None,
    partitions: Partitions = None,
    show_all: Annotated[
        bool,
        typer.Option(
            "--all",
            help="With --server and --client: every partition, not only those rolling back.",
        ),
    ] = False,
    json_out: JsonOutput = False,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Compute where a client must roll back to and restart."""
    if server is not None or client is not None:
        if server is None or client is None:
            raise UsageError("--server and --client go together (upr://… or repo:URL[@BACKUP])")
        secure = any(s.startswith(("uprs://", "couchbases://")) for s in (server, client))
        tls = client_tls(cacert, no_verify, cert, key, secure=secure)
        sources(server, client, selected(partitions), json_out, show_all, tls)
        return
    if server_log is None:
        given = (ctx.get_parameter_source(name) for name in ctx.params)
        if not any(source is not None and source.name == "COMMANDLINE" for source in given):
            sys.stderr.write(USAGE)  # run without arguments: the forms, then what is missing
        raise UsageError(
            "give --server-log LOG (or --server and --client sources): see 'upr "
            "rollback-point --help'"
        )
    dcp = DcpArgs(start=start, high=high_seq, uuid=uuid, snap_start=snap_start,
                  snap_end=snap_end, purge_seq=purge_seq, client_purge_seq=client_purge_seq,
                  strict=strict)  # fmt: skip
    decision = compute(
        rule=rule,
        server_log=load_log(server_log, "--server-log", max_entries),
        client_log=None
        if client_log is None
        else load_log(client_log, "--client-log", max_entries),
        snapshot_seq=snapshot_seq,
        seen_seq=seen_seq,
        dcp=dcp,
    )
    if json_out:
        print_json(decision.to_json())
    else:
        render(decision)


def sources(
    server: str, client: str, partitions: list[int] | None, json_out: bool, show_all: bool,
    tls: ClientTls | None = None,
) -> None:  # fmt: skip
    """Per partition: the seed rule between two sources (exit 3 if any history is impossible)."""
    results = compare_sources(server, client, partitions, tls)
    if json_out:
        print_json(sources_json(server, client, results))
    else:
        render_sources(server, client, results, show_all)
    if any(r.error for r in results):
        raise typer.Exit(3)


def sources_json(server: str, client: str, results: Sequence[Any]) -> dict[str, Any]:
    """The one JSON object of --server/--client: the sources (passwords redacted), the
    counts, and under `partitions` one object a partition (its decision, or its error)."""
    from upr_cli.net.uri import SCHEMES, SourceUri

    def redact(spec: str) -> str:
        node = spec.partition("://")[0].lower() in SCHEMES
        return SourceUri.parse(spec).redacted() if node else spec

    return {
        "server": redact(server),
        "client": redact(client),
        "rule": "seed",
        "must_roll_back_count": sum(
            1 for r in results if r.decision is not None and r.decision.rollback
        ),
        "impossible": sum(1 for r in results if r.decision is None),
        "partitions": [
            {"partition": r.partition, **(r.decision.to_json() if r.decision else {}),
             "error": r.error}
            for r in results
        ],
    }  # fmt: skip


def render_sources(server: str, client: str, results: Sequence[Any], show_all: bool) -> None:
    """The partitions that must roll back or failed (the first few, unless `show_all`:
    then every one), and the counts."""
    rolled = [r for r in results if r.decision is not None and r.decision.rollback]
    failed = [r for r in results if r.decision is None]
    rows = [r for r in results if show_all or r.decision is None or r.decision.rollback]
    shown, left_out = first_rows(rows, show_all)
    if shown:
        stdout.print(sources_table(f"seed rule: server {server} / client {client}", shown))
        more_line(left_out, "partitions")
    bad = f", {len(failed):,} with an impossible history" if failed else ""
    must = f"{len(rolled):,}" if rolled else "none"
    stdout.print(f"{len(results):,} partitions, {must} must roll back{bad}",
                 markup=False, highlight=False)  # fmt: skip
    if rolled:
        hint("the client's writes above each rollback seq are lost writes: upr salvage lists "
             "them (--repo for a repository client)")  # fmt: skip


def sources_table(title: str, results: Sequence[Any]) -> Table:
    """One row a partition: where it restarts, whether it rolls back, which step decided."""
    t = table(title)
    for col in ("partition", "rollback to", "rolls back", "step", "common ancestor"):
        right = col in ("partition", "rollback to")
        t.add_column(col, no_wrap=col != "common ancestor", overflow="fold",
                     justify="right" if right else "left")  # fmt: skip
    for r in results:
        d = r.decision
        if d is None:
            t.add_row(str(r.partition), "-", "-", r.error or "", "")
            continue
        ca = d.common_ancestor
        t.add_row(str(r.partition), str(d.rollback_seq), "yes" if d.rollback else "no", d.step,
                  "none" if ca is None else f"{ca.uuid:x}@{ca.seq}")  # fmt: skip
    return keep_whole(t, "partition", "rollback to", "rolls back", "step")


def render(d: RollbackDecision) -> None:
    """Human-readable decision with its reasoning."""
    rule = "seed rule" if d.rule == "seed" else "producer rule"
    if d.rule == "dcp" and not d.rollback:
        stdout.print(
            f"[bold green]no rollback[/]: stream from {d.rollback_seq}  ({rule}, step {d.step})"
        )
    else:
        seq = d.rollback_seq
        stdout.print(f"[bold]roll back to {seq}[/] and restart from there  ({rule}, step {d.step})")
    ca = d.common_ancestor
    stdout.print(f"common ancestor: {'none' if ca is None else f'{ca.uuid:x} at seq {ca.seq}'}")
    for i, line in enumerate(d.explanation, 1):
        stdout.print(f"  {i}. {line}", markup=False)
