"""Each partition's DCP stream state, without I/O: the consumer's sans-IO core.

Theory of operation (the h11 shape). `DcpConsumer` owns the connections; it feeds every
batch of decoded server items to `Streams.feed`, which returns the rows and events for
the caller, and leaves behind what the consumer must act on: the snapshot markers to
acknowledge on a link (`outbox`) and the partitions whose stream must be reopened
(`reopen`). The stream requests it builds (`request`), the answers it takes (`accepted`,
`rollback`, `refilter`) and the caller's commits (`commit`) are the other inputs. Events
that arise outside a batch (a stream opened, a rollback, a filter emptied) wait in
`events` for the consumer to hand them over first. Nothing here imports asyncio or
`net/`, so the whole of it can be driven by tests alone (tests/dcp/test_streams.py).

Positions advance as items arrive; `commit()` records what the caller made durable, and
a reconnect resumes from there (`reset`). ROLLBACK(r) follows docs/design.md, "Snapshot
boundaries": inside a deduplicated snapshot a seq is not a state the source ever had, so
a partition goes back to r', the newest snapshot boundary at or below r that the caller
reached (the boundaries it passed in, the start position, and every snapshot completed
on a stream since), takes the newest entry of the kept failover log with seq ≤ r',
restarts from (r', r', r') on that uuid, and hands the caller an explicit `Rollback`
event first. A stream that ends for any reason but "end reached", "closed by us" or
"filter empty" (docs/protocol.md §2.6) is reopened from where it stood, unless a finite
stream already reached its end.

Collections (docs/protocol.md §12.4, "Resuming a filter across drops"). Each partition
holds its own copy of the filter and forgets a dropped id once the caller committed past
that partition's drop; a filter that lost every collection ends its stream with
FilterEmpty. A partition whose followed ids the source no longer has streams unfiltered
up to a catch-up seq, keeping what it follows, so that their drops reach the caller.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from upr_cli.collections import (
    CollectionsError,
    CollectionsManifest,
    ManifestChange,
    Path,
    decode_event,
)
from upr_cli.dcp.events import (
    BarrierReached,
    Item,
    Rollback,
    Snapshot,
    StreamEnded,
    StreamOpened,
)
from upr_cli.dcp.filter import StreamFilter, resolve_filter
from upr_cli.errors import RemoteProtocolError
from upr_cli.failover import FailoverLog
from upr_cli.position import StreamPosition, boundary_at
from upr_cli.protocol import Frame, decode_message, snappy, xattrs
from upr_cli.protocol.dcp import (
    END_CLOSED,
    END_FILTER_EMPTY,
    END_OK,
    MARKER_ACK,
    S_ACTIVE_ONLY,
    S_FROM_LATEST,
)
from upr_cli.protocol.decoder import R_BY_SEQNO, R_COLLECTION, R_DATATYPE, R_VBUCKET, DcpRecord
from upr_cli.protocol.header import Magic, Opcode
from upr_cli.protocol.messages import (
    STREAM_FOREVER,
    Barrier,
    Response,
    SeqnoAdvanced,
    SnapshotMarker,
    SnapshotMarkerV2,
    StreamEnd,
    StreamRequest,
    SystemEvent,
)

log = logging.getLogger(__name__)

FLAG_FROM_LATEST = S_FROM_LATEST
# docs/protocol.md §2.2 ActiveVbOnly: a client wants the history of the active copy; a
# replica copy (possibly behind, possibly on another branch) is refused with NOT_MY_VBUCKET.
FLAG_ACTIVE_ONLY = S_ACTIVE_ONLY
_SYSTEM_EXTRAS = struct.Struct(">QIB")  # DCP_SYSTEM_EVENT: seq, event, version
_CODED = snappy.SNAPPY | xattrs.XATTR
#: the newest snapshot boundaries kept per partition beside those the caller passed in: a
#: rollback further back than these lands on the caller's own, or resets the partition
KEEP_BOUNDARIES = 256

Addr = tuple[str, int]


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


@dataclass(slots=True)
class Part:
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
    # 2 * KEEP_BOUNDARIES; `Streams.rollback` takes those at or below where the partition
    # stands, with the caller's), and whether the current stream has sent a marker yet:
    # only then does a new marker complete the snapshot before it.
    bounds: list[int] = field(default_factory=list)
    marked: bool = False
    # Collections (docs/protocol.md §12.4): this partition's filter; the ids the caller
    # followed here that the source no longer has, until the caller committed past
    # their drops or the catch-up seq; the seq up to which it streams unfiltered to find
    # those drops (None: to be pinned); what a catch-up stream hands over (None: all);
    # the drops handed over and not yet committed; the drops committed (id → seq).
    filter: StreamFilter | None = None
    pending: set[int] = field(default_factory=set)
    catchup: int | None = None
    keep: set[int] | None = None
    delivered: list[ManifestChange] = field(default_factory=list)
    forgotten: dict[int, int] = field(default_factory=dict)

    def position(self) -> StreamPosition:
        """Where the partition stands now."""
        return StreamPosition(self.partition, self.uuid, self.seq, self.snap_start, self.snap_end)

    def hand_over(self, change: ManifestChange) -> bool:
        """Whether a change goes to the caller (a catch-up stream keeps the changes of
        what the partition follows); a drop handed over waits to be forgotten."""
        f = self.filter
        if f is None:
            return True
        keep = self.keep
        if keep is not None:
            cid = change.collection_id
            if cid is not None:
                wanted = cid in keep or (change.kind == "collection-created"
                                         and change.scope_id == f.scope)  # fmt: skip
            else:  # a scope's own events: for a scope filter, its scope or a dropped one's
                wanted = f.scope is not None and (change.scope_id == f.scope or any(
                    d.scope_id == change.scope_id for d in self.delivered))  # fmt: skip
            if not wanted:
                return False
            if cid is not None and change.kind == "collection-created":
                keep.add(cid)
        f.admit(change)
        if change.dropped:
            self.delivered.append(change)
        return True

    def settle(self, seq: int) -> bool:
        """The caller committed up to `seq`: forget the drops at or below it; a catch-up
        committed past is over (its vanished ids' drops were at or below it). True when
        nothing is left to settle."""
        assert self.filter is not None
        left = []
        for change in self.delivered:
            if change.seq > seq:
                left.append(change)
                continue
            self.filter.forget(change)
            if change.collection_id is not None:
                self.pending.discard(change.collection_id)
                self.forgotten[change.collection_id] = change.seq
        self.delivered = left
        if self.catchup is not None and seq >= self.catchup:
            self.pending.clear()
            self.catchup = None
        return not left and not self.pending

    def unforget(self, b: int) -> bool:
        """A rollback to b takes back the drops above it: they come again, and those
        already forgotten can no longer be asked for by id, so the partition catches up
        unfiltered on them (docs/protocol.md §12.4). True when some were forgotten."""
        self.delivered = [c for c in self.delivered if c.seq <= b]
        back = {cid for cid, seq in self.forgotten.items() if seq > b}
        for cid in back:
            del self.forgotten[cid]
        if back:
            self.pending |= back
            self.catchup = None
        return bool(back)

    def begin(self) -> None:
        """A stream is requested from where the partition stands: what arrives from now on
        belongs to it. Boundaries an earlier stream passed above that point are not this
        stream's (it may deduplicate differently across them), so they go."""
        self.marked = False
        if self.bounds and self.bounds[-1] > self.seq:
            self.bounds = [b for b in self.bounds if b <= self.seq]


class Streams:
    """The stream state of every partition a consumer streams, fed decoded items."""

    def __init__(
        self,
        *,
        positions: Mapping[int, StreamPosition] | None = None,
        boundaries: Mapping[int, Iterable[int]] | None = None,
        until_end: bool = False,
        end_seqs: Mapping[int, int] | None = None,
        from_latest: bool = False,
        collections: list[Path] | None = None,
        followed_ids: Mapping[int, Iterable[int]] | Iterable[int] | None = None,
    ) -> None:
        self.start = dict(positions or {})
        # the caller's snapshot boundaries per partition, those at or below its start
        self.bounds = {p: sorted(set(b)) for p, b in (boundaries or {}).items()}
        self.until_end = until_end or end_seqs is not None
        self.end_seqs = dict(end_seqs or {})
        self.from_latest = from_latest
        self.parts: dict[int, Part] = {}
        # (uuid, seq, snap_start, snap_end) per partition: plain tuples, since commit()
        # runs after every batch and must stay cheap for 1024 partitions.
        self.committed: dict[int, tuple[int, int, int, int]] = {}
        # the partitions whose position moved since the last commit(): commit() copies
        # those alone, unless a position changed outside the decode path (`stale`)
        self.dirty: set[int] = set()
        self.stale = True
        self.highs: dict[int, int] = {}  # each partition's high seq, as pinned
        self.events: list[Item] = []  # to hand over before the next batch
        self.outbox: list[tuple[Addr, bytes]] = []  # marker acknowledgements to send
        self.reopen: list[Part] = []  # streams to request again
        self.paths = list(collections) if collections else None
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
        self.settling: set[int] = set()
        self.manifest: CollectionsManifest | None = (
            None  # the source's, at open; None: no collections
        )
        self.filter: StreamFilter | None = None
        self.uid = 0  # the newest manifest uid known: at open, then from system events

    # -- set up ---------------------------------------------------------------------

    def resolve(self, manifest: CollectionsManifest | None) -> None:
        """Take the source's manifest (None: no collections) and resolve the filter
        against it. A resume of a filter the caller followed before may find paths
        missing: they were dropped since (their drops may still be to hand over)."""
        self.manifest = manifest
        if manifest is not None:
            self.uid = max(self.uid, manifest.uid)
        lenient = (manifest is not None and self._resuming
                   and any(pos.seq > 0 for pos in self.start.values()))  # fmt: skip
        self.filter = resolve_filter(self.paths, manifest, lenient=lenient)

    def add(self, p: int, addr: Addr, log: FailoverLog | None) -> Part:
        """A partition streamed from the caller's position (or the beginning) on `addr`."""
        pos = self.start.get(p, StreamPosition.beginning(p))
        part = Part(p, pos.uuid, pos.seq, pos.snap_start, pos.snap_end, addr=addr)
        self.bounds[p] = [b for b in self.bounds.get(p, ()) if b <= pos.seq]
        if log is not None:
            part.log = log
        if self.filter is not None:
            part.filter = self.filter.copy()
            if part.seq > 0 and self.manifest is not None:
                # the followed ids whose drops it must still hand over (none from 0: the
                # caller holds nothing of them)
                part.pending = self._vanished(p, self.manifest)
                if part.pending:
                    self.settling.add(p)
        self.parts[p] = part
        return part

    def _vanished(self, p: int, manifest: CollectionsManifest) -> set[int]:
        """The ids the caller followed on partition p that the source no longer has."""
        known = {c.id for _s, c in manifest.collections()}
        return {c for c in self._followed.get(p, self._followed_all) if c not in known}

    def settled(self, part: Part, *, pinned: bool) -> None:
        """A partition set up at open, its high seq `pinned` or still unknown (no active
        node answered yet): its catch-up seq (every drop it lacks is at or below the high
        pinned after the manifest was read) or its planned end, and its start is what a
        reconnect goes back to until a commit."""
        if pinned and part.pending:
            part.catchup = self.highs.get(part.partition, 0)
        elif not pinned and self.until_end:
            part.end = self.end_seqs.get(part.partition, part.end)
        self.committed[part.partition] = (part.uuid, part.seq, part.snap_start, part.snap_end)

    def start_at(self, part: Part, uuid: int, seq: int) -> None:
        """Start a partition at `seq` on branch `uuid` (the commands' start seq)."""
        part.uuid, part.seq = uuid, seq
        part.snap_start = part.snap_end = seq
        self.committed[part.partition] = (part.uuid, part.seq, part.snap_start, part.snap_end)
        self.stale = True

    def pin_end(self, part: Part) -> None:
        """A finite stream's end: `end_seqs` (a planned range) capped at the high seq the
        source holds now; a branch that rolled back below it cannot serve it."""
        high = self.highs.get(part.partition, 0)
        part.end = min(self.end_seqs.get(part.partition, high), high)

    def cap_end(self, part: Part, pinned: int | None) -> None:
        """After a reconnect or a move: the end is the lower of the one pinned at the start
        and the high seq the node holds now (docs/protocol.md §4.5). `pinned` is the high
        held before the node was asked again."""
        p = part.partition
        if pinned is not None:
            self.highs[p] = min(pinned, self.highs[p])
        part.end = min(part.end, self.highs[p])

    def reset(self, part: Part) -> None:
        """Back to the committed position (a reconnect)."""
        part.uuid, part.seq, part.snap_start, part.snap_end = self.committed[part.partition]
        self.stale = True
        part.delivered = [c for c in part.delivered if c.seq <= part.seq]  # they come again

    # -- stream requests ------------------------------------------------------------

    def filter_ended(self, part: Part) -> bool:
        """A partition whose filter lost every collection, with no drop left to hand
        over, ends as the source would end it (FilterEmpty)."""
        f = part.filter
        if f is None or not f.empty or part.pending:
            return False
        part.done = True
        self.events.append(StreamEnded(part.partition, END_FILTER_EMPTY, part.position()))
        return True

    def need_catchup(self, parts: Iterable[Part]) -> list[Part]:
        """The partitions with vanished ids whose catch-up seq is still to be pinned (a
        partition at 0 has none: the caller holds nothing of them)."""
        need = []
        for part in parts:
            if part.pending and part.catchup is None:
                if part.seq == 0:
                    part.pending.clear()
                else:
                    need.append(part)
        return need

    def request(self, part: Part) -> StreamRequest:
        """The STREAM_REQ for a partition from where it stands, on a link that grants
        collections if it has a filter. A partition catching up on vanished ids streams
        unfiltered up to its catch-up seq and keeps only what it follows
        (docs/protocol.md §12.4)."""
        flags = FLAG_ACTIVE_ONLY | (
            FLAG_FROM_LATEST if self.from_latest and part.seq == 0 and not part.uuid else 0
        )
        top = part.catchup
        catching = bool(part.pending) and (top is None or part.seq < top)
        end = min(part.end, top) if catching and top is not None else part.end
        part.keep = None
        if catching and part.filter is not None:
            part.keep = part.filter.ids | part.pending
        value = b"" if catching or part.filter is None else part.filter.value()
        return StreamRequest(
            vbucket=part.partition, opaque=0x1000_0000 + part.partition, flags=flags,
            start_seqno=part.seq, end_seqno=max(end, part.seq), vbucket_uuid=part.uuid,
            snap_start_seqno=part.snap_start, snap_end_seqno=part.snap_end, value=value,
        )  # fmt: skip

    def accepted(
        self, part: Part, failover_log: tuple[tuple[int, int], ...], sent: StreamRequest
    ) -> None:
        """A stream is open: keep its failover log, settle its branch (and, from latest,
        its start), and queue `StreamOpened` with where the stream starts."""
        part.log = FailoverLog.sanitised(failover_log)
        self.stale = True
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
        self.events.append(StreamOpened(part.partition, failover_log, start))

    def rollback(self, part: Part, r: int) -> Rollback:
        """ROLLBACK(r): go back to the newest boundary b ≤ r the caller reached, take the
        newest log entry with seq ≤ b, prune above b, restart from (b, b, b)
        (docs/design.md, "Snapshot boundaries"). The `Rollback` event is queued."""
        previous = part.position()
        b = boundary_at(self._boundaries(part), r)
        entry = part.log.entry_at(b)
        part.log = part.log.prune_above(b)
        # Without a kept log, stay on the position's branch: the server bounded r by it.
        uuid = entry.uuid if entry is not None else previous.uuid
        part.uuid, part.seq, part.snap_start, part.snap_end = uuid, b, b, b
        self.stale = True
        part.bounds = [x for x in part.bounds if x < b] + [b]
        if part.unforget(b):
            self.settling.add(part.partition)
        if part.partition in self.bounds:  # the caller's: those above b are gone with it
            self.bounds[part.partition] = [x for x in self.bounds[part.partition] if x <= b]
        self.committed[part.partition] = (part.uuid, part.seq, part.snap_start, part.snap_end)
        event = Rollback(part.partition, previous, b, uuid, r)
        self.events.append(event)
        return event

    def _boundaries(self, part: Part) -> list[int]:
        """The boundaries a partition standing where it stands can go back to: the
        caller's and those seen since, at or below its seq, and the position itself when
        it is one."""
        out = [b for b in part.bounds if b <= part.seq]
        out += [b for b in self.bounds.get(part.partition, ()) if b <= part.seq]
        if part.seq == part.snap_end:
            out.append(part.seq)
        return out

    def boundaries(self, partition: int) -> list[int]:
        """Snapshot boundaries of a partition known at or below where it stands now
        (ascending): what a rollback of the caller's sink could go back to."""
        return sorted(set(self._boundaries(self.parts[partition])))

    def refilter(self, part: Part, now: CollectionsManifest) -> str:
        """A stream refused for an unknown collection or scope, judged by the node's
        manifest `now`: "behind" (it has not received the newest manifest known),
        "changed" (what it no longer has was dropped: it leaves the partition's filter,
        and its drop is still to be handed over, docs/protocol.md §12.4), or "stands"
        (the manifest explains nothing)."""
        f = part.filter
        assert f is not None
        if now.uid < self.uid:
            return "behind"
        gone = {c for c in f.ids if now.by_id(c) is None}
        scope_gone = f.scope is not None and now.scope_by_id(f.scope) is None
        if not gone and scope_gone == f.gone:
            return "stands"
        f.ids -= gone
        f.gone = scope_gone
        part.pending |= gone
        part.catchup = None  # pinned anew: the drops are below the node's high now
        self.settling.add(part.partition)
        log.info("partition %d: collections dropped since the stream began; filter now %s,"
                 " catching up on %s", part.partition, f.value().decode(),
                 sorted(part.pending))  # fmt: skip
        return "changed"

    # -- receiving --------------------------------------------------------------------

    def feed(self, items: Sequence[DcpRecord | Frame]) -> list[Item]:
        """One batch of server items (data records and frames, in wire order): the rows
        and events for the caller. Marker acknowledgements land in `outbox`, streams to
        request again in `reopen`."""
        # The hot path: a data record costs a dict lookup and an attribute store (its
        # fields by index, not by name); a record whose value is compressed or carries
        # xattrs is noted and made plain with the rest of its batch (`plain_records`).
        parts, dirty = self.parts, self.dirty
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
                self._marker(part, msg)
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
                self._ended(part, msg.status, out)
        if coded:
            plain_records(out, coded)
        return out

    def _marker(self, part: Part, msg: SnapshotMarker | SnapshotMarkerV2) -> None:
        """A snapshot marker: the snapshot before it is complete, and the caller's state
        at its end (or at the start position) is one the source had: a boundary."""
        if part.marked or part.seq == part.snap_end:
            end = part.snap_end if part.marked else part.seq
            if not part.bounds or part.bounds[-1] < end:
                part.bounds.append(end)
                if len(part.bounds) > 2 * KEEP_BOUNDARIES:  # bounded memory
                    del part.bounds[:-KEEP_BOUNDARIES]
        part.marked = True
        part.snap_start, part.snap_end = msg.start_seqno, msg.end_seqno
        if msg.flags & MARKER_ACK:
            ack = Response(opcode=Opcode.DCP_SNAPSHOT_MARKER, opaque=msg.opaque)
            self.outbox.append((part.addr, ack.encode()))

    def _ended(self, part: Part, status: int, out: list[Item]) -> None:
        """A stream end (docs/protocol.md §2.6): "end reached", "closed by us" and "filter
        empty" end the partition, as does a finite stream at its end; any other status is
        a stream to reopen from where it stood. A catch-up stream that reached its
        catch-up seq is reopened with its filter, without telling the caller."""
        if self._caught_up(part, status):
            self.reopen.append(part)
            return
        out.append(StreamEnded(part.partition, status, part.position()))
        if status in (END_OK, END_CLOSED, END_FILTER_EMPTY) or (
            self.until_end and part.seq >= part.end
        ):
            part.done = True
        else:
            log.info("partition %d: stream ended with status %d, reopening",
                     part.partition, status)  # fmt: skip
            self.reopen.append(part)

    def _caught_up(self, part: Part, status: int) -> bool:
        """A catch-up stream reached its catch-up seq before the partition's end
        (docs/protocol.md §12.4)."""
        top = part.catchup
        if part.keep is None or status != END_OK or top is None or top >= part.end:
            return False
        part.catchup = min(top, part.seq)  # the end reached: nothing above it was left
        part.keep = None
        return True

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
        self.dirty.add(part.partition)
        change = self._system_event(part, seq, event, version, bytes(frame.key),
                                    bytes(frame.value))  # fmt: skip
        if change is not None and self._hand_over(part, change):
            out.append(change)

    def _system_event(self, part: Part, seq: int, event: int, version: int, key: bytes,
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
        self.uid = max(self.uid, change.manifest_uid)
        return change

    def _hand_over(self, part: Part, change: ManifestChange) -> bool:
        """Whether a change goes to the caller (`Part.hand_over`); a drop handed over
        is forgotten once committed."""
        if not part.hand_over(change):
            return False
        if change.dropped and part.filter is not None:
            self.settling.add(part.partition)
        return True

    # -- committing -------------------------------------------------------------------

    def commit(self, positions: Mapping[int, StreamPosition] | None = None) -> None:
        """Mark positions durable in the caller's sink (None: where the partitions
        stand); a reconnect resumes from these."""
        if positions is not None:
            self.committed.update(
                {p: (s.uuid, s.seq, s.snap_start, s.snap_end) for p, s in positions.items()}
            )
            self.stale = True  # the caller's positions may differ from where parts stand
        elif self.stale:
            self.committed.update(
                {p: (t.uuid, t.seq, t.snap_start, t.snap_end) for p, t in self.parts.items()}
            )
            self.stale = False
            self.dirty.clear()
        else:  # runs after every batch: only the partitions the batches moved
            parts, committed = self.parts, self.committed
            for p in self.dirty:
                t = parts[p]
                committed[p] = (t.uuid, t.seq, t.snap_start, t.snap_end)
            self.dirty.clear()
        if self.settling:
            self._settle_filters()

    def _settle_filters(self) -> None:
        """Forget the drops the caller committed past, per partition (`Part.settle`)."""
        for p in list(self.settling):
            part = self.parts.get(p)
            if (part is None or part.filter is None or p not in self.committed
                    or part.settle(self.committed[p][1])):  # fmt: skip
                self.settling.discard(p)

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


__all__ = ["KEEP_BOUNDARIES", "Part", "Streams", "plain_records"]
