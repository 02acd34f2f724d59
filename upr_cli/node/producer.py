"""The node's DCP producer: one per connection after DCP_OPEN (docs/protocol.md §2, §4, §7).

This module owns the connection: its open flags and controls, NOOPs, stream requests
(the checks of docs/protocol.md §4.1 and the producer's rollback rule), the streams'
tasks and their STREAM_END, and flow control. What each stream sends lives below it:
the stream loop with its disk and memory snapshots (`upr_cli/node/snapshots.py`), the
encoding of items (`upr_cli/node/dcp_encoder.py`), the collections filter
(`upr_cli/node/stream_view.py`) and barrier cookies (`upr_cli/node/barriers.py`).

Flow control (docs/protocol.md §7.1): every message but NOOP counts its full size; the
connection stops sending once unacknowledged bytes reach the window and resumes on
BUFFER_ACK.
Streams hand the sender bounded batches, so a client that never acks stalls its
streams without the node's memory growing. Whatever the connection's read loop causes
to be sent and counted (barrier cookies, STREAM_END on CLOSE_STREAM) is sent by a task of
its own: the read loop must never wait for credit, since it alone reads the BUFFER_ACK.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from upr_cli.failover import needs_rollback
from upr_cli.net.aio import cancel_and_wait
from upr_cli.node.barriers import BarrierCookies
from upr_cli.node.bucket import Bucket
from upr_cli.node.dcp_encoder import StreamEncoder
from upr_cli.node.partition import ACTIVE, REPLICA
from upr_cli.node.snapshots import (
    BACKFILLS_PER_CONNECTION,
    DEFAULT_BATCH_BYTES,
    SnapshotStreamer,
)
from upr_cli.node.stream_view import StreamSpec, stream_view
from upr_cli.position import StreamPosition
from upr_cli.protocol.dcp import (
    END_CLOSED,
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
)  # DCP flags (docs/protocol.md §2)
from upr_cli.protocol.header import DATATYPE_JSON
from upr_cli.protocol.messages import Noop, Response, StreamEnd, StreamRequest
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

log = logging.getLogger(__name__)


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
        # Xattrs (formats/wire.md "Xattrs"): sent with IncludeXattrs only; a deletion's
        # user xattrs only with IncludeDeletedUserXattrs too
        self.xattrs = bool(flags & OPEN_XATTRS)
        self.deleted_user_xattrs = bool(flags & OPEN_DELETED_USER_XATTRS)
        self.encoder = StreamEncoder(
            no_value=flags & (OPEN_NO_VALUE | OPEN_NO_VALUE_DT), keep_dt=flags & OPEN_NO_VALUE_DT,
            delete_times=flags & OPEN_DELETE_TIMES, xattrs=self.xattrs,
            deleted_user_xattrs=self.deleted_user_xattrs, snappy=snappy,
        )  # fmt: skip
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
        self._on_fatal = on_fatal
        # Barrier cookies (formats/barrier.md), settled by the streams as they go
        self.barriers_enabled = False
        self._cookies = BarrierCookies(sender.send)
        self._snapshots = SnapshotStreamer(
            bucket, sender, self.encoder, self._cookies, backfill_pool, backfill_slots,
            collections=collections, batch_bytes=batch_bytes,
        )  # fmt: skip
        # STREAM_END(Closed) of the streams the client closed, being sent (`close_stream`),
        # and per partition the newest of them (a new stream of it waits for that one)
        self._ends: dict[int, asyncio.Task[None]] = {}
        self._end_tasks: set[asyncio.Task[None]] = set()

    @property
    def force_compression(self) -> bool:
        """DCP_CONTROL force_value_compression was set (formats/wire.md "Snappy")."""
        return self.encoder.force_compression

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
            self.encoder.expirations = True
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
            self.encoder.force_compression = v == "true"
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
        states = (ACTIVE,) if flags & S_ACTIVE_ONLY else (ACTIVE, REPLICA)
        if part is None or part.state not in states:
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
        spec = StreamSpec(vb, req.opaque, flags, start, end, uuid, snap_start, snap_end, view,
                          states)  # fmt: skip
        return spec, part.failover.pairs()

    def register_barrier(self, cookie: bytes, opaque: int) -> None:
        """Note a cookie and, per open stream, the partition's high seqno now (its point)."""
        points = {
            vb: self.bucket.partitions[vb].high_seq for vb, task in self.streams.items()
            if not task.done()
        }  # fmt: skip
        self._cookies.register(cookie, opaque, points)

    async def check_barriers(self) -> None:
        """Send back, in arrival order, every cookie whose partitions all passed their point
        (without waiting for flow-control credit: `BarrierCookies.release`)."""
        self._cookies.release()

    def start_stream(self, spec: StreamSpec) -> None:
        """Start the stream task (after the SUCCESS response was sent)."""
        if spec.vbucket in self._cookies.sent_end:
            # the previous stream's task may never have run
            self._cookies.stream_gone(spec.vbucket)
        self._cookies.sent_end[spec.vbucket] = spec.start
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
        self._cookies.stream_gone(vb)
        if self.controls.get("send_stream_end_on_client_close_stream") == "true":
            # A task of its own sends it: STREAM_END counts for flow control, and waiting
            # for credit here would stall the connection's read loop, the only reader of
            # the BUFFER_ACK bringing it. A new stream of `vb` waits for it (`_run_stream`).
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
        cookie_tasks = self._cookies.drop()
        tasks = [t for t in self.streams.values() if not t.done()]
        if self._noop_task is not None:
            tasks.append(self._noop_task)
        tasks += cookie_tasks
        tasks += self._end_tasks
        await cancel_and_wait(tasks)
        self._ends.clear()
        self.streams.clear()
        self._snapshots.close()

    async def _run_stream(self, spec: StreamSpec) -> None:
        try:
            pending_end = self._ends.get(spec.vbucket)
            if pending_end is not None:  # the closed stream's STREAM_END goes first
                await asyncio.wait([pending_end])
            status = await self._snapshots.run(spec)
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError):
            return
        except Exception:
            log.exception("stream of partition %d failed", spec.vbucket)
            self._on_fatal(f"internal error in the stream of partition {spec.vbucket}")
            return
        finally:
            self._cookies.stream_gone(spec.vbucket)  # an ended stream holds no barrier back
        try:
            await self.sender.send(
                [StreamEnd(vbucket=spec.vbucket, opaque=spec.opaque, status=status).encode()]
            )
        except (ConnectionError, OSError):
            return  # the client left as its stream ended: there is no one to tell
        if self.specs.get(spec.vbucket) is spec:
            # a cookie that arrived while STREAM_END waited for credit counted this
            # stream as open: it holds nothing back either
            self._cookies.stream_gone(spec.vbucket)
            del self.specs[spec.vbucket]


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
    return Response(opcode=opcode, opaque=opaque, status=status, value=body,
                    datatype=DATATYPE_JSON).encode()  # fmt: skip


# BACKFILLS_PER_CONNECTION: the node sizes its backfill pool by it (upr_cli/node/server.py)
__all__ = ["BACKFILLS_PER_CONNECTION", "DcpProducer", "DcpSender", "RollbackTo", "Status",
           "error_response"]  # fmt: skip
