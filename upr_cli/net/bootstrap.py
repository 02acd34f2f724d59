"""Connection bootstrap before DCP or KV: HELLO → SASL → SELECT_BUCKET → config.

Each step follows docs/protocol.md §5. On a plain connection SASL picks SCRAM-SHA512
when the server offers it, else PLAIN (couchbase-cli tools and servers that offer
nothing else, docs/protocol.md §5.2). Over TLS it picks PLAIN when offered, as the
Couchbase SDKs do: the channel already hides the password (docs/protocol.md §13.4).
The cluster config gives the partition count (`vBucketServerMap.vBucketMap`,
docs/protocol.md §5.5), which key hashing needs.

HELLO offers Collections (docs/protocol.md "Collections"): a server that grants it
expects every document key on the connection to start with the collection id, and
sends DCP keys that way, so the connection's decoder splits the id off data records
from then on. A server that does not grant it (older Couchbase, an older `upr serve`)
gives the default collection only; `Session.collections` says which it was.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from upr_cli.errors import UprError
from upr_cli.net.connection import Connection, ConnectionClosed, ConnectionError_, ServerItems
from upr_cli.net.probe import answers_tls
from upr_cli.net.retry import RetryPolicy
from upr_cli.net.scram import AuthenticationFailed, ScramClient, plain_message
from upr_cli.net.tls import ClientTls, client_certificate_alert, closed_after_handshake
from upr_cli.net.uri import PASSWORD_ENV, SourceUri
from upr_cli.protocol import leb128
from upr_cli.protocol.header import Feature
from upr_cli.protocol.messages import (
    GetClusterConfig,
    GetErrorMap,
    Hello,
    HelloResponse,
    SaslAuth,
    SaslListMechs,
    SaslListMechsResponse,
    SaslStep,
    SelectBucket,
)
from upr_cli.protocol.status import (
    AccessDenied,
    AuthContinue,
    AuthError,
    KeyNotFound,
    NotSupported,
    Status,
    StatusError,
)

AGENT = "upr/0.1"
# how a TLS server that refuses the client without an alert ends the connection
_DROPPED = (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)
_V = TypeVar("_V")
WANTED = (Feature.TCP_NODELAY, Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON,
          Feature.MUTATION_SEQNO, Feature.COLLECTIONS)  # fmt: skip


class BootstrapError(UprError):
    """Authentication, bucket selection or configuration failed."""


@dataclass(slots=True)
class Session:
    """A bootstrapped connection: what HELLO granted and the bucket's cluster config."""

    conn: Connection
    uri: SourceUri
    features: frozenset[int]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def num_partitions(self) -> int:
        """Number of partitions (vbuckets) of the bucket."""
        vbmap = self.config.get("vBucketServerMap", {}).get("vBucketMap", [])
        return len(vbmap) if isinstance(vbmap, list) else 0

    @property
    def collections(self) -> bool:
        """True if HELLO granted Collections: keys carry a LEB128 collection id."""
        return Feature.COLLECTIONS in self.features

    def qualify(self, key: bytes, collection: int = 0) -> bytes:
        """A document key as this connection sends it: prefixed with its collection id
        when Collections was granted; without it only the default collection exists."""
        if self.collections:
            return leb128.join_key(collection, key)
        if collection:
            raise BootstrapError(
                f"{self.uri.redacted()}: the server does not support collections "
                f"(collection id {collection:#x})"
            )
        return key


def partition_of(key: bytes, num_partitions: int) -> int:
    """Key → partition, as the SDKs map it (docs/protocol.md §5.5, CRC32)."""
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % num_partitions


async def connect(
    uri: SourceUri,
    *,
    timeout: float = 10.0,
    on_server: Any = None,
    on_close: Any = None,
    name: str = "",
    features: tuple[int, ...] = WANTED,
) -> Session:
    """Open a connection to `uri` and run the bootstrap sequence; errors are one-line
    UprErrors. With more bootstrap hosts (`uri.seeds`) each is tried in order while the
    ones before cannot be reached; an answer that refuses (credentials, bucket) is final.
    The session's URI names the host that answered first."""
    if not uri.seeds:
        return await _connect_one(uri, timeout, on_server, on_close, name, features)
    failures = []
    for host, port in uri.hosts:
        try:
            return await _connect_one(uri.rebase(host, port), timeout, on_server, on_close,
                                      name, features)  # fmt: skip
        except (ConnectionError_, OSError) as exc:
            failures.append(f"{host}:{port}: {exc}")
    raise ConnectionError_(f"no bootstrap host answers ({'; '.join(failures)})")


async def _connect_one(
    uri: SourceUri,
    timeout: float,
    on_server: Any,
    on_close: Any,
    name: str,
    features: tuple[int, ...],
) -> Session:
    settings = (uri.tls or ClientTls.from_env()) if uri.secure else None
    tls = settings.context() if settings is not None else None
    conn = await Connection.open(uri.host, uri.port, timeout=timeout, name=name or uri.redacted(),
                                 on_server=on_server, on_close=on_close, tls=tls,
                                 cafile=settings.cafile if settings else None)  # fmt: skip
    certificate = settings is not None and settings.certfile is not None
    try:
        hello = await _hello(conn, uri, features, timeout, certificate=certificate)
        granted = frozenset(hello.features) if isinstance(hello, HelloResponse) else frozenset()
        # Nothing else is in flight yet, so no data record can have been decoded the
        # old way: every later key is split (docs/protocol.md "Collections").
        conn.collections = Feature.COLLECTIONS in granted
        if uri.username:
            await _authenticate(conn, uri, timeout, certificate=certificate)
        if Feature.XERROR in granted:
            await conn.request(GetErrorMap(version=2, opaque=conn.next_opaque()), timeout=timeout)
        if uri.bucket:
            try:
                await conn.request(SelectBucket(bucket=uri.bucket, opaque=conn.next_opaque()),
                                   timeout=timeout)  # fmt: skip
            except AccessDenied as exc:
                raise _denied(uri, certificate,
                              f"cannot select bucket {uri.bucket!r}: {exc}") from None  # fmt: skip
            except StatusError as exc:
                raise BootstrapError(
                    f"{uri.redacted()}: cannot select bucket {uri.bucket!r}: {exc}"
                ) from None
        config: dict[str, Any] = {}
        try:
            resp = await conn.request(GetClusterConfig(opaque=conn.next_opaque()), timeout=timeout)
            raw = getattr(resp, "value", b"")
            config = json.loads(raw) if raw else {}
        except KeyNotFound:
            config = {}
        except AccessDenied as exc:
            raise _denied(uri, certificate, f"cannot read the cluster config: {exc}") from None
        except json.JSONDecodeError as exc:
            raise BootstrapError(
                f"{uri.redacted()}: cluster config is not JSON: {exc.msg}"
            ) from None
        return Session(conn, uri, granted, config)
    except BaseException:
        await conn.aclose()
        raise


def _denied(uri: SourceUri, certificate: bool, what: str) -> BootstrapError:
    """EACCESS after the login: a URI without a user (and no client certificate) was not
    logged in at all, which a node with users requires (docs/protocol.md §5.3)."""
    if uri.username or certificate:
        return BootstrapError(f"{uri.redacted()}: {what}")
    where = f"{uri.scheme}://USER@{uri.redacted().partition('://')[2]}"
    return BootstrapError(
        f"{uri.redacted()}: the node requires a user: put it in the URI ({where}) and set "
        f"{PASSWORD_ENV}"
    )


async def _hello(
    conn: Connection,
    uri: SourceUri,
    features: tuple[int, ...],
    timeout: float,
    *,
    certificate: bool = False,
) -> Any:
    """HELLO; a TLS port closes a plain client's connection at its first bytes, so that
    close gets a hint (docs/protocol.md §13.3). Over TLS 1.3 a server checks the client
    certificate after the client's handshake is over: its refusal (an alert, or a close
    without one) comes here, and says what to do about the certificate
    (docs/protocol.md §13.5)."""
    try:
        return await conn.request(Hello(agent=AGENT, features=features, opaque=conn.next_opaque()),
                                  timeout=timeout)  # fmt: skip
    except ConnectionClosed as exc:
        if uri.secure:
            where, cause = f"{uri.host}:{uri.port}", exc.__cause__
            alert = client_certificate_alert(cause, where)
            if alert is not None:
                raise alert from None
            if cause is None or isinstance(cause, _DROPPED):
                raise closed_after_handshake(where, sent_certificate=certificate) from None
            raise
        # still retriable: a node that restarts closes the same way; the TLS-port hint
        # only when the port speaks TLS (net/probe.py)
        hint = ""
        if await answers_tls(uri.host, uri.port):
            hint = " (a TLS port? it takes uprs:// or couchbases://)"
        raise ConnectionClosed(
            f"{uri.host}:{uri.port}: the peer closed the connection during HELLO{hint}"
        ) from None


async def _authenticate(
    conn: Connection, uri: SourceUri, timeout: float, *, certificate: bool = False
) -> None:
    assert uri.username is not None
    password = uri.password or ""
    resp = await conn.request(SaslListMechs(opaque=conn.next_opaque()), timeout=timeout)
    offered = resp.names if isinstance(resp, SaslListMechsResponse) else ()
    try:
        if uri.secure and "PLAIN" in offered:
            await conn.request(
                SaslAuth(mechanism="PLAIN", payload=plain_message(uri.username, password),
                         opaque=conn.next_opaque()), timeout=timeout,
            )  # fmt: skip
        elif "SCRAM-SHA512" in offered:
            scram = ScramClient("SCRAM-SHA512", uri.username, password)
            first = await conn.request(
                SaslAuth(mechanism="SCRAM-SHA512", payload=scram.first_message(),
                         opaque=conn.next_opaque()), timeout=timeout, check=False,
            )  # fmt: skip
            if first.status != Status.AUTH_CONTINUE:
                raise AuthError()
            final = scram.final_message(getattr(first, "value", b""))
            done = await conn.request(
                SaslStep(mechanism="SCRAM-SHA512", payload=final, opaque=conn.next_opaque()),
                timeout=timeout, check=False,
            )  # fmt: skip
            if done.status != Status.SUCCESS:
                raise AuthError()
            scram.verify(getattr(done, "value", b""))
        elif "PLAIN" in offered:
            await conn.request(
                SaslAuth(mechanism="PLAIN", payload=plain_message(uri.username, password),
                         opaque=conn.next_opaque()), timeout=timeout,
            )  # fmt: skip
        else:
            raise BootstrapError(
                f"{uri.redacted()}: no supported SASL mechanism offered ({' '.join(offered)})"
            )
    except (AuthError, AuthContinue, AuthenticationFailed):
        if uri.password is None:  # neither in the URI nor in the environment: tried ""
            raise BootstrapError(
                f"{uri.redacted()}: no password for {uri.username}: set {PASSWORD_ENV} or put "
                "it in the URI"
            ) from None
        raise BootstrapError(
            f"{uri.redacted()}: authentication failed for user {uri.username!r}"
        ) from None
    except NotSupported:
        if not certificate:
            raise
        # a connection its client certificate logged in refuses SASL (docs/protocol.md §13.5)
        raise BootstrapError(
            f"{uri.redacted()}: the server logged this connection in by its client "
            "certificate and refuses SASL: leave the user name out of the URI"
        ) from None


__all__ = [
    "BootstrapError",
    "ServerItems",
    "Session",
    "connect",
    "map_nodes",
    "on_active_nodes",
    "partition_of",
]


def map_nodes(uri: SourceUri, config: dict[str, Any]) -> tuple[list[tuple[str, int]], list[int]]:
    """The cluster map's servers as (host, port) (`$HOST` is `uri`'s host) and, per
    partition, the index of its active server (-1: none). The one parser of the map.
    For a TLS URI the ports are the servers' TLS data ports (`kvSSL` in `nodesExt`), so
    that a TLS client stays on TLS (docs/protocol.md §13.2)."""
    smap = config.get("vBucketServerMap", {}) if isinstance(config, dict) else {}
    smap = smap if isinstance(smap, dict) else {}
    servers: list[tuple[str, int]] = []
    entries = smap.get("serverList", [])
    for entry in entries if isinstance(entries, list) else []:
        host, _, port = str(entry).rpartition(":")
        if port.isdigit():
            servers.append((uri.host if host in ("$HOST", "") else host, int(port)))
    if uri.secure and servers:
        servers = _tls_ports(uri, config, servers)
    rows = smap.get("vBucketMap", [])
    actives = [
        row[0] if isinstance(row, list) and row and isinstance(row[0], int) else -1
        for row in (rows if isinstance(rows, list) else [])
    ]
    return servers, actives


def _tls_ports(
    uri: SourceUri, config: dict[str, Any], servers: list[tuple[str, int]]
) -> list[tuple[str, int]]:
    """Each server's TLS data port from `nodesExt` (matched by host and plain data port;
    a node without a hostname there is the one we asked)."""
    tls: dict[tuple[str, int], int] = {}
    nodes = config.get("nodesExt", [])
    for node in nodes if isinstance(nodes, list) else []:
        services = node.get("services", {}) if isinstance(node, dict) else {}
        kv, kv_ssl = services.get("kv"), services.get("kvSSL")
        if isinstance(kv, int) and isinstance(kv_ssl, int):
            host = node.get("hostname") or "$HOST"
            tls[(uri.host if host == "$HOST" else str(host), kv)] = kv_ssl
    out = []
    for host, port in servers:
        if (host, port) not in tls:
            raise BootstrapError(
                f"{uri.redacted()}: the cluster map gives node {host}:{port} no TLS data "
                "port (kvSSL in nodesExt)"
            )
        out.append((host, tls[host, port]))
    return out


def node_uris(session: Session) -> list[SourceUri]:
    """One URI per server of the cluster map, with the session's bucket and credentials;
    the session's own when the map has none."""

    servers, _ = map_nodes(session.uri, session.config)
    return [session.uri.at(h, p) for h, p in servers] or [session.uri]


def active_index(session: Session) -> list[int]:
    """For each partition, the index (into `node_uris`) of its active node; -1 if none."""
    return map_nodes(session.uri, session.config)[1]


async def on_active_nodes(
    uri: SourceUri,
    partitions: list[int] | None,
    ask: Callable[[Connection, list[int]], Awaitable[dict[int, _V]]],
    *,
    name: str = "upr",
    wait_for: float = 60.0,
) -> tuple[dict[int, _V], int]:
    """Ask each partition's active node (as the map says: a replica or dead copy has its
    own log and seqs, not the history clients stream) with one connection per node;
    returns the merged answers and the partition count. A node that cannot be reached
    is retried under a re-read map for up to `wait_for` seconds (a failover may be
    moving its partitions), then its error is raised."""
    s = await connect(uri, name=name)
    try:
        pending = partitions if partitions is not None else list(range(s.num_partitions))
        out: dict[int, _V] = {}
        retry = RetryPolicy(within=wait_for, first=0.1, cap=0.5).start()
        while True:
            by_node, failed, error = _by_active_node(s, pending, uri)
            for k, parts in sorted(by_node.items()):
                try:
                    out |= await _ask_node(s, k, parts, ask, name)
                except _NodeAway as away:
                    failed += parts
                    error = away.error
            if not failed:
                return out, s.num_partitions
            if retry.spent:
                assert error is not None
                raise error
            pending = failed
            await retry.wait()
            resp = await s.conn.request(GetClusterConfig(opaque=s.conn.next_opaque()))
            with contextlib.suppress(ValueError):
                s.config = json.loads(getattr(resp, "value", b"") or b"{}")
    finally:
        await s.conn.aclose()


def _by_active_node(
    s: Session, partitions: list[int], uri: SourceUri
) -> tuple[dict[int, list[int]], list[int], Exception | None]:
    """The partitions grouped by the index of their active node in the session's map;
    those the map gives no active node (a failover without a replica), with the error."""
    uris, owner = node_uris(s), active_index(s)
    by_node: dict[int, list[int]] = {}
    failed: list[int] = []
    error: Exception | None = None
    for p in partitions:
        if not owner:  # no map: the bootstrap node serves everything
            k = 0
        elif 0 <= p < len(owner) and 0 <= owner[p] < len(uris):
            k = owner[p]
        else:
            failed.append(p)
            error = BootstrapError(f"{uri.redacted()}: partition {p} has no active node")
            continue
        by_node.setdefault(k, []).append(p)
    return by_node, failed, error


class _NodeAway(Exception):
    """A node other than the bootstrap one could not be reached or went away: ask again
    under a newer map."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


async def _ask_node(
    s: Session,
    k: int,
    parts: list[int],
    ask: Callable[[Connection, list[int]], Awaitable[dict[int, _V]]],
    name: str,
) -> dict[int, _V]:
    """`ask` node `k` of the map about `parts`, over the session's connection when it is
    that node (its loss is final); `_NodeAway` when another node cannot be asked."""
    target = node_uris(s)[k]
    if (target.host, target.port) == (s.uri.host, s.uri.port):
        return await ask(s.conn, parts)
    try:
        other = await connect(target, name=name, timeout=3.0)
    except (UprError, OSError) as exc:
        raise _NodeAway(exc) from exc
    try:
        return await ask(other.conn, parts)
    except ConnectionError_ as exc:
        raise _NodeAway(exc) from exc  # it went away meanwhile
    finally:
        await other.conn.aclose()
