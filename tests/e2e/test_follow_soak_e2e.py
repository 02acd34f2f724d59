"""Soak: `upr backup --follow` for 10 minutes under a mixed workload (make test-slow).

Updates, deletes and new keys arrive all the time while the follower commits every
second and rolls its commits up. Its memory must stay flat and bounded (the
--memory-limit budget plus the interpreter), and at the end the repository verifies
and restores to exactly the node's state. UPR_SOAK_SECONDS shortens or lengthens it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import node_rows, spawn_upr, store_rows, wait_persisted

SECONDS = float(os.environ.get("UPR_SOAK_SECONDS", "600"))


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.slow
@pytest.mark.timeout(int(SECONDS) + 300)
def test_a_follower_runs_for_minutes_with_flat_memory(node: Node, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    upr("load", node.uri, "--docs", "2000", "--seed", "1")
    samples: list[int] = []
    with spawn_upr("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every",
                   "1s", "--memory-limit", "64MB") as follower:  # fmt: skip
        start = time.monotonic()
        seed = 2
        while time.monotonic() - start < SECONDS:
            load = ["load", node.uri, "--docs", "3000", "--rate", "600", "--update-ratio",
                    "0.5", "--delete-ratio", "0.2", "--seed", str(seed), "--size", "400",
                    "--prefix", f"k{seed % 7}"]  # fmt: skip
            with spawn_upr(*load, stdout=subprocess.DEVNULL) as writer:
                writer.wait(timeout=120)
            seed += 1
            assert follower.poll() is None, follower.communicate()
            samples.append(_rss_kib(follower.pid))
        wait_persisted(node.uri)
        time.sleep(3)
        follower.send_signal(signal.SIGTERM)
        _out, err = follower.communicate(timeout=120)
    assert follower.returncode == 0, err
    warm = samples[len(samples) // 4 :]  # after the catch-up and the first rollups
    assert max(warm) < 64 * 1024 + 160 * 1024, samples  # the budget plus the interpreter
    assert max(warm) <= 1.25 * min(warm) + 16 * 1024, samples  # flat: no growth with time
    upr("verify", "--repo", str(repo))
    db = tmp_path / "soak.db"
    upr("restore", "--repo", str(repo), f"sqlite:{db}")
    assert store_rows(db) == node_rows(node.uri)
