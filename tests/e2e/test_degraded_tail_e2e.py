"""`upr tail` over a cluster with a node down: the reachable partitions stream at once,
the others are named in a warning at once and waited for (`--wait`), and a failover
during the wait brings them back (formats/cluster.md §3)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.e2e.cluster_helpers import Cluster
from tests.e2e.conftest import upr
from tests.e2e.e2e_helpers import spawn_upr


def _down_partitions(cl: Cluster, name: str) -> list[int]:
    index = next(i for i, n in enumerate(cl.spec.nodes) if n.name == name)
    return [p for p, row in enumerate(cl.spec.vbmap) if row and row[0] == index]


def _final(lines: str) -> dict[str, tuple[str, object]]:
    """Each key's last change in a tail's JSON lines (in seq order within a partition)."""
    out: dict[str, tuple[str, object]] = {}
    for line in lines.splitlines():
        row = json.loads(line)
        out[row["key"]] = (row["op"], row.get("value"))
    return out


def test_a_node_down_holds_back_only_its_partitions(tmp_path: Path) -> None:
    cl = Cluster(tmp_path / "cl", nodes=3, replicas=1, partitions=12)
    try:
        upr("load", cl.uri(), "--docs", "900", "--update-ratio", "0.3", "--delete-ratio", "0.1")
        cl.settle()
        down = _down_partitions(cl, "n1")
        cl.kill("n1")
        t0 = time.monotonic()
        out = upr("tail", cl.uri("n0"), "--until-end", "--format", "json", "--wait", "2",
                  check=False)  # fmt: skip
        took = time.monotonic() - t0
        assert out.returncode == 1, out.stderr
        assert took < 30, took  # not the two minutes it used to wait before any output
        warning, error = out.stderr.strip().splitlines()[-2:]
        assert warning.startswith(f"upr: warning: {len(down)} of 12 partitions have no "
                                  "reachable active node")  # fmt: skip
        assert ",".join(map(str, down[:8])) in warning
        assert error.startswith("upr: error: partitions ") and "for 2s" in error
        seen = {json.loads(line)["partition"] for line in out.stdout.splitlines()}
        assert seen == set(range(12)) - set(down)  # every healthy partition streamed
    finally:
        cl.stop()


def test_a_failover_during_the_wait_completes_the_tail(tmp_path: Path) -> None:
    cl = Cluster(tmp_path / "cl", nodes=3, replicas=1, partitions=12)
    try:
        upr("load", cl.uri(), "--docs", "900", "--update-ratio", "0.3", "--delete-ratio", "0.1")
        cl.settle()
        whole = upr("tail", cl.uri("n0"), "--until-end", "--format", "json").stdout
        want = _final(whole)
        cl.kill("n1")
        with spawn_upr("tail", cl.uri("n0"), "--until-end", "--format", "json",
                       "--wait", "60") as proc:  # fmt: skip
            assert proc.stderr is not None
            assert "no reachable active node" in proc.stderr.readline()  # at once
            cl.cli("failover", "n1")
            stdout, stderr = proc.communicate(timeout=90)
        assert proc.returncode == 0, stderr
        assert _final(stdout) == want  # the failed-over partitions' replicas held it all
    finally:
        cl.stop()
