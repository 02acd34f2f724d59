"""`upr diff A B`: compare two failover histories partition by partition."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

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
    one_is_an_answer,
)
from upr_cli.cli.output import (
    first_rows,
    fits,
    hidden_columns,
    hint,
    keep_whole,
    more_line,
    print_json,
    stdout,
    table,
)
from upr_cli.errors import ExitCode
from upr_cli.jobs.diff import STATUSES, DiffReport, PartitionDiff, diff_sources
from upr_cli.source import selected

HELP = """Compare the failover histories of A and B, partition by partition.

A and B are each a live node (upr://…), a repository (repo:URL[@BACKUP]), a replay
store (sqlite:PATH) or a JSON file of failover logs (PATH.json or json:PATH: an object
of partition -> log, or partition -> {"failover_log": LOG, "seq": N}). For each
partition: identical; B behind or ahead on the same branch; diverged at seq S (the
common ancestor and the entries only in A and only in B; B's seqs above S are writes
A's history does not have); or no common history. When B is a replay store, a
diverged partition also lists those writes' keys, by collection: scope.collection:key
outside the default collection (--json: scope, collection and key fields). Both
rollback rules give where B would restart streaming from A.

A repository at a time, repo:URL@TIME (RFC 3339 such as 2026-12-06T14:37:00Z, a local
time, or relative: -15m), is each partition at its restore point then, as `upr
restore --at-time` resolves it: its branch and seq as a replay from that time would
record them.

A live node over TLS is uprs://… or couchbases://… (default port 11207): --cacert FILE
(or UPR_CACERT) names the CA that signs its certificate, --cert and --key present a
client certificate; the options apply to both A and B.

Exit status: 0 identical; 5 B is only behind A on the same branch (the others
identical) and needs no rollback: its next backup or replay catches up; 1 they differ
otherwise (diverged, B ahead, no common history, a partition on one side only); 2
error. A check from cron takes 0 and 5 as fine.

Example (what a failover did to a backup's history):

  upr diff upr://admin@127.0.0.1:11210/default repo:/backups/cb

Example (a replay store against its node, as JSON):

  upr diff upr://admin@127.0.0.1/default sqlite:/tmp/bucket.db --json

Example (a node over TLS against a repository):

  upr diff uprs://admin@db.example.com/default repo:/backups/cb --cacert ca.pem

Example (the repository as it was at 14:37 UTC against its state now):

  upr diff repo:/backups/cb@2026-12-06T14:37:00Z repo:/backups/cb
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("diff", help=HELP, no_args_is_help=True)(diff_cmd)


def diff_cmd(
    a: Annotated[
        str, typer.Argument(metavar="A", help="upr://…, repo:URL[@B], sqlite:PATH or a .json file")
    ],
    b: Annotated[str, typer.Argument(metavar="B", help="The same kinds; compared against A.")],
    partitions: Partitions = None,
    show_all: Annotated[
        bool, typer.Option("--all", help="List every partition, identical ones too.")
    ] = False,
    json_out: JsonOutput = False,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Compare failover histories."""
    secure = any(s.startswith(("uprs://", "couchbases://")) for s in (a, b))
    tls = client_tls(cacert, no_verify, cert, key, secure=secure)
    with one_is_an_answer():  # 1 means "they differ": a source that fails exits 2
        report = diff_sources(a, b, selected(partitions), tls)
    code = exit_code(report)
    if json_out:
        print_json(report.to_json())
        raise typer.Exit(code)
    render(report, show_all)
    raise typer.Exit(code)


def exit_code(report: DiffReport) -> int:
    """0 identical; 5 (ExitCode.BEHIND) when every partition that differs is behind on
    the same branch and neither rollback rule takes B back below its seq; else 1."""
    if report.identical:
        return ExitCode.OK
    for d in report.partitions:
        if d.status == "identical":
            continue
        if d.status != "behind" or d.b_seq is None:
            return ExitCode.FAILED
        rules = (r for r in (d.seed_rule, d.dcp_rule) if isinstance(r, int))
        if any(r < d.b_seq for r in rules):  # B restarts lower: a rollback
            return ExitCode.FAILED
    return ExitCode.BEHIND


#: what to do about each kind of difference (the hint after the counts)
NEXT = {
    "behind": "B is behind A on the same branch: the next backup or replay of B catches up",
    "diverged": "B holds writes A's history does not have (lost writes): "
    "upr salvage lists them and writes back the safe ones",
    "no-common-history": "B shares no history with A: B must start again from 0 (--full)",
}


def render(report: DiffReport, show_all: bool) -> None:
    """The partitions that differ (the first few, unless `show_all`), then the counts."""
    rows = [d for d in report.partitions if show_all or d.status != "identical"]
    shown, left_out = first_rows(rows, show_all)
    if shown:
        wide = fits(stdout, WIDE)
        stdout.print(diff_table(report, shown, wide=wide))
        hidden_columns([] if wide else list(WIDE_COLUMNS))
        more_line(left_out, "partitions")
    for d in shown:
        if d.lost_keys:
            stdout.print(_lost_keys(d), markup=False, highlight=False)
    counts = report.counts
    parts = ", ".join(f"{n:,} {s}" for s in STATUSES if (n := counts[s]))
    stdout.print(f"{len(report.partitions):,} partitions: {parts or 'none'}",
                 markup=False, highlight=False)  # fmt: skip
    for status, text in NEXT.items():
        if counts.get(status):
            hint(text)


#: the terminal width that has room for `WIDE_COLUMNS`, the columns only it shows
WIDE = 120
WIDE_COLUMNS = ("dcp rule", "common ancestor", "only in A", "only in B")


def diff_table(report: DiffReport, rows: Sequence[PartitionDiff], *, wide: bool) -> Table:
    """One row a partition. Key columns never wrap; the failover entries each side alone
    holds fold, and only a wide terminal has room for them (--json always has them)."""
    t = table(f"A = {report.a}   B = {report.b}")
    t.add_column("partition", justify="right", no_wrap=True)
    t.add_column("status", no_wrap=True, min_width=len("no-common-history"))
    for col in ("A seq", "B seq", "diverged at", "restart at"):
        t.add_column(col, justify="right", no_wrap=True)
    if wide:
        rule, *entries = WIDE_COLUMNS
        t.add_column(rule, justify="right", no_wrap=True)
        for col in entries:
            t.add_column(col, overflow="fold")
    for d in rows:
        row = [str(d.partition), d.status, _opt(d.a_seq), _opt(d.b_seq), _opt(d.diverged_at),
               _opt(d.seed_rule)]  # fmt: skip
        if wide:
            row += [_opt(d.dcp_rule), _opt(d.common_ancestor), _entries(d.only_in_a),
                    _entries(d.only_in_b)]  # fmt: skip
        t.add_row(*row)
    return keep_whole(
        t, "partition", "status", "A seq", "B seq", "diverged at", "restart at", "dcp rule"
    )


def _lost_keys(d: PartitionDiff, show: int = 10) -> str:
    """One line: the first keys a diverged partition of a store B would lose (--json has
    all), `scope.collection:key` outside the default collection."""
    keys = ", ".join(map(str, d.lost_keys[:show]))
    more = f" and {len(d.lost_keys) - show:,} more" if len(d.lost_keys) > show else ""
    return f"partition {d.partition}: B's lost keys: {keys}{more}"


def _opt(v: object) -> str:
    return "-" if v is None else str(v)


def _entries(entries: tuple[object, ...]) -> str:
    return ", ".join(str(e) for e in entries) or "-"
