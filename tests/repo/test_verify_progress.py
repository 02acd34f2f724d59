"""`verify`'s progress counts what it read: segments, records and bytes (for bytes/s)."""

from __future__ import annotations

from pathlib import Path

from tests.repo.repo_helpers import commit_backup
from upr_cli.jobs.inspect import verify
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.repo import Repository


def test_progress_counts_segments_records_and_bytes(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "repo")
    repo.init()
    rows = {p: [DcpRecord(OP_MUTATION, p, s, s, s, 0, 0, 0, 1, b"k%d" % s, b"{}", 0)
                for s in range(1, 11)] for p in (0, 1, 2)}  # fmt: skip
    commit_backup(repo, 0, rows)
    commit_backup(repo, 1, {0: [r._replace(by_seqno=r.by_seqno + 10) for r in rows[0]]}, 10)
    ticks: list[tuple[int, int, int, int]] = []
    [report] = verify(repo.path, on_progress=lambda *t: ticks.append(t))
    assert not report.problems and (report.segments, report.records) == (4, 40)
    assert [t[:3] for t in ticks] == [(1, 4, 10), (2, 4, 20), (3, 4, 30), (4, 4, 40)]
    assert ticks[-1][3] == report.bytes > 0  # the segment files' bytes
    assert ticks[0][3] < ticks[1][3] < ticks[2][3] < ticks[3][3]
