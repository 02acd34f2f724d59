"""`upr prune` and `upr remove`: retention, dry run by default (upr_cli/jobs/prune.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from upr_cli.cli.options import AllRows, Bucket, JsonOutput, Repo, wait_seconds
from upr_cli.cli.output import (
    first_rows,
    hint,
    human_bytes,
    keep_whole,
    more_line,
    notice,
    plural,
    print_json,
    stdout,
    table,
)
from upr_cli.errors import UsageError
from upr_cli.jobs.prune import BucketPlan, PruneResult, run
from upr_cli.jobs.retention import Duration, KeepRules
from upr_cli.metrics import MetricsFile, OneShot, one_shot
from upr_cli.repo import Repository

PRUNE_HELP = """Remove the backups no keep rule keeps; what the kept ones restore stays.

Keep rules combine as restic's `forget` rules do: a backup any rule keeps is kept.
--keep-last N keeps the N newest; --keep-within D every backup committed at most D
(36h, 14d, 2w, 6m, 1y6m) before the newest; --keep-hourly, --keep-daily, --keep-weekly
and --keep-monthly N the newest backup of each of the N most recent hours, days, ISO
weeks or months that have one. A backup's time is when it committed, and periods are
counted in the local time zone (the plan names it; set TZ to count in another).
Buckets are pruned independently.

Nothing changes without --apply: the plan lists each backup, kept (and why) or
removed, the records merged forward and the bytes freed. Removing a backup never
changes what a kept backup restores: the records of removed backups that a later kept
backup still needs are merged forward into it (a new revision of it, under the same
id), and so are their lost writes (records above a rollback cut, which salvage and
examine read); --drop-lost-writes drops those instead, and the plan says how many.

--apply waits up to --wait seconds (default 0: refuse at once) for commands reading
the bucket (restore, verify, …) to finish, and names them. A prune killed at any
point leaves every kept backup restorable; the next prune, backup or merge sweeps
what it left.

Exit status: 0 done (or planned), 1 locked or failed, 2 usage error.

Example (what 7 daily and 4 weekly backups would keep, changing nothing):

  upr prune --repo /backups/cb --keep-daily 7 --keep-weekly 4

Example (apply it, for one bucket, as a cron job):

  upr prune --repo /backups/cb --bucket travel --keep-within 14d --keep-monthly 12 \\
      --apply --json

--metrics-file PATH writes Prometheus metrics at the end, success or failure, per
bucket: last success time, duration, backups removed (items) and bytes freed (planned
ones on a dry run), and the result (docs/metrics.md), for node_exporter's textfile
collector.

Example (the nightly prune, its metrics for node_exporter):

  upr prune --repo /backups/cb --keep-daily 7 --apply \\
      --metrics-file /var/lib/node_exporter/textfile/upr-prune.prom
"""

REMOVE_HELP = """Remove the named backups; what the other backups restore stays.

BACKUP is a backup id, a unique prefix of one (20261121T06), or a range A..B,
inclusive, whose ends are ids or their starts: 202611..202611 is every backup of
November 2026 (ids are UTC times), and an open end is the oldest or the newest.
As with prune, the records a later backup still needs, and the lost writes, are
merged forward into the next kept backup, and nothing changes without --apply.

Exit status: 0 done (or planned), 1 locked or failed, 2 usage error.

Example (plan the removal of one backup):

  upr remove --repo /backups/cb 20261121T061500.123456Z

Example (remove everything of November, for bucket travel):

  upr remove --repo /backups/cb --bucket travel 202611..202611 --apply
"""


def register(app: typer.Typer) -> None:
    """Add the commands to the app."""
    app.command("prune", help=PRUNE_HELP, no_args_is_help=True)(prune_cmd)
    app.command("remove", help=REMOVE_HELP, no_args_is_help=True)(remove_cmd)


Apply = Annotated[
    bool, typer.Option("--apply/--dry-run", help="Change the repository (default: plan only).")
]
DropLost = Annotated[
    bool,
    typer.Option(
        "--drop-lost-writes",
        help="Drop the removed backups' lost writes instead of merging them forward.",
    ),
]
LockWait = Annotated[
    float,
    typer.Option(
        "--wait",
        metavar="SECONDS",
        parser=wait_seconds,
        help="With --apply, wait this long for readers of the bucket (0: refuse).",
    ),
]


def _count(flag: str, what: str) -> Any:
    return typer.Option(flag, min=0, metavar="N", help=what)


KeepLast = Annotated[int, _count("--keep-last", "Keep the N newest.")]
KeepHourly = Annotated[int, _count("--keep-hourly", "Newest of each of N hours.")]
KeepDaily = Annotated[int, _count("--keep-daily", "Newest of each of N days.")]
KeepWeekly = Annotated[int, _count("--keep-weekly", "Newest of each of N ISO weeks.")]
KeepMonthly = Annotated[int, _count("--keep-monthly", "Newest of each of N months.")]
KeepWithin = Annotated[
    str | None,
    typer.Option(
        "--keep-within",
        metavar="DURATION",
        help="Keep those at most DURATION older than the newest (36h, 14d).",
    ),
]
Backups = Annotated[
    list[str], typer.Argument(metavar="BACKUP", help="Ids, prefixes or ranges A..B.")
]


def prune_cmd(
    repo: Repo,
    bucket: Bucket = None,
    keep_last: KeepLast = 0,
    keep_within: KeepWithin = None,
    keep_hourly: KeepHourly = 0,
    keep_daily: KeepDaily = 0,
    keep_weekly: KeepWeekly = 0,
    keep_monthly: KeepMonthly = 0,
    apply: Apply = False,
    drop_lost: DropLost = False,
    wait: LockWait = 0.0,
    show_all: AllRows = False,
    json_out: JsonOutput = False,
    metrics_file: MetricsFile = None,
) -> None:
    """Prune by keep rules."""
    within = Duration.parse(keep_within) if keep_within else None
    rules = KeepRules(keep_last, within, keep_hourly, keep_daily, keep_weekly, keep_monthly)
    if not rules.given:
        raise UsageError(
            "give at least one keep rule (--keep-last, --keep-within, --keep-hourly, "
            "--keep-daily, --keep-weekly, --keep-monthly): prune keeps nothing by default"
        )
    with one_shot(metrics_file, "prune", bucket) as shot:
        _run(repo, bucket, rules, (), apply, drop_lost, wait, show_all, json_out, shot)


def remove_cmd(
    backups: Backups,
    repo: Repo,
    bucket: Bucket = None,
    apply: Apply = False,
    drop_lost: DropLost = False,
    wait: LockWait = 0.0,
    show_all: AllRows = False,
    json_out: JsonOutput = False,
) -> None:
    """Remove named backups."""
    _run(repo, bucket, None, backups, apply, drop_lost, wait, show_all, json_out)


def _readers_gone(wait: float) -> Any:
    """The exclusive side of the readers' lock, waiting up to `wait` seconds."""

    @contextlib.contextmanager
    def hold(repo: Repository, bucket: str) -> Iterator[None]:
        from upr_cli.repo.readers import ExclusiveAccess, describe_readers

        def say(readers: list[Any]) -> None:
            notice(f"{bucket}: waiting up to {wait:g}s for {describe_readers(readers)}")

        with ExclusiveAccess(repo, bucket, wait=wait, on_wait=say):
            yield

    return hold


def _run(repo: Path, bucket: str | None, rules: KeepRules | None, names: Any, apply: bool,
         drop_lost: bool, wait: float, show_all: bool, json_out: bool,
         shot: OneShot | None = None) -> None:  # fmt: skip
    result = run(repo, bucket=bucket, rules=rules, names=names, apply_=apply,
                 drop_lost=drop_lost, hold=_readers_gone(wait),
                 on_event=None if json_out else notice)  # fmt: skip
    for b in result.buckets if shot is not None else ():
        freed = b.written.get("bytes_freed") if result.applied else b.bytes_removed
        assert shot is not None
        shot.done(b.bucket, len(b.removed), freed or 0)
    if json_out:
        print_json(result.to_json())
        return
    for b in result.buckets:
        _show(result, b, show_all)
    if not apply:
        hint("dry run: nothing changed; run again with --apply to do it")


def _show(result: PruneResult, b: BucketPlan, show_all: bool) -> None:
    rows = _rows(b)
    shown, left_out = first_rows(rows, show_all, n=40)
    what = "plan" if not result.applied else "done"
    t = _table(f"{b.bucket}: {what} ({result.rules}; times in {result.time_zone})")
    for r in shown:
        t.add_row(*r)
    stdout.print(t)
    more_line(left_out, "backups")
    kept = len(b.chain) - len(b.removed)
    lines = [f"{b.bucket}: keep {plural(kept, 'backup')}, remove {len(b.removed)} "
             f"({human_bytes(b.bytes_removed)})"]  # fmt: skip
    if b.steps:
        lines.append(f"  records still needed merged forward into "
                     f"{plural(len(b.steps), 'kept backup')}")  # fmt: skip
    if b.lost_writes:
        fate = "dropped (--drop-lost-writes)" if b.drop_lost else "carried forward"
        lines.append(f"  {b.lost_writes:,} lost-write records {fate}")
    if result.applied:
        lines.append(f"  wrote {human_bytes(b.written.get('bytes_written') or 0)}, "
                     f"freed {human_bytes(b.written.get('bytes_freed') or 0)}")  # fmt: skip
    elif b.removed:
        lines.append(f"  frees up to {human_bytes(b.bytes_removed)}")
    for line in lines:
        stdout.print(line, markup=False, highlight=False)


def _table(title: str) -> Table:
    t = table(title)
    for col in ("backup", "committed", "action", "why (kept) / merged into"):
        t.add_column(col, no_wrap=col != "why (kept) / merged into", overflow="fold")
    return keep_whole(t, "backup", "action")


def _rows(b: BucketPlan) -> list[tuple[str, str, str, str]]:
    reasons = {d.backup_id: (d.time, d.reasons) for d in b.decisions}
    gone = {m.backup_id for m in b.removed}
    out = []
    for m in b.chain:
        t, why = reasons[m.backup_id]
        if m.backup_id in gone:
            into = b.merged_into(m.backup_id)
            action = "remove"
            detail = f"into {into}" if into is not None else "nothing newer kept"
        else:
            action = "keep"
            detail = ", ".join(why)
        out.append((str(m.backup_id), t.strftime("%Y-%m-%d %H:%M"), action, detail))
    return out
