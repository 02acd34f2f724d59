"""Salvage keeps xattrs (upr_cli/jobs/salvage.py): every holder's versions carry their
xattr blob apart from the body (a backup's records, a store's documents, a replica
node's rows, stored blob before body), two versions that differ only in their xattrs
are different, and the report shows them. Built from constructed records."""

from __future__ import annotations

import json

import pytest

from upr_cli.cli.salvage import _row
from upr_cli.jobs.salvage import (
    LostItem,
    Version,
    _ChangedSink,
    _same,
    _seg_versions,
    judge,
    node_version,
    same_xattrs,
)
from upr_cli.node.storage import DocRow
from upr_cli.protocol import snappy, xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.segments.format import OP_SYSTEM_EVENT, Record
from upr_cli.store import Document

SYNC = xattrs.encode({"_sync": '{"rev":"2-b"}', "meta": '{"by":"app"}'})
SPACED = xattrs.encode([("meta", '{ "by": "app" }'), ("_sync", '{"rev": "2-b"}')])
OTHER = xattrs.encode({"_sync": '{"rev":"3-c"}', "meta": '{"by":"app"}'})
BODY = b'{"n":1}'


def version(seq: int, blob: bytes = b"", *, deleted: bool = False, value: bytes = BODY) -> Version:
    return Version(seq, deleted, b"" if deleted else value, seq, 1, 0, 0, 1, blob)


def test_versions_that_differ_only_in_xattrs_are_different() -> None:
    assert _same(version(5, SYNC), version(9, SYNC))
    assert not _same(version(5, SYNC), version(9, OTHER))
    assert not _same(version(5, SYNC), version(9))
    assert not _same(version(5), version(9, SYNC))
    # tombstones too: one that kept system xattrs is not one that kept none
    assert _same(version(5, SYNC, deleted=True), version(9, SYNC, deleted=True))
    assert not _same(version(5, SYNC, deleted=True), version(9, deleted=True))


def test_the_same_xattrs_in_another_order_or_spacing_are_the_same() -> None:
    assert SYNC != SPACED and same_xattrs(SYNC, SPACED)
    assert same_xattrs(b"", b"") and not same_xattrs(SYNC, b"")
    assert _same(version(5, SYNC), version(9, SPACED))


def lost(key: bytes, blob: bytes, cut: int = 10) -> LostItem:
    return LostItem(0, key, cut, version(12, blob), "test")


def test_a_master_that_changed_only_the_xattrs_is_a_conflict() -> None:
    """What the master streamed after the cut decides: the same body with other xattrs
    is a change (conflict, never written); the same body and xattrs is already there."""
    items = [lost(b"a", SYNC), lost(b"b", SYNC), lost(b"c", SYNC)]
    changed = {0: {(0, b"a"): version(15, OTHER), (0, b"b"): version(16, SPACED)}}
    safe = judge(items, changed, set())
    assert [(it.key, it.outcome) for it in items] == [
        (b"a", "conflict"), (b"b", "already-there"), (b"c", "would-write"),
    ]  # fmt: skip
    assert safe == [items[2]]
    assert items[0].master is not None and items[0].master.xattrs == OTHER


def test_the_master_s_stream_carries_xattrs_into_its_versions() -> None:
    sink = _ChangedSink(None, {0: 10})  # type: ignore[arg-type]
    recs = [
        DcpRecord(OP_MUTATION, 0, 11, 2, 77, 0, 0, 0, 1, b"k", BODY, 0, 0, SYNC),
        DcpRecord(OP_DELETION, 0, 12, 3, 78, 0, 0, 0, 0, b"d", b"", 0, 8, xattrs.system_only(SYNC)),
    ]  # fmt: skip
    import asyncio

    asyncio.run(sink.records(recs))
    assert sink.changed[0][0, b"k"].xattrs == SYNC
    gone = sink.changed[0][8, b"d"]
    assert gone.deleted and xattrs.to_json(gone.xattrs) == {"_sync": {"rev": "2-b"}}


def test_a_backup_s_records_and_a_store_s_documents_carry_xattrs() -> None:
    recs = [
        Record(OP_MUTATION, 4, 1, 40, 7, 0, 0, 1, b"k", BODY, 9, SYNC),
        Record(OP_SYSTEM_EVENT, 5, 1, 41, 0, 0, 0, 0, b"app", b"{}", 0),
        Record(OP_DELETION, 6, 2, 42, 0, 0, 99, 0, b"k", b"", 9, xattrs.system_only(SYNC)),
    ]  # fmt: skip
    out = list(_seg_versions(recs))
    assert [(cid, key, v.seq, v.deleted) for cid, key, v in out] == [
        (9, b"k", 4, False), (9, b"k", 6, True),
    ]  # fmt: skip
    assert out[0][2].xattrs == SYNC and out[0][2].flags == 7
    assert out[1][2].xattrs == xattrs.system_only(SYNC)
    doc = Document(0, b"k", 4, 1, 40, 7, 0, 0, 1, False, BODY, 9, SYNC)
    assert Version.of(doc).xattrs == SYNC


def row(datatype: int, value: bytes, *, deleted: bool = False) -> DocRow:
    return DocRow(3, b"\x00k", 8, 2, 80, 5, 0, datatype, deleted, 0, value)


def test_a_node_row_is_split_as_a_consumer_record_is() -> None:
    """The node stores kv_engine's layout: blob before body and the XATTR bit, maybe
    compressed; salvage hands the version out inflated, the blob apart, both bits clear."""
    v = node_version(row(0x01 | xattrs.XATTR, SYNC + BODY))
    assert (v.value, v.xattrs, v.datatype, v.flags) == (BODY, SYNC, 0x01, 5)
    big = b'{"text":"' + b"abc" * 200 + b'"}'
    datatype, packed = snappy.compressed(0x01 | xattrs.XATTR, SYNC + big)
    assert datatype & snappy.SNAPPY and len(packed) < len(big)
    v = node_version(row(datatype, packed))
    assert (v.value, v.xattrs, v.datatype) == (big, SYNC, 0x01)
    kept = xattrs.system_only(SYNC)
    v = node_version(row(xattrs.XATTR, kept, deleted=True))
    assert v.deleted and (v.value, v.xattrs, v.datatype) == (b"", kept, 0)
    plain = node_version(row(0x01, BODY))
    assert (plain.value, plain.xattrs) == (BODY, b"")


def test_a_node_row_with_a_malformed_blob_is_a_typed_error_naming_the_key() -> None:
    with pytest.raises(xattrs.CorruptXattrsError, match="malformed xattrs"):
        node_version(row(xattrs.XATTR, b"\x00\x00\x00\x40" + BODY))


def test_the_report_shows_the_xattrs() -> None:
    it = lost(b"a", SYNC)
    it.master, it.outcome = version(15, OTHER), "conflict"
    out = it.to_json()
    assert out["lost_version"]["xattrs"] == {"_sync": {"rev": "2-b"}, "meta": {"by": "app"}}
    assert out["master"]["xattrs"]["_sync"] == {"rev": "3-c"}
    assert lost(b"b", b"").to_json()["lost_version"]["xattrs"] == {}
    json.dumps(out)  # JSON-safe
    cells = _row(it)
    assert "xattrs=_sync,meta" in cells[3] and "xattrs=_sync,meta" in cells[5]


def test_the_xattr_step_is_a_sub_document_request_the_node_accepts() -> None:
    """`xattr_upserts` against the node's own validator (kv_engine's rules): one
    DICT_UPSERT a pair, xattr paths, the expiry in the extras, the CAS guard; more pairs
    than one request takes go in several."""
    from upr_cli.jobs.salvage import MAX_SPECS, xattr_upserts
    from upr_cli.node.subdoc import parse_request
    from upr_cli.protocol import FrameDecoder

    pairs = xattrs.pairs(SYNC)
    dec = FrameDecoder()
    dec.feed(xattr_upserts(3, b"\x00k", pairs, 1234, 99, 7))
    frame = dec.next_frame()
    assert frame is not None and (frame.opcode, frame.cas, frame.vbucket_or_status) == (0xD1, 99, 3)
    req = parse_request(mutation=True, extras=bytes(frame.extras), value=bytes(frame.value),
                        cas=frame.cas)  # fmt: skip
    assert req.expiry == 1234 and req.doc_flags == 0
    assert [(s.path, s.value, s.xattr) for s in req.specs] == [
        ("_sync", b'{"rev":"2-b"}', True), ("meta", b'{"by":"app"}', True),
    ]  # fmt: skip
    no_expiry = xattr_upserts(3, b"\x00k", pairs, 0, 99, 7)
    assert no_expiry[4] == 0  # no extras: the document keeps no expiry, as it had none
    assert MAX_SPECS == 16
