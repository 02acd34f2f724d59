"""The DCP data fast path: mutations, deletions and expirations as plain row tuples.

A `Mutation` dataclass costs about 2 µs to build; a backup streams millions of them.
Here one precompiled `struct` call decodes a data record's extras and the key and
value stay memoryview slices of the received buffer (no per-frame copy). Rows are
what sinks batch into segment blocks or `executemany` (DESIGN "Performance").
Layouts are the same `Layout`s the message schemas use (dcp-wire §2.8-§2.10).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from upr_cli.errors import LocalProtocolError, RemoteProtocolError
from upr_cli.protocol.decoder import Frame
from upr_cli.protocol.header import HEADER, Magic, Opcode
from upr_cli.protocol.messages import (
    DELETION_V1_EXTRAS,
    DELETION_V2_EXTRAS,
    EXPIRATION_EXTRAS,
    MUTATION_EXTRAS,
)

OP_MUTATION = Opcode.DCP_MUTATION
OP_DELETION = Opcode.DCP_DELETION
OP_EXPIRATION = Opcode.DCP_EXPIRATION

_MUT = MUTATION_EXTRAS.struct
_DEL1 = DELETION_V1_EXTRAS.struct
_DEL2 = DELETION_V2_EXTRAS.struct
_EXP = EXPIRATION_EXTRAS.struct
# The header and the mutation extras in one call: 24 + 31 = 55 bytes (dcp-wire §2.8).
_MUTATION_FRAME = struct.Struct(HEADER.format + MUTATION_EXTRAS.struct.format[1:])
_MUTATION_FIXED = _MUTATION_FRAME.size


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
    """The data record in `frame`, or None if it is not a mutation/deletion/expiration."""
    op = frame.opcode
    ext = frame.extras
    if frame.magic not in (Magic.REQUEST, Magic.ALT_REQUEST):
        return None
    n = len(ext)
    if op == OP_MUTATION and n == 31:
        seq, rev, flags, exp, _lock, _nmeta, _nru = _MUT.unpack(ext)
        return DcpRecord(
            op,
            frame.vbucket_or_status,
            seq,
            rev,
            frame.cas,
            flags,
            exp,
            0,
            frame.datatype,
            frame.key,
            frame.value,
            frame.opaque,
        )
    if op == OP_DELETION:
        if n == 21:
            seq, rev, dtime, _unused = _DEL2.unpack(ext)
        elif n == 18:
            seq, rev, _nmeta = _DEL1.unpack(ext)
            dtime = 0
        else:
            raise RemoteProtocolError(f"DCP_DELETION extras length {n}, expected 18/21")
        return DcpRecord(
            op,
            frame.vbucket_or_status,
            seq,
            rev,
            frame.cas,
            0,
            0,
            dtime,
            frame.datatype,
            frame.key,
            frame.value,
            frame.opaque,
        )
    if op == OP_EXPIRATION and n == 20:
        seq, rev, dtime = _EXP.unpack(ext)
        return DcpRecord(
            op,
            frame.vbucket_or_status,
            seq,
            rev,
            frame.cas,
            0,
            0,
            dtime,
            frame.datatype,
            frame.key,
            frame.value,
            frame.opaque,
        )
    if op in (OP_MUTATION, OP_EXPIRATION):
        raise RemoteProtocolError(f"opcode 0x{op:02x}: extras length {n} is wrong")
    return None


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
        head = _MUTATION_FRAME.pack(
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
