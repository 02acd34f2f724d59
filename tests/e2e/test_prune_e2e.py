"""A prune applied while a restore into a node reads the same backups
(formats/repository.md §7.2): with --wait 0 it refuses at once, naming the restore;
with --wait it waits for the restore, naming it, and goes on once the restore is done.
The restore completes exactly (the target node holds the source's state at the backup
restored), and the backup the prune kept restores the same afterwards.

The restore is held at a known point while the prunes start: once it holds the bucket's
shared lock it is stopped (SIGSTOP) and continued (SIGCONT) when both prunes have shown
what they do, so that the overlap does not depend on how fast the machine is.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import docs, store_rows, wait_persisted
from upr_cli.repo import Repository

BUCKET = "default"


def _shared_lock_held(repo: Path) -> bool:
    """A reader holds `lock.shared` (an exclusive flock on it is refused)."""
    try:
        fd = os.open(repo / BUCKET / "lock.shared", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # drops the flock when it was taken
    return False


def _until(cond: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not callable(cond) or not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_prune_waits_for_a_restore_that_reads_its_backups(
    node_factory: type[Node], spawned: Callable[..., subprocess.Popen[Any]], tmp_path: Path
) -> None:
    src = node_factory("--flush-interval", "0.02", name="src", partitions=8).start()
    dst = node_factory("--flush-interval", "0.02", name="dst", partitions=8).start()
    repo = tmp_path / "repo"
    # three backups: a load, then updates and deletes twice
    loads = [
        ["--docs", "4000", "--size", "512"],
        ["--docs", "1500", "--update-ratio", "0.6", "--delete-ratio", "0.2", "--seed", "2"],
        ["--docs", "1500", "--update-ratio", "0.5", "--delete-ratio", "0.3", "--seed", "3"],
    ]
    for load in loads:
        upr("load", src.uri, *load)
        wait_persisted(src.uri)
        upr("backup", src.uri, "--repo", str(repo), "--no-progress")
    ids = [str(b) for b in Repository(repo).committed(BUCKET)]
    assert len(ids) == 3
    kept = ids[-1]  # --keep-last 1 keeps it, and merges the other two into it
    want = docs(src.uri)  # the source has not changed since that backup
    before = tmp_path / "before.db"
    upr("restore", "--repo", str(repo), "--at", kept, f"sqlite:{before}")

    upr_cmd = [sys.executable, "-m", "upr_cli"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    rp = spawned(*upr_cmd, "restore", "--repo", str(repo), "--at", kept, "--json",
                 "--no-progress", dst.uri, **pipes)  # fmt: skip
    _until(lambda: _shared_lock_held(repo) or rp.poll() is not None, "the restore's lock")
    rp.send_signal(signal.SIGSTOP)  # holding the shared lock, mid-restore
    prune_args = ["prune", "--repo", str(repo), "--keep-last", "1", "--apply"]
    try:
        assert rp.poll() is None, "the restore ended before the prune could start"
        refused = upr(*prune_args, "--wait", "0", check=False)
        assert refused.returncode == 1, refused.stderr
        (line,) = refused.stderr.strip().splitlines()
        assert f"restore (pid {rp.pid} " in line and "--wait SECONDS" in line, line
        assert [str(b) for b in Repository(repo).committed(BUCKET)] == ids

        pruning = spawned(*upr_cmd, *prune_args, "--wait", "120", "--json", **pipes)
        waiting = pruning.stderr.readline()
        assert waiting.startswith("upr: default: waiting up to 120s for 1 reader: "), waiting
        assert f"restore (pid {rp.pid} " in waiting, waiting
        time.sleep(0.3)
        assert pruning.poll() is None  # still waiting for the restore
        assert [str(b) for b in Repository(repo).committed(BUCKET)] == ids
    finally:
        rp.send_signal(signal.SIGCONT)
    out, err = rp.communicate(timeout=60)
    assert rp.returncode == 0, err
    assert json.loads(out)["errors"] == 0
    # the restore completed exactly; then the prune went on
    assert docs(dst.uri) == want
    prune_out, prune_err = pruning.communicate(timeout=60)
    assert pruning.returncode == 0, prune_err
    plan = json.loads(prune_out)["buckets"][0]
    assert (plan["kept"], plan["backups_removed"]) == (1, 2)
    assert [str(b) for b in Repository(repo).committed(BUCKET)] == [kept]
    after = tmp_path / "after.db"
    upr("restore", "--repo", str(repo), "--at", kept, f"sqlite:{after}")
    assert store_rows(after) == store_rows(before)
    upr("verify", "--repo", str(repo))
