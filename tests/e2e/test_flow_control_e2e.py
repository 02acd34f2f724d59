"""DCP flow control (docs/protocol.md §2.13, §2.14, §7.1) against a real `upr serve` process.

One node per module holds about 22 MB: 5,000 JSON documents of ~4.5 KB each, every one
larger than the 4 KiB window used here, so each message the producer sends overshoots
the window (the case docs/protocol.md §7.1 allows: a message may go whenever
unacknowledged bytes are below the window). The library consumer must still deliver
every item with a tiny window; a hand-driven client that never sends
DCP_BUFFER_ACKNOWLEDGEMENT must see the stream stop at the window (plus the one
overshooting message) while the node's memory stays flat, and see it resume after an
ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.conftest import PASSWORD, USER, Node, upr
from tests.e2e.e2e_helpers import drain, run, wait_persisted, watched_node
from upr_cli.dcp.events import StreamEnded
from upr_cli.net.scram import plain_message
from upr_cli.protocol import Frame, FrameDecoder, decode_message
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.protocol.header import RESPONSE_MAGICS, Opcode
from upr_cli.protocol.messages import (
    STREAM_FOREVER,
    BufferAck,
    Control,
    DcpOpen,
    Hello,
    Request,
    ResponseMessage,
    SaslAuth,
    SelectBucket,
    StreamRequest,
)

DOCS = 5_000
DOC_SIZE = 4_500
PARTITIONS = 16
WINDOW = 4096
QUIET = 1.0  # seconds without a DCP byte: the producer has stalled
RSS_BOUND_KIB = 30 * 1024


@dataclass
class Loaded:
    """The module's node, and what a default-window drain saw on it."""

    node: Node
    items: set[tuple[int, int, bytes]]  # (partition, seq, key) of every item streamed
    value_bytes: int


def identities(rows: list[DcpRecord]) -> list[tuple[int, int, bytes]]:
    """(partition, seq, key) of each item streamed."""
    return [(r.vbucket, r.by_seqno, r.key) for r in rows]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
    """A node with ~22 MB of persisted documents; stopped cleanly at the end."""
    node = Node(
        tmp_path_factory.mktemp("flow") / "node", "--flush-interval", "0.02", partitions=PARTITIONS
    )
    with watched_node(node, clean_stop=False) as w:
        upr("load", node.uri, "--docs", str(DOCS), "--size", str(DOC_SIZE), "--seed", "11")
        wait_persisted(node.uri)
        rows, _events, _c = run(asyncio.wait_for(drain(node.uri), 60))
        yield Loaded(node, set(identities(rows)), sum(len(r.value) for r in rows))
    assert "Traceback" not in "".join(w.stderr), "".join(w.stderr)[-4000:]


class RawDcpClient:
    """A hand-driven DCP client: our codec on an asyncio socket, acks only when told to.

    It counts the bytes of every DCP message the producer sends (full wire size, as
    docs/protocol.md §7.1 counts them), leaving out responses to its own requests and NOOPs.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self.dcp_bytes = 0
        self.last_size = 0
        self.messages = 0
        self.responses: dict[int, int] = {}  # opaque -> status
        self.closed = False

    @classmethod
    async def open(
        cls, port: int, window: int | None, *, partitions: int = PARTITIONS, name: str = "raw-fc"
    ) -> RawDcpClient:
        """HELLO, SASL PLAIN, SELECT_BUCKET, DCP_OPEN(producer), the window, then streams."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        self = cls(reader, writer)
        await self.request(Hello(agent="raw-fc", features=(), opaque=1))
        await self.request(
            SaslAuth(mechanism="PLAIN", payload=plain_message(USER, PASSWORD), opaque=2)
        )
        await self.request(SelectBucket(bucket="default", opaque=3))
        await self.request(DcpOpen(name=f"{name}-{id(self):x}", flags=0x01, opaque=4))
        if window is not None:
            await self.request(Control(name="connection_buffer_size", value=str(window), opaque=5))
        for vb in range(partitions):
            writer.write(
                StreamRequest(
                    vbucket=vb, opaque=0x100 + vb, start_seqno=0, end_seqno=STREAM_FOREVER
                ).encode()
            )
        await writer.drain()
        return self

    async def request(self, msg: Request) -> None:
        """Send a bootstrap request and require SUCCESS (nothing else flows yet)."""
        self.writer.write(msg.encode())
        await self.writer.drain()
        deadline = time.monotonic() + 10
        while msg.opaque not in self.responses:
            await self.read_some(deadline - time.monotonic())
            if time.monotonic() > deadline:
                raise AssertionError(f"no answer to {type(msg).__name__}")
        assert self.responses[msg.opaque] == 0, (type(msg).__name__, self.responses[msg.opaque])

    async def read_some(self, timeout: float) -> bool:
        """Read once (up to `timeout`); account every whole frame; False on timeout."""
        try:
            data = await asyncio.wait_for(self.reader.read(1 << 16), max(timeout, 0.01))
        except TimeoutError:
            return False
        if not data:
            self.closed = True
            raise AssertionError("the node closed the connection")
        self.decoder.feed(data)
        for frame in self.decoder.frames():
            self._account(frame)
        return True

    def _account(self, frame: Frame) -> None:
        if frame.magic in RESPONSE_MAGICS:
            msg = decode_message(frame)
            assert isinstance(msg, ResponseMessage)
            self.responses[frame.opaque] = msg.status
        elif frame.opcode != Opcode.DCP_NOOP:  # NOOPs are not counted (docs/protocol.md §7.1)
            self.dcp_bytes += frame.size
            self.last_size = frame.size
            self.messages += 1

    async def read_until_quiet(self, quiet: float = QUIET, limit: float = 20.0) -> None:
        """Read until no DCP message arrived for `quiet` seconds (at most `limit`)."""
        start = time.monotonic()
        last_progress, seen = start, self.dcp_bytes
        while time.monotonic() - start < limit:
            await self.read_some(0.1)
            if self.dcp_bytes != seen:
                seen, last_progress = self.dcp_bytes, time.monotonic()
            elif time.monotonic() - last_progress >= quiet:
                return
        raise AssertionError(f"DCP data kept flowing for {limit:g}s: no stall")

    def ack(self, nbytes: int) -> None:
        """DCP_BUFFER_ACKNOWLEDGEMENT (no response on success, docs/protocol.md §2.13)."""
        self.writer.write(BufferAck(acked=nbytes, opaque=0).encode())

    async def aclose(self) -> None:
        """Close the socket and wait for it."""
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


def test_fixture_holds_enough_data(loaded: Loaded) -> None:
    """The premise of the memory checks below: ≥ 20 MB of values, every doc > the window."""
    assert len(loaded.items) == DOCS
    assert loaded.value_bytes >= 20 * 1024 * 1024
    assert loaded.value_bytes // DOCS > WINDOW


@pytest.mark.parametrize("window", [WINDOW, 100])
def test_consumer_with_a_tiny_window_still_delivers_every_item(loaded: Loaded, window: int) -> None:
    rows, events, consumer = run(
        asyncio.wait_for(drain(loaded.node.uri, buffer_size=window, until_end=True), 90)
    )
    got = identities(rows)
    assert len(got) == len(set(got)) == DOCS  # nothing doubled, nothing lost
    assert set(got) == loaded.items  # the same items as at the default 4 MiB window
    # GET_ALL_VB_SEQNOS agrees: one seq per document (no updates were loaded)
    assert sum(consumer.highs.values()) == DOCS
    ends = [e for e in events if isinstance(e, StreamEnded)]
    assert sorted(e.partition for e in ends) == list(range(PARTITIONS))
    assert all(e.status == 0 for e in ends)
    assert all(sum(len(bytes(r.value)) for r in rows if r.vbucket == p) > 0
               for p in range(PARTITIONS))  # fmt: skip


def test_a_client_that_never_acks_stalls_at_the_window_and_resumes_on_ack(
    loaded: Loaded,
) -> None:
    node = loaded.node

    async def scenario() -> None:
        rss_before = node.rss_kib()
        client = await RawDcpClient.open(node.port, WINDOW)
        try:
            await client.read_until_quiet()
            assert all(client.responses.get(0x100 + vb) == 0 for vb in range(PARTITIONS))
            first = client.dcp_bytes
            # docs/protocol.md §7.1: a message goes out only while unacknowledged bytes < window, so
            # everything before the last message is below the window, and it stopped
            # because the window was reached, far short of the ~22 MB in the bucket.
            assert first >= WINDOW
            assert first - client.last_size < WINDOW, (first, client.last_size)
            assert first < loaded.value_bytes // 100
            # sit there without acking: the node's memory must stay flat
            peak = rss_before
            for _ in range(10):
                await client.read_some(0.25)
                peak = max(peak, node.rss_kib())
            assert client.dcp_bytes == first, "data arrived without an ack"
            assert peak - rss_before < RSS_BOUND_KIB, (rss_before, peak)
            # acknowledge what arrived: the producer resumes, and stalls again one window on
            client.ack(first)
            await client.read_until_quiet()
            second = client.dcp_bytes - first
            assert second >= WINDOW
            assert second - client.last_size < WINDOW, (second, client.last_size)
            # several acks in a row keep it going
            for _ in range(3):
                before = client.dcp_bytes
                client.ack(client.dcp_bytes)  # more than outstanding: clamps at zero
                await client.read_until_quiet(quiet=0.5)
                assert client.dcp_bytes > before
        finally:
            await client.aclose()

    run(asyncio.wait_for(scenario(), 120))
    assert node.alive()


@contextlib.asynccontextmanager
async def stuck_client(port: int, name: str) -> AsyncIterator[RawDcpClient]:
    """A client that filled its window and never acks; it leaves at the end of the block."""
    stuck = await RawDcpClient.open(port, WINDOW, name=name)
    try:
        await stuck.read_until_quiet(quiet=1.0)
        yield stuck
    finally:
        await stuck.aclose()


def test_a_stuck_client_does_not_starve_other_clients(loaded: Loaded) -> None:
    node = loaded.node

    async def scenario() -> None:
        async with stuck_client(node.port, "stuck"):
            try:
                rows, _events, _c = await asyncio.wait_for(drain(node.uri), 5)
            except TimeoutError:
                pytest.fail("a second client could not stream for 5 s while a stuck one sat idle")
            assert set(identities(rows)) == loaded.items

    run(asyncio.wait_for(scenario(), 60))


def test_when_the_stuck_client_leaves_other_clients_proceed(loaded: Loaded) -> None:
    node = loaded.node

    async def scenario() -> None:
        async with stuck_client(node.port, "leaving"):
            other = asyncio.create_task(drain(node.uri))
            await asyncio.sleep(1.0)
        rows, _events, _c = await asyncio.wait_for(other, 30)
        assert set(identities(rows)) == loaded.items

    run(asyncio.wait_for(scenario(), 60))


def test_window_zero_disables_flow_control(loaded: Loaded) -> None:
    """CONTROL connection_buffer_size=0 turns flow control off (docs/protocol.md §2.14).

    No stall at all.
    """
    node = loaded.node

    async def scenario() -> None:
        client = await RawDcpClient.open(node.port, 0, name="nowindow")
        try:
            await client.read_until_quiet(quiet=1.0, limit=60)
            # every document arrived (plus markers) without a single ack
            assert client.messages >= DOCS
            assert client.dcp_bytes > loaded.value_bytes
        finally:
            await client.aclose()

    run(asyncio.wait_for(scenario(), 90))
