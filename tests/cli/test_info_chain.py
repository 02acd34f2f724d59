"""`upr info` shows the chain: each backup's type (full, incremental, merged), when it
committed, its parent, its size on disk and its items, and the repository's size.

The repository is built with the library (tests/repo/repo_helpers.py): a full backup,
an incremental one, and a merge through the newest (a full backup whose source says
`merge of …`, as `upr spark merge` writes it). Sizes on disk are checked against the
files themselves; the table is checked at 80 columns (the key columns whole) and as
a pipe gets it (200 columns, every column).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

from tests.cli.json_convention import problems
from tests.repo.repo_helpers import BUCKET, LOG, bid, commit_backup
from upr_cli.cli import inspect as inspect_cli
from upr_cli.jobs.inspect import backup_type, info
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.repo import (
    Manifest,
    PartitionEntry,
    Repository,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.segments import SegmentHeader, SegmentWriter

ROOT = Path(__file__).resolve().parents[2]


def rows(lo: int, hi: int) -> list[DcpRecord]:
    return [DcpRecord(OP_MUTATION, 0, s, s, s, 0, 0, 0, 1, b"k%d" % (s % 7), b'{"s":%d}' % s,
                      0, 0, b"") for s in range(lo, hi + 1)]  # fmt: skip


def merge(repo: Repository, n: int, records: list[DcpRecord], through: str) -> Manifest:
    """Backup `n`: a merge through the newest backup, as `upr spark merge` writes it
    (full, no parent, its source naming what it merged)."""
    b = bid(n)
    d = repo.new_backup_dir(BUCKET, b)
    high = records[-1].by_seqno
    hdr = SegmentHeader(BUCKET, 0, LOG, 0, high, ((0, high),), "2026-11-26T00:00:00.000000Z",
                        "merge", 128)  # fmt: skip
    w = SegmentWriter(d / "p0.open", hdr)
    w.add(records)
    name = format_segment_name(0, records[0].by_seqno, high)
    i = w.finish(path=d / name)
    seg = SegmentEntry(name, i.first_seq, i.last_seq, i.records, i.bytes, i.checksum)
    entries = (PartitionEntry(0, 0xBEEF, LOG, 0, high, high, high, (seg,)),)
    m = Manifest(b, BUCKET, f"merge of {bid(0)}..{through}", b.time,
                 b.time + timedelta(seconds=2), True, None, entries,
                 Totals.derive(entries, 1))  # fmt: skip
    repo.write_manifest(m)
    return m


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("infochain") / "repo"
    r = Repository(path)
    r.init()
    commit_backup(r, 0, {0: rows(1, 40)})
    commit_backup(r, 1, {0: rows(41, 60)}, start=40)
    merge(r, 2, rows(1, 60)[-7:], str(bid(1)))
    (path / "notes.txt").write_text("a user's notes: not the repository's\n")
    return path


def files_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_json_has_type_dates_parent_and_sizes_on_disk(repo: Path) -> None:
    data = info(repo)
    assert problems(data) == []
    backups = data["buckets"][0]["backups"]
    assert [b["type"] for b in backups] == ["full", "incremental", "merged"]
    assert [b["parent"] for b in backups] == [None, str(bid(0)), None]
    assert [b["items"] for b in backups] == [40, 20, 7]
    for n, b in enumerate(backups):
        assert b["finished"] == (bid(n).time + timedelta(seconds=1 + (n == 2))).strftime(
            "%Y-%m-%dT%H:%M:%S.%fZ")  # RFC 3339, UTC  # fmt: skip
        assert b["started"] == bid(n).time.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        on_disk = files_under(repo / BUCKET / b["backup_id"])
        assert b["bytes_on_disk"] == on_disk > b["bytes_written"]  # segments + manifests
    bucket = data["buckets"][0]["bytes_on_disk"]
    assert bucket == files_under(repo / BUCKET) == sum(b["bytes_on_disk"] for b in backups)
    assert data["bytes_on_disk"] == bucket + (repo / "repo.json").stat().st_size


def test_backup_type_reads_every_mark_of_a_merge() -> None:
    m = commit_backup_manifest()
    assert backup_type(m) == "incremental"
    assert backup_type(replace(m, full=True, parent=None)) == "full"
    assert backup_type(replace(m, full=True, parent=None, merged_through=bid(0))) == "merged"
    assert backup_type(replace(m, source="merge of a..b")) == "merged"
    absorbed = SimpleNamespace(**{f: getattr(m, f) for f in ("merged_through", "source", "full")},
                               absorbed=(bid(0),))  # fmt: skip
    assert backup_type(absorbed) == "merged"  # type: ignore[arg-type]


def commit_backup_manifest() -> Manifest:
    entries = (PartitionEntry(0, 0xBEEF, LOG, 0, 60, 60, 60),)
    return Manifest(bid(1), BUCKET, "upr://h/default", bid(1).time, bid(1).time, False, bid(0),
                    entries, Totals.derive(entries, 0))  # fmt: skip


def render(data: dict[str, Any], width: int) -> list[str]:
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, legacy_windows=False)
    entry = data["buckets"][0]
    console.print(inspect_cli.backups_table("t", entry["backups"], wide=width >= 100))
    lines = buf.getvalue().splitlines()
    assert all(cell_len(line) <= width for line in lines), "\n".join(lines)
    return lines


def test_the_table_keeps_its_key_columns_whole_at_80_columns(repo: Path) -> None:
    data = info(repo)
    text = "\n".join(render(data, 80))
    assert "…" not in text, text
    for cell in (str(bid(0)), str(bid(2)), "incremental", "merged", "full", "finished (UTC)",
                 "2026-11-21", "06:15:01", "on disk", "40"):  # fmt: skip
        assert cell in text, text


def test_piped_output_has_every_column(repo: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "upr_cli", "info", "--repo", str(repo)],
                          capture_output=True, env=env, timeout=60, check=True)  # fmt: skip
    out = proc.stdout.decode()
    header = next(line for line in out.splitlines() if line.lstrip().startswith("backup"))
    for col in ("type", "finished (UTC)", "parent", "items", "on disk", "read", "written",
                "ratio", "rollbacks"):  # fmt: skip
        assert col in header, out
    row = next(line for line in out.splitlines() if line.startswith(str(bid(1))))
    assert "2026-11-21 07:15:01" in row and str(bid(0))[:15] in row, out
    assert out.splitlines()[-1].startswith(f"{repo}: ") and "on disk" in out.splitlines()[-1]
    args = [sys.executable, "-m", "upr_cli", "info", "--repo", str(repo), "--json"]
    proc = subprocess.run(args, capture_output=True, env=env, timeout=60, check=True)
    assert json.loads(proc.stdout)["bytes_on_disk"] == info(repo)["bytes_on_disk"]
