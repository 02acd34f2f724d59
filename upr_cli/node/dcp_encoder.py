"""How a DCP connection's streams encode what they send (formats/wire.md "Xattrs",
"Snappy" and "Collections on DCP"; docs/protocol.md §2.4-§2.10).

One `StreamEncoder` per connection, fixed by its DCP_OPEN flags and HELLO features
(only `force_compression` and `expirations` change later, by DCP_CONTROL). It turns
storage rows or queued versions into encoded messages: mutations, deletions,
expirations and the system events its stream's view lets through. Both methods are the
producer's hot path; the backfill calls `encode_rows` on a pool thread, in the same call
that fetched the rows.

Xattrs: a document stores its blob in front of its body (bit 0x04). A connection opened
with IncludeXattrs gets it as stored; any other gets the body alone with the bit clear.
NoValue leaves the blob alone (or nothing), and a deletion carries its tombstone's
system xattrs (its user xattrs too with IncludeDeletedUserXattrs). The backfill's fast
path sends stored rows untouched only while none has a bit the connection cannot take.

Snappy: a connection whose HELLO granted Snappy gets the stored bytes and datatype as
they are (with `force_value_compression`, plain values compressed when that makes them
smaller); any other gets every value inflated and the Snappy bit cleared, as kv_engine's
producer does.
"""

from __future__ import annotations

from upr_cli.node.bucket import unpacked
from upr_cli.node.storage import ROW_DELETED, ROW_MUTATION_ARGS, ROW_SEQ, DocRow, StoredRow
from upr_cli.node.stream_view import StreamSpec
from upr_cli.node.sysevents import is_system_key
from upr_cli.protocol import snappy
from upr_cli.protocol.fast import encode_mutation
from upr_cli.protocol.messages import Deletion, DeletionV2, Expiration
from upr_cli.protocol.snappy import SNAPPY
from upr_cli.protocol.xattrs import XATTR, join, system_only


class StreamEncoder:
    """Encodes a connection's stream items as its open flags and features ask."""

    def __init__(self, *, no_value: int, keep_dt: int, delete_times: int, xattrs: bool,
                 deleted_user_xattrs: bool, snappy: bool) -> None:  # fmt: skip
        self.no_value = no_value  # NoValue or NoValueWithUnderlyingDatatype
        self.keep_dt = keep_dt  # NoValueWithUnderlyingDatatype
        self.delete_times = delete_times  # deletions as DELETION_V2, with their time
        self.xattrs = xattrs
        self.deleted_user_xattrs = deleted_user_xattrs
        self.snappy = snappy
        self.force_compression = False  # DCP_CONTROL force_value_compression
        # DCP_CONTROL enable_expiry_opcode: an expiration (a tombstone that keeps its
        # expiry) goes out as one only to a client that asked (docs/protocol.md §2.10),
        # as a deletion to the others
        self.expirations = False
        self._hidden_bits = (0 if snappy else SNAPPY) | (0 if xattrs else XATTR)
        self._no_fast_path = no_value | delete_times  # stored rows never go out as they are

    def encode_rows(self, spec: StreamSpec, rows: list[StoredRow]) -> list[bytes]:
        """Encode storage rows without building DocRows (all live mutations of collections
        the stream sends whole: the hot path)."""
        if not rows:
            return []
        view = spec.view
        plain = view.plain_ids()
        hidden = self._hidden_bits  # datatype bits this connection cannot take as stored
        if (
            self._no_fast_path
            or self.force_compression
            or any(map(ROW_DELETED, rows))
            or (hidden and any(r[7] & hidden for r in rows))
            or not all(r[1][0] in plain for r in rows)
        ):
            return self.encode(spec, [DocRow(*r) for r in rows])
        opaque, vb, args = spec.opaque, spec.vbucket, ROW_MUTATION_ARGS
        view.last_sent = ROW_SEQ(rows[-1])
        if view.collections:  # the stored (qualified) key is the wire key
            return [encode_mutation(vb, opaque, *args(r)) for r in rows]
        # without collections every row here is in the default collection: drop its 0x00
        return [encode_mutation(vb, opaque, r[4], r[7], r[2], r[3], r[5], r[6], r[1][1:], r[10])
                for r in rows]  # fmt: skip

    def encode(self, spec: StreamSpec, docs: list[DocRow]) -> list[bytes]:
        """Encode versions (queued, or rows the fast path could not take): what the
        stream's view sends of them, system events included."""
        no_value, keep_dt, v2 = self.no_value, self.keep_dt, self.delete_times
        expirations = self.expirations
        out = []
        opaque, vb, view = spec.opaque, spec.vbucket, spec.view
        plain, cut = view.plain_ids(), 0 if view.collections else 1
        # the datatype bits that make a stored value unfit to go out as it is
        special = self._hidden_bits | (XATTR if no_value else 0)
        for d in docs:
            if d.key[0] in plain:  # the common case: no LEB128 to read
                key = d.key[cut:]
            elif is_system_key(d.key):
                msg = view.event(vb, opaque, d)
                if msg is not None:
                    out.append(msg)
                    view.last_sent = d.seq
                if view.ended:
                    break  # nothing after the drop that emptied the filter goes out
                plain = view.plain_ids()  # the event may have changed the filter
                continue
            elif (seen := view.data_key(d.key)) is not None:
                key = seen
            else:
                continue
            view.last_sent = d.seq
            if not d.deleted:
                dt = d.datatype
                if dt & special:  # compressed or with xattrs, for a client that cannot take it
                    dt, value = self._reworked(d, no_value, keep_dt)
                else:
                    value = b"" if no_value else d.value
                    if no_value and not keep_dt:
                        dt = 0
                    if self.force_compression:
                        dt, value = snappy.compressed(dt, value)
                out.append(encode_mutation(vb, opaque, d.cas, dt, d.seq, d.rev_seq, d.flags,
                                           d.expiry, key, value))  # fmt: skip
                continue
            dt, value = self._tombstone_value(d) if d.datatype & XATTR else (0, b"")
            if d.expiry and expirations:
                out.append(Expiration(vbucket=vb, opaque=opaque, cas=d.cas, by_seqno=d.seq,
                                      rev_seqno=d.rev_seq, delete_time=d.delete_time,
                                      key=key, datatype=dt, value=value).encode())  # fmt: skip
            elif v2:
                out.append(DeletionV2(vbucket=vb, opaque=opaque, cas=d.cas, by_seqno=d.seq,
                                      rev_seqno=d.rev_seq, delete_time=d.delete_time,
                                      key=key, datatype=dt, value=value).encode())  # fmt: skip
            else:
                out.append(Deletion(vbucket=vb, opaque=opaque, cas=d.cas, by_seqno=d.seq,
                                    rev_seqno=d.rev_seq, key=key, datatype=dt,
                                    value=value).encode())  # fmt: skip
        return out

    def _reworked(self, d: DocRow, no_value: int, keep_dt: int) -> tuple[int, bytes]:
        """(datatype, value) of a mutation whose stored value this connection cannot take
        as it is: stored compressed for a client without Snappy, or with xattrs that go
        in part (`_stripped`)."""
        if d.datatype & XATTR and (no_value or not self.xattrs):
            dt, value = self._stripped(d, no_value, keep_dt)
        else:
            value = b"" if no_value else d.value
            dt = d.datatype if (not no_value or keep_dt) else 0
        if dt & SNAPPY and not self.snappy:
            # stored compressed, and this client cannot take it so
            dt, value = snappy.plain(dt, value, d.key)
            dt &= ~SNAPPY  # also with no value (NoValueWithUnderlyingDatatype)
        elif self.force_compression:
            dt, value = snappy.compressed(dt, value)
        return dt, value

    def _stripped(self, d: DocRow, no_value: int, keep_dt: int) -> tuple[int, bytes]:
        """A mutation of a document with xattrs that this connection gets in part: the
        blob without IncludeXattrs, the body with NoValue (formats/wire.md "Xattrs",
        point 4). The whole stored value is compressed as one: it is inflated first, and
        what is left goes out plain (`encode` compresses it again where asked)."""
        rest, blob, body = unpacked(d)
        if not self.xattrs:
            blob = b""
        if no_value:
            body = b""
            # NoValueWithUnderlyingDatatype: the document's bits, Snappy's only where
            # nothing is sent (a blob that is sent goes plain)
            rest = (rest | (0 if blob else d.datatype & snappy.SNAPPY)) if keep_dt else 0
        return join(blob, body, rest)

    def _tombstone_value(self, d: DocRow) -> tuple[int, bytes]:
        """(datatype, value) of a deletion or expiration: with IncludeXattrs the blob the
        tombstone kept, its user xattrs only with IncludeDeletedUserXattrs."""
        if not self.xattrs:
            return 0, b""
        blob = unpacked(d)[1]
        if not self.deleted_user_xattrs:
            blob = system_only(blob)
        return join(blob, b"", 0)
