"""`upr backup`: incremental backups that survive failovers."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from upr_cli import interrupt
from upr_cli.cli.options import (
    AllRows,
    CaCert,
    ClientCert,
    ClientKey,
    Compression,
    JsonOutput,
    MemoryLimitOption,
    NodeUri,
    NoProgress,
    NoVerify,
    OldSparkMaster,
    Partitions,
    PasswordFile,
    Repo,
    SparkConf,
    SparkMaster,
    SparkTasks,
    Wait,
    duration_seconds,
    either,
    size_bytes,
    tls_source,
)
from upr_cli.cli.output import (
    Progress,
    first_rows,
    hint,
    human_bytes,
    keep_whole,
    more_line,
    notice,
    plural,
    print_json,
    stderr,
    stdout,
    table,
)
from upr_cli.collections import parse_paths
from upr_cli.errors import UsageError
from upr_cli.jobs.backup import BackupSummary, PartitionRollback, backup
from upr_cli.jobs.backup_dry_run import BackupPlan, plan_backup
from upr_cli.jobs.backup_stream import DEFAULT_MEMORY, StreamStats
from upr_cli.jobs.follow import (
    COMMIT_BYTES,
    COMMIT_EVERY,
    CommitReport,
    FollowOptions,
    follow,
)
from upr_cli.metrics import (
    DEFAULT_HOST,
    MetricsFile,
    MetricsHost,
    MetricsPerPartition,
    MetricsPort,
    one_shot,
)
from upr_cli.net.uri import SourceUri
from upr_cli.source import selected

if TYPE_CHECKING:
    from upr_cli.collections import Path as CollectionPath
    from upr_cli.dcp.consumer import WireCompression
    from upr_cli.memory import MemoryLimit
    from upr_cli.metrics import FollowMetrics

HELP = """Back up a bucket into a repository, incrementally, through failovers.

The first run (or --full) streams every partition from 0; later runs stream each
partition from where the newest committed backup ended, up to the high seqnos read at
the start. When the source failed over or restarted uncleanly, the rollback is recorded
and the backup continues from the rollback point; the lost writes stay in the older
backup, readable. A failover while the run streams (a cluster) is followed the same way:
what the rollback took back moves to cut-back segments, kept as lost writes, and the run
completes with each partition as its new active holds it (a partition whose stream had
already ended gets a follow-up backup that records the rollback). A node that goes away
while the run streams is reconnected for up to --wait seconds (120; 0 for no waiting),
with a line on stderr when the link is lost and when it is back; one that restarted
from a crash ends the run at what it holds then, the rollback recorded as after a
failover. A backup exists once its
manifest (manifest.json.copy, then manifest.json) is written; an interrupted run leaves
nothing visible. The repository is created on first use (formats/repository.md).

The next run after an interrupted one reuses the segments it finished and streams each
of those partitions on to the new high seqnos, so every backup holds everything
acknowledged before it started. A backup goes on only from a chain that is whole: a
manifest file whose twin is valid is rewritten from it (with a warning); a damaged
manifest, a missing parent backup, a seq gap or a missing segment file stops it, naming
the problem, before anything is streamed (`upr verify --repair`, or --full to start a
new chain). Nothing holding committed data is ever removed.

Every collection is backed up, with the source's collections manifest and the
collections and scopes created and dropped while it ran. --include-data backs up only
the scopes and collections it names (SCOPE or SCOPE.COLLECTION, comma-separated or
repeated; filtered by the source; --collections, as tail, replay and load name it, is
the same option), --exclude-data every other one; the two cannot be combined, as in
cbbackupmgr. The repository records the filter, so a restore knows a
collection left out was not backed up rather than empty; an incremental backup keeps
its chain's filter (--full starts a chain with another one), and still records the drop
of a collection the chain followed that was dropped (or dropped and created again)
since; a name the chain had that is gone for good is no error. A source without
collections (an older server) has only _default._default.

Xattrs (extended attributes: Sync Gateway's _sync, transactions' _txn, an application's
own) are backed up with their documents, and with the tombstones that kept them: the
connection negotiates XATTR and opens DCP with IncludeXattrs and
IncludeDeletedUserXattrs, and the segments keep each record's xattrs
(formats/segment.md "Xattrs"). `upr restore` writes them back.

Example:

  upr backup upr://admin@127.0.0.1:11210/default --repo /backups/cb

Example (a new chain, after a backup refused a broken one):

  upr backup upr://admin@127.0.0.1:11210/default --repo /backups/cb --full

--master URL divides the partitions among Spark tasks on that Spark master (local[*],
spark://…, yarn; --spark-tasks, default 8; --conf k=v passes Spark settings; --spark,
the old spelling of --master, still works, with a warning): each streams its share
into the new backup's directory, which every executor must share; the high seqs are
pinned once and the manifest is committed by this process after every task succeeded,
so the result is the backup a local run of the same seqs would make.

Example (only scope app, except its collection logs is left out in the second form):

  upr backup upr://admin@127.0.0.1/default --repo /backups/app --include-data app
  upr backup upr://admin@127.0.0.1/default --repo /backups/nolog --exclude-data app.logs

Example (a new full backup, summary as JSON):

  upr backup upr://admin@127.0.0.1/default --repo /backups/cb --full --json

--dry-run says what the backup would take, and writes nothing (no repository created,
no lock taken): full or incremental (after which backup), per partition the seqs from
where the chain ended (or the rollback point the source forces) to the high seq now,
at most how many items (the sum of those ranges: an upper bound, as DCP deduplicates),
and the rollbacks it would record.

Example (what tonight's backup would take, as JSON):

  upr backup upr://admin@127.0.0.1/default --repo /backups/cb --dry-run --json

--follow keeps the streams open once the backup has caught up and commits a restore
point every --commit-every (a duration: 1s, 30s, 5m; default 30s) or once
--commit-bytes (default 64MB) have arrived, whichever comes first, each at a snapshot
boundary: the writes at risk are seconds, not hours. Each commit is one pack file and a
manifest whatever the partition count, crash-safe as a backup; the repository's lock is
held only while it commits, so prune, remove and readers run meanwhile. SIGINT or
SIGTERM commits what it holds and exits 0; a SIGKILL loses only the uncommitted tail,
which the next run streams again (the outage shows in `upr info` as a coarse stretch).
`upr restore --at-time` then restores any moment of the restorable range.

Example (continuous backup, a restore point every 10 seconds):

  upr backup upr://admin@127.0.0.1/default --repo /backups/cb --follow \\
      --commit-every 10s

--metrics-port PORT (with --follow) serves Prometheus metrics on --metrics-host
(default 127.0.0.1): items, bytes and commits, the time of the last commit, the lag in
seqs and seconds, rollbacks, lost writes, reconnects, errors by kind, process memory
(docs/metrics.md). --metrics-per-partition labels the lag by partition too. A one-shot
backup takes --metrics-file PATH instead: its last success time, duration, items,
bytes and result, written at the end (success or failure) for node_exporter's textfile
collector.

Example (continuous backup, metrics for Prometheus on port 9464):

  upr backup upr://admin@127.0.0.1/default --repo /backups/cb --follow \\
      --metrics-port 9464

Example (a nightly backup from cron, its metrics for node_exporter):

  upr backup upr://admin@127.0.0.1/default --repo /backups/cb \\
      --metrics-file /var/lib/node_exporter/textfile/upr-backup.prom

Example (a new repository, encrypted at rest with a random key file; keep a copy of
the key, or add a second one with upr repo add-key: a lost key loses the backups):

  head -c 32 /dev/urandom > k
  upr backup upr://admin@127.0.0.1/default --repo /bk/x --encrypt --key-file k
"""


IncludeData = Annotated[
    list[str] | None,
    typer.Option(
        "--include-data",
        "--collections",
        metavar="PATHS",
        help="Back up only these: SCOPE or SCOPE.COLLECTION, comma-separated or repeated.",
        show_default=False,
    ),
]
Follow = Annotated[
    bool,
    typer.Option(
        "--follow",
        help="Keep streaming after catching up; commit a restore "
        "point every --commit-every (continuous backup).",
    ),
]
CommitEvery = Annotated[
    float,
    typer.Option("--commit-every", metavar="DURATION", parser=duration_seconds,
                 show_default=False,
                 help="With --follow: commit at least this often (1s, 30s, 5m; default 30s)."),
]  # fmt: skip
CommitBytes = Annotated[
    int,
    typer.Option("--commit-bytes", metavar="SIZE", parser=size_bytes, show_default=False,
                 help="With --follow: commit once this much has arrived (default 64MB)."),
]  # fmt: skip
ExcludeData = Annotated[
    list[str] | None,
    typer.Option(
        metavar="PATHS",
        help="Back up every collection but these (SCOPE or SCOPE.COLLECTION).",
        show_default=False,
    ),
]


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("backup", help=HELP, no_args_is_help=True)(backup_cmd)


def backup_cmd(
    uri: NodeUri,
    repo: Repo,
    full: Annotated[bool, typer.Option("--full", help="Stream everything from 0 again.")] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Say what a backup would take; write nothing."),
    ] = False,
    partitions: Partitions = None,
    no_progress: NoProgress = False,
    master: SparkMaster = None,
    old_spark: OldSparkMaster = None,
    spark_tasks: SparkTasks = 8,
    conf: SparkConf = None,
    show_all: AllRows = False,
    json_out: JsonOutput = False,
    include_data: IncludeData = None,
    exclude_data: ExcludeData = None,
    wait: Wait = 120.0,
    compression: Compression = "auto",
    memory: MemoryLimitOption = DEFAULT_MEMORY,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
    follow_: Follow = False,
    commit_every: CommitEvery = COMMIT_EVERY,
    commit_bytes: CommitBytes = COMMIT_BYTES,
    encrypt: Annotated[
        bool,
        typer.Option(
            "--encrypt",
            help="Create a new repository encrypted (its key: --key-file, "
            "--key-command, UPR_KEY_FILE or UPR_PASSPHRASE); an encrypted one is always "
            "used encrypted.",
        ),
    ] = False,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = DEFAULT_HOST,
    metrics_per_partition: MetricsPerPartition = False,
    metrics_file: MetricsFile = None,
) -> None:
    """Back up a bucket."""
    spark = either(master, old_spark, None, ("--master", "--spark"))
    source = tls_source(SourceUri.parse(uri), cacert, no_verify, cert, key)
    include, exclude = parse_paths(include_data), parse_paths(exclude_data)
    if dry_run:
        if follow_ or spark is not None or metrics_file is not None:
            raise UsageError("--dry-run writes nothing: it does not combine with --follow, "
                             "--master or --metrics-file")  # fmt: skip
        plan = asyncio.run(plan_backup(source, repo, full=full, partitions=selected(partitions),
                                       include=include, exclude=exclude))  # fmt: skip
        if json_out:
            print_json(plan.to_json())
        else:
            render_plan(plan, show_all)
        return
    if follow_:
        if spark is not None:
            raise UsageError("--follow streams from this process: it cannot take --master")
        if metrics_file is not None:
            raise UsageError("--metrics-file is for a one-shot backup: a follower serves "
                             "its metrics with --metrics-port")  # fmt: skip
        opts = FollowOptions(commit_every, commit_bytes, full=full,
                             partitions=selected(partitions), include=tuple(include),
                             exclude=tuple(exclude), wait=wait, compression=compression,
                             memory=memory, encrypt=encrypt)  # fmt: skip
        metrics = (None if metrics_port is None else
                   (metrics_host, metrics_port, metrics_per_partition))  # fmt: skip
        run_follow(source, repo, opts, json_out=json_out, no_progress=no_progress,
                   metrics=metrics)  # fmt: skip
        return
    if commit_every != COMMIT_EVERY or commit_bytes != COMMIT_BYTES:
        raise UsageError("--commit-every and --commit-bytes go with --follow")
    if metrics_port is not None or metrics_per_partition or metrics_host != DEFAULT_HOST:
        raise UsageError("--metrics-port, --metrics-host and --metrics-per-partition go with "
                         "--follow; a one-shot backup writes --metrics-file")  # fmt: skip
    with one_shot(metrics_file, "backup", source.bucket) as run:
        summary = _backup_once(source, repo, full, partitions, no_progress, spark, spark_tasks,
                               conf, include, exclude, wait, compression, memory,
                               encrypt)  # fmt: skip
        run.done(summary.bucket, summary.items, summary.bytes_written)
    if json_out:
        print_json(summary.to_json())
        return
    render(summary, show_all, str(repo))


def _backup_once(source: SourceUri, repo: Path, full: bool, partitions: str | None,
                 no_progress: bool, spark: str | None, spark_tasks: int,
                 conf: list[str] | None, include: list[CollectionPath],
                 exclude: list[CollectionPath], wait: float, compression: WireCompression,
                 memory: MemoryLimit, encrypt: bool) -> BackupSummary:  # fmt: skip
    """One backup, with its bar (and Spark with --master)."""
    show = sys.stderr.isatty() and not no_progress
    with Progress("backup", "items", show=show) as bar:
        bar.note(f"connecting to {source.redacted()}")

        last: list[StreamStats] = []
        interrupt.keeps(lambda: kept_line(last[0] if last else None))

        def tick(s: StreamStats) -> None:
            last[:] = [s]
            # the bar and the ETA follow the seqs passed (a deduplicated key comes once:
            # counted items fall short of the seqs); 0 (nothing planned) gives no total
            bar.update(s.items, total=s.items_total or None, done=s.seqs_done,
                       parts=(s.partitions_done, s.partitions), started=s.started,
                       nbytes=s.bytes_in)  # fmt: skip

        sess = None
        streamer = None
        if spark is not None:
            from upr_cli.spark.distributed import spark_streamer
            from upr_cli.spark.jobs import parse_conf, session

            bar.note(f"starting Spark ({spark})")
            sess = session(spark, parse_conf(conf or []), app="upr backup")
            streamer = spark_streamer(sess, spark_tasks, repo)
        try:
            summary = asyncio.run(
                backup(
                    source,
                    repo,
                    full=full,
                    partitions=selected(partitions),
                    on_progress=tick,
                    on_warning=lambda w: stderr.print(f"warning: {w}", markup=False),
                    streamer=streamer,
                    include=include,
                    exclude=exclude,
                    wait=wait,
                    on_notice=notice,
                    compression=compression,
                    memory=memory,
                    encrypt=encrypt,
                )
            )
        finally:
            if sess is not None:
                sess.stop()
    return summary


def kept_line(stats: StreamStats | None) -> str:
    """What a backup a signal stopped kept, and how to go on (its finished segments stay
    for the next run, which reuses them)."""
    done = f" and the segments of {stats.partitions_done:,} of {stats.partitions:,} partitions " \
        "this run finished" if stats is not None and stats.partitions else ""  # fmt: skip
    return f"the repository keeps its committed backups{done}; run the same command to resume"


def summary_table(summary: BackupSummary) -> Table:
    """The backup's one-row summary: items, bytes, ratio, time, rate, rollbacks."""
    d = summary.to_json()
    kind = "full" if summary.full else "incremental"
    t = table(f"backup {summary.backup_id} of {summary.bucket} ({kind})")
    for col in ("items", "read", "written", "ratio", "time", "rate", "rollbacks"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_row(
        f"{summary.items:,}",
        human_bytes(summary.bytes_read),
        human_bytes(summary.bytes_written),
        f"{d['ratio']}" if d["ratio"] else "-",
        f"{summary.seconds:.2f}s",
        f"{d['items_per_s']:,}/s" if d["items_per_s"] else "-",
        str(len(summary.rollbacks)),
    )
    return keep_whole(t)


def rollback_table(rollbacks: Sequence[PartitionRollback]) -> Table:
    """One row a rolled-back partition: from, to, and the records kept as lost writes."""
    t = table()
    for col in ("partition", "rolled back from", "to", "when", "lost writes kept"):
        t.add_column(col, justify="left" if col == "when" else "right", no_wrap=True)
    for rb in rollbacks:
        t.add_row(str(rb.partition), str(rb.from_seq), str(rb.to_seq),
                  "during the run" if rb.during_run else "at the start",
                  f"{rb.cut_records:,}" if rb.cut_records else "-")  # fmt: skip
    return keep_whole(t)


def render(summary: BackupSummary, show_all: bool, repo: str) -> None:
    """The summary; the rollbacks counted, the first few listed; what to do next."""
    stdout.print(summary_table(summary))
    if summary.collections > 1 or summary.manifest_changes:
        changes = f", {summary.manifest_changes:,} collection changes met" if (
            summary.manifest_changes) else ""  # fmt: skip
        stdout.print(f"{summary.collections:,} collections backed up{changes}", markup=False,
                     highlight=False)  # fmt: skip
    rollbacks = summary.rollbacks
    if rollbacks:
        during = sum(1 for rb in rollbacks if rb.during_run)
        also = f" ({during:,} during the run)" if during else ""
        stdout.print(f"{len(rollbacks):,} partitions rolled back{also}", markup=False,
                     highlight=False)  # fmt: skip
        rows, left_out = first_rows(rollbacks, show_all)
        stdout.print(rollback_table(rows))
        more_line(left_out, "rolled-back partitions")
        hint(f"lost writes may be recoverable: upr salvage --repo {repo} --into URI")
    for fid in summary.follow_ups:
        stdout.print(f"follow-up backup {fid}: the partitions a failover overtook after their "
                     "streams ended, now as their active holds them", markup=False)  # fmt: skip


def render_plan(plan: BackupPlan, show_all: bool) -> None:
    """`--dry-run`: what the backup would be, the partitions with seqs to take (the first
    few), the rollbacks it would record."""
    kind = "a full backup" if plan.full else f"an incremental backup after {plan.parent}"
    where = plan.repo if plan.repository_exists else f"{plan.repo} (a new repository)"
    changed = plan.changed
    lines = [
        f"dry run, nothing written: {kind}",
        f"of bucket {plan.bucket} into {where}",
        f"{plural(len(plan.ranges), 'partition')}, {len(changed):,} with seqs to take; "
        f"at most {plural(plan.estimated_items, 'item')} (the sum of the seq ranges)",
    ]
    if plan.collections > 1:
        lines.append(f"{plural(plan.collections, 'collection')}")
    stdout.print("\n".join(lines), markup=False, highlight=False)
    rows, left_out = first_rows(changed, show_all)
    if rows:
        t = table()
        for col in ("partition", "from seq", "to seq", "at most items"):
            t.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            t.add_row(str(r.partition), str(r.from_seq), str(r.to_seq), f"{r.items:,}")
        stdout.print(keep_whole(t))
        more_line(left_out, "partitions")
    if plan.rollbacks:
        stdout.print(f"{plural(len(plan.rollbacks), 'rollback')} it would record:",
                     markup=False, highlight=False)  # fmt: skip
        rbs, more = first_rows(plan.rollbacks, show_all)
        stdout.print(rollback_table(rbs))
        more_line(more, "rollbacks")
    for w in plan.warnings:
        stderr.print(f"warning: {w}", markup=False)


def run_follow(source: SourceUri, repo: Path, opts: FollowOptions, *, json_out: bool,
               no_progress: bool,
               metrics: tuple[str, int, bool] | None = None) -> None:  # fmt: skip
    """`backup --follow`: catch up (with the backup's bar), then a line per commit on
    stderr; the summary once a signal ends it (exit 0: a follower's normal end). With
    `metrics` (host, port, per partition) its metrics are served there, the port bound
    before any work (upr_cli/metrics.py)."""
    from upr_cli.metrics import FollowMetrics, serve

    watch = endpoint = None
    if metrics is not None:
        host, port, per_partition = metrics
        watch = FollowMetrics(source.bucket or "", per_partition=per_partition)
        endpoint = serve(watch.registry, host, port)
        notice(f"metrics on http://{_host_port(endpoint.host, endpoint.port)}/metrics")
    try:
        _follow(source, repo, opts, json_out=json_out, no_progress=no_progress, watch=watch)
    finally:
        if endpoint is not None:
            endpoint.close()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _follow(source: SourceUri, repo: Path, opts: FollowOptions, *, json_out: bool,
            no_progress: bool, watch: FollowMetrics | None) -> None:  # fmt: skip
    show = sys.stderr.isatty() and not no_progress
    interrupt.follows(lambda: "every commit is in the repository; run it again to go on")

    def committed(r: CommitReport) -> None:
        stderr.print(f"upr: commit {r.backup_id}: {r.partitions:,} partitions, "
                     f"{r.items:,} items, {human_bytes(r.bytes)}, lag {r.lag:.1f}s",
                     markup=False, highlight=False)  # fmt: skip

    with Progress("backup", "items", show=show) as bar:
        bar.note(f"connecting to {source.redacted()}")

        def tick(s: StreamStats) -> None:
            bar.update(s.items, total=s.items_total or None, done=s.seqs_done,
                       parts=(s.partitions_done, s.partitions), started=s.started,
                       nbytes=s.bytes_in)  # fmt: skip

        def caught_up(r: CommitReport) -> None:
            if watch is not None:
                watch.commit(r)
            if show:  # the bar says it, in place
                bar.note(f"following; last commit {r.backup_id}, lag {r.lag:.1f}s")
            else:
                committed(r)

        summary = asyncio.run(follow(source, repo, opts, on_commit=caught_up, on_progress=tick,
                                     on_warning=lambda w: stderr.print(f"warning: {w}",
                                                                       markup=False),
                                     on_notice=notice,
                                     hooks=None if watch is None else watch.hooks()))  # fmt: skip
    if json_out:
        print_json(summary.to_json())
        return
    stdout.print(
        f"followed {summary.bucket}: {summary.commits:,} commits, "
        f"{summary.items:,} items, {human_bytes(summary.bytes_written)} "
        f"(last {summary.last_commit or '-'})",
        markup=False,
        highlight=False,
    )
