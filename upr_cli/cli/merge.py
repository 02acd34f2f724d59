"""`upr merge`: merge a chain into one full backup, on this machine (upr_cli/jobs/merge.py)."""

from __future__ import annotations

import sys

import typer

from upr_cli.cli.options import Bucket, JsonOutput, NoProgress, Repo, Through
from upr_cli.cli.output import Progress, print_json, stdout
from upr_cli.metrics import MetricsFile, one_shot, repo_bucket

HELP = """Merge a repository's chain into one full backup, on one machine.

The backup equals the chain's state at --through (latest by default). Reads each
partition's chain (checksums verified), keeps the latest version of every document
(tombstones too, so a restore deletes what the chain deletes; the collections dropped
by then left out) and writes one ordinary segment per partition into a new backup
directory, one partition at a time: memory stays flat however long the chain is. The
manifest is committed only after every partition is written, so a failed or killed
merge leaves nothing visible (the next backup or merge sweeps its directory). The
merged backup is a full backup: `upr info` lists it, and restoring it equals restoring
the chain at --through. The older backups stay (nothing is deleted). Through an older
backup B, the merge sorts right after B and the backups after B go on from it
(formats/repository.md §8.9): every state is unchanged (a partition a later backup
rolled back inside B's range is split there into more segments).

The same as `upr spark merge`, on one machine; use that one for a repository too large
for one.

Example:

  upr merge --repo /backups/cb

Example (through an older backup, as JSON):

  upr merge --repo /backups/cb --through 20261121T071033.959105Z --json

--metrics-file PATH writes Prometheus metrics at the end, success or failure (result,
duration, the items and bytes written: docs/metrics.md), for node_exporter's textfile
collector.
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("merge", help=HELP, no_args_is_help=True)(merge_cmd)


def merge_cmd(
    repo: Repo,
    through: Through = "latest",
    bucket: Bucket = None,
    no_progress: NoProgress = False,
    json_out: JsonOutput = False,
    metrics_file: MetricsFile = None,
) -> None:
    """Merge a chain into one full backup."""
    from upr_cli.jobs.merge import merge

    show = sys.stderr.isatty() and not no_progress
    label = bucket or (repo_bucket(repo) if metrics_file is not None else "")
    with (
        one_shot(metrics_file, "merge", label) as run,
        Progress("merge", "items", show=show) as bar,
    ):

        def tick(done: int, total: int, items: int) -> None:
            bar.update(items, parts=(done, total))

        summary = merge(repo, through=through, bucket=bucket, progress=tick)
        run.done(label, summary.records, summary.bytes_written)
    if json_out:
        print_json(summary.to_json())
        return
    stdout.print(
        f"merged {summary.merged} backups through {summary.through} into full backup "
        f"{summary.backup_id}: {summary.partitions} partitions, {summary.records:,} "
        f"items, {summary.bytes_written / 1e6:,.1f} MB in {summary.seconds:.1f}s",
        markup=False,
        highlight=False,
    )
