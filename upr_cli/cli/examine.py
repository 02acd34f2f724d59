"""`upr examine`: every version of a key across the chain, lost writes marked."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from upr_cli.cli.options import Bucket, JsonOutput, Partitions, Repo
from upr_cli.cli.output import print_json, stdout
from upr_cli.jobs.examine import examine
from upr_cli.source import selected

HELP = """Show every version of a key stored in a repository.

Each version with its backup, seq, op, cas and rev seq, whether it is in the latest
state, and whether it is a lost write: a version a failover or an unclean restart rolled
back (above a later backup's rollback point), absent from the latest state but kept.

The key's partition comes from the bucket's partition count, which the repository's
backups record. --partitions selects partitions as in every command: one that leaves
out the key's partition is an error naming it.

Example:

  upr examine --repo /backups/cb user::1042

Example (as JSON):

  upr examine --repo /backups/cb --json user::1042
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("examine", help=HELP, no_args_is_help=True)(examine_cmd)


def examine_cmd(
    key: Annotated[str, typer.Argument(metavar="KEY", help="The document key.")],
    repo: Repo,
    bucket: Bucket = None,
    partitions: Partitions = None,
    json_out: JsonOutput = False,
) -> None:
    """Show every version of a key."""
    versions = examine(repo, key.encode(), bucket=bucket, partitions=selected(partitions))
    if json_out:
        print_json({"key": key, "versions": [v.to_json() for v in versions]})
        return
    if not versions:
        stdout.print(f"no version of {key!r} in the repository")
        raise typer.Exit(1)
    table = Table(title=f"{key} (partition {versions[0].partition})")
    for col in ("backup", "seq", "op", "cas", "rev", "state"):
        table.add_column(col, no_wrap=True)
    table.add_column("value", no_wrap=True, overflow="ellipsis", min_width=8)
    for v in versions:
        state = "lost write" if v.lost else ("latest" if v.in_latest else "superseded")
        preview = v.value.decode(errors="replace")[:60] if v.op == "mutation" else ""
        table.add_row(v.backup_id, str(v.seq), v.op, str(v.cas), str(v.rev_seq), state, preview)
    stdout.print(table)
