"""`write_latest`: the latest record of every document of a run of pieces, in one segment."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.repo.repo_helpers import BUCKET, LOG, bid
from upr_cli.collections import ManifestChange
from upr_cli.jobs.compact import Piece, write_latest
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import NO_CUT, BackupId, Repository, format_segment_name
from upr_cli.segments import SegmentError, SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.segments.format import event_record

P = 3


def rec(seq: int, key: str, value: str = "", *, op: int = OP_MUTATION,
        cid: int = 0) -> DcpRecord:  # fmt: skip
    v = value.encode() if op == OP_MUTATION else b""
    return DcpRecord(op, P, seq, seq, 1000 + seq, 7, 0, 0, 0, key.encode(), v, 0, cid, b"")


def header(end: int, start: int = 0, block: int = 128) -> SegmentHeader:
    return SegmentHeader(BUCKET, P, LOG, start, end, ((start, end),),
                         "2026-11-26T00:00:00.000000Z", "test", block)  # fmt: skip


def segment(repo: Repository, backup: BackupId, rows: list[DcpRecord], start: int = 0) -> str:
    """A segment of `rows` in `backup`'s directory; its manifest file name."""
    d = repo.backup_dir(BUCKET, backup)
    d.mkdir(parents=True, exist_ok=True)
    w = SegmentWriter(d / "x.open", header(rows[-1].by_seqno, start))
    w.add(rows)
    name = format_segment_name(P, rows[0].by_seqno, rows[-1].by_seqno)
    w.finish(path=d / name)
    return name


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    r = Repository(tmp_path / "repo")
    r.init()
    return r


def run(repo: Repository, tmp: Path, pieces: list[Piece], keep=None, end: int = 100):  # type: ignore[no-untyped-def]
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    return write_latest(repo, BUCKET, P, pieces, keep=keep, header=header(end),
                        directory=out), out  # fmt: skip


def read(path: Path) -> list[tuple[int, int, bytes, bytes, int]]:
    with SegmentReader(path) as r:
        return [(x.op, x.seq, x.key, x.value, x.collection) for x in r.records(events=True)]


def test_latest_wins_across_pieces_cut_and_tombstones(repo: Repository, tmp_path: Path) -> None:
    a = segment(repo, bid(0), [rec(1, "a", "a1"), rec(2, "b", "b1"), rec(3, "c", "c1"),
                               rec(4, "a", "a2"), rec(9, "d", "lost")])  # fmt: skip
    b = segment(repo, bid(1), [rec(5, "b", op=OP_DELETION), rec(6, "e", "e1"),
                               rec(7, "c", "c2")], start=4)  # fmt: skip
    pieces = [Piece(bid(0), a, 4), Piece(bid(1), b, NO_CUT)]  # backup 0 cut at 4: no "d"
    w, out = run(repo, tmp_path, pieces)
    assert w is not None
    got = read(out / w.entry.file)
    assert got == [(OP_MUTATION, 4, b"a", b"a2", 0), (OP_DELETION, 5, b"b", b"", 0),
                   (OP_MUTATION, 6, b"e", b"e1", 0), (OP_MUTATION, 7, b"c", b"c2", 0)]  # fmt: skip
    assert w.entry.file == format_segment_name(P, 4, 7)
    assert (w.entry.first_seq, w.entry.last_seq, w.entry.records) == (4, 7, 4)
    assert w.collections == {0: (3, 1)}
    with SegmentReader(out / w.entry.file) as r:
        info = r.verify()  # the whole file checks
    assert (info.checksum, info.bytes, info.raw_bytes) == (w.entry.checksum, w.entry.bytes,
                                                           w.raw_bytes)  # fmt: skip
    assert [p.name for p in out.iterdir()] == [w.entry.file]  # no temp file left


def test_events_dropped_and_keep_filter(repo: Repository, tmp_path: Path) -> None:
    ev = event_record(ManifestChange(P, 2, "collection-created", 2, 0, 8, "c"))
    rows = [rec(1, "k", "0"), ev, rec(3, "k", "8", cid=8), rec(4, "x", "9", cid=9),
            rec(5, "k", "0b")]  # fmt: skip
    name = segment(repo, bid(0), rows)
    w, out = run(repo, tmp_path, [Piece(bid(0), name, NO_CUT)], keep=lambda c: c != 9)
    assert w is not None
    assert read(out / w.entry.file) == [(OP_MUTATION, 3, b"k", b"8", 8),
                                        (OP_MUTATION, 5, b"k", b"0b", 0)]  # fmt: skip
    assert w.collections == {0: (1, 0), 8: (1, 0)}


def test_nothing_left_writes_nothing(repo: Repository, tmp_path: Path) -> None:
    name = segment(repo, bid(0), [rec(1, "x", "1", cid=9)])
    w, out = run(repo, tmp_path, [Piece(bid(0), name, NO_CUT)], keep=lambda c: c != 9)
    assert w is None
    assert list(out.iterdir()) == []
    w, _ = run(repo, tmp_path, [])
    assert w is None


def test_damaged_piece_raises_segment_error(repo: Repository, tmp_path: Path) -> None:
    name = segment(repo, bid(0), [rec(s, f"k{s}", "v" * 50) for s in range(1, 40)])
    path = repo.segment_path(BUCKET, bid(0), name)
    with SegmentReader(path) as r:
        at = r.blocks[1].offset + 5
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SegmentError, match="block checksum mismatch"):
        run(repo, tmp_path, [Piece(bid(0), name, NO_CUT)])
    assert list((tmp_path / "out").iterdir()) == []  # nothing left behind
    with pytest.raises(SegmentError, match="cannot open"):
        run(repo, tmp_path, [Piece(bid(1), name, NO_CUT)])


def test_memory_stays_flat_as_the_partition_grows(repo: Repository, tmp_path: Path) -> None:
    """Pass 2 streams: 8 MB of incompressible values go through well under 8 MB of heap
    (the writer spills its blocks, the map holds seqs), and twice the data costs about
    the same."""
    import os
    import tracemalloc

    def peak(n: int, hours: float) -> int:
        half = n // 2
        rows = [rec(s, f"k{s % half:06d}", "") for s in range(1, n + 1)]
        rows = [r._replace(value=os.urandom(8192)) for r in rows]
        a = segment(repo, bid(hours), rows[:half])
        b = segment(repo, bid(hours + 0.5), rows[half:], start=half)
        del rows
        out = tmp_path / f"out{n}"
        out.mkdir()
        pieces = [Piece(bid(hours), a, NO_CUT), Piece(bid(hours + 0.5), b, NO_CUT)]
        hdr = SegmentHeader(BUCKET, P, LOG, 0, n, ((0, n),), "2026-11-26T00:00:00.000000Z",
                            "test", 64 << 10)  # fmt: skip
        tracemalloc.start()
        try:
            w = write_latest(repo, BUCKET, P, pieces, keep=None, header=hdr, directory=out)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            assert w is not None and w.entry.records == half  # the second half won

    small, big = peak(1000, 0), peak(2000, 2)
    assert small < 3 << 20, small
    assert big < 3 << 20 and big < small * 1.5, (small, big)


def test_min_seq_reads_only_above_it(repo: Repository, tmp_path: Path) -> None:
    """A merge cut where a later rollback cuts it: each range compacted on its own."""
    name = segment(repo, bid(0), [rec(1, "a", "a1"), rec(2, "b", "b1"), rec(3, "a", "a2"),
                                  rec(4, "b", op=OP_DELETION), rec(5, "c", "c1")])  # fmt: skip
    low, out = run(repo, tmp_path, [Piece(bid(0), name, 2)], end=2)
    assert low is not None
    assert read(out / low.entry.file) == [(OP_MUTATION, 1, b"a", b"a1", 0),
                                          (OP_MUTATION, 2, b"b", b"b1", 0)]  # fmt: skip
    high, out = run(repo, tmp_path, [Piece(bid(0), name, NO_CUT, 2)])
    assert high is not None
    assert read(out / high.entry.file) == [(OP_MUTATION, 3, b"a", b"a2", 0),
                                           (OP_DELETION, 4, b"b", b"", 0),
                                           (OP_MUTATION, 5, b"c", b"c1", 0)]  # fmt: skip
