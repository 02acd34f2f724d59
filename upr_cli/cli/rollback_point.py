"""`upr rollback-point`: compute where a client must roll back to and restart."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from upr_cli.cli.options import JsonOutput
from upr_cli.cli.output import print_json, stdout
from upr_cli.errors import UsageError
from upr_cli.failover import RollbackDecision
from upr_cli.jobs.rollback_point import DcpArgs, compare_sources, compute, load_log
from upr_cli.jobs.tail import parse_partitions

HELP = """Compute where a client must roll back to and restart streaming a partition.

The seed rule (default) compares the client's failover log and last snapshot with the
server's log (seed 000, "How UPR Replicas/Clients find out where to rollback to").
`--rule dcp` runs the producer's STREAM_REQ check instead (dcp-wire §4.2).

A LOG is a JSON array of [uuid, seq] pairs, newest first, the uuid a hex string
("deadbeef") or an integer; or @path to a file holding one.

Exit status: 0 done, 2 malformed input, 3 an impossible history.

Example (the seed's worked example, prints "rollback_seq": 6):

  upr rollback-point --server-log '[["deadbeef",8],["cafebabe",0]]'
      --client-log '[["ba5eba11",7],["cafebabe",0]]' --snapshot-seq 6 --seen-seq 9 --json

Example (where a repository's next backup must restart, per partition):

  upr rollback-point --server upr://admin@127.0.0.1/default --client repo:/backups/cb

Example (producer rule):

  upr rollback-point --rule dcp --server-log '[["deadbeef",8],["cafebabe",0]]'
      --uuid cafebabe --start 9 --snap-start 7 --snap-end 10 --high-seq 12
"""

Log = Annotated[str, typer.Option(metavar="LOG", show_default=False)]
OptSeq = Annotated[int | None, typer.Option(min=0, metavar="SEQ", show_default=False)]


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("rollback-point", help=HELP, no_args_is_help=True)(rollback_point_cmd)


def rollback_point_cmd(
    server_log: Annotated[
        str | None, typer.Option("--server-log", metavar="LOG", help="The server's failover log.")
    ] = None,
    client_log: Annotated[
        str | None, typer.Option("--client-log", metavar="LOG", help="The client's failover log.")
    ] = None,
    snapshot_seq: Annotated[
        int | None,
        typer.Option(
            "--snapshot-seq",
            min=0,
            metavar="SEQ",
            help="Seed rule: the client's last complete snapshot seq.",
        ),
    ] = None,
    seen_seq: Annotated[
        int | None,
        typer.Option(
            "--seen-seq",
            min=0,
            metavar="SEQ",
            help="Seed rule: the highest seq the client has seen.",
        ),
    ] = None,
    rule: Annotated[
        str,
        typer.Option(
            "--rule",
            metavar="seed|dcp",
            help="seed (client-side, seed 000) or dcp (producer, dcp-wire §4.2).",
        ),
    ] = "seed",
    uuid: Annotated[
        str | None,
        typer.Option(
            "--uuid",
            metavar="HEX",
            help="dcp rule: the uuid in the STREAM_REQ (default: newest of --client-log).",
        ),
    ] = None,
    start: OptSeq = None,
    snap_start: Annotated[
        int | None,
        typer.Option(
            "--snap-start",
            min=0,
            metavar="SEQ",
            help="dcp rule: snapshot start (default: --start).",
        ),
    ] = None,
    snap_end: Annotated[
        int | None,
        typer.Option(
            "--snap-end", min=0, metavar="SEQ", help="dcp rule: snapshot end (default: --start)."
        ),
    ] = None,
    high_seq: Annotated[
        int | None,
        typer.Option(
            "--high-seq",
            min=0,
            metavar="SEQ",
            help="dcp rule: the partition's high seqno on the server.",
        ),
    ] = None,
    purge_seq: Annotated[
        int,
        typer.Option(
            "--purge-seq",
            min=0,
            metavar="SEQ",
            help="dcp rule: the server's tombstone purge seqno.",
        ),
    ] = 0,
    client_purge_seq: Annotated[
        int,
        typer.Option(
            "--client-purge-seq",
            min=0,
            metavar="SEQ",
            help="dcp rule: purge_seqno sent in the request value.",
        ),
    ] = 0,
    strict: Annotated[
        bool, typer.Option("--strict", help="dcp rule: the StrictVbUuid stream flag.")
    ] = False,
    max_entries: Annotated[
        int, typer.Option("--max-entries", min=1, help="Maximum failover-log length accepted.")
    ] = 25,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            metavar="SRC",
            help="Server logs from a source: upr://… (live node) or repo:DIR[@BACKUP].",
        ),
    ] = None,
    client: Annotated[
        str | None,
        typer.Option(
            "--client",
            metavar="SRC",
            help="Client logs and positions from a source: repo:DIR[@BACKUP] or upr://….",
        ),
    ] = None,
    partitions: Annotated[
        str | None, typer.Option("--partitions", help="With sources: only these, e.g. 0-15,40.")
    ] = None,
    json_out: JsonOutput = False,
) -> None:
    """Compute where a client must roll back to and restart."""
    if server is not None or client is not None:
        if server is None or client is None:
            raise UsageError("--server and --client go together (upr://… or repo:DIR[@BACKUP])")
        sources(server, client, parse_partitions(partitions) if partitions else None, json_out)
        return
    if server_log is None:
        raise UsageError("give --server-log (or --server and --client sources)")
    server_log_ = load_log(server_log, "--server-log", max_entries)
    client_log_ = (
        load_log(client_log, "--client-log", max_entries) if client_log is not None else None
    )
    dcp = DcpArgs(
        start=start,
        high=high_seq,
        uuid=uuid,
        snap_start=snap_start,
        snap_end=snap_end,
        purge_seq=purge_seq,
        client_purge_seq=client_purge_seq,
        strict=strict,
    )
    decision = compute(
        rule=rule,
        server_log=server_log_,
        client_log=client_log_,
        snapshot_seq=snapshot_seq,
        seen_seq=seen_seq,
        dcp=dcp,
    )
    if json_out:
        print_json(decision.to_json())
    else:
        render(decision)


def sources(server: str, client: str, partitions: list[int] | None, json_out: bool) -> None:
    """Per partition: the seed rule between two sources (exit 3 if any history is impossible)."""
    results = compare_sources(server, client, partitions)
    if json_out:
        print_json(
            [
                {
                    "partition": r.partition,
                    **(r.decision.to_json() if r.decision else {}),
                    "error": r.error,
                }
                for r in results
            ]
        )
    else:
        table = Table(title=f"seed rule: server {server} / client {client}")
        for col in ("partition", "rollback to", "rolls back", "step", "common ancestor"):
            table.add_column(col, no_wrap=True)
        for r in results:
            d = r.decision
            if d is None:
                table.add_row(str(r.partition), "-", "-", r.error or "", "")
                continue
            ca = d.common_ancestor
            table.add_row(
                str(r.partition),
                str(d.rollback_seq),
                "yes" if d.rollback else "no",
                d.step,
                "none" if ca is None else f"{ca.uuid:x}@{ca.seq}",
            )
        stdout.print(table)
        rolled = sum(1 for r in results if r.decision and r.decision.rollback)
        stdout.print(f"{len(results)} partitions, {rolled} must roll back")
    if any(r.error for r in results):
        raise typer.Exit(3)


def render(d: RollbackDecision) -> None:
    """Human-readable decision with its reasoning."""
    rule = "seed rule (seed 000)" if d.rule == "seed" else "producer rule (dcp-wire §4.2)"
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
