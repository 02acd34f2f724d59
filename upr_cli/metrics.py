"""Prometheus metrics: `backup --follow --metrics-port` and the one-shot `--metrics-file`.

Theory of operation (docs/metrics.md lists every metric). Every process that exports
metrics builds its own `CollectorRegistry` (never prometheus_client's global default, so
nothing another library registers leaks into ours, and tests can build as many as they
like in one process), with the `upr_` names of docs/metrics.md: units in the names,
counters ending in `_total`, and the label `bucket` (plus `partition` for the lag, only
with --metrics-per-partition: a thousand partitions are a thousand series).

A long-running follower (`FollowMetrics`) serves its registry over HTTP with
prometheus_client's own server (`serve`), on --metrics-host (default 127.0.0.1: the
metrics name buckets and rates, not for the whole network) and --metrics-port; the
port is bound before any work, so a port in use is a one-line usage error and nothing
has been streamed. The registry also holds prometheus_client's `ProcessCollector`
(resident and virtual memory, CPU seconds, open files: `process_*`, Linux only). The
job (upr_cli/jobs/follow.py) imports nothing of this: it calls `FollowHooks`, which
`FollowMetrics.hooks` fills in; the lag seconds are computed at scrape time from when
the last poll found the follower caught up.

A one-shot command (`OneShot`, used as `one_shot(path, command, bucket)`) writes its
registry once, at the end, success or failure, with prometheus_client's
`write_to_textfile`: a temporary file in the same directory renamed over PATH, so
node_exporter's textfile collector never reads half a file. A directory that does not
exist is a usage error before the work. The last success time of a failed run is carried
over from the file it replaces (same command and bucket), so an alert on its age fires
while runs keep failing.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from upr_cli.errors import UsageError, check_file_path

if TYPE_CHECKING:  # prometheus_client is imported when metrics are asked for (lazy CLI)
    from prometheus_client import CollectorRegistry

    from upr_cli.jobs.backup import BackupSummary
    from upr_cli.jobs.follow import CommitReport, FollowHooks

# -- the options --------------------------------------------------------------------------

MetricsPort = Annotated[
    int | None,
    typer.Option("--metrics-port", metavar="PORT", min=0, max=65535,
                 help="With --follow: serve Prometheus metrics on this port "
                 "(docs/metrics.md)."),
]  # fmt: skip
MetricsHost = Annotated[
    str,
    typer.Option("--metrics-host", metavar="HOST",
                 help="The address --metrics-port listens on (default 127.0.0.1).",
                 show_default=False),
]  # fmt: skip
MetricsPerPartition = Annotated[
    bool,
    typer.Option("--metrics-per-partition",
                 help="Label the lag metrics by partition too (one series a partition)."),
]  # fmt: skip
MetricsFile = Annotated[
    Path | None,
    typer.Option("--metrics-file", metavar="PATH",
                 help="Write Prometheus metrics here at the end, for node_exporter's "
                 "textfile collector (docs/metrics.md)."),
]  # fmt: skip

DEFAULT_HOST = "127.0.0.1"

# -- the long-running follower --------------------------------------------------------------


def _registry() -> CollectorRegistry:
    """A registry of this process's own; counters without their `_created` series (the
    process start time says as much: prometheus_client's switch is process-wide, and
    upr is the only user of prometheus_client in its process)."""
    from prometheus_client import CollectorRegistry, disable_created_metrics

    disable_created_metrics()  # type: ignore[no-untyped-call]
    return CollectorRegistry(auto_describe=True)


class FollowMetrics:
    """The metrics of `backup --follow` (docs/metrics.md "backup --follow")."""

    def __init__(self, bucket: str, *, per_partition: bool = False,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        from prometheus_client import Counter, Gauge, ProcessCollector

        self.registry = reg = registry if registry is not None else _registry()
        self.bucket, self.per_partition = bucket, per_partition
        ProcessCollector(registry=reg)
        b = ["bucket"]
        lag = ["bucket", "partition"] if per_partition else b

        def counter(name: str, doc: str, labels: list[str] = b) -> Any:
            return Counter(name, doc, labels, registry=reg)

        # prometheus_client appends `_total` to a counter's name: the names below are
        # exported as upr_follow_items_total, …
        self.items = counter("upr_follow_items", "Items committed to the repository.")
        self.bytes = counter("upr_follow_bytes", "Bytes committed (segment bytes written).")
        self.commits = counter("upr_follow_commits", "Continuous commits (restore points).")
        self.rollups = counter("upr_follow_rollups", "Rollups of commits published.")
        self.rollbacks = counter("upr_rollbacks", "Partition rollbacks met (failovers).")
        self.lost = counter("upr_lost_writes", "Seqs rollbacks took back: acknowledged "
                            "writes a failover lost (kept as lost writes).")  # fmt: skip
        self.reconnects = counter("upr_reconnects", "Links to a node lost and back.")
        self.errors = counter("upr_errors", "Warnings and errors met, by kind.", [*b, "kind"])
        self.last_commit = Gauge("upr_follow_last_commit_timestamp_seconds",
                                 "When the last commit was written (unix seconds).", b,
                                 registry=reg)  # fmt: skip
        self.lag_seqs = Gauge("upr_follow_lag_seqs", "Seqs the follower has not received "
                              "yet: the source's high seqs less what was streamed.", lag,
                              registry=reg)  # fmt: skip
        self.lag_seconds = Gauge("upr_follow_lag_seconds", "Seconds since the follower was "
                                 "last caught up (0 when it is).", lag,
                                 registry=reg)  # fmt: skip
        for c in (self.items, self.bytes, self.commits, self.rollups, self.rollbacks,
                  self.lost, self.reconnects):  # fmt: skip
            c.labels(bucket)  # every series from the start, at 0
        self._started = time.time()
        self._caught_up: dict[int | None, float] = {}  # None: the bucket as a whole
        self._behind: dict[int | None, bool] = {}
        self._watch(None)

    def _watch(self, partition: int | None) -> None:
        """The lag seconds of `partition` (None: the bucket), computed when scraped."""
        self._caught_up.setdefault(partition, self._started)
        self._behind.setdefault(partition, True)

        def seconds() -> float:
            if not self._behind[partition]:
                return 0.0
            return max(0.0, time.time() - self._caught_up[partition])

        if partition is None and self.per_partition:
            return  # per partition only
        labels = (self.bucket,) if partition is None else (self.bucket, str(partition))
        self.lag_seconds.labels(*labels).set_function(seconds)

    # -- what the follower tells (FollowHooks) --------------------------------------------

    def commit(self, r: CommitReport) -> None:
        """One continuous commit."""
        b = self.bucket
        self.items.labels(b).inc(r.items)
        self.bytes.labels(b).inc(r.bytes)
        self.commits.labels(b).inc()
        self.last_commit.labels(b).set(r.finished.timestamp())
        self._rolled_back(r.rollbacks, r.lost_seqs)

    def catch_up(self, s: BackupSummary) -> None:
        """A catch-up backup (its items are a backup's, not the follower's commits)."""
        self._rolled_back(len(s.rollbacks), sum(max(0, rb.from_seq - rb.to_seq)
                                                for rb in s.rollbacks))  # fmt: skip

    def _rolled_back(self, rollbacks: int, lost_seqs: int) -> None:
        self.rollbacks.labels(self.bucket).inc(rollbacks)
        self.lost.labels(self.bucket).inc(lost_seqs)

    def rollup(self) -> None:
        self.rollups.labels(self.bucket).inc()

    def reconnect(self) -> None:
        self.reconnects.labels(self.bucket).inc()

    def error(self, kind: str) -> None:
        self.errors.labels(self.bucket, kind).inc()

    def lag(self, behind: dict[int, int]) -> None:
        """Each partition's seqs behind its high seq, as one poll found them."""
        now = time.time()
        if self.per_partition:
            for p, n in behind.items():
                self.lag_seqs.labels(self.bucket, str(p)).set(n)
                self._watch(p)
                self._note(p, n, now)
        else:
            self.lag_seqs.labels(self.bucket).set(sum(behind.values()))
        self._note(None, sum(behind.values()), now)

    def _note(self, key: int | None, n: int, now: float) -> None:
        self._behind[key] = n > 0
        if n == 0:
            self._caught_up[key] = now

    def hooks(self) -> FollowHooks:
        """The follower's callbacks that feed these metrics."""
        from upr_cli.jobs.follow import FollowHooks

        return FollowHooks(catch_up=self.catch_up, rollup=self.rollup,
                           reconnect=self.reconnect, error=self.error,
                           lag=self.lag)  # fmt: skip


@dataclass
class Endpoint:
    """A running metrics server; `close` stops it."""

    host: str
    port: int
    _stop: Callable[[], None]

    def close(self) -> None:
        self._stop()


def serve(registry: CollectorRegistry, host: str, port: int) -> Endpoint:
    """Serve `registry` on host:port (0: any free port) in a thread; a port in use or an
    address that is not ours is a `UsageError` now, before any work."""
    from prometheus_client import start_http_server

    label = f"--metrics-port {port}"
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except socket.gaierror as exc:
        raise UsageError(f"--metrics-host {host}: cannot resolve it ({exc.strerror})") from None
    except OSError as exc:
        reason = (exc.strerror or str(exc)).rstrip(".").lower()
        raise UsageError(f"{label}: cannot listen on {host}:{port}: {reason}") from None
    bound = server.server_address[1]

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return Endpoint(host, int(bound), stop)


# -- one-shot commands ----------------------------------------------------------------------


@dataclass
class OneShot:
    """What a one-shot command reports (docs/metrics.md "One-shot commands"): per bucket
    its items, bytes and whether it went well; `ok` turns False on a failure of the run
    (the context manager sees it), which fails every bucket."""

    command: str
    bucket: str
    buckets: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    ok: bool = True

    def done(self, bucket: str, items: int, nbytes: int, ok: bool = True) -> None:
        """One bucket's figures (a run over several buckets calls it for each)."""
        self.buckets[bucket] = (items, nbytes, ok)


@contextlib.contextmanager
def one_shot(path: Path | None, command: str, bucket: str | None) -> Iterator[OneShot]:
    """Around a one-shot command's work: with `path`, its metrics are written there at
    the end, the result 1 or 0 (a failure still raises). `bucket` is the label until the
    work names the buckets it did (`OneShot.done`)."""
    run = OneShot(command, bucket or "")
    if path is None:
        yield run
        return
    check_file_path(path, f"--metrics-file {path}")  # before the work
    t0 = time.monotonic()
    try:
        yield run
    except typer.Exit as exc:  # an answer's exit (verify: problems; restore: partial)
        if exc.exit_code and all(fine for *_, fine in run.buckets.values()):
            run.ok = False  # a failure no bucket's result explains fails them all
        write_one_shot(path, run, time.monotonic() - t0)
        raise
    except BaseException:
        run.ok = False
        write_one_shot(path, run, time.monotonic() - t0)
        raise
    write_one_shot(path, run, time.monotonic() - t0)


def write_one_shot(path: Path, run: OneShot, seconds: float, *, now: float | None = None) -> None:
    """Write the run's metrics to `path` atomically (temp file + rename)."""
    from prometheus_client import Gauge, write_to_textfile

    reg = _registry()
    labels = ["command", "bucket"]

    def gauge(name: str, doc: str) -> Any:
        return Gauge(name, doc, labels, registry=reg)

    success = gauge("upr_last_success_timestamp_seconds", "When the command last succeeded "
                    "(unix seconds).")  # fmt: skip
    duration = gauge("upr_last_duration_seconds", "How long the last run took.")
    items = gauge("upr_last_items", "Items the last run handled.")
    nbytes = gauge("upr_last_bytes", "Bytes the last run handled.")
    result = gauge("upr_last_result", "1 when the last run succeeded, 0 when it failed.")
    now = time.time() if now is None else now
    before = _previous_success(path, run.command)
    for b, (n, size, fine) in (run.buckets or {run.bucket: (0, 0, True)}).items():
        key, ok = (run.command, b), run.ok and fine
        if ok:
            success.labels(*key).set(now)
        elif key in before:
            success.labels(*key).set(before[key])
        duration.labels(*key).set(round(seconds, 3))
        items.labels(*key).set(n)
        nbytes.labels(*key).set(size)
        result.labels(*key).set(1 if ok else 0)
    try:
        write_to_textfile(str(path), reg)
    except OSError as exc:
        from upr_cli.errors import os_error

        raise os_error(exc, path, "writing --metrics-file") from None


def _previous_success(path: Path, command: str) -> dict[tuple[str, str], float]:
    """The last success times the file at `path` holds for `command`, by bucket."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = path.read_text()
        out = {}
        for family in text_string_to_metric_families(text):
            if family.name != "upr_last_success_timestamp_seconds":
                continue
            for s in family.samples:
                if s.labels.get("command") == command:
                    out[(command, s.labels.get("bucket", ""))] = float(s.value)
        return out
    except (OSError, ValueError, UnicodeDecodeError):
        return {}  # none, or not ours: nothing carried over
