"""The node's front end: the memcached binary protocol on TCP (docs/protocol.md §5, §9).

One `ClientSession` per connection reads frames in order (no unordered execution,
docs/protocol.md §1.5) and answers each request before taking the next. Authentication
is required unless the node runs with `--no-auth` on loopback; on the TLS port a client
certificate can log a connection in (docs/protocol.md §13.5). Statuses for a misuse, as
documented in the README: wrong password → AUTH_ERROR (0x20); a bucket command before
SELECT_BUCKET → NO_BUCKET (0x08); SELECT_BUCKET or DCP_OPEN before authenticating →
EACCESS (0x24). A peer sending bytes that do not frame (bad magic, huge lengths) is
disconnected; the node keeps serving everyone else.

A session owns the connection: its read loop, the output queue and the connection's
state (login, bucket, features, DCP producer). It applies the classic stores of the load
and restore path itself, without message objects; every other request goes to its
family's handler through the dispatch table (`node/dispatch.py`, `node/handlers_*.py`).

Collections (formats/collections.md §4): a connection that negotiated them (HELLO 0x12)
names every document by a key that starts with its collection id (LEB128); on any
other connection a key is in the default collection. The bucket is handed the
qualified key either way.

Xattrs (formats/wire.md "Xattrs"): HELLO XATTR is granted and remembered per
connection; it decides whether a with-meta write may carry a blob, whether GET_META
shows bit 0x04 and whether sub-document xattr paths are served (formats/subdoc.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upr_cli.errors import ExitCode, PathError, RemoteProtocolError, UprError, UsageError, os_error
from upr_cli.memory import MemoryLimit
from upr_cli.net.certdates import date_warning
from upr_cli.net.scram import ScramServer, StoredCredential, make_credential
from upr_cli.net.tls import DEFAULT_TLS_PORT, server_context
from upr_cli.node.bucket import EXPIRY_PAGER_INTERVAL, Bucket, StaleCas
from upr_cli.node.collection_state import UnknownCollectionError, parse_specs, with_specs
from upr_cli.node.dispatch import HANDLERS, KV, unknown
from upr_cli.node.lock import DataDirLock
from upr_cli.node.partition import ACTIVE, STATE_CODES
from upr_cli.node.producer import (
    BACKFILLS_PER_CONNECTION,
    DcpProducer,
    DcpSender,
    RollbackTo,
    error_response,
)
from upr_cli.node.replication import Replicator
from upr_cli.node.storage import DocRow
from upr_cli.protocol import Frame, FrameDecoder, decode_message, leb128, snappy, xattrs
from upr_cli.protocol.fast import encode_store_response, parse_set
from upr_cli.protocol.header import DATATYPE_JSON, RESPONSE_MAGICS, Feature, Magic, Opcode
from upr_cli.protocol.messages import Message, Response, StreamRequestRollback
from upr_cli.protocol.status import (
    AccessDenied,
    InvalidArguments,
    NoBucket,
    Status,
    StatusError,
    TemporaryFailure,
)

log = logging.getLogger(__name__)

FAST_STORE: dict[int, str] = {Opcode.SET: "set", Opcode.ADD: "add", Opcode.REPLACE: "replace"}
# KV requests the read loop answers in its synchronous pass, through their messages
SYNC_KV = frozenset({Opcode.SET_WITH_META, Opcode.DEL_WITH_META, Opcode.DELETE, Opcode.GET})
# the writes whose keys' disk versions are read in one query a read; not GET, whose
# values (up to 20 MB each) would all be held at once for a read of many small requests
LOOKS_UP = frozenset(FAST_STORE) | (SYNC_KV - {Opcode.GET})
# a TLS peer that does not finish its handshake (a plain client, a stalled one) is dropped
TLS_HANDSHAKE_TIMEOUT = 10.0
UNAUTH_MAX_BODY = 16 * 1024  # bytes a peer may send in one frame before authenticating
OUT_HIGH_WATER = 1 << 20  # queued response bytes that make the session wait for the socket
OUT_CORK = 1 << 18  # queued DCP output written at once, without waiting for the loop turn
# --memory-limit's shares (docs/design.md "Performance"): the write queue (versions
# acknowledged and not yet on disk) and the disk reads of DCP backfills, all streams
# together; the rest is for what is in flight on the sockets
WRITE_QUEUE_SHARE = 0.5
BACKFILL_SHARE = 0.125
PAGE_CACHE_SHARE = 1 / 24  # each of a bucket's two SQLite connections (8 MiB of 192)
# what a single node's terse config says it can do (docs/protocol.md §5.5); the SDK
# addresses named collections only on a bucket that lists "collections"
CAPABILITIES = ["couchapi", "collections", "dcp", "cbhello", "touch", "cccp", "nodesExt"]
MECHANISMS = "SCRAM-SHA512 PLAIN"
# --no-auth takes any login over PLAIN, which carries the password. SCRAM cannot succeed
# for a password the node does not know (its final message proves that the node knows
# it), so a --no-auth node without users offers PLAIN alone.
NO_AUTH_MECHANISMS = "PLAIN"
# --tls-client-auth: Couchbase's client-certificate states other than "disable"
CLIENT_AUTH_MODES = ("enable", "mandatory")


class ServeError(UprError):
    """The node cannot start (bad options, port in use, unusable data directory)."""


class ServeUsageError(ServeError):
    """The options given cannot make a node (exit 2, as every usage error)."""

    exit_code = ExitCode.USAGE


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class NodeConfig:
    """Options of `upr serve`."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 11210
    bucket: str = "default"
    # None: the count of the bucket on disk (1024 for a new one); another count than
    # the one on disk is a usage error
    partitions: int | None = 1024
    users: dict[str, str] = field(default_factory=dict)
    no_auth: bool = False
    flush_interval: float = 0.05
    purge_age: float | None = None
    idle_timeout: float = 360.0
    max_body: int = 20 * 1024 * 1024
    backfills: int = 4
    # scopes and collections created at start when missing: "S", "S.C" or "S.C:MAXTTL"
    collections: tuple[str, ...] = ()
    # a TLS data port beside the plain one (docs/protocol.md §13): PEM chain, key, port
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_port: int = DEFAULT_TLS_PORT
    # client certificates on the TLS port (docs/protocol.md §13.5): the CA file that
    # verifies them, and "enable" (the default with a CA) or "mandatory"
    tls_client_ca: Path | None = None
    tls_client_auth: str | None = None
    # seconds between the expiry pager's rounds (None: only reads expire documents)
    expiry_pager_interval: float | None = EXPIRY_PAGER_INTERVAL
    # --memory-limit: the budget of the node's buffers, shared as MEMORY_SHARES says
    memory_limit: MemoryLimit = field(default_factory=MemoryLimit)


class NodeServer:
    """`upr serve`: buckets plus the TCP listener."""

    def __init__(self, config: NodeConfig) -> None:
        if not config.users and not config.no_auth:
            raise ServeUsageError("no users: give --user/--password or --users-file (or --no-auth)")
        if config.no_auth and not is_loopback(config.host):
            raise ServeUsageError("--no-auth is allowed only on a loopback address")
        if config.partitions is not None and not 1 <= config.partitions <= 1024:
            raise ServeUsageError("--partitions must be between 1 and 1024")
        if (config.tls_cert is None) != (config.tls_key is None):
            raise ServeUsageError("--tls-cert and --tls-key go together")
        self.tls = self._tls_context(config)
        try:
            parse_specs(config.collections)
        except UsageError as exc:
            raise ServeUsageError(f"--collections: {exc}") from None
        self.config = config
        self.credentials: dict[str, StoredCredential] = {
            u: make_credential("SCRAM-SHA512", p) for u, p in config.users.items()
        }
        self.buckets: dict[str, Bucket] = {}
        self.sessions: set[ClientSession] = set()
        self.dcp_sent: dict[str, int] = {}  # DCP bytes of closed sessions, per bucket
        self._server: asyncio.Server | None = None
        self._tls_server: asyncio.Server | None = None
        self.tls_port: int | None = None  # once listening with TLS
        self.backfill_pool = ThreadPoolExecutor(
            max_workers=config.backfills, thread_name_prefix="backfill"
        )
        self.backfill_slots = asyncio.Semaphore(config.backfills)
        # what one stream reads from disk at a time: the backfills' share of the memory
        # limit over the open backfills of one connection
        self.backfill_batch_bytes = max(
            64 * 1024, config.memory_limit.share(BACKFILL_SHARE) // BACKFILLS_PER_CONNECTION
        )
        self.port = config.port
        self.rev = 1
        self.replicator: Replicator | None = None
        self.warned_no_auth_scram = False  # logged once: SCRAM cannot take any password
        self.lock = DataDirLock(config.data_dir)

    @staticmethod
    def _tls_context(config: NodeConfig) -> ssl.SSLContext | None:
        """The TLS port's context; with --tls-client-ca it asks for client certificates."""
        mode = config.tls_client_auth
        if mode is not None and config.tls_client_ca is None:
            raise ServeUsageError("--tls-client-auth needs --tls-client-ca FILE")
        if mode not in (None, *CLIENT_AUTH_MODES):
            raise ServeUsageError(f"--tls-client-auth: enable or mandatory, not {mode!r}")
        if config.tls_client_ca is not None and config.tls_cert is None:
            raise ServeUsageError("--tls-client-ca needs --tls-cert and --tls-key (the TLS port)")
        if config.tls_cert is None or config.tls_key is None:
            return None
        ca = None if config.tls_client_ca is None else str(config.tls_client_ca)
        try:
            return server_context(str(config.tls_cert), str(config.tls_key), ca,
                                  mandatory=mode == "mandatory")  # fmt: skip
        except UsageError as exc:
            raise ServeUsageError(str(exc)) from None

    def certificate_user(self, peercert: Any) -> tuple[bool, str | None]:
        """Client-certificate authentication (docs/protocol.md §13.5), as Couchbase maps
        a certificate by default (path subject.cn, no prefix, no delimiter): whether the
        connection may stay, and the user a verified certificate logs it in as. A
        certificate whose subject CN names none of the node's users is refused (kv_engine
        closes such a connection); --no-auth ignores the CN, as it needs no login."""
        if not peercert or self.config.no_auth:  # plain port, no certificate, --no-auth
            return True, None
        names = [v for rdn in peercert.get("subject", ()) for k, v in rdn if k == "commonName"]
        user = names[0] if names else None
        if user is None or user not in self.credentials:
            return False, user
        return True, user

    @property
    def mechanisms(self) -> str:
        """What SASL_LIST_MECHS offers: PLAIN alone on a --no-auth node without users."""
        cfg = self.config
        return NO_AUTH_MECHANISMS if cfg.no_auth and not cfg.users else MECHANISMS

    async def start(self) -> None:
        """Lock the data directory, open the buckets (recovery included) and listen."""
        cfg = self.config
        if cfg.data_dir.exists() and not cfg.data_dir.is_dir():
            raise PathError(f"--data {cfg.data_dir}: not a directory", cfg.data_dir)
        try:
            cfg.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, cfg.data_dir, "cannot create the data directory") from None
        self.lock.acquire()  # before anything in the directory is opened (node/lock.py)
        try:
            await self._start()
        except BaseException:
            self.lock.release()
            raise

    async def _start(self) -> None:
        cfg = self.config
        bucket = Bucket(
            cfg.data_dir,
            cfg.bucket,
            cfg.partitions,
            flush_interval=cfg.flush_interval,
            purge_age=cfg.purge_age,
            expiry_pager_interval=cfg.expiry_pager_interval,
            queue_limit=cfg.memory_limit.share(WRITE_QUEUE_SHARE),
            cache_kib=cfg.memory_limit.share(PAGE_CACHE_SHARE) // 1024,
        )
        await bucket.start()
        self.buckets[cfg.bucket] = bucket
        try:
            wanted = with_specs(bucket.manifest, cfg.collections)
            if wanted != bucket.manifest:
                await bucket.set_manifest(wanted)
        except UprError as exc:  # a spec the stored manifest cannot take
            await bucket.stop(clean=True)
            raise ServeUsageError(f"--collections: {exc}") from None
        user = min(cfg.users) if cfg.users else None
        try:
            self._server = await asyncio.start_server(
                self._accept, cfg.host, cfg.port, limit=1 << 18
            )
        except OSError as exc:
            await bucket.stop(clean=True)
            raise ServeError(
                f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}"
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]
        if self.tls is not None:
            assert cfg.tls_cert is not None
            if (warning := date_warning(cfg.tls_cert, "--tls-cert")) is not None:
                log.warning("%s", warning)  # ssl serves it all the same
            await self._listen_tls(bucket)
        # replicas are fed with the node's own credentials (formats/cluster.md §5)
        self.replicator = Replicator(bucket, port=self.port, user=user,
                                     password=cfg.users.get(user) if user else None)  # fmt: skip
        self.replicator.start()

    async def _listen_tls(self, bucket: Bucket) -> None:
        """The TLS data port: the same sessions as the plain port, behind a handshake."""
        cfg = self.config
        try:
            self._tls_server = await asyncio.start_server(
                self._accept, cfg.host, cfg.tls_port, limit=1 << 18, ssl=self.tls,
                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT,
            )  # fmt: skip
        except OSError as exc:
            assert self._server is not None
            self._server.close()
            await bucket.stop(clean=True)
            raise ServeError(
                f"cannot listen on {cfg.host}:{cfg.tls_port} (TLS): {exc.strerror or exc}"
            ) from None
        self.tls_port = self._tls_server.sockets[0].getsockname()[1]

    async def stop(self, *, clean: bool = True) -> None:
        """Stop listening, drop sessions, flush (if clean) and close the buckets."""
        if self._tls_server is not None:
            self._tls_server.close()
        if self._server is not None:
            self._server.close()
        if self.replicator is not None:
            await self.replicator.stop()
        for s in list(self.sessions):
            await s.aclose()
        for server in (self._server, self._tls_server):
            if server is not None:
                with contextlib.suppress(Exception):
                    await server.wait_closed()
        for b in self.buckets.values():
            await b.stop(clean=clean)
        self.backfill_pool.shutdown(wait=True)
        self.lock.release()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = ClientSession(self, reader, writer)
        if not session.certificate_login():
            writer.close()
            return
        self.sessions.add(session)
        try:
            await session.run()
        except (ConnectionError, OSError) as exc:
            # a peer that leaves while its session closes is normal: one debug line, not
            # an exception in this task that nobody awaits (asyncio would print it with a
            # traceback as "Task exception was never retrieved")
            log.debug("%s: connection lost while closing: %s", session.peer, exc)
        finally:
            self.sessions.discard(session)
            if session.bucket is not None and session.dcp_sent:
                name = session.bucket.name
                self.dcp_sent[name] = self.dcp_sent.get(name, 0) + session.dcp_sent

    def cluster_config(self, bucket: Bucket) -> dict[str, Any]:
        """The cluster map an orchestrator set (formats/cluster.md), else a terse
        single-node bucket config (docs/protocol.md §5.5)."""
        if bucket.cluster_map is not None:
            return bucket.cluster_map
        port = self.port
        return {
            "rev": self.rev,
            "revEpoch": 1,
            "name": bucket.name,
            "uuid": bucket.storage.bucket_uuid(),
            "nodeLocator": "vbucket",
            "uri": f"/pools/default/buckets/{bucket.name}",
            "streamingUri": f"/pools/default/bucketsStreaming/{bucket.name}",
            "bucketCapabilitiesVer": "",
            "bucketCapabilities": CAPABILITIES,
            "collectionsManifestUid": f"{bucket.manifest.uid:x}",
            "ddocs": {"uri": f"/pools/default/buckets/{bucket.name}/ddocs"},
            "vBucketServerMap": {
                "hashAlgorithm": "CRC",
                "numReplicas": 0,
                "serverList": [f"$HOST:{port}"],
                "vBucketMap": [
                    [0 if p.state == ACTIVE else -1] for _, p in sorted(bucket.partitions.items())
                ],
            },
            "nodes": [
                {
                    "hostname": "$HOST:8091",
                    "ports": {"direct": port},
                    "couchApiBase": f"http://$HOST:8092/{bucket.name}",
                }
            ],
            "nodesExt": [{"thisNode": True, "services": self.services()}],
            "clusterCapabilitiesVer": [1, 0],
            "clusterCapabilities": {},
        }

    def services(self) -> dict[str, int]:
        """This node's ports as `nodesExt` names them: `kvSSL` is the TLS data port, which
        keeps TLS clients on TLS (docs/protocol.md §13.2)."""
        out = {"kv": self.port}
        if self.tls_port is not None:
            out["kvSSL"] = self.tls_port
        return out


class ClientSession:
    """One client connection: the read loop, the fast paths, output corking and the
    connection's state; the handlers of `node/dispatch.py` answer through it."""

    def __init__(
        self, server: NodeServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
        self.authenticated = server.config.no_auth
        self.user: str | None = None
        self.cert_user: str | None = None  # the user its client certificate logged in
        self.bucket: Bucket | None = None
        self.features: set[int] = set()
        self.scram: ScramServer | None = None
        self.dcp: DcpProducer | None = None
        self.sender = DcpSender(self._write_now, writer.drain)
        self._closing = False
        self._out: list[bytes] = []  # responses of the current read, written in one go
        self._out_bytes = 0
        self._flush_soon = False  # a call_soon(_uncork) is pending
        self.dcp_sent = 0  # DCP output bytes (serve's metrics)
        self.decoder = FrameDecoder(max_body=UNAUTH_MAX_BODY)

    def certificate_login(self) -> bool:
        """Log in as the user a verified client certificate names; False for one that
        names none: the caller closes at once (docs/protocol.md §13.5)."""
        ok, user = self.server.certificate_user(self.writer.get_extra_info("peercert"))
        if not ok:
            cn = "(none)" if user is None else repr(user)
            log.warning("%s: disconnecting: the client certificate's subject CN %s names "
                        "no user of this node", self.peer, cn)  # fmt: skip
        elif user is not None:
            self.authenticated, self.user, self.cert_user = True, user, user
        return ok

    async def run(self) -> None:
        """Read and answer requests until the peer leaves or misbehaves."""
        # kv_engine's limit for unauthenticated peers; raised after SASL (docs/protocol.md §1.6)
        self.decoder.max_body = (
            self.server.config.max_body if self.authenticated else UNAUTH_MAX_BODY
        )
        decoder = self.decoder
        try:
            while not self._closing:
                data = await self.reader.read(1 << 18)
                if not data:
                    return
                decoder.feed(data)
                if self.dcp is not None:
                    self.dcp.last_received = time.monotonic()
                # every item is a Frame: requests are never turned into DCP data rows here
                frames: list[Frame] = decoder.read_rows(1 << 16, data_rows=False)  # type: ignore[assignment]
                if self.bucket is not None and len(frames) > 8:
                    self.bucket.prefetch([
                        (f.vbucket_or_status, self.qualified(f.key, check=False)) for f in frames
                        if f.opcode in LOOKS_UP and f.magic == Magic.REQUEST
                    ])  # fmt: skip
                i, n = 0, len(frames)
                while i < n:
                    # the KV stores of the read in one pass, without a coroutine each
                    i = self.fast_stores(frames, i)
                    if i < n:
                        await self.handle(frames[i])
                        i += 1
                        if self._closing:
                            return
                    if self._out_bytes > OUT_HIGH_WATER:
                        await self.drain_out()
                await self.drain_out()
        except RemoteProtocolError as exc:
            log.info("%s: disconnecting: %s", self.peer, exc)
        except (ConnectionError, OSError) as exc:
            log.debug("%s: connection lost: %s", self.peer, exc)  # a peer leaving is normal
        finally:
            await self.aclose()

    async def drain_out(self) -> None:
        """Write queued responses and wait while the socket's buffer is full (back-pressure)."""
        self.flush_out()
        await self.writer.drain()

    def fatal(self, reason: str) -> None:
        """Disconnect this peer (idle DCP peer, internal stream error)."""
        log.info("%s: disconnecting: %s", self.peer, reason)
        self._closing = True
        self.writer.close()

    async def aclose(self) -> None:
        """Stop DCP streams and close the socket."""
        with contextlib.suppress(Exception):
            self.flush_out()
        self._closing = True
        if self.dcp is not None:
            dcp, self.dcp = self.dcp, None
            await dcp.aclose()
        with contextlib.suppress(Exception):
            self.writer.close()

    def send(self, msg: Message | bytes) -> None:
        """Queue a response (not flow-controlled); written at the end of the read or before
        anything that lets DCP stream output interleave."""
        data = msg if isinstance(msg, bytes) else msg.encode()
        self._out.append(data)
        self._out_bytes += len(data)

    def flush_out(self) -> None:
        """Write queued responses in one call."""
        if self._out:
            out, self._out = self._out, []
            self._out_bytes = 0
            self.writer.write(out[0] if len(out) == 1 else b"".join(out))

    def _write_now(self, data: bytes) -> None:
        """DCP output joins the queued responses in order (a STREAM_REQ reply precedes its
        data). Streams of many partitions each send small snapshots; the queue is written
        once per event-loop turn (or at OUT_CORK bytes), not once per snapshot: one
        syscall for many streams (profiled: per-snapshot writes dominated replication)."""
        self._out.append(data)
        self._out_bytes += len(data)
        self.dcp_sent += len(data)
        if self._out_bytes >= OUT_CORK:
            self.flush_out()
        elif not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._uncork)

    def _uncork(self) -> None:
        self._flush_soon = False
        if not self._closing and not self.writer.is_closing():
            self.flush_out()

    async def handle(self, frame: Frame) -> None:
        """Answer one request; status errors become responses, not disconnects."""
        if frame.magic in RESPONSE_MAGICS:
            return  # a client's reply: NOOP (docs/protocol.md §2.12), marker ack, set-vbucket-state
        if frame.opcode in FAST_STORE and frame.magic == Magic.REQUEST and len(frame.extras) == 8:
            self.fast_stores([frame], 0)
            return
        try:
            msg = decode_message(frame)
        except RemoteProtocolError as exc:
            self.send(error_response(frame.opcode, frame.opaque, Status.EINVAL, str(exc)))
            return
        try:
            # the handler by the request's type (node/dispatch.py); one that awaits
            # returns its coroutine
            pending = HANDLERS.get(type(msg), unknown)(self, msg)
            if pending is not None:
                await pending
        except RollbackTo as rb:
            self.send(StreamRequestRollback(opaque=msg.opaque, rollback_seqno=rb.seq))
        except StatusError as exc:
            self.error_reply(frame, exc)

    @property
    def collections(self) -> bool:
        """Whether this connection negotiated collections (HELLO 0x12)."""
        return Feature.COLLECTIONS in self.features

    def qualified(self, key: bytes | memoryview, *, check: bool = True) -> bytes:
        """The node's key for a request's key: as sent on a collections connection (a
        canonical LEB128 collection id, then at least one byte), else in the default
        collection (formats/collections.md §4)."""
        if Feature.COLLECTIONS not in self.features:
            return b"\x00" + bytes(key)
        if check and not (len(key) > 1 and key[0] < 0x80):  # a one-byte id is canonical
            try:
                _, rest = leb128.split_key(key)
            except RemoteProtocolError as exc:
                raise InvalidArguments(str(exc)) from None
            if not rest:
                raise InvalidArguments("a key needs a collection id and at least one byte")
        return bytes(key)

    def error_reply(self, frame: Frame, exc: StatusError) -> None:
        """The response to a refused request (formats/cluster.md for the first two)."""
        if isinstance(exc, UnknownCollectionError):
            # kv_engine's error context: the uid of the manifest the node looked in
            # (formats/collections.md §4), so a client knows whether to refresh its own
            body = json.dumps({"error": {"context": str(exc)},
                               "manifest_uid": f"{exc.manifest_uid:x}"}).encode()  # fmt: skip
            self.send(Response(opcode=frame.opcode, opaque=frame.opaque, status=exc.code,
                               value=body, datatype=DATATYPE_JSON))  # fmt: skip
        elif isinstance(exc, StaleCas) and self.bucket is not None:
            # the right bucket CAS in the header: the orchestrator retries with it
            # (formats/cluster.md §1)
            self.send(Response(opcode=frame.opcode, opaque=frame.opaque, status=exc.code,
                               cas=self.bucket.state_cas, value=str(exc).encode()))  # fmt: skip
        elif exc.code == Status.NOT_MY_VBUCKET and self.bucket is not None:
            # the cluster map travels with NOT_MY_VBUCKET (docs/protocol.md §3)
            body = json.dumps(self.server.cluster_config(self.bucket)).encode()
            self.send(Response(opcode=frame.opcode, opaque=frame.opaque, status=exc.code,
                               value=body, datatype=DATATYPE_JSON))  # fmt: skip
        else:
            self.send(error_response(frame.opcode, frame.opaque, exc.code, str(exc)))

    def fast_stores(self, frames: list[Frame], i: int) -> int:
        """Apply the classic SET/ADD/REPLACE requests from `frames[i]` on, up to the
        first other request, and queue their answers; returns the index of that request.
        No message objects, no coroutine per request (the load and restore path); each
        request still gets its own answer, a refusal included."""
        out = self._out
        size = 0
        n = len(frames)
        request = Magic.REQUEST
        with_seq = Feature.MUTATION_SEQNO in self.features
        colls = self.collections
        uuids: dict[int, int] = {}  # per partition: no failover happens within this pass
        while i < n:
            frame = frames[i]
            if frame.magic != request:
                break
            if frame.opcode not in FAST_STORE or len(frame.extras) != 8:
                if frame.opcode not in SYNC_KV:
                    break
                # the restore path (with-meta writes) and deletions: decoded as messages,
                # answered in the same pass
                i += 1
                self._out_bytes += size
                size = 0
                self.sync_kv(frame)
                out = self._out
                if self._out_bytes > OUT_HIGH_WATER:
                    break  # a GET's answer can be megabytes: the session waits for the socket
                continue
            i += 1
            try:
                bucket, vb, doc = self.fast_store(frame, colls)
            except StatusError as exc:
                self._out_bytes += size
                size = 0
                self.error_reply(frame, exc)
                out = self._out
                continue
            if with_seq:
                uuid = uuids.get(vb)
                if uuid is None:
                    uuid = uuids[vb] = bucket.partitions[vb].uuid
                data = encode_store_response(frame.opcode, frame.opaque, doc.cas, uuid, doc.seq)
            else:
                data = encode_store_response(frame.opcode, frame.opaque, doc.cas)
            out.append(data)
            size += len(data)
            if size + self._out_bytes > OUT_HIGH_WATER:
                break
        self._out_bytes += size
        return i

    def sync_kv(self, frame: Frame) -> None:
        """A KV request of SYNC_KV answered as `handle` would, without a coroutine."""
        try:
            msg = decode_message(frame)
        except RemoteProtocolError as exc:
            self.send(error_response(frame.opcode, frame.opaque, Status.EINVAL, str(exc)))
            return
        try:
            KV.get(type(msg), unknown)(self, msg)
        except StatusError as exc:
            self.error_reply(frame, exc)

    def fast_store(self, frame: Frame, collections: bool) -> tuple[Bucket, int, DocRow]:
        """SET/ADD/REPLACE without building message objects: (bucket, vbucket, version).
        `collections`: whether the connection negotiated them (see `qualified`)."""
        bucket = self.need_bucket()
        if not bucket.traffic:
            self.check_traffic()
        flags, expiration, key, value = parse_set(frame)
        if frame.datatype:
            self.check_datatype(frame.datatype)
        if not collections:
            key = b"\x00" + key
        elif not (len(key) > 1 and key[0] < 0x80):  # else a one-byte id, then the key
            key = self.qualified(key)
        vb = frame.vbucket_or_status
        doc = bucket.store(FAST_STORE[frame.opcode], vb, key, value, flags=flags,
                           expiry=expiration, datatype=frame.datatype, cas=frame.cas)  # fmt: skip
        return bucket, vb, doc

    def check_datatype(self, datatype: int, *, with_meta: bool = False) -> None:
        """EINVAL for a compressed value on a connection that did not negotiate Snappy
        (docs/protocol.md §1.4), and for a value with xattrs unless it is a with-meta
        write on a connection that negotiated XATTR: kv_engine's validators take bit
        0x04 from neither SET, ADD nor REPLACE (formats/wire.md "Xattrs", point 5)."""
        if datatype & snappy.SNAPPY and Feature.SNAPPY not in self.features:
            raise InvalidArguments("a Snappy value needs HELLO Snappy (0x0a)")
        if datatype & xattrs.XATTR:
            if not with_meta:
                raise InvalidArguments("datatype XATTR is only for SET_WITH_META/DEL_WITH_META")
            if Feature.XATTR not in self.features:
                raise InvalidArguments("a value with xattrs needs HELLO XATTR (0x06)")

    def need_admin_bucket(self) -> Bucket:
        """The selected bucket, for a state command (an authenticated session)."""
        if not self.authenticated:
            raise AccessDenied("authenticate before changing partition states")
        return self.need_bucket()

    def check_traffic(self) -> None:
        """ETMPFAIL while front-end traffic is off: a cluster node that restarted serves
        no data until its orchestrator has given it the current map and states (the UPR
        design specification, "How ns_server and ep-engine guarantee ordering of partition
        state transitions", steps 1-3), so a client holding an older map cannot write to a
        copy that is no longer active (formats/cluster.md §3)."""
        if self.bucket is not None and not self.bucket.traffic:
            raise TemporaryFailure(
                "traffic is off until the cluster's orchestrator turns it on (upr cluster start)"
            )

    def need_bucket(self) -> Bucket:
        """The selected bucket, or NO_BUCKET."""
        if self.bucket is None:
            raise NoBucket("no bucket selected")
        return self.bucket


__all__ = ["STATE_CODES", "NodeConfig", "NodeServer", "ServeError", "is_loopback"]
