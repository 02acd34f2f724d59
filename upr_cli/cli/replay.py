"""`upr replay`: keep a SQLite store in step with a node, a cluster or a repository."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from upr_cli import interrupt
from upr_cli.cli.options import (
    Bucket,
    CaCert,
    ClientCert,
    ClientKey,
    Compression,
    JsonOutput,
    MemoryLimitOption,
    NoProgress,
    NoVerify,
    Partitions,
    PasswordFile,
    Wait,
    tls_source,
)
from upr_cli.cli.output import Progress, notice, print_json, stderr, stdout
from upr_cli.collections import parse_paths
from upr_cli.errors import UsageError, check_file_path
from upr_cli.jobs.replay import ReplayStats, check_options, replay_node, replay_repo
from upr_cli.memory import MemoryLimit
from upr_cli.metrics import (
    DEFAULT_HOST,
    MetricsFile,
    MetricsHost,
    MetricsPerPartition,
    MetricsPort,
    beside,
    check_port_options,
    endpoint,
    one_shot,
    repo_bucket,
)
from upr_cli.net.uri import SourceUri
from upr_cli.source import parse_source, selected
from upr_cli.store import DEFAULT_UNDO_WINDOW

if TYPE_CHECKING:
    from upr_cli.metrics import ReplayMetrics

HELP = """Replay a source into a SQLite store that follows it like a UPR replica.

SOURCE is a live node or cluster (upr://…) or a repository (repo:URL[@BACKUP]; after
@ also a time, repo:URL@2026-12-06T14:37:00Z, a local time or -15m: each partition
at its restore point then, as `upr restore --at-time` resolves it). The
store (formats/store.md) holds the documents, each partition's position and failover
log, and a mutation log of the rows changes replaced (--undo-window entries per
partition). Each snapshot's changes commit with the new position in one transaction;
a rerun resumes from the stored positions. When the source rolls a partition back
(a failover, an unclean restart), the changes above the rollback point are undone from
the mutation log and the versions taken back are kept for `upr salvage --store`; when
the log does not reach back far enough, the partition is reset and streamed from 0.
Every rollback is printed.

--consistent commits only at barrier-cookie points, so the store always holds a cut
consistent across partitions (the catch-up to the start's high seqnos is one
transaction); a server without barrier cookies gets per-snapshot commits, said once.
--durable-only applies only what the source reports persisted (OBSERVE_SEQNO), so the
store never holds a write a crash of the source can take back. --follow keeps going
until Ctrl-C, checkpointing as it goes.

A node that goes away (a restart, a crash, a network cut) is reconnected for up to
--wait seconds (120; forever for a service, 0 for no waiting), with a line on stderr
when the link is lost and when it is back; the store resumes from its committed
positions, nothing lost. Without --follow the replay ends at the high seqnos read at
the start, capped at what the node holds after it restarted from a crash or failed
over (the rollback is undone and printed as any other).

Collections: every collection is replayed unless --collections names some (SCOPE or
SCOPE.COLLECTION, comma-separated; filtered by the source). Documents are keyed by
collection id; the scope and collection columns of the views json_documents and
named_documents give the names. A collection dropped in the stream is removed from the
store through the mutation log, so a rollback across the drop brings it back. A store
keeps the filter it was first replayed with: a rerun must give the same, and still
applies the drop of a collection it followed that was dropped (or dropped and created
again under its name) since the last run.

Xattrs: each document's extended attributes (_sync, _txn, an application's own) are
kept in the xattrs column of documents and the views, a JSON object (NULL for none); a
deleted document keeps the system xattrs its tombstone kept, and a rollback puts a
document's xattrs back with it. A store of an older schema is migrated when opened.

Example:

  upr replay upr://admin@127.0.0.1:11210/default --into /tmp/bucket.db

Example (a service: follow for good, waiting out any node restart):

  upr replay upr://admin@127.0.0.1/default --into /tmp/bucket.db --follow --wait forever

Example (follow, consistent cuts only, durable writes only):

  upr replay upr://admin@127.0.0.1/default --into /tmp/bucket.db --follow \\
      --consistent --durable-only

Example (one collection, then its documents by name):

  upr replay upr://admin@127.0.0.1/default --into /tmp/users.db --collections app.users
  sqlite3 /tmp/users.db \\
      "SELECT scope, collection, id, doc FROM json_documents LIMIT 5"

Example (from a backup repository, then query the JSON):

  upr replay repo:/backups/cb --into /tmp/bucket.db
  sqlite3 /tmp/bucket.db \\
      "SELECT id, json_extract(doc, '$.name') FROM json_documents LIMIT 5"

Example (the bucket as it was two hours ago, from a continuous backup):

  upr replay repo:/backups/cb@-2h --into /tmp/then.db

Metrics: --metrics-port PORT (with --follow) serves Prometheus metrics on
--metrics-host (default 127.0.0.1): changes and bytes applied, lag in seqs and
seconds, rollbacks, lost writes, reconnects, errors by kind, the last apply time
(docs/metrics.md); --metrics-per-partition labels the lag by partition too. A
one-shot replay takes --metrics-file PATH instead (node_exporter's textfile).

Example (a replica service with metrics for Prometheus on port 9465):

  upr replay upr://admin@127.0.0.1/default --into /tmp/bucket.db --follow \\
      --metrics-port 9465
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("replay", help=HELP, no_args_is_help=True)(replay_cmd)


UndoWindow = Annotated[
    int,
    typer.Option("--undo-window", min=0, metavar="N",
                 help="Mutation-log entries kept per partition (how far a rollback reaches)."),
]  # fmt: skip
MaxPending = Annotated[
    int,
    typer.Option("--max-pending", min=1, metavar="N",
                 help="Uncommitted changes a partition may hold (bounds memory)."),
]  # fmt: skip


_DEFAULT_MEMORY = MemoryLimit()


def replay_cmd(
    source: Annotated[
        str,
        typer.Argument(
            metavar="SOURCE", help="upr://[user[:password]@]host[:port]/bucket or repo:URL[@BACKUP]"
        ),
    ],
    into: Annotated[
        Path,
        typer.Option("--into", metavar="PATH", help="The SQLite store (created if missing)."),
    ],
    follow: Annotated[
        bool, typer.Option("--follow", help="Keep following new changes until Ctrl-C.")
    ] = False,
    consistent: Annotated[
        bool, typer.Option("--consistent", help="Commit only cuts consistent across partitions.")
    ] = False,
    durable_only: Annotated[
        bool, typer.Option("--durable-only", help="Apply only changes the source persisted.")
    ] = False,
    undo_window: UndoWindow = DEFAULT_UNDO_WINDOW,
    max_pending: MaxPending = 262_144,
    partitions: Partitions = None,
    collections: Annotated[
        str | None,
        typer.Option(
            "--collections",
            metavar="PATHS",
            help="Only these scopes or collections, filtered by the source (SCOPE or "
            "SCOPE.COLLECTION, comma-separated; a live source only).",
        ),
    ] = None,
    wait: Wait = 120.0,
    compression: Compression = "auto",
    memory: MemoryLimitOption = _DEFAULT_MEMORY,
    bucket: Bucket = None,
    no_progress: NoProgress = False,
    json_out: JsonOutput = False,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = DEFAULT_HOST,
    metrics_per_partition: MetricsPerPartition = False,
    metrics_file: MetricsFile = None,
) -> None:
    """Replay a source into a SQLite store."""
    spec = parse_source(source, ("node", "repo"))
    paths = parse_paths(collections)
    check_options(follow, consistent, durable_only, source, collections=bool(paths))
    _check_metrics(follow, metrics_port, metrics_host, metrics_per_partition, metrics_file)
    parts = selected(partitions)
    check_file_path(into, f"--into {into}")  # the store's directory, before streaming
    show = sys.stderr.isatty() and not no_progress

    def event(message: str) -> None:
        stderr.print(message, markup=False, highlight=False)

    _on_signal(follow, into)
    uri_text = spec.uri if spec.kind == "node" else None
    label = _label(spec.kind, spec.path, uri_text, bucket, metrics_file is not None)
    watch = _watch(label, metrics_port, metrics_per_partition)
    with (
        endpoint(watch.registry if watch else None, metrics_host, metrics_port),
        one_shot(metrics_file, "replay", label) as run,
        Progress("replay", "applied", show=show) as bar,
    ):
        bar.note(f"connecting to {spec.text if spec.kind == 'repo' else 'the source'}")

        def tick(s: ReplayStats) -> None:
            if watch is not None:
                watch.progress(s)
            bar.update(s.applied, parts=(s.partitions_caught_up, s.partitions),
                       unit="caught up", started=s.started, nbytes=s.bytes)  # fmt: skip

        if spec.kind == "repo":
            assert spec.path is not None
            stats = replay_repo(spec.path, into, bucket=bucket, at=spec.at or "latest",
                                partitions=parts, undo_window=undo_window, on_progress=tick,
                                on_event=event, memory_limit=memory)  # fmt: skip
        else:
            uri = tls_source(SourceUri.parse(spec.uri), cacert, no_verify, cert, key)
            job = replay_node(uri, into, partitions=parts, follow=follow, consistent=consistent,
                              durable_only=durable_only, undo_window=undo_window,
                              max_pending=max_pending, collections=paths or None,
                              on_progress=tick, on_event=event, wait=wait,
                              on_notice=notice if watch is None else watch.with_notice(notice),
                              compression=compression, memory_limit=memory)  # fmt: skip
            poll = None if watch is None else watch.poll_lag(uri, parts, watch.taken,
                                                             "upr-replay-lag")  # fmt: skip
            stats = asyncio.run(beside(job, poll))
        run.done(label, stats.applied, stats.bytes, not stats.interrupted)
    if stats.interrupted and not follow:
        raise interrupt.Stopped  # the job kept what it committed: a bounded run's ending
    _report(stats, into, json_out)
    if stats.interrupted:
        raise interrupt.Stopped  # a follower's ending, after its summary


def _on_signal(follow: bool, into: Path) -> None:
    """What a SIGINT or SIGTERM says: a follower's end, or a bounded run's."""
    if follow:
        interrupt.follows(lambda: f"positions saved in {into}; the same command continues "
                          "from there")  # fmt: skip
    else:
        interrupt.keeps(lambda: f"{into} keeps every change it committed, with its positions; "
                        "run the same command to resume")  # fmt: skip


def _check_metrics(follow: bool, port: int | None, host: str, per_partition: bool,
                   path: Path | None) -> None:  # fmt: skip
    """A follower serves metrics (--metrics-port), a one-shot replay writes them."""
    check_port_options(port, host, per_partition,
                       "" if follow else "a replay that follows (--follow); a one-shot "
                       "replay writes --metrics-file")  # fmt: skip
    if follow and path is not None:
        raise UsageError("--metrics-file is for a one-shot replay: a follower serves its "
                         "metrics with --metrics-port")  # fmt: skip


def _label(kind: str, path: Path | None, uri: str | None, bucket: str | None,
           one_shot_file: bool) -> str:  # fmt: skip
    """The metrics' bucket label: --bucket, the URI's, or a repository's only one."""
    if bucket:
        return bucket
    if kind == "repo":
        return repo_bucket(path) if path is not None and one_shot_file else ""
    return (SourceUri.parse(uri).bucket or "") if uri else ""


def _watch(bucket: str, port: int | None, per_partition: bool) -> ReplayMetrics | None:
    """The follower's metrics when --metrics-port asks for them."""
    if port is None:
        return None
    from upr_cli.metrics import ReplayMetrics

    return ReplayMetrics(bucket, per_partition=per_partition)


def _report(stats: ReplayStats, into: Path, json_out: bool) -> None:
    """The run's summary: JSON, or one line."""
    if json_out:
        print_json(stats.to_json())
        return
    d = stats.to_json()
    rate = f", {d['items_per_s']:,} items/s" if d["items_per_s"] else ""
    stopped = " (interrupted: positions saved, rerun to resume)" if stats.interrupted else ""
    changes = f", {stats.changes} collection changes" if stats.changes else ""
    stdout.print(
        f"replayed {stats.applied:,} changes of {stats.partitions} partitions into {into} "
        f"in {d['seconds']:.2f}s{rate}{changes}; {stats.commits} commits, "
        f"{len(stats.rollbacks)} rollbacks, {stats.resets} resets{stopped}",
        markup=False,
        highlight=False,
    )
