"""`upr spark …`: the data pipeline on Spark (formats/spark.md).

Theory of operation: the options are checked and the repository opened before Spark
starts (its start-up takes seconds). The JVM Spark runs in writes its own start-up
lines (the JVM's warnings, log4j's "Setting default log level", Ivy's resolution) on
its stdout and stderr: they go to a log file in the temporary directory, removed when
the command succeeds and named in a line on stderr when it fails; `--log-level debug`
leaves them on stderr. The summary's time (`seconds` in --json) is the command's wall
time, Spark's start-up included, which it also gives apart (`startup_seconds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Annotated, Any, TypeVar

import typer

from upr_cli import logs
from upr_cli.cli.options import (
    At,
    Bucket,
    JsonOutput,
    NoProgress,
    Repo,
    SparkConf,
    Through,
    deprecated_alias,
    either,
)
from upr_cli.cli.output import Progress, hint, plural, print_json, stderr, stdout
from upr_cli.source import open_bucket

HELP = """Run upr's data pipeline on Spark, locally or on a Spark cluster.

Locally with --master local[*] (the default), or on any Spark cluster unchanged
(--master spark://…, yarn, k8s://…; --conf k=v passes settings through). The
repository must be on storage every executor can read.

Example (the latest state as Parquet, partitioned by partition id):

  upr spark export --repo /backups/cb --output /data/cb-state --format parquet

Example (merge the chain into one full backup):

  upr spark merge --repo /backups/cb
"""

EXPORT_HELP = """Export the state of a repository at a backup, partitioned by partition id
or by collection.

The state at --at (a backup id, latest or oldest) follows the chain semantics: the
latest version of every document, tombstones, lost writes and collections dropped by
then left out; every row names its scope and collection (columns as in
formats/spark.md; a backup from before collections is _default._default). Writes
DIR/partition=N/… (--partition-by partition, the default) or
DIR/scope=S/collection=C/… (--partition-by collection) as Parquet (default) or JSON
lines; --collections S.C,... (or a scope S) exports those only. An existing directory
is refused unless --overwrite. --output was called --to before; --to still works, with
a warning.

Example:

  upr spark export --repo /backups/cb --output /data/cb-state

Example (an older backup as JSON, on a cluster):

  upr spark export --repo /shared/cb --at 20261121T071033.959105Z \\
      --output /shared/cb-json --format json --master spark://10.0.0.5:7077 \\
      --conf spark.executor.memory=4g

Example (one directory per collection, the app scope only):

  upr spark export --repo /backups/cb --output /data/cb-app --partition-by collection \\
      --collections app
"""

T = TypeVar("T")

app = typer.Typer(name="spark", help=HELP, no_args_is_help=True)

Master = Annotated[
    str,
    typer.Option("--master", metavar="URL",
                 help="Spark master URL (local[*], spark://…, yarn, k8s://…)."),
]  # fmt: skip


def register(root: typer.Typer) -> None:
    """Add the `spark` command group to the app."""
    root.add_typer(app, name="spark")


@app.command("export", help=EXPORT_HELP, no_args_is_help=True)
def export_cmd(
    repo: Repo,
    output: Annotated[
        Path | None, typer.Option("--output", metavar="DIR", help="Output directory.")
    ] = None,
    old_to: Annotated[Path | None, deprecated_alias("--to", "--output")] = None,
    fmt: Annotated[
        str, typer.Option("--format", metavar="parquet|json", help="The files' format.")
    ] = "parquet",
    at: At = "latest",
    bucket: Bucket = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DIR.")] = False,
    partition_by: Annotated[
        str,
        typer.Option(
            "--partition-by",
            metavar="partition|collection",
            help="Directory levels: partition=N, or scope=S/collection=C.",
        ),
    ] = "partition",
    collections: Annotated[
        str | None,
        typer.Option(
            "--collections",
            metavar="PATHS",
            help="Only these collections: S.C or S (all of its own), comma-separated.",
        ),
    ] = None,
    master: Master = "local[*]",
    conf: SparkConf = None,
    no_progress: NoProgress = False,
    json_out: JsonOutput = False,
) -> None:
    """Export the state at a backup."""
    from upr_cli.errors import UsageError, check_parent_dir
    from upr_cli.spark.jobs import FORMATS, PARTITION_BY, check_target, export

    if fmt not in FORMATS:
        raise UsageError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if partition_by not in PARTITION_BY:
        raise UsageError(f"--partition-by: {partition_by!r} is not one of "
                         f"{', '.join(PARTITION_BY)}")  # fmt: skip
    to = either(output, old_to, None, ("--output", "--to"))
    if to is None:
        raise UsageError("--output DIR (the directory to write) is required")
    _checked(repo, at, bucket, collections)
    check_parent_dir(to, f"--output {to}")  # before Spark starts, which would fail late
    check_target(to, overwrite)
    summary, startup = _run(master, conf, "upr spark export",
                            lambda spark: export(spark, repo, to, fmt=fmt, at=at, bucket=bucket,
                                                 overwrite=overwrite, partition_by=partition_by,
                                                 collections=collections), no_progress)  # fmt: skip
    _report(
        summary,
        startup,
        json_out,
        f"exported backup {summary.at}: {plural(summary.rows, 'document')} in "
        f"{plural(summary.partitions, 'partition')} and "
        f"{plural(summary.collections, 'collection')} to {summary.target} "
        f"({summary.format}, by {summary.partition_by}) in {_took(summary.seconds, startup)}",
    )


MERGE_HELP = """Merge a repository's chain into one full backup equal to its state at a backup.

Spark tasks read each partition's chain (checksums verified), keep the latest version of
every key (tombstones too, so a restore deletes what the chain deletes) and write one
ordinary segment per partition into a new backup directory; the manifest is committed
only after every task succeeded, so a failed merge leaves nothing visible. The merged
backup is a full backup: `upr info` lists it, and restoring it equals restoring the
chain at --through. The older backups stay (their records are kept, never deleted).
Through an older backup B, the merge sorts right after B and the backups after B go on
from it (formats/repository.md §8.9): every state is unchanged.

Example:

  upr spark merge --repo /backups/cb

Example (on a cluster, the repository on shared storage):

  upr spark merge --repo /shared/cb --master spark://10.0.0.5:7077 --json
"""


@app.command("merge", help=MERGE_HELP, no_args_is_help=True)
def merge_cmd(
    repo: Repo,
    through: Through = "latest",
    bucket: Bucket = None,
    master: Master = "local[*]",
    conf: SparkConf = None,
    no_progress: NoProgress = False,
    json_out: JsonOutput = False,
) -> None:
    """Merge a chain into one full backup."""
    from upr_cli.spark.merge import merge

    _checked(repo, through, bucket)
    summary, startup = _run(master, conf, "upr spark merge",
                            lambda spark: merge(spark, repo, through=through, bucket=bucket),
                            no_progress)  # fmt: skip
    _report(
        summary,
        startup,
        json_out,
        f"merged {summary.merged} backups through {summary.through} into full backup "
        f"{summary.backup_id}: {summary.partitions} partitions, {summary.records:,} "
        f"items, {summary.bytes_written / 1e6:,.1f} MB in {_took(summary.seconds, startup)}",
    )


def _checked(repo: Path, at: str, bucket: str | None, collections: str | None = None) -> None:
    """The repository options, checked before Spark starts (its start-up takes seconds).
    The repository is opened as every command opens it (same errors, same exit codes)."""
    from upr_cli.spark.plan import parse_options

    open_bucket(repo, bucket)
    opts = {"path": str(repo), "at": at} | ({"bucket": bucket} if bucket else {})
    parse_options(opts | ({"collections": collections} if collections else {}))


def _run(master: str, conf: list[str] | None, app: str, job: Callable[[Any], T],
         no_progress: bool = False) -> tuple[T, float]:  # fmt: skip
    """Run `job(spark)` in a session for `master`, stopped afterwards: its summary, whose
    `seconds` become the wall time from here to the session's stop, and Spark's start-up
    time. The JVM's own lines go to a log file (the module's doc)."""
    t0 = time.monotonic()
    with _jvm_output() as output:
        result, startup = _in_session(master, conf, app, job, no_progress, output)
    return dataclasses.replace(result, seconds=time.monotonic() - t0), startup  # type: ignore[type-var]


@contextlib.contextmanager
def _jvm_output() -> Iterator[IO[bytes] | None]:
    """Where the JVM writes its stdout and stderr: a log file in the temporary directory,
    removed when the block succeeds and named on stderr when it fails (removed too when
    nothing was written to it); none (the command's own stderr) at `--log-level debug`."""
    if logs.enabled("debug"):
        yield None
        return
    fd, name = tempfile.mkstemp(prefix="upr-spark-", suffix=".log")
    with os.fdopen(fd, "wb") as out:
        try:
            yield out
        except BaseException:
            out.flush()
            if os.path.getsize(name):  # (a failure before the JVM started leaves it empty)
                hint(f"Spark's own log (the JVM's output): {name}")
                raise
            os.unlink(name)
            raise
    os.unlink(name)


def _in_session(master: str, conf: list[str] | None, app: str, job: Callable[[Any], T],
                no_progress: bool, output: IO[bytes] | None) -> tuple[T, float]:  # fmt: skip
    """`job(spark)`'s result and Spark's start-up time. On a terminal a bar on stderr says
    what runs: Spark's start-up (seconds on its own), then the job's tasks done of how
    many, their rate and an ETA, from Spark's status tracker."""
    from upr_cli.spark.jobs import parse_conf, session, watch_tasks

    show = sys.stderr.isatty() and not no_progress
    with Progress(app, "tasks", show=show) as bar:
        bar.note(f"starting Spark ({master})")
        t0 = time.monotonic()
        spark = session(master, parse_conf(conf or []), app=app, jvm_output=output)
        startup = time.monotonic() - t0
        try:
            bar.note(f"running on Spark ({master})")
            if not show:
                return job(spark), startup
            url = _ui_url(spark)
            if url:  # the bar shows the tasks; the UI the stages, executors and logs
                stderr.print(f"Spark UI: {url}", markup=False, highlight=False)
            t0 = time.monotonic()  # the rate and ETA of the job, not of Spark's start-up

            def tick(done: int, total: int) -> None:
                bar.update(done, total=total, started=t0)

            with watch_tasks(spark, tick):
                return job(spark), startup
        finally:
            spark.stop()


def _ui_url(spark: Any) -> str | None:
    """The session's web UI, if it runs one (a local run does not)."""
    url = getattr(getattr(spark, "sparkContext", None), "uiWebUrl", None)
    return str(url) if url else None


def _took(seconds: float, startup: float) -> str:
    """The wall time of a Spark command, its start-up apart: `41.2s (Spark's start-up
    12.0s)`."""
    return f"{seconds:.1f}s (Spark's start-up {startup:.1f}s)"


def _report(summary: Any, startup: float, json_out: bool, line: str) -> None:
    if json_out:
        print_json(summary.to_json() | {"startup_seconds": round(startup, 3)})
    else:
        stdout.print(line, markup=False, highlight=False)
