"""Regenerate the segment test vectors (run only when the format version changes).

Usage: python formats/vectors/make_vectors.py
Writes NAME.seg and NAME.json (header and records, bytes as hex) for each vector.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from upr_cli.failover import FailoverLog  # noqa: E402
from upr_cli.segments import SegmentHeader, SegmentReader, SegmentWriter  # noqa: E402

LOG = FailoverLog.of([(0xDEADBEEF, 8), (0xCAFEBABE, 0)])
VECTORS = {
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
    for name, (header, rows) in VECTORS.items():
        seg = HERE / f"{name}.seg"
        seg.unlink(missing_ok=True)
        w = SegmentWriter(seg, header)
        w.add(rows)
        info = w.finish()
        with SegmentReader(seg) as r:
            records = [
                [op, str(seq), str(rev), str(cas), flags, exp, dtime, dt, key.hex(), value.hex()]
                for op, seq, rev, cas, flags, exp, dtime, dt, key, value in r.records()
            ]
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
