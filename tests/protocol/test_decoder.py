"""FrameDecoder: any bytes in any chunking give frames or RemoteProtocolError, nothing else."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol import FrameDecoder, decode_message
from upr_cli.protocol.messages import Message, Mutation, Noop, StreamRequestOk

HEADER = 24


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    """Split `data` at the given cut points."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


def drain(chunks: list[bytes], max_body: int = 1 << 20) -> list[Message]:
    """Feed chunks, reading frames after each; decode every frame to a message."""
    dec = FrameDecoder(max_body=max_body)
    msgs: list[Message] = []
    for chunk in chunks:
        dec.feed(chunk)
        for frame in dec.frames():
            msgs.append(decode_message(frame))
    return msgs


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_bytes_give_frames_or_remote_protocol_error(data: bytes, cuts: list[int]) -> None:
    with contextlib.suppress(RemoteProtocolError):
        drain(chunked(data, cuts), max_body=256)


@settings(max_examples=300)
@given(
    st.lists(
        st.sampled_from([0x80, 0x81, 0x08, 0x18, 0x82, 0x83]).flatmap(
            lambda magic: st.tuples(
                st.just(magic),
                st.integers(0, 255),  # opcode
                st.binary(min_size=0, max_size=3),  # framing
                st.binary(max_size=40),  # extras
                st.binary(max_size=8),  # key
                st.binary(max_size=20),  # value
                st.integers(0, 0xFFFF),  # vbucket / status
            )
        ),
        max_size=6,
    ),
    st.lists(st.integers(0, 10_000), max_size=8),
)
def test_structurally_valid_frames_decode_or_raise_typed(
    packets: list[tuple[int, int, bytes, bytes, bytes, bytes, int]], cuts: list[int]
) -> None:
    """Well-framed packets with random bodies: decoding never raises anything untyped."""
    stream = b""
    for magic, op, framing, extras, key, value, word in packets:
        alt = magic in (0x08, 0x18)
        body = (framing if alt else b"") + extras + key + value
        b23 = bytes([len(framing), len(key)]) if alt else len(key).to_bytes(2, "big")
        stream += (
            bytes([magic, op])
            + b23
            + bytes([len(extras), 0])
            + word.to_bytes(2, "big")
            + len(body).to_bytes(4, "big")
            + b"\x00" * 12
            + body
        )
    with contextlib.suppress(RemoteProtocolError):
        drain(chunked(stream, cuts))


def test_valid_stream_in_every_chunking_gives_the_same_messages() -> None:
    msgs: list[Message] = [
        StreamRequestOk(opaque=1, failover_log=((0xCAFEBABE, 0),)),
        Mutation(vbucket=5, opaque=1, by_seqno=1, key=b"k", value=b"v" * 100),
        Noop(opaque=9),
        Mutation(vbucket=5, opaque=1, by_seqno=2, key=b"k2", value=b"", stream_id=3),
    ]
    data = b"".join(m.encode() for m in msgs)
    for size in (1, 2, 3, 7, 23, 24, 25, 64, len(data)):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        assert drain(chunks) == msgs


def test_bad_magic_is_rejected_and_the_decoder_stays_poisoned() -> None:
    dec = FrameDecoder()
    dec.feed(b"\x42" + b"\x00" * 23)
    with pytest.raises(RemoteProtocolError, match="bad magic 0x42"):
        dec.next_frame()
    with pytest.raises(RemoteProtocolError):
        dec.frames()


def test_oversized_body_is_rejected_from_the_header_alone() -> None:
    dec = FrameDecoder(max_body=1000)
    header = bytes.fromhex("80 57 0000 00 00 0000 000003e9 00000000 0000000000000000")
    dec.feed(header)  # declares 1001 body bytes, none sent
    with pytest.raises(RemoteProtocolError, match="exceeds the maximum 1000"):
        dec.next_frame()


def test_default_limit_is_20_mib() -> None:
    dec = FrameDecoder()
    ok = (20 * 1024 * 1024).to_bytes(4, "big")
    dec.feed(bytes.fromhex("80 57 0000 00 00 0000") + ok + bytes(12))
    assert dec.next_frame() is None  # allowed, waits for the body
    dec = FrameDecoder()
    dec.feed(bytes.fromhex("80 57 0000 00 00 0000") + (20 * 1024 * 1024 + 1).to_bytes(4, "big"))
    dec.feed(bytes(12))
    with pytest.raises(RemoteProtocolError):
        dec.frames()


@pytest.mark.parametrize(
    ("hexhdr", "why"),
    [
        ("80 57 0010 05 00 0000 00000014", "extras 5 + key 16 exceed body 20"),
        ("80 57 0000 20 00 0000 0000001f", "extras 32 exceed body 31"),
        ("08 57 0302 00 00 0000 00000004", "framing 3 + key 2 exceed body 4"),
    ],
)
def test_lengths_that_do_not_fit_are_rejected(hexhdr: str, why: str) -> None:
    dec = FrameDecoder()
    dec.feed(bytes.fromhex(hexhdr) + bytes(12))
    with pytest.raises(RemoteProtocolError, match="exceed body length"):
        dec.next_frame()


def test_one_byte_feeding_of_a_large_frame_is_linear() -> None:
    """Feeding a 2 MiB frame one byte at a time must not re-join the buffer per byte."""
    m = Mutation(vbucket=1, by_seqno=1, key=b"k", value=b"x" * (2 * 1024 * 1024))
    data = m.encode()
    dec = FrameDecoder()
    view = memoryview(data)
    for i in range(len(data) - 1):
        dec.feed(view[i : i + 1])
        if i % 4096 == 0:
            assert dec.next_frame() is None
    dec.feed(view[-1:])
    frame = dec.next_frame()
    assert frame is not None and decode_message(frame) == m


def test_frames_are_zero_copy_views() -> None:
    m = Mutation(vbucket=1, by_seqno=1, key=b"key", value=b"value")
    dec = FrameDecoder()
    dec.feed(m.encode() * 3)
    frames = dec.frames()
    assert len(frames) == 3
    assert all(isinstance(f.value, memoryview) for f in frames)
    assert frames[0].value.obj is frames[2].value.obj  # one buffer, sliced
    assert bytes(frames[1].key) == b"key" and frames[1].size == len(m.encode())


# -- the DCP fast path: read_rows ----------------------------------------------

from upr_cli.protocol import Frame  # noqa: E402
from upr_cli.protocol.decoder import ROW_FIELDS  # noqa: E402
from upr_cli.protocol.fast import DcpRecord, record_from_frame  # noqa: E402
from upr_cli.protocol.messages import (  # noqa: E402
    Deletion,
    DeletionV2,
    Expiration,
    SnapshotMarker,
    StreamEnd,
)

u64 = st.integers(0, 2**64 - 1)
data_messages = st.one_of(
    st.builds(Mutation, vbucket=st.integers(0, 1023), opaque=st.integers(0, 2**32 - 1), cas=u64,
              datatype=st.integers(0, 7), by_seqno=u64, rev_seqno=u64,
              flags=st.integers(0, 2**32 - 1), expiration=st.integers(0, 2**32 - 1),
              key=st.binary(max_size=30), value=st.binary(max_size=300),
              stream_id=st.none() | st.integers(0, 9)),
    st.builds(Deletion, vbucket=st.integers(0, 1023), cas=u64, by_seqno=u64, rev_seqno=u64,
              key=st.binary(max_size=30), value=st.binary(max_size=20)),
    st.builds(DeletionV2, vbucket=st.integers(0, 1023), cas=u64, by_seqno=u64, rev_seqno=u64,
              delete_time=st.integers(0, 2**32 - 1), key=st.binary(max_size=30)),
    st.builds(Expiration, vbucket=st.integers(0, 1023), cas=u64, by_seqno=u64, rev_seqno=u64,
              delete_time=st.integers(0, 2**32 - 1), key=st.binary(max_size=30)),
    st.builds(SnapshotMarker, vbucket=st.integers(0, 1023), start_seqno=u64, end_seqno=u64,
              flags=st.integers(0, 0x3F)),
    st.builds(StreamEnd, vbucket=st.integers(0, 1023), status=st.integers(0, 8)),
    st.builds(Noop, opaque=st.integers(0, 2**32 - 1)),
)  # fmt: skip


def expected_row(msg: Message) -> tuple[object, ...] | Message:
    """What read_rows must return for `msg`: a row for classic data messages, else the message."""
    data = msg.encode()
    dec = FrameDecoder()
    dec.feed(data)
    frame = dec.next_frame()
    assert frame is not None
    rec = record_from_frame(frame)
    if rec is None or frame.magic != 0x80:
        return msg
    return tuple(bytes(v) if isinstance(v, memoryview) else v for v in rec)


@settings(max_examples=200, deadline=None)
@given(st.lists(data_messages, max_size=12), st.lists(st.integers(0, 5000), max_size=6),
       st.integers(1, 5))  # fmt: skip
def test_read_rows_agrees_with_the_typed_path(
    msgs: list[Message], cuts: list[int], limit: int
) -> None:
    stream = b"".join(m.encode() for m in msgs)
    dec = FrameDecoder()
    got: list[object] = []
    for chunk in chunked(stream, cuts):
        dec.feed(chunk)
        while batch := dec.read_rows(limit):
            assert len(batch) <= limit
            for item in batch:
                if type(item) is Frame:
                    got.append(decode_message(item))
                else:
                    got.append(tuple(bytes(v) if isinstance(v, memoryview) else v for v in item))
    assert got == [expected_row(m) for m in msgs]
    assert dec.buffered == 0


def test_row_layout_matches_dcp_record() -> None:
    assert DcpRecord._fields == ROW_FIELDS


@pytest.mark.parametrize("extlen", [0, 17, 30, 32])
def test_read_rows_rejects_bad_data_extras(extlen: int) -> None:
    body = bytes(extlen) + b"k"
    pkt = (bytes([0x80, 0x57, 0, 1, extlen, 0, 0, 0]) + len(body).to_bytes(4, "big")
           + bytes(12) + body)  # fmt: skip
    dec = FrameDecoder()
    dec.feed(pkt + Noop().encode())
    if extlen == 0:
        # too short to be a mutation at all: the typed path reports it
        with pytest.raises(RemoteProtocolError):
            for item in dec.read_rows():
                assert type(item) is Frame
                decode_message(item)
        return
    with pytest.raises(RemoteProtocolError, match="extras length"):
        dec.read_rows()
    with pytest.raises(RemoteProtocolError):
        dec.read_rows()


@settings(max_examples=300)
@given(st.binary(max_size=600), st.lists(st.integers(0, 10_000), max_size=12))
def test_read_rows_on_any_bytes_gives_items_or_remote_protocol_error(
    data: bytes, cuts: list[int]
) -> None:
    dec = FrameDecoder(max_body=256)
    with contextlib.suppress(RemoteProtocolError):
        for chunk in chunked(data, cuts):
            dec.feed(chunk)
            while batch := dec.read_rows(7):
                for item in batch:
                    if type(item) is Frame:
                        decode_message(item)


def test_fast_path_structs_match_the_message_layouts() -> None:
    """The decoder cannot import messages (cycle); its struct codes must equal the schemas'."""
    from upr_cli.protocol import decoder
    from upr_cli.protocol.header import HEADER
    from upr_cli.protocol.messages import (
        DELETION_V1_EXTRAS,
        DELETION_V2_EXTRAS,
        EXPIRATION_EXTRAS,
        MUTATION_EXTRAS,
    )

    assert decoder.MUTATION_FRAME.format == HEADER.format + MUTATION_EXTRAS.struct.format[1:]
    assert decoder._MUT_EXTRAS.format == MUTATION_EXTRAS.struct.format
    assert decoder._DEL_V1.format == DELETION_V1_EXTRAS.struct.format
    assert decoder._DEL_V2.format == DELETION_V2_EXTRAS.struct.format
    assert decoder._EXPIRY.format == EXPIRATION_EXTRAS.struct.format


def test_record_field_positions_name_the_fields() -> None:
    """The R_ constants the hot loops index records with are the fields' positions."""
    from upr_cli.protocol import decoder

    positions = {f: getattr(decoder, "R_" + f.upper()) for f in decoder.ROW_FIELDS}
    assert list(positions.values()) == list(range(len(decoder.ROW_FIELDS)))
