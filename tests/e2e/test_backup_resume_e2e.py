"""A resumed backup holds every write acknowledged before it started.

As formats/repository.md §4.5 requires: a `upr backup` process is SIGKILLed while it
writes segments, the bucket changes (updates, deletions, new keys), and the rerun, which
reuses the segments the killed run finished, restores to the state the source had when
the rerun started.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import node_content_hash, spawn_upr, wait_persisted
from upr_cli.jobs.inspect import verify
from upr_cli.store import Store

PARTITIONS = 16


def test_a_resumed_backup_holds_what_was_acknowledged_before_it_started(
    node_factory: type[Node], tmp_path: Path
) -> None:
    node = node_factory("--flush-interval", "0.02", partitions=PARTITIONS).start()
    upr("load", node.uri, "--docs", "4000", "--size", "2000", "--update-ratio", "0.2",
        "--delete-ratio", "0.05")  # fmt: skip
    wait_persisted(node.uri)
    repo = tmp_path / "repo"
    deadline = time.monotonic() + 60
    with spawn_upr("backup", node.uri, "--repo", str(repo), "--no-progress",
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:  # fmt: skip
        while len(list(repo.glob("default/*/p*.seg"))) < 3 and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    written = list(repo.glob("default/*/p*.seg"))
    if list(repo.glob("default/*/manifest.json*")) or not 0 < len(written) < PARTITIONS:
        pytest.fail(f"the kill missed the segment writing ({len(written)} segments)")
    # not a backup: the run the next one resumes (formats/repository.md §4.5)
    killed = written[0].parent.name
    shown = upr("info", "--repo", str(repo)).stdout
    assert "bucket default: no backups" in shown, shown
    assert (
        f"incomplete (not a backup): {killed}, an interrupted run: the next `upr backup` "
        "resumes it" in " ".join(shown.split())
    ), shown
    (report,) = verify(repo)
    assert (report.backups, report.problems, report.resumable, report.leftovers) == (
        0, [], killed, [])  # fmt: skip

    # acknowledged after the killed run pinned its high seqs, before the rerun starts
    upr("load", node.uri, "--docs", "600", "--update-ratio", "0.5", "--delete-ratio", "0.2",
        "--seed", "7")  # fmt: skip
    upr("load", node.uri, "--docs", "100", "--seed", "8", "--prefix", "new")
    wait_persisted(node.uri)
    at_start = node_content_hash(node.uri)

    rerun = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json").stdout)
    assert rerun["reused_segments"] >= 1
    db = tmp_path / "rerun.db"
    upr("restore", "--repo", str(repo), "--at", rerun["backup_id"], f"sqlite:{db}")
    with Store(db) as s:
        assert (s.count(), s.content_hash()) == at_start
    assert upr("verify", "--repo", str(repo)).returncode == 0
