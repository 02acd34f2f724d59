"""Byte layouts of segment files (formats/segment.md is normative; offsets live only here)."""

from __future__ import annotations

import json
import operator
import re
import struct
import sys
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from upr_cli.collections import ManifestChange, decode_event, encode_event
from upr_cli.errors import UprError
from upr_cli.failover import FailoverLog, InvalidFailoverLog
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_EXPIRATION, OP_MUTATION, DcpRecord
from upr_cli.protocol.header import Opcode

MAGIC = b"\x89USEG\r\n\x1a"
END_MAGIC = b"USEGEND\n"
# 2: a collection id per record, system events as records; 3: an xattrs column
# (formats/segment.md "Versions")
VERSION = 3
VERSIONS = frozenset({1, 2, 3})  # what a reader accepts: version 1 holds collection 0 only
PREAMBLE = struct.Struct("<8sHHI")  # magic, version, flags, header_len
CRC = struct.Struct("<I")
RECORD_HEAD = struct.Struct("<BBHIQQQIIII")  # op, datatype, key_len, value_len, seq, rev, cas,
# flags, expiry, delete_time, collection (version 1: reserved, 0)
FOOTER_FIXED = struct.Struct("<IIQQQQ")  # block_count, events (v1: reserved), records,
# raw_bytes, first, last
BLOCK_ENTRY = struct.Struct("<QQQIIII")  # offset, first, last, clen, rlen, count, crc
TRAILER = struct.Struct("<QII8s")  # footer_offset, footer_len, footer_crc, end magic
MAX_HEADER = 1 << 20
OP_SYSTEM_EVENT = int(Opcode.DCP_SYSTEM_EVENT)  # 0x5f: a collection or scope created or dropped
DATA_OPS = frozenset({OP_MUTATION, OP_DELETION, OP_EXPIRATION})
OPS = DATA_OPS | {OP_SYSTEM_EVENT}  # what version 2 holds
OPS_BY_VERSION = {1: DATA_OPS, 2: OPS, 3: OPS}
XATTR = xattrs.XATTR  # a head's datatype bit: the record has a blob in the xattrs column
BLOB_LEN = struct.Struct(">I")  # a blob starts with its big-endian length (formats/wire.md)
# byte → its XATTR bit: a block's datatype column translated, counted in C
_XATTR_BITS = bytes(b & XATTR for b in range(256))
_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z")  # ASCII
U64 = (1 << 64) - 1


class Record(NamedTuple):
    """One record as a segment reader hands it out (formats/segment.md, Blocks), read by
    field name. The partition is the segment's; a writer takes `DcpRecord`s instead."""

    op: int
    seq: int
    rev_seq: int
    cas: int
    flags: int
    expiry: int
    delete_time: int
    datatype: int
    key: bytes
    value: bytes
    # the collection id (0: `_default._default`, and every record of a version 1 file)
    collection: int = 0
    # the xattr blob (formats/wire.md "Xattrs"; b"": none, and every record before
    # version 3); `value` is the body alone and `datatype` lacks the XATTR bit, as the
    # consumer hands records out
    xattrs: bytes = b""

    def as_dcp(self, vbucket: int) -> DcpRecord:
        """The same record as the DCP record a stream of `vbucket` delivers (opaque 0)."""
        return DcpRecord(self.op, vbucket, self.seq, self.rev_seq, self.cas, self.flags,
                         self.expiry, self.delete_time, self.datatype, self.key, self.value,
                         0, self.collection, self.xattrs)  # fmt: skip

    @property
    def is_event(self) -> bool:
        """True for a system event record (formats/segment.md "System events")."""
        return self.op == OP_SYSTEM_EVENT

    def change(self, partition: int) -> ManifestChange | None:
        """The manifest change a system event record holds (None: not an event, or an
        event upr does not use); a malformed one raises CollectionsError."""
        if self.op != OP_SYSTEM_EVENT:
            return None
        return decode_event(partition, self.seq, self.flags, self.expiry, self.key, self.value)


SegmentRecord = Record  # the name the collections contract uses


def event_record(change: ManifestChange) -> DcpRecord:
    """A system event as the record a segment stores (formats/segment.md "System
    events"): key the name, flags the event id, expiry its version, value the event's
    value, collection the collection id (0 for a scope event)."""
    event, version, key, value = encode_event(change)
    return DcpRecord(OP_SYSTEM_EVENT, change.partition, change.seq, 0, 0, event, version, 0, 0,
                     key, value, 0, change.collection_id or 0)  # fmt: skip


RECORD_FIELDS = Record._fields


class SegmentError(UprError):
    """A segment file is missing, unreadable, corrupt or truncated."""

    def __init__(self, path: object, reason: str, block: int | None = None) -> None:
        self.path, self.reason, self.block = path, reason, block
        where = f"{path}" + (f", block {block}" if block is not None else "")
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """What a segment says about itself (formats/segment.md, Header)."""

    bucket: str
    partition: int
    failover_log: FailoverLog
    start_seq: int
    end_seq: int
    snapshots: tuple[tuple[int, int], ...] = ()
    created: str = "1970-01-01T00:00:00.000000Z"
    source: str = ""
    block_size: int = 1 << 20
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def uuid(self) -> int:
        """The branch the records belong to."""
        return self.failover_log.latest.uuid

    def to_bytes(self) -> bytes:
        """The header JSON (decimal strings for 64-bit values)."""
        obj = {
            "bucket": self.bucket, "partition": self.partition, "uuid": str(self.uuid),
            "failover_log": self.failover_log.to_json(), "start_seq": str(self.start_seq),
            "end_seq": str(self.end_seq),
            "snapshots": [[str(a), str(b)] for a, b in self.snapshots],
            "created": self.created, "source": self.source, "block_size": self.block_size,
        }  # fmt: skip
        return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, path: object) -> SegmentHeader:
        """Parse and validate a header; problems raise SegmentError."""
        try:
            obj = json.loads(data)
            log = FailoverLog.from_json(obj["failover_log"])
            hdr = cls(
                bucket=str(obj["bucket"]), partition=_int(obj["partition"], 0, 1023),
                failover_log=log, start_seq=_int(obj["start_seq"]), end_seq=_int(obj["end_seq"]),
                snapshots=tuple((_int(a), _int(b)) for a, b in obj["snapshots"]),
                created=str(obj["created"]), source=str(obj["source"]),
                block_size=_int(obj["block_size"], 1, 1 << 30),
            )  # fmt: skip
            if int(obj["uuid"]) != hdr.uuid:
                raise ValueError("uuid is not the failover log's newest entry")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, InvalidFailoverLog) as exc:
            raise SegmentError(path, f"bad header: {exc}") from None
        if hdr.start_seq > hdr.end_seq:
            raise SegmentError(path, f"bad header: start {hdr.start_seq} > end {hdr.end_seq}")
        if not _TIME.fullmatch(hdr.created):
            raise SegmentError(path, f"bad header: created {hdr.created!r}")
        return hdr


def _int(v: Any, lo: int = 0, hi: int = U64) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{v!r} is not a number")
    n = int(v)  # ints and decimal strings
    if not lo <= n <= hi:
        raise ValueError(f"{n} outside {lo}..{hi}")
    return n


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One footer entry."""

    offset: int
    first_seq: int
    last_seq: int
    compressed_len: int
    raw_len: int
    record_count: int
    crc: int


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What a writer produced (for manifests) or a verify found."""

    path: str
    partition: int
    start_seq: int
    end_seq: int
    first_seq: int
    last_seq: int
    records: int
    raw_bytes: int
    bytes: int
    checksum: str  # BLAKE2b-128 of the whole file, hex
    # (collection id, mutations, deletions and expirations) of the data records, by id
    counts: tuple[tuple[int, int, int], ...] = ()
    changes: tuple[ManifestChange, ...] = ()  # the system events held, in seq order


Tally = dict[tuple[int, int], int]  # records per (collection id, op)


def tally_counts(tallies: Iterable[Tally]) -> tuple[tuple[int, int, int], ...]:
    """`SegmentInfo.counts` from blocks' tallies (system events left out)."""
    out: dict[int, list[int]] = {}
    for tally in tallies:
        for (cid, op), n in tally.items():
            if op in DATA_OPS:
                out.setdefault(cid, [0, 0])[op != OP_MUTATION] += n
    return tuple((cid, a, b) for cid, (a, b) in sorted(out.items()))


def block_stats(raw: bytes, count: int, partition: int,
                version: int = VERSION) -> tuple[Tally, list[ManifestChange]]:  # fmt: skip
    """The records per (collection, op) of one raw block, and the manifest changes of
    its system events. Read off the head column at C speed: every head's op is at a
    multiple of 48 and its collection id in the head's last u32."""
    k = 48 * count
    ops = raw[0:k:48]
    heads = array("I", raw[:k])
    if sys.byteorder == "big":
        heads.byteswap()  # the file is little-endian
    ids = heads[11::12]
    if not count:
        return {}, []
    if ids.count(ids[0]) == count:  # one collection: the common case
        tally = {(ids[0], op): n for op, n in Counter(ops).items()}
    else:
        tally = dict(Counter(zip(ids, ops, strict=True)))
    if OP_SYSTEM_EVENT not in ops:
        return tally, []
    changes = []
    for rec in parse_block(raw, count, version):
        if rec.op == OP_SYSTEM_EVENT and (change := rec.change(partition)) is not None:
            changes.append(change)
    return tally, changes


# a record head's key and value lengths (formats/segment.md, Blocks)
_KEY_LEN, _VALUE_LEN = operator.itemgetter(2), operator.itemgetter(3)


def parse_block(raw: bytes, count: int, version: int = VERSION) -> list[Record]:
    """The records of one decompressed block (formats/segment.md, Blocks: `count` heads,
    then the keys, the xattr blobs (version 3) and the values). Raises ValueError saying
    what does not fit."""
    n = len(raw)
    k = 48 * count
    if k > n:
        raise ValueError(f"{count} record heads do not fit in {n} bytes")
    heads = list(RECORD_HEAD.iter_unpack(raw[:k]))
    key_bytes = sum(map(_KEY_LEN, heads))  # C-level sums: a block holds thousands of heads
    value_bytes = sum(map(_VALUE_LEN, heads))
    x = k + key_bytes  # the xattrs column: between the keys and the values
    v = n - value_bytes
    with_xattrs = count - raw[1:k:48].translate(_XATTR_BITS).count(0) if version > 2 else 0
    if v < x or (v > x) != (with_xattrs > 0):
        raise ValueError("keys, xattrs and values do not fill the block exactly")
    if with_xattrs:
        return _parse_with_xattrs(raw, heads, k, x, v, version)
    out: list[Record] = []
    new = tuple.__new__  # builds the named record without a Python-level __new__ call
    prev = 0
    ops = OPS_BY_VERSION[version]
    for op, dt, klen, vlen, seq, rev, cas, flags, exp, dtime, coll in heads:
        if op not in ops or seq <= prev:
            raise ValueError(f"bad record head (seq {seq}, op 0x{op:02x})")
        key, value = raw[k : k + klen], raw[v : v + vlen]
        out.append(new(Record, (op, seq, rev, cas, flags, exp, dtime, dt, key, value, coll, b"")))
        k += klen
        v += vlen
        prev = seq
    return out


def _parse_with_xattrs(raw: bytes, heads: list[tuple[int, ...]], k: int, x: int, v: int,
                       version: int) -> list[Record]:  # fmt: skip
    """`parse_block` for a block whose xattrs column is not empty: each record with the
    XATTR bit takes the next blob (its length is its first four bytes), checked."""
    out: list[Record] = []
    new = tuple.__new__
    prev = 0
    ops = OPS_BY_VERSION[version]
    end = v  # where the xattrs column ends and the values start
    for op, dt, klen, vlen, seq, rev, cas, flags, exp, dtime, coll in heads:
        if op not in ops or seq <= prev:
            raise ValueError(f"bad record head (seq {seq}, op 0x{op:02x})")
        key, value = raw[k : k + klen], raw[v : v + vlen]
        blob = b""
        if dt & XATTR:
            if op == OP_SYSTEM_EVENT or x + 4 > end:
                raise ValueError(f"seq {seq}: no xattrs where the head says there are")
            nxt = x + 4 + BLOB_LEN.unpack_from(raw, x)[0]
            blob = raw[x:nxt]
            if nxt > end:
                raise ValueError(f"seq {seq}: xattrs of {nxt - x} bytes run past their column")
            if not _pairs_fit(raw, x + 4, nxt):
                raise ValueError(f"seq {seq}: {_why_corrupt(blob, key)}")
            x, dt = nxt, dt & ~XATTR
        out.append(new(Record, (op, seq, rev, cas, flags, exp, dtime, dt, key, value, coll, blob)))
        k += klen
        v += vlen
        prev = seq
    if x != end:
        raise ValueError("the xattrs column holds more than its records' blobs")
    return out


def _pairs_fit(raw: bytes, pos: int, end: int) -> bool:
    """True if raw[pos:end] is a run of xattr pairs (`xattrs.pairs` checks the same, at
    twice the cost: this runs once per record with xattrs)."""
    unpack = BLOB_LEN.unpack_from
    try:
        while pos < end:
            size = unpack(raw, pos)[0]
            pos += 4
            stop = pos + size
            if stop > end or size < 3 or raw[stop - 1] or raw.count(0, pos, stop) != 2:
                return False
            raw[pos : raw.index(0, pos)].decode()
            pos = stop
    except (struct.error, UnicodeDecodeError):
        return False
    return True


def _why_corrupt(blob: bytes, key: bytes) -> str:
    """What `xattrs.pairs` says is wrong with a blob `_pairs_fit` refused."""
    try:
        xattrs.pairs(blob, key)
    except xattrs.CorruptXattrsError as exc:
        return str(exc)
    return "malformed xattrs"
