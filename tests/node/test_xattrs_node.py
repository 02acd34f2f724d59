"""The node's side of xattrs (formats/wire.md "Xattrs"): the kv_engine layout (blob, then
body, bit 0x04) in storage; KV reads answer the body alone; full-document writes keep
every xattr; deletions and expirations keep the system ones in the tombstone; the with-
meta writes take a blob on a connection that negotiated XATTR; the DCP producer honours
IncludeXattrs, IncludeDeletedUserXattrs and NoValue; and a replica keeps what its
active has, tombstones included."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.dcp.inprocess import InProcessNode, nodes, run
from upr_cli.net.bootstrap import WANTED, connect
from upr_cli.node import subdoc as subdoc_engine
from upr_cli.node.bucket import Bucket, XattrInvalid
from upr_cli.node.partition import REPLICA
from upr_cli.node.producer import DcpProducer, DcpSender, open_flags_problem
from upr_cli.node.storage import DocRow
from upr_cli.node.subdoc import Code, Document, SpecFailed
from upr_cli.protocol import FrameDecoder, snappy, xattrs
from upr_cli.protocol.dcp import (
    OPEN_DELETED_USER_XATTRS,
    OPEN_NO_VALUE,
    OPEN_NO_VALUE_DT,
    OPEN_PRODUCER,
    OPEN_XATTRS,
)
from upr_cli.protocol.header import Feature, Opcode
from upr_cli.protocol.messages import (
    Deletion,
    DelWithMeta,
    Get,
    Mutation,
    Set,
    SetWithMeta,
    StreamEnd,
    StreamRequest,
    UnknownRequest,
    decode_message,
)
from upr_cli.protocol.status import InvalidArguments, NotSupported, Status
from upr_cli.protocol.subdoc import XATTR_PATH, SpecOp

VB = 0
JSON, SNAPPY, XATTR = 0x01, 0x02, 0x04
SYS = xattrs.encode([("_sync", b'{"rev":"1-a"}')])
BOTH = xattrs.encode([("_sync", b'{"rev":"1-a"}'), ("meta", b'{"by":"u1"}')])
USER = xattrs.encode([("meta", b'{"by":"u1"}')])
BODY = b'{"name":"doc","pad":"' + b"xy" * 100 + b'"}'


def _key(name: str) -> bytes:
    return b"\x00" + name.encode()  # qualified: the default collection


def _with_meta(bucket: Bucket, name: str, value: bytes, datatype: int, *, rev: int = 1,
               deleted: bool = False) -> DocRow:  # fmt: skip
    return bucket.store_with_meta(VB, _key(name), value, deleted=deleted, flags=0, expiry=0,
                                  rev_seq=rev, item_cas=bucket.next_cas(),
                                  datatype=datatype)  # fmt: skip


def _stored(bucket: Bucket, name: str) -> tuple[int, bytes, bool]:
    doc = bucket.lookup(VB, _key(name))
    assert doc is not None
    return doc.datatype, doc.value, doc.deleted


# -- the bucket ---------------------------------------------------------------------


def test_a_full_write_keeps_every_xattr_and_reads_answer_the_body(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            _with_meta(b, "d", BOTH + BODY, XATTR | JSON)
            assert _stored(b, "d") == (XATTR | JSON, BOTH + BODY, False)
            got = b.get(VB, _key("d"))
            assert (got.datatype, got.value) == (JSON, BODY)
            b.store("set", VB, _key("d"), b'{"v":2}', datatype=JSON)
            assert _stored(b, "d") == (XATTR | JSON, BOTH + b'{"v":2}', False)
            b.store("replace", VB, _key("d"), b"not json", datatype=JSON)
            assert _stored(b, "d") == (XATTR, BOTH + b"not json", False)  # JSON bit: the body's
            assert b.get_meta(VB, _key("d")).datatype == XATTR  # the server masks it per client
            touched = b.touch(VB, _key("d"), 0)
            assert (touched.datatype, touched.value) == (0, b"not json")  # GAT: the body
            await b.flush()
            await node.stop()  # read back from disk after a restart
            await node.start()
            assert _stored(node.bucket, "d") == (XATTR, BOTH + b"not json", False)

    run(scenario())


def test_a_compressed_write_over_xattrs_is_joined_and_compressed_again(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            _with_meta(b, "d", BOTH + b"{}", XATTR | JSON)
            b.store("set", VB, _key("d"), snappy.deflate(BODY), datatype=SNAPPY | JSON)
            dt, value, _ = _stored(b, "d")
            assert dt == SNAPPY | XATTR | JSON and snappy.inflate(value) == BOTH + BODY
            got = b.get(VB, _key("d"))
            assert (got.datatype, got.value) == (JSON, BODY)

    run(scenario())


def test_a_deletion_keeps_the_system_xattrs_alone(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            _with_meta(b, "both", BOTH + BODY, XATTR | JSON)
            _with_meta(b, "user", USER + BODY, XATTR | JSON)
            b.store("set", VB, _key("plain"), BODY, datatype=JSON)
            for name in ("both", "user", "plain"):
                b.delete(VB, _key(name))
            assert _stored(b, "both") == (XATTR, SYS, True)
            assert _stored(b, "user") == (0, b"", True)
            assert _stored(b, "plain") == (0, b"", True)
            # a write over the tombstone starts afresh: a deleted document's xattrs
            # are not a live one's (kv_engine reads only live documents to keep them)
            b.store("add", VB, _key("both"), b'{"new":1}', datatype=JSON)
            assert _stored(b, "both") == (JSON, b'{"new":1}', False)

    run(scenario())


def test_an_expiration_keeps_the_system_xattrs_alone(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            b.store_with_meta(VB, _key("e"), BOTH + BODY, deleted=False, flags=0,
                              expiry=int(time.time()) - 5, rev_seq=1, item_cas=b.next_cas(),
                              datatype=XATTR | JSON)  # fmt: skip
            assert await b.expire_due() == 1
            dt, value, deleted = _stored(b, "e")
            assert (dt, value, deleted) == (XATTR, SYS, True)

    run(scenario())


def test_the_with_meta_writes_check_and_keep_the_blob(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            high = b.partitions[VB].high_seq
            with pytest.raises(XattrInvalid, match=r"'\\x00bad'.*malformed xattrs") as err:
                _with_meta(b, "bad", b"\x00\x00\x00\x09" + BODY, XATTR | JSON)
            assert err.value.code == 0x87  # XATTR_EINVAL, as kv_engine's validator says
            assert b.partitions[VB].high_seq == high
            # DEL_WITH_META: the blob stays on the tombstone, user xattrs too; a body goes
            _with_meta(b, "t", BOTH + BODY, XATTR | JSON, deleted=True)
            assert _stored(b, "t") == (XATTR, BOTH, True)
            _with_meta(b, "z", snappy.deflate(BOTH), SNAPPY | XATTR, rev=2, deleted=True)
            assert _stored(b, "z") == (XATTR, BOTH, True)  # kept inflated
            _with_meta(b, "n", b"", 0, deleted=True)
            assert _stored(b, "n") == (0, b"", True)

    run(scenario())


# -- the producer, by connection ----------------------------------------------------


def _write_docs(bucket: Bucket) -> None:
    """x: xattrs and a JSON body; c: the same stored compressed; p: no xattrs; tb: a
    tombstone keeping system and user xattrs (DEL_WITH_META); ts: a deletion that kept
    the system ones; tn: a tombstone without any."""
    _with_meta(bucket, "x", BOTH + BODY, XATTR | JSON)
    _with_meta(bucket, "c", snappy.deflate(BOTH + BODY), SNAPPY | XATTR | JSON)
    bucket.store("set", VB, _key("p"), BODY, datatype=JSON)
    _with_meta(bucket, "tb", BOTH, XATTR, deleted=True)
    _with_meta(bucket, "ts", BOTH + BODY, XATTR | JSON)
    bucket.delete(VB, _key("ts"))
    bucket.store("set", VB, _key("tn"), BODY, datatype=JSON)
    bucket.delete(VB, _key("tn"))


Sent = dict[bytes, tuple[str, int, bytes]]
NOOP = {"enable_noop": "true"}


async def _stream(node: InProcessNode, flags: int, *, snappy_granted: bool = False,
                  controls: dict[str, str] | None = None) -> Sent:  # fmt: skip
    """key → (kind, datatype, value) of what one stream of partition 0 sends from 0 to
    the high seq, on a producer made as the server makes it for a connection."""
    assert node.server is not None
    out = FrameDecoder()
    sender = DcpSender(out.feed, lambda: asyncio.sleep(0))
    fatal: list[str] = []
    producer = DcpProducer(node.bucket, "xattr-test", flags, sender, node.server.backfill_pool,
                           node.server.backfill_slots, fatal.append, 60.0,
                           snappy=snappy_granted)  # fmt: skip
    try:
        for key, value in (NOOP if controls is None else controls).items():
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
    got: dict[bytes, tuple[str, int, bytes]] = {}
    for m in msgs:
        if isinstance(m, Mutation | Deletion):
            kind = "mutation" if isinstance(m, Mutation) else "deletion"
            got[bytes(m.key)] = (kind, m.datatype, bytes(m.value))
    return got


@pytest.mark.parametrize("flush", [True, False], ids=["disk", "memory"])
def test_include_xattrs_and_deleted_user_xattrs(tmp_path: Path, flush: bool) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> list[Sent]:
        async with nodes(node):
            _write_docs(node.bucket)
            if flush:
                await node.bucket.flush()
            base = OPEN_PRODUCER | OPEN_XATTRS
            return [
                await _stream(node, OPEN_PRODUCER, controls={}),
                await _stream(node, base),
                await _stream(node, base | OPEN_DELETED_USER_XATTRS),
                await _stream(node, base, snappy_granted=True),
            ]

    without, system, every, packed = run(scenario())
    body_only = ("mutation", JSON, BODY)
    assert without == {b"x": body_only, b"c": body_only, b"p": body_only,
                       b"tb": ("deletion", 0, b""), b"ts": ("deletion", 0, b""),
                       b"tn": ("deletion", 0, b"")}  # fmt: skip
    whole = ("mutation", XATTR | JSON, BOTH + BODY)
    assert system == {b"x": whole, b"c": whole, b"p": body_only,
                      b"tb": ("deletion", XATTR, SYS), b"ts": ("deletion", XATTR, SYS),
                      b"tn": ("deletion", 0, b"")}  # fmt: skip
    assert every == {**system, b"tb": ("deletion", XATTR, BOTH)}
    kind, dt, value = packed[b"c"]  # a Snappy connection gets the stored bytes
    assert (kind, dt, snappy.inflate(value)) == ("mutation", SNAPPY | XATTR | JSON, BOTH + BODY)
    assert packed[b"x"] == whole


def test_the_backfill_fast_path_takes_no_row_the_connection_cannot_take(tmp_path: Path) -> None:
    """Live rows only: the backfill would send them as stored, unless one has a bit the
    connection did not ask for (here xattrs without IncludeXattrs)."""
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> list[Sent]:
        async with nodes(node):
            b = node.bucket
            b.store("set", VB, _key("p"), BODY, datatype=JSON)
            _with_meta(b, "x", BOTH + BODY, XATTR | JSON)
            await b.flush()
            return [
                await _stream(node, OPEN_PRODUCER, controls={}),
                await _stream(node, OPEN_PRODUCER | OPEN_XATTRS),
            ]

    without, with_ = run(scenario())
    assert without == {b"p": ("mutation", JSON, BODY), b"x": ("mutation", JSON, BODY)}
    assert with_[b"x"] == ("mutation", XATTR | JSON, BOTH + BODY)


@pytest.mark.parametrize("flush", [True, False], ids=["disk", "memory"])
def test_no_value_sends_the_blob_alone(tmp_path: Path, flush: bool) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> list[Sent]:
        async with nodes(node):
            _write_docs(node.bucket)
            if flush:
                await node.bucket.flush()
            return [
                await _stream(node, OPEN_PRODUCER | OPEN_XATTRS | OPEN_NO_VALUE),
                await _stream(node, OPEN_PRODUCER | OPEN_NO_VALUE, controls={}),
                await _stream(node, OPEN_PRODUCER | OPEN_XATTRS | OPEN_NO_VALUE_DT),
            ]

    blob, nothing, underlying = run(scenario())
    assert blob[b"x"] == blob[b"c"] == ("mutation", XATTR, BOTH)
    assert blob[b"p"] == ("mutation", 0, b"")
    assert blob[b"ts"] == ("deletion", XATTR, SYS)  # NoValue leaves xattrs on deletions
    assert nothing[b"x"] == nothing[b"c"] == nothing[b"p"] == ("mutation", 0, b"")
    assert underlying[b"x"] == underlying[b"c"] == ("mutation", XATTR | JSON, BOTH)
    assert underlying[b"p"] == ("mutation", JSON, b"")


def test_the_open_flags_and_controls_of_xattrs(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)
    assert open_flags_problem(OPEN_PRODUCER | OPEN_DELETED_USER_XATTRS) is not None
    assert open_flags_problem(OPEN_PRODUCER | OPEN_XATTRS | OPEN_DELETED_USER_XATTRS) is None

    async def scenario() -> None:
        async with nodes(node):
            node.bucket.store("set", VB, _key("p"), BODY, datatype=JSON)
            with pytest.raises(NotSupported, match="enable_noop"):
                await _stream(node, OPEN_PRODUCER | OPEN_XATTRS, controls={})
            probe = {**NOOP, "include_deleted_user_xattrs": "true"}
            with pytest.raises(InvalidArguments, match="IncludeDeletedUserXattrs"):
                await _stream(node, OPEN_PRODUCER | OPEN_XATTRS, controls=probe)
            flags = OPEN_PRODUCER | OPEN_XATTRS | OPEN_DELETED_USER_XATTRS
            got = await _stream(node, flags, controls=probe)
            assert got == {b"p": ("mutation", JSON, BODY)}

    run(scenario())


# -- the front end --------------------------------------------------------------------


async def _request(node: InProcessNode, features: tuple[int, ...], msg: Any) -> Any:
    """Send `msg` on a new connection that negotiated `features`; its reply, whatever the
    status."""
    s = await connect(node.uri, features=features)
    try:
        return await s.conn.request(replace(msg, key=s.qualify(msg.key)), check=False)
    finally:
        await s.conn.aclose()


def test_the_front_end_takes_xattrs_only_with_meta_and_only_after_hello(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    request = partial(_request, node)

    async def scenario() -> None:
        async with nodes(node):
            plain, xattr = WANTED, (*WANTED, Feature.XATTR)
            meta = SetWithMeta(vbucket=VB, key=b"m", value=BOTH + BODY, rev_seqno=1,
                               item_cas=99, datatype=XATTR | JSON)  # fmt: skip
            assert (await request(plain, meta)).status == Status.EINVAL
            assert (await request(xattr, meta)).status == Status.SUCCESS
            bad = replace(meta, key=b"b", value=b"\x00\x00\x01\x00" + BODY)
            assert (await request(xattr, bad)).status == 0x87
            for f in (plain, xattr):  # a plain SET never takes the bit (kv_engine's mask)
                msg = Set(vbucket=VB, key=b"s", value=BOTH + BODY, datatype=XATTR | JSON)
                assert (await request(f, msg)).status == Status.EINVAL
            got = await request(xattr, Get(vbucket=VB, key=b"m"))
            assert (got.status, got.datatype, bytes(got.value)) == (0, JSON, BODY)
            for f, shown in ((plain, JSON), (xattr, XATTR | JSON)):
                meta_v2 = UnknownRequest(opcode=Opcode.GET_META, vbucket=VB, key=b"m",
                                         extras=b"\x02")  # fmt: skip
                resp = await request(f, meta_v2)
                assert resp.status == 0 and resp.extras[-1] == shown
            tomb = DelWithMeta(vbucket=VB, key=b"t", value=SYS, rev_seqno=3, item_cas=100,
                               datatype=XATTR)  # fmt: skip
            assert (await request(xattr, tomb)).status == Status.SUCCESS
            assert _stored(node.bucket, "t") == (XATTR, SYS, True)

    run(scenario())


def test_an_xattr_value_that_is_not_json_is_refused_as_kv_engine_does(tmp_path: Path) -> None:
    # kv_engine's xattr validator requires every value to be JSON (formats/wire.md
    # "Xattrs"): a well-formed blob holding one that is not is XATTR_EINVAL
    node = InProcessNode(tmp_path, partitions=1)
    odd = xattrs.encode([("_sync", b'{"rev":"1-a"}'), ("app", b"not json")])
    nan = xattrs.encode([("app", b"NaN")])  # Python's json takes it; JSON does not

    request = partial(_request, node, (*WANTED, Feature.XATTR, Feature.SNAPPY))

    async def scenario() -> None:
        async with nodes(node):
            high = node.bucket.partitions[VB].high_seq
            for blob in (odd, nan):
                meta = SetWithMeta(vbucket=VB, key=b"m", value=blob + BODY, rev_seqno=1,
                                   item_cas=99, datatype=XATTR | JSON)  # fmt: skip
                assert (await request(meta)).status == 0x87
                packed = replace(meta, value=snappy.deflate(blob + BODY),
                                 datatype=SNAPPY | XATTR | JSON)  # fmt: skip
                assert (await request(packed)).status == 0x87
                tomb = DelWithMeta(vbucket=VB, key=b"t", value=blob, rev_seqno=3, item_cas=100,
                                   datatype=XATTR)  # fmt: skip
                assert (await request(tomb)).status == 0x87
            assert node.bucket.partitions[VB].high_seq == high  # nothing stored
            assert node.bucket.lookup(VB, _key("m")) is None
            with pytest.raises(XattrInvalid, match=r"xattr 'app' is not JSON"):
                _with_meta(node.bucket, "b", odd + BODY, XATTR | JSON)
            ok = SetWithMeta(vbucket=VB, key=b"m", value=BOTH + BODY, rev_seqno=1, item_cas=99,
                             datatype=XATTR | JSON)  # fmt: skip
            assert (await request(ok)).status == Status.SUCCESS

    run(scenario())
    # a sub-document xattr write parses its value as JSON: one that is not cannot go in
    spec = struct.pack(">BBHI", SpecOp.DICT_UPSERT, XATTR_PATH, 3, 8) + b"app" + b"not json"
    req = subdoc_engine.parse_request(mutation=True, extras=b"", value=spec)
    with pytest.raises(SpecFailed) as failed:
        subdoc_engine.mutate(req, Document(body=BODY, json=True), cas=1, seqno=1)
    assert failed.value.status == Code.VALUE_CANTINSERT


# -- replication ------------------------------------------------------------------------


def _cluster_map(servers: list[str]) -> dict[str, Any]:
    return {"rev": 1, "name": "default", "nodeLocator": "vbucket",
            "vBucketServerMap": {"hashAlgorithm": "CRC", "numReplicas": 1,
                                 "serverList": servers, "vBucketMap": [[0, 1]]}}  # fmt: skip


def test_a_replica_keeps_xattrs_and_tombstones_with_them(tmp_path: Path) -> None:
    a, b = (InProcessNode(tmp_path / n, partitions=1) for n in "ab")

    def rows(node: InProcessNode) -> dict[bytes, tuple[int, int, int, bool, bytes]]:
        out = {}
        for name in ("x", "c", "p", "tb", "ts", "tn"):
            doc = node.bucket.lookup(VB, _key(name))
            assert doc is not None
            _, blob, body = _unpack(doc)
            out[doc.key] = (doc.seq, doc.cas, doc.datatype & ~SNAPPY, doc.deleted, blob + body)
        return out

    async def scenario() -> None:
        async with nodes(a, b) as both:
            for n in both:
                n.bucket.set_cluster_map(n.bucket.state_cas, _cluster_map([a.address, b.address]))
            await b.bucket.set_partition_state(VB, REPLICA, cas=b.bucket.state_cas, rev=1)
            _write_docs(a.bucket)
            a.bucket.store("set", VB, _key("x"), b'{"v":3}', datatype=JSON)  # keeps BOTH
            high = a.bucket.partitions[VB].high_seq
            await b.wait_for("the replica", lambda: b.bucket.partitions[VB].high_seq == high,
                             timeout=5.0)  # fmt: skip
            assert rows(b) == rows(a)
            x = b.bucket.lookup(VB, _key("x"))
            assert x is not None and (x.datatype, x.value) == (XATTR | JSON, BOTH + b'{"v":3}')
            tb = b.bucket.lookup(VB, _key("tb"))
            assert tb is not None and (tb.datatype, tb.value) == (XATTR, BOTH)  # user ones too

    run(scenario(), timeout=8.0)


def _unpack(doc: DocRow) -> tuple[int, bytes, bytes]:
    from upr_cli.node.bucket import unpacked

    return unpacked(doc)


def test_json_bit_is_checked_on_the_body_behind_the_blob(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> None:
        async with nodes(node):
            b = node.bucket
            assert _with_meta(b, "j", BOTH + BODY, XATTR | JSON).datatype == XATTR | JSON
            assert _with_meta(b, "r", BOTH + b"raw", XATTR | JSON).datatype == XATTR
            assert json.loads(b.get(VB, _key("j")).value)["name"] == "doc"

    run(scenario())
