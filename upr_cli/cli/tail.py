"""`upr tail`: watch a bucket's changes (kcat-like)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from upr_cli import interrupt
from upr_cli.cli.options import (
    CaCert,
    ClientCert,
    ClientKey,
    Compression,
    Keys,
    MemoryLimitOption,
    NodeUri,
    NoVerify,
    Partitions,
    PasswordFile,
    Wait,
    key_pattern,
    tls_source,
)
from upr_cli.cli.output import notice, stderr
from upr_cli.collections import parse_paths
from upr_cli.errors import UsageError
from upr_cli.jobs.tail import TailOptions, TailSummary, tail, window
from upr_cli.memory import MemoryLimit
from upr_cli.metrics import (
    DEFAULT_HOST,
    MetricsHost,
    MetricsPerPartition,
    MetricsPort,
    beside,
    check_port_options,
    endpoint,
)
from upr_cli.net.uri import SourceUri
from upr_cli.source import selected

if TYPE_CHECKING:
    from upr_cli.metrics import TailMetrics

_MEMORY = MemoryLimit()  # --memory-limit's default

HELP = """Print a bucket's changes as they stream over DCP.

URI is upr://[user[:password]@]host[:port]/bucket (couchbase:// too; the password may
come from UPR_PASSWORD); uprs:// and couchbases:// connect with TLS (port 11207 by
default) and check the server certificate against the system's CAs or --cacert FILE
(UPR_CACERT); --no-verify checks nothing and says so on every run. --format json
prints one object a line with partition, seq, op, scope and collection (names), key,
value (the document itself when its datatype says JSON, else value_b64), cas (a
decimal string), rev_seq, flags and expiry, and xattrs (an object of the document's
extended attributes, each value as JSON) when the change has some: a deletion too
keeps its system xattrs (_sync, _txn). Text lines show a key outside the default
collection as scope.collection:key, and xattrs by name (xattrs=_sync,meta).

Every collection is streamed unless --collections names some (SCOPE or
SCOPE.COLLECTION, comma-separated; .C is _default.C): the source then sends only
those. Collections and scopes created and dropped are always shown, in seq order: as
JSON, objects with "op": "system_event" and an "event" field ("collection-created",
"collection-dropped", "scope-created", "scope-dropped"); as text, lines starting with
"#", ids in hex. -v also shows snapshot markers, rollbacks and stream opens and ends
(as JSON, "op" snapshot_marker, rollback, stream_open, stream_end, and their "event").
Every JSON line has "op", so jq 'select(.op=="mutation")' reads the stream. --state
keeps the collections followed, so a resume still shows the drop of one dropped
meanwhile. A source without collections (an older server) has only
_default._default.

A node that goes away (a restart, a crash, a network cut) is reconnected for up to
--wait seconds (120; forever for a service, 0 for no waiting), with a line on stderr
when the link is lost and when it is back; streams resume where they stood, nothing
lost. In a cluster, partitions whose node is down wait as long while the others stream.
--until-end stops at the high seqnos read at the start, capped at what the node holds
after it restarted from a crash or failed over (the rollback shows with -v).

Exit 0 at the end and when SIGINT (Ctrl-C) or SIGTERM stops a follow; 130 or 143 when
one stops --until-end; 1 on a connection or authentication error, a node away longer
than --wait, an unknown collection, or a follow whose collections were all
dropped.

Example (everything up to now, as JSON lines):

  upr tail upr://admin@127.0.0.1:11210/default --until-end --format json

Example (follow new changes of partitions 0-15, keys matching user::):

  upr tail upr://admin@127.0.0.1/default --from now --partitions 0-15 \\
      --keys 'user::'

Example (over TLS, the server certificate checked against ca.pem; UPR_CACERT=ca.pem
does the same for every command):

  upr tail uprs://admin@db.example.com/default --cacert ca.pem --until-end

Example (a service: follow for good, waiting out any node restart):

  upr tail upr://admin@127.0.0.1/default --from now --wait forever --format json

Example (two collections of scope app, with their creations and drops):

  upr tail upr://admin@127.0.0.1/default --collections app.users,app.orders -v

Metrics: --metrics-port PORT (a tail that follows: not with --until-end) serves
Prometheus metrics on --metrics-host (default 127.0.0.1): changes and bytes
streamed, lag in seqs and seconds, reconnects, rollbacks (docs/metrics.md);
--metrics-per-partition labels the lag by partition too.

Example (follow with metrics for Prometheus on port 9466):

  upr tail upr://admin@127.0.0.1/default --from now --format json \\
      --metrics-port 9466 > changes.jsonl
"""


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("tail", help=HELP, no_args_is_help=True)(tail_cmd)


def tail_cmd(
    uri: NodeUri,
    start: Annotated[
        str, typer.Option("--from", metavar="WHERE", help="beginning, now, or a seq number.")
    ] = "beginning",
    until_end: Annotated[
        bool, typer.Option("--until-end", help="Stop at the high seqnos read at start.")
    ] = False,
    count: Annotated[
        int | None, typer.Option("--count", min=1, metavar="N", help="Stop after N changes.")
    ] = None,
    partitions: Partitions = None,
    keys: Keys = None,
    fmt: Annotated[
        str, typer.Option("--format", metavar="text|json", help="One line of text, or of JSON.")
    ] = "text",
    collections: Annotated[
        str | None,
        typer.Option(
            "--collections",
            metavar="PATHS",
            help="Only these scopes or collections, filtered by the source (SCOPE or "
            "SCOPE.COLLECTION, comma-separated).",
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "-v",
            "--verbose",
            help="Also show snapshot markers, rollbacks and stream opens and ends "
            "(collection changes are always shown).",
        ),
    ] = False,
    state: Annotated[
        Path | None,
        typer.Option(
            "--state", metavar="PATH", help="Resume from and save positions to this JSON file."
        ),
    ] = None,
    wait: Wait = 120.0,
    compression: Compression = "auto",
    memory: MemoryLimitOption = _MEMORY,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = DEFAULT_HOST,
    metrics_per_partition: MetricsPerPartition = False,
) -> None:
    """Print a bucket's changes."""
    if fmt not in ("text", "json"):
        raise UsageError("--format takes text or json")
    follows = "" if not until_end else "a tail that follows (not with --until-end)"
    check_port_options(metrics_port, metrics_host, metrics_per_partition, follows)
    opts = TailOptions(
        start=start, until_end=until_end, count=count, partitions=selected(partitions),
        keys=key_pattern(keys), fmt=fmt, verbose=verbose, state=state, wait=wait,
        compression=compression, buffer_size=window(memory),
        collections=parse_paths(collections) or None,
    )  # fmt: skip
    source = tls_source(SourceUri.parse(uri), cacert, no_verify, cert, key)
    saved = (f"positions saved in {state}; the same command continues from there" if state
             else "no --state, so no position saved (--state FILE keeps one)")  # fmt: skip
    (interrupt.keeps if until_end else interrupt.follows)(lambda: saved)
    watch = None
    if metrics_port is not None:
        from upr_cli.metrics import TailMetrics

        watch = TailMetrics(source.bucket or "", per_partition=metrics_per_partition)
    try:
        with endpoint(watch.registry if watch else None, metrics_host, metrics_port):
            summary = asyncio.run(_run(source, opts, watch))
    except BrokenPipeError:
        # the reader went away (`upr tail … | head`): a normal end, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    if sys.stderr.isatty():
        stderr.print(f"{summary.items} changes, {summary.rollbacks} rollbacks")


async def _run(source: SourceUri, opts: TailOptions, watch: TailMetrics | None) -> TailSummary:
    """The tail, and with metrics its lag polled beside it."""
    warn = lambda text: stderr.print(f"upr: warning: {text}")  # noqa: E731
    if watch is None:
        return await tail(source, opts, on_warning=warn, on_notice=notice)

    def opened(positions: Callable[[], dict[int, int]]) -> None:
        watch.positions = positions

    job = tail(source, opts, on_warning=warn, on_notice=watch.with_notice(notice),
               on_progress=watch.progress, on_open=opened)  # fmt: skip
    poll = watch.poll_lag(source, opts.partitions, watch.taken, "upr-tail-lag")
    summary: TailSummary = await beside(job, poll)
    return summary
