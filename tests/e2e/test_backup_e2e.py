"""upr backup end to end: full, incremental, a crash with lost writes, the chain state."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import (
    Replica,
    drain,
    node_content_hash,
    run,
    spawn_upr,
    wait_persisted,
)
from upr_cli.jobs.restore import partition_state
from upr_cli.jobs.state import select
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.repo import Repository, lost_ranges
from upr_cli.store import Store


def node_state(uri: str) -> dict[bytes, bytes]:
    rows, _e, _c = run(drain(uri))
    r = Replica()
    r.apply(rows, [])
    return r.state()


def repo_state(repo: Path, at: str = "latest") -> dict[bytes, bytes]:
    r = Repository(repo)
    manifests = r.manifests("default")
    out = {}
    sel = select(manifests, at)
    for p in sel.partitions:
        for rec in partition_state(r, "default", manifests, sel.backup_id, p).values():
            if rec.op == OP_MUTATION:
                out[bytes(rec.key)] = bytes(rec.value)
    return out


def test_backups_through_a_crash_keep_the_chain_and_the_lost_writes(
    node_factory: type[Node], tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    node = node_factory("--flush-interval", "0.02").start()
    upr("load", node.uri, "--docs", "1500", "--update-ratio", "0.2", "--delete-ratio", "0.1")
    wait_persisted(node.uri)
    first = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json").stdout)
    assert first["full"] and first["rollbacks"] == []
    at_first = node_state(node.uri)
    assert repo_state(repo) == at_first

    upr(
        "load",
        node.uri,
        "--docs",
        "600",
        "--update-ratio",
        "0.5",
        "--delete-ratio",
        "0.1",
        "--seed",
        "2",
        "--prefix",
        "inc",
    )
    second = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json").stdout)
    assert not second["full"] and second["items"] < 900
    assert repo_state(repo) == node_state(node.uri)
    assert repo_state(repo, "oldest") == at_first

    # writes the node never persists, seen by a third backup; then a crash loses them
    persisted = {p: h for p, (_u, h, _x) in wait_persisted(node.uri).items()}
    node.stop()
    node.start("--flush-interval", "3600")
    upr("load", node.uri, "--docs", "400", "--seed", "3", "--prefix", "lost")
    third = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json").stdout)
    assert third["items"] >= 400
    node.kill()
    node.start()
    fourth = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json").stdout)
    rolled = {rb["partition"]: rb for rb in fourth["rollbacks"]}
    assert {p: int(rb["to"]) for p, rb in rolled.items()} == persisted
    assert all(rb["seed_rule_seq"] == rb["producer_seq"] == rb["to"] for rb in rolled.values())
    assert repo_state(repo) == node_state(node.uri)
    db = tmp_path / "after-crash.db"  # and through `upr restore`, metadata included
    upr("restore", "--repo", str(repo), f"sqlite:{db}")
    with Store(db) as s:
        assert (s.count(), s.content_hash()) == node_content_hash(node.uri)
    # the lost writes stay addressable: the third backup's records above each cut
    r = Repository(repo)
    manifests = r.manifests("default")
    lost = [x for p in rolled for x in lost_ranges(manifests, p)]
    assert {str(x.backup_id) for x in lost} == {third["backup_id"]}
    assert all(x.from_seq == persisted[p] for p in rolled for x in lost_ranges(manifests, p))


# Kill points, as segments published before the SIGKILL (32 partitions, one segment
# each): right after the lock is taken, a seeded random point in the middle, and with
# every segment published but (most likely) no manifest yet.
_KILL_AT = [0, random.Random(4).randint(2, 28), 32]


@pytest.mark.parametrize("segments_before_kill", _KILL_AT)
def test_a_killed_backup_leaves_nothing_visible_and_a_rerun_equals_a_clean_run(
    node_factory: type[Node], tmp_path: Path, segments_before_kill: int
) -> None:
    node = node_factory("--flush-interval", "0.02", partitions=32).start()
    upr("load", node.uri, "--docs", "6000", "--size", "3000")
    wait_persisted(node.uri)
    repo = tmp_path / "repo"
    deadline = time.monotonic() + 60

    def reached() -> bool:
        if segments_before_kill == 0:
            return (repo / "default" / "lock").exists()
        return len(list(repo.glob("default/*/p*.seg"))) >= segments_before_kill

    with spawn_upr("backup", node.uri, "--repo", str(repo), "--no-progress",
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:  # fmt: skip
        while not reached() and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.002)
        finished = proc.poll() is not None
        if finished and segments_before_kill < 32:
            pytest.fail(f"the backup finished before {segments_before_kill} segments were seen")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    committed = list(repo.glob("default/*/manifest.json"))
    if not committed:  # killed before the commit: nothing visible, the run is incomplete
        info = json.loads(upr("info", "--repo", str(repo), "--json").stdout)
        assert info["buckets"][0]["backups"] == []
    assert upr("verify", "--repo", str(repo)).returncode == 0
    rerun = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json").stdout)
    if not committed and segments_before_kill > 0:
        assert rerun["reused_segments"] >= 1
    assert upr("verify", "--repo", str(repo)).returncode == 0
    assert repo_state(repo) == node_state(node.uri)
    clean = tmp_path / "clean"
    upr("backup", node.uri, "--repo", str(clean))
    assert repo_state(clean) == repo_state(repo)
    info = json.loads(upr("info", "--repo", str(repo), "--json").stdout)
    assert info["buckets"][0]["incomplete"] == []


def test_examine_shows_every_version_and_the_lost_writes(
    node_factory: type[Node], tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    node = node_factory("--flush-interval", "0.02").start()
    upr("load", node.uri, "--docs", "200", "--seed", "1")
    wait_persisted(node.uri)
    upr("backup", node.uri, "--repo", str(repo))
    node.stop()
    node.start("--flush-interval", "3600")
    upr("load", node.uri, "--docs", "200", "--seed", "2")  # rewrites doc-000000000..199
    upr("backup", node.uri, "--repo", str(repo))  # sees the updates, which are never persisted
    node.kill()
    node.start()
    upr("backup", node.uri, "--repo", str(repo))  # records the rollback
    rows = {}
    for key in ("doc-000000000", "doc-000000007", "doc-000000042"):
        out = json.loads(upr("examine", "--repo", str(repo), "--json", key).stdout)
        rows[key] = out["versions"]
    updated = [k for k, vs in rows.items() if len(vs) > 1]
    assert updated == list(rows), rows  # every one was rewritten
    for key in updated:
        vs = rows[key]
        assert vs[0]["lost"] is False and vs[0]["in_latest"] is True
        assert all(v["lost"] for v in vs[1:])  # the updates the crash took back
    text = upr("examine", "--repo", str(repo), updated[0])
    assert "lost write" in text.stdout and "latest" in text.stdout
    missing = upr("examine", "--repo", str(repo), "no-such-key", check=False)
    assert missing.returncode == 1


def test_rollback_point_between_a_node_and_a_repository(
    node_factory: type[Node], tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    node = node_factory("--flush-interval", "0.02").start()
    upr("load", node.uri, "--docs", "300")
    persisted = {p: h for p, (_u, h, _x) in wait_persisted(node.uri).items()}
    node.stop()
    node.start("--flush-interval", "3600")
    upr("load", node.uri, "--docs", "200", "--prefix", "lost")
    upr("backup", node.uri, "--repo", str(repo))  # the backup holds writes the node will lose
    node.kill()
    node.start()
    out = upr("rollback-point", "--server", node.uri, "--client", f"repo:{repo}", "--json")
    rows = {r["partition"]: r for r in json.loads(out.stdout)["partitions"]}
    assert {p: int(r["rollback_seq"]) for p, r in rows.items()} == persisted
    assert all(r["must_roll_back"] for r in rows.values())
    one = upr(
        "rollback-point", "--server", node.uri, "--client", f"repo:{repo}", "--partitions", "3"
    )
    assert "must roll back" in one.stdout
    bad = upr("rollback-point", "--server", node.uri, check=False)
    assert bad.returncode == 2 and "go together" in bad.stderr
