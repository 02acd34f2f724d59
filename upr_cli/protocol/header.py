"""The 24-byte memcached binary header, magics, opcodes, datatype bits and frame extras.

docs/protocol.md §1.1 (classic header), §1.3 (alternate header with flexible framing
extras: byte 2 is the framing-extras length, byte 3 the key length), docs/protocol.md §1.4
(datatype), docs/protocol.md §2 and §5.1 (opcodes, HELLO features). All integers are
big-endian.
"""

from __future__ import annotations

import struct
from enum import IntEnum, IntFlag
from typing import Final

from upr_cli.errors import LocalProtocolError, RemoteProtocolError

HEADER_LEN = 24
# magic, opcode, keylen(u16), extlen, datatype, vbucket/status, bodylen, opaque, cas
HEADER = struct.Struct(">BBHBBHIIQ")
# alternate header: magic, opcode, framelen(u8), keylen(u8), extlen, ...
ALT_HEADER = struct.Struct(">BBBBBBHIIQ")


class Magic(IntEnum):
    """Byte 0 of every packet (docs/protocol.md §1.2)."""

    REQUEST = 0x80
    RESPONSE = 0x81
    ALT_REQUEST = 0x08
    ALT_RESPONSE = 0x18
    SERVER_REQUEST = 0x82
    SERVER_RESPONSE = 0x83


RESPONSE_MAGICS = frozenset({Magic.RESPONSE, Magic.ALT_RESPONSE, Magic.SERVER_RESPONSE})
ALT_MAGICS = frozenset({Magic.ALT_REQUEST, Magic.ALT_RESPONSE})
VALID_MAGICS = frozenset(int(m) for m in Magic)


class Opcode(IntEnum):
    """Opcodes used by upr (docs/protocol.md §2, §5, §6)."""

    GET = 0x00
    SET = 0x01
    ADD = 0x02
    REPLACE = 0x03
    DELETE = 0x04
    STAT = 0x10
    TOUCH = 0x1C  # what the official SDK sends (formats/collections.md)
    GAT = 0x1D
    SET_VBUCKET = 0x3D
    SET_PARAM = 0x82  # ep-engine's engine-parameter command (formats/cluster.md §6)
    HELLO = 0x1F
    SASL_LIST_MECHS = 0x20
    SASL_AUTH = 0x21
    SASL_STEP = 0x22
    GET_ALL_VB_SEQNOS = 0x48
    DCP_OPEN = 0x50
    DCP_ADD_STREAM = 0x51
    DCP_CLOSE_STREAM = 0x52
    DCP_STREAM_REQ = 0x53
    DCP_GET_FAILOVER_LOG = 0x54
    DCP_STREAM_END = 0x55
    DCP_SNAPSHOT_MARKER = 0x56
    DCP_MUTATION = 0x57
    DCP_DELETION = 0x58
    DCP_EXPIRATION = 0x59
    DCP_SET_VBUCKET_STATE = 0x5B
    DCP_NOOP = 0x5C
    DCP_BUFFER_ACKNOWLEDGEMENT = 0x5D
    DCP_CONTROL = 0x5E
    DCP_SYSTEM_EVENT = 0x5F
    DCP_SEQNO_ADVANCED = 0x64
    SELECT_BUCKET = 0x89
    ENABLE_TRAFFIC = 0x8D  # front-end traffic on/off (formats/cluster.md §3)
    DISABLE_TRAFFIC = 0x8E
    OBSERVE_SEQNO = 0x91
    GET_FAILOVER_LOG = 0x96
    GET_META = 0xA0
    SET_WITH_META = 0xA2
    DEL_WITH_META = 0xA8
    SET_CLUSTER_CONFIG = 0xB4
    GET_CLUSTER_CONFIG = 0xB5
    COLLECTIONS_SET_MANIFEST = 0xB9  # docs/protocol.md "Collections"
    COLLECTIONS_GET_MANIFEST = 0xBA
    COLLECTIONS_GET_ID = 0xBB
    COLLECTIONS_GET_SCOPE_ID = 0xBC
    SUBDOC_MULTI_LOOKUP = 0xD0
    SUBDOC_MULTI_MUTATION = 0xD1  # formats/subdoc.md
    GET_ERROR_MAP = 0xFE
    UPR_BARRIER = 0xE1  # upr extension (formats/barrier.md)


class Datatype(IntFlag):
    """Datatype bits of header byte 5 (docs/protocol.md §1.4)."""

    RAW = 0x00
    JSON = 0x01
    SNAPPY = 0x02
    XATTR = 0x04


# The bits as plain ints for tests made per record, where `int & IntFlag` would build an
# enum member each time: this one, `snappy.SNAPPY` and `xattrs.XATTR`.
DATATYPE_JSON: Final = int(Datatype.JSON)


class Feature(IntEnum):
    """HELLO feature codes (docs/protocol.md §5.1) that upr names."""

    TCP_NODELAY = 0x03
    MUTATION_SEQNO = 0x04
    XATTR = 0x06
    XERROR = 0x07
    SELECT_BUCKET = 0x08
    SNAPPY = 0x0A
    JSON = 0x0B
    DUPLEX = 0x0C
    CLUSTERMAP_CHANGE_NOTIFICATION = 0x0D
    UNORDERED_EXECUTION = 0x0E
    TRACING = 0x0F
    ALT_REQUEST_SUPPORT = 0x10
    SYNC_REPLICATION = 0x11
    COLLECTIONS = 0x12


class FrameId(IntEnum):
    """Request frame-info ids (docs/protocol.md §1.3)."""

    BARRIER = 0
    DURABILITY = 1
    DCP_STREAM_ID = 2
    IMPERSONATE = 4
    PRESERVE_TTL = 5


def encode_frame_infos(infos: tuple[tuple[int, bytes], ...]) -> bytes:
    """Encode (id, data) frame infos with the 4-bit id/length nibbles and escapes."""
    out = bytearray()
    for fid, data in infos:
        n = len(data)
        if fid < 0 or fid > 15 + 255 or n > 15 + 255:
            raise LocalProtocolError(f"frame info id {fid} / length {n} out of range")
        id_nib, id_esc = (fid, None) if fid < 15 else (15, fid - 15)
        len_nib, len_esc = (n, None) if n < 15 else (15, n - 15)
        out.append((id_nib << 4) | len_nib)
        if id_esc is not None:
            out.append(id_esc)
        if len_esc is not None:
            out.append(len_esc)
        out += data
    return bytes(out)


def decode_frame_infos(buf: bytes | memoryview) -> tuple[tuple[int, bytes], ...]:
    """Decode flexible framing extras into (id, data) pairs; bad bytes raise RemoteProtocolError."""
    infos = []
    i, n = 0, len(buf)
    while i < n:
        b = buf[i]
        i += 1
        fid, flen = b >> 4, b & 0x0F
        if fid == 15:
            if i >= n:
                raise RemoteProtocolError("frame info id escape byte missing")
            fid += buf[i]
            i += 1
        if flen == 15:
            if i >= n:
                raise RemoteProtocolError("frame info length escape byte missing")
            flen += buf[i]
            i += 1
        if i + flen > n:
            raise RemoteProtocolError(f"frame info {fid} of length {flen} overruns framing extras")
        infos.append((fid, bytes(buf[i : i + flen])))
        i += flen
    return tuple(infos)
