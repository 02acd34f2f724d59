"""A restore into a cluster keeps every process under 300 MB (issue 27, docs/design.md
"Performance"): documents of 5 MB of random (barely compressible) values, restored with
the default --memory-limit through the map of a 3-node cluster with one replica. Each
node takes the restore's writes to its actives, replicates them to a peer and takes its
peer's into its replicas at once: the streams waiting for a replication link's window
once held an encoded copy of their next document each, the restore's writer a joined
copy of its window, and each node two 32 MiB SQLite page caches (together 400 MB a node
and 300 MB for the restore with 100 documents)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.e2e.cluster_helpers import Cluster
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import run, set_keys, wait_persisted
from tests.e2e.memory_helpers import large_values, peak_mb, vm_hwm_mb

DOCS, SIZE, PARTITIONS = 60, 5 * 1024 * 1024, 16
LIMIT_MB = 300


def test_restore_into_a_cluster_stays_under_300_mb(node_factory: Callable[..., Node],
                                                    tmp_path: Path) -> None:  # fmt: skip
    src = node_factory("--flush-interval", "0.02", partitions=PARTITIONS, name="src").start()
    values = list(large_values(DOCS, SIZE).items())
    # in runs the write queue takes (96 MiB with the default --memory-limit): a fuller
    # queue answers ETMPFAIL, which this plain writer does not retry
    for i in range(0, DOCS, 10):
        run(set_keys(src.uri, dict(values[i : i + 10])))
        wait_persisted(src.uri, timeout=60)
    del values
    repo = tmp_path / "repo"
    upr("backup", src.uri, "--repo", str(repo), "--json")
    src.stop()

    cl = Cluster(tmp_path / "cl", nodes=3, replicas=1, partitions=PARTITIONS)
    try:
        peak, out = peak_mb("restore", "--repo", str(repo), cl.uri(), "--json",
                            "--no-progress", timeout=180)  # fmt: skip
        summary = json.loads(out)
        assert summary["written"] == DOCS
        cl.settle(timeout=120)  # replication done: the nodes' peaks include it
        nodes = {n.name: vm_hwm_mb(n.pid) for n in cl.spec.nodes if n.pid is not None}
        print(f"restore into a cluster: peak RSS {peak:.0f} MB; the nodes' {nodes}")
        assert len(nodes) == 3
        assert peak < LIMIT_MB, f"restore into a cluster peaked at {peak:.0f} MB"
        for name, mb in nodes.items():
            assert mb < LIMIT_MB, f"node {name} peaked at {mb:.0f} MB taking the restore"
        assert len(cl.rows()) == DOCS
    finally:
        cl.stop()
