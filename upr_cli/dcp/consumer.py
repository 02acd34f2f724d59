"""The DCP consumer: stream a set of partitions from positions, in batches.

Theory of operation. The connection's reader task hands every batch of server frames
to `_on_server`, which answers NOOPs at once (dcp-wire §2.12) and queues the rest; the
flow-control window (§7.1) bounds what can be queued. `batches()` turns frames into
row tuples (`DcpRecord` order) and events, and acknowledges a batch's bytes only when
the caller asks for the next one, i.e. after the sink took the items. Positions
advance as items arrive; `commit()` marks what the caller has made durable, and a
reconnect resumes from the committed positions (at-least-once delivery).

ROLLBACK(r) follows §4.4: take the newest entry of the kept failover log with seq ≤ r,
restart from (r, r, r) on that uuid, and hand the caller an explicit `Rollback` event
first, so it can undo its sink above r. A stream that ends for any reason but "end
reached" or "closed by us" is reopened from where it stood. A connection silent for
longer than `dead_after` seconds is treated as dead (the server sends NOOPs every
`noop_interval`) and reconnected with capped exponential backoff and jitter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from upr_cli.dcp.events import (
    BarrierReached,
    Event,
    Rollback,
    Snapshot,
    StreamEnded,
    StreamOpened,
)
from upr_cli.dcp.position import StreamPosition
from upr_cli.errors import RemoteProtocolError, UprError
from upr_cli.failover import FailoverLog
from upr_cli.net.bootstrap import Session, connect
from upr_cli.net.connection import ConnectionClosed, ConnectionError_, ServerItems
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Frame, decode_message
from upr_cli.protocol.header import Opcode
from upr_cli.protocol.messages import (
    STREAM_FOREVER,
    Barrier,
    BufferAck,
    Control,
    DcpOpen,
    FailoverLogResponse,
    GetAllVbSeqnos,
    GetAllVbSeqnosResponse,
    GetFailoverLog,
    Response,
    SeqnoAdvanced,
    SnapshotMarker,
    SnapshotMarkerV2,
    StreamEnd,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
)
from upr_cli.protocol.status import Status, status_error

log = logging.getLogger(__name__)

OPEN_PRODUCER = 0x01
FLAG_FROM_LATEST = 0x40
# dcp-wire §2.2 ActiveVbOnly: a client wants the history of the active copy; a replica
# copy (possibly behind, possibly on another branch) is refused with NOT_MY_VBUCKET.
FLAG_ACTIVE_ONLY = 0x10
MARKER_ACK = 0x08
END_OK, END_CLOSED = 0, 1
Item = tuple[object, ...] | Event


class ConsumerError(UprError):
    """The stream cannot continue (a partition refused, retries exhausted)."""


class _Lost:
    """Queue marker: the connection closed or went silent."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


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

    def position(self) -> StreamPosition:
        return StreamPosition(self.partition, self.uuid, self.seq, self.snap_start, self.snap_end)


class DcpConsumer:
    """Stream partitions of one bucket over one DCP connection."""

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
        reconnect_attempts: int = 5,
        barriers: bool = False,
        connect_timeout: float = 10.0,
        name: str = "upr",
    ) -> None:
        self.uri = uri
        self._want = None if partitions is None else sorted(set(partitions))
        self._start = dict(positions or {})
        self._logs = dict(failover_logs or {})
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
        self.name = f"{name}:{random.getrandbits(32):08x}"
        self.parts: dict[int, _Part] = {}
        # (uuid, seq, snap_start, snap_end) per partition: plain tuples, since commit()
        # runs after every batch and must stay cheap for 1024 partitions.
        self._committed: dict[int, tuple[int, int, int, int]] = {}
        self.session: Session | None = None
        self._queue: asyncio.Queue[tuple[ServerItems, int] | BaseException | _Lost] = (
            asyncio.Queue()
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._events: list[Item] = []
        self._unacked = 0
        self.highs: dict[int, int] = {}

    # -- life cycle -----------------------------------------------------------------

    async def open(self) -> None:
        """Connect, negotiate, pin end seqnos (if finite) and open every stream."""
        await self._connect()
        assert self.session is not None
        n = self.session.num_partitions
        if n == 0:
            raise ConsumerError(f"{self.uri.redacted()}: the cluster config lists no partitions")
        want = self._want if self._want is not None else list(range(n))
        bad = [p for p in want if not 0 <= p < n]
        if bad:
            raise ConsumerError(f"partition {bad[0]} does not exist (the bucket has {n})")
        conn = self.session.conn
        resp = await conn.request(GetAllVbSeqnos(opaque=conn.next_opaque()))
        assert isinstance(resp, GetAllVbSeqnosResponse)
        self.highs = dict(resp.seqnos)
        for p in want:
            pos = self._start.get(p, StreamPosition.beginning(p))
            if self.start_seq is not None and p not in self._start:
                seq = min(self.start_seq, self.highs.get(p, 0))
                entry = (await self.failover_log(p)).entry_at(seq)
                pos = StreamPosition(p, entry.uuid if entry else 0, seq, seq, seq)
            part = _Part(p, pos.uuid, pos.seq, pos.snap_start, pos.snap_end)
            if p in self._logs:
                part.log = self._logs[p]
            if self.until_end:
                # `end_seqs` (a planned range) is capped at what the source holds now: a
                # branch that rolled back below it cannot serve it (the next plan sees that)
                high = self.highs.get(p, 0)
                part.end = min(self._end_seqs.get(p, high), high)
            self.parts[p] = part
            self._committed[p] = (pos.uuid, pos.seq, pos.snap_start, pos.snap_end)
        await self._open_streams(list(self.parts.values()))

    async def _connect(self) -> None:
        queue = self._queue

        def lost(exc: ConnectionClosed) -> None:
            if self.session is not None:  # not a bootstrap that failed
                queue.put_nowait(_Lost(str(exc)))

        session = await connect(self.uri, timeout=self.connect_timeout, on_server=self._on_server,
                                on_close=lost, name=self.name)  # fmt: skip
        conn = session.conn
        try:
            await conn.request(
                DcpOpen(name=self.name, flags=OPEN_PRODUCER, opaque=conn.next_opaque())
            )
            controls = [("connection_buffer_size", str(self.buffer_size)), ("enable_noop", "true"),
                        ("set_noop_interval", f"{self.noop_interval:g}")]  # fmt: skip
            for key, value in controls:
                await conn.request(Control(name=key, value=value, opaque=conn.next_opaque()))
            if self.want_barriers:
                # a real server answers EINVAL: no barriers, callers fall back (formats/barrier.md)
                resp = await conn.request(
                    Control(name="upr_barrier_cookies", value="true", opaque=conn.next_opaque()),
                    check=False,
                )
                self.barriers_supported = resp.status == Status.SUCCESS
        except BaseException:
            await conn.aclose()
            raise
        self.session = session
        self._unacked = 0

    async def aclose(self) -> None:
        """Close the connection."""
        for task in list(self._tasks):
            task.cancel()
        if self.session is not None:
            await self.session.conn.aclose()
            self.session = None

    async def __aenter__(self) -> DcpConsumer:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- streams ------------------------------------------------------------------------

    async def _open_streams(self, parts: list[_Part]) -> None:
        """Send every STREAM_REQ pipelined; follow ROLLBACK answers (§4.4) until accepted."""
        assert self.session is not None
        conn = self.session.conn
        pending = [p for p in parts if not p.done]
        while pending:
            futs = []
            for part in pending:
                flags = FLAG_ACTIVE_ONLY | (
                    FLAG_FROM_LATEST if self.from_latest and part.seq == 0 and not part.uuid else 0
                )
                req = StreamRequest(
                    vbucket=part.partition, opaque=0x1000_0000 + part.partition, flags=flags,
                    start_seqno=part.seq, end_seqno=max(part.end, part.seq), vbucket_uuid=part.uuid,
                    snap_start_seqno=part.snap_start, snap_end_seqno=part.snap_end,
                )  # fmt: skip
                futs.append((part, conn.start_request(req)))
            retry = []
            for part, fut in futs:
                resp = (await fut)[0]
                if isinstance(resp, StreamRequestOk):
                    part.log = FailoverLog.sanitised(resp.failover_log)
                    if part.log.entries:
                        part.uuid = (
                            part.log.latest.uuid
                            if not part.uuid or part.log.find(part.uuid) is None
                            else part.uuid
                        )
                    if self.from_latest and part.seq == 0:
                        part.seq = part.snap_start = part.snap_end = self.highs.get(
                            part.partition, 0
                        )
                        part.uuid = part.log.latest.uuid if part.log.entries else 0
                    self._events.append(
                        StreamOpened(part.partition, resp.failover_log, part.position())
                    )
                elif isinstance(resp, StreamRequestRollback):
                    self._rollback(part, resp.rollback_seqno)
                    retry.append(part)
                else:
                    assert isinstance(resp, Response)
                    err = status_error(resp.status, body=resp.value, opcode=Opcode.DCP_STREAM_REQ)
                    raise ConsumerError(
                        f"partition {part.partition}: stream request refused: {err}"
                    )
            pending = retry

    def _rollback(self, part: _Part, r: int) -> None:
        """dcp-wire §4.4: newest entry with seq ≤ r, prune above r, restart from (r, r, r)."""
        previous = part.position()
        entry = part.log.entry_at(r)
        part.log = part.log.prune_above(r)
        # Without a kept log, stay on the position's branch: the server bounded r by it.
        uuid = entry.uuid if entry is not None else previous.uuid
        part.uuid, part.seq, part.snap_start, part.snap_end = uuid, r, r, r
        self._committed[part.partition] = (part.uuid, part.seq, part.snap_start, part.snap_end)
        self._events.append(Rollback(part.partition, previous, r, uuid))
        log.info("partition %d: rollback from %d to %d", part.partition, previous.seq, r)

    # -- receiving ------------------------------------------------------------------------

    def _on_server(self, items: ServerItems, nbytes: int) -> None:
        """Reader-task callback: answer NOOPs now, queue the rest (with its byte count)."""
        keep = []
        for it in items:
            if type(it) is Frame and it.opcode == Opcode.DCP_NOOP:
                if self.session is not None and not self.session.conn.closed:
                    self.session.conn.send_bytes(
                        Response(opcode=Opcode.DCP_NOOP, opaque=it.opaque).encode()
                    )
            else:
                keep.append(it)
        self._queue.put_nowait((keep, nbytes))

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
        else:
            self._committed.update(
                {p: (t.uuid, t.seq, t.snap_start, t.snap_end) for p, t in self.parts.items()}
            )

    @property
    def committed(self) -> dict[int, StreamPosition]:
        """The positions the caller committed; a reconnect resumes from these."""
        return {p: StreamPosition(p, *t) for p, t in self._committed.items()}

    @property
    def finished(self) -> bool:
        """True once every partition's finite stream has ended."""
        return all(p.done for p in self.parts.values())

    async def batches(self) -> AsyncIterator[list[Item]]:
        """Rows and events in wire order, batch by batch, until every stream ended."""
        attempts = 0
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
                log.info("connection lost: %s", got.reason)
                attempts = await self._reconnect(attempts, got.reason)
                continue
            if isinstance(got, BaseException):
                raise got
            items, nbytes = got
            out = self._process(items) if items else []
            if out:
                yield out
                attempts = 0
            self._ack(nbytes)

    def _ack(self, nbytes: int) -> None:
        """Acknowledge consumed bytes once a fifth of the window is pending (§7.1)."""
        self._unacked += nbytes
        if (
            self._unacked >= self.buffer_size // 5
            and self.session is not None
            and not self.session.conn.closed
        ):
            self.session.conn.send_bytes(BufferAck(acked=self._unacked).encode())
            self._unacked = 0

    def _process(self, items: ServerItems) -> list[Item]:
        parts = self.parts
        out: list[Item] = []
        for it in items:
            if type(it) is not Frame:
                part = parts.get(it[1])  # type: ignore[call-overload]
                if part is not None:
                    part.seq = it[2]
                out.append(it)
                continue
            msg = decode_message(it)
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
            if isinstance(msg, SnapshotMarker | SnapshotMarkerV2):
                part.snap_start, part.snap_end = msg.start_seqno, msg.end_seqno
                if msg.flags & MARKER_ACK and self.session is not None:
                    self.session.conn.send_bytes(
                        Response(opcode=Opcode.DCP_SNAPSHOT_MARKER, opaque=msg.opaque).encode()
                    )
                out.append(Snapshot(vb, msg.start_seqno, msg.end_seqno, msg.flags))
            elif isinstance(msg, SeqnoAdvanced):
                part.seq = msg.by_seqno
            elif isinstance(msg, StreamEnd):
                out.append(StreamEnded(vb, msg.status, part.position()))
                if msg.status in (END_OK, END_CLOSED) or (self.until_end and part.seq >= part.end):
                    part.done = True
                else:
                    log.info("partition %d: stream ended with status %d, reopening", vb, msg.status)
                    task = asyncio.get_running_loop().create_task(self._reopen(part))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        return out

    async def _reopen(self, part: _Part) -> None:
        try:
            await self._open_streams([part])
        except (ConsumerError, ConnectionError_) as exc:
            self._queue.put_nowait(exc)

    async def _reconnect(self, attempts: int, reason: str) -> int:
        """Reconnect with capped exponential backoff and jitter; resume from committed positions."""
        while True:
            attempts += 1
            if attempts > self.reconnect_attempts:
                raise ConsumerError(
                    f"{self.uri.redacted()}: connection lost ({reason}); "
                    f"{self.reconnect_attempts} reconnect attempts failed"
                )
            delay = min(10.0, 0.2 * 2 ** (attempts - 1)) * random.uniform(0.5, 1.0)
            log.info("reconnecting in %.1fs (attempt %d)", delay, attempts)
            await asyncio.sleep(delay)
            if self.session is not None:
                await self.session.conn.aclose()
                self.session = None
            self._queue = asyncio.Queue()
            self._events = [e for e in self._events if isinstance(e, Rollback)]
            for p, part in self.parts.items():
                pos = StreamPosition(p, *self._committed[p])
                part.uuid, part.seq, part.snap_start, part.snap_end = (
                    pos.uuid, pos.seq, pos.snap_start, pos.snap_end)  # fmt: skip
            try:
                await self._connect()
                await self._open_streams(list(self.parts.values()))
                return attempts
            except (ConnectionError_, OSError) as exc:
                reason = str(exc)
                log.info("reconnect failed: %s", exc)

    async def barrier(self, cookie: bytes) -> None:
        """Send a barrier cookie; a `BarrierReached` event follows in the stream."""
        if not self.barriers_supported or self.session is None:
            raise ConsumerError("the source does not support barrier cookies")
        conn = self.session.conn
        await conn.request(Barrier(cookie=cookie, opaque=conn.next_opaque()))

    async def failover_log(self, partition: int) -> FailoverLog:
        """The server's failover log for a partition (GET_FAILOVER_LOG)."""
        assert self.session is not None
        conn = self.session.conn
        resp = await conn.request(GetFailoverLog(vbucket=partition, opaque=conn.next_opaque()))
        assert isinstance(resp, FailoverLogResponse)
        return FailoverLog.sanitised(resp.failover_log)


__all__ = ["ConsumerError", "DcpConsumer", "Item", "Status"]
