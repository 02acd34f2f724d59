"""The node's side of Snappy (formats/wire.md "Snappy"): a compressed value is checked and
stored as it came; KV reads hand it out inflated; the DCP producer sends it as stored to
a connection that negotiated Snappy and inflated, Snappy bit clear, to any other, with
`force_value_compression` compressing plain values for the first kind only."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.dcp.inprocess import InProcessNode, nodes, run
from upr_cli.node.bucket import Bucket
from upr_cli.node.producer import DcpProducer, DcpSender
from upr_cli.protocol import FrameDecoder, snappy
from upr_cli.protocol.dcp import OPEN_NO_VALUE_DT, OPEN_PRODUCER
from upr_cli.protocol.messages import Mutation, StreamEnd, StreamRequest, decode_message
from upr_cli.protocol.status import InvalidArguments

VB = 0
DOC = b'{"name":"compressible","pad":"' + b"ab" * 200 + b'"}'
PACKED = snappy.deflate(DOC)
SMALL = b'{"v":1}'  # compressing makes it no smaller: it stays plain
JSON, SNAPPY = 0x01, 0x02


def _key(name: str) -> bytes:
    return b"\x00" + name.encode()  # qualified: the default collection


def _write_three(bucket: Bucket) -> None:
    """k1 stored compressed (JSON), k2 a large plain JSON value, k3 a small one."""
    bucket.store("set", VB, _key("k1"), PACKED, datatype=SNAPPY | JSON)
    bucket.store("set", VB, _key("k2"), DOC, datatype=JSON)
    bucket.store("set", VB, _key("k3"), SMALL, datatype=JSON)


# -- the bucket ---------------------------------------------------------------------


def test_a_compressed_value_is_stored_as_it_came_and_read_inflated(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            b.store("set", VB, _key("k1"), PACKED, datatype=SNAPPY | JSON)
            stored = b.lookup(VB, _key("k1"))
            assert stored is not None and (stored.datatype, stored.value) == (SNAPPY | JSON, PACKED)
            await node.stop()  # a clean stop flushes; after the restart it is read from disk
            await node.start()
            b = node.bucket
            stored = b.lookup(VB, _key("k1"))
            assert stored is not None and (stored.datatype, stored.value) == (SNAPPY | JSON, PACKED)
            got = b.get(VB, _key("k1"))
            assert (got.datatype, got.value) == (JSON, DOC)
            assert b.get_meta(VB, _key("k1")).datatype == JSON
            touched = b.touch(VB, _key("k1"), 0)
            assert (touched.datatype, touched.value) == (JSON, DOC)  # GAT answers inflated
            kept = b.lookup(VB, _key("k1"))
            assert kept is not None and (kept.datatype, kept.value) == (SNAPPY | JSON, PACKED)

    run(scenario())


def test_json_detection_looks_at_the_inflated_body(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            not_json = snappy.deflate(b"not json at all " * 8)
            doc = b.store("set", VB, _key("raw"), not_json, datatype=SNAPPY | JSON)
            assert doc.datatype == SNAPPY  # the JSON bit is cleared, the value kept
            meta = b.store_with_meta(VB, _key("m"), PACKED, deleted=False, flags=0, expiry=0,
                                     rev_seq=5, item_cas=77, datatype=SNAPPY | JSON)  # fmt: skip
            assert (meta.datatype, meta.value) == (SNAPPY | JSON, PACKED)

    run(scenario())


def test_a_corrupt_compressed_value_is_refused_naming_the_key(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            high = b.partitions[VB].high_seq
            corrupt = PACKED[:-10]
            with pytest.raises(InvalidArguments, match=r"'\\x00bad1'.*corrupt Snappy value"):
                b.store("set", VB, _key("bad1"), corrupt, datatype=SNAPPY | JSON)
            with pytest.raises(InvalidArguments, match="bad2"):
                b.store_with_meta(VB, _key("bad2"), b"\x40\x00", deleted=False, flags=0,
                                  expiry=0, rev_seq=1, item_cas=1, datatype=SNAPPY)  # fmt: skip
            assert b.partitions[VB].high_seq == high  # nothing was written

    run(scenario())


# -- the producer, by connection ----------------------------------------------------


async def _stream(node: InProcessNode, *, snappy_granted: bool, controls: dict[str, str],
                  flags: int = OPEN_PRODUCER) -> list[Mutation]:  # fmt: skip
    """The mutations one stream of partition 0 sends, from 0 to the high seq, on a
    producer made as the server makes it for a connection that did (or did not)
    negotiate Snappy."""
    assert node.server is not None
    out = FrameDecoder()
    sender = DcpSender(out.feed, lambda: asyncio.sleep(0))
    fatal: list[str] = []
    producer = DcpProducer(node.bucket, "snappy-test", flags, sender, node.server.backfill_pool,
                           node.server.backfill_slots, fatal.append, 60.0,
                           snappy=snappy_granted)  # fmt: skip
    try:
        for key, value in controls.items():
            producer.control(key, value)
        high = node.bucket.partitions[VB].high_seq
        spec, _ = producer.stream_request(StreamRequest(vbucket=VB, opaque=9, end_seqno=high))
        producer.start_stream(spec)
        await asyncio.wait_for(asyncio.shield(producer.streams[VB]), 2.0)
    finally:
        await producer.aclose()
    assert not fatal
    msgs = [decode_message(f) for f in out.frames()]
    assert isinstance(msgs[-1], StreamEnd)
    return [m for m in msgs if isinstance(m, Mutation)]


def _by_key(muts: list[Mutation]) -> dict[bytes, tuple[int, bytes]]:
    return {bytes(m.key): (m.datatype, bytes(m.value)) for m in muts}


@pytest.mark.parametrize("flush", [True, False], ids=["disk", "memory"])
def test_a_snappy_connection_gets_values_as_stored(tmp_path: Path, flush: bool) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> dict[bytes, tuple[int, bytes]]:
        async with nodes(node):
            _write_three(node.bucket)
            if flush:
                await node.bucket.flush()
            return _by_key(await _stream(node, snappy_granted=True, controls={}))

    assert run(scenario()) == {
        b"k1": (SNAPPY | JSON, PACKED),
        b"k2": (JSON, DOC),
        b"k3": (JSON, SMALL),
    }


@pytest.mark.parametrize("flush", [True, False], ids=["disk", "memory"])
def test_any_other_connection_gets_values_inflated(tmp_path: Path, flush: bool) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> dict[bytes, tuple[int, bytes]]:
        async with nodes(node):
            _write_three(node.bucket)
            if flush:
                await node.bucket.flush()
            return _by_key(await _stream(node, snappy_granted=False, controls={}))

    got = run(scenario())
    assert got == {b"k1": (JSON, DOC), b"k2": (JSON, DOC), b"k3": (JSON, SMALL)}
    assert json.loads(got[b"k1"][1])["name"] == "compressible"


@pytest.mark.parametrize("flush", [True, False], ids=["disk", "memory"])
def test_force_value_compression_compresses_what_gets_smaller(tmp_path: Path, flush: bool) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> dict[bytes, tuple[int, bytes]]:
        async with nodes(node):
            _write_three(node.bucket)
            if flush:
                await node.bucket.flush()
            controls = {"force_value_compression": "true"}
            return _by_key(await _stream(node, snappy_granted=True, controls=controls))

    got = run(scenario())
    assert got[b"k1"] == (SNAPPY | JSON, PACKED)
    assert got[b"k2"][0] == SNAPPY | JSON and snappy.inflate(got[b"k2"][1]) == DOC
    assert got[b"k3"] == (JSON, SMALL)


def test_force_value_compression_needs_snappy(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> None:
        async with nodes(node):
            with pytest.raises(InvalidArguments, match="needs HELLO Snappy"):
                await _stream(node, snappy_granted=False,
                              controls={"force_value_compression": "true"})  # fmt: skip

    run(scenario())


def test_no_value_with_underlying_datatype_clears_snappy_without_it(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> tuple[dict[bytes, tuple[int, bytes]], dict[bytes, tuple[int, bytes]]]:
        async with nodes(node):
            _write_three(node.bucket)
            flags = OPEN_PRODUCER | OPEN_NO_VALUE_DT
            plain = await _stream(node, snappy_granted=False, controls={}, flags=flags)
            packed = await _stream(node, snappy_granted=True, controls={}, flags=flags)
            return _by_key(plain), _by_key(packed)

    plain, packed = run(scenario())
    assert plain[b"k1"] == (JSON, b"")
    assert packed[b"k1"] == (SNAPPY | JSON, b"")
