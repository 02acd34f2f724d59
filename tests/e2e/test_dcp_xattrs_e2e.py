"""Xattrs over DCP from a real `upr serve` (formats/wire.md "Xattrs"): documents written
with SET_WITH_META and a blob (on a connection that negotiated XATTR), then updated with
plain SETs (which keep every xattr), deleted (a DELETE keeps the system xattrs, a
DEL_WITH_META the blob it carries); then read by raw DCP connections opened with and
without IncludeXattrs (0x04), IncludeDeletedUserXattrs (0x100) and NoValue (0x08), and
by upr's consumer, which splits the blob off into `DcpRecord.xattrs`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.e2e.conftest import Node
from tests.e2e.e2e_helpers import drain, run, set_keys, wait_persisted
from upr_cli.net.bootstrap import WANTED, connect, partition_of
from upr_cli.net.connection import ServerItems
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.protocol.header import Feature
from upr_cli.protocol.messages import (
    Control,
    DcpOpen,
    Delete,
    DelWithMeta,
    Set,
    SetWithMeta,
    StreamEnd,
    StreamRequest,
    decode_message,
)

JSON, XATTR = 0x01, 0x04
SYNC = {"_sync": {"rev": "2-b", "cas": "0x01"}}
META = {"meta": {"by": "app"}}
DOCS = [f"doc{i}" for i in range(6)]
BODY0 = b'{"updated":true}'


def _blob(*objs: dict[str, Any]) -> bytes:
    return xattrs.from_json({k: v for o in objs for k, v in o.items()})


async def _write(uri: str, names: list[str] = DOCS) -> None:
    """doc0..doc5 with system and user xattrs; doc0/doc1 updated by a plain SET; doc2
    deleted by DELETE; doc3 deleted by DEL_WITH_META carrying both kinds; doc4 a plain
    document; doc5 stays as written."""
    s = await connect(SourceUri.parse(uri), features=(*WANTED, Feature.XATTR))
    conn = s.conn

    def at(name: str) -> dict[str, Any]:
        key = name.encode()
        return {"vbucket": partition_of(key, s.num_partitions), "key": s.qualify(key),
                "opaque": conn.next_opaque()}  # fmt: skip

    try:
        assert Feature.XATTR in s.features
        for i, name in enumerate(names):
            body = json.dumps({"n": i}).encode()
            if name == "doc4":
                await conn.request(Set(**at(name), value=body, datatype=JSON))
            else:
                await conn.request(SetWithMeta(**at(name), value=_blob(SYNC, META) + body,
                                               rev_seqno=1, item_cas=1000 + i,
                                               datatype=XATTR | JSON))  # fmt: skip
        for name in ("doc0", "doc1"):
            if name in names:
                await conn.request(Set(**at(name), value=BODY0, datatype=JSON))
        if "doc2" in names:
            await conn.request(Delete(**at("doc2")))
        if "doc3" in names:
            await conn.request(DelWithMeta(**at("doc3"), value=_blob(SYNC, META), rev_seqno=5,
                                           item_cas=9000, datatype=XATTR))  # fmt: skip
    finally:
        await conn.aclose()


async def _raw_stream(uri: str, flags: int) -> dict[str, tuple[bool, int, bytes]]:
    """name → (deleted, datatype, value) of every document a DCP connection opened with
    `flags` receives (all partitions, from 0 to their high seqs), as sent."""
    got: dict[str, tuple[bool, int, bytes]] = {}
    ended: set[int] = set()
    done = asyncio.Event()

    def on_server(items: ServerItems, _nbytes: int) -> None:
        for it in items:
            if type(it) is DcpRecord:
                name = bytes(it.key).decode()
                got[name] = (it.opcode != OP_MUTATION, it.datatype, bytes(it.value))
            else:
                msg = decode_message(it)  # type: ignore[arg-type]
                if isinstance(msg, StreamEnd):
                    ended.add(msg.vbucket)
                    if len(ended) == len(highs):
                        done.set()

    features = tuple(f for f in (*WANTED, Feature.XATTR) if f != Feature.COLLECTIONS)
    s = await connect(SourceUri.parse(uri), features=features, on_server=on_server)
    try:
        highs = {vb: seq for vb, seq in (await _high_seqnos(s)).items() if seq}
        conn = s.conn
        await conn.request(DcpOpen(name="xattr-e2e", flags=flags, opaque=conn.next_opaque()))
        await conn.request(Control(name="enable_noop", value="true", opaque=conn.next_opaque()))
        for vb, high in highs.items():
            await conn.request(StreamRequest(vbucket=vb, end_seqno=high, opaque=conn.next_opaque()))
        await asyncio.wait_for(done.wait(), 20)
    finally:
        await s.conn.aclose()
    return got


async def _high_seqnos(s: Any) -> dict[int, int]:
    st = await s.conn.stats("vbucket-seqno")
    return {vb: int(st[f"vb_{vb}:high_seqno"]) for vb in range(s.num_partitions)}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Any:
    node = Node(tmp_path_factory.mktemp("dcpx") / "node", "--flush-interval", "0.02")
    try:
        node.start()
        run(_write(node.uri))
        wait_persisted(node.uri)  # streamed from disk (a backfill), the other path too below
        yield node
    finally:
        node.close()


def test_include_xattrs_sends_blob_and_body_and_system_xattrs_of_deletions(written: Node) -> None:
    both = _blob(SYNC, META)
    got = run(_raw_stream(written.uri, 0x01 | 0x04))
    assert got["doc0"] == got["doc1"] == (False, XATTR | JSON, both + BODY0)  # SET kept them
    assert got["doc5"] == (False, XATTR | JSON, both + b'{"n": 5}')
    assert got["doc4"] == (False, JSON, b'{"n": 4}')
    assert got["doc2"] == (True, XATTR, _blob(SYNC))  # DELETE kept the system xattrs
    assert got["doc3"] == (True, XATTR, _blob(SYNC))  # user ones need 0x100
    every = run(_raw_stream(written.uri, 0x01 | 0x04 | 0x100))
    assert every["doc3"] == (True, XATTR, both)  # DEL_WITH_META kept what it carried
    assert every["doc2"] == got["doc2"]


def test_without_include_xattrs_the_blob_is_stripped(written: Node) -> None:
    got = run(_raw_stream(written.uri, 0x01))
    assert got["doc0"] == (False, JSON, BODY0)
    assert got["doc5"] == (False, JSON, b'{"n": 5}')
    assert got["doc2"] == got["doc3"] == (True, 0, b"")


def test_no_value_leaves_the_blob_alone(written: Node) -> None:
    got = run(_raw_stream(written.uri, 0x01 | 0x04 | 0x08))
    assert got["doc0"] == got["doc5"] == (False, XATTR, _blob(SYNC, META))
    assert got["doc4"] == (False, 0, b"")
    assert got["doc2"] == (True, XATTR, _blob(SYNC))
    plain = run(_raw_stream(written.uri, 0x01 | 0x08))
    assert plain["doc0"] == (False, 0, b"")


def test_upr_consumer_splits_the_blob_off_and_sees_the_same(written: Node) -> None:
    rows, _events, _c = run(drain(written.uri))
    by_name = {bytes(r.key).decode(): r for r in rows}
    doc0, doc3 = by_name["doc0"], by_name["doc3"]
    assert (doc0.datatype, doc0.value) == (JSON, BODY0)
    assert xattrs.to_json(doc0.xattrs) == {**SYNC, **META}
    assert doc3.opcode != OP_MUTATION and xattrs.to_json(doc3.xattrs) == {**SYNC, **META}
    assert by_name["doc4"].xattrs == b""
    rows, _events, _c = run(drain(written.uri, with_xattrs=False))
    assert all(r.xattrs == b"" for r in rows)


def test_a_later_update_keeps_the_xattrs_on_a_following_stream(written: Node) -> None:
    """Written and updated while the stream's partitions are at rest: the update keeps
    the xattrs whether the stream finds it on disk or still in the write queue."""

    async def update_and_stream() -> dict[str, tuple[bool, int, bytes]]:
        await _write(written.uri, ["late"])
        await set_keys(written.uri, {b"late": b'{"v":9}'})
        return await _raw_stream(written.uri, 0x01 | 0x04)

    got = run(update_and_stream())
    assert got["late"] == (False, XATTR | JSON, _blob(SYNC, META) + b'{"v":9}')
