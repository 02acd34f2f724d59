"""A repository written before collections (manifest version 1, segment version 1)
reads as default-collection data: `upr info` counts it under `_default._default`,
`upr examine` finds its keys there, a backup chain continues from it."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from tests.repo.repo_helpers import BUCKET, LOG, T0, bid
from upr_cli.collections import Path as CollectionPath
from upr_cli.errors import UsageError
from upr_cli.jobs.examine import examine
from upr_cli.jobs.inspect import info
from upr_cli.net.bootstrap import partition_of
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import (
    MANIFEST_COPY,
    MANIFEST_FILE,
    Manifest,
    PartitionEntry,
    Repository,
    SegmentEntry,
    Totals,
    checksum_hex,
    format_segment_name,
)
from upr_cli.repo.manifest import canonical_json
from upr_cli.segments import SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.segments.format import PREAMBLE

PARTS = 4


def as_version_1(path: Path) -> None:
    """Relabel a segment with no system event and only collection 0 as version 1: the
    bytes a version 1 writer wrote (reserved fields 0), the header CRC recomputed."""
    data = bytearray(path.read_bytes())
    data[8:10] = (1).to_bytes(2, "little")
    hl = int.from_bytes(data[12:16], "little")
    end = PREAMBLE.size + hl
    data[end : end + 4] = zlib.crc32(bytes(data[:end])).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def old_repo(root: Path) -> dict[int, list[DcpRecord]]:
    """One full version 1 backup of 4 partitions: k0..k11 set, k1 and k2 set again, k3
    deleted."""
    repo = Repository(root)
    repo.init()
    b = bid(0)
    directory = repo.new_backup_dir(BUCKET, b)
    rows: dict[int, list[DcpRecord]] = {p: [] for p in range(PARTS)}
    changes = [(b"k%d" % i, OP_MUTATION) for i in range(12)]
    changes += [(b"k1", OP_MUTATION), (b"k2", OP_MUTATION), (b"k3", OP_DELETION)]
    for seq, (key, op) in enumerate(changes, 1):
        p = partition_of(key, PARTS)
        value = b'{"v":%d}' % seq if op == OP_MUTATION else b""
        rows[p].append(DcpRecord(op, p, seq, 1, seq, 0, 0, 0, 1, key, value, 0))
    entries = []
    for p in range(PARTS):
        end = rows[p][-1].by_seqno
        name = format_segment_name(p, rows[p][0].by_seqno, end)
        w = SegmentWriter(directory / name, SegmentHeader(BUCKET, p, LOG, 0, end,
                          created="2026-11-21T06:15:00.000000Z"))  # fmt: skip
        w.add(rows[p])
        w.finish()
        as_version_1(directory / name)
        with SegmentReader(directory / name) as r:
            assert r.version == 1
            info_ = r.verify()
        seg = SegmentEntry(name, info_.first_seq, end, info_.records, info_.bytes,
                           info_.checksum)  # fmt: skip
        entries.append(PartitionEntry(p, 0xBEEF, LOG, 0, end, end, end, (seg,)))
    m = Manifest(b, BUCKET, "upr://127.0.0.1/default", T0, T0, True, None, tuple(entries),
                 Totals.derive(entries, 0))  # fmt: skip
    obj = m.to_json()
    obj["version"] = 1
    for k in ("collections", "manifest_changes", "collection_filter", "collection_items"):
        del obj[k]
    obj["checksum"] = checksum_hex(canonical_json(obj))
    data = (json.dumps(obj, indent=2) + "\n").encode()
    (directory / MANIFEST_COPY).write_bytes(data)
    (directory / MANIFEST_FILE).write_bytes(data)
    return rows


def test_info_counts_an_old_repository_under_the_default_collection(tmp_path: Path) -> None:
    old_repo(tmp_path)
    [m] = Repository(tmp_path).manifests(BUCKET)
    assert m.collections is None and not m.collection_items
    got = info(tmp_path)["buckets"][0]["collections"]
    assert got == [{"scope": "_default", "collection": "_default", "id": 0, "items": 14,
                    "deletions": 1, "dropped": False, "backed_up": True}]  # fmt: skip


def test_examine_finds_an_old_repositorys_keys_in_the_default_collection(tmp_path: Path) -> None:
    old_repo(tmp_path)
    versions = examine(tmp_path, b"k1")
    assert [(v.seq, v.collection, v.dropped) for v in versions] == [(2, 0, False), (13, 0, False)]
    assert versions[-1].in_latest and versions[-1].to_json()["collection_id"] == 0
    assert [v.op for v in examine(tmp_path, b"k3")] == ["mutation", "deletion"]
    with pytest.raises(UsageError, match="no such collection in bucket 'default'"):
        examine(tmp_path, b"k1", collection=CollectionPath("app", "users"))
