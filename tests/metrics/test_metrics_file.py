"""`--metrics-file` of the one-shot commands (docs/metrics.md §2): written at the end,
success or failure, atomically, in the text format node_exporter's textfile collector
reads; a directory that does not exist is a usage error before any work."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.metrics.metrics_helpers import one, samples
from tests.repo.repo_helpers import run_upr


def _read(path: Path) -> dict[str, Any]:
    return samples(path.read_text())


def _damage_a_segment(repo: Path) -> None:
    seg = next(p for p in sorted(repo.rglob("*")) if p.is_file() and "manifest" not in p.name
               and p.stat().st_size > 64)  # fmt: skip
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))


def test_verify_says_ok_then_failed_and_keeps_the_last_success(
    capsys: pytest.CaptureFixture[str], repo: Path, tmp_path: Path
) -> None:
    prom = tmp_path / "verify.prom"
    t0 = time.time()
    code, out, err = run_upr(capsys, "verify", "--repo", str(repo), "--json",
                             "--metrics-file", str(prom))  # fmt: skip
    assert code == 0, err
    report = json.loads(out)["buckets"][0]
    got, key = _read(prom), {"command": "verify", "bucket": "default"}
    assert one(got, "upr_last_result", **key) == 1
    assert one(got, "upr_last_items", **key) == report["items"] > 0
    assert one(got, "upr_last_bytes", **key) == report["bytes"] > 0
    success = one(got, "upr_last_success_timestamp_seconds", **key)
    assert t0 <= success <= time.time()
    assert 0 <= one(got, "upr_last_duration_seconds", **key) < 60
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("verify.prom")] == [
        "verify.prom"]  # no temporary file left  # fmt: skip

    _damage_a_segment(repo)
    code, _out, err = run_upr(capsys, "verify", "--repo", str(repo), "--metrics-file", str(prom))
    assert code == 1, err
    got = _read(prom)
    assert one(got, "upr_last_result", **key) == 0
    # the last success stays what it was: an alert on its age goes on firing
    assert one(got, "upr_last_success_timestamp_seconds", **key) == success


def test_prune_dry_run_counts_the_backups_it_would_remove(
    capsys: pytest.CaptureFixture[str], repo: Path, tmp_path: Path
) -> None:
    prom = tmp_path / "prune.prom"
    code, out, err = run_upr(capsys, "prune", "--repo", str(repo), "--keep-last", "1", "--json",
                             "--metrics-file", str(prom))  # fmt: skip
    assert code == 0, err
    b = json.loads(out)["buckets"][0]
    got, key = _read(prom), {"command": "prune", "bucket": "default"}
    assert one(got, "upr_last_result", **key) == 1
    assert one(got, "upr_last_items", **key) == b["backups_removed"] == 2
    assert one(got, "upr_last_bytes", **key) == b["bytes_removed"] > 0


def test_restore_into_a_store_counts_what_it_restored(
    capsys: pytest.CaptureFixture[str], repo: Path, tmp_path: Path
) -> None:
    prom = tmp_path / "restore.prom"
    db = tmp_path / "out.db"
    code, out, err = run_upr(capsys, "restore", "--repo", str(repo), f"sqlite:{db}", "--json",
                             "--metrics-file", str(prom))  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    got, key = _read(prom), {"command": "restore", "bucket": "default"}
    assert one(got, "upr_last_result", **key) == 1
    assert one(got, "upr_last_items", **key) == summary["documents"] + summary["deletions"] > 0
    assert one(got, "upr_last_bytes", **key) > 0


def test_a_backup_that_fails_writes_result_0(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prom = tmp_path / "backup.prom"
    code, _out, err = run_upr(capsys, "backup", "upr://u:p@127.0.0.1:1/travel", "--repo",
                              str(tmp_path / "r"), "--wait", "0", "--metrics-file",
                              str(prom))  # fmt: skip
    assert code != 0 and "upr: error:" in err
    got, key = _read(prom), {"command": "backup", "bucket": "travel"}
    assert one(got, "upr_last_result", **key) == 0
    assert "upr_last_success_timestamp_seconds" not in got  # it never succeeded


def test_a_missing_directory_is_a_usage_error_before_any_work(
    capsys: pytest.CaptureFixture[str], repo: Path, tmp_path: Path
) -> None:
    before = sorted(p.name for p in repo.rglob("*"))
    missing = tmp_path / "no" / "prune.prom"
    code, _out, err = run_upr(capsys, "prune", "--repo", str(repo), "--keep-last", "1",
                              "--apply", "--metrics-file", str(missing))  # fmt: skip
    assert code == 2
    assert err.strip().splitlines() == [
        f"upr: error: --metrics-file {missing}: directory {missing.parent} does not exist"
    ]
    assert sorted(p.name for p in repo.rglob("*")) == before  # nothing pruned
