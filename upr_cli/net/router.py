"""KV requests routed by the cluster map, retried on NOT_MY_VBUCKET (formats/cluster.md §4).

The UPR design specification, "How front end clients ensure mutations are persisted to
disk on master": a node that is no longer the partition's active answers "not my
partition", and the client reloads the cluster map and retries. The router keeps one
connection per node holding an active partition, sends each request to its partition's
active node, and when an answer is NOT_MY_VBUCKET (whose value is the answering node's
map), ETMPFAIL (a restarted node whose orchestrator has not turned its traffic on yet)
or the node's connection is lost, it takes the newest map it can find (that answer's,
else one fetched from every node it knows) and sends the request again, until
`retry_for` seconds have passed. Requests stay pipelined: `submit` sends at once and
returns the node's answer future; `settle` turns it into the final answer, retrying only
when the answer asks for it.

Every connection offers Collections (net/bootstrap.py). Where the nodes grant it, a
request's key is the collection id and the document key (`qualify`), and the partition
is still the hash of the document key alone (docs/protocol.md "Collections"); every node
must agree, or a key would reach one of them in the wrong form.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from upr_cli.errors import UprError
from upr_cli.net.bootstrap import WANTED, Session, connect, map_nodes, partition_of
from upr_cli.net.connection import Connection, aclose_all
from upr_cli.net.retry import RetryPolicy
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Frame, leb128
from upr_cli.protocol.header import Feature
from upr_cli.protocol.messages import GetClusterConfig
from upr_cli.protocol.status import Status

Make = Callable[[int], bytes]  # opaque → an encoded request
# Answers that send a request again with the newest map: NOT_MY_VBUCKET, and ETMPFAIL
# from a cluster node whose traffic is still off after a restart (formats/cluster.md §3).
_FOLLOW = frozenset({Status.NOT_MY_VBUCKET, Status.ETMPFAIL})


def _map_body(frame: Frame) -> bytes | None:
    """A NOT_MY_VBUCKET answer's value is the answering node's map."""
    return bytes(frame.value) if frame.vbucket_or_status == Status.NOT_MY_VBUCKET else None


def _why(frame: Frame) -> str:
    if frame.vbucket_or_status == Status.NOT_MY_VBUCKET:
        return "not my vbucket"
    return "temporary failure (the node's traffic is off)"


# KV links also offer XATTR (formats/wire.md "Xattrs"): a write may then carry xattrs
# (SET_WITH_META with a blob, sub-document xattr paths); plain reads are unchanged.
FEATURES = (*WANTED, Feature.XATTR)


class RouterError(UprError):
    """No node could be reached for a partition."""


class NoNodeAnswers(RouterError):
    """Not one node of the map could be reached."""


class Router:
    """One connection per active node of a bucket, with map-following retries."""

    def __init__(self, session: Session, *, retry_for: float = 60.0, name: str = "upr") -> None:
        self.uri = session.uri
        self.name = name
        self.retry_for = retry_for
        self.features = session.features
        self.config: dict[str, Any] = session.config
        self.num_partitions = session.num_partitions
        self._conns: dict[tuple[str, int], Connection] = {
            (session.uri.host, session.uri.port): session.conn
        }
        self._servers, self._actives = self._layout(self.config)
        self._lock = asyncio.Lock()
        self._gen = 0  # refreshes done (waiters for the lock skip theirs if it moved)
        self.retries = 0

    def _layout(self, config: dict[str, Any]) -> tuple[list[tuple[str, int]], list[int]]:
        servers, actives = map_nodes(self.uri, config)
        return servers or [(self.uri.host, self.uri.port)], actives

    @classmethod
    async def open(cls, uri: SourceUri, *, name: str = "upr", retry_for: float = 60.0) -> Router:
        """Bootstrap from `uri` and connect to every node holding an active partition."""
        session = await connect(uri, name=name, features=FEATURES)
        router = cls(session, retry_for=retry_for, name=name)
        try:
            await router._connect_actives()
        except BaseException:
            await router.aclose()
            raise
        return router

    @property
    def xattrs(self) -> bool:
        """True if the nodes granted XATTR: writes may carry xattrs."""
        return Feature.XATTR in self.features

    @property
    def collections(self) -> bool:
        """True if the nodes granted Collections: keys are sent through `qualify`."""
        return Feature.COLLECTIONS in self.features

    def qualify(self, key: bytes, collection: int = 0) -> bytes:
        """The key as the nodes take it: with its LEB128 collection id when they
        negotiated Collections; without, only the default collection (0) exists."""
        if self.collections:
            return leb128.join_key(collection, key)
        if collection:
            raise RouterError(
                f"{self.uri.redacted()}: the cluster does not support collections "
                f"(collection id {collection:#x})"
            )
        return key

    @property
    def rev(self) -> int:
        """The revision of the map in use."""
        rev = self.config.get("rev", 0)
        return rev if isinstance(rev, int) else 0

    def partition(self, key: bytes) -> int:
        """The partition of a document key (never the collection-prefixed one)."""
        return partition_of(key, self.num_partitions)

    async def _connect_actives(self) -> None:
        for i in sorted({a for a in self._actives if a >= 0}):
            if i < len(self._servers):
                with contextlib.suppress(UprError, OSError):
                    await self._conn(self._servers[i])

    async def _conn(self, addr: tuple[str, int]) -> Connection:
        conn = self._conns.get(addr)
        if conn is None or conn.closed:
            self._conns.pop(addr, None)
            uri = self.uri.at(*addr)
            session = await connect(uri, name=self.name, timeout=3.0, features=FEATURES)
            conn = session.conn
            # every node must answer alike: a write with a collection id or xattrs would
            # be refused by one that did not grant them
            for feature, what in ((Feature.COLLECTIONS, "collections"), (Feature.XATTR, "xattrs")):
                if (feature in session.features) != (feature in self.features):
                    await conn.aclose()
                    granted = "grants" if feature in session.features else "refuses"
                    raise RouterError(f"{uri.redacted()}: {granted} {what}, unlike the node "
                                      "bootstrapped from")  # fmt: skip
            self._conns[addr] = conn
        return conn

    def conn_for(self, vb: int) -> Connection | None:
        """The open connection to the partition's active node, if there is one."""
        a = self._actives[vb] if vb < len(self._actives) else -1
        if 0 <= a < len(self._servers):
            conn = self._conns.get(self._servers[a])
            if conn is not None and not conn.closed:
                return conn
        return None

    # -- requests ---------------------------------------------------------------------

    def submit(self, vb: int, make: Make) -> asyncio.Future[Frame]:
        """Send a request to the partition's active node (deferred: see `flush`). The
        future holds the node's answer; pass it to `settle` for the final one (the fast
        path adds nothing per request: retries happen only when an answer asks for one)."""
        conn = self.conn_for(vb)
        if conn is not None:
            opaque = conn.next_opaque()
            try:
                return conn.start_raw(make(opaque), opaque, defer=True)
            except (UprError, OSError):
                pass  # the connection just closed: the retry below reconnects
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        fut.set_exception(RouterError(f"partition {vb}: no connection to its active node"))
        return fut

    async def settle(self, fut: asyncio.Future[Frame], vb: int, make: Make) -> Frame:
        """The final answer of a submitted request: on NOT_MY_VBUCKET or a lost node,
        the newest map is taken and the request sent again, for up to `retry_for` s."""
        try:
            frame = await fut
        except (UprError, OSError) as exc:
            return await self._retry(vb, make, None, str(exc))
        if frame.vbucket_or_status not in _FOLLOW:
            return frame
        return await self._retry(vb, make, _map_body(frame), _why(frame), frame)

    async def request(self, vb: int, make: Make) -> Frame:
        """Send one request now and wait for its final answer."""
        fut = self.submit(vb, make)
        self.flush()
        return await self.settle(fut, vb, make)

    def flush(self) -> None:
        """Write every deferred request."""
        for conn in list(self._conns.values()):
            if not conn.closed:
                conn.flush_writes()

    async def drain(self) -> None:
        """Wait until no connection holds more unsent bytes than its transport's
        high-water mark. A connection that fails meanwhile is left to its requests'
        answers (`settle` sends them again)."""
        for conn in list(self._conns.values()):
            if not conn.closed:
                with contextlib.suppress(UprError, OSError):
                    await conn.drain()

    async def _retry(self, vb: int, make: Make, body: bytes | None, reason: str,
                     frame: Frame | None = None) -> Frame:  # fmt: skip
        # Paced by the retry policy only while no answer carries a newer map (the map is
        # being changed: ask again shortly); a newer one is used at once.
        retry = RetryPolicy(within=self.retry_for, first=0.05, cap=0.5).start()
        while True:
            self.retries += 1
            if retry.spent:
                if frame is not None:
                    return frame
                raise RouterError(f"partition {vb}: {reason} for {self.retry_for:g}s")
            if self._newer(body) is None:
                await retry.wait()
            try:
                await self.refresh(body)
            except NoNodeAnswers:
                raise  # the whole cluster is gone: fail
            except (UprError, OSError):
                pass  # the request below fails too, and the next round asks again
            fut = self.submit(vb, make)
            self.flush()
            try:
                got = await fut
            except (UprError, OSError) as exc:
                body, reason, frame = None, str(exc), None
                continue
            if got.vbucket_or_status not in _FOLLOW:
                return got
            body, reason, frame = _map_body(got), _why(got), got

    def _newer(self, body: bytes | None) -> dict[str, Any] | None:
        """The map an answer carries, when it is newer than the one in use."""
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            cand = json.loads(body) if body else None
            if isinstance(cand, dict) and cand.get("rev", 0) > self.rev:
                return cand
        return None

    async def refresh(self, body: bytes | None = None) -> None:
        """Take a newer map: from an answer's body, else from every node we know."""
        gen = self._gen
        async with self._lock:
            if self._gen != gen:
                return  # another retry refreshed meanwhile
            self._gen += 1
            best = self._newer(body) or self.config
            if best is self.config:
                got = await self._fetch_all()
                if not any(got):
                    raise NoNodeAnswers(f"{self.uri.redacted()}: no node of the cluster answers")
                for cfg in got:
                    if cfg.get("rev", 0) > best.get("rev", 0):
                        best = cfg
            if best is not self.config:
                self.config = best
                self._servers, self._actives = self._layout(best)
            await self._connect_actives()

    async def _fetch_all(self) -> list[dict[str, Any]]:
        addrs = set(self._servers) | set(self._conns)

        async def one(addr: tuple[str, int]) -> dict[str, Any]:
            try:
                conn = await self._conn(addr)
                resp = await conn.request(GetClusterConfig(opaque=conn.next_opaque()), timeout=3)
                raw = getattr(resp, "value", b"")
                cfg = json.loads(raw) if raw else {}
                return cfg if isinstance(cfg, dict) else {}
            except (UprError, OSError, ValueError):
                return {}

        return list(await asyncio.gather(*(one(a) for a in addrs)))

    async def aclose(self) -> None:
        """Close every connection (all at once first: a cancelled aclose leaks none)."""
        conns = list(self._conns.values())
        self._conns.clear()
        await aclose_all(conns)
