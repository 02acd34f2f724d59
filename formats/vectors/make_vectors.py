"""Regenerate the segment test vectors of the current version (run only when the
format version changes).

Usage: python formats/vectors/make_vectors.py
Writes NAME.seg and NAME.json (header and records, bytes as hex) for each vector of
`VECTORS`. `empty` and `two-blocks` are version 1 files, written by the version 1
writer and kept byte for byte (`V1_VECTORS`, never regenerated): readers must go on
reading them, as collection 0. Their records are listed with ten fields, those of
version 2 vectors with an eleventh, the collection id (system events included);
`collections`, the version 2 vector, is kept as the version 2 writer wrote it
(`V2_VECTORS`, no longer regenerated). Version 3 vectors list a twelfth field, the
record's xattr blob (hex, "" for none).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from upr_cli.collections import ManifestChange  # noqa: E402
from upr_cli.failover import FailoverLog  # noqa: E402
from upr_cli.protocol import xattrs  # noqa: E402
from upr_cli.protocol.decoder import DcpRecord  # noqa: E402
from upr_cli.segments import SegmentHeader, SegmentReader, SegmentWriter  # noqa: E402
from upr_cli.segments.format import event_record  # noqa: E402

LOG = FailoverLog.of([(0xDEADBEEF, 8), (0xCAFEBABE, 0)])


def _row(seq: int, op: int, key: bytes, value: bytes, collection: int,
         blob: bytes = b"") -> DcpRecord:  # fmt: skip
    return DcpRecord(op, 7, seq, 1, 0x16B8_0000_0000_0000 + seq, 0, 0,
                     1_763_700_000 if op != 0x57 else 0, 1 if value[:1] == b"{" else 0, key,
                     value, 0, collection, blob)  # fmt: skip


# Version 2: a scope and two collections created (ids 8, 9 and 0x80: a two-byte LEB128
# on the wire, a u32 here like any other), documents in each and in the default
# collection, one collection dropped, across two blocks.
COLLECTIONS = [
    event_record(ManifestChange(7, 1, "scope-created", 1, 8, None, "app")),
    event_record(ManifestChange(7, 2, "collection-created", 2, 8, 9, "users")),
    event_record(ManifestChange(7, 3, "collection-created", 0x79, 8, 0x80, "logs", 3600)),
    _row(4, 0x57, b"u1", b'{"n":1}', 9),
    _row(5, 0x57, b"u1", b'{"n":1}', 0),
    _row(6, 0x57, b"l1", b"line", 0x80),
    _row(7, 0x58, b"u1", b"", 9),
    event_record(ManifestChange(7, 8, "collection-dropped", 0x7A, 8, 0x80)),
    _row(9, 0x57, b"u2", b'{"n":2}', 9),
]
SYNC1 = xattrs.encode([("_sync", '{"rev":"1-a1","sequence":4}')])
SYNC2 = xattrs.encode([("_sync", '{"rev":"2-b2","sequence":6}'), ("app", '{"v":2}')])
SYNC3 = xattrs.encode([("_sync", '{"rev":"3-c3","sequence":9,"deleted":true}')])
TXN = xattrs.encode([("_txn", '{"id":"t1"}'), ("tags", '["a","b"]'), ("meta", '"x\\u00e9"')])
# Version 3: documents with system and user xattrs, one without, an update replacing
# them, a tombstone keeping its system xattrs (its value empty), a deletion keeping a
# user xattr too (IncludeDeletedUserXattrs), a binary value with xattrs, in the default
# collection and in collection 9, across blocks.
XATTRS = [
    event_record(ManifestChange(7, 1, "collection-created", 1, 0, 9, "users")),
    _row(2, 0x57, b"plain", b'{"n":0}', 0),
    _row(4, 0x57, b"doc", b'{"n":1}', 0, SYNC1),
    _row(5, 0x57, b"u1", b'{"name":"\xc3\xa9"}', 9, TXN),
    _row(6, 0x57, b"doc", b'{"n":2}', 0, SYNC2),
    _row(7, 0x57, b"bin", bytes(range(8)), 9, xattrs.encode([("_a", "1")])),
    _row(9, 0x58, b"doc", b"", 0, SYNC3),
    _row(10, 0x58, b"u1", b"", 9, xattrs.encode([("_txn", '{"id":"t1"}'), ("tags", "[]")])),
    _row(11, 0x59, b"plain", b"", 0),
]
VECTORS = {
    "xattrs": (
        SegmentHeader(
            "travel",
            7,
            LOG,
            0,
            11,
            ((1, 11),),
            "2026-11-26T18:00:00.000000Z",
            "upr://127.0.0.1:11210/travel",
            200,
        ),
        XATTRS,
    ),
}
# Version 2, kept as written (the rows it was made from, for the record).
V2_VECTORS = {
    "collections": (
        SegmentHeader(
            "travel",
            7,
            LOG,
            0,
            9,
            ((1, 9),),
            "2026-11-26T12:00:00.000000Z",
            "upr://127.0.0.1:11210/travel",
            160,
        ),
        COLLECTIONS,
    ),
}
V1_VECTORS = {
    "empty": (
        SegmentHeader(
            "default",
            0,
            LOG,
            10,
            10,
            (),
            "2026-11-21T00:00:00.000000Z",
            "upr://127.0.0.1:11210/default",
            1 << 20,
        ),
        [],
    ),
    "two-blocks": (
        SegmentHeader(
            "travel",
            1023,
            LOG,
            8,
            40,
            ((9, 20), (21, 40)),
            "2026-11-21T12:34:56.789012Z",
            "upr://127.0.0.1:11210/travel",
            120,
        ),
        [
            (
                0x57,
                1023,
                9,
                1,
                0x16B8_0000_0000_0001,
                0,
                0,
                0,
                1,
                b"airline_10",
                b'{"name":"40-Mile Air"}',
                0,
            ),
            (
                0x57,
                1023,
                12,
                3,
                0x16B8_0000_0000_0002,
                0x02000006,
                1_800_000_000,
                0,
                0,
                b"raw",
                bytes(range(40)),
                0,
            ),
            (
                0x58,
                1023,
                20,
                4,
                0x16B8_0000_0000_0003,
                0,
                0,
                1_763_700_000,
                0,
                b"airline_11",
                b"",
                0,
            ),
            (0x59, 1023, 33, 2, 2**64 - 1, 0, 0, 1_763_700_001, 0, b"k\xffey", b"", 0),
            (0x57, 1023, 40, 7, 0x16B8_0000_0000_0005, 0xFFFFFFFF, 0, 0, 1, b"last", b"[]", 0),
        ],
    ),
}


def main() -> None:
    for name, (header, rows) in VECTORS.items():  # V1_VECTORS, V2_VECTORS: kept as written
        seg = HERE / f"{name}.seg"
        seg.unlink(missing_ok=True)
        w = SegmentWriter(seg, header)
        w.add(rows)
        info = w.finish()
        with SegmentReader(seg) as r:
            records = [
                [op, str(seq), str(rev), str(cas), flags, exp, dtime, dt, key.hex(), value.hex(),
                 coll, blob.hex()]
                for op, seq, rev, cas, flags, exp, dtime, dt, key, value, coll, blob
                in r.records(events=True)
            ]  # fmt: skip
            blocks = len(r.blocks)
        expected = {
            "header": json.loads(header.to_bytes()),
            "blocks": blocks,
            "records": records,
            "checksum": info.checksum,
            "bytes": info.bytes,
        }
        (HERE / f"{name}.json").write_text(json.dumps(expected, indent=1) + "\n")
        print(f"{name}: {info.records} records, {blocks} blocks, {info.bytes} bytes")


if __name__ == "__main__":
    main()
