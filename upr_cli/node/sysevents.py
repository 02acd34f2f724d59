"""How the node stores collection and scope system events: as document rows.

kv_engine weaves a system event into a partition's history as an item in a reserved
key namespace, collection id 1, the "system" namespace (docs/protocol.md
"Collections"). The node does the same, so a system event gets a seq, is persisted,
deduplicated, rolled back and replicated with the documents around it:

* every node key is qualified: LEB128 collection id, then the document key
  (`upr_cli.protocol.leb128.join_key`); the default collection's keys start with 0x00;
* a system row's key is 0x01, then `c` (a collection) or `s` (a scope), then the id
  as LEB128. One key per collection or scope: its drop replaces its creation (deleted
  = 1), as kv_engine's does;
* the row's `flags` hold the DCP event id, `expiry` the event version, and `value`
  the DCP message's key (the name) after a u16 length, then the DCP message's value.

A producer turns such a row back into a DCP_SYSTEM_EVENT with `event_of`; a replica
stores a received system event with `system_row`.
"""

from __future__ import annotations

import struct

from upr_cli.collections import ManifestChange, encode_event
from upr_cli.node_files import SYSTEM_NAMESPACE
from upr_cli.node_files import is_system_key as is_system_key
from upr_cli.protocol import leb128

_SYSTEM_PREFIX = bytes((SYSTEM_NAMESPACE,))
_NAME_LEN = struct.Struct(">H")


def system_key(change: ManifestChange) -> bytes:
    """The row key of a change: one per collection id, one per scope id."""
    if change.collection_id is not None:
        return _SYSTEM_PREFIX + b"c" + leb128.encode(change.collection_id)
    return _SYSTEM_PREFIX + b"s" + leb128.encode(change.scope_id)


def pack(event: int, version: int, key: bytes, value: bytes) -> tuple[int, int, bytes]:
    """(flags, expiry, value) columns of a system row holding a DCP system event."""
    return event, version, _NAME_LEN.pack(len(key)) + key + value


def system_row(change: ManifestChange) -> tuple[bytes, int, int, bytes, bool]:
    """(key, flags, expiry, value, deleted) of the row that records `change`."""
    event, version, name, value = encode_event(change)
    flags, expiry, packed = pack(event, version, name, value)
    return system_key(change), flags, expiry, packed, change.dropped


def event_of(flags: int, expiry: int, value: bytes) -> tuple[int, int, bytes, bytes]:
    """(event, version, key, value) of the DCP_SYSTEM_EVENT a system row holds."""
    (n,) = _NAME_LEN.unpack_from(value)
    return flags, expiry, bytes(value[2 : 2 + n]), bytes(value[2 + n :])
