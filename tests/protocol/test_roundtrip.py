"""encode → decode round-trips for every message class, with values drawn from its schema."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from upr_cli.protocol import FrameDecoder, decode_message
from upr_cli.protocol.fast import encode_mutation, record_from_frame
from upr_cli.protocol.messages import (
    _REQUESTS,
    _RESPONSES,
    MESSAGE_CLASSES,
    Message,
    Mutation,
    ObserveSeqnoResponse,
    Response,
    SnapshotMarkerV2,
    UnknownRequest,
)
from upr_cli.protocol.schema import FAILOVER_LOG, RAW, TEXT, U16, U16_LIST, U64, VB_SEQNOS, Layout

INT_RANGES = {"B": (0, 255), "H": (0, 0xFFFF), "I": (0, 2**32 - 1), "Q": (0, 2**64 - 1)}
INT_RANGES["q"] = (-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
CODECS: dict[object, st.SearchStrategy[Any]] = {
    RAW: st.binary(max_size=40),
    TEXT: st.text(max_size=30),
    U16: st.integers(0, 0xFFFF),
    U64: u64,
    U16_LIST: st.lists(st.integers(0, 0xFFFF), max_size=6).map(tuple),
    FAILOVER_LOG: st.lists(st.tuples(u64, u64), max_size=4).map(tuple),
    VB_SEQNOS: st.lists(st.tuples(st.integers(0, 0xFFFF), u64), max_size=4).map(tuple),
}
HEADER_FIELDS = {"opaque": "I", "cas": "Q", "datatype": "B", "vbucket": "H", "status": "H"}
SPECIFIC = [c for c in MESSAGE_CLASSES if c not in (Response, UnknownRequest)]


def _ints(code: str) -> st.SearchStrategy[int]:
    lo, hi = INT_RANGES[code]
    return st.integers(lo, hi)


@st.composite
def messages(draw: st.DrawFn, cls: type[Message]) -> Message:
    sch = cls.SCHEMA
    kw: dict[str, Any] = {}
    for name, code in HEADER_FIELDS.items():
        if name in {f.name for f in fields(cls)}:
            kw[name] = draw(_ints(code))
    if sch.response:
        kw["status"] = draw(st.sampled_from(sorted(sch.statuses or {0})))
    else:
        kw["stream_id"] = draw(st.none() | st.integers(0, 0xFFFF))
    for variants in (sch.extras, sch.value):
        if variants and isinstance(variants[0], Layout):
            chosen = draw(st.sampled_from(variants))
            for lay in variants:
                for fname, _ in lay.fields:
                    kw[fname] = None
            for fname, code in chosen.fields:
                kw[fname] = draw(_ints(code))
    for part in (sch.key, sch.value):
        if part is not None and not isinstance(part[0], Layout):
            kw[part[0]] = draw(CODECS[part[1]])
    if cls is SnapshotMarkerV2:
        kw["version"] = 0 if kw["purge_seqno"] is None else 2
    if cls is ObserveSeqnoResponse:
        kw["format"] = 0 if kw["old_vbucket_uuid"] is None else 1
    if "opcode" in {f.name for f in fields(cls)}:
        kw["opcode"] = draw(st.sampled_from(sch.opcodes))
    return cls(**kw)


def roundtrip(msg: Message) -> Message:
    data = msg.encode()
    dec = FrameDecoder()
    dec.feed(data)
    frame = dec.next_frame()
    assert frame is not None and dec.buffered == 0 and frame.size == len(data)
    return decode_message(frame)


@pytest.mark.parametrize("cls", SPECIFIC, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_message_round_trips(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(messages(cls))
    assert roundtrip(msg) == msg


@settings(max_examples=100)
@given(
    st.integers(0, 255).filter(lambda op: op not in _REQUESTS),
    st.binary(max_size=20),
    st.binary(max_size=20),
    st.binary(max_size=20),
    st.integers(0, 0xFFFF),
)
def test_unknown_requests_round_trip_raw(
    op: int, extras: bytes, key: bytes, value: bytes, vb: int
) -> None:
    msg = UnknownRequest(opcode=op, extras=extras, key=key, value=value, vbucket=vb)
    assert roundtrip(msg) == msg


@settings(max_examples=100)
@given(
    st.integers(0, 255).filter(lambda op: op not in _RESPONSES),
    st.integers(0, 0xFFFF),
    st.binary(max_size=20),
    st.binary(max_size=30),
)
def test_generic_responses_round_trip_raw(op: int, status: int, key: bytes, value: bytes) -> None:
    msg = Response(opcode=op, status=status, key=key, value=value)
    assert roundtrip(msg) == msg


@settings(max_examples=200)
@given(
    st.integers(0, 0xFFFF),
    st.integers(0, 2**32 - 1),
    u64,
    st.integers(0, 255),
    u64,
    u64,
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=300),
    st.binary(max_size=300),
)
def test_fast_mutation_path_matches_the_schema(
    vb: int, opaque: int, cas: int, dt: int, seq: int, rev: int, flags: int, exp: int,
    key: bytes, value: bytes,
) -> None:  # fmt: skip
    msg = Mutation(
        vbucket=vb, opaque=opaque, cas=cas, datatype=dt, by_seqno=seq, rev_seqno=rev,
        flags=flags, expiration=exp, key=key, value=value,
    )  # fmt: skip
    data = encode_mutation(vb, opaque, cas, dt, seq, rev, flags, exp, key, value)
    assert data == msg.encode()
    dec = FrameDecoder()
    dec.feed(data)
    (frame,) = dec.frames()
    rec = record_from_frame(frame)
    assert rec is not None
    assert (rec.vbucket, rec.by_seqno, rec.rev_seqno, rec.cas, rec.flags, rec.expiration) == (
        vb, seq, rev, cas, flags, exp,
    )  # fmt: skip
    assert bytes(rec.key) == key and bytes(rec.value) == value and rec.datatype == dt


@settings(max_examples=150)
@given(
    st.sampled_from([0x01, 0x02, 0x03]), st.integers(0, 0xFFFF), st.integers(0, 2**32 - 1),
    st.binary(max_size=40), st.binary(max_size=100), st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1), st.integers(0, 255), u64,
)  # fmt: skip
def test_fast_set_matches_the_schema(
    op: int, vb: int, opaque: int, key: bytes, value: bytes, flags: int, exp: int, dt: int,
    cas: int,
) -> None:  # fmt: skip
    from upr_cli.protocol.fast import encode_set, parse_set
    from upr_cli.protocol.messages import Add, Replace, Set

    cls = {0x01: Set, 0x02: Add, 0x03: Replace}[op]
    msg = cls(vbucket=vb, opaque=opaque, key=key, value=value, flags=flags, expiration=exp,
              datatype=dt, cas=cas)  # fmt: skip
    data = encode_set(op, vb, opaque, key, value, flags=flags, expiration=exp, datatype=dt, cas=cas)
    assert data == msg.encode()
    dec = FrameDecoder()
    dec.feed(data)
    frame = dec.next_frame()
    assert frame is not None and parse_set(frame) == (flags, exp, key, value)


@settings(max_examples=100)
@given(st.sampled_from([0x01, 0x02, 0x03, 0x04, 0xA2, 0xA8]), st.integers(0, 2**32 - 1), u64,
       st.none() | st.tuples(u64, u64))  # fmt: skip
def test_fast_store_response_matches_the_schema(
    op: int, opaque: int, cas: int, seq: tuple[int, int] | None
) -> None:
    from upr_cli.protocol.fast import encode_store_response
    from upr_cli.protocol.messages import StoreResponse

    uuid, seqno = seq if seq else (None, None)
    msg = StoreResponse(opcode=op, opaque=opaque, cas=cas, vbucket_uuid=uuid, seqno=seqno)
    assert encode_store_response(op, opaque, cas, uuid, seqno) == msg.encode()
