"""`upr diff A B`: compare two failover histories partition by partition."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from upr_cli.cli.options import JsonOutput, Partitions, one_is_an_answer
from upr_cli.cli.output import print_json, stdout
from upr_cli.jobs.diff import STATUSES, PartitionDiff, diff_sources
from upr_cli.source import selected

HELP = """Compare the failover histories of A and B, partition by partition.

A and B are each a live node (upr://…), a repository (repo:DIR[@BACKUP]), a replay
store (sqlite:PATH) or a JSON file of failover logs (PATH.json or json:PATH: an object
of partition -> log, or partition -> {"failover_log": LOG, "seq": N}). For each
partition: identical; B behind or ahead on the same branch; diverged at seq S (the
common ancestor and the entries only in A and only in B; B's seqs above S are writes
A's history does not have); or no common history. Both rollback rules give where B
would restart streaming from A.

Exit status: 0 identical, 1 they differ, 2 error.

Example (what a failover did to a backup's history):

  upr diff upr://admin@127.0.0.1:11210/default repo:/backups/cb

Example (a replay store against its node, as JSON):

  upr diff upr://admin@127.0.0.1/default sqlite:/tmp/bucket.db --json
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("diff", help=HELP, no_args_is_help=True)(diff_cmd)


def diff_cmd(
    a: Annotated[
        str, typer.Argument(metavar="A", help="upr://…, repo:DIR[@B], sqlite:PATH or a .json file")
    ],
    b: Annotated[str, typer.Argument(metavar="B", help="The same kinds; compared against A.")],
    partitions: Partitions = None,
    all_rows: Annotated[bool, typer.Option("--all", help="List identical partitions too.")] = False,
    json_out: JsonOutput = False,
) -> None:
    """Compare failover histories."""
    with one_is_an_answer():  # 1 means "they differ": a source that fails exits 2
        report = diff_sources(a, b, selected(partitions))
    code = 0 if report.identical else 1
    if json_out:
        print_json(report.to_json())
        raise typer.Exit(code)
    table = Table(title=f"A = {report.a}   B = {report.b}")
    for col in ("partition", "status", "A seq", "B seq", "diverged at", "common ancestor",
                "only in A", "only in B", "seed rule", "dcp rule"):  # fmt: skip
        table.add_column(col, justify="right" if col != "status" else "left")
    shown = 0
    for d in report.partitions:
        if d.status == "identical" and not all_rows:
            continue
        shown += 1
        table.add_row(*_row(d))
    if shown:
        stdout.print(table)
    counts = report.counts
    summary = Table(title="partitions per status")
    for s in STATUSES:
        summary.add_column(s, justify="right")
    summary.add_row(*(str(counts[s]) for s in STATUSES))
    stdout.print(summary)
    raise typer.Exit(code)


def _entries(entries: tuple[object, ...]) -> str:
    return ", ".join(str(e) for e in entries) or "-"


def _row(d: PartitionDiff) -> list[str]:
    def opt(v: object) -> str:
        return "-" if v is None else str(v)

    return [
        str(d.partition),
        d.status,
        opt(d.a_seq),
        opt(d.b_seq),
        opt(d.diverged_at),
        opt(d.common_ancestor),
        _entries(d.only_in_a),
        _entries(d.only_in_b),
        opt(d.seed_rule),
        opt(d.dcp_rule),
    ]
