"""Garbage, half frames and rude peers against a real `upr serve` process.

What docs/commands/serve.md promises: a peer sending bytes that do not frame (bad magic, huge
lengths) is disconnected and the node keeps serving everyone else; a well-framed but
wrong request gets a status, not a disconnect. Hypothesis generates the bytes
(docs/protocol.md §1.6: header checks before any body is read, frame limits,
per-opcode validation). After every example the node must be alive, must have closed
the connection once we closed our side, must have sent only well-framed responses (or
DCP traffic), must have logged no internal error, and a fresh authenticated client must
still SET and GET. The other tests cover a truncated frame followed by silence, a
request sent one byte at a time, peers that vanish in the middle of DCP streams (no
stream work left behind, no crash), and a peer that never reads its responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import socket
import struct
import time
from collections import deque
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import PASSWORD, USER, Node, upr
from tests.e2e.e2e_helpers import Watched, drain, run, wait_persisted, watched_node
from upr_cli.net.scram import plain_message
from upr_cli.protocol import Frame, FrameDecoder, decode_message
from upr_cli.protocol.header import HEADER, RESPONSE_MAGICS, Magic, Opcode
from upr_cli.protocol.messages import (
    Control,
    DcpOpen,
    Get,
    GetAllVbSeqnos,
    Hello,
    Request,
    ResponseMessage,
    SaslAuth,
    SelectBucket,
    Set,
    Stat,
    StatResponse,
    StreamRequest,
)
from upr_cli.protocol.status import Status

MAX_BODY = 20 * 1024 * 1024  # the node's frame limit (NodeConfig.max_body)
VALID_MAGICS = [int(m) for m in Magic]
DCP_PUSHED = frozenset(range(Opcode.DCP_STREAM_END, Opcode.DCP_SEQNO_ADVANCED + 1))
FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_keys = itertools.count()


# ---------------------------------------------------------------- a blocking client


class Client:
    """A blocking client speaking our codec over a plain socket."""

    def __init__(self, port: int, *, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.decoder = FrameDecoder()
        self.pending: deque[Frame] = deque()  # frames received, not yet looked at
        self.opaques = itertools.count(1)

    def request(self, msg: Request | bytes, opaque: int | None = None) -> ResponseMessage:
        """Send and wait for the response carrying `opaque` (skipping anything else)."""
        data = msg if isinstance(msg, bytes) else msg.encode()
        want = opaque if opaque is not None else getattr(msg, "opaque", None)
        self.sock.sendall(data)
        return self.wait_response(want)

    def wait_response(self, opaque: int | None) -> ResponseMessage:
        """The next response with `opaque` (any opaque if None)."""
        while True:
            while self.pending:
                frame = self.pending.popleft()
                if frame.magic in RESPONSE_MAGICS and opaque in (None, frame.opaque):
                    msg = decode_message(frame)
                    assert isinstance(msg, ResponseMessage)
                    return msg
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""  # closed with unread bytes pending: a reset, the same verdict
            if not data:
                raise AssertionError("the node closed the connection")
            self.decoder.feed(data)
            self.pending.extend(self.decoder.frames())

    def bootstrap(self) -> None:
        """HELLO, SASL PLAIN, SELECT_BUCKET."""
        assert self.request(Hello(agent="robust", opaque=next(self.opaques))).status == 0
        auth = SaslAuth(
            mechanism="PLAIN", payload=plain_message(USER, PASSWORD), opaque=next(self.opaques)
        )
        assert self.request(auth).status == 0
        assert self.request(SelectBucket(bucket="default", opaque=next(self.opaques))).status == 0

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def set_and_get(port: int) -> None:
    """A fresh authenticated client can SET and GET a key."""
    key = f"health-{next(_keys)}".encode()
    value = b'{"ok": true, "n": %d}' % next(_keys)
    with Client(port) as c:
        c.bootstrap()
        assert c.request(Set(key=key, value=value, datatype=1, opaque=100)).status == 0
        got = c.request(Get(key=key, opaque=101))
        assert got.status == 0 and getattr(got, "value", None) == value


def abort(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the rudest way to leave."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# ---------------------------------------------------------------- the shared node


def assert_healthy(w: Watched) -> None:
    """Alive, no internal error logged, and a fresh client can SET and GET."""
    assert w.node.alive(), "".join(w.stderr)[-4000:]
    set_and_get(w.node.port)
    text = "".join(w.stderr)
    assert "Traceback" not in text and "Unhandled exception" not in text, text[-4000:]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
    """One node for the fuzz tests (Hypothesis runs many examples against it)."""
    node = Node(tmp_path_factory.mktemp("robust") / "node", "--flush-interval", "0.02")
    with watched_node(node) as w:
        yield w


# ---------------------------------------------------------------- sending garbage


def send_then_half_close(port: int, data: bytes, *, timeout: float = 5.0) -> list[Frame]:
    """Send `data`, shut our write side, read until the node closes; return its frames.

    The node must close within `timeout` once it has read our FIN (or earlier, if the
    bytes did not frame), and everything it sent must be well-framed responses.
    """
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    received = bytearray()
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(f"connection kept open after {data[:64]!r}") from None
            if not chunk:
                break
            received += chunk
            if time.monotonic() > deadline:
                raise AssertionError("the node kept sending")
    finally:
        sock.close()
    dec = FrameDecoder(max_body=MAX_BODY)
    dec.feed(received)
    frames = dec.frames()  # raises on anything that does not frame
    assert dec.buffered == 0, f"{dec.buffered} trailing bytes from the node"
    for f in frames:
        # responses, or DCP traffic if the bytes happened to log in and open a stream
        pushed = f.magic == Magic.REQUEST and f.opcode in DCP_PUSHED
        assert f.magic in RESPONSE_MAGICS or pushed, f"the node sent request 0x{f.opcode:02x}"
        decode_message(f)  # everything decodes
    return frames


def expect_disconnect(port: int, data: bytes, *, timeout: float = 3.0) -> None:
    """Send `data` and keep our side open: the node must hang up by itself."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        try:
            while sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError(f"not disconnected in {timeout:g}s after {data[:32]!r}") from None
    finally:
        sock.close()


def header(
    magic: int,
    opcode: int,
    keylen: int,
    extlen: int,
    datatype: int,
    vb: int,
    bodylen: int,
    opaque: int = 0,
    cas: int = 0,
) -> bytes:
    """A raw 24-byte header (classic layout; for 0x08/0x18 keylen's high byte is framing)."""
    return HEADER.pack(magic, opcode, keylen, extlen, datatype, vb, bodylen, opaque, cas)


VALID_REQUESTS: list[bytes] = [
    Hello(agent="fuzz", features=(0x03, 0x07, 0x0B), opaque=7).encode(),
    SaslAuth(mechanism="PLAIN", payload=plain_message(USER, PASSWORD), opaque=8).encode(),
    SaslAuth(mechanism="PLAIN", payload=plain_message(USER, "wrong"), opaque=8).encode(),
    SelectBucket(bucket="default", opaque=9).encode(),
    Set(key=b"fuzz", value=b'{"a": 1}', datatype=1, flags=5, opaque=10).encode(),
    Get(key=b"fuzz", opaque=11).encode(),
    Stat(group="vbucket-seqno", opaque=12).encode(),
    DcpOpen(name="fuzz", flags=1, opaque=13).encode(),
    StreamRequest(vbucket=3, opaque=14).encode(),
    Control(name="connection_buffer_size", value="1024", opaque=15).encode(),
    GetAllVbSeqnos(opaque=16).encode(),
]


@st.composite
def random_header_frame(draw: st.DrawFn) -> bytes:
    """A 24-byte header with arbitrary fields, then up to 300 bytes of body."""
    magic = draw(st.sampled_from(VALID_MAGICS) | st.integers(0, 255))
    bodylen = draw(
        st.integers(0, 64) | st.integers(0, MAX_BODY) | st.integers(MAX_BODY + 1, 2**32 - 1)
    )
    hdr = header(
        magic,
        draw(st.integers(0, 255)),
        draw(st.integers(0, 0xFFFF)),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 0xFFFF)),
        bodylen,
        draw(st.integers(0, 2**32 - 1)),
        draw(st.integers(0, 2**64 - 1)),
    )
    return hdr + draw(st.binary(max_size=min(bodylen, 300)))


@st.composite
def truncated_request(draw: st.DrawFn) -> bytes:
    """A valid request (or a pipeline of them) cut at an arbitrary point."""
    data = b"".join(draw(st.lists(st.sampled_from(VALID_REQUESTS), min_size=1, max_size=4)))
    return data[: draw(st.integers(0, len(data)))]


@st.composite
def lengths_that_do_not_fit(draw: st.DrawFn) -> bytes:
    """extras + key (+ framing) longer than the declared body."""
    magic = draw(st.sampled_from([0x80, 0x81, 0x82, 0x83, 0x08, 0x18]))
    extlen = draw(st.integers(0, 255))
    if magic in (0x08, 0x18):
        framelen, keylen = draw(st.integers(0, 255)), draw(st.integers(0, 255))
        keyfield, need = (framelen << 8) | keylen, framelen + keylen + extlen
    else:
        keyfield = draw(st.integers(0, 0xFFFF))
        need = keyfield + extlen
    if need == 0:
        keyfield, need = 1, 1 + extlen
    bodylen = draw(st.integers(0, need - 1))
    hdr = header(magic, draw(st.integers(0, 255)), keyfield, extlen, 0, 0, bodylen)
    return hdr + draw(st.binary(max_size=min(bodylen, 64)))


@st.composite
def hello_then_garbage(draw: st.DrawFn) -> bytes:
    """A valid HELLO, then arbitrary bytes."""
    return VALID_REQUESTS[0] + draw(st.binary(max_size=400))


unframeable = st.one_of(
    # a first byte that is no magic at all
    st.builds(
        lambda b, rest: bytes([b]) + rest,
        st.integers(0, 255).filter(lambda b: b not in VALID_MAGICS),
        st.binary(min_size=23, max_size=100),
    ),
    # a valid magic claiming a body above the node's 20 MiB limit
    st.builds(
        lambda m, n, rest: header(m, 0x01, 0, 0, 0, 0, n) + rest,
        st.sampled_from(VALID_MAGICS),
        st.integers(MAX_BODY + 1, 2**32 - 1),
        st.binary(max_size=100),
    ),
    lengths_that_do_not_fit(),
)


@FUZZ
@given(data=st.binary(max_size=600))
@example(data=b"")
@example(data=b"\x80")
@example(data=b"\x00" * 24)
@example(data=b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
@example(data=b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40)  # a TLS hello
def test_arbitrary_bytes_never_hurt_the_node(shared: Watched, data: bytes) -> None:
    send_then_half_close(shared.node.port, data)
    assert_healthy(shared)


@FUZZ
@given(
    data=st.one_of(
        random_header_frame(), truncated_request(), hello_then_garbage(), lengths_that_do_not_fit()
    )
)
@example(data=header(0x80, Opcode.SET, 1, 8, 0, 0, MAX_BODY))  # a 20 MiB body never sent
@example(data=header(0x80, Opcode.GET, 0, 0, 0, 0, 2**32 - 1))
@example(data=header(0x08, Opcode.GET, 0xFF01, 0, 0, 0, 4) + b"\xff" * 4)  # framing overrun
@example(data=header(0x08, Opcode.GET, 0x0301, 0, 0, 0, 4) + b"\xff" * 4)  # bad frame info
@example(data=header(0x80, Opcode.SET, 1, 3, 0, 0, 5) + b"\0\0\0k" + b"v")  # wrong extras
@example(data=header(0x80, 0xEE, 0, 0, 0, 0, 0))  # unknown opcode
@example(data=header(0x83, 0x01, 0, 0, 0, 0, 0) + VALID_REQUESTS[0])  # a server response
@example(data=b"".join(VALID_REQUESTS))  # the whole pipeline, unauthenticated order
def test_structured_garbage_never_hurts_the_node(shared: Watched, data: bytes) -> None:
    send_then_half_close(shared.node.port, data)
    assert_healthy(shared)


@settings(FUZZ, max_examples=60)
@given(data=unframeable)
@example(data=b"\x00" * 24)
@example(data=header(0x80, Opcode.GET, 0, 0, 0, 0, MAX_BODY + 1))
@example(data=header(0x80, Opcode.GET, 5, 4, 0, 0, 8))
def test_bytes_that_do_not_frame_are_disconnected_at_once(shared: Watched, data: bytes) -> None:
    """Bad magic, a body over the limit, lengths that overrun the body: hang up, do not wait."""
    expect_disconnect(shared.node.port, data)
    assert_healthy(shared)


def well_framed(
    magic: int,
    opcode: int,
    vb: int,
    datatype: int,
    extras: bytes,
    key: bytes,
    value: bytes,
    cas: int,
) -> bytes:
    """A frame whose lengths are all consistent, whatever it says."""
    body = len(extras) + len(key) + len(value)
    return (
        header(magic, opcode, len(key), len(extras), datatype, vb, body, 0x1234, cas)
        + extras
        + key
        + value
    )


# Client-sent DCP data messages whose extras have the wrong length: once a bug (the node
# disconnected instead of answering EINVAL); the fuzz test covers them again, and the
# dedicated test below pins the status.
DCP_DATA_EXTRAS = {
    Opcode.DCP_MUTATION: (31,),
    Opcode.DCP_DELETION: (18, 21),
    Opcode.DCP_EXPIRATION: (20,),
}


def known_disconnect(frame: bytes) -> bool:
    """A classic-magic DCP mutation/deletion/expiration with a bad extras length."""
    allowed = DCP_DATA_EXTRAS.get(frame[1])
    return frame[0] == Magic.REQUEST and allowed is not None and frame[4] not in allowed


nonsense_frame = st.builds(
    well_framed,
    magic=st.sampled_from([0x80, 0x80, 0x80, 0x81, 0x82, 0x83]),
    opcode=st.sampled_from([int(o) for o in Opcode]) | st.integers(0, 255),
    vb=st.integers(0, 20) | st.integers(0, 0xFFFF),
    datatype=st.integers(0, 255),
    extras=st.binary(max_size=48)
    | st.sampled_from([b"\0" * n for n in (4, 8, 18, 20, 21, 24, 31, 48)]),
    key=st.binary(max_size=40) | st.text(max_size=20).map(str.encode),
    value=st.binary(max_size=200),
    cas=st.integers(0, 2**64 - 1),
)


@FUZZ
@given(frames=st.lists(nonsense_frame, min_size=1, max_size=6))
def test_well_framed_nonsense_after_login_gets_statuses_not_a_disconnect(
    shared: Watched, frames: list[bytes]
) -> None:
    """Any consistent frame, however wrong, is answered (or ignored); the session survives."""
    with Client(shared.node.port) as c:
        c.bootstrap()
        c.sock.sendall(b"".join(frames))
        # a marker request after the nonsense: answered on the same, still open, connection
        resp = c.request(Get(key=b"no-such-key-\xff", opaque=0xFEEDFACE))
        assert resp.status in (0x00, 0x01, 0x07), hex(resp.status)
    assert_healthy(shared)


@pytest.mark.parametrize(
    ("opcode", "extras"),
    [(Opcode.DCP_MUTATION, 0), (Opcode.DCP_DELETION, 4), (Opcode.DCP_EXPIRATION, 8)],
    ids=["mutation", "deletion", "expiration"],
)
def test_a_dcp_data_message_with_bad_extras_from_a_client_gets_einval(
    shared: Watched, opcode: int, extras: int
) -> None:
    frame = well_framed(Magic.REQUEST, opcode, 0, 0, b"\0" * extras, b"k", b"v", 0)
    assert known_disconnect(frame)
    with Client(shared.node.port) as c:
        c.bootstrap()
        assert c.request(frame, opaque=0x1234).status == Status.EINVAL
        assert c.request(Get(key=b"k", opaque=0xFEEDFACE)).status in (0x00, 0x01)
    assert_healthy(shared)


# ---------------------------------------------------------------- slow and partial peers


def test_a_truncated_frame_followed_by_silence_does_not_stall_anyone(shared: Watched) -> None:
    port = shared.node.port
    with Client(port) as half_header, Client(port) as half_body:
        half_body.bootstrap()
        full = Set(key=b"late", value=b"x" * 500, opaque=77).encode()
        half_header.sock.sendall(Hello(agent="slow", opaque=76).encode()[:10])
        half_body.sock.sendall(full[:100])
        time.sleep(0.3)
        # everyone else is served meanwhile: KV and a whole DCP drain
        t0 = time.monotonic()
        set_and_get(port)
        with Client(port) as c:
            c.bootstrap()
            stats = _stats(c, "")
        assert int(stats["curr_connections"]) >= 3
        rows, _events, _c = run(drain(_uri(port)))
        assert any(bytes(r[9]).startswith(b"health-") for r in rows)
        assert time.monotonic() - t0 < 10
        # the silent peers finish their frames late: both are answered correctly
        half_body.sock.sendall(full[100:])
        assert half_body.request(b"", opaque=77).status == 0
        half_header.sock.sendall(Hello(agent="slow", opaque=76).encode()[10:])
        assert half_header.request(b"", opaque=76).status == 0
    assert_healthy(shared)


def test_requests_sent_one_byte_at_a_time_are_understood(shared: Watched) -> None:
    with Client(shared.node.port) as c:
        pipeline = b"".join(
            [
                Hello(agent="trickle", opaque=1).encode(),
                SaslAuth(
                    mechanism="PLAIN", payload=plain_message(USER, PASSWORD), opaque=2
                ).encode(),
                SelectBucket(bucket="default", opaque=3).encode(),
                Set(key=b"trickle", value=b"drop by drop", opaque=4).encode(),
                Get(key=b"trickle", opaque=5).encode(),
            ]
        )
        for i in range(len(pipeline)):
            c.sock.send(pipeline[i : i + 1])
        statuses = [c.wait_response(op).status for op in (1, 2, 3, 4)]
        got = c.wait_response(5)
    assert statuses == [0, 0, 0, 0]
    assert got.status == 0 and getattr(got, "value", None) == b"drop by drop"


# ---------------------------------------------------------------- peers that vanish mid-stream


def _uri(port: int) -> str:
    return f"upr://{USER}:{PASSWORD}@127.0.0.1:{port}/default"


def _stats(c: Client, group: str) -> dict[str, str]:
    opaque = next(c.opaques) + 1000
    c.sock.sendall(Stat(group=group, opaque=opaque).encode())
    out: dict[str, str] = {}
    while True:
        msg = c.wait_response(opaque)
        if isinstance(msg, StatResponse):
            if not msg.name and not msg.value:
                return out
            out[msg.name] = msg.value
        else:
            raise AssertionError(f"STAT {group!r}: status 0x{msg.status:02x}")


def _open_streams_and_vanish(
    port: int, partitions: int, *, window: int | None = None, read: int = 64 * 1024
) -> None:
    """Open DCP streams on every partition, read about `read` bytes, then reset the socket."""
    c = Client(port)
    try:
        c.bootstrap()
        assert c.request(DcpOpen(name=f"vanish-{next(_keys)}", flags=1, opaque=50)).status == 0
        if window is not None:
            ctl = Control(name="connection_buffer_size", value=str(window), opaque=51)
            assert c.request(ctl).status == 0
        c.sock.sendall(
            b"".join(
                StreamRequest(vbucket=vb, opaque=0x200 + vb).encode() for vb in range(partitions)
            )
        )
        got = 0
        deadline = time.monotonic() + 5
        while got < read and time.monotonic() < deadline:
            try:
                chunk = c.sock.recv(1 << 16)
            except TimeoutError:
                break
            if not chunk:
                raise AssertionError("the node closed a DCP connection by itself")
            got += len(chunk)
            if window is not None and got > window:
                break  # a stalled stream: leave while it waits for an ack
        assert got > 0
    finally:
        abort(c.sock)


def _wait_connections(port: int, expected: int, timeout: float = 10.0) -> None:
    """Poll STAT curr_connections (our own connection included) until it is `expected`."""
    with Client(port) as c:
        c.bootstrap()
        deadline = time.monotonic() + timeout
        while (n := int(_stats(c, "")["curr_connections"])) != expected:
            assert time.monotonic() < deadline, f"{n} sessions linger, expected {expected}"
            time.sleep(0.05)


def test_peers_vanishing_mid_stream_leave_no_stream_work_behind(node_factory: type[Node]) -> None:
    """Streams from the write queue (nothing persisted yet): 8 peers reset mid-stream."""
    with watched_node(node_factory("--flush-interval", "60")) as w:
        node = w.node
        upr("load", node.uri, "--docs", "2000", "--size", "4000", "--seed", "5")
        for i in range(8):  # with and without a flow-control window
            _open_streams_and_vanish(node.port, 16, window=4096 if i % 2 else None)
        _wait_connections(node.port, 1)
        t0 = time.monotonic()
        rows, _events, _c = run(drain(node.uri))
        assert len({bytes(r[9]) for r in rows if r[0] == 0x57}) == 2000
        assert time.monotonic() - t0 < 20
        assert_healthy(w)


def test_peers_vanishing_mid_backfill_do_not_crash_the_node(node_factory: type[Node]) -> None:
    """Persisted data, 4 partitions of ~8 MB: peers reset while their backfills run."""
    with watched_node(
        node_factory("--flush-interval", "0.02", partitions=4), clean_stop=False
    ) as w:
        node = w.node
        upr("load", node.uri, "--docs", "4000", "--size", "8000", "--seed", "6")
        wait_persisted(node.uri)
        rng = random.Random(1234)
        for _ in range(150):  # the race needs a few tries; stop at the first casualty
            with contextlib.suppress(OSError, AssertionError):
                _open_streams_and_vanish(node.port, 4, read=rng.randrange(256_000, 8_000_000))
            if not node.alive() or "Traceback" in "".join(w.stderr):
                break
        time.sleep(0.2)
        assert node.alive(), f"the node died ({node.proc.poll() if node.proc else None})"
        assert_healthy(w)
        _wait_connections(node.port, 1)
        # no backfill slot leaked: a full drain is prompt and complete (the loaded documents
        # plus the probe key assert_healthy wrote)
        rows, _events, _c = run(asyncio.wait_for(drain(node.uri), 30))
        loaded = {bytes(r[9]) for r in rows if r[0] == 0x57 and bytes(r[9]).startswith(b"doc-")}
        assert len(loaded) == 4000


def test_a_peer_that_never_reads_its_responses_does_not_grow_the_node(
    node_factory: type[Node],
) -> None:
    with watched_node(node_factory("--flush-interval", "0.02")) as w, Client(w.node.port) as c:
        node = w.node
        c.bootstrap()
        assert c.request(Set(key=b"big", value=b"x" * 1_000_000, opaque=9)).status == 0
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        time.sleep(0.3)
        before = node.rss_kib()
        c.sock.sendall(Get(key=b"big", opaque=10).encode() * 120)  # ~120 MB of responses
        peak = before
        for _ in range(10):
            time.sleep(0.2)
            peak = max(peak, node.rss_kib())
        abort(c.sock)
        growth_mib = (peak - before) / 1024
        assert_healthy(w)
    assert growth_mib < 64, f"node RSS grew by {growth_mib:.0f} MiB for one idle reader"
