"""The Snappy value codec (formats/wire.md "Snappy"): Snappy's raw block format, round
trips, and a typed error naming the key for a value that does not inflate."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol import snappy
from upr_cli.protocol.snappy import CorruptValueError

# Raw block format, written by hand from Snappy's format description, independently of
# the library: a varint of the inflated length, then elements. A literal of n ≤ 60
# bytes is the tag (n - 1) << 2; a copy with a 1-byte offset is
# 0b01 | (len - 4) << 2 | (offset >> 8) << 5, then the offset's low byte.
LITERAL_ABC = b"\x03" + b"\x08" + b"abc"
# "abcd" then a copy of 8 bytes from 4 back: "abcdabcdabcd"
LITERAL_AND_COPY = b"\x0c" + b"\x0cabcd" + bytes([0b01 | (8 - 4) << 2, 4])


def test_hand_written_raw_blocks_inflate() -> None:
    assert snappy.inflate(LITERAL_ABC) == b"abc"
    assert snappy.inflate(LITERAL_AND_COPY) == b"abcdabcdabcd"


def test_deflate_writes_the_raw_format_not_the_framed_one() -> None:
    value = b'{"name":"snappy","pad":"' + b"x" * 200 + b'"}'
    packed = snappy.deflate(value)
    assert packed[:2] == bytes([len(value) & 0x7F | 0x80, len(value) >> 7])  # varint length
    assert not packed.startswith(b"\xff\x06\x00\x00sNaPpY")  # the framed stream header
    assert len(packed) < len(value)
    assert snappy.inflated_length(packed) == len(value)


@given(st.binary(max_size=4096))
def test_round_trip(value: bytes) -> None:
    assert snappy.inflate(snappy.deflate(value)) == value


@given(st.binary(max_size=2048), st.sampled_from([0, 1, 4, 5]))
def test_compressed_then_plain_gives_back_value_and_bits(value: bytes, bits: int) -> None:
    dt, packed = snappy.compressed(bits, value)
    assert dt & ~snappy.SNAPPY == bits
    if dt & snappy.SNAPPY:
        assert len(packed) < len(value)
    else:
        assert packed == value  # empty or incompressible: sent plain
    assert snappy.plain(dt, packed) == (bits, value)


def test_plain_leaves_an_empty_value_and_its_bits() -> None:
    # NoValueWithUnderlyingDatatype: the document's bits, no value
    assert snappy.plain(snappy.SNAPPY | 0x01, b"") == (3, b"")


@pytest.mark.parametrize(
    "bad",
    [
        b"",  # not even a length
        b"\xff\xff\xff\xff\xff\xff",  # a length varint that never ends
        b"\x05\x00",  # a literal cut short
        b"\x04\x08abc",  # inflates to 3 bytes, declares 4
        b"\x06\x04a" + bytes([0b01, 9]),  # a copy from before the start
    ],
    ids=["empty", "varint", "short-literal", "length-mismatch", "bad-offset"],
)
def test_a_corrupt_value_is_a_typed_error_naming_the_key(bad: bytes) -> None:
    with pytest.raises(CorruptValueError) as err:
        snappy.inflate(bad, b"user::42")
    assert isinstance(err.value, RemoteProtocolError)
    assert err.value.key == b"user::42"
    assert "'user::42'" in str(err.value) and "corrupt Snappy value" in str(err.value)
    with pytest.raises(CorruptValueError):
        snappy.plain(snappy.SNAPPY, bad or b"\x00\x00", b"k")
    # in a batch, the same error names the bad value's key, not its neighbours'
    good = memoryview(snappy.deflate(b"fine" * 10))
    with pytest.raises(CorruptValueError) as err:
        snappy.inflate_all([good, bad, good], [b"a", b"user::42", b"c"])
    assert err.value.key == b"user::42"


def test_a_key_with_unprintable_bytes_is_named_escaped() -> None:
    with pytest.raises(CorruptValueError, match=r"'\\x00k1'"):
        snappy.inflate(b"\x05\x00", b"\x00k1")


def test_a_declared_length_over_the_limit_is_refused_before_inflating() -> None:
    packed = snappy.deflate(b"a" * 1000)
    with pytest.raises(CorruptValueError, match="declares 1000 bytes, more than 999"):
        snappy.inflate(packed, b"big", limit=999)
    # the default limit, 20 MiB: a 3-byte header can claim 2 GiB
    claim = b"\x80\x80\x80\x80\x08" + b"\x00"
    with pytest.raises(CorruptValueError, match="more than 20971520"):
        snappy.inflate(claim, b"bomb")


@given(st.lists(st.binary(max_size=300), max_size=8))
def test_a_batch_inflates_as_value_by_value(values: list[bytes]) -> None:
    packed = [memoryview(snappy.deflate(v)) for v in values]
    assert snappy.inflate_all(packed, [b"k"] * len(packed)) == values


def test_a_batch_refuses_a_declared_length_over_the_limit() -> None:
    packed = [snappy.deflate(b"a" * 10), snappy.deflate(b"a" * 1000)]
    with pytest.raises(CorruptValueError, match="declares 1000 bytes, more than 999") as err:
        snappy.inflate_all(packed, [b"small", b"big"], limit=999)
    assert err.value.key == b"big"


@given(st.binary(max_size=64), st.binary(min_size=1, max_size=8))
def test_inflate_never_raises_anything_else(data: bytes, key: bytes) -> None:
    try:
        snappy.inflate(data, key)
    except CorruptValueError as exc:
        assert exc.key == key
