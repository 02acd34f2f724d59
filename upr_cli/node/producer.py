"""The node's DCP producer: one per connection after DCP_OPEN (docs/protocol.md §2, §4, §7).

Streams (the UPR design specification, "How ep-engine streams a consistent snapshot for a
partition"): a stream first backfills from disk what is at or below the partition's
persisted seq, then follows the write queue in Memory snapshots (0x01). The disk holds one
row per key and the queue one entry per key, so both phases deduplicate. The first marker
carries the requested start, later ones their first item's seq (docs/protocol.md §2.7).

The rule: **every snapshot marker ends at a state the partition had**, so that a client
holding a snapshot whole holds the source's state at its end (the UPR protocol draft,
"Snapshot Markers and Deduplication"; docs/design.md "Snapshot boundaries"), the only
seqs its consumers roll back to. Deduplication makes a snapshot whole only as a whole
deduplicated range: a key written at x ≤ e and again at y > e is held only at y, so an
end e cut out of a range lacks the key's version x. Hence:

* a Disk snapshot (0x06) is ONE read transaction under ONE marker ending at the highest
  seq it read; its rows go out in batches, never under several markers;
* a Memory snapshot takes every queued item after the cursor in one synchronous step
  (the event loop is the queue's only writer) and sends ONE marker ending at the last
  of them, then the items in bounded batches (references to versions the queue already
  held, so memory stays bounded by the queue);
* a replica copy (served to a client that did not ask ActiveVbOnly) holds what its
  active sent, possibly part of a snapshot: its memory snapshots end only on the end of
  one it received whole whose state its queue still holds (`_whole_end`), and its disk
  is streamed only while the state persisted is such an end (`snap_end`, as the flusher
  records it). Until then the stream waits; a replica set dead then ends StateChanged.

A finite stream ends with STREAM_END(OK) after the snapshot that reaches its end seq, so
the client always stops on a snapshot boundary (a consistent cut), possibly past end:
as far as the range the snapshot had to cover whole.

Flow control (docs/protocol.md §7.1): every message but NOOP counts its full size; the
connection stops sending once unacknowledged bytes reach the window and resumes on
BUFFER_ACK.
Streams hand the sender bounded batches, so a client that never acks stalls its
streams without the node's memory growing. Whatever the connection's read loop causes
to be sent and counted (barrier cookies, STREAM_END on CLOSE_STREAM) is sent by a task of
its own: the read loop must never wait for credit, since it alone reads the BUFFER_ACK.

Xattrs (formats/wire.md "Xattrs"): a document stores its blob in front of its body (bit
0x04). A connection opened with IncludeXattrs gets it as stored; any other gets the body
alone with the bit clear. NoValue leaves the blob alone (or nothing), and a deletion
carries its tombstone's system xattrs (its user xattrs too with
IncludeDeletedUserXattrs). The backfill's fast path sends stored rows untouched only
while none has a bit the connection cannot take.

Snappy (formats/wire.md "Snappy"): the node keeps a value as it arrived, compressed or
not. A connection whose HELLO granted Snappy gets the stored bytes and datatype as they
are (with `force_value_compression`, plain values compressed when that makes them
smaller); any other gets every value inflated and the Snappy bit cleared, as kv_engine's
producer does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from bisect import bisect_right
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from upr_cli.collections import DEFAULT_ID, Manifest, ManifestChange, decode_event
from upr_cli.failover import needs_rollback
from upr_cli.net.aio import cancel_and_wait
from upr_cli.node.bucket import Bucket, unpacked
from upr_cli.node.collection_state import UnknownCollectionError, UnknownScopeError
from upr_cli.node.partition import ACTIVE, DEAD, REPLICA, Partition
from upr_cli.node.storage import (
    ROW_DELETED,
    ROW_MUTATION_ARGS,
    ROW_SEQ,
    Backfill,
    DocRow,
    StorageReader,
    StoredRow,
)
from upr_cli.node.sysevents import event_of, is_system_key, system_key
from upr_cli.position import StreamPosition
from upr_cli.protocol import leb128, snappy
from upr_cli.protocol.dcp import (
    END_CLOSED,
    END_FILTER_EMPTY,
    END_OK,
    END_STATE_CHANGED,
    MARKER_DISK_CHECKPOINT,
    MARKER_MEMORY,
    OPEN_DELETE_TIMES,
    OPEN_DELETED_USER_XATTRS,
    OPEN_NO_VALUE,
    OPEN_NO_VALUE_DT,
    OPEN_NOTIFIER,
    OPEN_SKIP_DELETES,
    OPEN_XATTRS,
    S_ACTIVE_ONLY,
    S_CACHE_TRANSFER,
    S_DISK_ONLY,
    S_FROM_LATEST,
    S_IGNORE_PURGED,
    S_KNOWN,
    S_STRICT_UUID,
    S_TAKEOVER,
    S_TO_LATEST,
)  # DCP flags and stream-end statuses (docs/protocol.md §2)
from upr_cli.protocol.dcp import OPEN_PRODUCER as OPEN_PRODUCER  # node/server.py imports it here
from upr_cli.protocol.fast import encode_mutation
from upr_cli.protocol.messages import (
    Barrier,
    Deletion,
    DeletionV2,
    Expiration,
    Noop,
    Response,
    SeqnoAdvanced,
    SnapshotMarker,
    StreamEnd,
    StreamRequest,
    SystemEvent,
)
from upr_cli.protocol.snappy import SNAPPY
from upr_cli.protocol.status import (
    DcpStreamIdInvalid,
    InvalidArguments,
    KeyExists,
    KeyNotFound,
    NotMyVbucket,
    NotSupported,
    OutOfRange,
    Status,
)
from upr_cli.protocol.xattrs import XATTR, join, system_only

log = logging.getLogger(__name__)
_T = TypeVar("_T")

BACKFILLS_PER_CONNECTION = 6  # open disk snapshots per DCP connection
BATCH_ITEMS = 512
BATCH_BYTES = 64 * 1024
BACKFILL_ROWS = 1000
# a batch's bytes (keys and values) by default: the node's share of --memory-limit for
# backfills (an eighth of 192 MiB) over the open backfills of one connection
DEFAULT_BATCH_BYTES = 4 * 1024 * 1024
MIN_NOOP_INTERVAL = 0.1  # connection_manager_interval (docs/protocol.md §2.14)
BARRIER_CONTROL = "upr_barrier_cookies"  # our extension, formats/barrier.md

CONTROL_KEYS = {
    "connection_buffer_size", "enable_noop", "set_noop_interval", "set_priority",
    "supports_cursor_dropping", "supports_cursor_dropping_vulcan", "supports_hifi_MFU",
    "send_stream_end_on_client_close_stream", "enable_expiry_opcode", "enable_stream_id",
    "enable_sync_writes", "consumer_name", "force_value_compression",
    "enable_out_of_order_snapshots", "include_deleted_user_xattrs", "v7_dcp_status_codes",
    "flatbuffers_system_events", "change_streams", "max_marker_version", "backfill_order",
    "cache_transfer", "stream_buffer_size", BARRIER_CONTROL,
}  # fmt: skip


class DcpSender:
    """Serialises a connection's DCP output and enforces the flow-control window."""

    def __init__(self, write: Callable[[bytes], None], drain: Callable[[], object]) -> None:
        self._write = write
        self._drain = drain
        self.window = 0  # 0: flow control off
        self.outstanding = 0
        self._credit = asyncio.Event()
        self._lock = asyncio.Lock()

    async def send(self, msgs: list[bytes]) -> None:
        """Send messages in order, pausing while unacked bytes ≥ window (docs/protocol.md §7.1)."""
        async with self._lock:
            await self._send_locked(msgs)

    async def send_made(self, make: Callable[[], list[bytes]]) -> None:
        """Wait until the window has room, then encode the messages (`make`) and send
        them: the streams of a connection waiting for its window hold their items, not
        encoded copies of them (measured: a cluster node replicating 5 MiB documents
        held 16 such copies, 84 MB, one per stream)."""
        async with self._lock:
            while self.window and self.outstanding >= self.window:
                self._credit.clear()
                await self._credit.wait()
            await self._send_locked(make())

    async def _send_locked(self, msgs: list[bytes]) -> None:
        i, n = 0, len(msgs)
        while i < n:
            if self.window and self.outstanding >= self.window:
                self._credit.clear()
                await self._credit.wait()
                continue
            j = i
            while j < n and (not self.window or self.outstanding < self.window):
                self.outstanding += len(msgs[j])
                j += 1
            self._write(b"".join(msgs[i:j]) if j - i > 1 else msgs[i])
            i = j
            await self._drain()  # type: ignore[misc]

    def send_uncounted(self, data: bytes) -> None:
        """NOOPs and responses: not counted by flow control."""
        self._write(data)

    def ack(self, nbytes: int) -> None:
        """BUFFER_ACK: release credit."""
        self.outstanding = max(0, self.outstanding - nbytes)
        if not self.window or self.outstanding < self.window:
            self._credit.set()

    def set_window(self, nbytes: int) -> None:
        """CONTROL connection_buffer_size."""
        self.window = nbytes
        self.ack(0)


@dataclass(slots=True)
class PendingBarrier:
    """A barrier cookie waiting until every recorded partition passed its point.

    `points`: per partition streamed when the cookie arrived, its high seqno then. `cut`:
    per partition settled so far, the end of the first whole snapshot sent at or past the
    point (or what its stream had sent whole when it ended). It is never the point itself:
    deduplication may have sent the point's key only later, at its newest seq.
    """

    cookie: bytes
    opaque: int
    points: dict[int, int]
    cut: dict[int, int] = field(default_factory=dict)


# The system row of the default collection: a stream without collections ends when it
# is dropped, and looks at no other system row.
_DEFAULT_EVENT_KEY = system_key(ManifestChange(0, 0, "collection-dropped", 0, 0, DEFAULT_ID))
_HEX_ID = re.compile(r"[0-9a-fA-F]{1,8}")  # a u32 scope or collection id
_HEX_UID = re.compile(r"[0-9a-fA-F]{1,16}")  # a u64 manifest uid


class StreamView:
    """What one stream shows of its partition's rows: which collections, with which keys,
    and which system events (formats/wire.md "Collections on DCP", after kv_engine's
    DCP filter).

    `ids` None is the whole bucket (a collections connection without a filter); else the
    collection ids the stream sends, which system events update: a scope filter takes in
    the collections created in its scope, a drop takes one out. Rows of a collection the
    bucket's manifest no longer holds are never sent (their purge is lazy). A connection
    without collections sees the default collection only, keys without their 0x00
    prefix, and no system event; `ended` once nothing of the filter is left.
    """

    __slots__ = ("_bucket", "_live", "_manifest", "collections", "ended", "ids", "last_sent",
                 "scope", "scope_dropped")  # fmt: skip

    def __init__(self, bucket: Bucket, *, collections: bool, ids: set[int] | None = None,
                 scope: int | None = None) -> None:  # fmt: skip
        self._bucket = bucket
        self.collections = collections
        self.ids = ids
        self.scope = scope
        self.scope_dropped = False
        self.ended = False
        self.last_sent = 0  # the seq of the last item sent (SEQNO_ADVANCED when below an end)
        self._manifest: Manifest | None = None
        self._live: frozenset[int] = frozenset()

    def live(self) -> frozenset[int]:
        """The ids of the collections the bucket's manifest holds now."""
        manifest = self._bucket.manifest
        if manifest is not self._manifest:
            self._live = frozenset(c.id for _, c in manifest.collections())
            self._manifest = manifest
        return self._live

    def plain_ids(self) -> frozenset[int]:
        """The one-byte collection ids (the first key byte) whose rows this stream sends."""
        live = self.live()
        return frozenset(i for i in (live if self.ids is None else live & self.ids) if i < 0x80)

    def data_key(self, key: bytes) -> bytes | None:
        """The key a document row goes out with, or None if this stream does not send it."""
        cid, rest = leb128.split_key(key)
        if cid not in self.live() or (self.ids is not None and cid not in self.ids):
            return None
        return key if self.collections else bytes(rest)

    def hides_all(self, docs: list[DocRow]) -> bool:
        """True if a stream without collections has nothing in `docs` to look at."""
        return not self.collections and not any(
            d.key[0] == DEFAULT_ID or d.key == _DEFAULT_EVENT_KEY for d in docs
        )

    def event(self, vb: int, opaque: int, doc: DocRow) -> bytes | None:
        """The SYSTEM_EVENT of a system row, or None if this stream does not send it."""
        event, version, name, value = event_of(doc.flags, doc.expiry, doc.value)
        change = decode_event(vb, doc.seq, event, version, name, value)
        # an event upr does not model goes to unfiltered collections streams only
        send = self._admit(change) if change else self.collections and self.ids is None
        if self.ids is not None and (self.scope_dropped if self.scope is not None
                                     else not self.ids):  # fmt: skip
            self.ended = True
        if not send:
            return None
        return SystemEvent(vbucket=vb, opaque=opaque, by_seqno=doc.seq, event=event,
                           version=version, key=name, value=value).encode()  # fmt: skip

    def _admit(self, change: ManifestChange) -> bool:
        """Update the filter for a change; True if the stream sends its event."""
        cid, sid, ids = change.collection_id, change.scope_id, self.ids
        removed = cid is not None and change.dropped and ids is not None and cid in ids
        if removed:
            assert ids is not None and cid is not None
            ids.discard(cid)
        if cid is None and change.dropped and sid == self.scope:
            self.scope_dropped = True
        if not self.collections:
            return False
        if cid is None:  # a scope's own event: to its scope filter and unfiltered streams
            return ids is None or sid == self.scope
        if ids is None or removed:
            return True
        if sid == self.scope:  # a collection of the filtered scope: created ones join
            if not change.dropped:
                ids.add(cid)
            return True
        return cid in ids


def _hex(value: object, what: str, form: re.Pattern[str]) -> int:
    if not isinstance(value, str) or not form.fullmatch(value):
        raise InvalidArguments(f"stream-request value: {what} must be a hex string, got {value!r}")
    return int(value, 16)


def stream_view(bucket: Bucket, collections: bool, value: bytes) -> StreamView:
    """The view a STREAM_REQ value asks for (kv_engine's stream-request-value.md):
    EINVAL, UnknownCollection, UnknownScope or DCP_STREAMID_INVALID if it cannot be
    served."""
    manifest = bucket.manifest
    if not collections:
        if value:
            raise InvalidArguments("a stream-request value needs HELLO Collections")
        if manifest.by_id(DEFAULT_ID) is None:
            raise UnknownCollectionError("the _default collection was dropped", manifest.uid)
        return StreamView(bucket, collections=False, ids={DEFAULT_ID})
    if not value:
        return StreamView(bucket, collections=True)
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArguments("the stream-request value is not JSON") from None
    if not isinstance(doc, dict):
        raise InvalidArguments("the stream-request value must be a JSON object")
    if "sid" in doc:
        raise DcpStreamIdInvalid("stream-ids are not enabled on this connection")
    # Checked, then only logged: kv_engine's filter no longer uses the uid (neither to
    # leave out events at or below it nor to refuse one ahead of the node's), since a
    # resumed stream sends nothing at or below its start anyway (formats/wire.md
    # "Collections on DCP", point 4).
    uid = _hex(doc["uid"], "uid", _HEX_UID) if "uid" in doc else None
    if uid is not None:
        log.debug("stream request with manifest uid %x (the node's: %x)", uid, manifest.uid)
    purge = doc.get("purge_seqno")  # read and checked, not used: markers are v1
    if purge is not None and not (isinstance(purge, str) and purge.isdigit()):
        raise InvalidArguments("stream-request value: purge_seqno must be a decimal string")
    if "scope" in doc and "collections" in doc:
        raise InvalidArguments("stream-request value: give scope or collections, not both")
    if "scope" in doc:
        sid = _hex(doc["scope"], "scope", _HEX_ID)
        scope = manifest.scope_by_id(sid)
        if scope is None:
            raise UnknownScopeError(f"no scope with id {sid:x}", manifest.uid)
        ids = {c.id for c in scope.collections}
        return StreamView(bucket, collections=True, ids=ids, scope=sid)
    if "collections" in doc:
        wanted = doc["collections"]
        if not isinstance(wanted, list) or not wanted:
            raise InvalidArguments("stream-request value: collections must be a non-empty array")
        ids = {_hex(c, "a collection id", _HEX_ID) for c in wanted}
        for cid in sorted(ids):
            if manifest.by_id(cid) is None:
                raise UnknownCollectionError(f"no collection with id {cid:x}", manifest.uid)
        return StreamView(bucket, collections=True, ids=ids)
    if uid is None and purge is None:
        raise InvalidArguments("stream-request value: no uid, scope or collections")
    return StreamView(bucket, collections=True)


@dataclass(slots=True)
class StreamSpec:
    """What a STREAM_REQ asked for, after the docs/protocol.md §4.1 adjustments."""

    vbucket: int
    opaque: int
    flags: int
    start: int
    end: int
    uuid: int
    snap_start: int
    snap_end: int
    view: StreamView


class DcpProducer:
    """DCP state of one connection: open flags, controls, streams, noop, flow control."""

    def __init__(
        self,
        bucket: Bucket,
        name: str,
        flags: int,
        sender: DcpSender,
        backfill_pool: ThreadPoolExecutor,
        backfill_slots: asyncio.Semaphore,
        on_fatal: Callable[[str], None],
        idle_timeout: float,
        *,
        collections: bool = False,
        snappy: bool = False,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        self.bucket = bucket
        self.name = name
        self.flags = flags
        # HELLO Collections was granted: keys go out with their collection id, system
        # events are sent, and a stream request may carry a filter (formats/wire.md
        # "Collections on DCP")
        self.collections = collections
        # HELLO Snappy was granted: values may go out compressed (formats/wire.md "Snappy")
        self.snappy = snappy
        self.force_compression = False
        # Xattrs (formats/wire.md "Xattrs"): sent with IncludeXattrs only; a deletion's
        # user xattrs only with IncludeDeletedUserXattrs too
        self.xattrs = bool(flags & OPEN_XATTRS)
        self.deleted_user_xattrs = bool(flags & OPEN_DELETED_USER_XATTRS)
        self._hidden_bits = (0 if snappy else SNAPPY) | (0 if self.xattrs else XATTR)
        self.sender = sender
        self.streams: dict[int, asyncio.Task[None]] = {}
        self.specs: dict[int, StreamSpec] = {}
        self.controls: dict[str, str] = {}
        self.noop_enabled = False
        self.noop_interval = 1.0
        self.idle_timeout = idle_timeout
        self.last_received = time.monotonic()
        self._noop_task: asyncio.Task[None] | None = None
        self._noop_opaque = 0x7FFF_0000
        self._pool = backfill_pool
        self._slots = backfill_slots  # server-wide: concurrent SQLite reads
        self._own = asyncio.Semaphore(BACKFILLS_PER_CONNECTION)  # open backfills (snapshots)
        # what one stream reads from disk (or encodes from the queue) at a time, in keys
        # and values: each open backfill holds at most one such batch while it waits for
        # flow-control credit
        self.batch_bytes = batch_bytes
        self._readers: list[StorageReader] = []  # idle read connections, reused
        self._on_fatal = on_fatal
        # Barrier cookies (formats/barrier.md): pending cookies in arrival order, and per
        # partition the end of the last snapshot sent whole after which the client holds a
        # state the partition had (the stream's start until then).
        self.barriers_enabled = False
        self._barriers: list[PendingBarrier] = []
        self._barrier_task: asyncio.Task[None] | None = None  # sends settled cookies back
        self.sent_end: dict[int, int] = {}
        # STREAM_END(Closed) of the streams the client closed, being sent (`close_stream`),
        # and per partition the newest of them (a new stream of it waits for that one)
        self._ends: dict[int, asyncio.Task[None]] = {}
        self._end_tasks: set[asyncio.Task[None]] = set()

    # -- controls -----------------------------------------------------------------

    def control(self, key: str, value: str) -> None:
        """DCP_CONTROL (docs/protocol.md §2.14): unknown keys or invalid values raise EINVAL."""
        if key not in CONTROL_KEYS:
            raise InvalidArguments(f"unknown DCP control key {key!r}")
        v = value.strip()
        if key == "connection_buffer_size":
            if not v.isdigit():
                raise InvalidArguments("connection_buffer_size must be a decimal byte count")
            self.sender.set_window(int(v))
        elif key == "enable_noop":
            if v not in ("true", "false"):
                raise InvalidArguments("enable_noop takes true or false")
            self.noop_enabled = v == "true"
            self._restart_noop()
        elif key == "set_noop_interval":
            try:
                secs = float(v)
            except ValueError:
                raise InvalidArguments("set_noop_interval takes seconds") from None
            if not secs >= MIN_NOOP_INTERVAL:
                raise InvalidArguments(f"set_noop_interval must be >= {MIN_NOOP_INTERVAL}")
            self.noop_interval = secs
            self._restart_noop()
        elif key == "set_priority":
            if v not in ("high", "medium", "low"):
                raise InvalidArguments("set_priority takes high, medium or low")
        elif key == "enable_expiry_opcode":
            if v != "true" or not self.flags & OPEN_DELETE_TIMES:
                raise InvalidArguments("enable_expiry_opcode needs DCP_OPEN IncludeDeleteTimes")
        elif key in ("stream_buffer_size", "cache_transfer", "change_streams", "enable_stream_id",
                     "flatbuffers_system_events"):  # fmt: skip
            # system events go out as versions 0 and 1 only (formats/wire.md
            # "Collections on DCP")
            raise NotSupported(f"{key} is not supported by upr serve")
        elif key == "force_value_compression":
            if not self.snappy:
                raise InvalidArguments(f"{key} needs HELLO Snappy on this connection")
            if v not in ("true", "false"):
                raise InvalidArguments(f"{key} takes true or false")
            self.force_compression = v == "true"
        elif key == "include_deleted_user_xattrs":
            # a probe (kv_engine's producer): true only where DCP_OPEN asked for them
            if v != "true" or not self.flags & OPEN_DELETED_USER_XATTRS:
                raise InvalidArguments(f"{key} needs DCP_OPEN IncludeDeletedUserXattrs")
        elif key == "max_marker_version":
            raise InvalidArguments(f"{key} needs a feature this connection did not negotiate")
        elif key == "backfill_order":
            if v not in ("round-robin", "sequential"):
                raise InvalidArguments("backfill_order takes round-robin or sequential")
        elif key == BARRIER_CONTROL:
            if v != "true":
                raise InvalidArguments(f"{BARRIER_CONTROL} takes true")
            self.barriers_enabled = True
        elif key != "consumer_name" and v not in ("true", "true_with_seqno_advanced"):
            raise InvalidArguments(f"{key} takes true")
        self.controls[key] = v

    def _restart_noop(self) -> None:
        if self._noop_task is not None:
            self._noop_task.cancel()
            self._noop_task = None
        if self.noop_enabled:
            self._noop_task = asyncio.get_running_loop().create_task(self._noop_loop())

    async def _noop_loop(self) -> None:
        """Send NOOPs, which flow control does not count; disconnect an idle peer.

        As docs/protocol.md §2.12 and §7.2 describe.
        """
        while True:
            await asyncio.sleep(self.noop_interval)
            if time.monotonic() - self.last_received > self.idle_timeout:
                self._on_fatal(f"DCP peer idle for more than {self.idle_timeout:g}s")
                return
            self._noop_opaque = (self._noop_opaque + 1) & 0xFFFFFFFF
            self.sender.send_uncounted(Noop(opaque=self._noop_opaque).encode())

    # -- streams --------------------------------------------------------------------

    def stream_request(self, req: StreamRequest) -> tuple[StreamSpec, tuple[tuple[int, int], ...]]:
        """The checks of docs/protocol.md §4.1 in order; returns the stream and the failover log.

        Raises a status error, or RollbackRequired carrying the seq in its message via
        `RollbackTo`.
        """
        vb, flags = req.vbucket, req.flags
        if flags & ~S_KNOWN or flags & 0x08:
            raise InvalidArguments(f"unknown stream flags 0x{flags:x}")
        if flags & (S_TAKEOVER | S_CACHE_TRANSFER):
            raise NotSupported("takeover and cache-transfer streams are not supported")
        # 1. the partition and its state
        part = self.bucket.partitions.get(vb)
        allowed = (ACTIVE,) if flags & S_ACTIVE_ONLY else (ACTIVE, REPLICA)
        if part is None or part.state not in allowed:
            raise NotMyVbucket(f"partition {vb} cannot be streamed here")
        # 2. FromLatest
        high = part.high_seq
        start, end, uuid = req.start_seqno, req.end_seqno, req.vbucket_uuid
        snap_start, snap_end = req.snap_start_seqno, req.snap_end_seqno
        if flags & S_FROM_LATEST:
            start = snap_start = snap_end = high
            uuid = uuid or part.uuid
        # 3. noop is mandatory with xattrs or collections
        if (self.flags & OPEN_XATTRS or self.collections) and not self.noop_enabled:
            raise NotSupported("IncludeXattrs and collections streams need enable_noop=true")
        # 4-5. ranges
        if start > end:
            raise OutOfRange(f"start {start} > end {end}")
        if not snap_start <= start <= snap_end:
            raise OutOfRange(f"snapshot [{snap_start}, {snap_end}] does not contain start {start}")
        # 6. the value: a collections filter, only on a collections connection
        if req.stream_id is not None:
            raise DcpStreamIdInvalid("stream-ids are not enabled on this connection")
        view = stream_view(self.bucket, self.collections, req.value)
        # 7. an active stream for this partition already exists
        task = self.streams.get(vb)
        if task is not None and not task.done():
            raise KeyExists(f"a stream for partition {vb} is already open")
        # 8. the producer rule (docs/protocol.md §4.2)
        decision = needs_rollback(
            part.failover, StreamPosition(vb, uuid, start, snap_start, snap_end),
            high=high, purge_seq=0 if flags & S_IGNORE_PURGED else part.purge_seq,
            strict=bool(flags & S_STRICT_UUID),
        )  # fmt: skip
        if decision.rollback:
            raise RollbackTo(decision.rollback_seq)
        # 9-10. end adjustments and the final range checks
        if flags & S_TO_LATEST:
            end = high
        elif flags & S_DISK_ONLY:
            end = part.persisted_seq
        if start > end:
            raise OutOfRange(f"start {start} > end {end}")
        if start > high:
            raise OutOfRange(f"start {start} > high seqno {high}")
        spec = StreamSpec(vb, req.opaque, flags, start, end, uuid, snap_start, snap_end, view)
        return spec, part.failover.pairs()

    def register_barrier(self, cookie: bytes, opaque: int) -> None:
        """Note a cookie and, per open stream, the partition's high seqno now (its point)."""
        if not 1 <= len(cookie) <= 250:
            raise InvalidArguments("a barrier cookie has 1 to 250 bytes")
        if any(b.cookie == cookie for b in self._barriers):
            raise InvalidArguments("this barrier cookie is already pending")
        points = {
            vb: self.bucket.partitions[vb].high_seq for vb, task in self.streams.items()
            if not task.done()
        }  # fmt: skip
        b = PendingBarrier(cookie, opaque, points)
        for vb, point in points.items():
            if self.sent_end[vb] >= point:  # caught up: the client holds that state already
                b.cut[vb] = self.sent_end[vb]
        self._barriers.append(b)
        self._release_barriers()

    def _sent_whole(self, vb: int, end: int) -> None:
        """The stream of `vb` sent a snapshot ending at `end` whole, and the client now holds
        a state the partition had at `end`: settle the cookies whose point it reaches.

        Called as soon as the snapshot's last message went to the sender, before any await,
        so a cookie sent later follows every row up to its cut on the connection.
        """
        self.sent_end[vb] = end
        for b in self._barriers:
            point = b.points.get(vb)
            if point is not None and vb not in b.cut and end >= point:
                b.cut[vb] = end
        self._release_barriers()

    def _stream_gone(self, vb: int) -> None:
        """The stream of `vb` ended or was closed: it holds no cookie back any longer; its
        cut is what it had sent whole (before a new stream of `vb` resets `sent_end`)."""
        for b in self._barriers:
            if vb in b.points and vb not in b.cut:
                b.cut[vb] = self.sent_end[vb]
        self._release_barriers()

    def _release_barriers(self) -> None:
        """Have the settled cookies at the head of the queue sent back, in arrival order.

        A task of their own sends them: a cookie counts for flow control, and waiting for
        credit would stall the caller, which may be the connection's read loop (BARRIER,
        CLOSE_STREAM, STREAM_REQ), the very loop that must read the BUFFER_ACK bringing it.
        """
        if not self._barriers or len(self._barriers[0].cut) < len(self._barriers[0].points):
            return
        if self._barrier_task is None or self._barrier_task.done():
            self._barrier_task = asyncio.get_running_loop().create_task(
                self._send_barriers(), name="barrier cookies"
            )

    async def _send_barriers(self) -> None:
        try:
            while self._barriers and len(self._barriers[0].cut) == len(self._barriers[0].points):
                b = self._barriers.pop(0)
                cut = {str(vb): str(seq) for vb, seq in sorted(b.cut.items())}
                body = json.dumps({"cut": cut}, separators=(",", ":")).encode()
                msg = Barrier(opaque=b.opaque, cookie=b.cookie, datatype=0x01, value=body)
                await self.sender.send([msg.encode()])
        except (ConnectionError, OSError):
            return  # the connection is gone, and its pending cookies with it

    async def check_barriers(self) -> None:
        """Send back, in arrival order, every cookie whose partitions all passed their point
        (without waiting for flow-control credit: `_release_barriers`)."""
        self._release_barriers()

    def start_stream(self, spec: StreamSpec) -> None:
        """Start the stream task (after the SUCCESS response was sent)."""
        if spec.vbucket in self.sent_end:
            self._stream_gone(spec.vbucket)  # the previous stream's task may never have run
        self.sent_end[spec.vbucket] = spec.start
        self.specs[spec.vbucket] = spec
        self.streams[spec.vbucket] = asyncio.get_running_loop().create_task(
            self._run_stream(spec), name=f"stream vb{spec.vbucket}"
        )

    def has_stream(self, vb: int) -> bool:
        """True while a stream for the partition is running."""
        task = self.streams.get(vb)
        return task is not None and not task.done()

    async def close_stream(self, vb: int) -> None:
        """DCP_CLOSE_STREAM (docs/protocol.md §2.3): KEY_ENOENT if none; STREAM_END(1) if asked."""
        task = self.streams.pop(vb, None)
        spec = self.specs.pop(vb, None)
        if task is None or task.done() or spec is None:
            raise KeyNotFound(f"no stream for partition {vb}")
        await cancel_and_wait([task])
        self._stream_gone(vb)
        if self.controls.get("send_stream_end_on_client_close_stream") == "true":
            # A task of its own sends it: STREAM_END counts for flow control, and waiting
            # for credit here would stall the connection's read loop, the only reader of
            # the BUFFER_ACK bringing it. A new stream of `vb` waits for it (`_stream`).
            end = StreamEnd(vbucket=vb, opaque=spec.opaque, status=END_CLOSED).encode()
            task = asyncio.get_running_loop().create_task(
                self._send_end(end), name=f"stream end vb{vb}"
            )
            self._ends[vb] = task
            self._end_tasks.add(task)
            task.add_done_callback(self._end_tasks.discard)

    async def _send_end(self, msg: bytes) -> None:
        try:
            await self.sender.send([msg])
        except (ConnectionError, OSError):
            return  # the connection is gone

    async def aclose(self) -> None:
        """Stop every stream, the noop task and the cookie sender; close idle read connections."""
        self._barriers.clear()  # pending cookies die with the connection (formats/barrier.md)
        tasks = [t for t in self.streams.values() if not t.done()]
        if self._noop_task is not None:
            tasks.append(self._noop_task)
        if self._barrier_task is not None:
            tasks.append(self._barrier_task)
        tasks += self._end_tasks
        await cancel_and_wait(tasks)
        self._ends.clear()
        self.streams.clear()
        readers, self._readers = self._readers, []
        for r in readers:  # idle: no thread uses them, so close here (also when cancelled)
            r.close()

    async def _run_stream(self, spec: StreamSpec) -> None:
        try:
            status = await self._stream(spec)
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError):
            return
        except Exception:
            log.exception("stream of partition %d failed", spec.vbucket)
            self._on_fatal(f"internal error in the stream of partition {spec.vbucket}")
            return
        finally:
            self._stream_gone(spec.vbucket)  # an ended stream holds no barrier back
        try:
            await self.sender.send(
                [StreamEnd(vbucket=spec.vbucket, opaque=spec.opaque, status=status).encode()]
            )
        except (ConnectionError, OSError):
            return  # the client left as its stream ended: there is no one to tell
        if self.specs.get(spec.vbucket) is spec:
            # a cookie that arrived while STREAM_END waited for credit counted this
            # stream as open: it holds nothing back either
            self._stream_gone(spec.vbucket)
            del self.specs[spec.vbucket]

    async def _stream(self, spec: StreamSpec) -> int:
        """Send snapshots until the end seq is passed; returns the STREAM_END status."""
        vb, end = spec.vbucket, spec.end
        part = self.bucket.partitions[vb]
        cursor, first = spec.start, True
        allowed = (ACTIVE,) if spec.flags & S_ACTIVE_ONLY else (ACTIVE, REPLICA)
        pending_end = self._ends.get(vb)
        if pending_end is not None:  # the closed stream's STREAM_END goes first
            await asyncio.wait([pending_end])
        while True:
            if self.bucket.partitions.get(vb) is not part:
                return END_STATE_CHANGED
            if part.state not in allowed and not (part.state == DEAD and cursor < part.high_seq):
                # a partition set dead accepts no more writes, and its streams first send
                # everything it holds, then end StateChanged (the UPR design specification,
                # "How ns_server performs a partition rebalance", step 4)
                return END_STATE_CHANGED
            if cursor >= end:
                return END_OK
            if cursor < part.persisted_seq:
                done = await self._backfill(spec, part, cursor, first)
                if done is None:  # the disk holds no whole received snapshot's state yet
                    if part.state == DEAD:
                        return END_STATE_CHANGED  # nothing more to come that could end one
                    await part.wait_change(timeout=1.0)
                    continue
                cursor, sent = done
                first = first and not sent
                if spec.view.ended:
                    return self._filter_empty()
                continue
            # From the persisted check to the capture: one synchronous step, so the queue
            # holds exactly the newest version of every key written above `cursor`.
            snap = _memory_snapshot(part, cursor)
            if snap is None:
                if part.state == DEAD and part.markers:
                    return END_STATE_CHANGED  # a dead replica's copy: no more whole ends
                await part.wait_change(timeout=1.0)
                continue
            items, snap_end = snap
            if not items or spec.view.hides_all(items):
                # a whole received snapshot of purged tombstones only, or one of other
                # collections than a stream without collections sees
                cursor = snap_end
                self._sent_whole(vb, cursor)
                continue
            marker = SnapshotMarker(
                vbucket=vb, opaque=spec.opaque, start_seqno=spec.start if first else items[0].seq,
                end_seqno=snap_end, flags=MARKER_MEMORY,
            ).encode()  # fmt: skip
            first = False
            # One marker for the whole capture, its items in bounded batches: the writers
            # may replace queued versions meanwhile, but the captured references keep the
            # state at `snap_end` (and hold no more memory than the queue already did).
            head = [marker]
            for chunk in _chunks(items, BATCH_ITEMS, self.batch_bytes):
                await self.sender.send_made(partial(self._encoded, spec, head, chunk))
                head = []
                if spec.view.ended:
                    return self._filter_empty()
            await self._advance(spec, snap_end)
            cursor = snap_end
            self._sent_whole(vb, cursor)

    def _filter_empty(self) -> int:
        """The STREAM_END status once a stream's filter has nothing left (the default
        collection's drop ends a stream without collections too, with OK as kv_engine
        reports FilterEmpty to such a client)."""
        return END_FILTER_EMPTY if self.collections else END_OK

    async def _advance(self, spec: StreamSpec, snap_end: int) -> None:
        """SEQNO_ADVANCED to a snapshot's end when the stream held back its last items
        (kv_engine's seqno-advanced.md): the client then holds the snapshot whole."""
        if self.collections and spec.view.last_sent < snap_end:
            msg = SeqnoAdvanced(vbucket=spec.vbucket, opaque=spec.opaque, by_seqno=snap_end)
            await self.sender.send([msg.encode()])
            spec.view.last_sent = snap_end

    async def _pool_call(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` on the backfill pool under a server-wide slot.

        A cancelled caller still waits for `fn` to finish: a SQLite connection must not be
        closed (by the caller's cleanup, on another thread) while a fetch is using it.
        """
        async with self._slots:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                await asyncio.wait([fut])
                raise

    async def _backfill(
        self, spec: StreamSpec, part: Partition, cursor: int, first: bool
    ) -> tuple[int, bool] | None:
        """Stream one consistent disk snapshot of (cursor, disk high]; returns the new cursor
        and whether a marker was sent, or None when the disk holds no whole snapshot's state
        now (a replica's copy persisted in the middle of a snapshot it is receiving).

        The rows come from ONE read transaction and go under ONE marker whose end is the
        highest seq in it: the state persisted there, which the client holds once it has
        them all (fetched and sent in batches, but never split into several markers: an
        end inside the range would lack the keys whose newest version lies above it).

        The server-wide slots are held only around each SQLite call, never while waiting for
        flow-control credit, so a client that stops acknowledging stalls only itself. Rows
        are encoded in the same pool call that fetches them (no DocRow objects).
        """
        storage = self.bucket.storage

        readers = self._readers

        def open_and_fetch() -> tuple[StorageReader, Backfill, list[bytes], int]:
            reader = readers.pop() if readers else storage.open_reader()
            try:
                bf = reader.backfill(spec.vbucket, cursor, batch=BACKFILL_ROWS,
                                     max_bytes=self.batch_bytes)  # fmt: skip
                rows = bf.fetch_rows()
            except BaseException:
                reader.close()
                raise
            return reader, bf, self._encode_rows(spec, rows), ROW_SEQ(rows[0]) if rows else 0

        def close(reader: StorageReader, bf: Backfill) -> None:
            try:
                bf.close()  # ends the read transaction; the connection stays for the next one
            except BaseException:
                reader.close()
                raise
            if len(readers) < BACKFILLS_PER_CONNECTION:
                readers.append(reader)
            else:
                reader.close()

        async with self._own:
            # The read below starts later and sees at least the commit that persisted
            # `persisted`; any later one writes seqs above it (a flush writes the queue).
            persisted = part.persisted_seq
            if part.state != ACTIVE and part.snap_end != persisted:
                return None  # a replica persisted mid-snapshot: that state is not the active's
            reader, bf, msgs, first_seq = await self._pool_call(open_and_fetch)
            try:
                if part.state != ACTIVE and (
                    bf.high_seq > persisted or part.persisted_seq < persisted
                ):
                    # a flush (or a rollback) moved the disk under the read: what it saw is
                    # not known to be whole; look again
                    return cursor, False
                if not first_seq:
                    # only purged tombstones lay between cursor and what was read (not the
                    # persisted seq now: a flush since may have persisted more rows)
                    cursor = max(cursor, bf.high_seq, persisted)
                    self._sent_whole(spec.vbucket, cursor)  # nothing else changed up to it
                    return cursor, False
                marker = SnapshotMarker(
                    vbucket=spec.vbucket, opaque=spec.opaque,
                    start_seqno=spec.start if first else first_seq,
                    end_seqno=bf.high_seq, flags=MARKER_DISK_CHECKPOINT,
                )  # fmt: skip
                await self.sender.send([marker.encode()])
                while True:  # a batch may be empty: the stream's filter held back its rows
                    await self._send_batched(msgs)
                    if spec.view.ended:
                        return cursor, True  # the filter has nothing left: the stream ends
                    if bf.done:
                        break
                    msgs = await self._pool_call(lambda: self._encode_rows(spec, bf.fetch_rows()))
                await self._advance(spec, bf.high_seq)
                self._sent_whole(spec.vbucket, bf.high_seq)  # one read transaction: whole
                return max(cursor, bf.high_seq), True
            finally:
                await _finish(self._pool_call(lambda: close(reader, bf)))

    def _encoded(self, spec: StreamSpec, head: list[bytes], chunk: list[DocRow]) -> list[bytes]:
        return [*head, *self._encode(spec, chunk)]

    async def _send_batched(self, msgs: list[bytes]) -> None:
        batch: list[bytes] = []
        size = 0
        for m in msgs:
            batch.append(m)
            size += len(m)
            if size >= BATCH_BYTES:
                await self.sender.send(batch)
                batch, size = [], 0
        if batch:
            await self.sender.send(batch)

    def _encode_rows(self, spec: StreamSpec, rows: list[StoredRow]) -> list[bytes]:
        """Encode storage rows without building DocRows (all live mutations of collections
        the stream sends whole: the hot path)."""
        if not rows:
            return []
        view = spec.view
        plain = view.plain_ids()
        hidden = self._hidden_bits  # datatype bits this connection cannot take as stored
        if (
            self.flags & (OPEN_NO_VALUE | OPEN_NO_VALUE_DT | OPEN_DELETE_TIMES)
            or self.force_compression
            or any(map(ROW_DELETED, rows))
            or (hidden and any(r[7] & hidden for r in rows))
            or not all(r[1][0] in plain for r in rows)
        ):
            return self._encode(spec, [DocRow(*r) for r in rows])
        opaque, vb, args = spec.opaque, spec.vbucket, ROW_MUTATION_ARGS
        view.last_sent = ROW_SEQ(rows[-1])
        if view.collections:  # the stored (qualified) key is the wire key
            return [encode_mutation(vb, opaque, *args(r)) for r in rows]
        # without collections every row here is in the default collection: drop its 0x00
        return [encode_mutation(vb, opaque, r[4], r[7], r[2], r[3], r[5], r[6], r[1][1:], r[10])
                for r in rows]  # fmt: skip

    def _encode(self, spec: StreamSpec, docs: list[DocRow]) -> list[bytes]:
        no_value = self.flags & (OPEN_NO_VALUE | OPEN_NO_VALUE_DT)
        keep_dt = self.flags & OPEN_NO_VALUE_DT
        v2 = self.flags & OPEN_DELETE_TIMES
        # an expiration (a tombstone that keeps its expiry) goes out as one only to a
        # client that asked (docs/protocol.md §2.10), as a deletion to the others
        expirations = self.controls.get("enable_expiry_opcode") == "true"
        out = []
        opaque, vb, view = spec.opaque, spec.vbucket, spec.view
        plain, cut = view.plain_ids(), 0 if view.collections else 1
        # the datatype bits that make a stored value unfit to go out as it is
        special = self._hidden_bits | (XATTR if no_value else 0)
        for d in docs:
            if d.key[0] in plain:  # the common case: no LEB128 to read
                key = d.key[cut:]
            elif is_system_key(d.key):
                msg = view.event(vb, opaque, d)
                if msg is not None:
                    out.append(msg)
                    view.last_sent = d.seq
                if view.ended:
                    break  # nothing after the drop that emptied the filter goes out
                plain = view.plain_ids()  # the event may have changed the filter
                continue
            elif (seen := view.data_key(d.key)) is not None:
                key = seen
            else:
                continue
            view.last_sent = d.seq
            if not d.deleted:
                dt = d.datatype
                if dt & special:  # compressed or with xattrs, for a client that cannot take it
                    dt, value = self._reworked(d, no_value, keep_dt)
                else:
                    value = b"" if no_value else d.value
                    if no_value and not keep_dt:
                        dt = 0
                    if self.force_compression:
                        dt, value = snappy.compressed(dt, value)
                out.append(encode_mutation(vb, opaque, d.cas, dt, d.seq, d.rev_seq, d.flags,
                                           d.expiry, key, value))  # fmt: skip
                continue
            dt, value = self._tombstone_value(d) if d.datatype & XATTR else (0, b"")
            if d.expiry and expirations:
                out.append(Expiration(vbucket=vb, opaque=opaque, cas=d.cas, by_seqno=d.seq,
                                      rev_seqno=d.rev_seq, delete_time=d.delete_time,
                                      key=key, datatype=dt, value=value).encode())  # fmt: skip
            elif v2:
                out.append(DeletionV2(vbucket=vb, opaque=opaque, cas=d.cas, by_seqno=d.seq,
                                      rev_seqno=d.rev_seq, delete_time=d.delete_time,
                                      key=key, datatype=dt, value=value).encode())  # fmt: skip
            else:
                out.append(Deletion(vbucket=vb, opaque=opaque, cas=d.cas, by_seqno=d.seq,
                                    rev_seqno=d.rev_seq, key=key, datatype=dt,
                                    value=value).encode())  # fmt: skip
        return out

    def _reworked(self, d: DocRow, no_value: int, keep_dt: int) -> tuple[int, bytes]:
        """(datatype, value) of a mutation whose stored value this connection cannot take
        as it is: stored compressed for a client without Snappy, or with xattrs that go
        in part (`_stripped`)."""
        if d.datatype & XATTR and (no_value or not self.xattrs):
            dt, value = self._stripped(d, no_value, keep_dt)
        else:
            value = b"" if no_value else d.value
            dt = d.datatype if (not no_value or keep_dt) else 0
        if dt & SNAPPY and not self.snappy:
            # stored compressed, and this client cannot take it so
            dt, value = snappy.plain(dt, value, d.key)
            dt &= ~SNAPPY  # also with no value (NoValueWithUnderlyingDatatype)
        elif self.force_compression:
            dt, value = snappy.compressed(dt, value)
        return dt, value

    def _stripped(self, d: DocRow, no_value: int, keep_dt: int) -> tuple[int, bytes]:
        """A mutation of a document with xattrs that this connection gets in part: the
        blob without IncludeXattrs, the body with NoValue (formats/wire.md "Xattrs",
        point 4). The whole stored value is compressed as one: it is inflated first, and
        what is left goes out plain (`_encode` compresses it again where asked)."""
        rest, blob, body = unpacked(d)
        if not self.xattrs:
            blob = b""
        if no_value:
            body = b""
            # NoValueWithUnderlyingDatatype: the document's bits, Snappy's only where
            # nothing is sent (a blob that is sent goes plain)
            rest = (rest | (0 if blob else d.datatype & snappy.SNAPPY)) if keep_dt else 0
        return join(blob, body, rest)

    def _tombstone_value(self, d: DocRow) -> tuple[int, bytes]:
        """(datatype, value) of a deletion or expiration: with IncludeXattrs the blob the
        tombstone kept, its user xattrs only with IncludeDeletedUserXattrs."""
        if not self.xattrs:
            return 0, b""
        blob = unpacked(d)[1]
        if not self.deleted_user_xattrs:
            blob = system_only(blob)
        return join(blob, b"", 0)


async def _finish(call: Awaitable[None]) -> None:
    """Complete a cleanup call even if the task is being cancelled meanwhile."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


def _chunks(items: list[DocRow], max_items: int, max_bytes: int) -> Iterator[list[DocRow]]:
    """`items` in runs of at most `max_items` and about `max_bytes` of keys and values
    (what one encoded batch holds; a larger item comes alone), each taken out of `items`
    as it is given: a capture keeps only the versions its stream has yet to send, not
    those the flusher has written and the writers replaced meanwhile (measured: a
    cluster node restoring 5 MiB documents peaked 100 MB higher)."""
    while items:
        n, size = 0, 0
        for doc in items:
            n += 1
            size += len(doc.key) + len(doc.value)
            if size >= max_bytes or n >= max_items:
                break
        run = items[:n]
        del items[:n]
        yield run


def _memory_snapshot(part: Partition, cursor: int) -> tuple[list[DocRow], int] | None:
    """The next memory snapshot after `cursor`: the queued items it holds and its end, or
    None if there is none to send now. The caller has checked `cursor` ≥ the persisted
    seq in the same synchronous step, so the queue holds the newest version of every key
    written above `cursor`, and taking ALL of them at once gives the state at the last.

    An active (or one set dead) sends everything queued. A replica's queue is what it
    received from its active, possibly part of a snapshot: its snapshots end only where
    the active's did, at the newest end `_whole_end` finds.
    """
    if part.state == ACTIVE or (part.state == DEAD and not part.markers):
        items = part.queue.items_after(cursor, len(part.queue))
        return (items, items[-1].seq) if items else None
    if part.state != REPLICA:
        return None  # a dead replica copy: the ends its queue broke are no longer tracked
    snap_end = _whole_end(part, cursor)
    if snap_end is None:
        return None
    items = part.queue.items_after(cursor, len(part.queue))
    return items[: bisect_right(items, snap_end, key=lambda d: d.seq)], snap_end


def _whole_end(part: Partition, cursor: int) -> int | None:
    """The newest end above `cursor` of a snapshot a replica received whole, not yet
    persisted past, at which its queue still holds the state: every item up to the end
    arrived (the high seq reached it); the stream from the active did not restart inside
    it (a later marker starting below the end: the resumed stream deduplicates against
    its own end, so what it sent may lack a version at or below this one); and no version
    at or below the end was replaced in the queue by one above it (`Partition.broken`;
    conservative: also when the replaced version lies at or below `cursor`)."""
    high, broken = part.high_seq, part.broken
    best: int | None = None
    later_start = high + 1  # the lowest start of the markers received after this one
    for start, e in reversed(part.markers):
        if cursor < e <= high and e <= later_start and e not in broken:
            best = e if best is None else max(best, e)
        later_start = min(later_start, start)
    return best


class RollbackTo(Exception):
    """STREAM_REQ must be answered with ROLLBACK(seq)."""

    def __init__(self, seq: int) -> None:
        super().__init__(seq)
        self.seq = seq


def open_flags_problem(flags: int) -> str | None:
    """Why DCP_OPEN flags are invalid (docs/protocol.md §2.1), or None."""
    if flags & (OPEN_NOTIFIER | 0x10 | 0x80):
        return f"removed or unused DCP_OPEN flags in 0x{flags:x}"
    if flags & ~0x3FF:
        return f"unknown DCP_OPEN flags 0x{flags:x}"
    if flags & OPEN_NO_VALUE and flags & OPEN_NO_VALUE_DT:
        return "NoValue and NoValueWithUnderlyingDatatype exclude each other"
    if flags & OPEN_DELETED_USER_XATTRS and not flags & OPEN_XATTRS:
        return "IncludeDeletedUserXattrs needs IncludeXattrs"
    if flags & OPEN_SKIP_DELETES:
        return "SkipDeletesInInitialBackfill needs collections"
    return None


def error_response(opcode: int, opaque: int, status: int, message: str) -> bytes:
    """A response with a status and an XERROR-style JSON context (docs/protocol.md §1.5)."""
    body = json.dumps({"error": {"context": message}}).encode()
    return Response(opcode=opcode, opaque=opaque, status=status, value=body, datatype=1).encode()


__all__ = ["DcpProducer", "DcpSender", "RollbackTo", "Status", "StreamView",
           "error_response", "stream_view"]  # fmt: skip
