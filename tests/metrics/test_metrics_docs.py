"""docs/metrics.md names every metric upr exports, the examples (scrape config, alert
rules, Grafana dashboard) use no other, and promtool accepts the rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.metrics.metrics_helpers import one, samples
from upr_cli.jobs.follow import CommitReport
from upr_cli.jobs.replay import ReplayStats
from upr_cli.jobs.tail import TailSummary
from upr_cli.metrics import (
    FollowMetrics,
    NodeMetrics,
    OneShot,
    ReplayMetrics,
    TailMetrics,
    write_one_shot,
)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
EXAMPLES = [ROOT / "examples" / "prometheus" / "prometheus.yml",
            ROOT / "examples" / "prometheus" / "alerts.yml",
            ROOT / "examples" / "grafana" / "upr-dashboard.json"]  # fmt: skip
METRIC = re.compile(r"\b(?:upr|process)_[a-z0-9_]+\b")


def _documented() -> set[str]:
    """The metric names in docs/metrics.md's tables (the first column, in backquotes)."""
    names = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`((?:upr|process)_[a-z0-9_]+)`", line.split(" | ")[0]))
    return names


def _exported(tmp_path: Path) -> set[str]:
    """Every sample name a follower's registry and a one-shot file hold."""
    m = FollowMetrics("b", per_partition=True)
    m.lag({0: 1})
    m.error("session")
    now = datetime.now(UTC)
    m.commit(CommitReport("x", 1, 2, 3, 1, now, now, 0.0, 1, 5))
    names = {s.name for fam in m.registry.collect() for s in fam.samples}
    replay, tail = ReplayMetrics("b"), TailMetrics("b", per_partition=True)
    stats = ReplayStats(resets=1, last_apply=1.0)
    replay.progress(stats)
    tail.progress(TailSummary(1, 0, 2))
    for follower in (replay, tail):
        follower.notice("connection to n lost")
        follower.notice("connection to n back after 1.0s")
        follower._lag.lag({0: 1})
        names |= {s.name for fam in follower.registry.collect() for s in fam.samples}
    names |= {
        s.name
        for fam in NodeMetrics.families(
            {"b": {"connections": 1, "written": 2, "streams": 3, "sent": 4}}
        )
        for s in fam.samples
    }
    prom = tmp_path / "x.prom"
    write_one_shot(prom, OneShot("verify", "b"), 1.0)
    return names | set(samples(prom.read_text()))


def test_every_exported_metric_is_documented(tmp_path: Path) -> None:
    exported = _exported(tmp_path)
    assert {"upr_follow_items_total", "upr_last_result"} <= exported
    assert exported - _documented() == set()
    assert {n for n in _documented() if n.startswith("upr_")} - exported == set()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_use_documented_metrics_only(path: Path) -> None:
    text = path.read_text()
    if path.suffix == ".json":
        json.loads(text)
    used = set(METRIC.findall(text))
    if path.name != "prometheus.yml":
        assert used, "no metric used"
    assert used - _documented() == set()


def test_the_dashboard_shows_lag_lost_writes_and_failed_backups() -> None:
    dash = json.loads(EXAMPLES[2].read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", ()))
    for name in ("upr_follow_lag_seconds", "upr_lost_writes_total", "upr_last_result",
                 "process_resident_memory_bytes"):  # fmt: skip
        assert name in exprs, name


def test_the_alert_rules_cover_lag_failed_backups_and_lost_writes() -> None:
    text = EXAMPLES[1].read_text()
    for expr in ("upr_follow_lag_seconds", 'upr_last_result{command="backup"} == 0',
                 "increase(upr_lost_writes_total"):  # fmt: skip
        assert expr in text, expr


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (Debian's prometheus: make system-deps)",
)
def test_promtool_accepts_the_rules_and_the_config() -> None:
    for args in (["check", "rules", str(EXAMPLES[1])], ["check", "config", str(EXAMPLES[0])]):
        r = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "SUCCESS" in r.stdout


def test_lag_seconds_count_from_the_last_time_it_was_caught_up() -> None:
    m = FollowMetrics("b", per_partition=False)

    def got() -> dict[str, float]:
        s = {x.name: x.value for fam in m.registry.collect() for x in fam.samples
             if x.name.startswith("upr_follow_lag")}  # fmt: skip
        return s

    m.lag({0: 0, 1: 0})
    assert got() == {"upr_follow_lag_seqs": 0, "upr_follow_lag_seconds": 0}
    m.lag({0: 3, 1: 4})
    time.sleep(0.05)
    behind = got()
    assert behind["upr_follow_lag_seqs"] == 7 and behind["upr_follow_lag_seconds"] >= 0.05
    m.lag({0: 0, 1: 0})
    assert got()["upr_follow_lag_seconds"] == 0


def test_a_one_shot_file_per_bucket(tmp_path: Path) -> None:
    run = OneShot("verify", "")
    run.done("a", 10, 100)
    run.done("b", 5, 50, ok=False)
    prom = tmp_path / "v.prom"
    write_one_shot(prom, run, 2.5, now=1000.0)
    got = samples(prom.read_text())
    assert one(got, "upr_last_result", command="verify", bucket="a") == 1
    assert one(got, "upr_last_result", command="verify", bucket="b") == 0
    assert one(got, "upr_last_success_timestamp_seconds", command="verify", bucket="a") == 1000
    assert ("bucket", "b") not in {kv for k in got["upr_last_success_timestamp_seconds"]
                                   for kv in k}  # fmt: skip
    assert one(got, "upr_last_duration_seconds", command="verify", bucket="b") == 2.5
