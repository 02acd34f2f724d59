"""Extended attributes (datatype bit 0x04, formats/wire.md "Xattrs").

A value whose datatype has the XATTR bit starts with an xattr blob: a big-endian u32
giving the length of the pairs that follow, then for each pair a u32 pair length and
`name 0x00 value 0x00`; the document body follows the blob. A value is JSON text.
Names starting with `_` are system xattrs: a deleted document keeps them, and drops
the user xattrs with its body.

`DcpRecord.xattrs` holds the blob exactly as received (the u32 included) and
`DcpRecord.value` the body alone: `join` puts them back together for a write.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any, Final

from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol import snappy
from upr_cli.protocol.header import Datatype

XATTR: Final = int(Datatype.XATTR)  # datatype bit (docs/protocol.md §1.4)
#: kv_engine's limit on an xattr name (a longer key fails validation)
MAX_NAME = 15

_U32 = struct.Struct(">I")


class CorruptXattrsError(RemoteProtocolError):
    """A value marked with xattrs has a malformed blob; names the document's key."""

    def __init__(self, key: bytes | memoryview, reason: str) -> None:
        self.key = bytes(key)
        text = self.key.decode("utf-8", errors="backslashreplace")
        super().__init__(f"key {text!r}: malformed xattrs ({reason})")


def split(value: bytes | memoryview, key: bytes | memoryview = b"") -> tuple[bytes, bytes]:
    """(blob, body) of a value whose datatype has the XATTR bit; the blob is checked."""
    if len(value) < 4:
        raise CorruptXattrsError(key, f"value of {len(value)} bytes has no blob length")
    total = _U32.unpack_from(value)[0] + 4
    if total > len(value):
        raise CorruptXattrsError(key, f"blob of {total} bytes in a value of {len(value)}")
    blob = bytes(value[:total])
    pairs(blob, key)  # validate once, here, so later readers may trust it
    return blob, bytes(value[total:])


def unpack(
    datatype: int, value: bytes | memoryview, key: bytes | memoryview = b""
) -> tuple[int, bytes, bytes | memoryview]:
    """(datatype without the Snappy and XATTR bits, blob, body) of a value as sent or
    stored: inflated first (the blob and the body are compressed as one), then split."""
    if datatype & snappy.SNAPPY and value:
        value = snappy.inflate(value, key)
    datatype &= ~snappy.SNAPPY
    if datatype & XATTR:
        blob, body = split(value, key)
        return datatype & ~XATTR, blob, body
    return datatype, b"", value


def pairs(blob: bytes | memoryview, key: bytes | memoryview = b"") -> list[tuple[str, bytes]]:
    """The (name, value) pairs of a blob in stored order; an empty blob has none."""
    if not blob:
        return []
    view = memoryview(blob)
    if len(view) < 4 or _U32.unpack_from(view)[0] + 4 != len(view):
        raise CorruptXattrsError(key, "blob length does not match")
    out: list[tuple[str, bytes]] = []
    pos = 4
    while pos < len(view):
        if pos + 4 > len(view):
            raise CorruptXattrsError(key, f"pair length cut at byte {pos}")
        size = _U32.unpack_from(view, pos)[0]
        pos += 4
        raw = bytes(view[pos : pos + size])
        pos += size
        if len(raw) != size or size < 3 or raw[-1] != 0 or raw.count(0) != 2:
            raise CorruptXattrsError(key, f"pair at byte {pos - size - 4} is not name\\0value\\0")
        name, _, text = raw[:-1].partition(b"\0")
        try:
            out.append((name.decode("utf-8"), text))
        except UnicodeDecodeError:
            raise CorruptXattrsError(key, "a name is not UTF-8") from None
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def not_json(blob: bytes | memoryview, key: bytes | memoryview = b"") -> list[str]:
    """The names of a blob's xattrs whose value is not JSON text (strictly: no NaN or
    Infinity). kv_engine's validator refuses such a blob (XATTR_EINVAL); a consumer
    still takes it, so a backup may hold one."""
    bad = []
    for name, text in pairs(blob, key):
        try:
            json.loads(text, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError, RecursionError):
            bad.append(name)
    return bad


def encode(items: Mapping[str, bytes | str] | Iterable[tuple[str, bytes | str]]) -> bytes:
    """The blob of (name, JSON text) pairs, in the order given; b"" for none."""
    seq = items.items() if isinstance(items, Mapping) else items
    body = bytearray()
    for name, text in seq:
        raw = text.encode() if isinstance(text, str) else bytes(text)
        pair = name.encode() + b"\0" + raw + b"\0"
        body += _U32.pack(len(pair)) + pair
    return _U32.pack(len(body)) + bytes(body) if body else b""


def join(blob: bytes, body: bytes | memoryview, datatype: int) -> tuple[int, bytes]:
    """(datatype, value) for a write: the blob before the body, the XATTR bit set."""
    if not blob:
        return datatype & ~XATTR, bytes(body)
    return datatype | XATTR, blob + bytes(body)


def is_system(name: str) -> bool:
    """True for a system xattr (a name starting with `_`), kept by a tombstone."""
    return name.startswith("_")


def system_only(blob: bytes) -> bytes:
    """The blob with its user xattrs left out (what a deletion keeps)."""
    if not blob:
        return b""
    kept = [(n, v) for n, v in pairs(blob) if is_system(n)]
    return encode(kept)


def to_json(blob: bytes) -> dict[str, Any]:
    """The xattrs as a JSON object: each value parsed, or kept as text if it is not JSON."""
    out: dict[str, Any] = {}
    for name, text in pairs(blob):
        try:
            out[name] = json.loads(text)
        except ValueError:
            out[name] = text.decode("utf-8", errors="replace")
    return out


def from_json(obj: Mapping[str, Any]) -> bytes:
    """The blob of a JSON object of xattrs (the inverse of `to_json`)."""
    return encode((name, json.dumps(v, separators=(",", ":"))) for name, v in obj.items())
