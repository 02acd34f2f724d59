"""Client side of the sub-document commands (formats/subdoc.md): request specs in, the
bytes of SUBDOC_MULTI_MUTATION (0xd1) and SUBDOC_MULTI_LOOKUP (0xd0) out, and the
lookup response's per-path results back.

A mutation spec is `u8 op, u8 path flags, u16 path length, u32 value length, path,
value`; a lookup spec is `u8 op, u8 path flags, u16 path length, path` (big-endian).
Xattr specs come first, as kv_engine requires. Document flags (MKDOC, ADD,
ACCESS_DELETED) ride in one byte of extras, sent only when non-zero.

The spec opcodes, path and document flags and the spec and result layouts are defined
here once, for this encoder and for the engine of `upr serve` (`upr_cli/node/subdoc.py`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol.header import Opcode
from upr_cli.protocol.messages import UnknownRequest

MULTI_LOOKUP, MULTI_MUTATION = Opcode.SUBDOC_MULTI_LOOKUP, Opcode.SUBDOC_MULTI_MUTATION


class SpecOp(IntEnum):
    """The opcode of one spec (formats/subdoc.md §3; 0x00, 0x01 and 0x04 are the
    whole-document GET, SET and DELETE)."""

    GET_DOC = 0x00
    SET_DOC = 0x01
    DELETE_DOC = 0x04
    GET = 0xC5
    EXISTS = 0xC6
    DICT_ADD = 0xC7
    DICT_UPSERT = 0xC8
    DELETE = 0xC9
    REPLACE = 0xCA
    ARRAY_PUSH_LAST = 0xCB
    ARRAY_PUSH_FIRST = 0xCC
    ARRAY_INSERT = 0xCD
    ARRAY_ADD_UNIQUE = 0xCE
    COUNTER = 0xCF
    GET_COUNT = 0xD2


# the spec opcodes by their bare names, as the client's callers write them
GET_DOC, SET_DOC, DELETE_DOC = SpecOp.GET_DOC, SpecOp.SET_DOC, SpecOp.DELETE_DOC
GET, EXISTS, GET_COUNT = SpecOp.GET, SpecOp.EXISTS, SpecOp.GET_COUNT
DICT_ADD, DICT_UPSERT = SpecOp.DICT_ADD, SpecOp.DICT_UPSERT
DELETE, REPLACE, COUNTER = SpecOp.DELETE, SpecOp.REPLACE, SpecOp.COUNTER
ARRAY_PUSH_LAST, ARRAY_PUSH_FIRST = SpecOp.ARRAY_PUSH_LAST, SpecOp.ARRAY_PUSH_FIRST
# path flags
MKDIR_P, XATTR_PATH, EXPAND_MACROS = 0x01, 0x04, 0x10
# document flags; upr serve refuses the last three (formats/subdoc.md §3)
MKDOC, ADD, ACCESS_DELETED = 0x01, 0x02, 0x04
CREATE_AS_DELETED, REVIVE_DOCUMENT, REPLICA_READ = 0x08, 0x10, 0x20
DOC_FLAGS = MKDOC | ADD | ACCESS_DELETED | CREATE_AS_DELETED | REVIVE_DOCUMENT | REPLICA_READ
#: expands to the document's new CAS: "0x" and its 8 bytes, little-endian, in hex
CAS_MACRO = b'"${Mutation.CAS}"'

# the layouts of formats/subdoc.md §2
MUTATION_SPEC = struct.Struct(">BBHI")  # opcode, path flags, path length, value length
LOOKUP_SPEC = struct.Struct(">BBH")  # opcode, path flags, path length
LOOKUP_RESULT = struct.Struct(">HI")  # status, value length
MUTATION_RESULT = struct.Struct(">BHI")  # spec index, status, value length
MUTATION_FAILURE = struct.Struct(">BH")  # spec index, status
EXPIRY = struct.Struct(">I")  # a mutation's extras start with it


@dataclass(frozen=True, slots=True)
class Spec:
    """One path operation: `value` is JSON text (empty for lookups and deletes)."""

    op: int
    path: str = ""
    value: bytes = b""
    flags: int = 0


def _ordered(specs: Sequence[Spec]) -> list[Spec]:
    """Xattr specs first, each group in the given order (kv_engine's rule)."""
    return sorted(specs, key=lambda s: not s.flags & XATTR_PATH)


def multi_mutation(vbucket: int, opaque: int, key: bytes, specs: Sequence[Spec], *,
                   doc_flags: int = 0, cas: int = 0, expiry: int = 0) -> bytes:  # fmt: skip
    """The SUBDOC_MULTI_MUTATION request for `specs` on `key`. A non-zero `expiry` goes
    first in the extras (without one the server clears the document's, as kv_engine
    does)."""
    body = b"".join(
        MUTATION_SPEC.pack(s.op, s.flags, len(p := s.path.encode()), len(s.value)) + p + s.value
        for s in _ordered(specs)
    )
    head = EXPIRY.pack(expiry) if expiry else b""
    return _request(MULTI_MUTATION, vbucket, opaque, key, body, doc_flags, cas, head)


def multi_lookup(vbucket: int, opaque: int, key: bytes, specs: Sequence[Spec], *,
                 doc_flags: int = 0) -> bytes:  # fmt: skip
    """The SUBDOC_MULTI_LOOKUP request for `specs` on `key` (results in the given order
    only if xattr specs already come first)."""
    body = b"".join(
        LOOKUP_SPEC.pack(s.op, s.flags, len(p := s.path.encode())) + p for s in _ordered(specs)
    )
    return _request(MULTI_LOOKUP, vbucket, opaque, key, body, doc_flags, 0)


def _request(opcode: int, vbucket: int, opaque: int, key: bytes, body: bytes, doc_flags: int,
             cas: int, head: bytes = b"") -> bytes:  # fmt: skip
    extras = head + (bytes([doc_flags]) if doc_flags else b"")
    msg = UnknownRequest(opcode=opcode, vbucket=vbucket, opaque=opaque, cas=cas, extras=extras,
                         key=key, value=body)  # fmt: skip
    return msg.encode()


def lookup_results(value: bytes | memoryview) -> list[tuple[int, bytes]]:
    """(status, value) per spec of a SUBDOC_MULTI_LOOKUP response body."""
    view, pos, out = memoryview(value), 0, []
    while pos < len(view):
        if pos + 6 > len(view):
            raise RemoteProtocolError(f"subdoc lookup result cut at byte {pos}")
        status, size = LOOKUP_RESULT.unpack_from(view, pos)
        pos += 6
        if pos + size > len(view):
            raise RemoteProtocolError(f"subdoc lookup result overruns the body at byte {pos}")
        out.append((status, bytes(view[pos : pos + size])))
        pos += size
    return out
