"""The node's front end: the memcached binary protocol on TCP (docs/protocol.md §5, §9).

One `ClientSession` per connection reads frames in order (no unordered execution,
docs/protocol.md §1.5) and answers each request before taking the next. Authentication
is required unless the node runs with `--no-auth` on loopback; on the TLS port a client
certificate can log a connection in (docs/protocol.md §13.5). Statuses for a misuse, as
documented in the README: wrong password → AUTH_ERROR (0x20); a bucket command before
SELECT_BUCKET → NO_BUCKET (0x08); SELECT_BUCKET or DCP_OPEN before authenticating →
EACCESS (0x24). A peer sending bytes that do not frame (bad magic, huge lengths) is
disconnected; the node keeps serving everyone else.

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
import os
import ssl
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upr_cli.collections import CollectionsError, Manifest
from upr_cli.errors import ExitCode, PathError, RemoteProtocolError, UprError, UsageError, os_error
from upr_cli.memory import MemoryLimit
from upr_cli.net.certdates import date_warning
from upr_cli.net.scram import (
    AuthenticationFailed,
    ScramServer,
    StoredCredential,
    make_credential,
    parse_plain,
)
from upr_cli.net.tls import DEFAULT_TLS_PORT, server_context
from upr_cli.node import subdoc, subdoc_kv
from upr_cli.node.bucket import EXPIRY_PAGER_INTERVAL, Bucket, StaleCas
from upr_cli.node.collection_state import UnknownCollectionError, parse_specs, with_specs
from upr_cli.node.lock import DataDirLock
from upr_cli.node.partition import ACTIVE, DEAD, STATE_CODES
from upr_cli.node.producer import (
    BACKFILLS_PER_CONNECTION,
    OPEN_PRODUCER,
    DcpProducer,
    DcpSender,
    RollbackTo,
    error_response,
    open_flags_problem,
)
from upr_cli.node.replication import Replicator
from upr_cli.node.storage import DocRow
from upr_cli.protocol import Frame, FrameDecoder, decode_message, leb128, snappy, xattrs
from upr_cli.protocol.fast import encode_store_response, parse_set
from upr_cli.protocol.header import RESPONSE_MAGICS, Feature, FrameId, Magic, Opcode
from upr_cli.protocol.messages import (
    Add,
    AddStream,
    Barrier,
    BufferAck,
    CloseStream,
    CollectionsGetId,
    CollectionsGetManifest,
    CollectionsGetScopeId,
    CollectionsIdResponse,
    CollectionsSetManifest,
    Control,
    DcpOpen,
    Delete,
    DelWithMeta,
    DisableTraffic,
    EnableTraffic,
    FailoverLogResponse,
    Get,
    GetAllVbSeqnos,
    GetAllVbSeqnosResponse,
    GetClusterConfig,
    GetErrorMap,
    GetFailoverLog,
    GetResponse,
    Hello,
    HelloResponse,
    Message,
    Noop,
    ObserveSeqno,
    ObserveSeqnoResponse,
    Replace,
    Response,
    SaslAuth,
    SaslListMechs,
    SaslListMechsResponse,
    SaslStep,
    SelectBucket,
    Set,
    SetClusterConfig,
    SetParam,
    SetVbucket,
    SetWithMeta,
    Stat,
    StatResponse,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
    UnknownRequest,
)
from upr_cli.protocol.status import (
    AccessDenied,
    AuthError,
    InvalidArguments,
    KeyNotFound,
    NoBucket,
    NotMyVbucket,
    NotSupported,
    Status,
    StatusError,
    TemporaryFailure,
    UnknownCommand,
    registered_statuses,
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
GRANTABLE = {
    Feature.TCP_NODELAY,
    Feature.XERROR,
    Feature.SELECT_BUCKET,
    Feature.JSON,
    Feature.MUTATION_SEQNO,
    Feature.ALT_REQUEST_SUPPORT,
    Feature.COLLECTIONS,
    Feature.SNAPPY,  # values kept as they come, compressed or not (formats/wire.md "Snappy")
    Feature.XATTR,  # documents keep extended attributes (formats/wire.md "Xattrs")
}
# KV commands the official SDK sends that upr's message layer does not model: answered
# from the raw request (formats/collections.md §5)
TOUCH, GAT, GET_META = Opcode.TOUCH, Opcode.GAT, Opcode.GET_META
SUBDOC_MULTI_LOOKUP = Opcode.SUBDOC_MULTI_LOOKUP
SUBDOC_MULTI_MUTATION = Opcode.SUBDOC_MULTI_MUTATION
SUBDOC = frozenset({SUBDOC_MULTI_LOOKUP, SUBDOC_MULTI_MUTATION})  # formats/subdoc.md
RAW_KV = frozenset({TOUCH, GAT, GET_META, *SUBDOC})
_U32 = struct.Struct(">I")
_META_V2 = struct.Struct(">IIIQB")  # deleted, flags, expiry, rev seq, datatype
_MUTATION_TOKEN = struct.Struct(">QQ")  # vbucket uuid, seqno
# what a single node's terse config says it can do (docs/protocol.md §5.5); the SDK
# addresses named collections only on a bucket that lists "collections"
# the parts of a bucket config that describe the cluster rather than the bucket
GLOBAL_CONFIG_KEYS = ("rev", "revEpoch", "nodesExt", "clusterCapabilitiesVer",
                      "clusterCapabilities")  # fmt: skip
CAPABILITIES = ["couchapi", "collections", "dcp", "cbhello", "touch", "cccp", "nodesExt"]
MECHANISMS = "SCRAM-SHA512 PLAIN"
# --no-auth takes any login over PLAIN, which carries the password. SCRAM cannot succeed
# for a password the node does not know (its final message proves that the node knows
# it), so a --no-auth node without users offers PLAIN alone.
NO_AUTH_MECHANISMS = "PLAIN"
# --tls-client-auth: Couchbase's client-certificate states other than "disable"
CLIENT_AUTH_MODES = ("enable", "mandatory")


COLLECTIONS_COMMANDS = (CollectionsSetManifest, CollectionsGetManifest, CollectionsGetId,
                        CollectionsGetScopeId)  # fmt: skip


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
    """One client connection."""

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
            await self.dispatch(msg)
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
                               value=body, datatype=1))  # fmt: skip
        elif isinstance(exc, StaleCas) and self.bucket is not None:
            # the right bucket CAS in the header: the orchestrator retries with it
            # (formats/cluster.md §1)
            self.send(Response(opcode=frame.opcode, opaque=frame.opaque, status=exc.code,
                               cas=self.bucket.state_cas, value=str(exc).encode()))  # fmt: skip
        elif exc.code == Status.NOT_MY_VBUCKET and self.bucket is not None:
            # the cluster map travels with NOT_MY_VBUCKET (docs/protocol.md §3)
            body = json.dumps(self.server.cluster_config(self.bucket)).encode()
            self.send(Response(opcode=frame.opcode, opaque=frame.opaque, status=exc.code,
                               value=body, datatype=1))  # fmt: skip
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
            self.check_traffic()
            self.kv(msg)
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

    async def set_vbucket(self, msg: SetVbucket) -> None:
        """SET_VBUCKET (formats/cluster.md): bucket CAS and map revision checked, the state
        persisted before the answer, whose header carries the new bucket CAS."""
        bucket = self.need_admin_bucket()
        states = {code: name for name, code in STATE_CODES.items()}
        if msg.state not in states:
            raise InvalidArguments(f"partition state {msg.state} is not 1..4")
        try:
            args = json.loads(msg.value) if msg.value else {}
            rev = int(args.get("rev", 0))
            failover = bool(args.get("failover", False))
        except (ValueError, TypeError, AttributeError):
            raise InvalidArguments('SET_VBUCKET value: {"rev": N, "failover": bool}') from None
        cas = await bucket.set_partition_state(msg.vbucket, states[msg.state], cas=msg.cas,
                                               rev=rev, failover=failover)  # fmt: skip
        self.send(Response(opcode=Opcode.SET_VBUCKET, opaque=msg.opaque, cas=cas))

    def set_param(self, msg: SetParam) -> None:
        """SET_PARAM (formats/cluster.md §6): replication_pause / replication_resume with
        a JSON value {"partitions": [..] | null, "after": seq | null}; the answer lists
        the partitions affected."""
        self.need_admin_bucket()
        rep = self.server.replicator
        if msg.name not in ("replication_pause", "replication_resume") or rep is None:
            raise InvalidArguments(f"unknown parameter {msg.name!r}")
        try:
            args = json.loads(msg.value) if msg.value else {}
            vbs = args.get("partitions")
            vbs = None if vbs is None else [int(v) for v in vbs]
            after = args.get("after")
            after = None if after is None else int(after)
        except (ValueError, TypeError, AttributeError):
            raise InvalidArguments('value: {"partitions": [..], "after": N}') from None
        done = rep.pause(vbs, after) if msg.name == "replication_pause" else rep.resume(vbs)
        self.send(Response(opcode=Opcode.SET_PARAM, opaque=msg.opaque,
                           value=json.dumps(done).encode(), datatype=1))  # fmt: skip

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

    def cluster_config(self) -> dict[str, Any]:
        """The selected bucket's config; without one, once authenticated, the global
        config (GCCCP): without it the SDK takes the plain port for the TLS one and
        cannot open a bucket over TLS (docs/protocol.md §13.2)."""
        if self.bucket is not None or not self.authenticated:
            return self.server.cluster_config(self.need_bucket())
        bucket = next(iter(self.server.buckets.values()))
        full = self.server.cluster_config(bucket)
        return {k: full[k] for k in GLOBAL_CONFIG_KEYS if k in full}

    def need_bucket(self) -> Bucket:
        """The selected bucket, or NO_BUCKET."""
        if self.bucket is None:
            raise NoBucket("no bucket selected")
        return self.bucket

    async def dispatch(self, msg: Message) -> None:
        """Route a request by type."""
        op = type(msg)
        if op is Hello:
            assert isinstance(msg, Hello)
            granted = tuple(dict.fromkeys(f for f in msg.features if f in GRANTABLE))
            self.features = set(granted)
            self.send(HelloResponse(opaque=msg.opaque, features=granted))
        elif op is SaslListMechs:
            self.send(SaslListMechsResponse(opaque=msg.opaque, mechanisms=self.server.mechanisms))
        elif op in (SaslAuth, SaslStep):
            self.sasl(msg)  # type: ignore[arg-type]
        elif op is GetErrorMap:
            errors = {
                f"{code:x}": {
                    "name": cls.__name__,
                    "desc": (cls.__doc__ or "").strip(),
                    "attrs": ["temp"] if cls.retriable else ["item-only"],
                }
                for code, cls in registered_statuses().items()
            }
            body = json.dumps({"version": 2, "revision": 1, "errors": errors}).encode()
            self.send(
                Response(opcode=Opcode.GET_ERROR_MAP, opaque=msg.opaque, value=body, datatype=1)
            )
        elif op is SelectBucket:
            assert isinstance(msg, SelectBucket)
            if not self.authenticated:
                raise AccessDenied("authenticate before selecting a bucket")
            bucket = self.server.buckets.get(msg.bucket)
            if bucket is None:
                raise AccessDenied(f"no bucket {msg.bucket!r}")
            self.bucket = bucket
            self.send(Response(opcode=Opcode.SELECT_BUCKET, opaque=msg.opaque))
        elif op is GetClusterConfig:
            body = json.dumps(self.cluster_config()).encode()
            self.send(
                Response(
                    opcode=Opcode.GET_CLUSTER_CONFIG, opaque=msg.opaque, value=body, datatype=1
                )
            )
        elif op is Stat:
            assert isinstance(msg, Stat)
            self.stats(msg)
        elif op is SetVbucket:
            assert isinstance(msg, SetVbucket)
            await self.set_vbucket(msg)
        elif op is SetParam:
            assert isinstance(msg, SetParam)
            self.set_param(msg)
        elif op is EnableTraffic or op is DisableTraffic:
            self.need_admin_bucket().traffic = op is EnableTraffic
            code = Opcode.ENABLE_TRAFFIC if op is EnableTraffic else Opcode.DISABLE_TRAFFIC
            self.send(Response(opcode=code, opaque=msg.opaque))
        elif op is SetClusterConfig:
            assert isinstance(msg, SetClusterConfig)
            bucket = self.need_admin_bucket()
            try:
                config = json.loads(msg.value)
            except ValueError:
                raise InvalidArguments("the cluster map is not JSON") from None
            if not isinstance(config, dict):
                raise InvalidArguments("the cluster map is not a JSON object")
            cas = bucket.set_cluster_map(msg.cas, config)
            self.server.rev = max(self.server.rev, bucket.map_rev)
            self.send(Response(opcode=Opcode.SET_CLUSTER_CONFIG, opaque=msg.opaque, cas=cas))
        elif op in (
            Get,
            Set,
            Add,
            Replace,
            Delete,
            SetWithMeta,
            DelWithMeta,
            ObserveSeqno,
            GetAllVbSeqnos,
        ):
            if op is not GetAllVbSeqnos:
                self.check_traffic()
            self.kv(msg)
        elif op in COLLECTIONS_COMMANDS:
            await self.collections_request(msg)
        elif isinstance(msg, UnknownRequest) and msg.opcode in RAW_KV:
            self.check_traffic()
            self.kv_raw(msg)
        elif op in (
            DcpOpen,
            Control,
            StreamRequest,
            CloseStream,
            GetFailoverLog,
            BufferAck,
            AddStream,
            Noop,
            Barrier,
        ):
            await self.dcp_request(msg)
        else:
            raise UnknownCommand(f"opcode 0x{getattr(msg, 'opcode', 0):02x} is not supported")

    def sasl(self, msg: SaslAuth | SaslStep) -> None:
        """SASL PLAIN and SCRAM-SHA512 (docs/protocol.md §5.2); refused after DCP_OPEN (§2.1).
        With --no-auth, PLAIN takes any user and password (SCRAM only the node's users)."""
        if self.dcp is not None:
            raise InvalidArguments("SASL is not accepted after DCP_OPEN")
        if self.cert_user is not None:  # as kv_engine: no change of identity
            raise NotSupported(
                f"this connection is logged in as {self.cert_user!r} by its client "
                "certificate; SASL cannot change that"
            )
        creds = self.server.credentials
        try:
            if isinstance(msg, SaslAuth) and msg.mechanism == "PLAIN":
                user, password = parse_plain(msg.payload)
                stored = creds.get(user)
                if not self.server.config.no_auth and (
                    stored is None
                    or make_credential(
                        "SCRAM-SHA512", password, salt=stored.salt, iterations=stored.iterations
                    )
                    != stored
                ):
                    raise AuthenticationFailed("bad credentials")
                self._authenticated(user, msg, b"")
            elif isinstance(msg, SaslAuth) and msg.mechanism == "SCRAM-SHA512":
                self.scram = ScramServer("SCRAM-SHA512", creds.get)
                challenge = self.scram.first(msg.payload)
                self.send(
                    Response(
                        opcode=Opcode.SASL_AUTH,
                        opaque=msg.opaque,
                        status=Status.AUTH_CONTINUE,
                        value=challenge,
                    )
                )
            elif isinstance(msg, SaslStep) and self.scram is not None:
                final = self.scram.final(msg.payload)
                self._authenticated(self.scram.username or "", msg, final)
                self.scram = None
            else:
                raise AuthenticationFailed(f"unsupported mechanism {msg.mechanism!r}")
        except AuthenticationFailed:
            self.scram = None
            if self.server.config.no_auth and msg.mechanism != "PLAIN":
                # the official SDK uses SCRAM on a plain connection unless told
                # otherwise: say once what works instead
                if not self.server.warned_no_auth_scram:
                    self.server.warned_no_auth_scram = True
                    log.warning(
                        "a client failed SCRAM on this --no-auth node: it takes any user and "
                        "password with SASL PLAIN (the Couchbase SDKs: "
                        "allowed_sasl_mechanisms=PLAIN), SCRAM only for --user"
                    )
                raise AuthError(
                    "authentication failed: a --no-auth node takes any user and password "
                    "with PLAIN, SCRAM only for its own users"
                ) from None
            raise AuthError("authentication failed") from None

    def _authenticated(self, user: str, msg: SaslAuth | SaslStep, payload: bytes) -> None:
        self.authenticated, self.user = True, user
        self.decoder.max_body = self.server.config.max_body
        opcode = Opcode.SASL_AUTH if isinstance(msg, SaslAuth) else Opcode.SASL_STEP
        self.send(Response(opcode=opcode, opaque=msg.opaque, value=payload))

    def stats(self, msg: Stat) -> None:
        """STAT groups `""`, `vbucket [vb]`, `vbucket-seqno [vb]` and `failovers [vb]`.

        As docs/protocol.md §5.7 lists them.
        """
        bucket = self.need_bucket()
        group, _, arg = msg.group.partition(" ")
        parts = sorted(bucket.partitions.items())
        if arg:
            if not arg.isdigit() or int(arg) not in bucket.partitions:
                raise InvalidArguments(f"no partition {arg!r}")
            parts = [(int(arg), bucket.partitions[int(arg)])]
        pairs: list[tuple[str, str]] = []
        if group == "":
            pairs = [
                ("pid", str(os.getpid())),
                ("curr_connections", str(len(self.server.sessions))),
                ("ep_num_vbuckets", str(len(bucket.partitions))),
                ("bucket", bucket.name),
                ("ep_traffic_enabled", "true" if bucket.traffic else "false"),
            ]
        elif group == "vbucket":  # each partition's state, as Couchbase Server names it
            pairs = [(f"vb_{vb}", p.state) for vb, p in parts]
        elif group == "vbucket-seqno":
            for vb, p in parts:
                pairs += [
                    (f"vb_{vb}:high_seqno", str(p.high_seq)),
                    (f"vb_{vb}:abs_high_seqno", str(p.high_seq)),
                    (f"vb_{vb}:last_persisted_seqno", str(p.persisted_seq)),
                    (f"vb_{vb}:uuid", str(p.uuid)),
                    (f"vb_{vb}:purge_seqno", str(p.purge_seq)),
                    (f"vb_{vb}:last_persisted_snap_start", str(p.snap_start)),
                    (f"vb_{vb}:last_persisted_snap_end", str(p.snap_end)),
                ]
        elif group == "replication":  # formats/cluster.md §5: links, pauses, errors
            rep = self.server.replicator
            status = rep.status() if rep is not None else {}
            pairs = [(k, json.dumps(v)) for k, v in status.items()]
            pairs += [(f"vb_{vb}:complete_seqno", str(p.complete_seq)) for vb, p in parts]
        elif group == "failovers":
            for vb, p in parts:
                pairs.append((f"vb_{vb}:num_entries", str(len(p.failover))))
                for i, e in enumerate(p.failover.entries):
                    pairs += [(f"vb_{vb}:{i}:id", str(e.uuid)), (f"vb_{vb}:{i}:seq", str(e.seq))]
        else:
            raise KeyNotFound(f"unknown stat group {group!r}")
        out = [StatResponse(opaque=msg.opaque, name=k, value=v).encode() for k, v in pairs]
        out.append(StatResponse(opaque=msg.opaque).encode())
        self.send(b"".join(out))

    def kv(self, msg: Message) -> None:
        """GET/SET/ADD/REPLACE/DELETE/*_WITH_META, OBSERVE_SEQNO, GET_ALL_VB_SEQNOS."""
        bucket = self.need_bucket()
        if isinstance(msg, GetAllVbSeqnos):
            want = {1: "active", 2: "replica", 3: "pending", 4: "dead"}.get(msg.state or 0)
            seqnos = tuple(
                (vb, p.high_seq)
                for vb, p in sorted(bucket.partitions.items())
                if (p.state == want if want else p.state != "dead")
            )
            self.send(GetAllVbSeqnosResponse(opaque=msg.opaque, seqnos=seqnos))
            return
        vb = getattr(msg, "vbucket", 0)
        if isinstance(msg, Get):
            doc = bucket.get(vb, self.qualified(msg.key))
            self.send(
                GetResponse(
                    opaque=msg.opaque,
                    cas=doc.cas,
                    flags=doc.flags,
                    value=doc.value,
                    datatype=doc.datatype,
                )
            )
            return
        if isinstance(msg, ObserveSeqno):
            # a replica answers too, so a client can wait for replica persistence (the UPR
            # design specification, "How front end clients ensure mutations are replicated
            # or persisted on a replica"; formats/cluster.md §5)
            part = bucket.partition(vb, active=False)
            if part.state == DEAD:
                raise NotMyVbucket(f"partition {vb} is dead here")
            idx = part.failover.find(msg.vbucket_uuid)
            if idx is None:
                raise KeyNotFound(f"uuid {msg.vbucket_uuid:x} is not in partition {vb}'s history")
            hard = idx > 0  # a hard failover happened since: format 1
            # formats/cluster.md §5 "What OBSERVE_SEQNO tells a client": a replica (or
            # pending) copy reports as persisted the end of its last complete snapshot
            # persisted. Mid-snapshot, the seqs it persisted are not a state the active
            # had: a version deduplicated away (a key written again later in the same
            # snapshot) is on neither copy, and the copy's promotion would not hold it.
            # The current seqno stays the high seqno, as kv_engine reports it.
            persisted = part.persisted_seq if part.state == ACTIVE else part.complete_seq
            self.send(
                ObserveSeqnoResponse(
                    opaque=msg.opaque,
                    format=1 if hard else 0,
                    observed_vbucket=vb,
                    vbucket_uuid=part.uuid,
                    persisted_seqno=persisted,
                    current_seqno=part.high_seq,
                    old_vbucket_uuid=msg.vbucket_uuid if hard else None,
                    last_received_seqno=part.failover.entries[idx - 1].seq if hard else None,
                )
            )
            return
        if isinstance(msg, Set | SetWithMeta):
            self.check_datatype(msg.datatype, with_meta=isinstance(msg, SetWithMeta))
        if isinstance(msg, SetWithMeta):  # DelWithMeta is a subclass
            doc = bucket.store_with_meta(
                vb,
                self.qualified(msg.key),
                msg.value,
                deleted=isinstance(msg, DelWithMeta),
                flags=msg.flags,
                expiry=msg.expiration,
                rev_seq=msg.rev_seqno,
                item_cas=msg.item_cas,
                datatype=msg.datatype,
                options=msg.options or 0,
                cas=msg.cas,
            )
        elif isinstance(msg, Set):  # Add and Replace are subclasses
            op = "add" if isinstance(msg, Add) else "replace" if isinstance(msg, Replace) else "set"
            doc = bucket.store(
                op,
                vb,
                self.qualified(msg.key),
                msg.value,
                flags=msg.flags,
                expiry=msg.expiration,
                datatype=msg.datatype,
                cas=msg.cas,
            )
        elif isinstance(msg, Delete):
            doc = bucket.delete(vb, self.qualified(msg.key), cas=msg.cas)
        else:
            raise UnknownCommand("unsupported KV request")
        # StoreResponse's bytes, packed in one call (the restore path's answer)
        opcode = int(msg.SCHEMA.opcodes[0])
        if Feature.MUTATION_SEQNO in self.features:
            uuid = bucket.partitions[vb].uuid
            self.send(encode_store_response(opcode, msg.opaque, doc.cas, uuid, doc.seq))
        else:
            self.send(encode_store_response(opcode, msg.opaque, doc.cas))

    def kv_raw(self, msg: UnknownRequest) -> None:
        """TOUCH and GAT (extras u32 expiry), GET_META (extras: none, or u8 version 1 or
        2) and the sub-document commands, as the official SDK sends them
        (formats/collections.md §5, formats/subdoc.md)."""
        if msg.opcode in SUBDOC:
            self.subdoc(msg)
            return
        bucket = self.need_bucket()
        key = self.qualified(msg.key)
        if msg.opcode == GET_META:
            if len(msg.extras) > 1 or (msg.extras and msg.extras[0] not in (1, 2)):
                raise InvalidArguments("GET_META extras: none, or a u8 version 1 or 2")
            doc = bucket.get_meta(msg.vbucket, key)
            # the XATTR bit to a connection that negotiated it (formats/wire.md "Xattrs")
            shown = doc.datatype if Feature.XATTR in self.features else doc.datatype & ~xattrs.XATTR
            extras = _META_V2.pack(int(doc.deleted), doc.flags, doc.expiry, doc.rev_seq,
                                   shown)  # fmt: skip
            if msg.extras != b"\x02":
                extras = extras[:-1]  # the datatype only for version 2
            self.send(Response(opcode=msg.opcode, opaque=msg.opaque, cas=doc.cas, extras=extras))
            return
        if len(msg.extras) != 4 or msg.value:
            raise InvalidArguments("TOUCH/GAT: extras are a u32 expiry, and no value")
        (expiry,) = _U32.unpack(msg.extras)
        doc = bucket.touch(msg.vbucket, key, expiry)
        if msg.opcode == TOUCH:
            self.send(Response(opcode=TOUCH, opaque=msg.opaque, cas=doc.cas))
        else:  # GAT answers as GET does
            self.send(Response(opcode=GAT, opaque=msg.opaque, cas=doc.cas,
                               extras=_U32.pack(doc.flags), value=doc.value,
                               datatype=doc.datatype))  # fmt: skip

    def subdoc(self, msg: UnknownRequest) -> None:
        """SUBDOC_MULTI_LOOKUP and SUBDOC_MULTI_MUTATION (formats/subdoc.md): validated
        as kv_engine validates them, then run against the bucket; a spec's failure is in
        the body, a request's in the header status."""
        bucket = self.need_bucket()
        mutation = msg.opcode == SUBDOC_MULTI_MUTATION
        if msg.datatype or not msg.key:
            raise InvalidArguments("a sub-document request has a key and datatype RAW")
        preserve = [data for fid, data in msg.frame_infos if fid == FrameId.PRESERVE_TTL]
        if preserve and (preserve[0] or not mutation):
            raise InvalidArguments("PreserveTTL takes no value, on a mutation only")
        xattr = Feature.XATTR in self.features
        req = subdoc.parse_request(mutation=mutation, extras=msg.extras, value=msg.value,
                                   cas=msg.cas, xattrs_enabled=xattr)  # fmt: skip
        key, vb = self.qualified(msg.key), msg.vbucket
        if not mutation:
            status, cas, body = subdoc_kv.lookup_in(bucket, vb, key, req, msg.cas)
            self.send(Response(opcode=msg.opcode, opaque=msg.opaque, status=status, cas=cas,
                               value=body))  # fmt: skip
            return
        try:
            status, doc, body = subdoc_kv.mutate_in(bucket, vb, key, req, cas=msg.cas,
                                                    preserve_ttl=bool(preserve))  # fmt: skip
        except subdoc.SpecFailed as failed:
            self.send(Response(opcode=msg.opcode, opaque=msg.opaque,
                               status=subdoc.Code.MULTI_PATH_FAILURE,
                               value=subdoc.failure_body(failed)))  # fmt: skip
            return
        extras = b""
        if Feature.MUTATION_SEQNO in self.features:
            extras = _MUTATION_TOKEN.pack(bucket.partitions[vb].uuid, doc.seq)
        self.send(Response(opcode=msg.opcode, opaque=msg.opaque, status=status, cas=doc.cas,
                           extras=extras, value=body))  # fmt: skip

    async def collections_request(self, msg: Message) -> None:
        """COLLECTIONS_SET_MANIFEST (authenticated), _GET_MANIFEST, _GET_ID and
        _GET_SCOPE_ID (kv_engine's docs/Collections.md; formats/collections.md §4)."""
        bucket = self.need_bucket()
        if isinstance(msg, CollectionsSetManifest):
            self.need_admin_bucket()
            try:
                manifest = Manifest.from_json(msg.value)
            except CollectionsError as exc:
                raise InvalidArguments(str(exc)) from None
            await bucket.set_manifest(manifest)
            self.send(Response(opcode=Opcode.COLLECTIONS_SET_MANIFEST, opaque=msg.opaque))
        elif isinstance(msg, CollectionsGetManifest):
            self.send(Response(opcode=Opcode.COLLECTIONS_GET_MANIFEST, opaque=msg.opaque,
                               value=bucket.manifest.dumps(), datatype=1))  # fmt: skip
        elif isinstance(msg, CollectionsGetId | CollectionsGetScopeId):
            # the documented form has the path in the value; the SDK sends it as the key
            raw = msg.value or msg.key
            try:
                path = bytes(raw).decode()
                if isinstance(msg, CollectionsGetId):
                    uid, ident = bucket.collections.collection_id(path)
                else:
                    uid, ident = bucket.collections.scope_id(path)
            except (UnicodeDecodeError, CollectionsError) as exc:
                raise InvalidArguments(f"collection path: {exc}") from None
            self.send(CollectionsIdResponse(opcode=msg.SCHEMA.opcodes[0], opaque=msg.opaque,
                                            manifest_uid=uid, id=ident))  # fmt: skip

    async def dcp_request(self, msg: Message) -> None:
        """DCP_OPEN, CONTROL, STREAM_REQ, CLOSE_STREAM, GET_FAILOVER_LOG, BUFFER_ACK."""
        if isinstance(msg, GetFailoverLog) and msg.opcode == Opcode.GET_FAILOVER_LOG:
            part = self.need_bucket().partition(msg.vbucket, active=False)
            self.send(
                FailoverLogResponse(
                    opaque=msg.opaque, opcode=msg.opcode, failover_log=part.failover.pairs()
                )
            )
            return
        if isinstance(msg, DcpOpen):
            if not self.authenticated:
                raise AccessDenied("authenticate before DCP_OPEN")
            bucket = self.need_bucket()
            if self.dcp is not None:
                raise InvalidArguments("DCP_OPEN was already sent on this connection")
            problem = open_flags_problem(msg.flags)
            if problem:
                raise InvalidArguments(problem)
            if not msg.flags & OPEN_PRODUCER:
                raise NotSupported("upr serve accepts producer (client) DCP connections only")
            if msg.value:
                raise InvalidArguments("a producer DCP_OPEN takes no value")
            self.dcp = DcpProducer(
                bucket,
                msg.name,
                msg.flags,
                self.sender,
                self.server.backfill_pool,
                self.server.backfill_slots,
                self.fatal,
                self.server.config.idle_timeout,
                collections=self.collections,
                snappy=Feature.SNAPPY in self.features,
                batch_bytes=self.server.backfill_batch_bytes,
            )
            self.send(Response(opcode=Opcode.DCP_OPEN, opaque=msg.opaque))
            return
        dcp = self.dcp
        if isinstance(msg, Barrier):
            if dcp is None or not dcp.barriers_enabled:
                raise UnknownCommand("barrier cookies need the upr_barrier_cookies control")
            dcp.register_barrier(msg.cookie, msg.opaque)
            self.send(Response(opcode=Opcode.UPR_BARRIER, opaque=msg.opaque))
            self.flush_out()
            await dcp.check_barriers()
            return
        if dcp is None:
            raise InvalidArguments("send DCP_OPEN first")
        if isinstance(msg, BufferAck):
            dcp.sender.ack(msg.acked)  # no response on success (docs/protocol.md §2.13)
        elif isinstance(msg, Control):
            dcp.control(msg.name, msg.value)
            self.send(Response(opcode=Opcode.DCP_CONTROL, opaque=msg.opaque))
        elif isinstance(msg, StreamRequest):
            self.check_traffic()
            spec, log_pairs = dcp.stream_request(msg)
            self.send(StreamRequestOk(opaque=msg.opaque, failover_log=log_pairs))
            dcp.start_stream(spec)
        elif isinstance(msg, CloseStream):
            if not dcp.has_stream(msg.vbucket):
                raise KeyNotFound(f"no stream for partition {msg.vbucket}")
            self.send(Response(opcode=Opcode.DCP_CLOSE_STREAM, opaque=msg.opaque))
            self.flush_out()
            await dcp.close_stream(msg.vbucket)
        elif isinstance(msg, GetFailoverLog):
            part = dcp.bucket.partition(msg.vbucket, active=False)
            self.send(FailoverLogResponse(opaque=msg.opaque, failover_log=part.failover.pairs()))
        elif isinstance(msg, Noop):
            self.send(Response(opcode=Opcode.DCP_NOOP, opaque=msg.opaque))
        else:
            raise NotSupported("ADD_STREAM is for consumer connections, which upr serve lacks")


__all__ = ["STATE_CODES", "NodeConfig", "NodeServer", "ServeError", "is_loopback"]
