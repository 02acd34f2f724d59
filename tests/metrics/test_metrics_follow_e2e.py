"""`upr backup --follow --metrics-port` against `upr serve` (docs/metrics.md §1): a real
HTTP client scrapes the follower's endpoint, and the values are checked against what the
follower did (its --json summary, the repository's commits)."""

from __future__ import annotations

import json
import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import spawn_upr, wait_persisted
from tests.metrics.metrics_helpers import Samples, one, samples
from tests.metrics.metrics_helpers import until as _until
from tests.repo.repo_helpers import run_upr
from upr_cli.errors import UprError
from upr_cli.repo import Repository

COMMIT = "0.2s"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> tuple[str, Samples]:
    """GET /metrics: (its content type, its samples)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.headers["Content-Type"], samples(resp.read().decode())


def _commits(repo: Path) -> list[Any]:
    try:
        return [m for m in Repository(repo).manifests("default") if m.continuous is not None]
    except (UprError, OSError):  # not created yet, or a commit being written
        return []


def _committed_to_the_highs(repo: Path, node: Node) -> bool:
    """Every partition's newest committed end is the node's high seq."""
    try:
        chain = Repository(repo).manifests("default")
    except (UprError, OSError):
        return False
    ends = {e.partition: e.end_seq for m in chain for e in m.partitions}
    highs = wait_persisted(node.uri)
    return all(ends.get(p, 0) >= high for p, (_uuid, high, _p) in highs.items())


def _load(node: Node, docs: int, seed: int) -> None:
    upr("load", node.uri, "--docs", str(docs), "--update-ratio", "0.3", "--delete-ratio",
        "0.1", "--seed", str(seed), "--size", "100")  # fmt: skip


def test_the_endpoint_says_what_the_follower_committed(node: Node, tmp_path: Path) -> None:
    repo, port = tmp_path / "repo", _free_port()
    _load(node, 300, 1)
    with spawn_upr("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every", COMMIT,
                   "--metrics-port", str(port), "--json") as follower:  # fmt: skip
        _until(lambda: _scrape(port), follower, "the endpoint")
        _until(lambda: _committed_to_the_highs(repo, node), follower, "the catch-up backup")
        _load(node, 200, 2)

        def settled() -> Samples | None:
            if not _committed_to_the_highs(repo, node):
                return None
            got = _scrape(port)[1]
            caught_up = one(got, "upr_follow_lag_seqs", bucket="default") == 0
            return got if caught_up else None

        got = _until(settled, follower, "the follower to commit everything")
        kind, got = _scrape(port)  # after the lag poll: nothing left to commit
        last = _commits(repo)[-1]
        follower.send_signal(signal.SIGTERM)
        out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    assert kind.startswith("text/plain")
    summary = json.loads(out)
    b = {"bucket": "default"}
    assert one(got, "upr_follow_items_total", **b) == summary["items"] > 0
    assert one(got, "upr_follow_bytes_total", **b) == summary["bytes_written"] > 0
    # the commit SIGTERM makes on the way out holds nothing and is not scraped
    assert summary["commits"] - one(got, "upr_follow_commits_total", **b) in (0, 1)
    assert one(got, "upr_follow_rollups_total", **b) == summary["rollups"]
    assert one(got, "upr_follow_last_commit_timestamp_seconds", **b) == pytest.approx(
        last.finished.timestamp(), abs=1e-3)  # fmt: skip
    assert one(got, "upr_follow_lag_seconds", **b) == 0
    for name in ("upr_rollbacks_total", "upr_lost_writes_total", "upr_reconnects_total"):
        assert one(got, name, **b) == 0, name
    assert "upr_errors_total" not in got  # no error of any kind
    assert one(got, "process_resident_memory_bytes") > 1 << 20
    assert f"metrics on http://127.0.0.1:{port}/metrics" in err


def test_lag_per_partition_and_a_reconnect(node: Node, tmp_path: Path) -> None:
    repo, port = tmp_path / "repo", _free_port()
    _load(node, 20, 3)
    with spawn_upr("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every", COMMIT,
                   "--metrics-port", str(port), "--metrics-per-partition",
                   "--wait", "30") as follower:  # fmt: skip

        def polled() -> Samples | None:
            got = _scrape(port)[1]
            return got if len(got.get("upr_follow_lag_seqs", {})) == node.partitions else None

        got = _until(polled, follower, "a lag poll")
        partitions = {dict(k)["partition"] for k in got["upr_follow_lag_seqs"]}
        assert partitions == {str(p) for p in range(node.partitions)}
        assert len(got["upr_follow_lag_seconds"]) == node.partitions
        node.stop()
        node.start()
        _until(lambda: one(_scrape(port)[1], "upr_reconnects_total", bucket="default") >= 1,
               follower, "the reconnect counted")  # fmt: skip
        follower.send_signal(signal.SIGTERM)
        _out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    assert "back after" in err


def test_a_port_in_use_is_an_error_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _out, err = run_upr(capsys, "backup", "upr://u:p@127.0.0.1:1/default", "--repo",
                                  str(tmp_path / "repo"), "--follow", "--metrics-port",
                                  str(port))  # fmt: skip
    assert code == 2
    assert err.splitlines() == [
        f"upr: error: --metrics-port {port}: cannot listen on 127.0.0.1:{port}: "
        "address already in use"]  # fmt: skip
    assert not (tmp_path / "repo").exists()
