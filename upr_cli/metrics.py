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

import asyncio
import contextlib
import socket
import time
from abc import ABC, abstractmethod
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
    from upr_cli.jobs.replay import ReplayStats
    from upr_cli.jobs.tail import TailSummary
    from upr_cli.net.uri import SourceUri
    from upr_cli.node.server import NodeServer

# -- the options --------------------------------------------------------------------------

MetricsPort = Annotated[
    int | None,
    typer.Option("--metrics-port", metavar="PORT", min=0, max=65535,
                 help="Serve Prometheus metrics on this port while it runs "
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


class _Lag:
    """PREFIX_lag_seqs and PREFIX_lag_seconds of one bucket (and, per partition, of each
    partition): the seqs a poll found behind, and the seconds since a poll last found
    none behind (computed when scraped; counted from the start until the first)."""

    def __init__(self, reg: CollectorRegistry, prefix: str, bucket: str,
                 per_partition: bool) -> None:  # fmt: skip
        from prometheus_client import Gauge

        labels = ["bucket", "partition"] if per_partition else ["bucket"]
        self.bucket, self.per_partition = bucket, per_partition
        self.seqs = Gauge(f"{prefix}_lag_seqs", "Seqs not received yet: the source's high "
                          "seqs less what was taken.", labels, registry=reg)  # fmt: skip
        self.seconds = Gauge(f"{prefix}_lag_seconds", "Seconds since last caught up (0 "
                             "when it is).", labels, registry=reg)  # fmt: skip
        self._started = time.time()
        self._caught_up: dict[int | None, float] = {}  # None: the bucket as a whole
        self._behind: dict[int | None, bool] = {}
        self._watch(None)

    def _watch(self, partition: int | None) -> None:
        """The lag seconds of `partition` (None: the bucket), computed when scraped."""
        if partition in self._caught_up:
            return
        self._caught_up[partition] = self._started
        self._behind[partition] = True

        def seconds() -> float:
            if not self._behind[partition]:
                return 0.0
            return max(0.0, time.time() - self._caught_up[partition])

        if partition is None and self.per_partition:
            return  # per partition only
        labels = (self.bucket,) if partition is None else (self.bucket, str(partition))
        self.seconds.labels(*labels).set_function(seconds)

    def lag(self, behind: dict[int, int]) -> None:
        """Each partition's seqs behind its high seq, as one poll found them."""
        now = time.time()
        if self.per_partition:
            for p, n in behind.items():
                self.seqs.labels(self.bucket, str(p)).set(n)
                self._watch(p)
                self._note(p, n, now)
        else:
            self.seqs.labels(self.bucket).set(sum(behind.values()))
        self._note(None, sum(behind.values()), now)

    def _note(self, key: int | None, n: int, now: float) -> None:
        self._behind[key] = n > 0
        if n == 0:
            self._caught_up[key] = now


class FollowMetrics:
    """The metrics of `backup --follow` (docs/metrics.md "backup --follow")."""

    def __init__(self, bucket: str, *, per_partition: bool = False,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        from prometheus_client import Counter, Gauge, ProcessCollector

        self.registry = reg = registry if registry is not None else _registry()
        self.bucket, self.per_partition = bucket, per_partition
        ProcessCollector(registry=reg)
        b = ["bucket"]

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
        self._lag = _Lag(reg, "upr_follow", bucket, per_partition)
        for c in (self.items, self.bytes, self.commits, self.rollups, self.rollbacks,
                  self.lost, self.reconnects):  # fmt: skip
            c.labels(bucket)  # every series from the start, at 0

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
        self._lag.lag(behind)

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


@contextlib.contextmanager
def endpoint(registry: CollectorRegistry | None, host: str, port: int | None) -> Iterator[None]:
    """Around a long-running command's work: with a port, `registry` served there (bound
    now: an error before any work), said on stderr, closed at the end."""
    if registry is None or port is None:
        yield
        return
    from upr_cli.cli.output import notice

    end = serve(registry, host, port)
    where = f"[{end.host}]:{end.port}" if ":" in end.host else f"{end.host}:{end.port}"
    notice(f"metrics on http://{where}/metrics")
    try:
        yield
    finally:
        end.close()


def check_port_options(port: int | None, host: str, per_partition: bool, what: str) -> None:
    """--metrics-host and --metrics-per-partition mean nothing without --metrics-port;
    `what` names when a port is allowed at all ("" always)."""
    if port is None and (per_partition or host != DEFAULT_HOST):
        raise UsageError("--metrics-host and --metrics-per-partition go with --metrics-port")
    if port is not None and what:
        raise UsageError(f"--metrics-port is for {what}")


# -- replay --follow and tail: totals read when scraped, lag polled -------------------------

LAG_EVERY = 2.0  # seconds between two lag polls of `replay --follow` and `tail`

_BACK = " back after "  # a link back (upr_cli/dcp/consumer.py's notice): a reconnect


class _Streaming(ABC):
    """What `replay --follow` and `tail` share: the job's running totals, read when
    scraped (a collector of this registry: nothing counted twice, nothing lost between
    two progress reports), the lag of `_Lag`, reconnects and errors by kind."""

    prefix = ""

    def __init__(self, bucket: str, *, per_partition: bool = False,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        from prometheus_client import ProcessCollector

        self.registry = reg = registry if registry is not None else _registry()
        self.bucket = bucket
        ProcessCollector(registry=reg)
        self._lag = _Lag(reg, self.prefix, bucket, per_partition)
        self.reconnects = 0
        self.errors: dict[str, int] = {}
        reg.register(self)  # a collector: describe, collect

    @abstractmethod
    def totals(self) -> list[tuple[str, str, str, float | None]]:
        """(name, counter|gauge, help, value) of the job's totals (None: absent): each
        command's own (`ReplayMetrics`, `TailMetrics`)."""

    def describe(self) -> list[Any]:
        return []  # registered before the job: nothing to read yet

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        b = [self.bucket]
        for name, kind, doc, value in self.totals():
            if value is None:
                continue
            make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = make(name, doc, labels=["bucket"])
            fam.add_metric(b, value)
            yield fam
        fam = CounterMetricFamily("upr_reconnects", "Links to a node lost and back.",
                                  labels=["bucket"])  # fmt: skip
        fam.add_metric(b, self.reconnects)
        yield fam
        if self.errors:
            fam = CounterMetricFamily("upr_errors", "Warnings and errors met, by kind.",
                                      labels=["bucket", "kind"])  # fmt: skip
            for kind, n in sorted(self.errors.items()):
                fam.add_metric([*b, kind], n)
            yield fam

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def notice(self, text: str) -> None:
        """A consumer's notice: a link lost (an error of kind `link`) or back."""
        if text.startswith("connection to "):
            if _BACK in text:
                self.reconnects += 1
            elif " lost" in text:
                self.error("link")

    def with_notice(self, then: Callable[[str], None]) -> Callable[[str], None]:
        """A notice callback that counts what it hears, then hands it to `then`."""

        def hear(text: str) -> None:
            self.notice(text)
            then(text)

        return hear

    async def poll_lag(self, uri: SourceUri, partitions: list[int] | None,
                       taken: Callable[[], dict[int, int] | None],
                       name: str) -> None:  # fmt: skip
        """Every LAG_EVERY seconds, each partition's high seq on its active node less the
        seq `taken` says the job has (one STAT vbucket-seqno per active node; none while
        `taken` gives None: the job has not told where it stands yet); a poll that fails
        is an error of kind `lag_poll`. Runs until cancelled."""
        from upr_cli.dcp.states import partition_states
        from upr_cli.errors import UprError

        while True:
            if taken() is None:
                await asyncio.sleep(0.05)
                continue
            try:
                states, _n = await partition_states(uri, partitions, failover_logs=False,
                                                    name=name, wait_for=0)  # fmt: skip
            except (UprError, OSError):
                self.error("lag_poll")
            else:
                got = taken() or {}
                self._lag.lag({p: max(0, st.high_seq - got.get(p, 0))
                               for p, st in states.items()})  # fmt: skip
            await asyncio.sleep(LAG_EVERY)


class ReplayMetrics(_Streaming):
    """The metrics of `replay --follow` (docs/metrics.md "replay --follow")."""

    prefix = "upr_replay"

    def __init__(self, bucket: str, *, per_partition: bool = False,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        self.stats: ReplayStats | None = None  # the job's, from its first progress report
        super().__init__(bucket, per_partition=per_partition, registry=registry)

    def progress(self, stats: ReplayStats) -> None:
        self.stats = stats

    def taken(self) -> dict[int, int] | None:
        """The seqs the store committed, per partition (None before the job's first
        report: its positions not read yet)."""
        return dict(self.stats.positions) if self.stats is not None else None

    def totals(self) -> list[tuple[str, str, str, float | None]]:
        s = self.stats
        rollbacks = list(s.rollbacks) if s is not None else []
        if s is not None and s.resets:
            self.errors["reset"] = s.resets
        return [
            ("upr_replay_items", "counter", "Changes applied to the store (committed).",
             s.applied if s else 0),
            ("upr_replay_bytes", "counter", "Their keys' and values' bytes.",
             s.bytes if s else 0),
            ("upr_replay_commits", "counter", "Store transactions committed.",
             s.commits if s else 0),
            ("upr_rollbacks", "counter", "Partition rollbacks met (failovers).",
             len(rollbacks)),
            ("upr_lost_writes", "counter", "Versions rollbacks took back from the store "
             "(kept as lost writes).", sum(int(r.get("lost") or 0) for r in rollbacks)),
            ("upr_replay_last_apply_timestamp_seconds", "gauge", "When the store last "
             "committed changes (unix seconds).", s.last_apply if s and s.last_apply else None),
        ]  # fmt: skip


class TailMetrics(_Streaming):
    """The metrics of `tail` while it follows (docs/metrics.md "tail")."""

    prefix = "upr_tail"

    def __init__(self, bucket: str, *, per_partition: bool = False,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        self.summary: TailSummary | None = None
        self.positions: Callable[[], dict[int, int]] | None = None  # once the streams open
        super().__init__(bucket, per_partition=per_partition, registry=registry)

    def progress(self, summary: TailSummary) -> None:
        self.summary = summary

    def taken(self) -> dict[int, int] | None:
        """The seqs received, per partition (None before the streams open)."""
        return self.positions() if self.positions is not None else None

    def totals(self) -> list[tuple[str, str, str, float | None]]:
        s = self.summary
        return [
            ("upr_tail_items", "counter", "Changes streamed (printed).", s.items if s else 0),
            ("upr_tail_bytes", "counter", "Their keys' and values' bytes.", s.bytes if s else 0),
            ("upr_rollbacks", "counter", "Partition rollbacks met (failovers).",
             s.rollbacks if s else 0),
        ]  # fmt: skip


async def beside(job: Any, poller: Any | None) -> Any:
    """Await `job` with `poller` (a coroutine, or None) running beside it until it ends."""
    if poller is None:
        return await job
    task = asyncio.ensure_future(poller)
    try:
        return await job
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


# -- upr serve: the node's state, read on its event loop when scraped -----------------------


class NodeMetrics:
    """The metrics of `upr serve` (docs/metrics.md "upr serve"): a collector that reads the
    node's connections, buckets and DCP streams on the node's event loop when scraped
    (never from the HTTP thread: those are the loop's objects)."""

    def __init__(self, server: NodeServer, loop: asyncio.AbstractEventLoop,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        from prometheus_client import ProcessCollector

        self.registry = reg = registry if registry is not None else _registry()
        self.server, self.loop = server, loop
        ProcessCollector(registry=reg)
        reg.register(self)

    def describe(self) -> list[Any]:
        return []

    async def _snapshot(self) -> dict[str, dict[str, int]]:
        """Per bucket: connections, items written, DCP streams open, DCP bytes sent."""
        srv = self.server

        def row(written: int = 0, sent: int = 0) -> dict[str, int]:
            return {"connections": 0, "written": written, "streams": 0, "sent": sent}

        out = {name: row(sum(p.written for p in b.partitions.values()), srv.dcp_sent.get(name, 0))
               for name, b in srv.buckets.items()}  # fmt: skip
        for s in list(srv.sessions):
            r = out.setdefault(s.bucket.name if s.bucket is not None else "", row())
            r["connections"] += 1
            r["sent"] += s.dcp_sent
            if s.dcp is not None:
                r["streams"] += sum(1 for t in s.dcp.streams.values() if not t.done())
        return out

    def collect(self) -> Iterator[Any]:
        try:
            snap = asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop).result(5)
        except (RuntimeError, TimeoutError):
            return  # the node is stopping: its process metrics only
        yield from self.families(snap)

    @staticmethod
    def families(snap: dict[str, dict[str, int]]) -> list[Any]:
        """The metric families of a snapshot (`_snapshot`)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        fams: list[Any] = [
            GaugeMetricFamily("upr_node_connections", "Client connections open (bucket: the "
                              "one selected, empty before one is).", labels=["bucket"]),
            CounterMetricFamily("upr_node_items_written", "Versions written to the bucket "
                                "(stores, deletions, expirations, replicated).",
                                labels=["bucket"]),
            GaugeMetricFamily("upr_node_dcp_streams", "DCP streams open.", labels=["bucket"]),
            CounterMetricFamily("upr_node_dcp_sent_bytes", "Bytes DCP streams sent.",
                                labels=["bucket"]),
        ]  # fmt: skip
        keys = ("connections", "written", "streams", "sent")
        for name, row in sorted(snap.items()):
            for fam, key in zip(fams, keys, strict=True):
                if name or key == "connections":
                    fam.add_metric([name], row[key])
        return fams


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


def repo_bucket(repo: Path) -> str:
    """The repository's bucket when it has exactly one (a label without --bucket)."""
    from upr_cli.errors import UprError
    from upr_cli.repo import Repository

    try:
        names = Repository(repo).buckets()
    except (UprError, OSError):
        return ""
    return names[0] if len(names) == 1 else ""


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
