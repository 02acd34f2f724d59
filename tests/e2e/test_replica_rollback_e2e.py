"""Node replication rolls back onto a snapshot boundary (formats/cluster.md §5).

Within a DCP snapshot a key appears once, at its newest seq, so a seq inside a snapshot a
replica received is not a state the active ever had. A replica told to roll back to r
goes back to the newest snapshot boundary at or below r that its undo reaches, streams
again from there, and ends equal to the new active key for key; its `lost_writes` hold
exactly the versions above r (the ones the new active never had).

Both stagings use one partition, replication pauses (formats/cluster.md §6), updates and deletes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.e2e.cluster_helpers import Cluster, write
from tests.e2e.e2e_helpers import run

VB = 0


def _keys(rows: dict[tuple[int, bytes], tuple[Any, ...]]) -> dict[bytes, tuple[int, bool]]:
    return {k: (r[0], r[1]) for (_p, k), r in rows.items()}


def _rollbacks(cl: Cluster, name: str) -> list[tuple[int, int | None]]:
    """(seq rolled back to, seq asked) of each replica rollback the node logged."""
    text = (Path(cl.spec.node(name).data) / "serve.log").read_text(errors="replace")
    pat = rf"replica partition {VB} rolled back to (\d+)(?: \(asked (\d+))?"
    return [(int(a), int(b) if b else None) for a, b in re.findall(pat, text)]


def _persisted(cl: Cluster, name: str, seq: int) -> None:
    cl.wait(f"{name} to persist seq {seq}", lambda: cl.seqnos(name)[VB][1:] == (seq, seq))


def test_a_failover_inside_a_deduplicated_snapshot(tmp_path: Path) -> None:
    """A (n0) writes K=v1 (1), X (2), D (3); B (n1) persists the snapshot through 3; C
    (n2) has the snapshot [0,1] and then [1,6] from disk: X@2, K=v3@4, D deleted @5, Y@6
    (D@3 deduplicated away). A dies, B is promoted at 3. C is told to roll back to 3, which
    is inside [1,6]: keeping X@2 and undoing the rest would leave it without D forever
    (B never sends D@3 again, it is below 3). C goes back to 1 instead."""
    cl = Cluster(tmp_path / "cl", nodes=3, replicas=2, partitions=1)
    try:
        a = cl.uri("n0")
        cl.cli("pause", "n1", "--after", "0")
        cl.cli("pause", "n2", "--after", "1")
        run(write(a, [(b"K", {"v": 1})]))
        _persisted(cl, "n2", 1)
        run(write(a, [(b"X", {"x": 1}), (b"D", {"d": 1})]))
        cl.cli("pause", "n1", "--after", "3")
        _persisted(cl, "n1", 3)
        assert cl.stats("n1", "replication")[f"vb_{VB}:complete_seqno"] == "3"
        run(write(a, [(b"K", {"v": 3}), (b"D", None), (b"Y", {"y": 1})]))
        _persisted(cl, "n0", 6)  # C's next stream is one disk snapshot, deduplicated
        cl.cli("pause", "n2", "--after", "6")
        _persisted(cl, "n2", 6)
        assert _keys(cl.copy_rows("n2")) == {
            b"X": (2, False), b"K": (4, False), b"D": (5, True), b"Y": (6, False)
        }  # fmt: skip

        cl.kill("n0")
        cl.cli("failover", "n0", "--to", "n1")
        logs = cl.stats("n1", "failovers")
        assert logs[f"vb_{VB}:0:seq"] == "3"  # B's entry: its last complete snapshot
        cl.cli("resume", "n2")
        cl.settle()
        b_rows = cl.copy_rows("n1")
        assert _keys(b_rows) == {b"K": (1, False), b"X": (2, False), b"D": (3, False)}
        assert cl.copy_rows("n2") == b_rows  # values, cas, rev seqs, deletions
        # lost: exactly the versions above 3, none of which B holds (X@2 came back)
        assert cl.lost_writes("n2") == [
            (3, VB, b"K", 4, False), (3, VB, b"D", 5, True), (3, VB, b"Y", 6, False)
        ]  # fmt: skip
        # C went back to the boundary 1, not to 3 (inside [1,6]) and not further than 1
        assert _rollbacks(cl, "n2") == [(1, 3)]

        # the new active goes on: updates and deletes reach C
        run(write(cl.uri("n1"), [(b"K", {"v": 7}), (b"X", None), (b"Z", {"z": 1})]))
        cl.settle()
        assert cl.copy_rows("n2") == cl.copy_rows("n1")
        assert not cl.node_errors()
    finally:
        cl.stop()


def test_an_active_restart_after_a_replica_saw_its_unpersisted_writes(tmp_path: Path) -> None:
    """A (n0) persisted K=v1 (1) and D (2), then took J (3), K=v3 (4) and deleted D (5)
    without persisting them. C (n1) received the snapshots [0,2] and [3,5] but persisted
    neither on its own: its write queue replaced K@1 and D@2 by K@4 and D@5, so the state
    at 2 never reached its disk. A is SIGKILLed and restarts with an entry at 2; C, told
    to roll back to 2, cannot reach it (undoing would remove K and D for good) and goes
    back to 0."""
    cl = Cluster(tmp_path / "cl", nodes=2, replicas=1, partitions=1)
    try:
        for name in ("n0", "n1"):  # each persists only when told (Cluster.flush)
            cl.restart(name, "--flush-interval", "3600")
        a = cl.uri("n0")
        cl.cli("pause", "n1", "--after", "0")
        run(write(a, [(b"K", {"v": 1}), (b"D", {"d": 1})]))
        cl.flush("n0")
        assert cl.seqnos("n0")[VB][1:] == (2, 2)
        run(write(a, [(b"J", {"j": 1}), (b"K", {"v": 3}), (b"D", None)]))
        cl.cli("pause", "n1", "--after", "5")
        cl.wait("C to receive seq 5", lambda: cl.seqnos("n1")[VB][1:] == (5, 0))
        assert cl.seqnos("n0")[VB][1:] == (5, 2)

        cl.kill("n0")
        cl.cli("start")  # A comes back with what it persisted, a new entry at 2
        assert cl.stats("n0", "failovers")[f"vb_{VB}:0:seq"] == "2"
        cl.cli("resume", "n1")
        cl.wait("C to follow A again",
                lambda: _rollbacks(cl, "n1") and cl.seqnos("n1")[VB][1] == 2)  # fmt: skip
        cl.flush("n1")
        a_rows = cl.copy_rows("n0")
        assert _keys(a_rows) == {b"K": (1, False), b"D": (2, False)}
        assert cl.copy_rows("n1") == a_rows
        assert cl.lost_writes("n1") == [
            (2, VB, b"J", 3, False), (2, VB, b"K", 4, False), (2, VB, b"D", 5, True)
        ]  # fmt: skip
        assert _rollbacks(cl, "n1")[-1] == (0, 2)

        run(write(a, [(b"K", {"v": 8}), (b"D", None), (b"W", {"w": 1})]))
        cl.wait("C to catch up", lambda: cl.seqnos("n1")[VB][1] == cl.seqnos("n0")[VB][1])
        cl.flush("n1")
        cl.wait("A to persist", lambda: len(set(cl.seqnos("n0")[VB][1:])) == 1)
        assert cl.copy_rows("n1") == cl.copy_rows("n0")
        assert not cl.node_errors()
    finally:
        cl.stop()
