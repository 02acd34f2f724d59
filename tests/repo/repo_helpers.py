"""What the repository tests share: one bucket, one clock and one failover log, and
backups written with the library."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from upr_cli.failover import FailoverLog
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.repo import (
    BackupId,
    Manifest,
    PartitionEntry,
    Repository,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.segments import SegmentHeader, SegmentWriter

BUCKET = "default"
T0 = datetime(2026, 11, 21, 6, 15, tzinfo=UTC)
LOG = FailoverLog.of([(0xBEEF, 0)])


def bid(hours: float) -> BackupId:
    """The backup id `hours` after T0."""
    return BackupId(T0 + timedelta(hours=hours))


def commit_backup(repo: Repository, n: int, rows: Mapping[int, Sequence[DcpRecord]],
                  start: int = 0) -> Manifest:  # fmt: skip
    """Commit backup `n` (full when n is 0, else on backup `n - 1`) holding, per partition,
    `rows` (seqs above `start`, one snapshot): real segment files and a manifest."""
    b, parent = bid(n), bid(n - 1) if n else None
    d = repo.new_backup_dir(BUCKET, b)
    entries = []
    for p, mine in rows.items():
        high = mine[-1].by_seqno
        hdr = SegmentHeader(BUCKET, p, LOG, start, high, ((start, high),),
                            "2026-11-26T00:00:00.000000Z", "upr://h/default", 128)  # fmt: skip
        w = SegmentWriter(d / f"p{p}.open", hdr)
        w.add(mine)
        name = format_segment_name(p, mine[0].by_seqno, high)
        i = w.finish(path=d / name)
        seg = SegmentEntry(name, i.first_seq, i.last_seq, i.records, i.bytes, i.checksum)
        entries.append(PartitionEntry(p, 0xBEEF, LOG, start, high, high, high, (seg,)))
    m = Manifest(b, BUCKET, "upr://h/default", b.time, b.time + timedelta(seconds=1),
                 parent is None, parent, tuple(entries), Totals.derive(entries, 1))  # fmt: skip
    repo.write_manifest(m)
    return m


def one_backup_repo(root: Path, seqs: Sequence[int]) -> Path:
    """A new repository at `root` with one backup of partition 0: a mutation of key
    `k<seq>` at each of `seqs`."""
    r = Repository(root)
    r.init()
    rows = [DcpRecord(OP_MUTATION, 0, s, s, s, 0, 0, 0, 0, f"k{s}".encode(), b"v", 0)
            for s in seqs]  # fmt: skip
    commit_backup(r, 0, {0: rows})
    return root


def run_upr(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """A command run in this process, with its own access settings: (exit, out, err)."""
    from upr_cli.cli.app import main
    from upr_cli.repo import access

    access.reset()
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
