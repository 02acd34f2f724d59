"""Every snapshot marker of `upr serve`'s producer ends at a state its partition had.

DCP deduplicates: inside a snapshot a key appears once, at its newest seq. A marker
[s, e] therefore promises that once the client received the snapshot whole its state
equals the source's at e (the UPR protocol draft, "Snapshot Markers and
Deduplication"; docs/design.md "Snapshot boundaries"). The node's write queue holds one
entry per key, so a memory snapshot made of a prefix of it ends at no such state: a key
written at x ≤ e and rewritten at y > e sits in the queue only at y. These tests write a
partition's history through the KV front end, with the seqs the node answers, and
compare, marker by marker, the rows a DCP client received with the true state.

A node with `--flush-interval 3600` keeps its writes in memory (the memory phase); a
SET_VBUCKET to the state a partition already has persists everything (a state command
flushes first: formats/cluster.md §3), which puts the disk backfill in front.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.e2e.conftest import PASSWORD, USER, Node
from tests.e2e.e2e_helpers import apply_changes, seqnos
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Snapshot, StreamEnded
from upr_cli.net.bootstrap import Session, connect, partition_of
from upr_cli.net.scram import plain_message
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Frame, FrameDecoder, decode_message
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.protocol.header import RESPONSE_MAGICS, Opcode
from upr_cli.protocol.messages import (
    STREAM_FOREVER,
    BufferAck,
    CloseStream,
    Control,
    DcpOpen,
    Delete,
    Deletion,
    DeletionV2,
    GetFailoverLog,
    Hello,
    Mutation,
    Request,
    ResponseMessage,
    SaslAuth,
    SelectBucket,
    Set,
    SetClusterConfig,
    SetParam,
    SetVbucket,
    SnapshotMarker,
    StreamEnd,
    StreamRequest,
)
from upr_cli.protocol.status import Status

OP_MUTATION = 0x57
PART = 3  # the partition every test writes
Change = tuple[bytes, bytes | None]  # a key and its new value (None: deleted)


class Writer:
    """Writes one partition through the KV front end and keeps its history: the change
    made at every seq, as the node numbered it (HELLO MutationSeqno)."""

    def __init__(self, session: Session, part: int = PART) -> None:
        self.s = session
        self.part = part
        self.log: dict[int, Change] = {}

    def keys(self, prefix: str, n: int) -> list[bytes]:
        """The first `n` keys `prefix<i>` that map to the partition."""
        out: list[bytes] = []
        i = 0
        while len(out) < n:
            key = f"{prefix}{i}".encode()
            if partition_of(key, self.s.num_partitions) == self.part:
                out.append(key)
            i += 1
        return out

    async def set(self, key: bytes, value: bytes) -> int:
        msg = Set(vbucket=self.part, key=self.s.qualify(key), value=value, datatype=1,
                  opaque=self.s.conn.next_opaque())  # fmt: skip
        return self._logged(await self.s.conn.request(msg), key, value)

    async def delete(self, key: bytes) -> int:
        msg = Delete(vbucket=self.part, key=self.s.qualify(key), opaque=self.s.conn.next_opaque())
        return self._logged(await self.s.conn.request(msg), key, None)

    def _logged(self, resp: Any, key: bytes, value: bytes | None) -> int:
        seq = resp.seqno
        assert isinstance(seq, int) and seq not in self.log, (key, seq)
        self.log[seq] = (key, value)
        return seq

    @property
    def high(self) -> int:
        return max(self.log, default=0)

    def state_at(self, seq: int) -> dict[bytes, bytes]:
        """The partition's true state at `seq`: every change up to it, in seq order."""
        return apply_changes(change for s, change in sorted(self.log.items()) if s <= seq)


async def _writer(uri: str) -> Writer:
    return Writer(await connect(SourceUri.parse(uri)))


async def _flush(w: Writer) -> None:
    """Have the node persist everything: SET_VBUCKET to the partition's own state (active),
    retried with the bucket CAS the refusal carries."""
    conn = w.s.conn
    cas = 0
    for _ in range(5):
        req = SetVbucket(vbucket=w.part, state=1, cas=cas, value=json.dumps({"rev": 0}).encode(),
                         opaque=conn.next_opaque())  # fmt: skip
        resp = await conn.request(req, check=False)
        if resp.status == Status.SUCCESS:
            return
        assert resp.status == Status.KEY_EEXISTS, resp.status
        cas = resp.cas
    raise AssertionError("the bucket CAS kept changing")


async def _received(consumer: DcpConsumer, it: AsyncIterator[list[Any]]) -> list[Any]:
    """Everything of the partition's stream until it ends, in order: Snapshot events and
    rows (seq, key, value or None)."""
    out: list[Any] = []
    async for batch in it:
        for item in batch:
            if type(item) is DcpRecord:
                op, seq, key, value = item[0], item[2], bytes(item[9]), item[10]
                out.append((seq, key, bytes(value) if op == OP_MUTATION else None))
            elif isinstance(item, Snapshot):
                out.append(item)
            elif isinstance(item, StreamEnded):
                assert item.status == 0, item
                return out
        consumer.commit()
    raise AssertionError("the stream did not end")


def _check_snapshots(w: Writer, received: list[Any], start: int = 0) -> list[Snapshot]:
    """Every marker: its rows lie in [start, end] (and are the changes made at their seqs),
    and all rows received up to the end of its snapshot, applied in order over the state
    at `start`, are the partition's true state at its end. Returns the markers."""
    assert received and isinstance(received[0], Snapshot), received[:1]
    markers: list[Snapshot] = []
    state = w.state_at(start)
    for i, item in enumerate(received):
        if isinstance(item, Snapshot):
            assert item.partition == w.part
            assert not markers or item.start > markers[-1].end, (markers[-1], item)
            markers.append(item)
        else:
            seq, key, value = item
            snap = markers[-1]
            assert snap.start <= seq <= snap.end, (seq, snap)
            assert w.log.get(seq) == (key, value), (seq, key, value, w.log.get(seq))
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        if i + 1 == len(received) or isinstance(received[i + 1], Snapshot):
            snap = markers[-1]
            want = w.state_at(snap.end)
            assert state == want, (
                f"snapshot [{snap.start}, {snap.end}]: the rows received up to its end are no "
                f"state the partition had: {len(state)} keys, not {len(want)}; missing "
                f"{sorted(set(want) - set(state))[:5]}, extra {sorted(set(state) - set(want))[:5]}"
                f", differing {[k for k in want if k in state and state[k] != want[k]][:5]}"
            )
    return markers


async def _stream(uri: str, **kw: Any) -> list[Any]:
    consumer = DcpConsumer(SourceUri.parse(uri), partitions=[PART], until_end=True, **kw)
    await consumer.open()
    try:
        async with contextlib.aclosing(consumer.batches()) as it:
            return await _received(consumer, it)
    finally:
        await consumer.aclose()


async def _queue_beyond_a_batch(uri: str) -> tuple[Writer, list[Any]]:
    """More than 512 keys, then rewrites and deletes of early keys: the queue holds more
    than 512 entries, keys written early among them only beyond the 512th."""
    w = await _writer(uri)
    try:
        keys = w.keys("k", 600)
        for i, key in enumerate(keys):  # seqs 1..600
            await w.set(key, b'"v0-%d"' % i)
        await w.set(keys[3], b'"v1"')  # first at seq 4
        await w.delete(keys[10])
        await w.set(keys[20], b'"v1"')
        await w.delete(keys[5])
        await w.set(keys[5], b'"back"')  # deleted, then created again
        await w.set(keys[3], b'"v2"')  # rewritten twice
        for key in w.keys("n", 10):
            await w.set(key, b'"new"')
        await w.delete(keys[599])
        await w.set(keys[0], b'"v1"')
        _uuid, high, persisted = (await seqnos(uri))[PART]
        assert (high, persisted) == (w.high, 0), "the writes must still be in memory only"
        return w, await _stream(uri)
    finally:
        await w.s.conn.aclose()


def test_memory_snapshots_end_at_states_the_partition_had(node_factory: type[Node]) -> None:
    node = node_factory("--flush-interval", "3600").start()
    w, received = asyncio.run(asyncio.wait_for(_queue_beyond_a_batch(node.uri), 60))
    markers = _check_snapshots(w, received)
    assert markers[0].start == 0 and markers[-1].end == w.high
    assert all(m.flags & 0x01 for m in markers)  # memory snapshots


async def _rewrites_while_sending(uri: str) -> tuple[Writer, list[Any]]:
    """A snapshot sent in many flow-controlled chunks while its keys are rewritten and
    deleted: what it sends is still the state at its end (the items it covers were taken
    from the queue at one moment), not a mix with versions written meanwhile."""
    w = await _writer(uri)
    consumer = DcpConsumer(SourceUri.parse(uri), partitions=[PART], until_end=True,
                           buffer_size=8 * 1024)  # fmt: skip
    try:
        keys = w.keys("c", 1500)
        for i, key in enumerate(keys):
            await w.set(key, b'"%s-%d"' % (b"x" * 200, i))
        high = w.high
        await consumer.open()
        async with contextlib.aclosing(consumer.batches()) as it:
            first = await it.__anext__()  # the stream is sending; the window stops it soon
            await asyncio.sleep(0.3)
            for i in (0, 1, 2, 700, 701, 1497, 1498, 1499):
                await w.set(keys[i], b'"rewritten"')
            for i in (3, 702, 1496):
                await w.delete(keys[i])
            for key in w.keys("late", 20):
                await w.set(key, b'"late"')
            rest = await _received(consumer, _prepend(first, it))
        markers = [m for m in rest if isinstance(m, Snapshot)]
        assert markers and markers[-1].end >= high
        return w, rest
    finally:
        await consumer.aclose()
        await w.s.conn.aclose()


async def _prepend(first: list[Any], it: AsyncIterator[list[Any]]) -> AsyncIterator[list[Any]]:
    yield first
    async for batch in it:
        yield batch


def test_a_snapshot_sent_under_flow_control_is_taken_at_one_moment(
    node_factory: type[Node],
) -> None:
    node = node_factory("--flush-interval", "3600").start()
    w, received = asyncio.run(asyncio.wait_for(_rewrites_while_sending(node.uri), 60))
    _check_snapshots(w, received)


async def _disk_then_memory(uri: str) -> tuple[Writer, list[Any]]:
    """A persisted range (one disk snapshot), then more than 512 queued items with keys
    rewritten beyond the 512th, both of disk keys and of keys first written in memory."""
    w = await _writer(uri)
    try:
        keys = w.keys("d", 300)
        for i, key in enumerate(keys):
            await w.set(key, b'"d%d"' % i)
        await w.delete(keys[7])
        await _flush(w)
        persisted = w.high
        assert (await seqnos(uri))[PART][2] == persisted
        mem = w.keys("m", 600)
        for i, key in enumerate(mem):
            await w.set(key, b'"m%d"' % i)
        await w.set(mem[2], b'"m-again"')  # queued first near the queue's head
        await w.delete(mem[9])
        await w.set(keys[1], b'"d-again"')  # persisted, rewritten in memory
        await w.delete(keys[2])
        await w.set(keys[7], b'"d-back"')  # deleted on disk, created again in memory
        return w, await _stream(uri)
    finally:
        await w.s.conn.aclose()


def test_disk_and_memory_snapshots_end_at_states_the_partition_had(
    node_factory: type[Node],
) -> None:
    node = node_factory("--flush-interval", "3600").start()
    w, received = asyncio.run(asyncio.wait_for(_disk_then_memory(node.uri), 60))
    markers = _check_snapshots(w, received)
    assert markers[0].flags & 0x02 and markers[0].end == 301  # one disk snapshot
    assert all(m.flags & 0x01 for m in markers[1:]) and markers[-1].end == w.high


class RawDcp:
    """A hand-driven DCP connection: acknowledges only when told to, and keeps every
    frame the node sends, in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.responses: dict[int, int] = {}  # opaque -> status
        self.dcp_bytes = 0  # counted for flow control: every DCP message but NOOP

    @classmethod
    async def open(cls, port: int, window: int) -> RawDcp:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        self = cls(reader, writer)
        await self.request(Hello(agent="raw-close", features=(), opaque=1))
        await self.request(SaslAuth(mechanism="PLAIN", payload=plain_message(USER, PASSWORD),
                                    opaque=2))  # fmt: skip
        await self.request(SelectBucket(bucket="default", opaque=3))
        await self.request(DcpOpen(name=f"raw-close-{id(self):x}", flags=0x01, opaque=4))
        await self.request(Control(name="connection_buffer_size", value=str(window), opaque=5))
        await self.request(Control(name="send_stream_end_on_client_close_stream", value="true",
                                   opaque=6))  # fmt: skip
        return self

    def send(self, msg: Request) -> None:
        self.writer.write(msg.encode())

    async def request(self, msg: Request, timeout: float = 10.0) -> int:
        """Send a request and wait for its response's status."""
        self.send(msg)
        await self.writer.drain()
        assert await self.read_until(lambda: msg.opaque in self.responses, timeout), (
            f"no answer to {type(msg).__name__} within {timeout:g}s"
        )
        return self.responses[msg.opaque]

    async def read_until(self, done: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                data = await asyncio.wait_for(self.reader.read(1 << 16), left)
                assert data, "the node closed the connection"
                self.decoder.feed(data)
                for frame in self.decoder.frames():
                    self._take(frame)
        return True

    def _take(self, frame: Frame) -> None:
        if frame.magic in RESPONSE_MAGICS:
            msg = decode_message(frame)
            assert isinstance(msg, ResponseMessage)
            self.responses[frame.opaque] = msg.status
        elif frame.opcode != Opcode.DCP_NOOP:
            self.dcp_bytes += frame.size
            self.frames.append(frame)

    async def aclose(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def _close_with_the_window_full(uri: str, port: int) -> None:
    w = await _writer(uri)
    raw = await RawDcp.open(port, window=4096)
    try:
        for key in w.keys("big", 40):
            await w.set(key, b'"' + b"b" * 2000 + b'"')
        raw.send(StreamRequest(vbucket=PART, opaque=0x100, start_seqno=0,
                               end_seqno=STREAM_FOREVER))  # fmt: skip
        # read until the window is full: the stream then stalls, its batch taken
        seen = -1
        while seen != raw.dcp_bytes:
            seen = raw.dcp_bytes
            await raw.read_until(lambda: False, 0.5)
        assert 4096 <= raw.dcp_bytes < 40 * 2000, raw.dcp_bytes
        assert raw.responses.get(0x100) == Status.SUCCESS
        # CLOSE_STREAM: its response comes at once; its STREAM_END needs credit
        assert await raw.request(CloseStream(vbucket=PART, opaque=0x200)) == Status.SUCCESS
        # ... which this acknowledgement brings, if the node still reads the connection
        raw.send(BufferAck(acked=raw.dcp_bytes, opaque=0))
        raw.send(
            StreamRequest(vbucket=PART, opaque=0x300, start_seqno=0, end_seqno=STREAM_FOREVER)
        )  # the partition again, at once
        raw.send(GetFailoverLog(vbucket=PART, opaque=0x400))
        await raw.writer.drain()

        def ended_and_answered() -> bool:
            return 0x400 in raw.responses and any(
                f.opcode == Opcode.DCP_STREAM_END and f.opaque == 0x100 for f in raw.frames
            )

        assert await raw.read_until(ended_and_answered, 10), (
            "the node stopped reading the connection while STREAM_END waited for credit: "
            f"responses {sorted(raw.responses)}"
        )
        assert raw.responses[0x300] == Status.SUCCESS
        # the closed stream's STREAM_END (status Closed) precedes every message of the new
        # stream of the partition, and nothing of the closed stream follows it
        await raw.read_until(lambda: any(f.opaque == 0x300 for f in raw.frames), 5)
        ours = [(f.opaque, decode_message(f)) for f in raw.frames if f.vbucket_or_status == PART]
        end_at = next(i for i, (op, m) in enumerate(ours) if isinstance(m, StreamEnd))
        end = ours[end_at][1]
        assert isinstance(end, StreamEnd) and end.status == 1 and ours[end_at][0] == 0x100
        assert all(op == 0x100 for op, _m in ours[:end_at])
        assert all(op == 0x300 for op, _m in ours[end_at + 1 :])
        assert isinstance(ours[end_at + 1][1], SnapshotMarker)
    finally:
        await raw.aclose()
        await w.s.conn.aclose()


def test_close_stream_with_the_window_full_does_not_stop_the_connection(
    node_factory: type[Node],
) -> None:
    """STREAM_END on a client's CLOSE_STREAM counts for flow control; waiting for credit in
    the connection's read loop would never read the BUFFER_ACK that brings it."""
    node = node_factory("--flush-interval", "3600").start()
    asyncio.run(asyncio.wait_for(_close_with_the_window_full(node.uri, node.port), 60))


# -- a replica copy serves a stream (a client that does not ask ActiveVbOnly) ----------


async def _control(uri: str, make: Any) -> None:
    """A state command on a node, retried with the bucket CAS its refusal carries."""
    s = await connect(SourceUri.parse(uri))
    try:
        cas = 0
        for _ in range(5):
            resp = await s.conn.request(make(cas, s.conn.next_opaque()), check=False)
            if resp.status == Status.SUCCESS:
                return
            assert resp.status == Status.KEY_EEXISTS, resp.status
            cas = resp.cas
        raise AssertionError("the bucket CAS kept changing")
    finally:
        await s.conn.aclose()


async def _replica_of(replica: Node, active: Node, partitions: int) -> None:
    """Make PART a replica on `replica`, fed from `active` (a two-node map, rev 1)."""
    rev1 = json.dumps({"rev": 1}).encode()
    await _control(replica.uri, lambda cas, op: SetVbucket(vbucket=PART, state=2, cas=cas,
                                                           value=rev1, opaque=op))  # fmt: skip
    servers = [f"127.0.0.1:{active.port}", f"127.0.0.1:{replica.port}"]
    cmap = {"rev": 1, "revEpoch": 1, "name": "default", "nodeLocator": "vbucket",
            "vBucketServerMap": {"hashAlgorithm": "CRC", "numReplicas": 1,
                                 "serverList": servers,
                                 "vBucketMap": [[0, 1] if p == PART else [1]
                                                for p in range(partitions)]},
            "nodesExt": [{"hostname": "127.0.0.1", "services": {"kv": n.port}}
                         for n in (active, replica)]}  # fmt: skip
    value = json.dumps(cmap).encode()
    await _control(replica.uri, lambda cas, op: SetClusterConfig(value=value, cas=cas, opaque=op))


async def _replication(uri: str, what: str, after: int | None = None) -> None:
    s = await connect(SourceUri.parse(uri))
    try:
        value = json.dumps({"partitions": [PART], "after": after}).encode()
        await s.conn.request(SetParam(name=what, value=value, opaque=s.conn.next_opaque()))
    finally:
        await s.conn.aclose()


async def _until_high(uri: str, high: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (await seqnos(uri))[PART][1] != high:
        assert time.monotonic() < deadline, f"partition {PART} did not reach {high}"
        await asyncio.sleep(0.05)


def _decoded(raw: RawDcp, opaque: int) -> list[Any]:
    """A raw stream's messages as `_check_snapshots` takes them; stops at STREAM_END."""
    out: list[Any] = []
    for frame in raw.frames:
        if frame.opaque != opaque:
            continue
        msg = decode_message(frame)
        if isinstance(msg, SnapshotMarker):
            out.append(Snapshot(PART, msg.start_seqno, msg.end_seqno, msg.flags))
        elif isinstance(msg, Mutation):
            out.append((msg.by_seqno, bytes(msg.key), bytes(msg.value)))
        elif isinstance(msg, Deletion | DeletionV2):
            out.append((msg.by_seqno, bytes(msg.key), None))
        elif isinstance(msg, StreamEnd):
            assert msg.status == 0, msg
            break
    return out


async def _replica_mid_snapshot(active: Node, replica: Node, persist: bool) -> None:
    """The replica applies its active's snapshot [100, 223] only up to 150 (a paused
    replication): a key written at 101..121 and rewritten at 201..221 is not in the part
    it has, so its state at 150 is one the active never had. A client streaming the
    replica copy must get snapshots ending at 100 (the last it received whole) and, once
    it received the rest, at 223; never at 150. `persist`: the replica persists what it
    holds mid-snapshot (then the stream has nothing whole on disk to send until a later
    flush lands on a snapshot end)."""
    w = await _writer(active.uri)
    raw: RawDcp | None = None
    try:
        first = w.keys("r", 100)
        for i, key in enumerate(first):  # 1..100
            await w.set(key, b'"r%d"' % i)
        await _replica_of(replica, active, w.s.num_partitions)
        await _until_high(replica.uri, 100)
        await _replication(replica.uri, "replication_pause")  # stops at 100, its link closes
        second = w.keys("s", 100)
        for i, key in enumerate(second):  # 101..200
            await w.set(key, b'"s%d"' % i)
        for key in second[:21]:  # 201..221: first written at 101..121
            await w.set(key, b'"s-again"')
        await w.delete(second[30])  # 222
        await w.set(first[5], b'"r-again"')  # 223
        assert w.high == 223
        # the active's queue now holds one snapshot [100, 223]; the replica takes 122..150
        await _replication(replica.uri, "replication_pause", after=150)
        await _until_high(replica.uri, 150)
        rev1 = json.dumps({"rev": 1}).encode()

        async def flush_replica() -> None:  # a state command persists everything first
            await _control(replica.uri, lambda cas, op: SetVbucket(vbucket=PART, state=2,
                                                                   cas=cas, value=rev1,
                                                                   opaque=op))  # fmt: skip

        if persist:
            await flush_replica()
            assert (await seqnos(replica.uri))[PART][2] == 150
        raw = await RawDcp.open(replica.port, window=1 << 20)
        assert (
            await raw.request(
                StreamRequest(vbucket=PART, opaque=0x500, start_seqno=0, end_seqno=w.high)
            )
            == Status.SUCCESS
        )
        await raw.read_until(lambda: False, 1.5)
        paused = _decoded(raw, 0x500)
        if paused:
            markers = _check_snapshots(w, paused)
            assert markers[-1].end == 100, markers
        # in memory: the snapshots it received whole; on disk: nothing whole yet
        assert bool(paused) != persist, paused
        await _replication(replica.uri, "replication_resume")
        await _until_high(replica.uri, w.high)
        if persist:
            await flush_replica()  # now at the end of a snapshot received whole

        def ended() -> bool:
            return any(f.opcode == Opcode.DCP_STREAM_END and f.opaque == 0x500 for f in raw.frames)

        assert await raw.read_until(ended, 20), "the replica's stream did not reach its end"
        markers = _check_snapshots(w, _decoded(raw, 0x500))
        assert markers[-1].end == w.high
    finally:
        if raw is not None:
            await raw.aclose()
        await w.s.conn.aclose()


@pytest.mark.parametrize("persist", [False, True], ids=["memory", "disk"])
def test_a_replica_streams_only_snapshots_it_received_whole(
    node_factory: type[Node], persist: bool
) -> None:
    active = node_factory("--flush-interval", "3600", name="active").start()
    replica = node_factory("--flush-interval", "3600", name="replica").start()
    asyncio.run(asyncio.wait_for(_replica_mid_snapshot(active, replica, persist), 90))
