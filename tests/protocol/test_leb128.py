"""LEB128 collection ids: kv_engine's table of examples, round trips, and the
malformed forms it refuses (docs/protocol.md "Collections")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol import leb128
from upr_cli.protocol.decoder import FrameDecoder
from upr_cli.protocol.fast import encode_mutation, record_from_frame

TABLE = [
    (0x00, "00"), (0x01, "01"), (0x7F, "7f"), (0x80, "8001"), (0x555, "d50a"),
    (0x7FFF, "ffff01"), (0xBFFF, "ffff02"), (0xFFFF, "ffff03"), (0x8000, "808002"),
    (0x5555, "d5aa01"), (0xCAFEF00, "80debf65"), (0xCAFEF00D, "8de0fbd70c"),
    (0xFFFFFFFF, "ffffffff0f"),
]  # fmt: skip


@pytest.mark.parametrize(("value", "hexed"), TABLE)
def test_the_documented_encodings(value: int, hexed: str) -> None:
    assert leb128.encode(value).hex() == hexed
    assert leb128.decode(bytes.fromhex(hexed)) == (value, len(hexed) // 2)


@given(st.integers(0, 0xFFFF_FFFF), st.binary(max_size=8))
def test_round_trip_and_the_key_after_it(value: int, key: bytes) -> None:
    joined = leb128.join_key(value, key)
    assert leb128.split_key(joined) == (value, key)
    assert leb128.decode(joined) == (value, len(leb128.encode(value)))


@pytest.mark.parametrize(
    "bad",
    ["81", "8080808080", "808080808000", "8100", "80808000", "ffffffff1f", ""],
)
def test_malformed_ids_are_protocol_errors(bad: str) -> None:
    with pytest.raises(RemoteProtocolError):
        leb128.decode(bytes.fromhex(bad))


def test_values_outside_u32_are_not_encoded() -> None:
    for v in (-1, 1 << 32):
        with pytest.raises(ValueError):
            leb128.encode(v)


@given(st.integers(0, 0xFFFF_FFFF), st.binary(min_size=1, max_size=20), st.booleans())
def test_the_decoder_splits_the_id_off_data_records(cid: int, key: bytes, fast: bool) -> None:
    wire = encode_mutation(3, 7, 9, 0, 5, 1, 0, 0, leb128.join_key(cid, key), b"v")
    dec = FrameDecoder(collections=True)
    dec.feed(wire)
    if fast:
        (rec,) = dec.read_rows()
    else:
        frame = dec.next_frame()
        assert frame is not None
        rec = record_from_frame(frame, collections=True)
    assert rec is not None
    assert (rec.collection, bytes(rec.key), bytes(rec.value)) == (cid, key, b"v")


def test_without_collections_the_key_is_whole_and_the_id_zero() -> None:
    dec = FrameDecoder()
    dec.feed(encode_mutation(3, 7, 9, 0, 5, 1, 0, 0, b"\x08doc", b"v"))
    (rec,) = dec.read_rows()
    assert (rec.collection, bytes(rec.key)) == (0, b"\x08doc")


def test_a_malformed_id_stops_the_read() -> None:
    dec = FrameDecoder(collections=True)
    dec.feed(encode_mutation(3, 7, 9, 0, 5, 1, 0, 0, b"\x80", b"v"))
    with pytest.raises(RemoteProtocolError):
        dec.read_rows()
