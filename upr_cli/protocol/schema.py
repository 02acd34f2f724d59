"""One schema per message gives both its encoder and its decoder.

A `Schema` names the opcode(s), whether the message is a request or a response, the
extras layout(s), and how the key and value map to fields. Byte offsets live only in
`Layout`s (a precompiled big-endian `struct`), so no offset is written twice. A layout
tuple with several variants is chosen by length on decode and by which optional
fields are set on encode (e.g. SET_WITH_META's 24/26/28/30-byte extras, docs/protocol.md §6).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from upr_cli.errors import LocalProtocolError, RemoteProtocolError


@dataclass(frozen=True, slots=True)
class Layout:
    """A fixed-size big-endian record: ordered (field, struct code) pairs."""

    fields: tuple[tuple[str, str], ...]

    @property
    def struct(self) -> struct.Struct:
        """The compiled struct (cached per layout)."""
        return _compiled(self)

    @property
    def names(self) -> tuple[str, ...]:
        """Field names in wire order."""
        return tuple(name for name, _ in self.fields)

    @property
    def size(self) -> int:
        """Encoded size in bytes."""
        return self.struct.size


_STRUCTS: dict[Layout, struct.Struct] = {}


def _compiled(layout: Layout) -> struct.Struct:
    s = _STRUCTS.get(layout)
    if s is None:
        s = _STRUCTS[layout] = struct.Struct(">" + "".join(code for _, code in layout.fields))
    return s


def layout(*fields: tuple[str, str]) -> Layout:
    """Build a Layout from (name, struct code) pairs."""
    return Layout(tuple(fields))


class Codec:
    """Turns a body part (key or value) into a field value and back."""

    name = "raw"

    def encode(self, value: Any) -> bytes:
        """Field value → bytes."""
        return bytes(value)

    def decode(self, data: memoryview) -> Any:
        """Bytes → field value; malformed bytes raise RemoteProtocolError."""
        return bytes(data)


class TextCodec(Codec):
    """UTF-8 text (names, control keys, stat values)."""

    name = "text"

    def encode(self, value: Any) -> bytes:
        """Field value → bytes."""
        if not isinstance(value, str):
            raise LocalProtocolError(f"expected str, got {type(value).__name__}")
        return value.encode()

    def decode(self, data: memoryview) -> Any:
        """Bytes → field value; malformed bytes raise RemoteProtocolError."""
        try:
            return bytes(data).decode()
        except UnicodeDecodeError as exc:
            raise RemoteProtocolError(f"invalid UTF-8 in text field: {exc.reason}") from None


class RecordsCodec(Codec):
    """A packed array of fixed-size records, decoded to a tuple of tuples (or ints)."""

    def __init__(self, name: str, fmt: str, scalar: bool = False):
        self.name = name
        self.item = struct.Struct(">" + fmt)
        self.scalar = scalar

    def encode(self, value: Any) -> bytes:
        """Field value → bytes."""
        try:
            if self.scalar:
                return b"".join(self.item.pack(v) for v in value)
            return b"".join(self.item.pack(*v) for v in value)
        except (struct.error, TypeError) as exc:
            raise LocalProtocolError(f"cannot encode {self.name}: {exc}") from None

    def decode(self, data: memoryview) -> Any:
        """Bytes → field value; malformed bytes raise RemoteProtocolError."""
        size = self.item.size
        if len(data) % size:
            raise RemoteProtocolError(f"{self.name} length {len(data)} is not a multiple of {size}")
        items = tuple(self.item.iter_unpack(data))
        if self.scalar:
            return tuple(v[0] for v in items)
        return items


class ScalarCodec(Codec):
    """Exactly one fixed-size integer."""

    def __init__(self, name: str, fmt: str):
        self.name = name
        self.item = struct.Struct(">" + fmt)

    def encode(self, value: Any) -> bytes:
        """Field value → bytes."""
        try:
            return self.item.pack(value)
        except (struct.error, TypeError) as exc:
            raise LocalProtocolError(f"cannot encode {self.name}: {exc}") from None

    def decode(self, data: memoryview) -> Any:
        """Bytes → field value; malformed bytes raise RemoteProtocolError."""
        if len(data) != self.item.size:
            raise RemoteProtocolError(
                f"{self.name} must be {self.item.size} bytes, got {len(data)}"
            )
        return self.item.unpack(data)[0]


RAW = Codec()
TEXT = TextCodec()
U16_LIST = RecordsCodec("u16 list", "H", scalar=True)
U16 = ScalarCodec("u16", "H")
U64 = ScalarCodec("u64", "Q")
FAILOVER_LOG = RecordsCodec("failover log", "QQ")  # {u64 uuid, u64 seqno}, newest first
VB_SEQNOS = RecordsCodec("vbucket seqnos", "HQ")  # {u16 vbid, u64 seqno}


@dataclass(frozen=True, slots=True)
class Schema:
    """How one message class maps to bytes.

    `opcodes[0]` is used when encoding unless the class has an `opcode` field.
    `extras` lists the accepted layouts (empty: no extras allowed). `value` is either
    (field, codec) or a tuple of layouts flattened into fields. `statuses` restricts
    which response statuses decode to this class (None: any).
    """

    opcodes: tuple[int, ...]
    response: bool = False
    extras: tuple[Layout, ...] = ()
    key: tuple[str, Codec] | None = None
    value: tuple[str, Codec] | tuple[Layout, ...] | None = None
    statuses: frozenset[int] | None = None
    check: Callable[[dict[str, Any]], str | None] | None = None

    def extras_sizes(self) -> frozenset[int]:
        """Accepted extras lengths."""
        return frozenset(lay.size for lay in self.extras) if self.extras else frozenset({0})


def pick_layout(variants: tuple[Layout, ...], fields: dict[str, Any], what: str) -> Layout:
    """The variant whose fields are exactly the ones set (not None) among all variants' fields."""
    for lay in variants:
        optional = {n for v in variants for n in v.names} - set(lay.names)
        if all(fields.get(n) is not None for n in lay.names) and all(
            fields.get(n) is None for n in optional
        ):
            return lay
    raise LocalProtocolError(f"no {what} layout matches the fields set")


def unpack_variant(
    variants: tuple[Layout, ...], data: memoryview, what: str, out: dict[str, Any]
) -> None:
    """Unpack `data` with the variant of matching length into `out` (others' fields → None)."""
    n = len(data)
    for lay in variants:
        if lay.size == n:
            for name in {f for v in variants for f in v.names}:
                out[name] = None
            out.update(zip(lay.names, lay.struct.unpack(data), strict=True))
            return
    sizes = "/".join(str(v.size) for v in variants)
    raise RemoteProtocolError(f"{what} length {n}, expected {sizes}")
