"""A hand-driven DCP connection for the producer's collections tests: raw frames over a
real socket to an in-process node (tests/dcp/inprocess.py), so that what the producer
sends (keys with or without their collection id, SYSTEM_EVENT, SEQNO_ADVANCED, the
STREAM_END status) is seen as it is on the wire, without a consumer in between."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from upr_cli.collections import CollectionsManifest, Path
from upr_cli.node.bucket import Bucket
from upr_cli.protocol import Frame, FrameDecoder, decode_message
from upr_cli.protocol.header import RESPONSE_MAGICS, Feature, Opcode
from upr_cli.protocol.leb128 import join_key
from upr_cli.protocol.messages import (
    Control,
    DcpOpen,
    Hello,
    Message,
    ResponseMessage,
    SelectBucket,
    StreamEnd,
    StreamRequest,
)

FEATURES = (Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON)


@dataclass
class Answer:
    """A response: its status and value."""

    status: int
    value: bytes = b""

    def json(self) -> dict[str, object]:
        """The value as a JSON object."""
        doc = json.loads(self.value)
        assert isinstance(doc, dict)
        return doc


@dataclass
class RawDcp:
    """One DCP connection: every response by opaque, every stream message in order."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    answers: dict[int, Answer] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    _opaque: int = 0x10

    @classmethod
    async def open(cls, port: int, *, collections: bool, noop: bool = True) -> RawDcp:
        """HELLO (with or without Collections), SELECT_BUCKET, DCP_OPEN as a producer."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        self = cls(reader, writer)
        features = (*FEATURES, Feature.COLLECTIONS) if collections else FEATURES
        for msg in (
            Hello(agent="raw-collections", features=features, opaque=1),
            SelectBucket(bucket="default", opaque=2),
            DcpOpen(name=f"raw-collections-{id(self):x}", flags=0x01, opaque=3),
        ):
            assert (await self.request(msg)).status == 0, msg
        if noop:
            assert (await self.request(Control(name="enable_noop", value="true"))).status == 0
        return self

    def _next(self) -> int:
        self._opaque += 1
        return self._opaque

    async def request(self, msg: Message, timeout: float = 1.0) -> Answer:
        """Send a request (a fresh opaque unless it has one) and wait for its answer."""
        if not msg.opaque:
            msg = dataclasses.replace(msg, opaque=self._next())
        self.writer.write(msg.encode())
        await self.writer.drain()
        await self.read_until(lambda: msg.opaque in self.answers, timeout)
        return self.answers[msg.opaque]

    async def stream(self, vb: int, value: object = None, *, start: int = 0,
                     end: int = 2**64 - 1) -> tuple[int, Answer]:  # fmt: skip
        """STREAM_REQ (a dict value is sent as JSON); (its opaque, the answer)."""
        raw = json.dumps(value).encode() if isinstance(value, dict) else value or b""
        assert isinstance(raw, bytes)
        opaque = self._next()
        req = StreamRequest(vbucket=vb, opaque=opaque, start_seqno=start, end_seqno=end,
                            snap_start_seqno=start, snap_end_seqno=start, value=raw)  # fmt: skip
        return opaque, await self.request(req)

    def of(self, opaque: int) -> list[Message]:
        """The messages of one stream, in order."""
        return [m for m in self.messages if m.opaque == opaque]

    def end_status(self, opaque: int) -> int | None:
        """The stream's STREAM_END status, None while it runs."""
        ends = [m for m in self.of(opaque) if isinstance(m, StreamEnd)]
        return ends[-1].status if ends else None

    async def read_until(self, done: Callable[[], bool], timeout: float = 1.0) -> None:
        """Read frames until `done()`; a timeout fails the test."""
        async with asyncio.timeout(timeout):
            while not done():
                data = await self.reader.read(1 << 16)
                assert data, "the node closed the connection"
                self.decoder.feed(data)
                for frame in self.decoder.frames():
                    self._take(frame)

    async def settle(self, seconds: float = 0.1) -> None:
        """Read whatever comes within `seconds`."""
        with contextlib.suppress(TimeoutError):
            await self.read_until(lambda: False, seconds)

    def _take(self, frame: Frame) -> None:
        msg = decode_message(frame)
        if frame.magic in RESPONSE_MAGICS:
            assert isinstance(msg, ResponseMessage)
            self.answers[frame.opaque] = Answer(msg.status, bytes(getattr(msg, "value", b"")))
        elif frame.opcode != Opcode.DCP_NOOP:
            self.messages.append(msg)

    async def aclose(self) -> None:
        """Close the socket."""
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@contextlib.asynccontextmanager
async def raw_dcp(port: int, *, collections: bool, noop: bool = True) -> AsyncIterator[RawDcp]:
    """A RawDcp closed at the end, whatever happened."""
    conn = await RawDcp.open(port, collections=collections, noop=noop)
    try:
        yield conn
    finally:
        await conn.aclose()


async def create(bucket: Bucket, *paths: str, max_ttl: int | None = None) -> CollectionsManifest:
    """Create scopes and collections (`S` or `S.C`, a missing scope too) in the bucket."""
    m = bucket.manifest
    for text in paths:
        p = Path.parse(text)
        if m.scope(p.scope) is None:
            m = m.with_scope(p.scope)
        if p.collection is not None and m.lookup(p) is None:
            m = m.with_collection(p.scope, p.collection, max_ttl)
    await bucket.set_manifest(m)
    return m


async def drop(bucket: Bucket, path: str) -> CollectionsManifest:
    """Drop a scope or collection in the bucket."""
    m = bucket.manifest.without(Path.parse(path))
    await bucket.set_manifest(m)
    return m


def cid(bucket: Bucket, path: str) -> int:
    """The id of a collection (`S.C`) in the bucket's manifest."""
    found = bucket.manifest.lookup(Path.parse(path))
    assert found is not None, path
    return found.id


def put(bucket: Bucket, vb: int, path: str, key: str, value: bytes = b'{"v":1}') -> int:
    """SET a document in a collection (`S.C`); its seq."""
    return bucket.store("set", vb, join_key(cid(bucket, path), key.encode()), value,
                        datatype=1).seq  # fmt: skip
