"""Tools run through a rebalance and through failovers converge to the final cluster.

Issue 7: `tail --until-end`, `replay` and `backup` bootstrap from one node, stream every
partition from its active node, and follow the map when partitions move (NOT_MY_VBUCKET,
StreamEnd StateChanged, a dead node), resuming on the new active under the rollback
protocol. The final state is read from the active copies' database files directly.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from tests.e2e.cluster_helpers import Cluster, as_tail, popen, tail_state
from tests.e2e.conftest import upr
from tests.e2e.e2e_helpers import store_rows


def _positions(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            return int(c.execute("SELECT coalesce(sum(seq), 0) FROM partitions").fetchone()[0])
    except sqlite3.Error:
        return -1


class BackupLoop:
    """Incremental backups one after another until stopped (some overlap every event)."""

    def __init__(self, uri: str, repo: Path) -> None:
        self.uri, self.repo = uri, repo
        self.codes: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            r = upr("backup", self.uri, "--repo", str(self.repo), "--no-progress", check=False)
            self.codes.append(r.returncode)
            if r.returncode != 0:
                self.errors.append(r.stderr.strip())
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def _start(cl: Cluster, tmp: Path, *, backup_from: str) -> tuple[Any, BackupLoop, Any]:
    """Initial data, then a following replay, a backup loop and a writing load."""
    upr("load", cl.uri("n1"), "--docs", "4000", "--update-ratio", "0.2", "--delete-ratio", "0.1")
    replay = popen("replay", cl.uri("n1"), "--into", str(tmp / "replay.db"), "--follow",
                   "--no-progress")  # fmt: skip
    backups = BackupLoop(cl.uri(backup_from), tmp / "repo")
    load = popen("load", cl.uri("n1"), "--docs", "6000", "--update-ratio", "0.5",
                 "--delete-ratio", "0.1", "--rate", "2500", "--seed", "5", "--prefix",
                 "during", "--json")  # fmt: skip
    return replay, backups, load


def _until_writing(cl: Cluster, name: str, more: int = 300, timeout: float = 60) -> None:
    """Wait until node `name`'s partitions have taken `more` writes since now (the
    load started in the background is writing there)."""
    start = sum(high for _uuid, high, _persisted in cl.seqnos(name).values())
    deadline = time.monotonic() + timeout
    while sum(high for _uuid, high, _persisted in cl.seqnos(name).values()) < start + more:
        assert time.monotonic() < deadline, f"the load wrote nothing to {name} in {timeout}s"
        time.sleep(0.05)


def _tail_during(cl: Cluster, bootstrap: str, *change: str) -> None:
    """`tail --until-end` from the beginning while the cluster changes: it ends, and the
    newest version of every key it printed is the final cluster's."""
    tail = popen("tail", cl.uri(bootstrap), "--until-end", "--format", "json")
    cl.cli(*change)
    t_out, t_err = tail.communicate(timeout=120)
    assert tail.returncode == 0, t_err
    assert tail_state(t_out) == as_tail(cl.rows())


def _finish_and_compare(cl: Cluster, tmp: Path, replay: object, backups: BackupLoop) -> None:
    cl.settle()
    final = cl.rows()
    highs = {}
    for (p, _k), r in final.items():
        highs[p] = max(highs.get(p, 0), r[0])
    db = tmp / "replay.db"
    deadline = time.monotonic() + 60
    while _positions(db) != sum(highs.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    replay.send_signal(signal.SIGINT)  # type: ignore[attr-defined]
    _out, err = replay.communicate(timeout=60)  # type: ignore[attr-defined]
    assert replay.returncode == 0, err  # type: ignore[attr-defined]
    got = store_rows(db)
    diff = sorted(k for k in set(final) | set(got) if final.get(k) != got.get(k))
    # replay: exactly the final cluster, tombstones too
    with sqlite3.connect(db) as c:
        pos = {p: s for p, s in c.execute("SELECT partition, seq FROM partitions")}
    (tmp / "replay.err").write_text(err)
    assert not diff, ([(k, final.get(k, ())[:2], got.get(k, ())[:2]) for k in diff[:4]],
                      len(diff), {k[0]: pos.get(k[0]) for k in diff}, cl.spec.vbmap,
                      "\n".join(ln for ln in err.splitlines() if "partition 12" in ln or
                                 "move" in ln or "lost" in ln)[-4000:])  # fmt: skip
    backups.stop()
    # every run completes, through moves and through a hard failover's rollbacks
    assert backups.codes and set(backups.codes) == {0}, backups.errors
    upr("backup", backups.uri, "--repo", str(tmp / "repo"), "--no-progress")
    upr("verify", "--repo", str(tmp / "repo"))
    upr("restore", "--repo", str(tmp / "repo"), f"sqlite:{tmp / 'restored.db'}")
    assert store_rows(tmp / "restored.db") == final  # backup chain → restore: the same


def test_tail_replay_backup_through_rebalances(tmp_path: Path) -> None:
    cl = Cluster(tmp_path / "cl", nodes=3, replicas=1, partitions=16)
    try:
        replay, backups, load = _start(cl, tmp_path, backup_from="n0")  # n1 leaves later
        time.sleep(0.5)
        cl.cli("rebalance", "--add", "new")  # partitions move while writes go on
        out, err = load.communicate(timeout=120)
        assert load.returncode == 0, err
        assert json.loads(out)["errors"] == 0  # every write reached an active (retried)
        cl.settle()
        # tail from the beginning to the high seqs of its start, while n1 leaves
        _tail_during(cl, "n2", "rebalance", "--remove", "n1")
        _finish_and_compare(cl, tmp_path, replay, backups)
    finally:
        cl.stop()


def test_tail_replay_backup_through_failovers(tmp_path: Path) -> None:
    cl = Cluster(tmp_path / "cl", nodes=3, replicas=1, partitions=16)
    try:
        replay, backups, load = _start(cl, tmp_path, backup_from="n1")
        _until_writing(cl, "n0")  # a fixed pause lost the race to a slow start of the load
        cl.kill("n0")  # its unreplicated writes are lost: replay and backup roll back
        cl.cli("failover", "n0")
        out, _err = load.communicate(timeout=120)
        summary = json.loads(out)
        # writes retried onto the new actives; the only errors allowed are deletions of
        # keys whose creation the failover took back (KEY_ENOENT)
        assert summary["retries"] > 0 and set(summary["error_statuses"]) <= {"0x01"}, out
        cl.settle()
        # n0's partitions lost their replicas: a graceful failover of n2 would leave
        # some without a copy, so it is refused until a rebalance restores them
        bad = cl.cli("failover", "n2", "--graceful", check=False)
        assert bad.returncode == 2 and "no replica to take over" in bad.stderr
        cl.cli("rebalance", "--add", "new")
        cl.settle()
        # a graceful failover while tail streams: no entry, no rollback, nothing lost
        _tail_during(cl, "n1", "failover", "n2", "--graceful")
        _finish_and_compare(cl, tmp_path, replay, backups)
    finally:
        cl.stop()
