"""A backup running through a hard failover completes (issue 7, "Every tool follows the map").

Staged deterministically: replication into n1 is paused so n0's partitions run ahead of
their replicas; the backup streams n0's partitions, and once it has taken records from
n0 (its progress callback, on the event loop, so nothing more is read meanwhile) n0 is
SIGKILLed and failed over. The consumer moves to n1, whose new failover entry lies below
what was streamed: ROLLBACK. The run cuts the open segments back (the rollback is above
where the run began) or starts the partitions again (below it), completes, and the
chain restores to exactly the new actives' state.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

from tests.e2e.cluster_helpers import Cluster
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import store_rows
from upr_cli.jobs.backup import BackupSummary, backup
from upr_cli.jobs.backup_stream import StreamStats
from upr_cli.net.uri import SourceUri


def _backup_through_failover(
    cl: Cluster, repo: Path, parts: list[int], *, after_end: bool = False
) -> BackupSummary:
    """One backup of `parts` (active on n0), failing n0 over once records have arrived
    (or, `after_end`, once a partition's stream has ended)."""
    fired: list[StreamStats] = []

    def hook(stats: StreamStats) -> None:
        if fired or not stats.items or (after_end and not stats.partitions_done):
            return
        fired.append(StreamStats(stats.items, stats.bytes_in, stats.partitions_done))
        pid = cl.spec.node("n0").pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        cl.cli("failover", "n0")

    summary = asyncio.run(
        backup(SourceUri.parse(cl.uri("n1")), repo, partitions=parts, on_progress=hook)
    )
    assert fired and (fired[0].partitions_done > 0) == after_end, fired
    return summary


def _restored_equals_cluster(cl: Cluster, repo: Path, tmp: Path, parts: list[int]) -> None:
    upr("verify", "--repo", str(repo))
    db = tmp / "restored.db"
    upr("restore", "--repo", str(repo), f"sqlite:{db}")
    final = {k: v for k, v in cl.rows().items() if k[0] in parts}
    got = {k: v for k, v in store_rows(db).items() if k[0] in parts}
    assert final and got == final


def _cut_records_are_lost_writes(cl: Cluster, repo: Path, rollbacks: list[dict[str, Any]]) -> None:
    """What the run took back is kept (cut-back segments) and salvage offers it."""
    cut = {rb["partition"]: rb for rb in rollbacks if rb["cut_records"]}
    assert cut, rollbacks
    out = upr("salvage", "--repo", str(repo), "--into", cl.uri("n1"), "--json", check=False)
    assert out.returncode in (0, 1), out.stderr
    mine = [it for it in json.loads(out.stdout)["writes"] if "cut back mid-run" in it["origin"]]
    assert {it["partition"] for it in mine} == set(cut)
    # lost above the source's rollback seq; the stream went on from a boundary at or below
    assert all(int(cut[it["partition"]]["to"]) <= int(it["cut"])
               == int(cut[it["partition"]]["producer_seq"]) < int(it["lost_version"]["seq"])
               for it in mine)  # fmt: skip
    ahead = [it for it in mine if it["key"].startswith("ahead-")]  # never on n1
    assert ahead
    out = upr("examine", "--repo", str(repo), "--json", ahead[0]["key"])
    versions = json.loads(out.stdout)["versions"]
    assert [(int(v["seq"]), v["lost"], v["in_latest"]) for v in versions] == [
        (int(ahead[0]["lost_version"]["seq"]), True, False)
    ]


def _prepare(tmp: Path) -> tuple[Cluster, list[int]]:
    cl = Cluster(tmp / "cl", nodes=2, replicas=1, partitions=4)
    upr("load", cl.uri("n1"), "--docs", "400", "--seed", "1")
    cl.settle()
    cl.cli("pause", "n1")  # n0's partitions now run ahead of their copies on n1
    parts = [p for p, row in enumerate(cl.spec.vbmap) if row[0] == 0]
    assert parts
    return cl, parts


def test_a_backup_through_a_hard_failover_cuts_its_segments_back(tmp_path: Path) -> None:
    """The rollback is above where the run began (a full backup: 0): the records it took
    above the rollback seq are dropped from the open segments, the rest kept."""
    cl, parts = _prepare(tmp_path)
    try:
        upr("load", cl.uri("n1"), "--docs", "30000", "--seed", "2", "--prefix", "ahead")
        repo = tmp_path / "repo"
        summary = _backup_through_failover(cl, repo, parts)
        during = [rb for rb in summary.to_json()["rollbacks"] if rb["during_run"]]
        assert during and all(int(rb["from"]) > int(rb["to"]) for rb in during), summary
        assert {rb["partition"] for rb in during} <= set(parts)
        man = json.loads(next(repo.glob("*/*/manifest.json")).read_text())
        assert all(e["rollback"] is None for e in man["partitions"])  # nothing before it
        _restored_equals_cluster(cl, repo, tmp_path, parts)
        _cut_records_are_lost_writes(cl, repo, during)
    finally:
        cl.stop()


def test_a_backup_through_a_hard_failover_below_its_start_starts_again(tmp_path: Path) -> None:
    """The rollback is below where the run began (the previous backup already held
    records the failover took back): the partition starts again at the rollback seq and
    the manifest records the rollback, so the earlier records become lost writes."""
    cl, parts = _prepare(tmp_path)
    try:
        repo = tmp_path / "repo"
        upr("load", cl.uri("n1"), "--docs", "2000", "--seed", "3", "--prefix", "first")
        upr("backup", cl.uri("n1"), "--repo", str(repo), "--no-progress")
        upr("load", cl.uri("n1"), "--docs", "30000", "--seed", "4", "--prefix", "ahead")
        summary = _backup_through_failover(cl, repo, parts)
        recorded = {rb["partition"]: rb for rb in summary.to_json()["rollbacks"]}
        assert set(recorded) == set(parts), summary
        assert all(int(rb["from"]) > int(rb["to"]) for rb in recorded.values())
        _restored_equals_cluster(cl, repo, tmp_path, parts)
        # the first backup's records above the cut are the failover's lost writes
        out = upr("salvage", "--repo", str(repo), "--into", cl.uri("n1"), "--json", check=False)
        assert out.returncode == 1, out.stderr  # a dry run with writes that could go back
        items = json.loads(out.stdout)["writes"]
        assert items and all(
            it["outcome"] == "would-write" and it["origin"].startswith("backup ")
            and int(recorded[it["partition"]]["to"]) <= int(it["cut"])
            == int(recorded[it["partition"]]["producer_seq"]) < int(it["lost_version"]["seq"])
            for it in items
        )  # fmt: skip
    finally:
        cl.stop()


def test_a_failover_after_a_partition_ended_gets_a_follow_up_backup(tmp_path: Path) -> None:
    """n0 fails over after the stream of its partition ended in this run: the run
    commits, finds that the new active's history no longer holds that end, and commits a
    follow-up backup recording the rollback; the newest state is the new active's, and
    the records the failover took back are lost writes of the first backup."""
    cl, parts = _prepare(tmp_path)
    try:
        upr("load", cl.uri("n1"), "--docs", "3000", "--seed", "5", "--prefix", "ahead")
        repo = tmp_path / "repo"
        summary = _backup_through_failover(cl, repo, parts[:1], after_end=True)
        assert len(summary.follow_ups) == 1, summary
        recorded = [rb for rb in summary.to_json()["rollbacks"] if rb["partition"] == parts[0]]
        assert recorded and int(recorded[0]["from"]) > int(recorded[0]["to"]), summary
        _restored_equals_cluster(cl, repo, tmp_path, parts[:1])
        out = upr("salvage", "--repo", str(repo), "--into", cl.uri("n1"), "--json", check=False)
        items = json.loads(out.stdout)["writes"]
        assert items and all(it["origin"] == f"backup {summary.backup_id}" for it in items)
    finally:
        cl.stop()


def test_a_source_gone_after_the_commit_leaves_the_backup_committed(
    node_factory: type[Node], tmp_path: Path
) -> None:
    """The check after the commit cannot reach the source (it died once the streams
    ended): the backup stands, with a warning; the next run checks again."""
    node = node_factory("--flush-interval", "0.02", partitions=8).start()
    upr("load", node.uri, "--docs", "500")

    def hook(stats: StreamStats) -> None:
        if stats.partitions_done == stats.partitions and node.alive():
            node.kill()

    repo = tmp_path / "repo"
    summary = asyncio.run(backup(SourceUri.parse(node.uri), repo, on_progress=hook))
    assert summary.items == 500 and not summary.follow_ups
    assert any("checking it against the source afterwards failed" in w for w in summary.warnings)
    assert upr("verify", "--repo", str(repo)).returncode == 0
