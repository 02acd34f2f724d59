"""Unsigned LEB128, the encoding of a collection id at the front of a key.

On a connection that negotiated Collections (HELLO 0x12) every key that names a
document starts with its collection id as unsigned LEB128: seven bits a byte, least
significant first, the top bit set on every byte but the last (docs/protocol.md
"Collections"). kv_engine accepts only the canonical (shortest) form of at most five
bytes, holding a u32; so do we.
"""

from __future__ import annotations

from upr_cli.errors import RemoteProtocolError

MAX_BYTES = 5  # a u32 never needs more
U32_MAX = 0xFFFF_FFFF


def encode(value: int) -> bytes:
    """The canonical encoding of a u32."""
    if not 0 <= value <= U32_MAX:
        raise ValueError(f"collection id {value} is not a u32")
    if value < 0x80:
        return bytes((value,))  # the default collection and every id below 128: one byte
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[int, int]:
    """(value, offset after it) of the LEB128 u32 at `offset`; malformed bytes (no stop
    byte within five, more than 32 bits, a non-canonical form) are a RemoteProtocolError."""
    value = shift = 0
    end = min(len(data), offset + MAX_BYTES)
    for i in range(offset, end):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and i > offset:
                raise RemoteProtocolError("collection id: non-canonical LEB128 (a zero last byte)")
            if value > U32_MAX:
                raise RemoteProtocolError("collection id: LEB128 value above 32 bits")
            return value, i + 1
        shift += 7
    raise RemoteProtocolError("collection id: LEB128 with no stop byte within 5 bytes")


def split_key(key: bytes | memoryview) -> tuple[int, bytes | memoryview]:
    """(collection id, document key) of a collection-prefixed key."""
    if key and key[0] < 0x80:  # one byte: the common case, no loop
        return key[0], key[1:]
    cid, off = decode(key)
    return cid, key[off:]


def join_key(collection: int, key: bytes) -> bytes:
    """A collection-prefixed key: LEB128 id, then the document key."""
    return encode(collection) + key
