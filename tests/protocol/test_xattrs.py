"""The xattr blob codec (formats/wire.md "Xattrs") and the consumer's split of a
received record into body and blob, after inflating (Snappy) where needed."""

from __future__ import annotations

import json
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from upr_cli.dcp.consumer import Item
from upr_cli.dcp.streams import plain_records
from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol import FrameDecoder, snappy, xattrs
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.protocol.messages import DeletionV2, Mutation
from upr_cli.protocol.xattrs import CorruptXattrsError

# Written by hand from the layout: `_s` = {} (system), `u` = 1 (user)
BLOB = bytes.fromhex("00000012000000065f73007b7d000000000475003100")
BODY = b'{"a":1}'


def test_hand_written_blob_decodes() -> None:
    assert xattrs.pairs(BLOB) == [("_s", b"{}"), ("u", b"1")]
    assert xattrs.encode({"_s": "{}", "u": b"1"}) == BLOB
    assert xattrs.split(BLOB + BODY, b"k") == (BLOB, BODY)
    assert xattrs.to_json(BLOB) == {"_s": {}, "u": 1}


def test_system_only_keeps_underscore_names_and_empty_stays_empty() -> None:
    assert xattrs.pairs(xattrs.system_only(BLOB)) == [("_s", b"{}")]
    assert xattrs.system_only(xattrs.encode({"u": "1"})) == b""
    assert xattrs.system_only(b"") == b""
    assert xattrs.encode({}) == b""


def test_join_sets_and_clears_the_bit() -> None:
    assert xattrs.join(BLOB, BODY, 0x01) == (0x05, BLOB + BODY)
    assert xattrs.join(b"", BODY, 0x05) == (0x01, BODY)


names = st.text(alphabet="abcdefghij_", min_size=1, max_size=15)
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)


@given(st.dictionaries(names, values, max_size=5), st.binary(max_size=64))
def test_round_trip(obj: dict[str, object], body: bytes) -> None:
    blob = xattrs.from_json(obj)
    assert xattrs.to_json(blob) == obj
    dt, value = xattrs.join(blob, body, 0)
    if obj:
        assert dt == xattrs.XATTR and xattrs.split(value) == (blob, body)
    else:
        assert (dt, value) == (0, body)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"\x00\x00", "no blob length"),
        (b"\x00\x00\x00\x20" + b"\x00" * 8, "blob of 36 bytes"),
        (bytes.fromhex("00000008 00000004 61003100")[:-1] + b"\x01", "not name"),
        (bytes.fromhex("00000007 00000004 610031"), "not name"),  # pair cut short
        (bytes.fromhex("00000006 00000002 6100"), "not name"),  # no value
        (bytes.fromhex("00000002 0000"), "pair length cut"),
        (bytes.fromhex("00000008 00000004 ff003100"), "not UTF-8"),
    ],
)
def test_malformed_blob_is_a_typed_error_naming_the_key(value: bytes, reason: str) -> None:
    with pytest.raises(CorruptXattrsError, match=reason) as info:
        xattrs.split(value, b"user::42")
    assert isinstance(info.value, RemoteProtocolError)
    assert "user::42" in str(info.value) and "\n" not in str(info.value)


def _received(packet: bytes) -> DcpRecord:
    decoder = FrameDecoder()
    decoder.feed(packet)
    [row] = decoder.read_rows()
    assert type(row) is DcpRecord
    out: list[Item] = [row]
    plain_records(out, [0])
    return cast(DcpRecord, out[0])


@pytest.mark.parametrize("compress", [False, True])
def test_received_mutation_is_split_after_inflating(compress: bool) -> None:
    dt, value = (0x07, snappy.deflate(BLOB + BODY)) if compress else (0x05, BLOB + BODY)
    packet = Mutation(opaque=1, vbucket=3, cas=9, datatype=dt, by_seqno=4, rev_seqno=1,
                      key=b"doc1", value=value).encode()  # fmt: skip
    rec = _received(packet)
    assert (rec.datatype, rec.value, rec.xattrs) == (0x01, BODY, BLOB)
    assert json.loads(rec.value) == {"a": 1}


def test_received_tombstone_keeps_its_blob_and_no_body() -> None:
    kept = xattrs.system_only(BLOB)
    packet = DeletionV2(opaque=1, vbucket=3, cas=9, datatype=0x04, by_seqno=5, rev_seqno=2,
                        delete_time=7, key=b"doc1", value=kept).encode()  # fmt: skip
    rec = _received(packet)
    assert (rec.datatype, rec.value) == (0, b"")
    assert xattrs.to_json(rec.xattrs) == {"_s": {}}


def test_received_record_without_xattrs_is_untouched() -> None:
    packet = Mutation(opaque=1, vbucket=3, cas=9, datatype=0x01, by_seqno=4, rev_seqno=1,
                      key=b"doc1", value=BODY).encode()  # fmt: skip
    rec = _received(packet)
    assert (rec.datatype, bytes(rec.value), rec.xattrs) == (0x01, BODY, b"")


def test_received_malformed_blob_names_the_key() -> None:
    packet = Mutation(opaque=1, vbucket=3, cas=9, datatype=0x04, by_seqno=4, rev_seqno=1,
                      key=b"bad-doc", value=b"\x00\x00\x00\x40{}").encode()  # fmt: skip
    with pytest.raises(CorruptXattrsError, match="bad-doc"):
        _received(packet)
