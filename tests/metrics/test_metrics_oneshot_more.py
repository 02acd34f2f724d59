"""`--metrics-file` of `replay` (one-shot), `merge` and `repo copy` (docs/metrics.md
"One-shot commands"): the file says what the command's --json says it did."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.metrics.metrics_helpers import one, samples
from tests.repo.chain_gen import Step, build
from tests.repo.repo_helpers import run_upr
from upr_cli.repo import Repository

STEPS = [
    Step("full", (3, 3, 3), (0, 0, 0), (False, False, False), 1),
    Step("inc", (4, 2, 3), (0, 0, 0), (False, False, False), 2),
]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    build(Repository(path), STEPS)
    return path


def _ok(prom: Path, command: str, t0: float) -> dict[str, float]:
    """The file's figures for `command` and bucket default, after checking it succeeded."""
    got = samples(prom.read_text())
    key = {"command": command, "bucket": "default"}
    assert one(got, "upr_last_result", **key) == 1
    assert t0 <= one(got, "upr_last_success_timestamp_seconds", **key) <= time.time()
    assert 0 <= one(got, "upr_last_duration_seconds", **key) < 60
    return {n: one(got, n, **key) for n in ("upr_last_items", "upr_last_bytes")}


def test_a_one_shot_replay_counts_what_it_applied(
    capsys: pytest.CaptureFixture[str], repo: Path, tmp_path: Path
) -> None:
    prom, t0 = tmp_path / "replay.prom", time.time()
    code, out, err = run_upr(capsys, "replay", f"repo:{repo}", "--into", str(tmp_path / "r.db"),
                             "--json", "--metrics-file", str(prom))  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    got = _ok(prom, "replay", t0)
    assert got["upr_last_items"] == summary["applied"] > 0
    assert got["upr_last_bytes"] == summary["bytes"] > 0


def test_merge_counts_the_items_and_bytes_it_wrote(
    capsys: pytest.CaptureFixture[str], repo: Path, tmp_path: Path
) -> None:
    prom, t0 = tmp_path / "merge.prom", time.time()
    code, out, err = run_upr(capsys, "merge", "--repo", str(repo), "--json",
                             "--metrics-file", str(prom))  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    got = _ok(prom, "merge", t0)
    assert got["upr_last_items"] == summary["items"] > 0
    assert got["upr_last_bytes"] == summary["bytes_written"] > 0


def test_repo_copy_counts_backups_and_bytes_per_bucket(
    capsys: pytest.CaptureFixture[str], repo: Path, tmp_path: Path
) -> None:
    prom, t0 = tmp_path / "copy.prom", time.time()
    code, out, err = run_upr(capsys, "repo", "copy", "--from", str(repo), "--to",
                             str(tmp_path / "copy"), "--json", "--metrics-file",
                             str(prom))  # fmt: skip
    assert code == 0, err
    b = json.loads(out)["buckets"][0]
    got = _ok(prom, "repo_copy", t0)
    assert got["upr_last_items"] == b["backups_copied"] == 2
    assert got["upr_last_bytes"] == b["bytes"] > 0


def test_a_merge_that_fails_writes_result_0(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    prom = tmp_path / "merge.prom"
    code, _out, err = run_upr(capsys, "merge", "--repo", str(tmp_path / "none"), "--bucket",
                              "default", "--metrics-file", str(prom))  # fmt: skip
    assert code != 0 and "upr: error:" in err
    got = samples(prom.read_text())
    assert one(got, "upr_last_result", command="merge", bucket="default") == 0
