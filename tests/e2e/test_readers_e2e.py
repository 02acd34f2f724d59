"""A backup runs alongside a repository's readers (formats/repository.md §7.2): it is not
blocked by them, and it leaves the sweep of leftovers to a run with no reader present."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import spawn
from upr_cli.repo import Repository
from upr_cli.repo.readers import live_readers

READER = """
import sys
from upr_cli.repo import Repository
from upr_cli.repo.readers import ReadLock
with ReadLock(Repository(sys.argv[1]), "default", command="restore"):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_backup_is_not_blocked_by_a_reader(node_factory: type[Node], tmp_path: Path) -> None:
    node = node_factory(partitions=4).start()
    upr("load", node.uri, "--docs", "200")
    repo = tmp_path / "repo"
    upr("backup", node.uri, "--repo", str(repo), "--no-progress")
    leftover = repo / "default" / ".manifest.json.tmp-0a1b2c3d"  # an interrupted write's
    leftover.write_bytes(b"x")
    with spawn(sys.executable, "-c", READER, str(repo), stdin=subprocess.PIPE,
               stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        got = upr("backup", node.uri, "--repo", str(repo), "--no-progress", "--json",
                  timeout=60)  # fmt: skip
        assert time.monotonic() - t0 < 30
        summary = json.loads(got.stdout)
        assert summary["full"] is False and summary["items"] == 0  # committed, nothing new
        assert [r.pid for r in live_readers(Repository(repo), "default")] == [proc.pid]
        assert leftover.exists()  # the sweep waits for a run with no reader
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
    upr("backup", node.uri, "--repo", str(repo), "--no-progress")
    assert not leftover.exists()
    assert sorted(p.name for p in (repo / "default").iterdir() if not p.name[0].isdigit()) == []
