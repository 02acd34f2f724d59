"""upr replay into SQLite through crashes; upr diff and upr salvage after a SIGKILL."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import (
    node_rows,
    run,
    seqnos,
    set_keys,
    store_rows,
    wait_persisted,
)

Spawn = Callable[..., "subprocess.Popen[str]"]


def _upr_proc(spawned: Spawn, *args: str) -> subprocess.Popen[str]:
    """A `upr` process owned by the `spawned` fixture (killed at teardown)."""
    return spawned(sys.executable, "-m", "upr_cli", *args, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True)  # fmt: skip


def _position_total(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            return int(c.execute("SELECT coalesce(sum(seq), 0) FROM partitions").fetchone()[0])
    except sqlite3.Error:
        return 0


def _wait(pred: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_follow_through_a_sigkill_under_load_ends_equal_to_the_node(
    node_factory: type[Node], tmp_path: Path, spawned: Spawn
) -> None:
    node = node_factory("--flush-interval", "0.02").start()
    db = tmp_path / "r.db"
    upr("load", node.uri, "--docs", "1500", "--update-ratio", "0.3", "--delete-ratio", "0.1")
    persisted = sum(h for _u, h, _p in wait_persisted(node.uri).values())
    node.stop()
    node.start("--flush-interval", "3600")  # from now on nothing is persisted
    replay = _upr_proc(spawned, "replay", node.uri, "--into", str(db), "--follow", "--no-progress")
    load = _upr_proc(spawned, "load", node.uri, "--docs", "3000", "--update-ratio", "0.4",
                     "--rate", "3000", "--seed", "7", "--prefix", "live")  # fmt: skip
    # mid-stream: the store holds writes the node has not persisted
    _wait(lambda: _position_total(db) > persisted + 300)
    node.kill()
    load.communicate(timeout=60)
    node.start("--flush-interval", "0.02")
    upr("load", node.uri, "--docs", "500", "--update-ratio", "0.5", "--seed", "8",
        "--prefix", "after")  # fmt: skip
    highs = {p: h for p, (_u, h, _p) in wait_persisted(node.uri).items()}
    _wait(lambda: _position_total(db) == sum(highs.values()))
    replay.send_signal(signal.SIGINT)
    out, err = replay.communicate(timeout=60)
    assert replay.returncode == 0, err
    assert "rolled back from seq" in err and "interrupted" in out
    # a rerun resumes from the stored positions: nothing new, nothing rolled back
    again = json.loads(upr("replay", node.uri, "--into", str(db), "--json").stdout)
    assert again["applied"] == 0 and again["rollbacks"] == []
    assert store_rows(db) == node_rows(node.uri)  # key, value, seq, cas, rev seq, flags, expiry


def test_replay_resumes_after_sigkill_at_any_point_and_twice_is_the_same(
    node: Node, tmp_path: Path, spawned: Spawn
) -> None:
    upr("load", node.uri, "--docs", "20000", "--update-ratio", "0.2", "--delete-ratio", "0.1")
    wait_persisted(node.uri)
    clean = tmp_path / "clean.db"
    upr("replay", node.uri, "--into", str(clean))
    upr("replay", node.uri, "--into", str(clean))  # twice: the same rows
    truth = node_rows(node.uri)
    assert store_rows(clean) == truth
    for i, delay in enumerate((0.35, 0.5, 0.7)):
        db = tmp_path / f"killed{i}.db"
        proc = _upr_proc(spawned, "replay", node.uri, "--into", str(db), "--no-progress")
        time.sleep(delay)
        proc.kill()
        proc.communicate()
        upr("replay", node.uri, "--into", str(db))
        assert store_rows(db) == truth, f"after SIGKILL at {delay}s"


def test_replay_from_a_repository_equals_restore_and_follows_the_chain(
    node: Node, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    upr("load", node.uri, "--docs", "1500", "--update-ratio", "0.3", "--delete-ratio", "0.1")
    wait_persisted(node.uri)
    upr("backup", node.uri, "--repo", str(repo))
    replayed, restored = tmp_path / "replayed.db", tmp_path / "restored.db"
    upr("replay", f"repo:{repo}", "--into", str(replayed))
    upr("restore", "--repo", str(repo), f"sqlite:{restored}")
    assert store_rows(replayed) == store_rows(restored) == node_rows(node.uri)
    # an incremental backup: the replay applies only what is new, then equals restore again
    upr("load", node.uri, "--docs", "600", "--update-ratio", "0.6", "--delete-ratio", "0.2",
        "--seed", "3", "--prefix", "doc")  # fmt: skip
    wait_persisted(node.uri)
    upr("backup", node.uri, "--repo", str(repo))
    out = json.loads(upr("replay", f"repo:{repo}", "--into", str(replayed), "--json").stdout)
    assert 0 < out["applied"] < 1500 and out["rollbacks"] == []
    restored2 = tmp_path / "restored2.db"
    upr("restore", "--repo", str(repo), f"sqlite:{restored2}")
    assert store_rows(replayed) == store_rows(restored2) == node_rows(node.uri)
    # the positions are the chain's: a live replay continues from the backup
    assert (
        json.loads(upr("replay", node.uri, "--into", str(replayed), "--json").stdout)["applied"]
        == 0
    )


def test_consistent_replay_never_commits_b_ahead_of_a(
    node_factory: type[Node], tmp_path: Path, spawned: Spawn
) -> None:
    node = node_factory("--flush-interval", "0.02", partitions=16).start()
    db = tmp_path / "c.db"
    from upr_cli.net.bootstrap import partition_of

    # two keys in different partitions
    a = b"key-a"
    b = next(
        k for k in (f"key-b{i}".encode() for i in range(100)) if partition_of(k, 16) !=
        partition_of(a, 16)
    )  # fmt: skip
    upr("load", node.uri, "--docs", "3000")  # a backfill to catch up on first
    run(set_keys(node.uri, {a: b'{"v":0}', b: b'{"v":0}'}))
    replay = _upr_proc(spawned, "replay", node.uri, "--into", str(db), "--follow", "--consistent",
                       "--no-progress")  # fmt: skip
    violations: list[tuple[int, int]] = []
    samples: set[tuple[int, int]] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
                    got = dict(c.execute(
                        "SELECT key, json_extract(value, '$.v') FROM documents"
                        " WHERE key IN (?, ?)", (a, b)).fetchall())  # fmt: skip
            except sqlite3.Error:
                continue
            va, vb = got.get(a, -1), got.get(b, -1)
            samples.add((va, vb))
            if vb > va:
                violations.append((va, vb))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    for v in range(1, 120):  # a, then b, each acknowledged before the next
        run(set_keys(node.uri, {a: b'{"v":%d}' % v}))
        run(set_keys(node.uri, {b: b'{"v":%d}' % v}))
        time.sleep(0.01)
    _wait(lambda: (119, 119) in samples, timeout=60)
    stop.set()
    t.join()
    replay.send_signal(signal.SIGINT)
    _out, err = replay.communicate(timeout=60)
    assert replay.returncode == 0, err
    assert violations == []
    assert len(samples) > 5  # the sampler saw the store move through many states


def test_consistent_replay_keeps_committing_after_a_reconnect(
    node_factory: type[Node], tmp_path: Path, spawned: Spawn
) -> None:
    """A restarted node is a new DCP connection: the consumer negotiates barrier cookies
    on it again, and the replay asks for a new cookie (the pending one went with the old
    connection), so its cuts keep committing."""
    node = node_factory("--flush-interval", "0.02").start()
    db = tmp_path / "c.db"
    upr("load", node.uri, "--docs", "300", "--update-ratio", "0.3", "--delete-ratio", "0.1")
    replay = _upr_proc(spawned, "replay", node.uri, "--into", str(db), "--follow", "--consistent",
                       "--no-progress")  # fmt: skip
    try:
        highs = {p: h for p, (_u, h, _p) in wait_persisted(node.uri).items()}
        _wait(lambda: _position_total(db) == sum(highs.values()))
        node.stop()
        node.start("--flush-interval", "0.02")
        upr("load", node.uri, "--docs", "300", "--update-ratio", "0.5", "--delete-ratio", "0.1",
            "--seed", "9", "--prefix", "after")  # fmt: skip
        highs = {p: h for p, (_u, h, _p) in wait_persisted(node.uri).items()}
        _wait(lambda: _position_total(db) == sum(highs.values()), timeout=30)
    finally:
        replay.send_signal(signal.SIGINT)
        _out, err = replay.communicate(timeout=60)
    assert replay.returncode == 0, err
    assert store_rows(db) == node_rows(node.uri)


def test_durable_only_never_holds_a_write_the_node_lost(
    node_factory: type[Node], tmp_path: Path
) -> None:
    node = node_factory("--flush-interval", "0.02").start()
    db = tmp_path / "d.db"
    upr("load", node.uri, "--docs", "1000", "--update-ratio", "0.3")
    wait_persisted(node.uri)
    node.stop()
    node.start("--flush-interval", "3600")
    upr("load", node.uri, "--docs", "500", "--update-ratio", "0.5", "--seed", "4",
        "--prefix", "lost")  # fmt: skip
    proc = upr("replay", node.uri, "--into", str(db), "--durable-only", "--json")
    out = json.loads(proc.stdout)
    assert any(n.startswith("not-persisted:") for n in out["notes"])
    held = store_rows(db)
    node.kill()
    node.start("--flush-interval", "0.02")
    truth = node_rows(node.uri)
    assert held == truth  # exactly the persisted state: nothing the crash took back
    again = json.loads(upr("replay", node.uri, "--into", str(db), "--json").stdout)
    assert again["rollbacks"] == []  # nothing to take back


def test_diff_and_salvage_after_a_sigkill(node_factory: type[Node], tmp_path: Path) -> None:
    node = node_factory("--flush-interval", "0.02").start()
    repo, db = tmp_path / "repo", tmp_path / "s.db"
    upr("load", node.uri, "--docs", "800", "--update-ratio", "0.3")
    persisted = {p: h for p, (_u, h, _p) in wait_persisted(node.uri).items()}
    upr("backup", node.uri, "--repo", str(repo))
    node.stop()
    node.start("--flush-interval", "3600")
    upr("load", node.uri, "--docs", "300", "--seed", "5", "--prefix", "lost")
    highs = {p: h for p, (_u, h, _p) in run(seqnos(node.uri)).items()}
    upr("backup", node.uri, "--repo", str(repo))  # the backup holds the unpersisted writes
    upr("replay", node.uri, "--into", str(db))  # and so does the store
    assert upr("diff", node.uri, f"repo:{repo}", check=False).returncode == 0
    node.kill()
    node.start("--flush-interval", "0.02")

    proc = upr("diff", node.uri, f"repo:{repo}", "--json", check=False)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    changed = {d["partition"]: d for d in report["partitions"] if highs[d["partition"]] >
               persisted[d["partition"]]}  # fmt: skip
    assert changed and report["counts"]["diverged"] == len(changed)
    for p, d in changed.items():
        assert d["status"] == "diverged" and d["diverged_at"] == str(persisted[p])
        assert d["lost_seqs"] == [str(persisted[p]), str(highs[p])]
        assert d["rollback_seqs"] == {"seed": str(persisted[p]), "dcp": str(persisted[p])}
    text = upr("diff", node.uri, f"repo:{repo}", check=False).stdout
    assert "diverged" in text
    # the store, through a JSON file of failover logs, says the same
    assert upr("diff", node.uri, f"sqlite:{db}", check=False).returncode == 1

    # rewrite some lost keys on the new master: they must come back as conflicts
    lost_keys = sorted({k for (_p, k), v in _lost_in_store(db, persisted).items()})
    assert len(lost_keys) > 20
    rewritten = {k: b'{"rewritten":true}' for k in lost_keys[::4]}
    run(set_keys(node.uri, rewritten))
    dry = json.loads(upr("salvage", "--repo", str(repo), "--into", node.uri, "--json",
                         check=False).stdout)  # fmt: skip
    outcome = {it["key"].encode(): it["outcome"] for it in dry["writes"]}
    assert set(outcome) == set(lost_keys)
    assert {k for k, o in outcome.items() if o == "conflict"} == set(rewritten)
    assert {k for k, o in outcome.items() if o == "would-write"} == set(lost_keys) - set(rewritten)
    # the store sees the same lost writes (still unreplayed: above the master's rollback point)
    sdry = json.loads(upr("salvage", "--store", str(db), "--into", node.uri, "--json",
                          check=False).stdout)  # fmt: skip
    assert {it["key"].encode(): it["outcome"] for it in sdry["writes"]} == outcome

    lost_values = _lost_in_store(db, persisted)
    applied = json.loads(upr("salvage", "--repo", str(repo), "--into", node.uri, "--apply",
                             "--json", check=False).stdout)  # fmt: skip
    assert applied["counts"] == {"written": len(lost_keys) - len(rewritten),
                                 "conflict": len(rewritten)}  # fmt: skip
    now = {k: v for (_p, k), v in node_rows(node.uri).items()}
    for (_p, k), v in lost_values.items():
        assert now[k][2] == (rewritten.get(k) or v[2])  # salvaged, or the newer write kept

    # the store rolls back on its next replay, keeping what it took back, and then
    # reports the salvaged ones as already there
    proc = upr("replay", node.uri, "--into", str(db))
    assert "rolled back from seq" in proc.stderr
    assert store_rows(db) == node_rows(node.uri)
    again = json.loads(upr("salvage", "--store", str(db), "--into", node.uri, "--json",
                           check=False).stdout)  # fmt: skip
    assert again["counts"].get("would-write", 0) == 0
    assert again["counts"]["already-there"] == len(lost_keys) - len(rewritten)


def _lost_in_store(db: Path, persisted: dict[int, int]) -> dict[tuple[int, bytes], tuple]:  # type: ignore[type-arg]
    return {k: v for k, v in store_rows(db).items() if v[0] > persisted[k[0]]}


def test_a_snapshot_larger_than_max_pending_commits_inside_it(
    node_factory: type[Node], tmp_path: Path
) -> None:
    from upr_cli.jobs.replay import replay_node
    from upr_cli.net.uri import SourceUri

    node = node_factory("--flush-interval", "0.02", partitions=1).start()
    upr("load", node.uri, "--docs", "3000")
    wait_persisted(node.uri)  # one partition: its backfill is ONE snapshot of 3000 rows
    db = tmp_path / "m.db"
    stats = run(replay_node(SourceUri.parse(node.uri), db, max_pending=500))
    assert stats.commits >= 3  # memory held at most ~max_pending rows at a time
    assert store_rows(db) == node_rows(node.uri)


def test_a_full_backup_on_the_same_history_makes_nothing_lost(node: Node, tmp_path: Path) -> None:
    """After `backup --full` of an unchanged history, the older backups' records are not
    lost writes (formats/repository.md §8.3): salvage and examine find none."""
    repo = tmp_path / "repo"
    upr("load", node.uri, "--docs", "600", "--update-ratio", "0.3", "--delete-ratio", "0.2")
    wait_persisted(node.uri)
    upr("backup", node.uri, "--repo", str(repo))
    upr("load", node.uri, "--docs", "200", "--update-ratio", "0.5", "--seed", "2")
    wait_persisted(node.uri)
    upr("backup", node.uri, "--repo", str(repo))
    upr("backup", node.uri, "--repo", str(repo), "--full")
    out = json.loads(upr("salvage", "--repo", str(repo), "--into", node.uri, "--json").stdout)
    assert out["lost_writes"] == 0
    versions = json.loads(upr("examine", "--repo", str(repo), "doc-000000001", "--json").stdout)
    assert versions and not any(v["lost"] for v in versions["versions"])
