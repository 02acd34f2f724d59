"""What a replica's OBSERVE_SEQNO promises (formats/cluster.md §5 "What OBSERVE_SEQNO
tells a client"): a replica in the middle of a deduplicated snapshot reports as persisted
the end of its last complete snapshot, not the seqs it holds, and every write up to what
it reports survives its promotion.

Staged with replication pauses (formats/cluster.md §6) on three nodes and one partition:
n0 is active, n1 pauses in the middle of a deduplicated snapshot, n2 takes everything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.cluster_helpers import Cluster, observe, write
from tests.e2e.e2e_helpers import run

VB = 0
# (seq, key, value): None is a delete. K=v1 (2) is replaced by K=v3 (4) in the same
# snapshot, and X=x1 (1) is deleted (5): the snapshot [1,5] from disk holds J@3, K@4, X†@5.
WORKLOAD: list[tuple[int, bytes, Any]] = [
    (1, b"X", {"x": 1}),
    (2, b"K", {"v": 1}),
    (3, b"J", {"j": 1}),
    (4, b"K", {"v": 3}),
    (5, b"X", None),
]


def _claimed_writes_survive(rows: dict[tuple[int, bytes], tuple[Any, ...]], upto: int) -> None:
    """Every write at or below `upto` is on the copy, or a later write of its key is."""
    for seq, key, _value in WORKLOAD:
        if seq > upto:
            continue
        got = rows.get((VB, key))
        assert got is not None and got[0] >= seq, (key, seq, got)
        later = [(s, v) for s, k, v in WORKLOAD if k == key and s == got[0]]
        assert later, (key, got)  # the copy holds one of the workload's versions of the key
        want = later[0][1]
        assert got[1] == (want is None), (key, got)
        if want is not None:
            assert json.loads(got[2]) == want, (key, got)


def test_a_replica_mid_snapshot_reports_its_last_complete_snapshot(tmp_path: Path) -> None:
    cl = Cluster(tmp_path / "cl", nodes=3, replicas=2, partitions=1)
    try:
        cl.cli("pause", "n1", "--after", "1")
        a = cl.uri("n0")
        run(write(a, [(k, v) for _s, k, v in WORKLOAD[:1]]))
        cl.wait("n1 to persist seq 1", lambda: cl.seqnos("n1")[VB][1:] == (1, 1))
        run(write(a, [(k, v) for _s, k, v in WORKLOAD[1:]]))
        # n0 persists everything first: n1 then streams one disk snapshot [1,5], deduplicated
        cl.wait("n0 to persist seq 5", lambda: cl.seqnos("n0")[VB][1:] == (5, 5))
        cl.cli("pause", "n1", "--after", "3")  # takes J@3 of [1,5], stops before K@4
        cl.wait("n1 to persist seq 3", lambda: cl.seqnos("n1")[VB][1:] == (3, 3))
        cl.wait("n2 to persist seq 5", lambda: cl.seqnos("n2")[VB][1:] == (5, 5))
        assert {k: r[0] for (_p, k), r in cl.copy_rows("n1").items()} == {b"X": 1, b"J": 3}
        uuid = cl.seqnos("n0")[VB][0]

        mid = run(observe(cl.uri("n1"), VB, uuid))
        assert (mid.format, mid.vbucket_uuid) == (0, uuid)
        # n1 holds seqs up to 3 but K=v1 (2) is on no copy: only the snapshot [0,1] is whole
        assert mid.persisted_seqno == 1, mid
        assert mid.current_seqno == 3, mid  # the high seqno, as kv_engine reports it
        assert cl.stats("n1", "replication")[f"vb_{VB}:complete_seqno"] == "1"
        whole = run(observe(cl.uri("n2"), VB, uuid))  # the snapshot received whole
        assert (whole.persisted_seqno, whole.current_seqno) == (5, 5)
        active = run(observe(a, VB, uuid))
        assert (active.persisted_seqno, active.current_seqno) == (5, 5)

        # the active dies; n1 is promoted: its failover entry sits at what it reported
        cl.kill("n0")
        cl.cli("failover", "n0", "--to", "n1")
        new_uuid, high, _ = cl.seqnos("n1")[VB]
        assert high == 3 and new_uuid != uuid
        logs = cl.stats("n1", "failovers")
        assert (int(logs[f"vb_{VB}:0:id"]), int(logs[f"vb_{VB}:0:seq"])) == (new_uuid, 1)
        assert int(logs[f"vb_{VB}:1:id"]) == uuid
        _claimed_writes_survive(cl.copy_rows("n1"), mid.persisted_seqno)
        # the old branch, observed on the new active: it ended at the entry (format 1)
        after = run(observe(cl.uri("n1"), VB, uuid))
        assert (after.format, after.last_received_seqno) == (1, 1)
        # n2 follows the new active and ends equal to it
        cl.settle()
        assert cl.copy_rows("n2") == cl.copy_rows("n1")
    finally:
        cl.stop()
