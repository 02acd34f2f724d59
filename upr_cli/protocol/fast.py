"""The DCP data fast path: mutations, deletions and expirations as plain row tuples.

A `Mutation` dataclass costs about 2 µs to build; a backup streams millions of them.
`FrameDecoder.read_rows` decodes a mutation's header and extras in one precompiled
`struct` call and leaves key and value as memoryview slices of the received buffer
(no per-frame copy). Rows are what sinks batch into segment blocks or `executemany`
(DESIGN "Performance"). This module adds the record type, the fallback for frames the
row path hands back, and the producer's one-call mutation encoder.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from upr_cli.errors import LocalProtocolError
from upr_cli.protocol.decoder import (
    MUTATION_FRAME,
    OP_DELETION,
    OP_EXPIRATION,
    OP_MUTATION,
    Frame,
    data_fields,
)
from upr_cli.protocol.header import Magic

__all__ = ["OP_DELETION", "OP_EXPIRATION", "OP_MUTATION", "DcpRecord", "encode_mutation"]


class DcpRecord(NamedTuple):
    """One DCP data record. `flags`/`expiration` are 0 and `delete_time` set for deletions."""

    opcode: int
    vbucket: int
    by_seqno: int
    rev_seqno: int
    cas: int
    flags: int
    expiration: int
    delete_time: int
    datatype: int
    key: memoryview | bytes
    value: memoryview | bytes
    opaque: int


def record_from_frame(frame: Frame) -> DcpRecord | None:
    """The data record in `frame`, or None if it is not a mutation/deletion/expiration.

    For frames the row fast path hands back (e.g. magic 0x08 with a stream-id).
    """
    op = frame.opcode
    if frame.magic not in (Magic.REQUEST, Magic.ALT_REQUEST) or not (
        OP_MUTATION <= op <= OP_EXPIRATION
    ):
        return None
    seq, rev, flags, exp, dtime = data_fields(op, frame.extras, 0, len(frame.extras))
    return DcpRecord(op, frame.vbucket_or_status, seq, rev, frame.cas, flags, exp, dtime,
                     frame.datatype, frame.key, frame.value, frame.opaque)  # fmt: skip


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
