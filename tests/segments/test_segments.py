"""Segment files: exact round trips, vectors, and rejection of every truncation and bit flip."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import IO, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upr_cli.collections import ManifestChange
from upr_cli.errors import LocalProtocolError
from upr_cli.failover import FailoverLog
from upr_cli.fsio import FileOps
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_EXPIRATION, OP_MUTATION, DcpRecord
from upr_cli.segments import (
    Record,
    SegmentError,
    SegmentHeader,
    SegmentReader,
    SegmentWriter,
)
from upr_cli.segments.format import OP_SYSTEM_EVENT, event_record

VECTORS = Path(__file__).resolve().parents[2] / "formats" / "vectors"
LOG = FailoverLog.of([(0xDEADBEEF, 8), (0xCAFEBABE, 0)])


def header(start: int = 0, end: int = 10_000, block: int = 256, part: int = 3) -> SegmentHeader:
    return SegmentHeader(
        "b",
        part,
        LOG,
        start,
        end,
        ((start, end),),
        "2026-11-21T00:00:00.000000Z",
        "upr://127.0.0.1/b",
        block,
    )


def rows_for(seqs: list[int], part: int = 3, events: bool = False) -> list[DcpRecord]:
    """Data records in collections 0, 8, 200 and 0xFFFFFFFF (ids of one to five LEB128
    bytes on the wire), two in five with xattrs (a deletion's system ones only); with
    `events`, every seq divisible by 11 a system event."""
    ops = (OP_MUTATION, OP_DELETION, OP_EXPIRATION)
    colls = (0, 8, 200, 0xFFFF_FFFF)
    return [
        event_record(_change(s, part))
        if events and s % 11 == 0
        else DcpRecord(
            ops[s % 3],
            part,
            s,
            s % 7 + 1,
            (s * 2654435761) % 2**64,
            s % 5,
            s % 11,
            s % 13,
            s % 2,
            f"key-{s}".encode(),
            b"v" * (s % 90) if s % 3 == 0 else b"",
            0,
            colls[s % 4],
            _xattrs(s),
        )
        for s in seqs
    ]


def _xattrs(s: int) -> bytes:
    """Xattrs for two seqs in five: a system one, and a user one on a mutation."""
    if s % 5 > 1:
        return b""
    user = [("user", '{"n":' + str(s) + "}")] if s % 3 == 0 else []
    return xattrs.encode([("_sync", f'"{s}"'), *user])


def _change(s: int, part: int) -> ManifestChange:
    if s % 2:
        return ManifestChange(part, s, "collection-dropped", s, 8, 8 + s)
    return ManifestChange(part, s, "collection-created", s, 8, 8 + s, f"c{s}", s % 3 or None)


def as_records(rows: list[DcpRecord]) -> list[Record]:
    return [
        Record(
            r.opcode,
            r.by_seqno,
            r.rev_seqno,
            r.cas,
            r.flags,
            r.expiration,
            r.delete_time,
            r.datatype,
            bytes(r.key),
            bytes(r.value),
            r.collection,
            r.xattrs,
        )
        for r in rows
    ]


def data(rows: list[DcpRecord]) -> list[DcpRecord]:
    return [r for r in rows if r.opcode != OP_SYSTEM_EVENT]


def changes(rows: list[DcpRecord]) -> list[ManifestChange]:
    return [_change(r.by_seqno, r.vbucket) for r in rows if r.opcode == OP_SYSTEM_EVENT]


def vector_record(x: Record) -> list[Any]:
    """A record as the vector files list it (64-bit values as decimal strings)."""
    return [x.op, str(x.seq), str(x.rev_seq), str(x.cas), x.flags, x.expiry, x.delete_time,
            x.datatype, x.key.hex(), x.value.hex()]  # fmt: skip


def write(path: Path, hdr: SegmentHeader, rows: list[DcpRecord]) -> Any:
    w = SegmentWriter(path, hdr)
    w.add(rows)
    return w.finish()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.integers(1, 5000), unique=True, max_size=300),
    st.integers(50, 3000),
    st.integers(0, 5001),
    st.booleans(),
)
def test_round_trip_and_seek(
    tmp_path: Path, seqs: list[int], block: int, from_seq: int, events: bool
) -> None:
    """Data records keep their collection; system events come back in seq order among
    them with `events=True`, and are left out otherwise."""
    seqs.sort()
    rows = rows_for(seqs, events=events)
    path = tmp_path / f"s{block}-{len(seqs)}.seg"
    path.unlink(missing_ok=True)
    info = write(path, header(block=block), rows)
    with SegmentReader(path) as r:
        assert r.version == 3
        assert list(r.records()) == as_records(data(rows))
        assert list(r.records(events=True)) == as_records(rows)
        assert list(r.records(from_seq)) == [x for x in as_records(data(rows)) if x.seq >= from_seq]
        assert r.changes() == changes(rows) == list(info.changes)
        assert r.event_count == len(rows) - len(data(rows))
        assert r.verify() == info
        assert info.records == len(rows) and (info.first_seq, info.last_seq) == (
            (seqs[0], seqs[-1]) if seqs else (0, 0)
        )
        assert r.header == header(block=block)
    counts: dict[int, list[int]] = {}
    for x in data(rows):
        counts.setdefault(x.collection, [0, 0])[x.opcode != OP_MUTATION] += 1
    assert info.counts == tuple((c, a, b) for c, (a, b) in sorted(counts.items()))


@pytest.mark.parametrize(
    ("name", "version"), [("empty", 1), ("two-blocks", 1), ("collections", 2), ("xattrs", 3)]
)
def test_vectors_read_back_exactly(name: str, version: int) -> None:
    """Version 1 files (before collections) read as collection 0; the version 2 vector
    lists each record's collection id, its system events among the records; the
    version 3 vector each record's xattr blob (hex), handed out apart from its value."""
    expected = json.loads((VECTORS / f"{name}.json").read_text())
    with SegmentReader(VECTORS / f"{name}.seg") as r:
        assert r.version == version
        assert json.loads(r.header.to_bytes()) == expected["header"]
        assert len(r.blocks) == expected["blocks"]
        got = [
            [
                x.op,
                str(x.seq),
                str(x.rev_seq),
                str(x.cas),
                x.flags,
                x.expiry,
                x.delete_time,
                x.datatype,
                x.key.hex(),
                x.value.hex(),
                *([x.collection] if version > 1 else []),
                *([x.xattrs.hex()] if version > 2 else []),
            ]
            for x in r.records(events=True)
        ]
        assert got == expected["records"]
        assert all(not x.datatype & xattrs.XATTR for x in r.records())
        if version < 3:
            assert not any(x.xattrs for x in r.records())
        if version == 1:
            assert {x.collection for x in r.records()} <= {0} and not r.changes()
        info = r.verify()
        assert (info.checksum, info.bytes) == (expected["checksum"], expected["bytes"])


def test_collections_vector_decodes_to_its_changes() -> None:
    with SegmentReader(VECTORS / "collections.seg") as r:
        got = [(c.seq, c.kind, c.collection_id, c.name, c.max_ttl) for c in r.changes()]
        assert got == [
            (1, "scope-created", None, "app", None),
            (2, "collection-created", 9, "users", None),
            (3, "collection-created", 0x80, "logs", 3600),
            (8, "collection-dropped", 0x80, None, None),
        ]
        assert r.verify().counts == ((0, 1, 0), (9, 2, 1), (0x80, 1, 0))
        assert [x.seq for x in r.records()] == [4, 5, 6, 7, 9]


def test_the_xattrs_vector_holds_its_documents_and_tombstones() -> None:
    """Documents with system and user xattrs, an update that replaced them, tombstones
    that kept theirs (empty value); the blobs sit in their own column, between the keys
    and the values (formats/segment.md, Blocks), so each block's raw length is the heads,
    keys, blobs and values."""
    with SegmentReader(VECTORS / "xattrs.seg") as r:
        recs = {x.seq: x for x in r.records()}
        assert xattrs.to_json(recs[6].xattrs) == {"_sync": {"rev": "2-b2", "sequence": 6},
                                                  "app": {"v": 2}}  # fmt: skip
        assert xattrs.to_json(recs[5].xattrs)["meta"] == "x\u00e9"
        tomb = recs[9]
        assert (tomb.op, tomb.value, tomb.datatype) == (OP_DELETION, b"", 0)
        assert [n for n, _v in xattrs.pairs(tomb.xattrs)] == ["_sync"]
        assert [n for n, _v in xattrs.pairs(recs[10].xattrs)] == ["_txn", "tags"]
        assert recs[2].xattrs == recs[11].xattrs == b""
        for i, b in enumerate(r.blocks):
            got = r.block_records(i)
            assert b.raw_len == sum(48 + len(x.key) + len(x.xattrs) + len(x.value) for x in got)
        # the DCP record a reader gives a writer carries the blob, and the writer puts it
        # back in its column
        dcp = recs[6].as_dcp(7)
        assert (dcp.xattrs, dcp.value, dcp.datatype) == (recs[6].xattrs, b'{"n":2}', 1)


def _raw_segment(path: Path, raw: bytes, count: int, first: int, last: int) -> None:
    """A version 3 segment of one block holding `raw` (any bytes: how a reader sees a
    block a broken writer made), its CRCs right."""
    import zstandard

    from upr_cli.segments.format import (
        BLOCK_ENTRY,
        CRC,
        END_MAGIC,
        FOOTER_FIXED,
        MAGIC,
        PREAMBLE,
        TRAILER,
    )

    head = header(end=last).to_bytes()
    pre = PREAMBLE.pack(MAGIC, 3, 0, len(head)) + head
    pre += CRC.pack(zlib.crc32(pre))
    frame = zstandard.ZstdCompressor().compress(raw)
    footer = FOOTER_FIXED.pack(1, 0, count, len(raw), first, last) + BLOCK_ENTRY.pack(
        len(pre), first, last, len(frame), len(raw), count, zlib.crc32(frame)
    )
    tail = TRAILER.pack(len(pre) + len(frame), len(footer), zlib.crc32(footer), END_MAGIC)
    path.write_bytes(pre + frame + footer + tail)


def _block_of(rows: list[tuple[int, bytes, bytes, bytes]]) -> bytes:
    """A raw block: (seq, key, blob, value) each, a mutation with the XATTR bit set
    where a blob is given."""
    from upr_cli.segments.format import RECORD_HEAD

    heads = b"".join(
        RECORD_HEAD.pack(OP_MUTATION, 4 if x else 0, len(k), len(v), s, 1, s, 0, 0, 0, 0)
        for s, k, x, v in rows
    )
    return (
        heads
        + b"".join(r[1] for r in rows)
        + b"".join(r[2] for r in rows)
        + b"".join(r[3] for r in rows)
    )


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"\0\0\0\x08\0\0\0\x04a\x001\x01", "pair at byte 4"),  # a pair without its end 0
        (b"\0\0\0\x06\0\0\0\x02a\0", "pair at byte 4"),  # a pair too short
        (b"\0\0\0\x08\0\0\0\x04\xff\x001\0", "not UTF-8"),  # a name not UTF-8
        (b"\0\0\0\x07\0\0\0\x04a\x001\0", "pair at byte 4"),  # a length short of a pair
        (b"\0\0\0\x40\0\0\0\x04a\x001\0", "run past their column"),  # a length past it
        (b"\0\0", "fill|no xattrs"),  # a blob cut short
    ],
)
def test_a_malformed_blob_is_corruption_named_by_file_and_seq(
    tmp_path: Path, blob: bytes, reason: str
) -> None:
    good = xattrs.encode([("a", "1")])
    path = tmp_path / "x.seg"
    _raw_segment(path, _block_of([(5, b"k5", good, b"{}"), (6, b"k6", blob, b"{}")]), 2, 5, 6)
    with SegmentReader(path) as r, pytest.raises(SegmentError) as exc:
        list(r.records())
    text = str(exc.value)
    assert "x.seg, block 0" in text
    assert re.search(reason, text), text
    if "fill" not in text:
        assert "seq 6" in text


def test_xattrs_column_must_match_the_heads(tmp_path: Path) -> None:
    """A blob with no head bit asking for it (or the reverse) does not fill the block."""
    good = xattrs.encode([("a", "1")])
    raw = _block_of([(5, b"k5", good, b"{}")])
    path = tmp_path / "bit.seg"
    cleared = bytearray(raw)
    cleared[1] = 0  # the head's datatype: no XATTR bit, the blob still in its column
    _raw_segment(path, bytes(cleared), 1, 5, 5)
    with SegmentReader(path) as r, pytest.raises(SegmentError, match="fill the block"):
        list(r.records())
    _raw_segment(path, raw, 1, 5, 5)
    with SegmentReader(path) as r:
        (rec,) = r.records()
        assert (rec.xattrs, rec.value, rec.datatype) == (good, b"{}", 0)


def test_writer_takes_a_value_that_still_holds_its_blob(tmp_path: Path) -> None:
    """A record whose value still starts with its blob (XATTR bit set, no `xattrs`) is
    split on the way in; a blob whose length is wrong is refused, naming the key."""
    blob = xattrs.encode([("_sync", "1")])
    row = DcpRecord(OP_MUTATION, 3, 1, 1, 1, 0, 0, 0, 1 | xattrs.XATTR, b"k", blob + b"{}", 0)
    write(tmp_path / "w.seg", header(), [row])
    with SegmentReader(tmp_path / "w.seg") as r:
        (rec,) = r.records()
        assert (rec.xattrs, rec.value, rec.datatype) == (blob, b"{}", 1)
    w = SegmentWriter(tmp_path / "bad.seg", header())
    with pytest.raises(xattrs.CorruptXattrsError, match="'k'"):
        w.add([row._replace(value=b"{}", datatype=1, xattrs=blob[:-1])])
    assert not (tmp_path / "bad.seg").exists()


def test_a_version_1_file_cannot_hold_events_or_collections(tmp_path: Path) -> None:
    """A version 2 file relabelled as version 1 (its header CRC fixed) is refused: a
    version 1 footer counts no system event."""
    v2 = bytearray((VECTORS / "collections.seg").read_bytes())
    v2[8:10] = (1).to_bytes(2, "little")
    hl = int.from_bytes(v2[12:16], "little")
    v2[16 + hl : 20 + hl] = zlib.crc32(bytes(v2[: 16 + hl])).to_bytes(4, "little")
    bad = tmp_path / "relabelled.seg"
    bad.write_bytes(bytes(v2))
    with pytest.raises(SegmentError, match="system events"):
        SegmentReader(bad)


def _fully_read(path: Path) -> None:
    with SegmentReader(path) as r:
        r.verify()


def test_every_truncation_and_extension_is_rejected(tmp_path: Path) -> None:
    good = tmp_path / "good.seg"
    write(good, header(block=200), rows_for(list(range(1, 60))))
    data = good.read_bytes()
    _fully_read(good)
    bad = tmp_path / "bad.seg"
    for cut in range(len(data)):
        bad.write_bytes(data[:cut])
        with pytest.raises(SegmentError):
            _fully_read(bad)
    bad.write_bytes(data + b"\0")
    with pytest.raises(SegmentError):
        _fully_read(bad)


def test_every_single_byte_flip_is_rejected(tmp_path: Path) -> None:
    good = tmp_path / "good.seg"
    write(good, header(block=200), rows_for(list(range(1, 40))))
    data = good.read_bytes()
    bad = tmp_path / "bad.seg"
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x20
        bad.write_bytes(bytes(flipped))
        with pytest.raises(SegmentError) as exc:
            _fully_read(bad)
        assert "bad.seg" in str(exc.value)


def test_a_corrupt_block_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.seg"
    write(path, header(block=100), rows_for(list(range(1, 30))))
    with SegmentReader(path) as r:
        target = r.blocks[2]
    data = bytearray(path.read_bytes())
    data[target.offset + 5] ^= 1
    path.write_bytes(bytes(data))
    with (
        SegmentReader(path) as r,
        pytest.raises(SegmentError, match=r"x\.seg, block 2: block checksum"),
    ):
        list(r.records())


class Failing(FileOps):
    """Fail the n-th file-system call."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0
        self.failed = False

    def _tick(self, what: str) -> None:
        self.calls += 1
        if self.calls == self.n:
            self.failed = True
            raise OSError(f"injected failure in {what}")

    def open(self, path: Path) -> IO[bytes]:
        self._tick("open")
        return super().open(path)

    def write(self, f: IO[bytes], data: bytes) -> None:
        self._tick("write")
        super().write(f, data)

    def fsync(self, f: IO[bytes]) -> None:
        self._tick("fsync")
        super().fsync(f)

    def copy(self, src: IO[bytes], dst: IO[bytes]) -> None:
        self._tick("copy")
        super().copy(src, dst)

    def remove(self, path: Path) -> None:
        if not self.failed:  # after a failure, abort's cleanup must work
            self._tick("remove")
        super().remove(path)

    def rename(self, src: Path, dst: Path) -> None:
        self._tick("rename")
        super().rename(src, dst)

    def fsync_dir(self, path: Path) -> None:
        self._tick("fsync_dir")
        super().fsync_dir(path)


def test_a_failure_at_any_write_fsync_or_rename_leaves_nothing_half_written(tmp_path: Path) -> None:
    rows = rows_for(list(range(1, 80)))
    counter = Failing(0)
    write_with(tmp_path / "count.seg", counter, rows)
    total = counter.calls
    assert total >= 10  # body open+write, final open, writes, copy, remove, fsync, rename, dir
    for n in range(1, total + 1):
        path = tmp_path / f"f{n}.seg"
        with pytest.raises(OSError, match="injected"):
            write_with(path, Failing(n), rows)
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".f{n}.seg.tmp")]
        assert not leftovers, leftovers  # the writer removed its temporary file
        if path.exists():  # only a failure after the rename: the file is whole
            _fully_read(path)


def write_with(path: Path, fs: FileOps, rows: list[DcpRecord]) -> None:
    """Half the rows, a spill to the body file, the rest, finish: every file-system path."""
    w = SegmentWriter(path, header(block=150), fs=fs)
    w.add(rows[: len(rows) // 2])
    w.spill()
    w.add(rows[len(rows) // 2 :])
    w.finish()


def test_writer_refuses_records_out_of_range_or_order(tmp_path: Path) -> None:
    for bad in ([5, 5], [7, 3]):
        w = SegmentWriter(tmp_path / f"w{bad}.seg", header(end=10_000))
        with pytest.raises(LocalProtocolError):
            w.add(rows_for(bad))
    w = SegmentWriter(tmp_path / "end.seg", header(end=10_000))
    w.add(rows_for([10_001]))
    with pytest.raises(LocalProtocolError, match="> end"):
        w.finish()
    w = SegmentWriter(tmp_path / "op.seg", header())
    with pytest.raises(LocalProtocolError):
        w.add([DcpRecord(OP_EXPIRATION + 1, 3, 1, 1, 1, 0, 0, 0, 0, b"k", b"", 0)])  # no data op
    assert not list(tmp_path.iterdir())  # every refusal aborted and removed its files


def test_finish_sets_the_range_end_and_markers(tmp_path: Path) -> None:
    w = SegmentWriter(tmp_path / "f.seg", header(start=100, end=200))
    w.add(rows_for([150, 230]))  # a stream may pass its pinned end to finish a snapshot
    info = w.finish(end_seq=230, snapshots=((100, 180), (181, 230)))
    with SegmentReader(tmp_path / "f.seg") as r:
        assert r.header.end_seq == 230 and r.header.snapshots == ((100, 180), (181, 230))
        assert r.verify() == info


def test_not_a_segment(tmp_path: Path) -> None:
    p = tmp_path / "n.seg"
    p.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(SegmentError, match="bad magic"):
        SegmentReader(p)
    with pytest.raises(SegmentError, match="cannot open"):
        SegmentReader(tmp_path / "missing.seg")


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.integers(1, 3000), unique=True, max_size=200),
    st.integers(50, 2000),
    st.integers(0, 3001),
    st.integers(0, 200),
    st.integers(0, 200),
    st.lists(st.integers(1, 2000), unique=True, max_size=40),
)
def test_truncate_keeps_exactly_the_records_up_to_the_seq(
    tmp_path: Path,
    seqs: list[int],
    block: int,
    cut: int,
    spill_at: int,
    spill_after: int,
    more: list[int],
) -> None:
    """A rollback in mid-stream: whatever was compressed, spilled or still buffered, the
    segment holds exactly the records ≤ cut, then what follows on the new branch."""
    seqs.sort()
    rows = rows_for(seqs, events=bool(spill_at % 2))  # system events are cut like records
    path = tmp_path / f"t{block}-{len(seqs)}-{cut}.seg"
    path.unlink(missing_ok=True)
    w = SegmentWriter(path, header(block=block))
    w.add(rows[:spill_at])
    w.spill()
    w.add(rows[spill_at:])
    if spill_after % 3 == 0:
        w.spill()
    moved = None
    if spill_after % 2:
        (tmp_path / "cut.seg").unlink(missing_ok=True)
        moved = SegmentWriter(tmp_path / "cut.seg", header(start=cut, end=cut + 5000, block=block))
    dropped = w.truncate(cut, into=moved)
    kept = [r for r in rows if r.by_seqno <= cut]
    assert dropped == len(rows) - len(kept)
    if moved is not None:  # the records cut off, kept elsewhere: exactly those above cut
        if moved.last_seq > cut:
            moved.finish()
            with SegmentReader(tmp_path / "cut.seg") as r:
                above = [x for x in rows if x.by_seqno > cut]
                assert list(r.records(events=True)) == as_records(above)
                assert r.changes() == changes(above)
        else:
            assert dropped == 0
            moved.abort()
    assert w.last_seq == (kept[-1][2] if kept else 0)
    after = rows_for(sorted(cut + m for m in more), events=True)
    w.add(after)
    assert w.changes == changes(kept + after)
    info = w.finish(end_seq=max(10_000, cut + 2000))
    with SegmentReader(path) as r:
        assert list(r.records(events=True)) == as_records(kept + after)
        assert r.verify() == info and list(info.changes) == changes(kept + after)
    assert info.records == len(kept) + len(after)
    assert not list(tmp_path.glob(".*tmp-*"))  # the body file went with the finish
