"""Rollbacks into deduplicated snapshots lose nothing (docs/design.md, "Snapshot boundaries").

One partition, three nodes. The active A (n0) writes K=v1 (1), J (2); the replica B (n1)
persists the snapshot [0,2] whole; then A writes D (3), updates K (4) and deletes D (5).
A replay store, a backup and the replica C (n2) each receive the whole history as one
deduplicated disk snapshot [0,5]: J@2, K@4, D deleted @5 (K@1 and D@3 replaced). A is
SIGKILLed and B promoted with an entry at 2. Told to roll back to 2, each client goes
back to its newest boundary at or below 2 (0) and streams again: all three end equal to
B key for key, where rolling back to 2 would have left them without K (B never sends
K@1 again: it lies below 2). Only the versions above 2 count as lost.

A single node's SIGKILL and restart is staged the same way, with the clients holding
writes it never persisted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.cluster_helpers import Cluster, write
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import node_rows, run, store_rows, wait_persisted
from upr_cli.store import Store

VB = 0


def _persisted(cl: Cluster, name: str, seq: int) -> None:
    cl.wait(f"{name} to persist seq {seq}", lambda: cl.seqnos(name)[VB][1:] == (seq, seq))


def _replay(uri: str, db: Path) -> dict[str, Any]:
    out = upr("replay", uri, "--into", str(db), "--json", "--no-progress")
    return dict(json.loads(out.stdout))


def _backup(uri: str, repo: Path) -> dict[str, Any]:
    out = upr("backup", uri, "--repo", str(repo), "--json", "--no-progress")
    return dict(json.loads(out.stdout))


def _restore(repo: Path, db: Path) -> dict[tuple[int, bytes], tuple[Any, ...]]:
    upr("verify", "--repo", str(repo))
    upr("restore", "--repo", str(repo), f"sqlite:{db}")
    return store_rows(db)


def test_a_hard_failover_inside_a_deduplicated_snapshot(tmp_path: Path) -> None:
    cl = Cluster(tmp_path / "cl", nodes=3, replicas=2, partitions=1)
    store, repo = tmp_path / "replay.db", tmp_path / "repo"
    try:
        a = cl.uri("n0")
        cl.cli("pause", "n1", "--after", "0")
        cl.cli("pause", "n2", "--after", "0")
        run(write(a, [(b"K", {"v": 1}), (b"J", {"j": 1})]))
        cl.cli("pause", "n1", "--after", "2")
        _persisted(cl, "n1", 2)
        run(write(a, [(b"D", {"d": 1}), (b"K", {"v": 3}), (b"D", None)]))
        _persisted(cl, "n0", 5)  # the clients' stream is one disk snapshot, deduplicated
        first = _replay(a, store)
        assert first["applied"] == 3 and first["rollbacks"] == []
        assert {k[1] for k in store_rows(store)} == {b"J", b"K", b"D"}
        _backup(a, repo)
        cl.cli("pause", "n2", "--after", "5")
        _persisted(cl, "n2", 5)

        cl.kill("n0")
        cl.cli("failover", "n0", "--to", "n1")
        assert cl.stats("n1", "failovers")[f"vb_{VB}:0:seq"] == "2"
        b = cl.uri("n1")
        truth = cl.copy_rows("n1")
        assert {k[1]: (r[0], r[1]) for k, r in truth.items()} == {
            b"K": (1, False),
            b"J": (2, False),
        }

        # the replay store: asked 2, back to the boundary 0, streamed again
        again = _replay(b, store)
        assert [(r["asked"], r["to"]) for r in again["rollbacks"]] == [(2, 0)], again
        assert store_rows(store) == truth
        with Store(store, create=False) as s:
            lost = sorted((lw.document.key, lw.document.seq) for lw in s.lost_writes())
        assert lost == [(b"D", 5), (b"K", 4)]  # above 2 only: J@2 came back

        # the backup chain: the incremental starts at the boundary, restores to B
        inc = _backup(b, repo)
        (rb,) = inc["rollbacks"]
        assert (rb["to"], rb["producer_seq"]) == ("0", "2"), inc
        assert _restore(repo, tmp_path / "restored.db") == truth
        # lost writes of the chain: the versions above 2, not J@2 (B has it)
        out = upr("salvage", "--repo", str(repo), "--into", b, "--json", check=False)
        items = json.loads(out.stdout)["writes"]
        assert sorted((it["key"], int(it["lost_version"]["seq"]), it["cut"]) for it in items) == [
            ("D", 5, "2"), ("K", 4, "2")
        ]  # fmt: skip
        out = upr("examine", "--repo", str(repo), "--json", "K")
        versions = json.loads(out.stdout)["versions"]
        assert sorted((int(v["seq"]), v["lost"], v["in_latest"]) for v in versions) == [
            (1, False, True), (4, True, False)
        ]  # fmt: skip

        # the replica C, as the other two
        cl.cli("resume", "n2")
        cl.settle()
        assert cl.copy_rows("n2") == truth
        assert not cl.node_errors()
    finally:
        cl.stop()


def test_a_sigkill_and_restart_of_a_single_node(node_factory: type[Node], tmp_path: Path) -> None:
    """The node persisted K=v1 (1), J (2), D (3); a replay store and a backup then saw K=v3
    (4), D deleted (5) and L (6), which the node never persisted. It restarts with an
    entry at 3, a snapshot boundary both clients reached: they roll back exactly there."""
    node = node_factory("--flush-interval", "0.02", partitions=1).start()
    store, repo = tmp_path / "replay.db", tmp_path / "repo"
    run(write(node.uri, [(b"K", {"v": 1}), (b"J", {"j": 1}), (b"D", {"d": 1})]))
    wait_persisted(node.uri)
    node.stop()
    node.start("--flush-interval", "3600")
    _replay(node.uri, store)
    _backup(node.uri, repo)
    run(write(node.uri, [(b"K", {"v": 3}), (b"D", None), (b"L", {"l": 1})]))
    assert _replay(node.uri, store)["applied"] == 3
    _backup(node.uri, repo)
    node.kill()
    node.start("--flush-interval", "0.02")
    run(write(node.uri, [(b"K", {"v": 5}), (b"J", None)]))
    wait_persisted(node.uri)
    truth = node_rows(node.uri)
    again = _replay(node.uri, store)
    assert [(r["asked"], r["to"]) for r in again["rollbacks"]] == [(3, 3)], again
    assert store_rows(store) == truth
    inc = _backup(node.uri, repo)
    assert [(r["to"], r["producer_seq"]) for r in inc["rollbacks"]] == [("3", "3")], inc
    assert _restore(repo, tmp_path / "restored.db") == truth
