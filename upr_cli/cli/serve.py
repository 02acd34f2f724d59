"""`upr serve`: run a UPR node (one Couchbase data node) on the memcached binary protocol."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from upr_cli import interrupt
from upr_cli.cli.options import (
    BucketName,
    MemoryLimitOption,
    OldNumPartitions,
    deprecated_alias,
    either,
    num_partitions_option,
)
from upr_cli.errors import UsageError
from upr_cli.memory import MemoryLimit
from upr_cli.metrics import DEFAULT_HOST, MetricsHost, MetricsPort, check_port_options, endpoint
from upr_cli.net.collections_manifest import parse_specs
from upr_cli.net.tls import DEFAULT_TLS_PORT
from upr_cli.node.server import NodeConfig, NodeServer

HELP = """Run a UPR node: KV front end, DCP producer, SQLite storage in --data DIR.

The node prints "listening upr://HOST:PORT/BUCKET" on stdout once it serves, and with
--tls-cert and --tls-key a second line "listening-tls uprs://HOST:PORT/BUCKET" for its
TLS data port (default 11207, as Couchbase's; its cluster map advertises that port as
kvSSL, so TLS clients stay on TLS; PLAIN and SCRAM-SHA512 are offered on both ports,
and TLS clients use PLAIN, as the Couchbase SDKs do). SIGTERM or
SIGINT stop it cleanly (everything flushed, failover uuids kept); after a SIGKILL the
next start adds a failover entry at the last persisted seq of every partition. One node
at a time per --data DIR: a second one exits 1 naming the node that holds the directory
(an OS lock on DIR/node.lock, gone with its process, so a killed node restarts at once).

--memory-limit (default 192MB) bounds the node's buffers: half of it for the write
queue (writes acknowledged and not yet on disk), an eighth for what the DCP backfills
of one connection read from disk at a time, a twenty-fourth each for the page caches
of the bucket's two SQLite connections. A write that would take the queue past its
half is answered ETMPFAIL (0x86, temporary failure, as Couchbase answers when it has
no memory for a write); clients retry once the flusher has made room. A document
larger than the queue's half still goes in, alone, when the queue is empty.

Example:

  upr serve --data /tmp/node --port 11210 --user admin --password secret

Example (tests and demos on loopback, writes kept unpersisted for 60 s; with --no-auth
any user and password log in with SASL PLAIN, which the Couchbase SDKs use on a plain
connection only when told: PasswordAuthenticator(user, password,
allowed_sasl_mechanisms=["PLAIN"])):

  upr serve --data /tmp/node --port 0 --no-auth --flush-interval 60

Example (TLS on port 11207 beside the plain port; clients use uprs:// with
--cacert ca.pem or UPR_CACERT=ca.pem):

  upr serve --data /tmp/node --user admin --password secret --tls-cert node.pem \\
      --tls-key node.key

Example (client certificates required on the TLS port; one whose subject CN is
"admin" logs in as admin, and clients give uprs://HOST:11207/default --cert c.pem
--key c.key with no user in the URI):

  upr serve --data /tmp/node --user admin --password secret --tls-cert node.pem \\
      --tls-key node.key --tls-client-ca clients-ca.pem --tls-client-auth mandatory

Example (a bucket of 64 partitions; --partitions N, the old spelling, still works; a
bucket keeps its count: later starts may leave the option out):

  upr serve --data /tmp/node --no-auth --num-partitions 64

Example (scopes and collections created at start when missing; app.sessions with a
max TTL of one hour; --collections, the old spelling, still works, with a warning):

  upr serve --data /tmp/node --no-auth \\
      --create-collections app.users,app.sessions:3600

Metrics: --metrics-port PORT serves Prometheus metrics on --metrics-host (default
127.0.0.1): connections, versions written, DCP streams open and bytes they sent,
per bucket, and the process's memory (docs/metrics.md).

Example (metrics for Prometheus on port 9467):

  upr serve --data /tmp/node --no-auth --metrics-port 9467
"""

NUM_PARTITIONS = "the bucket's count in --data, 1024 for a new one"
CreateCollections = Annotated[
    str | None,
    typer.Option("--create-collections", metavar="SPEC",
                 help="Create these when missing: SCOPE, SCOPE.COLLECTION or "
                 "SCOPE.COLLECTION:MAXTTL, comma-separated."),
]  # fmt: skip
OldCollections = Annotated[str | None, deprecated_alias("--collections", "--create-collections")]
_MEMORY = MemoryLimit()  # --memory-limit's default

Host = Annotated[str, typer.Option("--host", metavar="ADDRESS", help="Address to listen on.")]
Port = Annotated[
    int,
    typer.Option("--port", min=0, max=65535, metavar="PORT", help="TCP port (0: any free port)."),
]
TlsCert = Annotated[
    Path | None,
    typer.Option("--tls-cert", metavar="FILE",
                 help="PEM certificate chain for the TLS data port (with --tls-key)."),
]  # fmt: skip
TlsKey = Annotated[
    Path | None,
    typer.Option("--tls-key", metavar="FILE", help="PEM private key of --tls-cert."),
]
TlsPort = Annotated[
    int | None,
    typer.Option("--tls-port", min=0, max=65535, metavar="PORT",
                 help="TLS data port (default 11207; 0: any free port)."),
]  # fmt: skip
TlsClientCa = Annotated[
    Path | None,
    typer.Option("--tls-client-ca", metavar="FILE",
                 help="PEM CA file: the TLS port asks for client certificates and verifies "
                 "them against it; a certificate whose subject CN is a user logs in as "
                 "that user."),
]  # fmt: skip
TlsClientAuth = Annotated[
    str | None,
    typer.Option("--tls-client-auth", metavar="MODE",
                 help="enable (default with --tls-client-ca: a client may log in with SASL "
                 "instead) or mandatory (no certificate, no connection)."),
]  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add the command to the app."""
    app.command("serve", help=HELP, no_args_is_help=True)(serve_cmd)


def load_users(user: str | None, password: str | None, users_file: Path | None) -> dict[str, str]:
    """Users from --user/--password and/or a JSON file {"name": "password", …}."""
    users: dict[str, str] = {}
    if users_file is not None:
        try:
            data = json.loads(users_file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise UsageError(f"--users-file: cannot read {users_file}: {exc.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UsageError(f"--users-file: {users_file} is not a JSON object") from None
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in data.items()
        ):
            raise UsageError('--users-file must hold a JSON object {"user": "password", …}')
        users.update(data)
    if (user is None) != (password is None):
        raise UsageError("--user and --password go together")
    if user is not None and password is not None:
        users[user] = password
    return users


# glibc's mallopt parameter: allocations from this size on get pages of their own
_M_MMAP_THRESHOLD = -3
_LARGE_BLOCK = 1 << 20


def _return_large_blocks() -> None:
    """Large values (documents of megabytes) are allocated in pages of their own and
    given back to the system when freed. glibc otherwise raises its threshold to the
    size of the largest block freed, after which such values come from per-thread
    arenas that keep the memory (measured: a backfill of 5 MB documents peaked 70 MB
    higher). Nothing happens where the C library is not glibc."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to set
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _LARGE_BLOCK)


def _users(ctx: typer.Context, user: str | None, password: str | None, users_file: Path | None,
           *, no_auth: bool) -> dict[str, str]:  # fmt: skip
    """`load_users`, after two checks: UPR_PASSWORD goes with --user alone (it is ambient:
    --no-auth and --users-file ignore it), and --no-auth takes no users."""
    source = ctx.get_parameter_source("password")  # typer's own click: compare by name
    if user is None and source is not None and source.name == "ENVIRONMENT":
        password = None
    if no_auth and (user is not None or password is not None or users_file is not None):
        raise UsageError("--no-auth serves without users: give it or --user/--password "
                         "(--users-file), not both")  # fmt: skip
    return load_users(user, password, users_file)


# Declared here, not in the signature, to keep `serve_cmd` short.
ExpiryPager = Annotated[
    float,
    typer.Option(
        "--expiry-pager-interval",
        min=0.0,
        metavar="SECONDS",
        help="Seconds between expiry pager rounds, which turn expired documents into "
        "expirations (0: only reads that find them do).",
    ),
]


def serve_cmd(
    ctx: typer.Context,
    data: Annotated[
        Path, typer.Option("--data", metavar="DIR", help="Directory for the bucket's SQLite file.")
    ],
    host: Host = "127.0.0.1",
    port: Port = 11210,
    bucket: BucketName = "default",
    num_partitions: Annotated[int | None, num_partitions_option(NUM_PARTITIONS)] = None,
    old_partitions: OldNumPartitions = None,
    user: Annotated[str | None, typer.Option("--user", metavar="NAME", help="A user name.")] = None,
    password: Annotated[
        str | None,
        typer.Option(
            "--password",
            metavar="TEXT",
            help="Its password (or set UPR_PASSWORD).",
            envvar="UPR_PASSWORD",
            show_envvar=False,
        ),
    ] = None,
    users_file: Annotated[
        Path | None,
        typer.Option("--users-file", metavar="PATH", help='JSON object {"user": "password", …}.'),
    ] = None,
    no_auth: Annotated[
        bool,
        typer.Option(
            "--no-auth",
            help="Serve without authentication (loopback only; any SASL PLAIN login is accepted).",
        ),
    ] = False,
    flush_interval: Annotated[
        float,
        typer.Option(
            "--flush-interval",
            min=0.001,
            metavar="SECONDS",
            help="Seconds the flusher gathers writes before committing.",
        ),
    ] = 0.05,
    purge_age: Annotated[
        float | None,
        typer.Option(
            "--purge-age",
            min=0.0,
            metavar="SECONDS",
            help="Purge tombstones older than this many seconds (checked every flush).",
        ),
    ] = None,
    idle_timeout: Annotated[
        float,
        typer.Option(
            "--dcp-idle-timeout",
            min=0.1,
            metavar="SECONDS",
            help="Disconnect a DCP peer silent this long (with noop on).",
        ),
    ] = 360.0,
    expiry_pager_interval: ExpiryPager = 10.0,
    create_collections: CreateCollections = None,
    old_collections: OldCollections = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_port: TlsPort = None,
    tls_client_ca: TlsClientCa = None,
    tls_client_auth: TlsClientAuth = None,
    memory: MemoryLimitOption = _MEMORY,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = DEFAULT_HOST,
) -> None:
    """Run a UPR node."""
    check_port_options(metrics_port, metrics_host, False, "")
    _return_large_blocks()
    users = _users(ctx, user, password, users_file, no_auth=no_auth)
    specs = parse_specs(either(create_collections, old_collections, None,
                               ("--create-collections", "--collections")))  # fmt: skip
    partitions = either(num_partitions, old_partitions, None, ("--num-partitions", "--partitions"))
    config = NodeConfig(
        data_dir=data, host=host, port=port, bucket=bucket, partitions=partitions, users=users,
        no_auth=no_auth, flush_interval=flush_interval, purge_age=purge_age,
        idle_timeout=idle_timeout, collections=specs,
        expiry_pager_interval=expiry_pager_interval or None, tls_cert=tls_cert,
        tls_key=tls_key, tls_port=DEFAULT_TLS_PORT if tls_port is None else tls_port,
        tls_client_ca=tls_client_ca, tls_client_auth=tls_client_auth, memory_limit=memory,
    )  # fmt: skip
    if tls_port is not None and tls_cert is None:
        raise UsageError("--tls-port needs --tls-cert and --tls-key")
    node = NodeServer(config)
    if asyncio.run(_serve(node) if metrics_port is None else
                   _serve(node, (metrics_host, metrics_port))):  # fmt: skip
        raise interrupt.Stopped  # a follower's ending


async def _serve(
    server: NodeServer, metrics: tuple[str, int | None] = (DEFAULT_HOST, None)
) -> bool:
    """Serve until SIGTERM or SIGINT, then stop cleanly; True once a signal stopped it.
    With a metrics port (`metrics`: host, port), its metrics are served there, bound
    before the node listens (upr_cli/metrics.py)."""
    watch = None
    if metrics[1] is not None:
        from upr_cli.metrics import NodeMetrics

        watch = NodeMetrics(server, asyncio.get_running_loop())
    with endpoint(watch.registry if watch else None, *metrics):
        return await _run(server)


async def _run(server: NodeServer) -> bool:
    """`_serve`'s work."""
    interrupt.follows(lambda: "every write flushed, failover uuids kept; the next start "
                      "goes on from there")  # fmt: skip
    stop = asyncio.Event()
    # closed before the clean stop, not around it: a second signal then interrupts it
    signals = contextlib.ExitStack()
    signals.enter_context(interrupt.on_signals(lambda _sig: stop.set()))
    await server.start()
    cfg = server.config
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    sys.stdout.write(f"listening upr://{host}:{server.port}/{cfg.bucket}\n")
    if server.tls_port is not None:
        sys.stdout.write(f"listening-tls uprs://{host}:{server.tls_port}/{cfg.bucket}\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        signals.close()
        await server.stop(clean=True)
    return True
