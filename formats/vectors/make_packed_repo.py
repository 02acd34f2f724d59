"""Regenerate `packed-repo/`: a tiny plain repository whose newest backup is a packed
continuous commit (formats/repository.md §12), and what it holds (run only when the
pack or manifest format changes).

Usage: python formats/vectors/make_packed_repo.py
Writes packed-repo/repo (repo.json, one bucket `vec`):
  * backup 20261206T120000.000000Z, full: partition 3, seqs 1-4, as a segment file;
  * backup 20261206T130000.000000Z, a continuous commit on it (`continuous`; no
    restore points, which are optional) whose three segments are members of its
    `segments.pack` and nowhere else: partition 3 (seqs 5-6 on a new branch from 4,
    after a failover took back 5-6 of the old one: the member `cut-1/…`) and partition
    5 (seqs 1-2, new);
and packed-repo/expected.json: the pack's members, and the state at each backup (key ->
value, null for a deletion, per partition). Every byte is fixed: a new run writes the
same files. tests/repo/test_pack.py opens it.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from upr_cli.failover import FailoverLog  # noqa: E402
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord  # noqa: E402
from upr_cli.repo import (  # noqa: E402
    BackupId,
    CutBack,
    Manifest,
    PartitionEntry,
    Repository,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.repo.layout import REPO_VERSIONS, RepoInfo  # noqa: E402
from upr_cli.repo.pack import write_pack  # noqa: E402
from upr_cli.segments import SegmentHeader, SegmentWriter  # noqa: E402

OUT = HERE / "packed-repo"
BUCKET = "vec"
OLD, NEW, P5 = 0xC0FFEE, 0xBEEF01, 0x5555
ID1 = BackupId(datetime(2026, 12, 6, 12, 0, tzinfo=UTC))
ID2 = BackupId(datetime(2026, 12, 6, 13, 0, tzinfo=UTC))
CREATED = "2026-12-06T12:00:00.000000Z"


def rec(p: int, seq: int, key: bytes, value: bytes | None) -> DcpRecord:
    op = OP_MUTATION if value is not None else OP_DELETION
    return DcpRecord(op, p, seq, 1, 1000 * p + seq, 0, 0, 0, 1 if value else 0, key,
                     value or b"", 0)  # fmt: skip


def segment(d: Path, p: int, log: FailoverLog, start: int, rows: list[DcpRecord]) -> SegmentEntry:
    end = rows[-1].by_seqno
    hdr = SegmentHeader(BUCKET, p, log, start, end, ((start, end),), CREATED, "upr://h/vec", 4096)
    w = SegmentWriter(d / f"p{p:04x}.open", hdr)
    w.add(rows)
    name = format_segment_name(p, rows[0].by_seqno, end)
    i = w.finish(path=d / name)
    return SegmentEntry(name, i.first_seq, i.last_seq, i.records, i.bytes, i.checksum)


def build(root: Path) -> dict[str, object]:
    root.mkdir(parents=True)
    info = RepoInfo(REPO_VERSIONS[0], datetime(2026, 12, 6, 12, 0, tzinfo=UTC))
    (root / "repo.json").write_text(json.dumps(info.to_json(), indent=2) + "\n")
    repo = Repository(root)
    old = FailoverLog.of([(OLD, 0)])
    d1 = repo.new_backup_dir(BUCKET, ID1)
    rows1 = [rec(3, 1, b"alpha", b'{"n":1}'), rec(3, 2, b"beta", b'{"n":2}'),
             rec(3, 3, b"gamma", b"raw bytes"), rec(3, 4, b"alpha", None)]  # fmt: skip
    e1 = PartitionEntry(3, OLD, old, 0, 4, 4, 4, (segment(d1, 3, old, 0, rows1),))
    repo.write_manifest(Manifest(ID1, BUCKET, "upr://h/vec", ID1.time,
                                 ID1.time + timedelta(seconds=1), True, None, (e1,),
                                 Totals.derive([e1], 1)))  # fmt: skip
    d2 = repo.new_backup_dir(BUCKET, ID2)
    new = FailoverLog.of([(NEW, 4), (OLD, 0)])
    p5 = FailoverLog.of([(P5, 0)])
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp)
        (local / "cut-1").mkdir()
        lost = segment(local / "cut-1", 3, old, 4, [rec(3, 5, b"beta", b'{"n":"lost"}'),
                                                   rec(3, 6, b"delta", b'{"n":6}')])  # fmt: skip
        kept = segment(local, 3, new, 4, [rec(3, 5, b"beta", b'{"n":5}'),
                                          rec(3, 6, b"gamma", None)])  # fmt: skip
        fresh = segment(local, 5, p5, 0, [rec(5, 1, b"epsilon", b'{"n":"e"}'),
                                          rec(5, 2, b"zeta", b'{"n":"z"}')])  # fmt: skip
        members = [(kept.file, local / kept.file), (f"cut-1/{lost.file}",
                   local / "cut-1" / lost.file), (fresh.file, local / fresh.file)]  # fmt: skip
        write_pack(repo.storage, d2, members)
    t = ID2.time
    # no restore points (`points` is optional): the vector is about the pack, and reads
    # the same whichever encoding of points (formats/repository.md §5.11) the code has
    e3 = PartitionEntry(3, NEW, new, 4, 6, 6, 6, (kept,), cut_backs=(CutBack(6, 4, (lost,)),))
    e5 = PartitionEntry(5, P5, p5, 0, 2, 2, 2, (fresh,))
    repo.write_manifest(Manifest(ID2, BUCKET, "upr://h/vec", t, t + timedelta(seconds=3),
                                 False, ID1, (e3, e5), Totals.derive([e3, e5], 1),
                                 continuous=ID1.time + timedelta(seconds=1)))  # fmt: skip
    return {
        "bucket": BUCKET,
        "packed": str(ID2),
        "members": [name for name, _ in members],
        "states": {
            str(ID1): {"3": {"beta": '{"n":2}', "gamma": "raw bytes"}},
            str(ID2): {
                "3": {"beta": '{"n":5}'},
                "5": {"epsilon": '{"n":"e"}', "zeta": '{"n":"z"}'},
            },
        },
    }


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    expected = build(OUT / "repo")
    (OUT / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")


if __name__ == "__main__":
    main()
