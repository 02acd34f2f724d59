"""The DCP consumer: stream a set of partitions from positions, in batches.

Theory of operation. Three layers, the h11 way. The links (dcp/links.py): each node's
reader task hands every batch of server frames to `Links.on_server`, which answers
NOOPs at once (docs/protocol.md §2.12) and queues the rest; the flow-control window
(docs/protocol.md §7.1) bounds what can be queued. The stream state machine
(dcp/streams.py, no I/O): `batches()` feeds it each batch, and it turns frames into row
tuples (`DcpRecord` order) and events; the consumer sends what it asks for (snapshot
marker acknowledgements) and reopens the streams it ends. The opener (dcp/opening.py):
stream requests out, their answers (accepted, ROLLBACK, refused) back to the state
machine, partitions moved to their active node. A batch's bytes are acknowledged only
when the caller asks for the next one, i.e. after the sink took the items. Positions
advance as items arrive; `commit()` marks what the caller has made durable, and a
reconnect resumes from the committed positions (at-least-once delivery). A connection
silent for longer than `dead_after` seconds is treated as dead (the server sends NOOPs
every `noop_interval`) and reconnected.

Reconnects (docs/protocol.md §4.5). One policy for a single node and a cluster alike:
capped exponential backoff with jitter (net/retry.py) for up to `follow_for` seconds
(the commands' --wait; `math.inf` waits for ever, 0 tries once), with a line to
`on_notice` when a link is lost and when it is back. Streams resume from the committed
positions, so the catch-up loses nothing. A finite stream's end is pinned once, at the
start, at its node's high seq; after a reconnect (or a move to another node) it is
capped at the high seq the node holds then: a failover or an unclean restart started a
new branch (a new failover entry) that may never reach the end pinned on the old one,
and the writes above the branch point come back as a ROLLBACK like any other.

Clusters (formats/cluster.md §4). When the bootstrap node's cluster map lists several
nodes, each partition is streamed from its active node, one connection ("link") per
node. A stream refused with NOT_MY_VBUCKET (a rebalance moved the partition, a
failover promoted a replica) or a link lost for good makes the consumer take the
newest map it can find (the refusal carries one; else it asks every node it knows) and
reopen the partition on its new active from where it stood: the producer rule there
decides any rollback, which reaches the caller as a `Rollback` event like any other.
Barrier cookies are per connection, so they are offered only while one link serves.

Collections (docs/protocol.md "Collections"). Every link offers them in HELLO; where the
source grants them, the consumer reads its manifest at open (GET_COLLECTIONS_MANIFEST),
data records carry their collection id, and each system event that creates or drops a
collection or scope on a partition is handed over as a `ManifestChange` at its seq. A
`collections` filter is resolved to ids against that manifest (dcp/filter.py) and sent
with every stream request, so the source streams only those collections (and
SEQNO_ADVANCED past the rest); how each partition follows drops, and how a filter is
resumed with `followed_ids`, is dcp/streams.py (docs/protocol.md §12.4).

Snappy (formats/wire.md "Snappy"), as `compression` says (the commands'
`--wire-compression`): "auto" offers it in HELLO, so a value the server stores compressed
may travel as it is and the rest travel plain; "force" also asks, where it is granted,
for `force_value_compression` (every value compressed: for a slow link; a server that
refuses that control still sends what it holds compressed as it is); "off" does not
offer it, so the server inflates every value before sending it. A compressed value
is inflated here, once, as its record is decoded, so every caller (backup, tail, replay,
a replica) sees plain values with the Snappy bit clear; a value that does not inflate
raises `CorruptValueError` naming its key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from typing import Any

from upr_cli.collections import CollectionsError, CollectionsManifest, Path
from upr_cli.dcp.events import Item
from upr_cli.dcp.filter import StreamFilter
from upr_cli.dcp.links import WIRE_COMPRESSION, Addr, Link, Links, Lost, WireCompression
from upr_cli.dcp.opening import ConsumerError, Opener
from upr_cli.dcp.streams import Part, Streams
from upr_cli.errors import RemoteProtocolError, UprError, UsageError
from upr_cli.failover import FailoverLog
from upr_cli.net.bootstrap import WANTED, Session, connect, map_nodes
from upr_cli.net.collections_manifest import get_collections_manifest
from upr_cli.net.connection import ConnectionError_, ServerItems
from upr_cli.net.retry import RetryPolicy
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.protocol.header import Feature
from upr_cli.protocol.messages import (
    Barrier,
    GetClusterConfig,
)
from upr_cli.protocol.status import Status

log = logging.getLogger(__name__)


class DcpConsumer:
    """Stream partitions of one bucket: over one DCP connection, or one per active node."""

    def __init__(
        self,
        uri: SourceUri,
        *,
        partitions: Iterable[int] | None = None,
        positions: dict[int, StreamPosition] | None = None,
        failover_logs: dict[int, FailoverLog] | None = None,
        until_end: bool = False,
        end_seqs: dict[int, int] | None = None,
        from_latest: bool = False,
        start_seq: int | None = None,
        buffer_size: int = 4 * 1024 * 1024,
        noop_interval: float = 2.0,
        dead_after: float | None = None,
        reconnect_attempts: int = 1,
        boundaries: Mapping[int, Iterable[int]] | None = None,
        barriers: bool = False,
        connect_timeout: float = 10.0,
        follow_for: float = 120.0,
        name: str = "upr",
        collections: list[Path] | None = None,
        followed_ids: Mapping[int, Iterable[int]] | Iterable[int] | None = None,
        compression: WireCompression = "auto",
        with_xattrs: bool = True,
        on_notice: Callable[[str], None] | None = None,
    ) -> None:
        self.uri = uri
        # offer HELLO Snappy (compressed values are inflated here) unless "off", and XATTR
        # (each record's xattrs are split off into `DcpRecord.xattrs`)
        if compression not in WIRE_COMPRESSION:
            raise ValueError(f"compression {compression!r}: one of {', '.join(WIRE_COMPRESSION)}")
        self.compression = compression
        extra = () if compression == "off" else (Feature.SNAPPY,)
        self._want = None if partitions is None else sorted(set(partitions))
        self._logs = dict(failover_logs or {})
        self.streams = Streams(positions=positions, boundaries=boundaries, until_end=until_end,
                               end_seqs=end_seqs, from_latest=from_latest,
                               collections=collections, followed_ids=followed_ids)  # fmt: skip
        self.until_end = self.streams.until_end
        self.from_latest = from_latest
        self.start_seq = start_seq
        self.buffer_size = buffer_size
        self.noop_interval = noop_interval
        self.dead_after = dead_after or max(2 * noop_interval + 1, 5.0)
        self.reconnect_attempts = reconnect_attempts
        self.want_barriers = barriers
        self.connect_timeout = connect_timeout
        # how long a lost link is reconnected, or a partition waits for an active node
        # (the commands' --wait; math.inf: for ever), and at least how many attempts
        self.follow_for = follow_for
        self.on_notice = on_notice  # a line when a link is lost and when it is back
        self.name = f"{name}:{random.getrandbits(32):08x}"
        self.links = Links(name=self.name, buffer_size=buffer_size, noop_interval=noop_interval,
                           features=(*WANTED, *extra, *((Feature.XATTR,) if with_xattrs else ())),
                           compression=compression, want_barriers=barriers,
                           connect_timeout=connect_timeout)  # fmt: skip
        # the state machine's tables and the links', under the consumer's own names
        # (shared, never rebound; `_bounds` is the caller's boundaries, for the tests)
        self.parts, self.highs = self.streams.parts, self.streams.highs
        self._committed, self._bounds = self.streams.committed, self.streams.bounds
        self._events, self._links = self.streams.events, self.links.by_addr
        self._queue = self.links.queue
        self._config: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.opener = Opener(uri, self.links, self.streams, follow_for=follow_for,
                             start_seq=start_seq, spawn=self._spawn,
                             locate=self._locate)  # fmt: skip
        self.collections_enabled = False  # HELLO granted Collections (set by open())

    @property
    def manifest(self) -> CollectionsManifest | None:
        """The source's manifest, read at open; None: no collections."""
        return self.streams.manifest

    @property
    def filter(self) -> StreamFilter | None:
        """The `collections` filter resolved against the manifest (None: every collection)."""
        return self.streams.filter

    @property
    def waiting(self) -> set[int]:
        """Partitions with no reachable active node yet (streamed once one answers)."""
        return self.opener.waiting

    @property
    def session(self) -> Session | None:
        """The bootstrap link's session."""
        return self.links.session

    @property
    def barriers_supported(self) -> bool:
        """Whether the link granted barrier cookies (only while one link serves)."""
        return self.links.barriers_supported

    # -- life cycle -----------------------------------------------------------------

    async def open(self) -> None:
        """Connect, negotiate, pin end seqnos (if finite) and open every stream."""
        failures = []
        for home in self.uri.hosts:  # the URI's bootstrap hosts, in order (net/uri.py)
            try:
                await self.links.connect(self.uri, home, bootstrap=True)
                break
            except (ConnectionError_, OSError) as exc:
                if len(self.uri.hosts) == 1:
                    raise
                failures.append(f"{home[0]}:{home[1]}: {exc}")
        else:
            raise ConnectionError_(f"no bootstrap host answers ({'; '.join(failures)})")
        self.uri = self.opener.uri = self.uri.rebase(*home)  # `$HOST` in the map means this one
        session = self.links.session
        assert session is not None
        self._config = session.config
        await self._read_manifest(session)
        n = session.num_partitions
        if n == 0:
            raise ConsumerError(f"{self.uri.redacted()}: the cluster config lists no partitions")
        want = self._want if self._want is not None else list(range(n))
        bad = [p for p in want if not 0 <= p < n]
        if bad:
            raise UsageError(f"partition {bad[0]} does not exist (the bucket has {n})")
        actives = self._actives()
        self.opener.follow = len({a for a in actives if a is not None}) > 1 or (
            len(self._servers()) > 1
        )
        for p in want:
            self.streams.add(p, (actives[p] if p < len(actives) else None) or home,
                             self._logs.get(p))  # fmt: skip
        for addr in sorted({part.addr for part in self.parts.values()}):
            with contextlib.suppress(ConnectionError_, OSError, UprError):
                await self._link(addr)  # an unreachable active: its partitions move below
        for part in self.parts.values():
            if part.addr not in self._links:
                part.addr = home
        unpinned = await self.opener.pin_highs(list(self.parts.values()))
        waiting = {part.partition for part in unpinned}
        for part in self.parts.values():
            if part.partition not in waiting:
                await self.opener.settle_start(part)
            self.streams.settled(part, pinned=part.partition not in waiting)
        # A degraded cluster (a node down, not yet failed over) must not hold back the
        # partitions that can be streamed: they start now, and the others wait for an
        # active node in the background for up to `follow_for` seconds (`waiting` says
        # which, so that the caller can warn at once), then fail the stream.
        self.opener.waiting = waiting
        try:
            await self.opener.open([part for part in self.parts.values() if part.partition
                                      not in waiting])  # fmt: skip
        except ConnectionError_:
            if not any(link.session.conn.closed for link in self._links.values()):
                raise
            # The node went away as the streams opened, their ends pinned: its loss is
            # queued, and batches() reconnects as after any other (docs/protocol.md §4.5).
            log.info("a connection closed while the streams opened: reconnecting")
        for part in unpinned:
            self._spawn(self.opener.move(part, delay=0.1))

    async def _read_manifest(self, session: Session) -> None:
        """The source's manifest, when it granted Collections, and the filter resolved
        against it. A source that has none set answers NO_COLLECTIONS_MANIFEST: it
        holds the default collection only."""
        self.collections_enabled = session.collections
        manifest = None
        if self.collections_enabled:
            try:
                held = await get_collections_manifest(session.conn)
            except CollectionsError as exc:  # not a manifest: the source's fault
                raise RemoteProtocolError(f"{self.uri.redacted()}: {exc}") from None
            # no collections at all (the command unknown): the default collection only
            manifest = CollectionsManifest() if held is None else held
        self.streams.resolve(manifest)

    def _servers(self) -> list[Addr]:
        return map_nodes(self.uri, self._config)[0]

    def _actives(self) -> list[Addr | None]:
        """Per partition, the address of its active node in the map held (None: none)."""
        servers, actives = map_nodes(self.uri, self._config)
        return [servers[a] if 0 <= a < len(servers) else None for a in actives]

    async def _link(self, addr: Addr) -> Link:
        """The open link to a node, connecting it if needed (`Links.link`)."""
        return await self.links.link(self.uri, addr)

    async def aclose(self) -> None:
        """Close every connection (all at once first: a cancelled aclose leaks none)."""
        for task in list(self._tasks):
            task.cancel()
        await self.links.aclose()

    async def __aenter__(self) -> DcpConsumer:
        try:
            await self.open()
        except BaseException:  # a failed or cancelled open closes what it connected
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- streams ------------------------------------------------------------------------

    # The steps a stream request takes, by the names the consumer's boundary tests drive
    # its decode path with (tests/dcp/test_consumer_boundaries.py): the opener takes
    # them itself.
    @staticmethod
    def _begin_stream(part: Part) -> None:
        """What arrives from now on belongs to the stream requested (`Part.begin`)."""
        part.begin()

    def _rollback(self, part: Part, r: int) -> None:
        """ROLLBACK(r) answered for a partition (`Opener.rollback`)."""
        self.opener.rollback(part, r)

    def _reset(self, part: Part) -> None:
        """Back to the committed position, as a reconnect resumes (`Streams.reset`)."""
        self.streams.reset(part)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background step; an error it did not expect ends `batches()` with it
        (a stream must never stall silently)."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - handed to the caller, not swallowed
                self._queue.put_nowait(exc)

        task = asyncio.get_running_loop().create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _locate(self, p: int, body: bytes) -> Addr | None:
        """The address of a partition's active node in the newest map (None: none)."""
        await self._refresh_map(body)
        actives = self._actives()
        return actives[p] if p < len(actives) else None

    async def _refresh_map(self, body: bytes = b"") -> None:
        """Take the newest map: a NOT_MY_VBUCKET body's, or the one any node serves."""
        best = self._config
        cands: list[Any] = []
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            if body:
                cands.append(json.loads(body))
        addrs = set(self._servers()) | set(self._links)
        for addr in sorted(addrs):
            try:
                link = self._links.get(addr)
                if link is not None and not link.session.conn.closed:
                    conn = link.session.conn
                    resp = await conn.request(GetClusterConfig(opaque=conn.next_opaque()),
                                              timeout=3.0)  # fmt: skip
                else:
                    s = await connect(self.uri.at(*addr),
                                      timeout=3.0, name=self.name)  # fmt: skip
                    try:  # closed whatever happens: an open one dropped leaks its reader
                        resp = await s.conn.request(
                            GetClusterConfig(opaque=s.conn.next_opaque()), timeout=3.0
                        )
                    finally:
                        await s.conn.aclose()
                cands.append(json.loads(getattr(resp, "value", b"") or b"{}"))
            except (UprError, OSError, ValueError):
                continue
        for cfg in cands:
            rev = cfg.get("rev", 0) if isinstance(cfg, dict) else 0
            if isinstance(rev, int) and rev > best.get("rev", 0):
                best = cfg
        self._config = best

    def _reconnecting(self) -> RetryPolicy:
        """The one reconnect policy, single node or cluster: capped exponential backoff
        with jitter (at most a second apart, so a node back is found at once) for up to
        `follow_for` seconds and at least `reconnect_attempts` attempts."""
        return RetryPolicy(attempts=max(1, self.reconnect_attempts), within=self.follow_for,
                           first=0.2, cap=1.0)  # fmt: skip

    def _notice(self, text: str) -> None:
        if self.on_notice is not None:
            self.on_notice(text)
        else:
            log.info("%s", text)

    async def _reconnect(self, addr: Addr, attempts: int, reason: str) -> int:
        """Reconnect a link through `_reconnecting`; its partitions resume from their
        committed positions, finite ones with their ends capped (`Opener.cap_ends`). While
        following a map, partitions the newest map moved elsewhere are reopened there
        instead (it may restart or fail over). Returns the attempts made."""
        parts = [
            p for p in self.parts.values()
            if p.addr == addr and not p.done and p.partition not in self.opener.moving
        ]  # fmt: skip
        link = self._links.pop(addr, None)
        if link is not None:
            await link.session.conn.aclose()
        where = f"{addr[0]}:{addr[1]}"
        wait = self.follow_for
        how = ("until it is back" if math.isinf(wait) else
               f"for up to {wait:g}s" if wait > 0 else "once")  # fmt: skip
        self._notice(f"connection to {where} lost ({reason}); reconnecting {how}")
        retry = self._reconnecting().start(tries=attempts)
        while True:
            if retry.spent:
                raise ConsumerError(
                    f"{self.uri.redacted()}: connection to {where} lost ({reason}); "
                    f"{retry.tries} reconnect attempts failed in {retry.elapsed:.0f}s"
                )
            log.info("reconnecting to %s (attempt %d)", where, retry.tries + 1)
            await retry.wait()
            for part in parts:
                self._reset(part)
            if self.opener.follow:
                with contextlib.suppress(UprError, OSError):
                    await self._refresh_map()
                actives = self._actives()
                for part in list(parts):
                    new = actives[part.partition] if part.partition < len(actives) else None
                    if new is not None and new != addr:
                        parts.remove(part)
                        self._spawn(self.opener.move(part))
                if not parts:
                    self._notice(f"the partitions of {where} moved to other nodes; streaming "
                                 "from there")  # fmt: skip
                    return 0
            try:
                await self._link(addr)
                if self.until_end:
                    for part in await self.opener.cap_ends(parts):  # not active there (a cluster)
                        parts.remove(part)
                        self._spawn(self.opener.move(part))
                await self.opener.open(parts)
            except (ConnectionError_, OSError) as exc:
                reason = str(exc)
                log.info("reconnect failed: %s", exc)
                continue
            self._notice(f"connection to {where} back after {retry.elapsed:.1f}s; streams "
                         "resume where they were committed")  # fmt: skip
            return retry.tries

    # -- receiving ------------------------------------------------------------------------

    def boundaries(self, partition: int) -> list[int]:
        """Snapshot boundaries of a partition known at or below where it stands now
        (ascending): what a rollback of the caller's sink could go back to."""
        return self.streams.boundaries(partition)

    @property
    def positions(self) -> dict[int, StreamPosition]:
        """Where every partition stands now (received, not necessarily committed)."""
        return {p: part.position() for p, part in self.parts.items()}

    @property
    def failover_logs(self) -> dict[int, FailoverLog]:
        """The failover log kept per partition (from the last accepted stream request)."""
        return {p: part.log for p, part in self.parts.items()}

    def commit(self, positions: dict[int, StreamPosition] | None = None) -> None:
        """Mark positions durable in the caller's sink; a reconnect resumes from these."""
        self.streams.commit(positions)

    def followed(self, partition: int) -> set[int]:
        """The collection ids the caller follows on a partition at its committed
        position: what a later resume passes as `followed_ids` (docs/protocol.md §12.4)."""
        return self.streams.followed(partition)

    @property
    def filter_emptied(self) -> bool:
        """True when a filter was given and every partition's stream ended because all
        it followed was dropped (FilterEmpty)."""
        return self.streams.filter_emptied

    @property
    def committed(self) -> dict[int, StreamPosition]:
        """The positions the caller committed; a reconnect resumes from these."""
        return {p: StreamPosition(p, *t) for p, t in self._committed.items()}

    @property
    def finished(self) -> bool:
        """True once every partition's finite stream has ended and been handed over.

        A stream being opened is not finished even when its end already arrived: the
        data and the end it sent are held until its StreamOpened is handed over
        (`Opener.hold`), which may run after `batches()` decoded them."""
        return not self.opener.busy and all(p.done for p in self.parts.values())

    async def batches(self) -> AsyncIterator[list[Item]]:
        """Rows and events in wire order, batch by batch, until every stream ended."""
        attempts: dict[Addr, int] = {}
        events = self._events
        while True:
            if events:
                yield self._take_events()
            if self.finished:
                return
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                # that arrives as the queue yields (the task then never stops)
                async with asyncio.timeout(self.dead_after):
                    got = await self._queue.get()
            except TimeoutError:
                got = Lost(f"no message for {self.dead_after:g}s: connection presumed dead")
            if isinstance(got, Lost):
                for addr in [got.addr] if got.addr is not None else list(self._links):
                    link = self._links.get(addr)
                    if got.addr is not None and (link is None or link.gen != got.gen):
                        continue  # an older connection of this link
                    log.info("connection to %s:%d lost: %s", *addr, got.reason)
                    attempts[addr] = await self._reconnect(addr, attempts.get(addr, 0), got.reason)
                continue
            if isinstance(got, BaseException):
                raise got
            addr, gen, items, nbytes = got
            link = self._links.get(addr)
            if link is None or link.gen != gen:
                continue  # queued before that link was reconnected: its streams restarted
            if events:  # a stream opened while we waited: its StreamOpened first
                yield self._take_events()
            out = self._process(items, addr) if items else []
            if out:
                yield out
                attempts[addr] = 0
            self.links.ack(link, nbytes)

    def _take_events(self) -> list[Item]:
        """The events queued outside a batch (the list itself is shared, never rebound)."""
        events = self._events[:]
        self._events.clear()
        return events

    def _process(self, items: ServerItems, addr: Addr | None = None) -> list[Item]:
        out = self._decode(items)
        if self.opener.opening and out:
            out = self.opener.hold(out, addr)
        return out

    def _decode(self, items: ServerItems) -> list[Item]:
        """Feed a batch to the state machine; send the marker acknowledgements it asks
        for and reopen the streams it ends."""
        streams = self.streams
        out = streams.feed(items)
        if streams.outbox:
            self.links.send(streams.outbox)
        if streams.reopen:
            for part in streams.reopen:
                self._spawn(self.opener.reopen(part))
            streams.reopen.clear()
        return out

    async def barrier(self, cookie: bytes) -> bool:
        """Send a barrier cookie; a `BarrierReached` event follows in the stream. False
        when the connection is down: `batches()` reconnects it, and the caller asks
        again once streams reopen (a cookie lives and dies with its connection)."""
        if not self.barriers_supported or self.session is None or len(self._links) > 1:
            raise ConsumerError("the source does not support barrier cookies")
        conn = self.session.conn
        if conn.closed:
            return False
        try:
            await conn.request(Barrier(cookie=cookie, opaque=conn.next_opaque()))
        except ConnectionError_:
            return False
        return True

    async def failover_log(self, partition: int) -> FailoverLog:
        """The server's failover log for a partition (GET_FAILOVER_LOG), from its node."""
        return await self.opener.failover_log(partition)


# `Item` and `WireCompression` are imported from here by the jobs, the CLI options, the
# sink loop and Spark: the consumer's vocabulary, defined beside the pieces it uses
__all__ = ["WIRE_COMPRESSION", "ConsumerError", "DcpConsumer", "Item", "Status", "WireCompression"]
