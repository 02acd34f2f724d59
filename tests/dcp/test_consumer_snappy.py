"""The consumer's side of Snappy (formats/wire.md "Snappy"), against a scripted server:
it offers Snappy in HELLO unless compression is "off", asks `force_value_compression`
only with "force" and where Snappy was granted (and carries on when refused), and
inflates every compressed value once, so its callers see plain values with the Snappy
bit clear. A value that does not inflate is a typed error naming the key."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from tests.dcp.inprocess import run
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.errors import RemoteProtocolError
from upr_cli.jobs.backup_stream import stream_to_segments
from upr_cli.jobs.replay import replay_node
from upr_cli.jobs.tail import TailOptions, tail
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.protocol import FrameDecoder, Message, decode_message, snappy
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.protocol.header import Feature, Opcode
from upr_cli.protocol.messages import (
    Control,
    DcpOpen,
    Deletion,
    GetAllVbSeqnos,
    GetAllVbSeqnosResponse,
    GetClusterConfig,
    Hello,
    HelloResponse,
    Mutation,
    Response,
    SelectBucket,
    SnapshotMarker,
    StreamEnd,
    StreamRequest,
    StreamRequestOk,
)
from upr_cli.protocol.snappy import CorruptValueError
from upr_cli.protocol.status import Status
from upr_cli.segments.reader import SegmentReader

UUID = 0xC0FFEE
DOC = b'{"name":"compressible","pad":"' + b"xy" * 300 + b'"}'
JSON, SNAPPY = 0x01, 0x02


@dataclass
class SnappyNode:
    """A scripted server of one partition without collections: grants Snappy when
    `grant`, answers `force_value_compression` with SUCCESS when `force_ok` (else
    EINVAL, as a server that does not allow it), then streams `script`."""

    script: list[Message]
    grant: bool = True
    force_ok: bool = True
    offered: list[int] = field(default_factory=list)
    controls: dict[str, str] = field(default_factory=dict)
    port: int = 0
    _server: asyncio.Server | None = None
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    @property
    def uri(self) -> SourceUri:
        """A URI for the node."""
        return SourceUri.parse(f"upr://127.0.0.1:{self.port}/default")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        decoder = FrameDecoder()
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                decoder.feed(data)
                for frame in decoder.frames():
                    for out in self._answer(decode_message(frame)):
                        writer.write(out)

    def _answer(self, msg: Message) -> list[bytes]:
        op = msg.opaque
        if isinstance(msg, Hello):
            self.offered = list(msg.features)
            granted = tuple(f for f in msg.features if f == Feature.SNAPPY and self.grant)
            return [HelloResponse(opaque=op, features=granted).encode()]
        if isinstance(msg, GetClusterConfig):
            config = {"rev": 1, "vBucketServerMap": {"serverList": [f"$HOST:{self.port}"],
                                                     "vBucketMap": [[0]]}}  # fmt: skip
            return [Response(opcode=Opcode.GET_CLUSTER_CONFIG, opaque=op,
                             value=json.dumps(config).encode(), datatype=1).encode()]  # fmt: skip
        if isinstance(msg, Control):
            self.controls[msg.name] = msg.value
            refused = msg.name == "force_value_compression" and not self.force_ok
            return [Response(opcode=Opcode.DCP_CONTROL, opaque=op,
                             status=Status.EINVAL if refused else 0).encode()]  # fmt: skip
        if isinstance(msg, SelectBucket | DcpOpen):
            return [Response(opcode=msg.SCHEMA.opcodes[0], opaque=op).encode()]
        if isinstance(msg, GetAllVbSeqnos):
            return [GetAllVbSeqnosResponse(opaque=op, seqnos=((0, 3),)).encode()]
        if isinstance(msg, StreamRequest):
            out = [StreamRequestOk(opaque=op, failover_log=((UUID, 0),)).encode()]
            out += [replace(m, opaque=op, vbucket=msg.vbucket).encode() for m in self.script]
            return out
        raise AssertionError(f"SnappyNode: unexpected {msg!r}")


@contextlib.asynccontextmanager
async def serving(node: SnappyNode) -> AsyncIterator[SnappyNode]:
    """The node, listening on a free loopback port until the block ends."""
    node._server = await asyncio.start_server(node._serve, "127.0.0.1", 0)
    node.port = node._server.sockets[0].getsockname()[1]
    try:
        yield node
    finally:
        node._server.close()
        for w in node._writers:
            w.close()
        for w in node._writers:
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()
        await node._server.wait_closed()


async def drain(consumer: DcpConsumer) -> list[DcpRecord]:
    """Every record the consumer hands over until its stream ends."""
    out: list[DcpRecord] = []
    async for batch in consumer.batches():
        out += [it._replace(key=bytes(it.key), value=bytes(it.value))
                for it in batch if isinstance(it, DcpRecord)]  # fmt: skip
        consumer.commit()
    return out


def _script(packed: bytes) -> list[Message]:
    return [
        SnapshotMarker(start_seqno=0, end_seqno=3, flags=0x06),
        Mutation(by_seqno=1, key=b"packed", value=packed, datatype=SNAPPY | JSON),
        Mutation(by_seqno=2, key=b"plain", value=b'{"v":1}', datatype=JSON),
        Deletion(by_seqno=3, key=b"gone"),
        StreamEnd(status=0),
    ]


def _seen(records: list[DcpRecord]) -> list[tuple[int, bytes, int, bytes]]:
    return [(r.by_seqno, bytes(r.key), r.datatype, bytes(r.value)) for r in records]


INFLATED = [(1, b"packed", JSON, DOC), (2, b"plain", JSON, b'{"v":1}'), (3, b"gone", 0, b"")]


@pytest.mark.parametrize("force_ok", [True, False], ids=["force-allowed", "force-refused"])
def test_values_arrive_inflated_and_force_compression_is_asked(force_ok: bool) -> None:
    node = SnappyNode(_script(snappy.deflate(DOC)), force_ok=force_ok)

    async def scenario() -> list[DcpRecord]:
        async with serving(node), DcpConsumer(node.uri, until_end=True,
                                              compression="force") as consumer:  # fmt: skip
            return await drain(consumer)

    assert _seen(run(scenario())) == INFLATED
    assert Feature.SNAPPY in node.offered
    assert node.controls["force_value_compression"] == "true"


def test_by_default_snappy_is_offered_but_not_forced() -> None:
    # "auto": a value the server holds compressed still comes compressed and is inflated
    node = SnappyNode(_script(snappy.deflate(DOC)))

    async def scenario() -> list[DcpRecord]:
        async with serving(node), DcpConsumer(node.uri, until_end=True) as consumer:
            return await drain(consumer)

    assert _seen(run(scenario())) == INFLATED
    assert Feature.SNAPPY in node.offered
    assert "force_value_compression" not in node.controls


def test_no_force_compression_where_snappy_was_not_granted() -> None:
    # a server without Snappy sends plain values; the consumer asks nothing more
    node = SnappyNode(_script(DOC)[:1] + _script(DOC)[2:], grant=False)

    async def scenario() -> list[DcpRecord]:
        async with serving(node), DcpConsumer(node.uri, until_end=True,
                                              compression="force") as consumer:  # fmt: skip
            return await drain(consumer)

    assert _seen(run(scenario())) == INFLATED[1:]
    assert "force_value_compression" not in node.controls
    assert "connection_buffer_size" in node.controls


def test_snappy_can_be_left_out_of_hello() -> None:
    node = SnappyNode(_script(DOC)[:1] + _script(DOC)[2:])

    async def scenario() -> None:
        async with serving(node), DcpConsumer(node.uri, until_end=True, compression="off") as c:
            await drain(c)

    run(scenario())
    assert Feature.SNAPPY not in node.offered
    assert "force_value_compression" not in node.controls


def test_a_corrupt_value_is_a_typed_error_naming_the_key() -> None:
    node = SnappyNode(_script(snappy.deflate(DOC)[:-20]))

    async def scenario() -> Any:
        async with serving(node), DcpConsumer(node.uri, until_end=True) as consumer:
            return await drain(consumer)

    with pytest.raises(CorruptValueError, match="key 'packed': corrupt Snappy value") as err:
        run(scenario())
    assert isinstance(err.value, RemoteProtocolError)


# -- the tools see plain values ------------------------------------------------------


def test_tail_prints_the_inflated_json() -> None:
    node = SnappyNode(_script(snappy.deflate(DOC)))
    out = io.StringIO()

    async def scenario() -> None:
        async with serving(node):
            await tail(node.uri, TailOptions(until_end=True, fmt="json"), out=out)

    run(scenario())
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["key"], r.get("value")) for r in lines] == [
        ("packed", json.loads(DOC)),
        ("plain", {"v": 1}),
        ("gone", None),
    ]


def test_backup_stores_values_inflated_in_its_segments(tmp_path: Path) -> None:
    node = SnappyNode(_script(snappy.deflate(DOC)))

    async def scenario() -> None:
        async with serving(node):
            await stream_to_segments(
                node.uri, tmp_path, bucket="default", positions={0: StreamPosition(0)},
                segment_name=lambda p, a, b: f"seg-{p}-{a}-{b}",
            )  # fmt: skip

    run(scenario())
    (path,) = tmp_path.glob("seg-*")
    with SegmentReader(path) as reader:
        got = [(bytes(r.key), r.datatype, bytes(r.value)) for r in reader.records()]
    assert got == [(b"packed", JSON, DOC), (b"plain", JSON, b'{"v":1}'), (b"gone", 0, b"")]


def test_replay_stores_the_inflated_value_as_json_text(tmp_path: Path) -> None:
    node = SnappyNode(_script(snappy.deflate(DOC)))
    db = tmp_path / "replay.db"

    async def scenario() -> None:
        async with serving(node):
            await replay_node(node.uri, db)

    run(scenario())
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT key, datatype, typeof(value), CAST(value AS BLOB) FROM documents"
            " WHERE deleted = 0 ORDER BY key"
        ).fetchall()
    assert rows == [(b"packed", JSON, "text", DOC), (b"plain", JSON, "text", b'{"v":1}')]
