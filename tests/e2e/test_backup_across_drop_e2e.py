"""A backup that runs while a collection is dropped and created again under its name
restores exactly the final state (issue 18).

The backup is held (SIGSTOP) once its first segment is being written, so the drop and
the re-create come while its streams are open: partitions it finished hold the first
incarnation's documents, the others stream on without them (the source no longer sends
a dropped collection's documents). The outcome must not depend on that: the first
incarnation's documents are gone, the second one's are there, and the other
collections are untouched. A second, incremental backup takes what came after the
first one's end; the restore of the chain into a node with another partition count
equals the source, document for document.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.collections_helpers import create, drop
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import run, spawn, wait_persisted
from tests.e2e.test_restore_collections_e2e import _set_raw, live_docs


def test_a_backup_across_a_drop_and_re_create_restores_the_final_state(
    node_factory: type[Node], tmp_path: Path
) -> None:
    src = node_factory("--flush-interval", "0.02", "--create-collections", "app.users,app.orders",
                       partitions=16, name="src").start()  # fmt: skip
    upr("load", src.uri, "--docs", "40000", "--collections", "app.users,app.orders",
        "--update-ratio", "0.2", "--delete-ratio", "0.1")  # fmt: skip
    upr("load", src.uri, "--docs", "2000", "--prefix", "plain", "--update-ratio", "0.3")
    wait_persisted(src.uri)
    repo = tmp_path / "repo"
    cmd = [sys.executable, "-m", "upr_cli", "backup", src.uri, "--repo", str(repo),
           "--no-progress"]  # fmt: skip
    with spawn(*cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as backup:
        deadline = time.monotonic() + 30
        while not _writing(repo) and time.monotonic() < deadline:
            time.sleep(0.002)  # the first segment is being written: the streams are open
        # hold the backup mid-run (its streams open, its end seqs pinned) while the
        # collection is dropped and created again and more is written
        backup.send_signal(signal.SIGSTOP)
        try:
            drop(src.uri, "app.users")
            create(src.uri, "app.users")
            for i in range(50):
                run(_set_raw(src.uri, "app.users", b"reborn-%d" % i, b'{"n":%d}' % i, i, 0))
                run(_set_raw(src.uri, "app.orders", b"order-late-%d" % i, b"{}", 0, 0))
        finally:
            backup.send_signal(signal.SIGCONT)
        _out, err = backup.communicate(timeout=120)
        assert backup.returncode == 0, err
    wait_persisted(src.uri)
    upr("backup", src.uri, "--repo", str(repo))  # what came after the first one's end
    upr("verify", "--repo", str(repo))
    want = live_docs(src.uri, 16)
    users = sorted(k for p, k in want if p == "app.users")
    assert users == sorted(b"reborn-%d" % i for i in range(50))  # the old ones are gone
    assert sum(1 for p, _k in want if p == "app.orders") > 5000
    dst = node_factory("--flush-interval", "0.02", partitions=32, name="dst").start()
    upr("restore", "--repo", str(repo), dst.uri)
    assert live_docs(dst.uri, 32) == want


def _writing(repo: Path) -> bool:
    """Whether a segment is being written in `repo` (a directory the backup removes or
    renames while it is walked reads as not yet)."""
    try:
        return any(repo.rglob("*.seg*"))
    except FileNotFoundError:
        return False
