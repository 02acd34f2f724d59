"""`--metrics-file` of `replay` (one-shot), `merge` and `repo copy` (docs/metrics.md
"One-shot commands"): the file says what the command's --json says it did."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.metrics.metrics_helpers import one, samples
from tests.repo.repo_helpers import run_upr

BACKUPS = 2  # the chain of the `repo` fixture (tests/metrics/conftest.py)


def _ok(prom: Path, command: str, t0: float) -> dict[str, float]:
    """The file's figures for `command` and bucket default, after checking it succeeded."""
    got = samples(prom.read_text())
    key = {"command": command, "bucket": "default"}
    assert one(got, "upr_last_result", **key) == 1
    assert t0 <= one(got, "upr_last_success_timestamp_seconds", **key) <= time.time()
    assert 0 <= one(got, "upr_last_duration_seconds", **key) < 60
    return {n: one(got, n, **key) for n in ("upr_last_items", "upr_last_bytes")}


@pytest.mark.parametrize(
    ("command", "args", "items", "written"),
    [
        ("replay", ("replay", "repo:{repo}", "--into", "{tmp}/r.db"), "applied", "bytes"),
        ("merge", ("merge", "--repo", "{repo}"), "items", "bytes_written"),
    ],
)
def test_a_one_shot_counts_the_items_and_bytes_its_summary_says(
    capsys: pytest.CaptureFixture[str], repo: Path, tmp_path: Path, command: str,
    args: tuple[str, ...], items: str, written: str,
) -> None:  # fmt: skip
    """A one-shot replay (what it applied) and a merge (what it wrote)."""
    prom, t0 = tmp_path / f"{command}.prom", time.time()
    argv = [a.format(repo=repo, tmp=tmp_path) for a in args]
    code, out, err = run_upr(capsys, *argv, "--json", "--metrics-file", str(prom))
    assert code == 0, err
    summary = json.loads(out)
    got = _ok(prom, command, t0)
    assert got["upr_last_items"] == summary[items] > 0
    assert got["upr_last_bytes"] == summary[written] > 0


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
