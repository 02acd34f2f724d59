"""Snappy-compressed values (datatype bit 0x02, docs/protocol.md §1.4).

Couchbase compresses a value on its own with Snappy's raw block format: a varint of
the inflated length, then the compressed elements, with no stream identifier and no
framing or checksums (formats/wire.md "Snappy"). `cramjam.snappy.compress_raw` and
`decompress_raw` are that format; cramjam's `compress`/`decompress` are the framed
format, which Couchbase never uses.

A value is inflated only after its declared length is checked against `MAX_VALUE`, so
a few hostile bytes cannot make a peer allocate gigabytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Final

import cramjam

from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol.header import Datatype

SNAPPY: Final = int(Datatype.SNAPPY)  # datatype bit (docs/protocol.md §1.4)
#: the largest inflated value accepted: kv_engine's largest item (20 MiB)
MAX_VALUE = 20 * 1024 * 1024


class CorruptValueError(RemoteProtocolError):
    """A value marked Snappy-compressed does not inflate; names the document's key."""

    def __init__(self, key: bytes | memoryview, reason: str) -> None:
        self.key = bytes(key)
        super().__init__(f"key {describe_key(self.key)}: corrupt Snappy value ({reason})")


def describe_key(key: bytes) -> str:
    """A key as text for a message: its UTF-8, non-printable bytes escaped."""
    text = key.decode("utf-8", errors="backslashreplace")
    return repr(text) if text.isprintable() else ascii(text)


def deflate(value: bytes | memoryview) -> bytes:
    """Compress a value in Snappy's raw block format."""
    return bytes(cramjam.snappy.compress_raw(value))


def inflated_length(value: bytes | memoryview, key: bytes | memoryview = b"") -> int:
    """The inflated length a compressed value declares; CorruptValueError if unreadable."""
    try:
        return int(cramjam.snappy.decompress_raw_len(value))
    except cramjam.DecompressionError as exc:
        raise CorruptValueError(key, str(exc) or "bad length header") from None


def inflate(value: bytes | memoryview, key: bytes | memoryview = b"",
            limit: int = MAX_VALUE) -> bytes:  # fmt: skip
    """Inflate a raw-format Snappy value; CorruptValueError (naming `key`) if it is not one
    or declares more than `limit` bytes."""
    size = inflated_length(value, key)
    if size > limit:
        raise CorruptValueError(key, f"declares {size} bytes, more than {limit}")
    try:
        out = bytes(cramjam.snappy.decompress_raw(value))
    except cramjam.DecompressionError as exc:
        raise CorruptValueError(key, str(exc) or "does not inflate") from None
    if len(out) != size:  # cramjam checks it; the wire contract is this length
        raise CorruptValueError(key, f"inflates to {len(out)} bytes, header says {size}")
    return out


_length = cramjam.snappy.decompress_raw_len
_inflate = cramjam.snappy.decompress_raw


def inflate_all(values: Sequence[bytes | memoryview], keys: Sequence[bytes | memoryview],
                limit: int = MAX_VALUE) -> list[bytes]:  # fmt: skip
    """`inflate` for a batch of values at once (the consumer's hot path: one call per
    batch, not three per record); the first value that does not inflate, or declares
    more than `limit` bytes, raises CorruptValueError naming its key, as `inflate` does."""
    with contextlib.suppress(cramjam.DecompressionError):  # then the loop names the key
        sizes = list(map(_length, values))
        if max(sizes, default=0) <= limit:
            out = [bytes(_inflate(v)) for v in values]
            if list(map(len, out)) == sizes:
                return out
    for value, key in zip(values, keys, strict=True):  # find the culprit, and name it
        inflate(value, key, limit)
    raise CorruptValueError(keys[0], "a value of its batch does not inflate")


def plain(datatype: int, value: bytes, key: bytes | memoryview = b"") -> tuple[int, bytes]:
    """A value inflated and its datatype without the Snappy bit; an empty value as it is."""
    if not datatype & SNAPPY or not value:
        # an empty value keeps its bits: NoValueWithUnderlyingDatatype sends the
        # document's datatype with no value (docs/protocol.md §2.2)
        return datatype, value
    return datatype & ~SNAPPY, inflate(value, key)


def compressed(datatype: int, value: bytes) -> tuple[int, bytes]:
    """A value with the Snappy bit set, compressed if it was not, kept plain when
    compressing would not make it smaller (an empty or incompressible value)."""
    if datatype & SNAPPY or not value:
        return datatype, value
    packed = deflate(value)
    if len(packed) >= len(value):
        return datatype, value
    return datatype | SNAPPY, packed
