"""`upr info` and `upr verify`: what a repository holds, and whether it is sound."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from upr_cli.cli.options import AllRows, Bucket, JsonOutput, NoProgress, Partitions, Repo
from upr_cli.cli.output import (
    Progress,
    first_rows,
    fits,
    hint,
    human_bytes,
    keep_whole,
    more_line,
    plural,
    print_json,
    stdout,
    table,
)
from upr_cli.jobs.inspect import info, verify
from upr_cli.metrics import MetricsFile, one_shot
from upr_cli.source import selected

INFO_HELP = """Show a repository's backups: items, bytes, ratio, rollbacks, the chain.

Each backup with when it committed (UTC), its type (full, incremental, or merged: a
backup `upr spark merge` wrote), its parent, its items and its size on disk (its
segments, cut-back ones included, and both manifest files), with the bytes read and
written and their ratio on a wide terminal; then the size of the repository on disk.
--json has every field; times are RFC 3339 UTC.

With --partitions, each partition's range in every backup, its rollbacks and the lost
writes (records above a rollback point, still readable).

Each collection the backups saw is listed as SCOPE.COLLECTION with its id and its
records over the chain: items (mutations) and deleted (deletions and expirations); a
collection dropped since says "dropped", one a filtered backup (--include-data,
--exclude-data) left out says "not backed up". Repositories written before collections
list their records under _default._default.

The restorable range of each bucket runs from its oldest restore point to its last
commit (point-in-time restore: `upr restore --at-time`). Continuous commits (`upr
backup --follow`) watch every moment in between; a time no commit watched (the
follower was stopped, or between ordinary backups) lies in a coarse stretch, listed
with its start, end and length: a restore there gives the state at its start. The
failovers the chain recorded (a backup with rollbacks) are numbered from 1, with their
time, partitions and lost writes (`upr restore --before-failover N` restores the state
just before one). --json has them as `restorable` (`oldest`, `last`, `coarse`) and
`failovers`.

A run that was interrupted after it finished segments is not a backup: it is listed as
incomplete, which the next `upr backup` resumes; other interrupted runs' directories as
leftovers, which no resume can use and the next backup removes.

Example:

  upr info --repo /backups/cb

Example (partition 12's chain, as JSON):

  upr info --repo /backups/cb --partitions 12 --json

Example (the restorable range and the failovers, as JSON):

  upr info --repo /backups/cb --json | jq '.buckets[] | .restorable, .failovers'
"""

VERIFY_HELP = """Read everything in a repository and check it.

Checks every segment's blocks, footer and checksums against its manifest, both files
of every manifest (manifest.json and manifest.json.copy, each against its own checksum),
that every incremental backup's parent is there, that each partition's chain covers
its seqs without gaps, that each backup's records per collection agree with its
manifest, and that every collection id they hold is one the chain names. Every problem
is named (missing, truncated, checksum, corrupt, mismatch, gap, manifest, chain,
collection); the exit status is 1 when there is one. Interrupted runs are named too:
the one the next backup resumes, and the leftovers no resume can use (not problems).
Records whose xattrs hold a value that is not JSON are a warning, named by key (a node
refuses to write them; a SQLite restore keeps them): the exit status stays 0.

--repair takes each bucket's lock and rewrites a missing or damaged manifest.json or
manifest.json.copy from its valid twin. Nothing else is changed: a problem it cannot
repair is still reported, and the exit status is 1 while one is left.

Example:

  upr verify --repo /backups/cb

Example (rewrite a lost manifest from its copy, report the rest as JSON):

  upr verify --repo /backups/cb --repair --json

--metrics-file PATH writes Prometheus metrics at the end, per bucket: last success
time, duration, items and bytes read, and the result (0 when a problem is left or the
run failed; docs/metrics.md), for node_exporter's textfile collector.

Example (a weekly check from cron, its metrics for node_exporter):

  upr verify --repo /backups/cb \\
      --metrics-file /var/lib/node_exporter/textfile/upr-verify.prom
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
    for entry in data["buckets"]:
        b = entry["bucket"]
        title = f"{data['repository']}: bucket {b}"
        if entry["backups"]:
            stdout.print(backups_table(title, entry["backups"], wide=fits(stdout, 100)))
        else:
            stdout.print(f"{title}: no backups", markup=False)
        for line in interrupted_lines(entry["resumable"], entry["leftovers"]):
            stdout.print(line, markup=False)
        for line in restorable_lines(entry["restorable"], entry["failovers"]):
            stdout.print(line, markup=False)
        if entry["collections"]:
            stdout.print(collections_table(entry["collections"]))
        for part in entry.get("partitions", []):
            _print_chain(part)
    stdout.print(total_line(data), markup=False)


# coarse stretches listed in text (--json has them all): an ordinary chain has one
# between every two backups
_SHOWN_STRETCHES = 10


def restorable_lines(span: dict[str, Any] | None, failovers: list[dict[str, Any]]) -> list[str]:
    """The restorable range, its coarse stretches and the failovers, as lines."""
    from upr_cli.repo.pitr import show_span

    if span is None:
        return []
    out = [f"restorable: {span['oldest']} to {span['last']}"]
    coarse = span["coarse"]
    if coarse:
        out.append(f"coarse stretches ({len(coarse)}): a restore there gives the state at "
                   "the start")  # fmt: skip
        for c in coarse[:_SHOWN_STRETCHES]:
            out.append(f"  {c['start_time']} to {c['end_time']} ({show_span(c['seconds'])})")
        if len(coarse) > _SHOWN_STRETCHES:
            out.append(f"  and {len(coarse) - _SHOWN_STRETCHES} more (--json lists them)")
    for f in failovers:
        parts = ", ".join(map(str, f["partitions"]))
        which = "partition" if len(f["partitions"]) == 1 else "partitions"
        out.append(f"failover {f['number']}: {f['time']}, backup {f['backup_id']}")
        out.append(f"  {which} {parts}; lost writes in {plural(f['lost_seq_count'], 'seq')}")
    return out


def interrupted_lines(resumable: str | None, leftovers: list[str]) -> list[str]:
    """What interrupted runs left (formats/repository.md §4.5): the one the next backup
    resumes, and those no resume can use. Neither is a backup."""
    out = []
    if resumable is not None:
        out.append(f"incomplete (not a backup): {resumable}, an interrupted run: the next "
                   "`upr backup` resumes it")  # fmt: skip
    if leftovers:
        out.append(f"leftovers (not backups): {', '.join(leftovers)}: interrupted runs no "
                   "resume can use; the next `upr backup` of the bucket removes them, and "
                   "nothing reads them: they can be deleted")  # fmt: skip
    return out


def backups_table(title: str, backups: list[dict[str, Any]], *, wide: bool) -> Table:
    """One row a backup. The id and the type never wrap; when it committed (UTC) folds
    into two lines when short of room; the parent (its id to the second, a prefix
    `--at` takes), the bytes read and written and the ratio come when the terminal is
    `wide`, and are always in --json."""
    t = table(title)
    t.add_column("backup", no_wrap=True)
    t.add_column("type", no_wrap=True, min_width=len("incremental"))
    t.add_column("finished (UTC)", overflow="fold", min_width=len("2026-11-21"))
    if wide:
        t.add_column("parent", no_wrap=True)
    cols = ("items", "on disk", "read", "written", "ratio", "rollbacks") if wide else (
        "items", "on disk", "rollbacks")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="right", no_wrap=True)
    for bk in backups:
        cells = {
            "items": f"{bk['items']:,}",
            "on disk": human_bytes(bk["bytes_on_disk"]),
            "read": human_bytes(bk["bytes_read"]),
            "written": human_bytes(bk["bytes_written"]),
            "ratio": str(bk["ratio"] or "-"),
            "rollbacks": str(bk["rollback_count"]),
        }
        row = [bk["backup_id"], bk["type"], _utc(bk["finished"])]
        if wide:
            row.append(bk["parent"][:15] if bk["parent"] else "-")
        t.add_row(*row, *(cells[c] for c in cols))
    return keep_whole(t, "backup", "type", *cols)


def _utc(time: str) -> str:
    """An RFC 3339 UTC time (`2026-11-21T06:15:00.123456Z`) to the second, for people:
    `2026-11-21 06:15:00` (the space is where it folds)."""
    return time[:19].replace("T", " ")


def total_line(data: dict[str, Any]) -> str:
    """The repository's size on disk, every bucket's, and the selected buckets'."""
    line = f"{data['repository']}: {human_bytes(data['bytes_on_disk'])} on disk"
    if len(data["buckets"]) > 1:
        each = ", ".join(
            f"{e['bucket']} {human_bytes(e['bytes_on_disk'])}" for e in data["buckets"]
        )
        line += f" ({each})"
    return line


def collections_table(collections: list[dict[str, Any]]) -> Table:
    """One row a collection the chain saw: its name, id, records, and whether it was
    dropped or left out."""
    t = table()
    t.add_column("collection", no_wrap=True)
    for col in ("id", "items", "deleted"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("state", no_wrap=True)
    for c in collections:
        state = "dropped" if c["dropped"] else ("" if c["backed_up"] else "not backed up")
        t.add_row(f"{c['scope']}.{c['collection']}", f"{c['id']:#x}", f"{c['items']:,}",
                  f"{c['deletions']:,}", state)  # fmt: skip
    return keep_whole(t, "collection", "id")


def _print_chain(part: dict[str, Any]) -> None:
    """One partition of `info --partitions`: its chain, then its lost writes' ranges."""
    stdout.print(f"partition {part['partition']}:")
    for link in part["chain"]:
        rb = link["rollback"]
        note = f"  rolled back {rb['from']} -> {rb['to']}" if rb else ""
        stdout.print(f"  {link['backup_id']}: ({link['start']}, {link['end']}] "
                     f"{link['items']:,} items{note}", markup=False)  # fmt: skip
    for x in part["lost_ranges"]:
        stdout.print(f"  lost writes: {x['backup_id']} seqs ({x['from']}, {x['to']}]",
                     markup=False)  # fmt: skip


def verify_cmd(
    repo: Repo,
    bucket: Bucket = None,
    repair: Annotated[
        bool, typer.Option("--repair", help="Rewrite a lost or damaged manifest file.")
    ] = False,
    no_progress: NoProgress = False,
    show_all: AllRows = False,
    json_out: JsonOutput = False,
    metrics_file: MetricsFile = None,
) -> None:
    """Check a repository."""
    with one_shot(metrics_file, "verify", bucket) as run:
        _verify(repo, bucket, repair, no_progress, show_all, json_out, run.done)


def _verify(repo: Path, bucket: str | None, repair: bool, no_progress: bool, show_all: bool,
            json_out: bool, done: Callable[[str, int, int, bool], None]) -> None:  # fmt: skip
    show = sys.stderr.isatty() and not no_progress
    with Progress("verify", "items", show=show) as bar:

        def tick(segments: int, total: int, records: int, nbytes: int) -> None:
            bar.update(records, parts=(segments, total), unit="segments", nbytes=nbytes)

        reports = verify(repo, bucket, repair=repair, on_progress=tick)
    for r in reports:
        done(r.bucket, r.records, r.bytes, not r.unrepaired)
    problems = [p for r in reports for p in r.unrepaired]
    if json_out:
        print_json({"ok": not problems, "buckets": [r.to_json() for r in reports]})
    else:
        for r in reports:
            left, fixed = len(r.unrepaired), len(r.problems) - len(r.unrepaired)
            status = "ok" if not left else f"{left} problem(s)"
            if fixed:
                status += f", {fixed} repaired"
            if r.warnings:
                status += f", {plural(len(r.warnings), 'warning')}"
            if r.leftovers:
                status += f", {plural(len(r.leftovers), 'leftover')}"
            stdout.print(
                f"{r.bucket}: {plural(r.backups, 'backup')}, {plural(r.segments, 'segment')}, "
                f"{r.records:,} items, {human_bytes(r.bytes)} read: {status}",
                markup=False,
            )
            shown, left_out = first_rows(r.problems, show_all, 20)
            for p in shown:
                stdout.print(f"  {p}", markup=False)
            more_line(left_out, "problems")
            for w in r.warnings:
                stdout.print(f"  warning: {w}", markup=False)
            for line in interrupted_lines(r.resumable, r.leftovers):
                stdout.print(f"  {line}", markup=False)
        if any(p.kind == "manifest" for p in problems):
            hint(f"a manifest file with a valid twin is rewritten by: upr verify --repo {repo} "
                 "--repair")  # fmt: skip
    if problems:
        raise typer.Exit(1)
