"""Point-in-time restore across a hard failover with lost writes (issue 31).

A follower backs up a two-node cluster. Replication into n1 is paused, so n0's
partitions run ahead of their copies; the follower commits those writes. n0 is killed
and failed over: n1's copies become active without them (lost writes), the follower
meets the rollback and records it. Then `restore --before-failover 1` gives the old
branch (the lost writes included) and `restore --at-time` after the failover the new
master's branch, key for key.
"""

from __future__ import annotations

import json
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

from tests.e2e.cluster_helpers import Cluster, Rows
from tests.e2e.conftest import upr
from tests.e2e.e2e_helpers import spawn_upr, store_rows
from tests.e2e.test_follow_e2e import _backups, _wait_for


def _caught_up(repo: Path, cl: Cluster) -> bool:
    """Every partition's newest committed end is its active's high seqno."""
    ends: dict[int, int] = {}
    for m in _backups(repo):
        for e in m.partitions:
            ends[e.partition] = e.end_seq
    spec = cl.spec
    highs: dict[int, int] = {}
    for name in {spec.nodes[row[0]].name for row in spec.vbmap}:
        seqs = cl.seqnos(name)
        for part, row in enumerate(spec.vbmap):
            if spec.nodes[row[0]].name == name:
                highs[part] = seqs[part][1]
    return bool(ends) and all(ends.get(p, 0) >= h for p, h in highs.items())


def _restored(repo: Path, db: Path, *how: str) -> Rows:
    upr("restore", "--repo", str(repo), *how, f"sqlite:{db}")
    return store_rows(db)


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def test_before_failover_gives_the_lost_branch_and_at_time_the_new_one(tmp_path: Path) -> None:
    cl = Cluster(tmp_path / "cl", nodes=2, replicas=1, partitions=4)
    repo = tmp_path / "repo"
    try:
        upr("load", cl.uri("n1"), "--docs", "300", "--seed", "1")
        cl.settle()
        with spawn_upr("backup", cl.uri("n1"), "--repo", str(repo), "--follow",
                       "--commit-every", "0.2s") as follower:  # fmt: skip
            _wait_for(lambda: bool(_backups(repo)), what="the catch-up")
            cl.cli("pause", "n1")  # n0's partitions run ahead of their copies on n1
            ahead_of_copies = [p for p, row in enumerate(cl.spec.vbmap) if row[0] == 0]
            upr("load", cl.uri("n1"), "--docs", "300", "--seed", "2", "--prefix", "ahead",
                "--update-ratio", "0.3")  # fmt: skip
            cl.flush("n0")
            _wait_for(lambda: _caught_up(repo, cl), what="the follower to take the writes")
            old_branch = cl.rows()
            time.sleep(0.3)
            cl.kill("n0")
            cl.cli("failover", "n0")
            upr("load", cl.uri("n1"), "--docs", "200", "--seed", "3", "--prefix", "after",
                "--update-ratio", "0.3")  # fmt: skip
            cl.flush("n1")
            _wait_for(lambda: _caught_up(repo, cl), timeout=60, what="the new branch")
            new_branch = cl.rows()
            after = _now()
            time.sleep(0.3)
            follower.send_signal(signal.SIGTERM)
            _out, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err
        info = json.loads(upr("info", "--repo", str(repo), "--json").stdout)
        # one event per commit that recorded rollbacks: the failed-over partitions can
        # reach the follower in two commits
        failovers = info["buckets"][0]["failovers"]
        assert [f["number"] for f in failovers] == list(range(1, len(failovers) + 1))
        moved = {p for f in failovers for p in f["partitions"]}
        assert failovers and moved <= set(ahead_of_copies), failovers
        lost = {k for k in old_branch if k not in new_branch or old_branch[k] != new_branch[k]}
        assert lost  # the failover took writes back
        assert _restored(repo, tmp_path / "before.db", "--before-failover", "1") == old_branch
        assert _restored(repo, tmp_path / "after.db", "--at-time", after) == new_branch
    finally:
        cl.stop()
