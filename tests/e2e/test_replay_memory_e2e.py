"""Replay keeps its memory bounded in bytes (issue 27, docs/design.md "Performance"):
documents of 5 MB of random (barely compressible) values, all in one partition of a
real node, replayed into a new store with the default --memory-limit. The replay
process's peak RSS (VmHWM in /proc/PID/status, read until it exits) stays under 300 MB,
its rows are committed in batches bounded in bytes, and every document arrives whole.

(Not the child's rusage: Linux carries the parent's peak RSS into a child's ru_maxrss
across fork and exec, and this test's process holds every value.)"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.e2e.conftest import Node
from tests.e2e.e2e_helpers import run, set_keys, spawn, wait_persisted
from tests.e2e.memory_helpers import large_values, vm_hwm_mb

DOCS, SIZE = 20, 5 * 1024 * 1024
LIMIT_MB = 300
BATCH_MB = 192 / 8  # the rows a replay holds for commit with the default limit


def peak_rss_mb(*args: str) -> tuple[float, dict[str, object]]:
    """(peak RSS in MB, the --json summary) of one `upr ARGS` process."""
    env = dict(os.environ)
    env.pop("UPR_PASSWORD", None)
    peak = 0.0
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with spawn(sys.executable, "-m", "upr_cli", *args, "--json", "--no-progress",
                   stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env) as proc:  # fmt: skip
            while proc.poll() is None:
                peak = max(peak, vm_hwm_mb(proc.pid))  # VmHWM only rises: the last is the peak
                time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        assert proc.returncode == 0, err.read().decode(errors="replace")
        return peak, json.loads(out.read())


def test_replay_of_large_documents_stays_under_300_mb(node_factory: Callable[..., Node],
                                                       tmp_path: Path) -> None:  # fmt: skip
    src = node_factory("--flush-interval", "0.02", partitions=1).start()
    values = large_values(DOCS, SIZE)
    sizes = {k: len(v) for k, v in values.items()}
    run(set_keys(src.uri, values))
    del values
    wait_persisted(src.uri, timeout=60)
    db = tmp_path / "r.db"
    peak, summary = peak_rss_mb("replay", src.uri, "--into", str(db))
    assert summary["applied"] == DOCS
    print(f"replay: peak RSS {peak:.0f} MB, {summary['commits']} commits")
    assert isinstance(summary["commits"], int)
    # each transaction took at most about two shares of rows (one held past a share)
    assert summary["commits"] > DOCS * SIZE / (2 * BATCH_MB * 1024 * 1024), "batches unbounded"
    with sqlite3.connect(db) as conn:
        held = dict(conn.execute("SELECT CAST(key AS TEXT), length(value) FROM documents"))
    assert held == {k.decode(): n for k, n in sizes.items()}
    assert peak < LIMIT_MB, f"replay of {DOCS} documents of 5 MB peaked at {peak:.0f} MB"
