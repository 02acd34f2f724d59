"""The DCP consumer: stream a set of partitions from positions, in batches.

Theory of operation. The connection's reader task hands every batch of server frames to
`_on_server`, which answers NOOPs at once (docs/protocol.md §2.12) and queues the rest;
the flow-control window (docs/protocol.md §7.1) bounds what can be queued. `batches()`
turns frames into row tuples (`DcpRecord` order) and events, and acknowledges a batch's
bytes only when the caller asks for the next one, i.e. after the sink took the items.
Positions advance as items arrive; `commit()` marks what the caller has made durable,
and a reconnect resumes from the committed positions (at-least-once delivery).

ROLLBACK(r) follows docs/design.md, "Snapshot boundaries": inside a deduplicated
snapshot a seq is not a state the source ever had, so the consumer goes back to r', the
newest snapshot boundary at or below r that the caller reached (the boundaries it
passed in, the start position, and every snapshot completed on a stream since), takes
the newest entry of the kept failover log with seq ≤ r', restarts from (r', r', r') on
that uuid, and hands the caller an explicit `Rollback` event first, so it can undo its
sink above r'. A stream that ends for any reason but "end
reached" or "closed by us" is reopened from where it stood. A connection silent for
longer than `dead_after` seconds is treated as dead (the server sends NOOPs every
`noop_interval`) and reconnected.

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
`collections` filter is resolved to ids against that manifest and sent with every
stream request, so the source streams only those collections (and SEQNO_ADVANCED past
the rest). Each partition forgets a dropped id once the caller committed past that
partition's drop; a stream whose filter lost every collection ends with FilterEmpty,
which counts as ended. A caller resuming a filter passes the ids it followed
(`followed_ids`): a partition whose followed ids the source no longer has streams
unfiltered up to its high seq at open, keeping what it follows, so that their drops
reach the caller (docs/protocol.md §12.4, "Resuming a filter across drops").

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
import struct
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from upr_cli.collections import (
    DEFAULT,
    CollectionsError,
    Manifest,
    ManifestChange,
    Path,
    decode_event,
)
from upr_cli.dcp.events import (
    BarrierReached,
    Event,
    Rollback,
    Snapshot,
    StreamEnded,
    StreamOpened,
)
from upr_cli.errors import RemoteProtocolError, UprError, UsageError
from upr_cli.failover import FailoverLog
from upr_cli.net.bootstrap import WANTED, Session, connect, map_nodes
from upr_cli.net.connection import (
    ConnectionClosed,
    ConnectionError_,
    ServerItems,
    aclose_all,
    raise_for_status,
)
from upr_cli.net.retry import RetryPolicy
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition, boundary_at
from upr_cli.protocol import Frame, Message, decode_message, snappy, xattrs
from upr_cli.protocol.dcp import (
    END_CLOSED,
    END_FILTER_EMPTY,
    END_OK,
    MARKER_ACK,
    OPEN_DELETED_USER_XATTRS,
    OPEN_PRODUCER,
    S_ACTIVE_ONLY,
    S_FROM_LATEST,
)
from upr_cli.protocol.dcp import OPEN_XATTRS as OPEN_INCLUDE_XATTRS
from upr_cli.protocol.decoder import R_BY_SEQNO, R_COLLECTION, R_DATATYPE, R_VBUCKET, DcpRecord
from upr_cli.protocol.header import Feature, Magic, Opcode
from upr_cli.protocol.messages import (
    STREAM_FOREVER,
    Barrier,
    BufferAck,
    CollectionsGetManifest,
    Control,
    DcpOpen,
    FailoverLogResponse,
    GetAllVbSeqnos,
    GetAllVbSeqnosResponse,
    GetClusterConfig,
    GetFailoverLog,
    Response,
    SeqnoAdvanced,
    SnapshotMarker,
    SnapshotMarkerV2,
    StreamEnd,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
    SystemEvent,
)
from upr_cli.protocol.status import Status, status_error

log = logging.getLogger(__name__)

# DCP_OPEN flags for xattrs (formats/wire.md "Xattrs"): every data message carries the
# document's xattrs, and a deletion keeps its user xattrs where the server still has them
OPEN_XATTRS = OPEN_INCLUDE_XATTRS | OPEN_DELETED_USER_XATTRS
_CODED = snappy.SNAPPY | xattrs.XATTR
# --wire-compression (formats/wire.md "Snappy"): negotiate Snappy without forcing it,
# force every value compressed (a slow link), or not negotiate it
WireCompression = Literal["auto", "force", "off"]
WIRE_COMPRESSION: tuple[WireCompression, ...] = ("auto", "force", "off")
FLAG_FROM_LATEST = S_FROM_LATEST
# docs/protocol.md §2.2 ActiveVbOnly: a client wants the history of the active copy; a
# replica copy (possibly behind, possibly on another branch) is refused with NOT_MY_VBUCKET.
FLAG_ACTIVE_ONLY = S_ACTIVE_ONLY
_SYSTEM_EXTRAS = struct.Struct(">QIB")  # DCP_SYSTEM_EVENT: seq, event, version
Item = DcpRecord | Event


class ConsumerError(UprError):
    """The stream cannot continue (a partition refused, retries exhausted)."""


@dataclass(slots=True)
class CollectionFilter:
    """What a filtered stream asks for (docs/protocol.md "Collections"): one scope's
    id, or a set of collection ids. Each partition holds its own copy and forgets a
    dropped id once the caller committed past that partition's drop
    (docs/protocol.md §12.4)."""

    scope: int | None = None
    ids: set[int] = field(default_factory=set)  # for a scope: its collections known
    gone: bool = False  # the scope was dropped

    @property
    def empty(self) -> bool:
        """True once nothing the filter names exists any more."""
        return self.gone if self.scope is not None else not self.ids

    def copy(self) -> CollectionFilter:
        """A partition's own copy."""
        return CollectionFilter(self.scope, set(self.ids), self.gone)

    def value(self) -> bytes:
        """The STREAM_REQ value, ids as hex strings (kv_engine's form). No `uid`: a
        producer leaves out the system events whose manifest uid is at or below it, and
        the events one manifest makes on a partition share its uid on a upr node, so
        even the uid seen at the start position would hide the rest of them
        (docs/protocol.md §12.4)."""
        doc = (
            {"scope": f"{self.scope:x}"}
            if self.scope is not None
            else {"collections": [f"{c:x}" for c in sorted(self.ids)]}
        )
        return json.dumps(doc, separators=(",", ":")).encode()

    def admit(self, change: ManifestChange) -> None:
        """A collection created in the filter's scope streams from now on."""
        if (change.kind == "collection-created" and change.scope_id == self.scope
                and change.collection_id is not None):  # fmt: skip
            self.ids.add(change.collection_id)

    def forget(self, change: ManifestChange) -> None:
        """Follow a drop: the id (or the scope) is gone for good, never reused."""
        if change.kind == "collection-dropped" and change.collection_id is not None:
            self.ids.discard(change.collection_id)
        elif change.kind == "scope-dropped" and change.scope_id == self.scope:
            self.gone = True


def plain_records(out: list[Item], where: list[int]) -> None:
    """Replace the records at `where` in `out` by their plain form: values inflated (all
    of a batch's compressed values in one call) and xattrs split off (formats/wire.md).
    Built with tuple.__new__ (as the decoder builds records): NamedTuple._replace costs
    about as much as the inflating itself."""
    recs = cast("list[DcpRecord]", [out[i] for i in where])
    packed = [r for r in recs if r[8] & snappy.SNAPPY and r[10]]
    inflated = iter(snappy.inflate_all([r[10] for r in packed], [r[9] for r in packed])
                    if packed else ())  # fmt: skip
    for i, (op, vb, seq, rev, cas, flags, exp, dtime, dt, key, value, opaque, coll,
            blob) in zip(where, recs, strict=True):  # fmt: skip
        if dt & snappy.SNAPPY and value:
            value = next(inflated)
        dt &= ~snappy.SNAPPY
        if dt & xattrs.XATTR:
            blob, value = xattrs.split(value, key)
            dt &= ~xattrs.XATTR
        out[i] = _new(DcpRecord, (op, vb, seq, rev, cas, flags, exp, dtime, dt, key, value,
                                  opaque, coll, blob))  # fmt: skip


_new = tuple.__new__


def resolve_filter(
    paths: list[Path] | None, manifest: Manifest | None, *, lenient: bool = False
) -> CollectionFilter | None:
    """The filter that streams `paths` from a source with `manifest` (None: a source
    without collections, where only `_default._default` exists); None streams all.
    A path the manifest does not know is a CollectionsError naming it, unless
    `lenient` (a resume whose followed collections were dropped): it is left out."""
    if not paths:
        return None
    if manifest is None:
        other = [str(p) for p in paths if not p.covers(DEFAULT, DEFAULT)]
        if other:
            raise CollectionsError(
                f"unknown collection {', '.join(other)}: the source does not support "
                "collections (only _default._default exists there)"
            )
        return None
    missing = [
        str(p) for p in paths
        if (manifest.scope(p.scope) if p.collection is None else manifest.lookup(p)) is None
    ]  # fmt: skip
    if missing and not lenient:
        many = "s" if len(missing) > 1 else ""
        raise CollectionsError(
            f"unknown collection{many} {', '.join(missing)} (the source's manifest uid "
            f"{manifest.uid:x})"
        )
    if len(paths) == 1 and paths[0].collection is None and not missing:
        scope = manifest.scope(paths[0].scope)
        assert scope is not None
        return CollectionFilter(scope=scope.id, ids={c.id for c in scope.collections})
    ids = manifest.ids(paths)
    if not ids and not lenient:
        raise CollectionsError(f"{', '.join(map(str, paths))}: no collection to stream")
    return CollectionFilter(ids=ids)


Addr = tuple[str, int]


class _Lost:
    """Queue marker: a link's connection closed or went silent."""

    def __init__(self, reason: str, addr: Addr | None = None, gen: int = -1) -> None:
        self.reason = reason
        self.addr = addr
        self.gen = gen


#: the newest snapshot boundaries kept per partition beside those the caller passed in: a
#: rollback further back than these lands on the caller's own, or resets the partition
KEEP_BOUNDARIES = 256


@dataclass(slots=True)
class _Link:
    """One connection of the consumer, to one node."""

    addr: Addr
    session: Session
    gen: int  # bumped per connection: queued items of an older one are dropped
    unacked: int = 0


@dataclass(slots=True)
class _Part:
    """Mutable per-partition state (cheap to update per row)."""

    partition: int
    uuid: int = 0
    seq: int = 0
    snap_start: int = 0
    snap_end: int = 0
    end: int = STREAM_FOREVER
    done: bool = False
    log: FailoverLog = field(default_factory=FailoverLog)
    addr: Addr = ("", 0)  # the node streaming it
    # Snapshot boundaries seen on this partition's streams (ascending, at most about
    # 2 * KEEP_BOUNDARIES; `_rollback` takes those at or below where the partition
    # stands, with the caller's), and whether the current stream has sent a marker yet:
    # only then does a new marker complete the snapshot before it.
    bounds: list[int] = field(default_factory=list)
    marked: bool = False
    # Collections (docs/protocol.md §12.4): this partition's filter; the ids the caller
    # followed here that the source no longer has, until the caller committed past
    # their drops or the catch-up seq; the seq up to which it streams unfiltered to find
    # those drops (None: to be pinned); what a catch-up stream hands over (None: all);
    # the drops handed over and not yet committed; the drops committed (id → seq).
    filter: CollectionFilter | None = None
    pending: set[int] = field(default_factory=set)
    catchup: int | None = None
    keep: set[int] | None = None
    delivered: list[ManifestChange] = field(default_factory=list)
    forgotten: dict[int, int] = field(default_factory=dict)

    def position(self) -> StreamPosition:
        return StreamPosition(self.partition, self.uuid, self.seq, self.snap_start, self.snap_end)


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
        self._features = (*WANTED, *extra, *((Feature.XATTR,) if with_xattrs else ()))
        self._want = None if partitions is None else sorted(set(partitions))
        self._start = dict(positions or {})
        self._logs = dict(failover_logs or {})
        self._bounds = {p: sorted(set(b)) for p, b in (boundaries or {}).items()}
        self.until_end = until_end or end_seqs is not None
        self._end_seqs = dict(end_seqs or {})
        self.from_latest = from_latest
        self.start_seq = start_seq
        self.buffer_size = buffer_size
        self.noop_interval = noop_interval
        self.dead_after = dead_after or max(2 * noop_interval + 1, 5.0)
        self.reconnect_attempts = reconnect_attempts
        self.want_barriers = barriers
        self.barriers_supported = False
        self.connect_timeout = connect_timeout
        # how long a lost link is reconnected, or a partition waits for an active node
        # (the commands' --wait; math.inf: for ever), and at least how many attempts
        self.follow_for = follow_for
        self.on_notice = on_notice  # a line when a link is lost and when it is back
        self.waiting: set[int] = set()  # partitions with no reachable active node yet
        self.name = f"{name}:{random.getrandbits(32):08x}"
        self.parts: dict[int, _Part] = {}
        # (uuid, seq, snap_start, snap_end) per partition: plain tuples, since commit()
        # runs after every batch and must stay cheap for 1024 partitions.
        self._committed: dict[int, tuple[int, int, int, int]] = {}
        # the partitions whose position moved since the last commit(): commit() copies
        # those alone, unless a position changed outside the decode path (`_stale`)
        self._dirty: set[int] = set()
        self._stale = True
        self.session: Session | None = None  # the bootstrap link's session
        self._links: dict[Addr, _Link] = {}
        self._link_locks: dict[Addr, asyncio.Lock] = {}
        self._gen = 0
        self._config: dict[str, Any] = {}
        self._follow = False  # the map lists several nodes: follow it
        self._tmpfail: dict[int, float] = {}  # partition → first ETMPFAIL of a stream request
        self._queue: asyncio.Queue[tuple[Addr, int, ServerItems, int] | BaseException | _Lost] = (
            asyncio.Queue()
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._events: list[Item] = []
        self._moving: set[int] = set()
        # A stream being opened: its data may be queued before the task that asked sees
        # the answer; it waits here so that StreamOpened always comes first (`_process`).
        self._opening: dict[int, Addr] = {}
        self._held: dict[int, list[Item]] = {}
        self.highs: dict[int, int] = {}
        self._paths = list(collections) if collections else None
        # the collection ids the caller followed at its positions, per partition (an
        # iterable: the same for every partition); see `_vanished`
        self._followed: dict[int, set[int]] = {}
        self._followed_all: set[int] = set()
        self._resuming = followed_ids is not None  # the caller followed this filter before
        if isinstance(followed_ids, Mapping):
            self._followed = {int(p): set(ids) for p, ids in followed_ids.items()}
        elif followed_ids is not None:
            self._followed_all = set(followed_ids)
        # partitions with drops handed over and not committed, or vanished ids pending
        self._settling: set[int] = set()
        self.collections_enabled = False  # HELLO granted Collections (set by open())
        self.manifest: Manifest | None = None  # the source's, at open; None: no collections
        self.filter: CollectionFilter | None = None
        self._uid = 0  # the newest manifest uid known: at open, then from system events

    # -- life cycle -----------------------------------------------------------------

    async def open(self) -> None:
        """Connect, negotiate, pin end seqnos (if finite) and open every stream."""
        failures = []
        for home in self.uri.hosts:  # the URI's bootstrap hosts, in order (net/uri.py)
            try:
                await self._connect(home, bootstrap=True)
                break
            except (ConnectionError_, OSError) as exc:
                if len(self.uri.hosts) == 1:
                    raise
                failures.append(f"{home[0]}:{home[1]}: {exc}")
        else:
            raise ConnectionError_(f"no bootstrap host answers ({'; '.join(failures)})")
        self.uri = self.uri.rebase(*home)  # `$HOST` in the map means this one
        assert self.session is not None
        self._config = self.session.config
        await self._read_manifest(self.session)
        n = self.session.num_partitions
        if n == 0:
            raise ConsumerError(f"{self.uri.redacted()}: the cluster config lists no partitions")
        want = self._want if self._want is not None else list(range(n))
        bad = [p for p in want if not 0 <= p < n]
        if bad:
            raise UsageError(f"partition {bad[0]} does not exist (the bucket has {n})")
        actives = self._actives()
        self._follow = len({a for a in actives if a is not None}) > 1 or (len(self._servers()) > 1)
        for p in want:
            pos = self._start.get(p, StreamPosition.beginning(p))
            part = _Part(p, pos.uuid, pos.seq, pos.snap_start, pos.snap_end)
            self._bounds[p] = [b for b in self._bounds.get(p, ()) if b <= pos.seq]
            part.addr = (actives[p] if p < len(actives) else None) or home
            if p in self._logs:
                part.log = self._logs[p]
            self._filter_part(part)
            self.parts[p] = part
        for addr in sorted({part.addr for part in self.parts.values()}):
            with contextlib.suppress(ConnectionError_, OSError, UprError):
                await self._link(addr)  # an unreachable active: its partitions move below
        for part in self.parts.values():
            if part.addr not in self._links:
                part.addr = home
        unpinned = await self._pin_highs(list(self.parts.values()))
        waiting = {part.partition for part in unpinned}
        for part in self.parts.values():
            p = part.partition
            if p not in waiting:
                await self._settle_start(part)
            elif self.until_end:  # its high is unknown until an active node answers
                part.end = self._end_seqs.get(p, part.end)
            if part.pending and p not in waiting:
                # pinned after the manifest was read: every drop it lacks is at or
                # below this seq (docs/protocol.md §12.4)
                part.catchup = self.highs.get(p, 0)
            self._committed[p] = (part.uuid, part.seq, part.snap_start, part.snap_end)
        # A degraded cluster (a node down, not yet failed over) must not hold back the
        # partitions that can be streamed: they start now, and the others wait for an
        # active node in the background for up to `follow_for` seconds (`waiting` says
        # which, so that the caller can warn at once), then fail the stream.
        self.waiting = waiting
        try:
            await self._open_streams([part for part in self.parts.values() if part.partition
                                      not in waiting])  # fmt: skip
        except ConnectionError_:
            if not any(link.session.conn.closed for link in self._links.values()):
                raise
            # The node went away as the streams opened, their ends pinned: its loss is
            # queued, and batches() reconnects as after any other (docs/protocol.md §4.5).
            log.info("a connection closed while the streams opened: reconnecting")
        for part in unpinned:
            self._spawn(self._move(part, delay=0.1))

    async def _read_manifest(self, session: Session) -> None:
        """The source's manifest, when it granted Collections, and the filter resolved
        against it. A source that has none set answers NO_COLLECTIONS_MANIFEST: it
        holds the default collection only."""
        self.collections_enabled = session.collections
        if self.collections_enabled:
            conn = session.conn
            resp = await conn.request(CollectionsGetManifest(opaque=conn.next_opaque()),
                                      check=False)  # fmt: skip
            if resp.status == Status.SUCCESS:
                self.manifest = self._parse_manifest(resp)
                self._uid = self.manifest.uid
            # no manifest set yet, or no collections at all: the default collection only
            elif resp.status in (Status.NO_COLLECTIONS_MANIFEST, Status.UNKNOWN_COMMAND):
                self.manifest = Manifest()
            else:
                raise_for_status(resp)
        manifest = self.manifest
        # A resume of a filter the caller followed before may find paths missing: they
        # were dropped since (their drops may still be to hand over, `_filter_part`).
        lenient = (manifest is not None and self._resuming
                   and any(pos.seq > 0 for pos in self._start.values()))  # fmt: skip
        self.filter = resolve_filter(self._paths, manifest, lenient=lenient)

    def _vanished(self, p: int, manifest: Manifest) -> set[int]:
        """The ids the caller followed on partition p that the source no longer has."""
        known = {c.id for _s, c in manifest.collections()}
        return {c for c in self._followed.get(p, self._followed_all) if c not in known}

    def _filter_part(self, part: _Part) -> None:
        """A partition's own filter, and the followed ids whose drops it must still hand
        over (none when it starts from 0: the caller holds nothing of them)."""
        if self.filter is None:
            return
        part.filter = self.filter.copy()
        if part.seq > 0 and self.manifest is not None:
            part.pending = self._vanished(part.partition, self.manifest)
            if part.pending:
                self._settling.add(part.partition)

    def _parse_manifest(self, resp: Message) -> Manifest:
        try:
            return Manifest.from_json(getattr(resp, "value", b""))
        except CollectionsError as exc:
            raise RemoteProtocolError(f"{self.uri.redacted()}: {exc}") from None

    async def _settle_start(self, part: _Part) -> None:
        """A partition whose high seq is pinned: its start (`start_seq`) and end
        (`until_end`, capped at what the source holds now)."""
        p = part.partition
        if self.start_seq is not None and p not in self._start:
            seq = min(self.start_seq, self.highs.get(p, 0))
            entry = (await self.failover_log(p)).entry_at(seq)
            part.uuid, part.seq = (entry.uuid if entry else 0), seq
            part.snap_start = part.snap_end = seq
            self._committed[p] = (part.uuid, part.seq, part.snap_start, part.snap_end)
            self._stale = True
        if self.until_end:
            # `end_seqs` (a planned range) is capped at what the source holds now: a
            # branch that rolled back below it cannot serve it (the next plan sees that)
            high = self.highs.get(p, 0)
            part.end = min(self._end_seqs.get(p, high), high)

    async def _pin_highs(self, parts: list[_Part]) -> list[_Part]:
        """Each partition's high seq, from the node streaming it (GET_ALL_VB_SEQNOS; in a
        cluster only active copies count). Returns the partitions not active there."""
        missing = []
        for addr in sorted({part.addr for part in parts}):
            link = self._links.get(addr)
            mine = [part for part in parts if part.addr == addr]
            if link is None:
                missing += mine
                continue
            conn = link.session.conn
            req = (
                GetAllVbSeqnos(opaque=conn.next_opaque(), state=1)
                if self._follow
                else GetAllVbSeqnos(opaque=conn.next_opaque())
            )
            try:
                resp = await conn.request(req)
            except ConnectionError_:
                if not self._follow:
                    raise
                missing += mine  # the node went away: wait for the map to move them
                continue
            assert isinstance(resp, GetAllVbSeqnosResponse)
            got = dict(resp.seqnos)
            for part in mine:
                if part.partition in got or not self._follow:
                    self.highs[part.partition] = got.get(part.partition, 0)
                else:
                    missing.append(part)
        return missing

    async def _cap_ends(self, parts: list[_Part]) -> list[_Part]:
        """Finite streams after a reconnect or a move: each end becomes the lower of the
        end pinned at the start and the high seq the node holds now. On one branch a high
        seq never goes down; a failover or an unclean restart starts a new branch below
        writes the old one had, and an end pinned on the old one may never come
        (docs/protocol.md §4.5). Returns the partitions not active there."""
        before = {part.partition: self.highs.get(part.partition) for part in parts}
        missing = await self._pin_highs(parts)
        for part in parts:
            if any(part is m for m in missing):
                continue
            p, pinned = part.partition, before[part.partition]
            if pinned is not None:
                self.highs[p] = min(pinned, self.highs[p])
            part.end = min(part.end, self.highs[p])
        return missing

    def _following(self, first: float) -> RetryPolicy:
        """Waiting for a map to name a partition's new active node: for up to
        `follow_for` seconds, first after `first` seconds, then at most every half second."""
        return RetryPolicy(within=self.follow_for, first=first, cap=max(first, 0.5))

    def _servers(self) -> list[Addr]:
        return map_nodes(self.uri, self._config)[0]

    def _actives(self) -> list[Addr | None]:
        """Per partition, the address of its active node in the map held (None: none)."""
        servers, actives = map_nodes(self.uri, self._config)
        return [servers[a] if 0 <= a < len(servers) else None for a in actives]

    async def _link(self, addr: Addr) -> _Link:
        """The open link to a node, connecting it if needed (one connection per node: a
        lock per address, so concurrent moves share it instead of replacing it)."""
        lock = self._link_locks.setdefault(addr, asyncio.Lock())
        async with lock:
            link = self._links.get(addr)
            if link is None or link.session.conn.closed:
                await self._connect(addr)
                link = self._links[addr]
            return link

    async def _connect(self, addr: Addr, *, bootstrap: bool = False) -> None:
        queue = self._queue
        self._gen += 1
        gen = self._gen
        live = False

        def lost(exc: ConnectionClosed) -> None:
            if live:  # not a bootstrap that failed
                queue.put_nowait(_Lost(str(exc), addr, gen))

        def on_server(items: ServerItems, nbytes: int) -> None:
            self._on_server(addr, gen, items, nbytes)

        uri = self.uri.at(*addr)
        session = await connect(uri, timeout=self.connect_timeout, on_server=on_server,
                                on_close=lost, name=self.name, features=self._features)  # fmt: skip
        conn = session.conn
        try:
            flags = OPEN_PRODUCER | (OPEN_XATTRS if Feature.XATTR in session.features else 0)
            await conn.request(DcpOpen(name=self.name, flags=flags, opaque=conn.next_opaque()))
            controls = [("connection_buffer_size", str(self.buffer_size)), ("enable_noop", "true"),
                        ("set_noop_interval", f"{self.noop_interval:g}")]  # fmt: skip
            for key, value in controls:
                await conn.request(Control(name=key, value=value, opaque=conn.next_opaque()))
            if self.compression == "force" and Feature.SNAPPY in session.features:
                # every value compressed on the wire; where refused (EINVAL), values
                # the server stores compressed still come compressed, the rest plain
                await conn.request(
                    Control(name="force_value_compression", value="true",
                            opaque=conn.next_opaque()),
                    check=False,
                )  # fmt: skip
            if self.want_barriers:
                # a real server answers EINVAL: no barriers, callers fall back (formats/barrier.md);
                # asked on every connection: a reconnected link is a new DCP connection
                resp = await conn.request(
                    Control(name="upr_barrier_cookies", value="true", opaque=conn.next_opaque()),
                    check=False,
                )
                self.barriers_supported = resp.status == Status.SUCCESS
        except BaseException:
            await conn.aclose()
            raise
        live = True
        old = self._links.get(addr)
        # the new link is held before anything awaits: a cancellation cannot leak it
        self._links[addr] = _Link(addr, session, gen)
        if bootstrap or self.session is None or self.session.conn.closed:
            self.session = session
        if len(self._links) > 1:
            self.barriers_supported = False  # cookies are per connection
        if old is not None:
            await old.session.conn.aclose()

    async def aclose(self) -> None:
        """Close every connection (all at once first: a cancelled aclose leaks none)."""
        for task in list(self._tasks):
            task.cancel()
        conns = [link.session.conn for link in self._links.values()]
        self._links.clear()
        self.session = None
        await aclose_all(conns)

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

    async def _open_streams(self, parts: list[_Part]) -> None:
        """Send every STREAM_REQ pipelined; follow ROLLBACKs (docs/protocol.md §4.4) until accepted.
        A NOT_MY_VBUCKET while following a map moves the partition (`_move`)."""
        pending = [p for p in parts if not p.done]
        while pending:
            await self._pin_catchups(pending)
            pending = [part for part in pending if not self._filter_ended(part)]
            if not pending:
                return
            sent = self._request_streams(pending)
            try:
                pending = [part for part, fut, req in sent if await self._answered(part, fut, req)]
            except BaseException:
                for part, _fut, _req in sent:
                    self._opening.pop(part.partition, None)
                raise

    def _filter_ended(self, part: _Part) -> bool:
        """A partition whose filter lost every collection, with no drop left to hand
        over, ends as the source would end it (FilterEmpty)."""
        f = part.filter
        if f is None or not f.empty or part.pending:
            return False
        part.done = True
        self._events.append(StreamEnded(part.partition, END_FILTER_EMPTY, part.position()))
        return True

    async def _pin_catchups(self, parts: list[_Part]) -> None:
        """The seq up to which each partition with vanished ids streams unfiltered: its
        high seq now, read after the manifest that lacks them (docs/protocol.md §12.4)."""
        need = []
        for part in parts:
            if part.pending and part.catchup is None:
                if part.seq == 0:  # the caller holds nothing of them
                    part.pending.clear()
                else:
                    need.append(part)
        for addr in sorted({part.addr for part in need}):
            link = self._links.get(addr)
            if link is None or link.session.conn.closed:
                raise ConnectionError_(f"no open link to {addr[0]}:{addr[1]}")
            conn = link.session.conn
            req = (GetAllVbSeqnos(opaque=conn.next_opaque(), state=1) if self._follow
                   else GetAllVbSeqnos(opaque=conn.next_opaque()))  # fmt: skip
            resp = await conn.request(req)
            assert isinstance(resp, GetAllVbSeqnosResponse)
            got = dict(resp.seqnos)
            for part in need:
                if part.addr == addr:
                    # None (not active there): unfiltered to the end, until a move to
                    # its active node pins it (safe, if costly)
                    part.catchup = got.get(part.partition)

    def _request_streams(
        self, pending: list[_Part]
    ) -> list[tuple[_Part, asyncio.Future[list[Message]], StreamRequest]]:
        """Send a STREAM_REQ for each partition from where it stands, on its node's link.
        A partition catching up on vanished ids streams unfiltered up to its catch-up
        seq and keeps only what it follows (docs/protocol.md §12.4)."""
        sent = []
        for part in pending:
            link = self._links.get(part.addr)
            if link is None or link.session.conn.closed:
                raise ConnectionError_(f"no open link to {part.addr[0]}:{part.addr[1]}")
            conn = link.session.conn
            flags = FLAG_ACTIVE_ONLY | (
                FLAG_FROM_LATEST if self.from_latest and part.seq == 0 and not part.uuid else 0
            )
            top = part.catchup
            catching = bool(part.pending) and (top is None or part.seq < top)
            end = min(part.end, top) if catching and top is not None else part.end
            part.keep = None
            if catching and part.filter is not None:
                part.keep = part.filter.ids | part.pending
            req = StreamRequest(
                vbucket=part.partition, opaque=0x1000_0000 + part.partition, flags=flags,
                start_seqno=part.seq, end_seqno=max(end, part.seq), vbucket_uuid=part.uuid,
                snap_start_seqno=part.snap_start, snap_end_seqno=part.snap_end,
                value=self._filter_value(part, link.session, catching),
            )  # fmt: skip
            self._opening[part.partition] = part.addr
            self._begin_stream(part)
            sent.append((part, conn.start_request(req), req))
        return sent

    def _filter_value(self, part: _Part, session: Session, catching: bool) -> bytes:
        """The STREAM_REQ value: the partition's filter, or nothing (every collection;
        also while catching up)."""
        if part.filter is None:
            return b""
        if not session.collections:  # a value there is EINVAL (docs/protocol.md §2.4)
            raise ConsumerError(
                f"{session.uri.redacted()}: does not support collections, cannot filter on "
                f"{', '.join(map(str, self._paths or []))}"
            )
        return b"" if catching else part.filter.value()

    async def _answered(
        self, part: _Part, fut: asyncio.Future[list[Message]], sent: StreamRequest
    ) -> bool:
        """Act on one stream request's answer; True when it must be sent again (after a
        ROLLBACK, from the rollback point)."""
        try:
            resp = (await fut)[0]
        except ConnectionError_:
            self._opening.pop(part.partition, None)
            if self._follow:
                return False  # its link's loss is queued: batches() reopens it there
            raise
        if isinstance(resp, StreamRequestOk):
            self._accepted(part, resp, sent)
            return False
        if isinstance(resp, StreamRequestRollback):
            self._rollback(part, resp.rollback_seqno)
            return True
        self._opening.pop(part.partition, None)
        assert isinstance(resp, Response)
        if resp.status == Status.NOT_MY_VBUCKET and self._follow:
            self._spawn(self._move(part, resp.value))
            return False
        unknown = resp.status in (Status.UNKNOWN_COLLECTION, Status.UNKNOWN_SCOPE)
        verdict = await self._refilter(part) if unknown and part.filter is not None else ""
        if verdict == "changed":
            return not part.done  # a collection dropped meanwhile: ask without it
        if resp.status == Status.ETMPFAIL or verdict == "behind":
            # a cluster node that restarted serves nothing until its orchestrator turns
            # traffic on (formats/cluster.md §3), and one the newest manifest has not
            # reached yet does not know its collections: ask again shortly
            since = self._tmpfail.setdefault(part.partition, time.monotonic())
            if time.monotonic() - since > self.follow_for:
                why = "ETMPFAIL" if verdict != "behind" else "an older collections manifest"
                raise ConsumerError(
                    f"partition {part.partition}: {part.addr[0]}:{part.addr[1]} "
                    f"refused streams ({why}) for {self.follow_for:g}s"
                )
            self._spawn(self._move(part, delay=0.25))
            return False
        err = status_error(resp.status, body=resp.value, opcode=Opcode.DCP_STREAM_REQ)
        what = f" (collections {','.join(map(str, self._paths or []))})" if unknown else ""
        raise ConsumerError(f"partition {part.partition}: stream request refused{what}: {err}")

    async def _refilter(self, part: _Part) -> str:
        """A stream refused for an unknown collection or scope, judged by the node's
        manifest now: "behind" (it has not received the newest manifest the consumer
        knows), "changed" (what it no longer has was dropped: it leaves the partition's
        filter, and its drop is still to be handed over, docs/protocol.md §12.4), or
        "stands" (the manifest explains nothing)."""
        f = part.filter
        assert f is not None
        link = self._links.get(part.addr)
        if link is None or link.session.conn.closed:
            return "stands"
        conn = link.session.conn
        now = self._parse_manifest(
            await conn.request(CollectionsGetManifest(opaque=conn.next_opaque()))
        )
        if now.uid < self._uid:
            return "behind"
        gone = {c for c in f.ids if now.by_id(c) is None}
        scope_gone = f.scope is not None and now.scope_by_id(f.scope) is None
        if not gone and scope_gone == f.gone:
            return "stands"
        f.ids -= gone
        f.gone = scope_gone
        part.pending |= gone
        part.catchup = None  # pinned anew: the drops are below the node's high now
        self._settling.add(part.partition)
        log.info("partition %d: collections dropped since the stream began; filter now %s,"
                 " catching up on %s", part.partition, f.value().decode(),
                 sorted(part.pending))  # fmt: skip
        return "changed"

    def _accepted(self, part: _Part, resp: StreamRequestOk, sent: StreamRequest) -> None:
        """A stream is open: keep its failover log, settle its branch (and, from latest,
        its start), then hand over StreamOpened and the data held for it meanwhile."""
        part.log = FailoverLog.sanitised(resp.failover_log)
        self._stale = True
        started_on = part.uuid  # the branch the start was asked on (0: none yet)
        if part.log.entries:
            if not started_on or part.log.find(started_on) is None:
                started_on = part.log.latest.uuid
            # The source accepted the start, so it lies on its current history, and all
            # that follows is that history: the position's branch is the newest entry.
            # Keeping an older uuid that the log still lists would name a branch that
            # ended below the seqs about to arrive, and the next resume from it would be
            # answered ROLLBACK (docs/design.md "Positions").
            part.uuid = part.log.latest.uuid
        if self.from_latest and part.seq == 0:
            part.seq = part.snap_start = part.snap_end = self.highs.get(part.partition, 0)
            part.uuid = part.log.latest.uuid if part.log.entries else 0
        # where the stream starts (not where held data already moved it)
        start = StreamPosition(part.partition, started_on, sent.start_seqno,
                               sent.snap_start_seqno, sent.snap_end_seqno)  # fmt: skip
        if self.from_latest and sent.start_seqno == 0:
            start = part.position()
        self._tmpfail.pop(part.partition, None)
        self._events.append(StreamOpened(part.partition, resp.failover_log, start))
        self._events.extend(self._held.pop(part.partition, []))
        self._opening.pop(part.partition, None)
        log.debug("partition %d: stream open from %d on %s:%d",
                  part.partition, sent.start_seqno, *part.addr)  # fmt: skip

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

    async def _move(self, part: _Part, body: bytes = b"", delay: float = 0.05) -> None:
        """Reopen a partition on the node the newest map names its active (a rebalance
        or failover moved it); waits up to `follow_for` seconds for such a map."""
        p = part.partition
        if p in self._moving:
            return
        self._moving.add(p)
        retry = self._following(delay).start()
        try:
            await retry.wait()  # a map being changed: give it a moment
            while True:
                await self._refresh_map(body)
                body = b""
                actives = self._actives()
                addr = actives[p] if p < len(actives) else None
                if addr is not None:
                    try:
                        await self._link(addr)
                        part.addr = addr
                        if p in self.waiting:  # never pinned: no high, no start yet
                            if await self._pin_highs([part]):
                                raise ConsumerError(f"{addr[0]}:{addr[1]} is not active yet")
                            await self._settle_start(part)
                            self.waiting.discard(p)
                        elif self.until_end and await self._cap_ends([part]):
                            # the new active may hold less than the end pinned
                            raise ConsumerError(f"{addr[0]}:{addr[1]} is not active yet")
                        # Opened even when nothing is left to send: only the new
                        # active's producer rule says whether what was streamed is
                        # still its history (a hard failover: ROLLBACK,
                        # docs/protocol.md §4.2).
                        log.info("partition %d: streaming from %s:%d", p, *addr)
                        self._moving.discard(p)
                        await self._open_streams([part])
                        self._queue.put_nowait((addr, -1, [], 0))  # wake batches()
                        return
                    except (ConnectionError_, OSError, UprError) as exc:
                        log.info("partition %d: %s:%d unusable: %s", p, *addr, exc)
                if retry.spent:
                    stuck = sorted(self.waiting) if p in self.waiting else [p]
                    more = f",… {len(stuck) - 8} more" if len(stuck) > 8 else ""
                    shown = ",".join(map(str, stuck[:8])) + more
                    raise ConsumerError(
                        f"partition{'s' if len(stuck) > 1 else ''} {shown}: no reachable "
                        f"active node for {self.follow_for:g}s"
                    )
                await retry.wait()
        except (ConsumerError, ConnectionError_) as exc:
            self._queue.put_nowait(exc)
        finally:
            self._moving.discard(p)

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

    @staticmethod
    def _begin_stream(part: _Part) -> None:
        """A stream of `part` is requested from where it stands: what arrives from now on
        belongs to it. Boundaries an earlier stream passed above that point are not this
        stream's (it may deduplicate differently across them), so they go."""
        part.marked = False
        if part.bounds and part.bounds[-1] > part.seq:
            part.bounds = [b for b in part.bounds if b <= part.seq]

    def _rollback(self, part: _Part, r: int) -> None:
        """ROLLBACK(r): go back to the newest boundary b ≤ r the caller reached, take the
        newest log entry with seq ≤ b, prune above b, restart from (b, b, b)
        (docs/design.md, "Snapshot boundaries")."""
        previous = part.position()
        b = boundary_at(self._boundaries(part), r)
        entry = part.log.entry_at(b)
        part.log = part.log.prune_above(b)
        # Without a kept log, stay on the position's branch: the server bounded r by it.
        uuid = entry.uuid if entry is not None else previous.uuid
        part.uuid, part.seq, part.snap_start, part.snap_end = uuid, b, b, b
        self._stale = True
        part.bounds = [x for x in part.bounds if x < b] + [b]
        self._unforget(part, b)
        if part.partition in self._bounds:  # the caller's: those above b are gone with it
            self._bounds[part.partition] = [x for x in self._bounds[part.partition] if x <= b]
        self._committed[part.partition] = (part.uuid, part.seq, part.snap_start, part.snap_end)
        self._events.append(Rollback(part.partition, previous, b, uuid, r))
        if b < r:
            log.info("partition %d: rollback from %d to %d (asked %d, inside a snapshot)",
                     part.partition, previous.seq, b, r)  # fmt: skip
        else:
            log.info("partition %d: rollback from %d to %d", part.partition, previous.seq, b)

    def _unforget(self, part: _Part, b: int) -> None:
        """A rollback to b takes back the drops above it: they come again, and those
        already forgotten can no longer be asked for by id, so the partition catches up
        unfiltered on them (docs/protocol.md §12.4)."""
        part.delivered = [c for c in part.delivered if c.seq <= b]
        back = {cid for cid, seq in part.forgotten.items() if seq > b}
        if back:
            for cid in back:
                del part.forgotten[cid]
            part.pending |= back
            part.catchup = None
            self._settling.add(part.partition)

    def _boundaries(self, part: _Part) -> list[int]:
        """The boundaries a partition standing where it stands can go back to: the
        caller's and those seen since, at or below its seq, and the position itself when
        it is one."""
        out = [b for b in part.bounds if b <= part.seq]
        out += [b for b in self._bounds.get(part.partition, ()) if b <= part.seq]
        if part.seq == part.snap_end:
            out.append(part.seq)
        return out

    def boundaries(self, partition: int) -> list[int]:
        """Snapshot boundaries of a partition known at or below where it stands now
        (ascending): what a rollback of the caller's sink could go back to."""
        part = self.parts[partition]
        return sorted(set(self._boundaries(part)))

    # -- receiving ------------------------------------------------------------------------

    def _on_server(self, addr: Addr, gen: int, items: ServerItems, nbytes: int) -> None:
        """Reader-task callback: answer NOOPs now, queue the rest (with its byte count)."""
        if Frame not in set(map(type, items)):  # data records alone: no NOOP among them
            self._queue.put_nowait((addr, gen, items, nbytes))
            return
        keep = []
        link = self._links.get(addr)
        for it in items:
            if type(it) is Frame and it.opcode == Opcode.DCP_NOOP:
                if link is not None and link.gen == gen and not link.session.conn.closed:
                    link.session.conn.send_bytes(
                        Response(opcode=Opcode.DCP_NOOP, opaque=it.opaque).encode()
                    )
            else:
                keep.append(it)
        self._queue.put_nowait((addr, gen, keep, nbytes))

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
        if positions is not None:
            self._committed.update(
                {p: (s.uuid, s.seq, s.snap_start, s.snap_end) for p, s in positions.items()}
            )
            self._stale = True  # the caller's positions may differ from where parts stand
        elif self._stale:
            self._committed.update(
                {p: (t.uuid, t.seq, t.snap_start, t.snap_end) for p, t in self.parts.items()}
            )
            self._stale = False
            self._dirty.clear()
        else:  # runs after every batch: only the partitions the batches moved
            parts, committed = self.parts, self._committed
            for p in self._dirty:
                t = parts[p]
                committed[p] = (t.uuid, t.seq, t.snap_start, t.snap_end)
            self._dirty.clear()
        if self._settling:
            self._settle_filters()

    def _settle_filters(self) -> None:
        """Forget the drops the caller committed past, per partition; a catch-up the
        caller committed past is over (its vanished ids' drops were at or below it)."""
        for p in list(self._settling):
            part = self.parts.get(p)
            if part is None or part.filter is None or p not in self._committed:
                self._settling.discard(p)
                continue
            seq = self._committed[p][1]
            left = []
            for change in part.delivered:
                if change.seq > seq:
                    left.append(change)
                    continue
                part.filter.forget(change)
                if change.collection_id is not None:
                    part.pending.discard(change.collection_id)
                    part.forgotten[change.collection_id] = change.seq
            part.delivered = left
            if part.catchup is not None and seq >= part.catchup:
                part.pending.clear()
                part.catchup = None
            if not left and not part.pending:
                self._settling.discard(p)

    def followed(self, partition: int) -> set[int]:
        """The collection ids the caller follows on a partition at its committed
        position: what a later resume passes as `followed_ids` (docs/protocol.md §12.4)."""
        part = self.parts.get(partition)
        if part is None or part.filter is None:
            return set()
        return part.filter.ids | part.pending

    @property
    def filter_emptied(self) -> bool:
        """True when a filter was given and every partition's stream ended because all
        it followed was dropped (FilterEmpty)."""
        return (
            self.filter is not None
            and bool(self.parts)
            and all(
                part.done and part.filter is not None and part.filter.empty and not part.pending
                for part in self.parts.values()
            )
        )

    @property
    def committed(self) -> dict[int, StreamPosition]:
        """The positions the caller committed; a reconnect resumes from these."""
        return {p: StreamPosition(p, *t) for p, t in self._committed.items()}

    @property
    def finished(self) -> bool:
        """True once every partition's finite stream has ended and been handed over.

        A stream being opened is not finished even when its end already arrived: the
        data and the end it sent are held until its StreamOpened is handed over
        (`_accepted`), which may run after `batches()` decoded them."""
        return (not self._moving and not self._opening and not self._held
                and all(p.done for p in self.parts.values()))  # fmt: skip

    async def batches(self) -> AsyncIterator[list[Item]]:
        """Rows and events in wire order, batch by batch, until every stream ended."""
        attempts: dict[Addr, int] = {}
        while True:
            if self._events:
                events, self._events = self._events, []
                yield events
            if self.finished:
                return
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                # that arrives as the queue yields (the task then never stops)
                async with asyncio.timeout(self.dead_after):
                    got = await self._queue.get()
            except TimeoutError:
                got = _Lost(f"no message for {self.dead_after:g}s: connection presumed dead")
            if isinstance(got, _Lost):
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
            if self._events:  # a stream opened while we waited: its StreamOpened first
                events, self._events = self._events, []
                yield events
            out = self._process(items, addr) if items else []
            if out:
                yield out
                attempts[addr] = 0
            self._ack(link, nbytes)

    def _ack(self, link: _Link, nbytes: int) -> None:
        """Acknowledge consumed bytes once a fifth of the window is pending.

        The window and the acknowledgements are docs/protocol.md §7.1.
        """
        link.unacked += nbytes
        if link.unacked >= self.buffer_size // 5 and not link.session.conn.closed:
            link.session.conn.send_bytes(BufferAck(acked=link.unacked).encode())
            link.unacked = 0

    def _process(self, items: ServerItems, addr: Addr | None = None) -> list[Item]:
        out = self._decode(items)
        if self._opening and out:
            opening = {p for p, a in self._opening.items() if a == addr}
            if opening:
                keep: list[Item] = []
                for it in out:
                    p = it.vbucket if type(it) is DcpRecord else getattr(it, "partition", None)
                    if p in opening:
                        self._held.setdefault(p, []).append(it)
                    else:
                        keep.append(it)
                out = keep
        return out

    def _decode(self, items: ServerItems) -> list[Item]:
        # The hot path: a data record costs a dict lookup and an attribute store (its
        # fields by index, not by name); a record whose value is compressed or carries
        # xattrs is noted and made plain with the rest of its batch (`plain_records`).
        parts, dirty = self.parts, self._dirty
        record, coded_bits, filtered = DcpRecord, _CODED, self.filter is not None
        out: list[Item] = []
        append = out.append
        coded: list[int] = []
        last = None  # the partition of the run of records going on
        for it in items:
            if type(it) is record:
                part = parts.get(it[R_VBUCKET])
                if part is not None:
                    part.seq = it[R_BY_SEQNO]
                    if part is not last:
                        dirty.add(it[R_VBUCKET])
                        last = part
                    if filtered and part.keep is not None and it[R_COLLECTION] not in part.keep:
                        continue  # catching up unfiltered: not a collection it follows
                if it[R_DATATYPE] & coded_bits:
                    coded.append(len(out))
                append(it)
                continue
            frame = cast(Frame, it)
            if frame.opcode == Opcode.DCP_SYSTEM_EVENT and frame.magic == Magic.REQUEST:
                self._system_frame(frame, out)  # many (one per collection and partition):
                continue  # struct, not the typed message path
            msg = decode_message(frame)
            if isinstance(msg, Barrier):
                try:
                    cut = json.loads(msg.value)["cut"]
                    out.append(BarrierReached(msg.cookie, {int(p): int(s) for p, s in cut.items()}))
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise RemoteProtocolError("malformed barrier cut") from None
                continue
            vb = getattr(msg, "vbucket", -1)
            part = parts.get(vb)
            if part is None:
                continue
            dirty.add(vb)
            if isinstance(msg, SnapshotMarker | SnapshotMarkerV2):
                if part.marked or part.seq == part.snap_end:
                    # the snapshot before is complete: the caller's state at its end (or
                    # at the start position) is one the source had
                    end = part.snap_end if part.marked else part.seq
                    if not part.bounds or part.bounds[-1] < end:
                        part.bounds.append(end)
                        if len(part.bounds) > 2 * KEEP_BOUNDARIES:  # bounded memory
                            del part.bounds[:-KEEP_BOUNDARIES]
                part.marked = True
                part.snap_start, part.snap_end = msg.start_seqno, msg.end_seqno
                link = self._links.get(part.addr)
                if msg.flags & MARKER_ACK and link is not None:
                    link.session.conn.send_bytes(
                        Response(opcode=Opcode.DCP_SNAPSHOT_MARKER, opaque=msg.opaque).encode()
                    )
                out.append(Snapshot(vb, msg.start_seqno, msg.end_seqno, msg.flags))
            elif isinstance(msg, SeqnoAdvanced):
                part.seq = msg.by_seqno
            elif isinstance(msg, SystemEvent):  # with a stream id (flexible framing)
                part.seq = msg.by_seqno
                change = self._system_event(part, msg.by_seqno, msg.event, msg.version,
                                            bytes(msg.key), bytes(msg.value))  # fmt: skip
                if change is not None and self._hand_over(part, change):
                    out.append(change)
            elif isinstance(msg, StreamEnd):
                if self._caught_up(part, msg.status):
                    self._spawn(self._reopen(part))
                    continue
                out.append(StreamEnded(vb, msg.status, part.position()))
                if msg.status in (END_OK, END_CLOSED, END_FILTER_EMPTY) or (
                    self.until_end and part.seq >= part.end
                ):
                    part.done = True
                else:
                    log.info("partition %d: stream ended with status %d, reopening", vb, msg.status)
                    self._spawn(self._reopen(part))
        if coded:
            plain_records(out, coded)
        return out

    def _system_frame(self, frame: Frame, out: list[Item]) -> None:
        """A classic DCP_SYSTEM_EVENT frame: extras u64 seq, u32 event, u8 version
        (docs/protocol.md §2.15)."""
        if len(frame.extras) != _SYSTEM_EXTRAS.size:
            raise RemoteProtocolError(
                f"opcode 0x5f: extras length {len(frame.extras)}, expected {_SYSTEM_EXTRAS.size}"
            )
        part = self.parts.get(frame.vbucket_or_status)
        if part is None:
            return
        seq, event, version = _SYSTEM_EXTRAS.unpack(frame.extras)
        part.seq = seq
        self._dirty.add(part.partition)
        change = self._system_event(part, seq, event, version, bytes(frame.key),
                                    bytes(frame.value))  # fmt: skip
        if change is not None and self._hand_over(part, change):
            out.append(change)

    def _system_event(self, part: _Part, seq: int, event: int, version: int, key: bytes,
                      value: bytes) -> ManifestChange | None:  # fmt: skip
        """A system event as a `ManifestChange` (docs/protocol.md "Collections"); None
        for events upr does not use (a collection modified, FlatBuffers values)."""
        try:
            change = decode_event(part.partition, seq, event, version, key, value)
        except CollectionsError as exc:
            raise RemoteProtocolError(str(exc)) from None
        if change is None:
            log.debug("partition %d seq %d: system event %d version %d skipped",
                      part.partition, seq, event, version)  # fmt: skip
            return None
        self._uid = max(self._uid, change.manifest_uid)
        return change

    def _hand_over(self, part: _Part, change: ManifestChange) -> bool:
        """Whether a change goes to the caller (a catch-up stream keeps the changes of
        what the partition follows); a drop handed over is forgotten once committed."""
        f = part.filter
        if f is None:
            return True
        keep = part.keep
        if keep is not None:
            cid = change.collection_id
            if cid is not None:
                wanted = cid in keep or (change.kind == "collection-created"
                                         and change.scope_id == f.scope)  # fmt: skip
            else:  # a scope's own events: for a scope filter, its scope or a dropped one's
                wanted = f.scope is not None and (change.scope_id == f.scope or any(
                    d.scope_id == change.scope_id for d in part.delivered))  # fmt: skip
            if not wanted:
                return False
            if cid is not None and change.kind == "collection-created":
                keep.add(cid)
        f.admit(change)
        if change.dropped:
            part.delivered.append(change)
            self._settling.add(part.partition)
        return True

    def _caught_up(self, part: _Part, status: int) -> bool:
        """A catch-up stream reached its catch-up seq before the partition's end: it is
        reopened with its filter, without telling the caller (docs/protocol.md §12.4)."""
        top = part.catchup
        if part.keep is None or status != END_OK or top is None or top >= part.end:
            return False
        part.catchup = min(top, part.seq)  # the end reached: nothing above it was left
        part.keep = None
        return True

    async def _reopen(self, part: _Part) -> None:
        try:
            await self._open_streams([part])
            self._queue.put_nowait((part.addr, -1, [], 0))  # wake batches(): held data
        except ConnectionError_:
            if self._follow:
                await self._move(part)  # its node went away meanwhile: follow the map
            # else the lost link is reconnected by batches(), which reopens the stream
        except ConsumerError as exc:
            self._queue.put_nowait(exc)

    def _reset(self, part: _Part) -> None:
        part.uuid, part.seq, part.snap_start, part.snap_end = self._committed[part.partition]
        self._stale = True
        part.delivered = [c for c in part.delivered if c.seq <= part.seq]  # they come again

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
        committed positions, finite ones with their ends capped (`_cap_ends`). While
        following a map, partitions the newest map moved elsewhere are reopened there
        instead (it may restart or fail over). Returns the attempts made."""
        parts = [
            p for p in self.parts.values()
            if p.addr == addr and not p.done and p.partition not in self._moving
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
            if self._follow:
                with contextlib.suppress(UprError, OSError):
                    await self._refresh_map()
                actives = self._actives()
                for part in list(parts):
                    new = actives[part.partition] if part.partition < len(actives) else None
                    if new is not None and new != addr:
                        parts.remove(part)
                        self._spawn(self._move(part))
                if not parts:
                    self._notice(f"the partitions of {where} moved to other nodes; streaming "
                                 "from there")  # fmt: skip
                    return 0
            try:
                await self._link(addr)
                if self.until_end:
                    for part in await self._cap_ends(parts):  # not active there (a cluster)
                        parts.remove(part)
                        self._spawn(self._move(part))
                await self._open_streams(parts)
            except (ConnectionError_, OSError) as exc:
                reason = str(exc)
                log.info("reconnect failed: %s", exc)
                continue
            self._notice(f"connection to {where} back after {retry.elapsed:.1f}s; streams "
                         "resume where they were committed")  # fmt: skip
            return retry.tries

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
        part = self.parts.get(partition)
        link = self._links.get(part.addr) if part is not None else None
        session = link.session if link is not None else self.session
        assert session is not None
        conn = session.conn
        resp = await conn.request(GetFailoverLog(vbucket=partition, opaque=conn.next_opaque()))
        assert isinstance(resp, FailoverLogResponse)
        return FailoverLog.sanitised(resp.failover_log)


__all__ = ["CollectionFilter", "ConsumerError", "DcpConsumer", "Item", "Status", "resolve_filter"]
