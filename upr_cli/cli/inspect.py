"""`upr info` and `upr verify`: what a repository holds, and whether it is sound."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from upr_cli.cli.options import Bucket, JsonOutput, Partitions, Repo
from upr_cli.cli.output import print_json, stdout
from upr_cli.jobs.inspect import info, verify
from upr_cli.source import selected

INFO_HELP = """Show a repository's backups: items, bytes, ratio, rollbacks, the chain.

With --partitions, each partition's range in every backup, its rollbacks and the lost
writes (records above a rollback point, still readable).

Example:

  upr info --repo /backups/cb

Example (partition 12's chain, as JSON):

  upr info --repo /backups/cb --partitions 12 --json
"""

VERIFY_HELP = """Read everything in a repository and check it.

Checks every segment's blocks, footer and checksums against its manifest, both files
of every manifest (manifest.json and manifest.json.copy, each against its own checksum),
that every incremental backup's parent is there, and that each partition's chain covers
its seqs without gaps. Every problem is named (missing, truncated, checksum, corrupt,
mismatch, gap, manifest, chain); the exit status is 1 when there is one.

--repair takes each bucket's lock and rewrites a missing or damaged manifest.json or
manifest.json.copy from its valid twin. Nothing else is changed: a problem it cannot
repair is still reported, and the exit status is 1 while one is left.

Example:

  upr verify --repo /backups/cb

Example (rewrite a lost manifest from its copy, report the rest as JSON):

  upr verify --repo /backups/cb --repair --json
"""


def register(app: typer.Typer) -> None:
    """Add the commands to the app."""
    app.command("info", help=INFO_HELP, no_args_is_help=True)(info_cmd)
    app.command("verify", help=VERIFY_HELP, no_args_is_help=True)(verify_cmd)


def info_cmd(
    repo: Repo,
    bucket: Bucket = None,
    partitions: Partitions = None,
    json_out: JsonOutput = False,
) -> None:
    """Show a repository's backups."""
    data = info(repo, bucket, selected(partitions))
    if json_out:
        print_json(data)
        return
    for b, entry in data["buckets"].items():
        table = Table(title=f"{data['repository']}: bucket {b}")
        for col in ("backup", "kind", "items", "read", "written", "ratio", "rollbacks"):
            table.add_column(
                col,
                justify="left" if col in ("backup", "kind") else "right",
                no_wrap=col == "backup",
            )
        for bk in entry["backups"]:
            table.add_row(
                bk["backup_id"],
                "full" if bk["full"] else "incremental",
                f"{bk['items']:,}",
                f"{int(bk['bytes_read']) / 1e6:,.1f} MB",
                f"{int(bk['bytes_written']) / 1e6:,.1f} MB",
                str(bk["ratio"] or "-"),
                str(bk["rollbacks"]),
            )
        stdout.print(table)
        if entry["incomplete"]:
            stdout.print(f"interrupted runs (not backups): {', '.join(entry['incomplete'])}")
        for p, chain in entry.get("partitions", {}).items():
            stdout.print(f"partition {p}:")
            for link in chain:
                if "lost" in link:
                    for x in link["lost"]:
                        stdout.print(
                            f"  lost writes: {x['backup_id']} seqs ({x['from']}, {x['to']}]"
                        )
                    continue
                rb = link["rollback"]
                note = f"  rolled back {rb['from']} -> {rb['to']}" if rb else ""
                stdout.print(
                    f"  {link['backup_id']}: ({link['start']}, {link['end']}] "
                    f"{link['records']} records{note}"
                )


def verify_cmd(
    repo: Repo,
    bucket: Bucket = None,
    repair: Annotated[
        bool, typer.Option("--repair", help="Rewrite a lost or damaged manifest file.")
    ] = False,
    json_out: JsonOutput = False,
) -> None:
    """Check a repository."""
    reports = verify(repo, bucket, repair=repair)
    problems = [p for r in reports for p in r.unrepaired]
    if json_out:
        print_json({"ok": not problems, "buckets": [r.to_json() for r in reports]})
    else:
        for r in reports:
            left, fixed = len(r.unrepaired), len(r.problems) - len(r.unrepaired)
            status = "ok" if not left else f"{left} problem(s)"
            if fixed:
                status += f", {fixed} repaired"
            stdout.print(
                f"{r.bucket}: {r.backups} backups, {r.segments} segments, "
                f"{r.records:,} records, {r.bytes / 1e6:,.1f} MB read: {status}"
            )
            for p in r.problems:
                stdout.print(f"  {p}", markup=False)
    if problems:
        raise typer.Exit(1)
