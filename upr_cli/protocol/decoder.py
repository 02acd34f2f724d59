"""Streaming frame decoder: feed bytes in any chunking, take `Frame`s out.

Theory of operation. Received chunks are kept as a list and joined only when the
next frame is complete, so feeding a large frame one byte at a time stays linear.
The header is validated as soon as its 24 bytes are present (magic, body limit,
framing+extras+key fitting in the body, docs/protocol.md §1.1/§1.3), before the declared
body is waited for or allocated. Frames hold memoryview slices of the received buffer: no
per-frame copy of keys or values. After an error the decoder is poisoned and
raises the same error again. For any input it yields frames or raises
`RemoteProtocolError`, nothing else.
"""

from __future__ import annotations

import struct
from typing import Final, NamedTuple

from upr_cli.errors import RemoteProtocolError
from upr_cli.protocol import leb128
from upr_cli.protocol.header import ALT_MAGICS, HEADER, HEADER_LEN, VALID_MAGICS, Opcode

# Header + DCP_MUTATION extras in one call (docs/protocol.md §1.1 + §2.8): 24 + 31 = 55 bytes.
MUTATION_FRAME = struct.Struct(">BBHBBHIIQ" + "QQIIIHB")
_MUT_FIXED = MUTATION_FRAME.size
_MUT_EXTRAS = struct.Struct(">QQIIIHB")  # docs/protocol.md §2.8
_DEL_V1 = struct.Struct(">QQH")  # docs/protocol.md §2.9 v1: by_seqno, rev_seqno, nmeta
# docs/protocol.md §2.9 v2: by_seqno, rev_seqno, delete_time, unused
_DEL_V2 = struct.Struct(">QQIB")
_EXPIRY = struct.Struct(">QQI")  # docs/protocol.md §2.10: by_seqno, rev_seqno, delete_time
# Plain ints (not the IntEnum members): they are compared and stored per record.
OP_MUTATION = int(Opcode.DCP_MUTATION)
OP_DELETION = int(Opcode.DCP_DELETION)
OP_EXPIRATION = int(Opcode.DCP_EXPIRATION)


DEFAULT_MAX_BODY = 20 * 1024 * 1024
_EMPTY = memoryview(b"")


def data_fields(
    opcode: int, buf: bytes | memoryview, p: int, extlen: int
) -> tuple[int, int, int, int, int]:
    """(by_seqno, rev_seqno, flags, expiration, delete_time) from a data record's extras.

    Mutation docs/protocol.md §2.8 (31 B), deletion v1/v2 docs/protocol.md §2.9 (18/21 B),
    expiration docs/protocol.md §2.10 (20 B); any other length raises RemoteProtocolError.
    """
    if opcode == OP_MUTATION and extlen == 31:
        seq, rev, flags, exp, _lock, _nmeta, _nru = _MUT_EXTRAS.unpack_from(buf, p)
        return seq, rev, flags, exp, 0
    if opcode == OP_DELETION and extlen == 21:
        seq, rev, dtime, _unused = _DEL_V2.unpack_from(buf, p)
        return seq, rev, 0, 0, dtime
    if opcode == OP_DELETION and extlen == 18:
        seq, rev, _nmeta = _DEL_V1.unpack_from(buf, p)
        return seq, rev, 0, 0, 0
    if opcode == OP_EXPIRATION and extlen == 20:
        seq, rev, dtime = _EXPIRY.unpack_from(buf, p)
        return seq, rev, 0, 0, dtime
    raise RemoteProtocolError(f"opcode 0x{opcode:02x}: extras length {extlen} is wrong")


class DcpRecord(NamedTuple):
    """One DCP data record: a mutation, deletion or expiration, read by field name.

    Built by `FrameDecoder.read_rows` (the fast path) and `fast.record_from_frame`. For
    deletions and expirations `flags` and `expiration` are 0 and `delete_time` is set;
    key and value are memoryview slices of the received buffer. A new field (a
    collection id, xattrs) is added here and in the two builders, nowhere else.
    """

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
    # The collection id (0: the default collection). On a connection that negotiated
    # Collections the wire key starts with it as LEB128 (docs/protocol.md "Collections");
    # the decoder strips it, so `key` is always the document key.
    collection: int = 0
    # The xattr blob (formats/wire.md "Xattrs"), split off the value by the consumer
    # once the value is inflated: `value` is then the body alone and `datatype` lacks
    # the XATTR bit. b"" when the document has none (or before the split).
    xattrs: bytes = b""


ROW_FIELDS = DcpRecord._fields
# Field positions, for the few loops that read records by index (a read by name is an
# attribute lookup a field): `rec[R_VBUCKET]`, never `rec[1]` (Final: mypy knows each
# field's type).
R_OPCODE: Final = 0
R_VBUCKET: Final = 1
R_BY_SEQNO: Final = 2
R_REV_SEQNO: Final = 3
R_CAS: Final = 4
R_FLAGS: Final = 5
R_EXPIRATION: Final = 6
R_DELETE_TIME: Final = 7
R_DATATYPE: Final = 8
R_KEY: Final = 9
R_VALUE: Final = 10
R_OPAQUE: Final = 11
R_COLLECTION: Final = 12
R_XATTRS: Final = 13


class Frame(NamedTuple):
    """One packet as received: header fields and zero-copy views of the body parts.

    `vbucket_or_status` is the vbucket id for requests and the status for responses.
    """

    magic: int
    opcode: int
    datatype: int
    vbucket_or_status: int
    opaque: int
    cas: int
    framing: memoryview
    extras: memoryview
    key: memoryview
    value: memoryview

    @property
    def size(self) -> int:
        """Full wire size: header plus body (what flow control counts, docs/protocol.md §7.1)."""
        return HEADER_LEN + len(self.framing) + len(self.extras) + len(self.key) + len(self.value)


def check_header(hdr: tuple[int, ...], max_body: int) -> tuple[int, int, int, int]:
    """Validate an unpacked header; return (framing_len, key_len, extras_len, body_len)."""
    magic, _op, keylen, extlen, _dt, _vb, bodylen, _opaque, _cas = hdr
    if magic not in VALID_MAGICS:
        raise RemoteProtocolError(f"bad magic 0x{magic:02x}")
    if bodylen > max_body:
        raise RemoteProtocolError(f"body length {bodylen} exceeds the maximum {max_body}")
    framelen = 0
    if magic in ALT_MAGICS:
        framelen, keylen = keylen >> 8, keylen & 0xFF
    if framelen + extlen + keylen > bodylen:
        raise RemoteProtocolError(
            f"framing {framelen} + extras {extlen} + key {keylen} exceed body length {bodylen}"
        )
    return framelen, keylen, extlen, bodylen


class FrameDecoder:
    """Incremental decoder of memcached binary packets."""

    __slots__ = ("_buf", "_chunks", "_consumed", "_error", "_max_body", "_need", "_off", "_pending",
                 "collections")  # fmt: skip

    def __init__(self, max_body: int = DEFAULT_MAX_BODY, *, collections: bool = False) -> None:
        self._max_body = max_body
        # Keys of data records carry a LEB128 collection id (set once HELLO negotiated
        # Collections; `read_rows` splits it off into `DcpRecord.collection`).
        self.collections = collections
        self._buf: bytes = b""
        self._off = 0
        self._chunks: list[bytes] = []
        self._pending = 0  # bytes held in _chunks
        self._need = HEADER_LEN  # bytes the next frame needs, from _off
        self._error: RemoteProtocolError | None = None
        self._consumed = 0  # bytes of frames returned so far (flow control counts these)

    @property
    def consumed(self) -> int:
        """Total bytes of all frames returned so far (what docs/protocol.md §7.1 counts)."""
        return self._consumed

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) - self._off + self._pending

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes (copied only if mutable)."""
        if data:
            self._chunks.append(bytes(data))
            self._pending += len(data)

    def _fill(self) -> bool:
        """Make at least `_need` bytes available in `_buf[_off:]`; False if not yet received."""
        have = len(self._buf) - self._off
        if have >= self._need:
            return True
        if have + self._pending < self._need:
            return False
        parts = [self._buf[self._off :]] if have else []
        parts += self._chunks
        self._buf = b"".join(parts) if len(parts) > 1 else parts[0]
        self._off = 0
        self._chunks = []
        self._pending = 0
        return True

    def _prepare(self) -> bool:
        """Make the next whole frame contiguous at `_buf[_off:]`; False until it is all received.

        The header is checked as soon as its 24 bytes are here, before the body is awaited.
        """
        if self._error is not None:
            raise self._error
        self._need = HEADER_LEN
        if not self._fill():
            return False
        try:
            bodylen = check_header(HEADER.unpack_from(self._buf, self._off), self._max_body)[3]
        except RemoteProtocolError as exc:
            self._error = exc
            raise
        self._need = HEADER_LEN + bodylen
        return self._fill()

    def next_frame(self) -> Frame | None:
        """Return the next complete frame, or None when more bytes are needed."""
        if not self._prepare():
            return None
        buf, off = self._buf, self._off
        hdr = HEADER.unpack_from(buf, off)
        framelen, keylen, extlen, bodylen = check_header(hdr, self._max_body)
        mv = memoryview(buf)
        p = off + HEADER_LEN
        framing = mv[p : p + framelen] if framelen else _EMPTY
        p += framelen
        extras = mv[p : p + extlen] if extlen else _EMPTY
        p += extlen
        key = mv[p : p + keylen]
        p += keylen
        end = off + HEADER_LEN + bodylen
        self._off = end
        self._consumed += end - off
        return Frame(
            hdr[0], hdr[1], hdr[4], hdr[5], hdr[7], hdr[8], framing, extras, key, mv[p:end]
        )

    @property
    def max_body(self) -> int:
        """The largest body accepted; a server raises it once the peer has authenticated."""
        return self._max_body

    @max_body.setter
    def max_body(self, value: int) -> None:
        self._max_body = value

    # spec-shaped: one tuned loop over the wire layout of docs/protocol.md §2.8-§2.10;
    # kept whole, since a call per record would cost the rate bench/codec.py measures.
    def read_rows(self, limit: int = 1024, *, data_rows: bool = True) -> list[DcpRecord | Frame]:
        """The DCP fast path: up to `limit` items, data records as `DcpRecord`, the rest as Frames.

        A mutation, deletion or expiration request (magic 0x80) becomes a `DcpRecord` (one
        struct call for a mutation's header and extras, key and value as memoryview
        slices, no copies); anything else comes back as a `Frame` (`type(item) is Frame`)
        for `decode_message`. With `data_rows=False` every item is a Frame (a server
        reading requests: a malformed one must get EINVAL, not end the read).
        """
        out: list[DcpRecord | Frame] = []
        append = out.append
        unpack_hdr = HEADER.unpack_from
        unpack_mut = MUTATION_FRAME.unpack_from
        new = tuple.__new__  # builds the named record without a Python-level __new__ call
        record = DcpRecord
        max_body = self._max_body
        empty = _EMPTY
        colls = self.collections
        cid = 0
        while len(out) < limit:
            buf, off = self._buf, self._off
            end_buf = len(buf)
            mv = memoryview(buf)
            room = limit - len(out)
            while room:
                # The hot path: a classic DCP_MUTATION with its 31 bytes of extras, whole.
                while data_rows and room and end_buf - off >= 55:
                    (magic, opcode, keylen, extlen, datatype, vb, bodylen, opaque, cas,
                     seq, rev, flags, exp, _lock, _nmeta, _nru) = unpack_mut(buf, off)  # fmt: skip
                    end = off + 24 + bodylen
                    if (
                        magic != 0x80
                        or opcode != 0x57
                        or extlen != 31
                        or end > end_buf
                        or bodylen > max_body
                        or keylen + 31 > bodylen
                    ):
                        break
                    k = off + 55
                    value = mv[k + keylen : end]
                    if colls and keylen and buf[k] < 0x80:  # a one-byte id: the common case
                        cid, key = buf[k], mv[k + 1 : k + keylen]  # the key sliced once
                    else:
                        key = mv[k : k + keylen]
                        if colls:
                            cid, key = self._split(key, off)
                    append(new(record, (0x57, vb, seq, rev, cas, flags, exp, 0, datatype,
                                        key, value, opaque, cid, b"")))  # fmt: skip
                    off = end
                    room -= 1
                if not room or end_buf - off < 24:
                    break
                if end_buf - off >= 55:  # room for a whole mutation's header and extras
                    (magic, opcode, keylen, extlen, datatype, vb, bodylen, opaque, cas,
                     seq, rev, flags, exp, _lock, _nmeta, _nru) = unpack_mut(buf, off)  # fmt: skip
                else:  # too short to be a whole mutation: header only
                    magic, opcode, keylen, extlen, datatype, vb, bodylen, opaque, cas = unpack_hdr(
                        buf, off
                    )
                    seq = rev = flags = exp = 0
                end = off + 24 + bodylen
                if not (
                    0x80 <= magic <= 0x83
                    and bodylen <= max_body
                    and extlen + keylen <= bodylen
                    and end <= end_buf
                ):
                    break
                room -= 1
                k = off + 24 + extlen
                if magic == 0x80 and 0x57 <= opcode <= 0x59 and data_rows:
                    if opcode != 0x57 or extlen != 31:  # the hot path has all fields
                        try:
                            seq, rev, flags, exp, dtime = data_fields(opcode, buf, off + 24, extlen)
                        except RemoteProtocolError as exc:
                            self._off = off
                            self._error = exc
                            raise
                    else:
                        dtime = 0
                    value = mv[k + keylen : end]
                    if colls and keylen and buf[k] < 0x80:
                        cid, key = buf[k], mv[k + 1 : k + keylen]
                    else:
                        key = mv[k : k + keylen]
                        if colls:
                            cid, key = self._split(key, off)
                    append(new(record, (opcode, vb, seq, rev, cas, flags, exp, dtime, datatype,
                                        key, value, opaque, cid, b"")))  # fmt: skip
                    off = end
                    continue
                p = off + 24
                append(new(Frame, (magic, opcode, datatype, vb, opaque, cas, empty,
                                   mv[p:k] if extlen else empty, mv[k : k + keylen],
                                   mv[k + keylen : end])))  # fmt: skip
                off = end
            self._consumed += off - self._off
            self._off = off
            if len(out) >= limit or not self._prepare():
                break
            if self._buf[self._off] in ALT_MAGICS:
                frame = self.next_frame()  # flexible framing (e.g. stream-ids): typed path
                assert frame is not None
                append(frame)
            # else: the next classic frame is now contiguous; the fast loop takes it
        return out

    def _split(self, key: memoryview, off: int) -> tuple[int, memoryview]:
        """(collection id, document key) of a record's wire key; a malformed id is a
        RemoteProtocolError, raised as a malformed frame is (the read stops at it)."""
        if key and key[0] < 0x80:
            return key[0], key[1:]
        try:
            if not key:
                raise RemoteProtocolError("a data record without a collection id in its key")
            cid, n = leb128.decode(key)
        except RemoteProtocolError as exc:
            self._off = off
            self._error = exc
            raise
        return cid, key[n:]

    def frames(self) -> list[Frame]:
        """Return every complete frame currently buffered (the generic, typed-path reader)."""
        out: list[Frame] = []
        while (frame := self.next_frame()) is not None:
            out.append(frame)
        return out
