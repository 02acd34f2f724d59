"""Spark jobs behind `upr spark …`: sessions and `export` (docs/design.md "Data flows").

`session()` builds a SparkSession for `--master` (default `local[*]`) with `--conf k=v`
passed through, the `upr` source registered, and the executors' Python set to this
interpreter unless the caller chose one (PYSPARK_PYTHON), so tasks can import upr.
Errors raised by the data source come back from the JVM wrapped in a long report;
`spark_error` digs out upr's one-line message.

`export` hands the data source the command's repository access as options
(`access_options`: `keyFile`, `keyCommand`, `s3Endpoint`, `transfers`), never a
passphrase or a data key: options show in Spark's UI, plans and event log. The data
source's planner unlocks the repository with them (or the environment's
`UPR_KEY_FILE` / `UPR_PASSPHRASE`, inherited by its Python worker) and ships the data
key to the executors inside the pickled tasks (formats/spark.md §7).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from upr_cli.errors import UprError, UsageError

FORMATS = ("parquet", "json")
# `--partition-by`: the output's directory levels (Hive style, name=value)
PARTITION_BY = {"partition": ("partition",), "collection": ("scope", "collection")}
LOG4J = Path(__file__).with_name("log4j2.properties")


class SparkJobError(UprError):
    """A Spark job failed; the message is upr's own when the data source raised it."""


def parse_conf(pairs: Sequence[str]) -> dict[str, str]:
    """`k=v` strings (repeatable --conf) into a dict; a pair without `=` is a usage error."""
    out = {}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        if not sep or not k.strip():
            raise UsageError(f"--conf: {pair!r} is not KEY=VALUE")
        out[k.strip()] = v
    return out


def session(master: str = "local[*]", conf: dict[str, str] | None = None,
            app: str = "upr", jvm_output: IO[bytes] | None = None) -> Any:  # fmt: skip
    """A SparkSession with the `upr` data source registered. With `jvm_output`, the JVM
    this process starts for Spark writes its stdout and stderr there (its start-up lines:
    the JVM's warnings, log4j's and Ivy's), not on the command's."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise UsageError("Spark jobs need the spark extra: pip install 'upr[spark]'") from None
    settings = {"spark.master": master, "spark.app.name": app,
                "spark.ui.showConsoleProgress": "false",
                "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={LOG4J}"}  # fmt: skip
    if master.startswith("local"):
        # Only loopback: a local run never binds or advertises another address.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        settings |= {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                     "spark.ui.enabled": "false"}  # fmt: skip
    settings |= conf or {}
    builder = SparkSession.builder
    for k, v in settings.items():
        builder = builder.config(k, v)
    if jvm_output is not None:
        _launch_jvm(settings, jvm_output)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    from upr_cli.spark import register

    register(spark)
    return spark


def _launch_jvm(settings: dict[str, str], output: IO[bytes]) -> None:
    """Start Spark's JVM as the session would (spark-submit with the same settings), its
    stdout and stderr into `output`: pyspark's `launch_gateway` takes the process's
    arguments, and the session uses the JVM already started. Nothing when one runs."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None:
        return
    conf = SparkConf(loadDefaults=False).setAll(list(settings.items()))
    streams = {"stdout": output, "stderr": output}
    gateway = launch_gateway(conf, popen_kwargs=streams)  # type: ignore[no-untyped-call]
    SparkContext._ensure_initialized(gateway=gateway)


@contextlib.contextmanager
def watch_tasks(
    spark: Any, on_progress: Callable[[int, int], None], every: float = 0.5
) -> Iterator[None]:
    """While the block runs, call `on_progress(done, total)` every `every` seconds with
    the tasks of the Spark jobs the block starts, from Spark's status tracker."""
    sc = spark.sparkContext
    group = f"upr-{os.getpid()}-{threading.get_ident()}"
    sc.setJobGroup(group, "upr")  # this thread's jobs: the ones to count
    tracker = sc.statusTracker()
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(every):
            try:
                done, total = _tasks(tracker, group)
            except Exception:  # noqa: BLE001 - progress only: never fail the job over it
                return
            if total:
                on_progress(done, total)

    thread = threading.Thread(target=poll, name="upr-spark-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()  # no status call may race the session's stop
        sc.setLocalProperty("spark.jobGroup.id", None)


def _tasks(tracker: Any, group: str) -> tuple[int, int]:
    """Tasks done and in all over the group's jobs (a stage a finished job skipped,
    its output reused, counts as done)."""
    done = total = 0
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        if job is None:
            continue
        for stage_id in job.stageIds:
            stage = tracker.getStageInfo(stage_id)
            if stage is None:
                continue
            total += stage.numTasks
            done += stage.numTasks if job.status == "SUCCEEDED" else stage.numCompletedTasks
    return done, total


_UPR_MESSAGE = re.compile(r"upr_cli(?:\.\w+)+\.([A-Z]\w*): ([^\n]+)")  # any upr error class


def spark_error(exc: BaseException) -> SparkJobError:
    """upr's one-line message out of a Spark exception, or its first line."""
    text = str(exc)
    m = _UPR_MESSAGE.search(text)
    if m:
        return SparkJobError(m.group(2))
    first = next((line.strip() for line in text.splitlines() if line.strip()), repr(exc))
    return SparkJobError(f"spark: {first[:300]}")


def check_target(to: Path, overwrite: bool) -> None:
    """An existing output is replaced only when asked."""
    if to.exists() and not overwrite:
        raise UsageError(f"{to}: exists; give --overwrite to replace it")


@dataclass
class ExportSummary:
    """What `upr spark export` wrote."""

    repo: str
    at: str
    target: str
    format: str
    rows: int
    partitions: int
    seconds: float
    collections: int = 1  # distinct (scope, collection) written
    partition_by: str = "partition"

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md §4: the documents written are `items`)."""
        return {"repo": self.repo, "at": self.at, "output": self.target,
                "format": self.format, "partition_by": self.partition_by, "items": self.rows,
                "partition_count": self.partitions, "collection_count": self.collections,
                "seconds": round(self.seconds, 3)}  # fmt: skip


def access_options() -> dict[str, str]:
    """The data-source options of this command's repository access: the key file's
    absolute path, the key command, the object-store endpoint and transfers. Never a
    secret: a passphrase stays in the environment, a data key in the tasks."""
    from upr_cli.repo import access
    from upr_cli.repo.access import DEFAULT_TRANSFERS

    now = access.current()
    out = {"keyFile": str(now.key_file.absolute())} if now.key_file is not None else {}
    out |= {"keyCommand": now.key_command} if now.key_command else {}
    out |= {"s3Endpoint": now.s3_endpoint} if now.s3_endpoint else {}
    return out | ({"transfers": str(now.transfers)} if now.transfers != DEFAULT_TRANSFERS else {})


def export(spark: Any, repo: Path, to: Path, *, fmt: str = "parquet", at: str = "latest",
           bucket: str | None = None, overwrite: bool = False, partition_by: str = "partition",
           collections: str | None = None) -> ExportSummary:  # fmt: skip
    """The state at `at` (of the `collections` only, when given: `S.C,S2`), written to
    `to` as Parquet or JSON lines, partitioned by partition id (`to/partition=N/…`) or
    by collection (`to/scope=S/collection=C/…`)."""
    from upr_cli.repo import Repository
    from upr_cli.repo.readers import read_lock
    from upr_cli.spark.plan import parse_options
    from upr_cli.storage import display_location

    if fmt not in FORMATS:
        raise UsageError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if partition_by not in PARTITION_BY:
        raise UsageError(f"--partition-by: {partition_by!r} is not one of "
                         f"{', '.join(PARTITION_BY)}")  # fmt: skip
    check_target(to, overwrite)
    opts = {"path": display_location(repo), "at": at} | ({"bucket": bucket} if bucket else {})
    opts |= ({"collections": collections} if collections else {}) | access_options()
    resolved, _ = parse_options(opts)  # fail fast, with upr's message, before Spark starts
    # The driver holds the bucket's shared lock for the run, each task its own
    # (`batch.read_group`): no prune or sweep removes a segment meanwhile.
    opened = Repository(resolved.repo, access=resolved.access)  # with the data key: no unlock
    with read_lock(opened, resolved.bucket, "spark export"):
        t0 = time.monotonic()
        try:
            from pyspark.sql import functions as F

            df = spark.read.format("upr").options(**opts).load()
            df.write.mode("overwrite" if overwrite else "errorifexists").partitionBy(
                *PARTITION_BY[partition_by]
            ).format(fmt).save(str(to))
            back = spark.read.format(fmt).load(str(to))
            got = back.agg(F.count(F.lit(1)), F.countDistinct("partition"),
                           F.countDistinct("scope", "collection")).first()  # fmt: skip
            rows, parts, colls = (int(v) for v in got) if got is not None else (0, 0, 0)
        except UprError:
            raise
        except Exception as exc:  # noqa: BLE001 - Spark wraps everything; report one line
            raise spark_error(exc) from None
    return ExportSummary(str(repo), resolved.at, str(to), fmt, rows, parts,
                         time.monotonic() - t0, colls, partition_by)  # fmt: skip
