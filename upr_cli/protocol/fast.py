"""The DCP data fast path: mutations, deletions and expirations as plain row tuples.

A `Mutation` dataclass costs about 2 µs to build; a backup streams millions of them.
`FrameDecoder.read_rows` decodes a mutation's header and extras in one precompiled
`struct` call and leaves key and value as memoryview slices of the received buffer
(no per-frame copy). Rows are what sinks batch into segment blocks or `executemany`
(docs/design.md "Performance"). This module adds the record type, the fallback for frames the
row path hands back, and the producer's one-call mutation encoder.
"""

from __future__ import annotations

import struct

from upr_cli.errors import LocalProtocolError
from upr_cli.protocol import leb128
from upr_cli.protocol.decoder import (
    MUTATION_FRAME,
    OP_DELETION,
    OP_EXPIRATION,
    OP_MUTATION,
    DcpRecord,
    Frame,
    data_fields,
)
from upr_cli.protocol.header import Magic

__all__ = ["OP_DELETION", "OP_EXPIRATION", "OP_MUTATION", "DcpRecord", "encode_mutation"]


def record_from_frame(frame: Frame, *, collections: bool = False) -> DcpRecord | None:
    """The data record in `frame`, or None if it is not a mutation/deletion/expiration.

    For frames the row fast path hands back (e.g. magic 0x08 with a stream-id).
    `collections`: the key starts with a LEB128 collection id (the connection
    negotiated Collections), split off into the record's `collection`.
    """
    op = frame.opcode
    if frame.magic not in (Magic.REQUEST, Magic.ALT_REQUEST) or not (
        OP_MUTATION <= op <= OP_EXPIRATION
    ):
        return None
    seq, rev, flags, exp, dtime = data_fields(op, frame.extras, 0, len(frame.extras))
    cid, key = leb128.split_key(frame.key) if collections else (0, frame.key)
    return DcpRecord(op, frame.vbucket_or_status, seq, rev, frame.cas, flags, exp, dtime,
                     frame.datatype, key, frame.value, frame.opaque, cid)  # fmt: skip


def encode_mutation(
    vbucket: int,
    opaque: int,
    cas: int,
    datatype: int,
    by_seqno: int,
    rev_seqno: int,
    flags: int,
    expiration: int,
    key: bytes,
    value: bytes,
) -> bytes:
    """A DCP_MUTATION packet in one struct call (the producer's hot path)."""
    klen = len(key)
    try:
        head = MUTATION_FRAME.pack(
            Magic.REQUEST,
            OP_MUTATION,
            klen,
            31,
            datatype,
            vbucket,
            31 + klen + len(value),
            opaque,
            cas,
            by_seqno,
            rev_seqno,
            flags,
            expiration,
            0,
            0,
            0,
        )
    except struct.error as exc:
        raise LocalProtocolError(f"mutation field out of range: {exc}") from None
    return head + key + value


# -- KV fast paths (the load generator and the node's SET path) --------------------

_SET_FRAME = struct.Struct(">BBHBBHIIQII")  # header + SET extras (docs/protocol.md §11)
_STORE_RESPONSE = struct.Struct(">BBHBBHIIQ")
_STORE_RESPONSE_SEQ = struct.Struct(">BBHBBHIIQQQ")  # + u64 vbucket uuid, u64 seqno


def encode_set(
    opcode: int, vbucket: int, opaque: int, key: bytes, value: bytes, *, flags: int = 0,
    expiration: int = 0, datatype: int = 0, cas: int = 0,
) -> bytes:  # fmt: skip
    """A SET/ADD/REPLACE request in one struct call (same bytes as `Set(...).encode()`)."""
    klen = len(key)
    try:
        head = _SET_FRAME.pack(Magic.REQUEST, opcode, klen, 8, datatype, vbucket,
                               8 + klen + len(value), opaque, cas, flags, expiration)  # fmt: skip
    except struct.error as exc:
        raise LocalProtocolError(f"SET field out of range: {exc}") from None
    return head + key + value


def parse_set(frame: Frame) -> tuple[int, int, bytes, bytes]:
    """(flags, expiration, key, value) of a classic SET/ADD/REPLACE frame with 8-byte extras."""
    flags, expiration = _SET_EXTRAS.unpack(frame.extras)
    return flags, expiration, bytes(frame.key), bytes(frame.value)


_SET_EXTRAS = struct.Struct(">II")


def encode_store_response(
    opcode: int, opaque: int, cas: int, vbucket_uuid: int | None = None, seqno: int | None = None
) -> bytes:
    """A success reply to SET/ADD/REPLACE/DELETE/*_WITH_META (same bytes as `StoreResponse`)."""
    if vbucket_uuid is None or seqno is None:
        return _STORE_RESPONSE.pack(Magic.RESPONSE, opcode, 0, 0, 0, 0, 0, opaque, cas)
    return _STORE_RESPONSE_SEQ.pack(Magic.RESPONSE, opcode, 0, 16, 0, 0, 16, opaque, cas,
                                    vbucket_uuid, seqno)  # fmt: skip
