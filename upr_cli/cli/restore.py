"""`upr restore`: write the state at a backup into a node, a cluster or a SQLite store."""

from __future__ import annotations

import asyncio
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from upr_cli.cli.options import (
    At,
    AtSeq,
    AtTime,
    BeforeFailover,
    Bucket,
    CaCert,
    ClientCert,
    ClientKey,
    JsonOutput,
    Keys,
    MemoryLimitOption,
    NoProgress,
    NoVerify,
    OldSparkMaster,
    Partitions,
    PasswordFile,
    Repo,
    SparkConf,
    SparkMaster,
    SparkTasks,
    either,
    key_pattern,
    point_at,
    restore_target,
    tls_source,
)
from upr_cli.cli.output import Progress, human_bytes, plural, print_json, stderr, stdout
from upr_cli.collections import parse_paths
from upr_cli.errors import ExitCode, UsageError
from upr_cli.jobs.backup import collection_filter
from upr_cli.jobs.restore import KeepXattrs, RestoreSummary, restore_to_node, restore_to_store
from upr_cli.jobs.restore_plan import MapRule, parse_map_data
from upr_cli.jobs.writer import DEFAULT_LIMIT
from upr_cli.memory import MemoryLimit
from upr_cli.metrics import MetricsFile, one_shot
from upr_cli.net.uri import SourceUri
from upr_cli.repo.manifest import CollectionFilter
from upr_cli.source import selected

HELP = """Restore the state at a backup into a node, a cluster or a SQLite store.

The state at --at (a backup id or the start of one, latest or oldest) follows the chain
semantics of the repository: lost writes (records above a rollback point) are not part
of it. Documents go as SET_WITH_META and deletions as DEL_WITH_META, keeping cas, rev
seq, flags and expiry; the target's conflict resolution applies unless --force-updates.
A deletion is sent only where the target has the key, unless --include-tombstones;
a tombstone that kept xattrs (system metadata of a deleted document) is always sent.
Nothing is written before every block checksum of every segment the state reads is
checked, and each segment against its manifest: a pass that reads at the speed of the
disk and decodes no record (the summary gives its time: restoring 200,000 documents
into a node, under 1% of the whole). Any damage stops the restore naming
the file, the block and what is wrong, with nothing written. --skip-corrupt leaves
out whole the partitions whose segments are damaged, restores the others, names the
partitions left out and exits 4. --no-check skips the pass (the summary says so):
damage is then found as records are read, and stops the restore part-way.

Partitions: every key goes to the partition its document key hashes to (CRC32, as the
SDKs do) over the TARGET's partition count, so a 1024-partition backup restores into a
64- or 128-partition bucket; the summary says "rehashed from 1024 to 64 partitions"
when the counts differ (--partitions selects partitions of the backup). A SQLite store
has no partition count: it keeps the source's partitions (and its positions and
failover logs, so a replay can go on from the backup).

Collections are matched by name, never by id: each collection of the backup (its names
at the end of the chain; a collection dropped by then is not restored) goes to the
target's collection of the same name, or the one --map-data names: SCOPE=SCOPE moves
every collection of a scope under the same names, S.C=S.C one collection; repeat it or
separate rules with commas. A collection the target lacks is created on a upr target
(one manifest change for all of them) unless --no-create. A target that cannot take a
collection (--no-create, a server without collections, a refused change) stops the
restore before anything is written, naming the missing collections; a server without
collections takes only _default._default.

--include-data restores only the scopes and collections it names (SCOPE or
SCOPE.COLLECTION, comma-separated or repeated; --collections is the same option),
--exclude-data every other one, as on `upr backup` (the two cannot be combined). A
name the backup does not hold is an error before anything is written; the summary
counts the records left out (`excluded` in --json). A SQLite store so restored records
no stream positions: a replay from it would miss what was left out.

Example (scope app only, then everything but app.logs):

  upr restore --repo /backups/cb --include-data app upr://admin@127.0.0.1/default
  upr restore --repo /backups/cb --exclude-data app.logs sqlite:/tmp/nolog.db

Before anything is written: the chain the state reads is checked (every manifest
readable, a lost manifest.json read from its copy, every parent backup present, every
seq covered, every segment file there at its size: `upr verify` lists every problem);
the target is reached and authenticated, its partition count and collections read,
every partition has a reachable active node. Any of these failing is one error naming
what is wrong, never a smaller or half-written restore.

Restores are idempotent: the same restore run again writes the same versions, which
the target keeps (its conflict resolution finds them equal: "not written: the target
has this version or a newer one"; --json: target_has_same_or_newer, also under its
deprecated name conflicts). If the target fails once writing began (a node dies), the
summary says how many items were written and which source partitions are complete,
and exits 1; run the same restore again to complete it. A write the target refuses as invalid (an
xattr value that is not JSON, which upr serve and Couchbase Server refuse but an
older backup may hold) is named by its key; everything else is written, and the
restore exits 4. A SQLite store takes such xattrs as they are.

Xattrs go back with their documents and with the tombstones that kept them: all of
them by default, as cbbackupmgr does (a document's value is its xattrs then its body,
datatype 0x04; a tombstone's value its xattrs alone). --no-system-xattrs leaves the
system xattrs (names starting with _, such as Sync Gateway's _sync) out, --no-xattrs
every xattr. The writes go over connections that negotiated HELLO XATTR: a target that
refuses it stops the restore before anything is written, unless --no-xattrs. The
summary counts the documents and deletions restored with xattrs (`xattrs` in --json)
and those whose xattrs the options left out (`xattrs_left_out`).

--dry-run does all of that, writes nothing and prints the plan: the partition counts,
whether keys are rehashed, and per collection its source and target names, whether the
target has it (exists), would get it (create) or lacks it (missing), and its documents
and deletions, and how many of them carry xattrs (a target that refuses xattrs, where
some are to be written, is noted and exits 1); --json gives the same as
`source_partitions`, `target_partitions`, `rehash`, `collections`, `xattrs` and
`target_xattrs`.

Example:

  upr restore --repo /backups/cb upr://admin@127.0.0.1:11210/default

Example (into a SQLite store):

  upr restore --repo /backups/cb sqlite:/tmp/bucket.db

Example (scope app restored as scope shop, every key at its partition there):

  upr restore --repo /backups/cb --map-data app=shop \\
      upr://admin@127.0.0.1:11210/default

Example (what would be restored, and where, without writing):

  upr restore --repo /backups/cb --dry-run --no-create \\
      upr://admin@127.0.0.1:11210/default

Example (a damaged repository: restore the partitions without damage, exit 4):

  upr restore --repo /backups/cb --skip-corrupt upr://admin@127.0.0.1/default

Example (the same restore again, after the target failed part-way: it completes):

  upr restore --repo /backups/cb upr://admin@127.0.0.1/default

Example (the state at one backup; its chain is checked first):

  upr restore --repo /backups/cb --at 20261121T061500.123456Z \\
      sqlite:/tmp/then.db

Point in time (docs/design.md "Point-in-time restore"). --at-time TIME restores the
state the bucket had at TIME: each partition at the newest restore point received at
or before it (in a continuous chain, `upr backup --follow`, the end of every snapshot
it received, by the follower's clock; in an ordinary chain, each backup's commit). TIME
is RFC 3339 (2026-12-06T14:37:00Z, or with an offset), a local time without offset
(2026-12-06 14:37) or relative to now (-15m, -2h, -30s, -1d). A time outside the
restorable range (`upr info` shows it) is one error naming the range, before anything
is written. A partition with no restore point by TIME did not exist yet: it is not
restored, and the summary says so. Where no snapshot end was watched (the follower was
stopped, or between ordinary backups: a coarse stretch), the state given is that at
the start of the stretch, and the summary says per partition how far before TIME it is
(and the maximum; `point` in --json). The CAS is not used: writes made with
SET_WITH_META keep their source's CAS, and node clocks differ.

--at-seq P:SEQ,… restores ONLY the partitions it names, each to its seq (the others
are left alone: a careful restore of some partitions touches nothing else); a seq
inside a snapshot is rounded down to the snapshot boundary below it, with a notice.
--before-failover N restores each partition to the state it had on its old branch
just before failover N (`upr info` numbers them), lost writes included: for
forensics, into a SQLite store or a scratch bucket. --at, --at-time, --at-seq and
--before-failover each name the state: give one. They do not combine with --master.

Example (the state at 14:37 UTC, into a SQLite store):

  upr restore --repo /backups/cb --at-time 2026-12-06T14:37:00Z \
      sqlite:/tmp/then.db

Example (15 minutes ago, local clock):

  upr restore --repo /backups/cb --at-time -15m upr://admin@127.0.0.1/default

Example (partition 3 at seq 1500, partition 7 at seq 20, nothing else):

  upr restore --repo /backups/cb --at-seq 3:1500,7:20 sqlite:/tmp/two.db

Example (the lost branch of failover 1, for forensics):

  upr restore --repo /backups/cb --before-failover 1 sqlite:/tmp/lost.db

--master URL divides the partitions among Spark tasks on that Spark master (local[*],
spark://…, yarn; --spark-tasks, default 8; --conf k=v passes Spark settings); each
task writes its share to the target node. --spark, the old spelling of --master,
still works, with a warning.

Example (what the oldest backup would restore for partitions 0-7):

  upr restore --repo /backups/cb --at oldest --partitions 0-7 --dry-run \\
      upr://admin@127.0.0.1/default

--metrics-file PATH writes Prometheus metrics at the end, success or failure (result
1 only for exit 0): last success time, duration, items and bytes restored
(docs/metrics.md), for node_exporter's textfile collector.

Example (a restore drill from cron, its metrics for node_exporter):

  upr restore --repo /backups/cb sqlite:/tmp/drill.db \\
      --metrics-file /var/lib/node_exporter/textfile/upr-restore.prom
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("restore", help=HELP, no_args_is_help=True)(restore_cmd)


DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan; write nothing.")]
ForceUpdates = Annotated[
    bool, typer.Option("--force-updates", help="Skip the target's conflict resolution.")
]
IncludeTombstones = Annotated[
    bool, typer.Option("--include-tombstones", help="Write every deletion.")
]
IncludeData = Annotated[
    list[str] | None,
    typer.Option("--include-data", "--collections", metavar="PATHS", show_default=False,
                 help="Restore only these: SCOPE or SCOPE.COLLECTION, comma-separated or "
                 "repeated."),
]  # fmt: skip
ExcludeData = Annotated[
    list[str] | None,
    typer.Option("--exclude-data", metavar="PATHS", show_default=False,
                 help="Restore every collection but these (SCOPE or SCOPE.COLLECTION)."),
]  # fmt: skip


def restore_cmd(
    target: Annotated[
        str,
        typer.Argument(
            metavar="TARGET", help="upr://[user[:password]@]host[:port]/bucket or sqlite:PATH"
        ),
    ],
    repo: Repo,
    at: At = "latest",
    at_time: AtTime = None,
    at_seq: AtSeq = None,
    before_failover: BeforeFailover = None,
    bucket: Bucket = None,
    partitions: Partitions = None,
    keys: Keys = None,
    include_data: IncludeData = None,
    exclude_data: ExcludeData = None,
    dry_run: DryRun = False,
    force_updates: ForceUpdates = False,
    include_tombstones: IncludeTombstones = False,
    skip_corrupt: Annotated[
        bool,
        typer.Option("--skip-corrupt", help="Leave out partitions with damage; exit 4."),
    ] = False,
    no_check: Annotated[
        bool,
        typer.Option("--no-check", help="Skip the checksum pass before the first write."),
    ] = False,
    map_data: Annotated[
        list[str] | None,
        typer.Option(
            "--map-data",
            metavar="SRC=DST",
            help="Restore a scope (a=b) or a collection (a.x=b.y) under another name; "
            "repeatable or comma-separated.",
        ),
    ] = None,
    no_create: Annotated[
        bool,
        typer.Option("--no-create", help="Do not create missing collections: refuse instead."),
    ] = False,
    no_system_xattrs: Annotated[
        bool,
        typer.Option("--no-system-xattrs", help="Leave system xattrs (names starting _) out."),
    ] = False,
    no_xattrs: Annotated[bool, typer.Option("--no-xattrs", help="Leave every xattr out.")] = False,
    master: SparkMaster = None,
    old_spark: OldSparkMaster = None,
    spark_tasks: SparkTasks = 8,
    conf: SparkConf = None,
    memory: MemoryLimitOption = DEFAULT_LIMIT,
    no_progress: NoProgress = False,
    json_out: JsonOutput = False,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
    metrics_file: MetricsFile = None,
) -> None:
    """Restore a backup."""
    spark = either(master, old_spark, None, ("--master", "--spark"))
    chosen = collection_filter(parse_paths(include_data), parse_paths(exclude_data))
    kind, where = restore_target(target)  # anything else: a usage error, before any work
    node = (tls_source(SourceUri.parse(where), cacert, no_verify, cert, key)
            if kind == "node" else None)  # fmt: skip
    keep: KeepXattrs = "none" if no_xattrs else "user" if no_system_xattrs else "all"
    point = point_at(at, at_time, at_seq, before_failover)
    if spark is not None and point is not at:
        raise UsageError("--at-time, --at-seq and --before-failover do not combine with --master")
    plan = Plan(repo, bucket=bucket, at=point, partitions=selected(partitions),
                keys=key_pattern(keys), dry_run=dry_run, skip_corrupt=skip_corrupt,
                map_data=parse_map_data(map_data), create=not no_create,
                keep_xattrs=keep, check=not no_check, memory=memory,
                collections=chosen)  # fmt: skip
    if spark is not None and kind != "node":
        raise UsageError("--master restores into a node (upr://…); a SQLite store has one writer")
    if kind == "sqlite" and force_updates:
        raise UsageError("--force-updates applies to node targets (a store keeps what it is given)")
    with one_shot(metrics_file, "restore", bucket) as run:
        summary = _restore(plan, kind, where, node, spark, spark_tasks, conf, force_updates,
                           include_tombstones, no_progress)  # fmt: skip
        if metrics_file is not None:
            fine = summary.failure is None and not summary.errors and not summary.partial
            run.done(bucket or _only_bucket(repo), summary.items, summary.bytes, fine)
        _report(summary, dry_run, json_out)


def _only_bucket(repo: Path) -> str:
    """The repository's bucket when it has one (the metrics' label without --bucket)."""
    from upr_cli.errors import UprError
    from upr_cli.repo import Repository

    try:
        names = Repository(repo).buckets()
    except (UprError, OSError):
        return ""
    return names[0] if len(names) == 1 else ""


def _restore(plan: Plan, kind: str, where: str, node: SourceUri | None, spark: str | None,
             spark_tasks: int, conf: list[str] | None, force_updates: bool,
             include_tombstones: bool, no_progress: bool) -> RestoreSummary:  # fmt: skip
    """The restore, with its bar."""
    repo = plan.repo
    show = sys.stderr.isatty() and not no_progress
    with Progress("restore", "items", show=show) as bar:

        def tick(s: RestoreSummary) -> None:
            bar.update(
                s.items, parts=(s.partitions + len(s.left_out), s.partitions_total), nbytes=s.bytes
            )

        summary: RestoreSummary
        if spark is not None:
            bar.note(f"starting Spark ({spark})")
            assert node is not None
            summary = _on_spark(plan, node, spark, spark_tasks, conf, force_updates,
                                include_tombstones)  # fmt: skip
        elif kind == "sqlite":
            summary = restore_to_store(repo, Path(where), on_progress=tick, **plan.options())
        else:
            assert node is not None
            summary = asyncio.run(
                restore_to_node(
                    repo,
                    node,
                    force_updates=force_updates,
                    include_tombstones=include_tombstones,
                    on_progress=tick,
                    **plan.options(),
                )
            )
    return summary


@dataclass(frozen=True, slots=True)
class Plan:
    """What to restore, as every kind of target takes it."""

    repo: Path
    bucket: str | None
    at: Any  # what `jobs.state.select` takes: a backup or a time, seqs, a failover
    partitions: list[int] | None
    keys: re.Pattern[bytes] | None
    dry_run: bool
    skip_corrupt: bool
    map_data: tuple[MapRule, ...] = ()
    create: bool = True
    keep_xattrs: KeepXattrs = "all"
    check: bool = True
    memory: MemoryLimit = DEFAULT_LIMIT
    collections: CollectionFilter | None = None  # --include-data or --exclude-data

    def options(self) -> dict[str, Any]:
        """The keyword arguments of `restore_to_node` and `restore_to_store`."""
        names = ("bucket", "at", "partitions", "keys", "dry_run", "skip_corrupt", "map_data",
                 "create", "keep_xattrs", "check", "memory", "collections")  # fmt: skip
        return {name: getattr(self, name) for name in names}


def _on_spark(plan: Plan, uri: SourceUri, master: str, tasks: int, conf: list[str] | None,
              force_updates: bool, include_tombstones: bool) -> Any:  # fmt: skip
    """Restore into a node from Spark tasks, each writing its share of the partitions."""
    from upr_cli.spark.distributed import spark_restore
    from upr_cli.spark.jobs import parse_conf, session

    sess = session(master, parse_conf(conf or []), app="upr restore")
    try:
        return spark_restore(sess, plan.repo, uri, tasks=tasks,
                             force_updates=force_updates, include_tombstones=include_tombstones,
                             **plan.options())  # fmt: skip
    finally:
        sess.stop()


def _report(summary: RestoreSummary, dry_run: bool, json_out: bool) -> None:
    """The summary (JSON, or the plan and a few lines), what was skipped; exit 1 when
    anything failed or (dry run) the target lacks a collection it would not get, 4 when
    the restore is done but partial (partitions left out, keys refused)."""
    plan = summary.plan
    if json_out:
        print_json(summary.to_json())
    else:
        verb = ("would restore" if dry_run else "restored" if summary.failure is None
                else "stopped part-way restoring")  # fmt: skip
        point = summary.point
        what = f"backup {summary.backup_id}" if point is None else point.describe()[0]
        lines = [f"{verb} {what}"]
        if point is not None:
            lines += [f"  read from backups up to {summary.backup_id}", *point.describe()[1:]]
        lines += plan.describe() if plan else ()
        lines.append(_precheck_line(summary))
        lines.append(f"{plural(summary.partitions, 'source partition')}, "
                     f"{plural(summary.documents, 'document')}, "
                     f"{plural(summary.deletions, 'deletion')}")  # fmt: skip
        if summary.dropped:
            lines.append(f"{plural(summary.dropped, 'record')} of dropped collections left out")
        if summary.excluded:
            lines.append(f"{plural(summary.excluded, 'record')} of collections "
                         "--include-data/--exclude-data left out")  # fmt: skip
        lines += _xattr_lines(summary)
        if summary.left_out:
            lines.append(f"left out (damaged segments): "
                         f"{_partition_list(summary.left_out)}")  # fmt: skip
        stdout.print("\n".join(lines), markup=False)
        if not dry_run:
            stdout.print(
                f"written {summary.written:,}; absent keys deleted "
                f"{summary.absent_deletes:,}; errors {summary.errors or 0}\n"
                f"{summary.conflicts:,} not written: the target has this version or a "
                "newer one",
                markup=False,
            )
        if summary.refused:
            stdout.print(f"refused by the target (an xattr value that is not JSON): "
                         f"{plural(len(summary.refused), 'key')}: "
                         f"{', '.join(summary.refused)}", markup=False)  # fmt: skip
        for s in summary.skipped:
            stderr.print(f"skipped {s}", markup=False)
    if summary.failure is not None:
        done = _partition_list(summary.complete) if summary.complete else "none"
        stderr.print(f"upr: error: {summary.failure}; {summary.written:,} items written, "
                     f"source partitions complete: {done}; run the same restore again to "
                     "complete it (a restore is idempotent)", markup=False)  # fmt: skip
    missing = plan.missing() if plan else []
    if missing:
        names = ", ".join(sorted({str(c.target) for c in missing}))
        stderr.print(f"upr: the target lacks {names}: a restore would stop", markup=False)
    refused = summary.target_xattrs is False and summary.xattrs > 0
    if refused:
        stderr.print("upr: the target does not take xattrs: a restore would stop "
                     "(--no-xattrs leaves them out)", markup=False)  # fmt: skip
    if summary.failure is not None or summary.errors or missing or refused:
        raise typer.Exit(ExitCode.FAILED)
    if summary.partial:
        raise typer.Exit(ExitCode.PARTIAL)


def _precheck_line(summary: RestoreSummary) -> str:
    """What the pass before the first write checked, or that it was skipped."""
    c = summary.precheck
    if c is None:
        return "checksums not checked before writing (--no-check)"
    read = f"{plural(c.blocks, 'block')}, {human_bytes(c.bytes)}"
    return f"checked before writing: {plural(c.segments, 'segment')}, {read} in {c.seconds:.2f} s"


def _partition_list(parts: list[int]) -> str:
    """0, 1, 2, 5 → 'partitions 0-2, 5'."""
    runs: list[list[int]] = []
    for p in sorted(parts):
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"{'partition' if len(parts) == 1 else 'partitions'} {text}"


def _xattr_lines(summary: RestoreSummary) -> list[str]:
    """What happened to xattrs, when the state had any."""
    out = []
    if summary.xattrs:
        out.append(f"{plural(summary.xattrs, 'document or deletion', 'documents and deletions')}"
                   " with xattrs")  # fmt: skip
    if summary.xattrs_left_out:
        which = "xattrs" if summary.keep_xattrs == "none" else "system xattrs"
        out.append(f"{which} left out of {plural(summary.xattrs_left_out, 'record')}")
    return out
