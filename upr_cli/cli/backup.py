"""`upr backup`: incremental backups that survive failovers."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import typer
from rich.table import Table

from upr_cli.cli.options import (
    JsonOutput,
    NodeUri,
    NoProgress,
    Partitions,
    Repo,
    SparkConf,
    SparkMaster,
    SparkTasks,
)
from upr_cli.cli.output import PartitionProgress, print_json, stderr, stdout
from upr_cli.jobs.backup import backup
from upr_cli.jobs.backup_stream import StreamStats
from upr_cli.net.uri import SourceUri
from upr_cli.source import selected

HELP = """Back up a bucket into a repository, incrementally, through failovers.

The first run (or --full) streams every partition from 0; later runs stream each
partition from where the newest committed backup ended, up to the high seqnos read at
the start. When the source failed over or restarted uncleanly, the rollback is recorded
and the backup continues from the rollback point; the lost writes stay in the older
backup, readable. A failover while the run streams (a cluster) is followed the same way:
what the rollback took back moves to cut-back segments, kept as lost writes, and the run
completes with each partition as its new active holds it (a partition whose stream had
already ended gets a follow-up backup that records the rollback). A backup exists once its
manifest (manifest.json.copy, then manifest.json) is written; an interrupted run leaves
nothing visible. The repository is created on first use (formats/repository.md).

The next run after an interrupted one reuses the segments it finished and streams each
of those partitions on to the new high seqnos, so every backup holds everything
acknowledged before it started. A backup goes on only from a chain that is whole: a
manifest file whose twin is valid is rewritten from it (with a warning); a damaged
manifest, a missing parent backup, a seq gap or a missing segment file stops it, naming
the problem, before anything is streamed (`upr verify --repair`, or --full to start a
new chain). Nothing holding committed data is ever removed.

Example:

  upr backup upr://admin@127.0.0.1:11210/default --repo /backups/cb

Example (a new chain, after a backup refused a broken one):

  upr backup upr://admin@127.0.0.1:11210/default --repo /backups/cb --full

--spark MASTER divides the partitions among Spark tasks (--spark-tasks, default 8;
--conf k=v passes Spark settings): each streams its share into the new backup's
directory, which every executor must share; the high seqs are pinned once and the
manifest is committed by this process after every task succeeded, so the result is the
backup a local run of the same seqs would make.

Example (a new full backup, summary as JSON):

  upr backup upr://admin@127.0.0.1/default --repo /backups/cb --full --json
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("backup", help=HELP, no_args_is_help=True)(backup_cmd)


def backup_cmd(
    uri: NodeUri,
    repo: Repo,
    full: Annotated[bool, typer.Option("--full", help="Stream everything from 0 again.")] = False,
    partitions: Partitions = None,
    no_progress: NoProgress = False,
    spark: SparkMaster = None,
    spark_tasks: SparkTasks = 8,
    conf: SparkConf = None,
    json_out: JsonOutput = False,
) -> None:
    """Back up a bucket."""
    source = SourceUri.parse(uri)
    show = sys.stderr.isatty() and not no_progress
    with PartitionProgress("backup", "partitions", show=show) as bar:

        def tick(s: StreamStats) -> None:
            bar.update(s.partitions_done, s.partitions, s.items, "items", s.started)

        sess = None
        streamer = None
        if spark is not None:
            from upr_cli.spark.distributed import spark_streamer
            from upr_cli.spark.jobs import parse_conf, session

            sess = session(spark, parse_conf(conf or []), app="upr backup")
            streamer = spark_streamer(sess, spark_tasks)
        try:
            summary = asyncio.run(
                backup(
                    source,
                    repo,
                    full=full,
                    partitions=selected(partitions),
                    on_progress=tick,
                    on_warning=lambda w: stderr.print(f"warning: {w}"),
                    streamer=streamer,
                )
            )
        finally:
            if sess is not None:
                sess.stop()
    if json_out:
        print_json(summary.to_json())
        return
    d = summary.to_json()
    kind = "full" if summary.full else "incremental"
    table = Table(title=f"backup {summary.backup_id} of {summary.bucket} ({kind})")
    for col in ("items", "read", "written", "ratio", "time", "rate", "rollbacks"):
        table.add_column(col, justify="right")
    table.add_row(
        f"{summary.items:,}",
        _mb(summary.bytes_read),
        _mb(summary.bytes_written),
        f"{d['ratio']}" if d["ratio"] else "-",
        f"{summary.seconds:.2f}s",
        f"{d['items_per_s']:,}/s" if d["items_per_s"] else "-",
        str(len(summary.rollbacks)),
    )
    stdout.print(table)
    for rb in summary.rollbacks:
        when = " during the run" if rb["during_run"] else ""
        kept = (f"; {rb['cut_records']:,} records it took back kept as lost writes"
                if rb["cut_records"] else "")  # fmt: skip
        stdout.print(
            f"partition {rb['partition']}: rolled back{when} from {rb['from']} to {rb['to']} "
            f"(seed rule {rb['seed_rule_seq']}, producer {rb['producer_seq']}){kept}"
        )
    for fid in summary.follow_ups:
        stdout.print(f"follow-up backup {fid}: the partitions a failover overtook after their "
                     "streams ended, now as their active holds them")  # fmt: skip


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"
