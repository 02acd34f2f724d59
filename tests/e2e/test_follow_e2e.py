"""`upr backup --follow` against `upr serve` (issue 31, "Continuous backup").

A follower commits restore points while a workload updates and deletes; readers and
`upr prune` run between its commits (it holds the lock only while it commits); SIGTERM
commits what it holds and exits 0; SIGKILL at seeded random moments loses only the
uncommitted tail, which the next run takes again: the repository verifies and restores
to exactly the node's state.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import node_rows, spawn_upr, store_rows, wait_persisted
from upr_cli.errors import UprError
from upr_cli.repo import Repository
from upr_cli.repo.pitr import timeline

COMMIT = "0.2s"


def _commits(repo: Path) -> list[Any]:
    """The continuous commits of the repository, oldest first."""
    return [m for m in _backups(repo) if m.continuous is not None]


def _backups(repo: Path) -> list[Any]:
    """Every committed backup (the catch-up one first), or none yet."""
    try:
        return Repository(repo).manifests("default")
    except (UprError, OSError):  # not created yet, or a commit being written: asked again
        return []


def _catch_ups(repo: Path) -> int:
    """The ordinary backups of the chain: one per session's catch-up."""
    return sum(1 for m in _backups(repo) if m.continuous is None)


def _session_committed(repo: Path, sessions_before: int) -> bool:
    """This session caught up (one more ordinary backup) and committed since."""
    chain = _backups(repo)
    catch_ups = sum(1 for m in chain if m.continuous is None)
    return catch_ups > sessions_before and chain[-1].continuous is not None


def _session_or_end(repo: Path, sessions_before: int, proc: subprocess.Popen[str]) -> bool:
    return _session_committed(repo, sessions_before) or proc.poll() is not None


def _wait_for(pred: Any, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _load(node: Node, docs: int, seed: int, rate: int = 0) -> list[str]:
    """`upr load` with updates and deletes (the command, for `spawn_upr` or `upr`)."""
    args = ["load", node.uri, "--docs", str(docs), "--update-ratio", "0.4",
            "--delete-ratio", "0.15", "--seed", str(seed), "--size", "200"]  # fmt: skip
    return args + (["--rate", str(rate)] if rate else [])


def _caught_up(repo: Path, node: Node) -> bool:
    """Every partition's newest committed end is the node's high seqno."""
    manifests = _backups(repo)
    ends: dict[int, int] = {}
    for m in manifests:
        for e in m.partitions:
            ends[e.partition] = e.end_seq
    highs = wait_persisted(node.uri)
    return all(ends.get(p, 0) >= high for p, (_uuid, high, _persisted) in highs.items())


def _restored_equals_node(repo: Path, node: Node, tmp: Path, name: str) -> None:
    upr("verify", "--repo", str(repo))
    db = tmp / f"{name}.db"
    upr("restore", "--repo", str(repo), f"sqlite:{db}")
    assert store_rows(db) == node_rows(node.uri)


def test_a_follower_commits_as_it_goes_lets_others_in_and_stops_on_sigterm(
    node: Node, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    upr(*_load(node, 800, 1))
    with spawn_upr("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every",
                   COMMIT, "--json") as follower:  # fmt: skip
        _wait_for(lambda: bool(_backups(repo)) or follower.poll() is not None, what="catch-up")
        upr(*_load(node, 600, 2))
        _wait_for(lambda: _caught_up(repo, node), what="the follower to catch up")
        # between commits the lock is free: a reader and a writer get in
        upr("verify", "--repo", str(repo))
        upr("prune", "--repo", str(repo), "--keep-last", "1000", "--apply")
        assert follower.poll() is None
        follower.send_signal(signal.SIGTERM)
        out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    summary = json.loads(out)
    assert summary["commits"] >= 2 and summary["last_commit"] == str(_commits(repo)[-1].backup_id)
    commits = _commits(repo)
    # each commit watched from where the one before ended: no gap inside a session
    assert all(b.continuous == a.finished for a, b in pairwise(commits))
    assert all(e.end_seq == e.snap_end for m in commits for e in m.partitions)
    _restored_equals_node(repo, node, tmp_path, "final")


def test_sigkill_at_seeded_moments_loses_nothing_and_the_outage_is_coarse(
    node: Node, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    rng = random.Random(31)
    upr(*_load(node, 500, 3))
    with spawn_upr(*_load(node, 4000, 4, rate=800), stdout=subprocess.DEVNULL) as writer:
        for _kill in range(2):
            with spawn_upr("backup", node.uri, "--repo", str(repo), "--follow",
                           "--commit-every", COMMIT) as follower:  # fmt: skip
                _wait_for(functools.partial(_session_or_end, repo, _kill, follower),
                          what="a catch-up and a commit")  # fmt: skip
                time.sleep(rng.uniform(0.1, 1.5))
                assert follower.poll() is None, follower.communicate()
                follower.send_signal(signal.SIGKILL)
                follower.wait(timeout=30)
        writer.wait(timeout=120)
        assert writer.returncode == 0
    with spawn_upr("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every",
                   COMMIT) as follower:  # fmt: skip
        # its own catch-up first (the repository may already hold every write): by then
        # it takes SIGINT as a follower does
        _wait_for(lambda: _catch_ups(repo) > 2 and _caught_up(repo, node), what="catch-up")
        follower.send_signal(signal.SIGINT)
        _out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    # three sessions: two outages where the follower was down, each a coarse stretch of
    # the restorable range (a restarted follower rolls the session before into one
    # backup, so the commits alone no longer show each gap)
    assert _catch_ups(repo) == 3
    tl = timeline(_backups(repo))
    assert tl is not None and len(tl.coarse) >= 2, tl
    _restored_equals_node(repo, node, tmp_path, "after-kills")


def test_a_rollup_keeps_every_record_and_restore_point(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """jobs/rollup.py on a follower's commits: one revision of the newest absorbs the
    rest, one segment a partition, every point kept; the state is the same. Past a
    small limit the merged segments are local files rather than held bytes: both go
    into the pack."""
    from upr_cli.jobs import rollup
    from upr_cli.jobs.rollup import (
        Tail,
        absorbed_dirs,
        prepare,
        publish,
        remove_absorbed,
        stage,
    )
    from upr_cli.repo import Manifest, RepositoryLock

    monkeypatch.setattr(rollup, "_HELD", 2000)

    repo = tmp_path / "repo"
    upr(*_load(node, 300, 5))
    with spawn_upr("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every",
                   "0.1s") as follower:  # fmt: skip
        _wait_for(lambda: bool(_backups(repo)), what="catch-up")
        for seed in (6, 7, 8, 9):
            upr(*_load(node, 150, seed))
            time.sleep(0.3)
        _wait_for(lambda: _caught_up(repo, node), what="the follower to catch up")
        follower.send_signal(signal.SIGTERM)
        follower.communicate(timeout=60)
    before = tmp_path / "before.db"
    upr("restore", "--repo", str(repo), f"sqlite:{before}")
    tail = Tail()
    for m in _commits(repo):
        tail.add(m)
    ids = [link.backup_id for link, _level in tail.items]
    group = [m for m in _commits(repo) if m.backup_id in ids and m.partitions][-4:]
    assert len(group) == 4 and all(m.continuous for m in group)
    # consecutive commits only: the ones between them carry nothing and go along
    ids = [m.backup_id for m in _commits(repo)]
    group = _commits(repo)[ids.index(group[0].backup_id) : ids.index(group[-1].backup_id) + 1]
    r = Repository(repo)
    prepared = prepare(r, group)
    kinds = {type(data) for _name, data in prepared.members}
    assert kinds == {bytes, type(tmp_path)} or len(prepared.members) < 2, kinds
    ids_before = [m.backup_id for m in _backups(repo)]
    stage(r, prepared)  # the pack written ahead, no lock: no reader sees it yet
    assert prepared.staged is not None and (prepared.staged / "segments.pack").exists()
    assert [m.backup_id for m in _backups(repo)] == ids_before
    assert _backups(repo)[-len(group)].revision == group[0].revision
    # a follower remembers what it committed: its publication parses no manifest (it
    # holds the lock), and forgets the members it absorbed
    store = r.manifest_store
    store.forget("default")
    for m in group:
        store.remember(m)
    parsed: list[int] = []
    real_loads = Manifest.loads

    def counted(data: bytes) -> Manifest:
        parsed.append(len(data))
        return real_loads(data)

    monkeypatch.setattr(Manifest, "loads", counted)
    try:
        with RepositoryLock(r, "default") as lock:
            assert publish(r, prepared, lock)
            assert remove_absorbed(r, "default", absorbed_dirs(r, group)) == []
    finally:
        prepared.discard()
    monkeypatch.undo()
    assert parsed == [] and not store._parsed
    assert {b for _bucket, b in store._written} & {m.backup_id for m in group} == {
        group[-1].backup_id
    }
    rolled = Repository(repo).read_manifest("default", group[-1].backup_id)
    assert rolled.revision == 2 and set(rolled.absorbed) == {m.backup_id for m in group[:-1]}
    assert rolled.continuous == group[0].continuous and rolled.finished == group[-1].finished
    for e in rolled.partitions:  # one segment, every point of the commits it absorbed
        assert len(e.segments) <= 1
        want = [pt for m in group if (g := m.partition(e.partition)) for pt in g.points]
        assert list(e.points) == want
    assert {m.backup_id for m in _backups(repo)}.isdisjoint(rolled.absorbed)
    after = tmp_path / "after.db"
    upr("verify", "--repo", str(repo))
    upr("restore", "--repo", str(repo), f"sqlite:{after}")
    assert store_rows(after) == store_rows(before) == node_rows(node.uri)


def _follow_batches(node: Node, repo: Path, env: dict[str, str], seeds: range,
                    then: Any = None) -> tuple[str, str]:  # fmt: skip
    """A follower (commits every 50 ms, `env` added) through a batch of writes per seed,
    caught up (and `then` true), stopped by SIGTERM: its stdout and stderr."""
    with spawn_upr("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every",
                   "0.05s", "--json", env={**os.environ, **env}) as follower:  # fmt: skip
        _wait_for(lambda: bool(_backups(repo)), what="catch-up")
        for seed in seeds:
            upr(*_load(node, 40, seed))
            time.sleep(0.15)
        _wait_for(lambda: _caught_up(repo, node), what="the follower to catch up")
        if then is not None:
            _wait_for(then, timeout=60, what="the rollups")
        follower.send_signal(signal.SIGTERM)
        out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    return out, err


def test_the_follower_rolls_its_commits_up_level_by_level(node: Node, tmp_path: Path) -> None:
    """The follower's own rollups (UPR_ROLLUP_FANOUT=2): each is said on stderr and
    counted in the summary, a rollup of rollups happens, and the chain restores to the
    node's state."""
    repo = tmp_path / "repo"
    upr(*_load(node, 200, 21))
    out, err = _follow_batches(node, repo, {"UPR_ROLLUP_FANOUT": "2"}, range(22, 30),
                               lambda: any(m.revision >= 3 for m in _backups(repo)))  # fmt: skip
    summary = json.loads(out)
    said = [line for line in err.splitlines() if line.startswith("upr: rolled up 2 backups")]
    assert summary["rollups"] >= 2 and len(said) >= summary["rollups"], err
    assert "warning:" not in err and not summary["warnings"], err
    _restored_equals_node(repo, node, tmp_path, "rolled")


def test_a_rollup_that_would_outgrow_its_manifest_is_left_out(node: Node, tmp_path: Path) -> None:
    """A rollup whose manifest would outgrow UPR_ROLLUP_MANIFEST_BYTES (the readers'
    limit, halved, by default) is not made: said once per group, the commits stay as
    they are, the tail goes on after them and the chain restores to the node's state."""
    repo = tmp_path / "repo"
    upr(*_load(node, 200, 41))
    env = {"UPR_ROLLUP_FANOUT": "2", "UPR_ROLLUP_MANIFEST_BYTES": "1024"}
    out, err = _follow_batches(node, repo, env, range(42, 47))
    left = [line for line in err.splitlines() if "left out: its manifest would outgrow" in line]
    assert len(left) >= 2 and json.loads(out)["rollups"] == 0, err
    assert "warning:" not in err, err
    assert all(m.revision == 1 for m in _backups(repo))
    _restored_equals_node(repo, node, tmp_path, "left")


def test_a_restarted_follower_rolls_up_what_the_last_session_left(
    node: Node, tmp_path: Path
) -> None:
    """A session's tail that no rollup took (fewer than the fanout) would stay in the
    chain for good: the next session rolls it into one backup as it starts."""
    from upr_cli.jobs.rollup import leftover

    repo = tmp_path / "repo"
    env = {**os.environ, "UPR_ROLLUP_FANOUT": "16"}  # no rollup in the first session
    args = ("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every", "0.05s")
    upr(*_load(node, 100, 31))
    with spawn_upr(*args, env=env) as follower:
        _wait_for(lambda: bool(_backups(repo)), what="catch-up")
        for seed in range(32, 36):  # a commit after each: a tail of at least four
            before = len(_commits(repo))
            upr(*_load(node, 30, seed))
            _wait_for(lambda n=before: len(_commits(repo)) > n, what="a commit")
        _wait_for(lambda: _caught_up(repo, node), what="the follower to catch up")
        follower.send_signal(signal.SIGTERM)
        follower.communicate(timeout=60)
    first = _commits(repo)
    assert 2 <= len(first) < 16
    upr(*_load(node, 30, 36))
    with spawn_upr(*args, env=env) as follower:
        _wait_for(lambda: _catch_ups(repo) == 2, what="the second catch-up")
        left = leftover(Repository(repo).manifests("default")[: len(first) + 2])
        assert [m.backup_id for m in left] == [m.backup_id for m in first]
        # the rolled revision there (an empty list is a chain read mid-write)
        _wait_for(lambda: any(m.backup_id == first[-1].backup_id and m.revision > 1
                              for m in _backups(repo)), what="the leftover rollup")  # fmt: skip
        follower.send_signal(signal.SIGTERM)
        _out, err = follower.communicate(timeout=60)
    assert f"rolled up {len(first)} backups into {first[-1].backup_id}" in err, err
    chain = _backups(repo)
    rolled = next(m for m in chain if m.backup_id == first[-1].backup_id)
    assert set(rolled.absorbed) == {m.backup_id for m in first[:-1]}
    assert chain[1] is not None and chain[1].backup_id == rolled.backup_id
    _restored_equals_node(repo, node, tmp_path, "restarted")


def test_a_killed_follower_leaves_no_worker_and_its_files_are_swept(
    node: Node, tmp_path: Path
) -> None:
    """SIGKILL of a follower with a rollup worker: the worker ends itself, and the next
    follower removes the work directories both left in the temporary directory."""
    repo, tmp = tmp_path / "repo", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "UPR_ROLLUP_FANOUT": "2", "TMPDIR": str(tmp)}
    args = ("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every", "0.05s")
    with spawn_upr(*args, env=env) as follower:
        _wait_for(lambda: bool(_backups(repo)), what="catch-up")
        for seed in range(41, 45):
            upr(*_load(node, 30, seed))
            time.sleep(0.2)
        _wait_for(lambda: any(m.revision >= 2 for m in _backups(repo)), what="a rollup")
        children = Path(f"/proc/{follower.pid}/task/{follower.pid}/children")
        workers = [int(p) for p in children.read_text().split()]
        assert workers
        killed = [follower.pid, *workers]
        follower.send_signal(signal.SIGKILL)
        follower.communicate(timeout=30)
    _wait_for(lambda: not any(Path(f"/proc/{w}").exists() for w in workers), timeout=15,
              what="the orphaned rollup worker to end")  # fmt: skip
    assert any(d.name.startswith(f"upr-follow-{killed[0]}-") for d in tmp.glob("upr-*"))
    with spawn_upr(*args, env=env) as follower:
        _wait_for(lambda: _catch_ups(repo) == 2, what="the second catch-up")
        assert not [d for d in tmp.glob("upr-*") if int(d.name.split("-")[2]) in killed]
        follower.send_signal(signal.SIGTERM)
        follower.communicate(timeout=60)
    _restored_equals_node(repo, node, tmp_path, "after-kill")


def test_the_rollup_tail_rolls_the_oldest_run_first() -> None:
    """Commits that arrive while a rollup works are not stranded between rollups."""
    from datetime import UTC, datetime, timedelta

    from upr_cli.jobs.rollup import Link, Tail
    from upr_cli.repo import BackupId, Manifest, Totals

    t0 = datetime(2026, 12, 6, tzinfo=UTC)

    def commit(i: int) -> Manifest:
        at = t0 + timedelta(seconds=i + 1)
        return Manifest(backup_id=BackupId(at), bucket="b", source="upr://h/b",
                        started=at - timedelta(seconds=1), finished=at, full=False,
                        parent=BackupId(t0), partitions=(), totals=Totals.derive((), 0),
                        continuous=at - timedelta(seconds=1))  # fmt: skip

    tail = Tail(fanout=3)
    made = [commit(i) for i in range(7)]
    for m in made[:5]:
        tail.add(m)
    group = tail.due()
    assert group == [Link.of(m) for m in made[:3]]  # the oldest run first
    tail.rolled(group, made[2])
    assert [lv for _m, lv in tail.items] == [1, 0, 0]
    assert tail.due() is None
    tail.add(made[5])
    assert tail.due() == [Link.of(m) for m in made[3:6]]
    tail.rolled([Link.of(m) for m in made[3:6]], made[5])
    tail.add(made[6])
    assert [lv for _m, lv in tail.items] == [1, 1, 0] and tail.due() is None
    # a group too large to roll leaves the tail with what came before it
    tail.freeze([Link.of(made[2]), Link.of(made[5])])
    assert [m for m, _lv in tail.items] == [Link.of(made[6])]
