"""examples/failover-walkthrough.sh: the UPR design specification's "UPR in action on a
Cluster" (its figures 1-9), with the specification's numbers."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_walkthrough_matches_the_specification(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    env = os.environ | {"UPR": str(bin_dir / "upr"), "PY": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "examples" / "failover-walkthrough.sh"),
                        str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1].split()
    assert last[0] == "walkthrough"
    got = dict(kv.split("=", 1) for kv in last[1:])
    # B persisted 6 and 7 of the snapshot 6-8: its new entry is at its last complete one
    assert got["b_entry_seq"] == "5"
    # C had the snapshots 1-5 and 6-8 whole on A's branch: it rolls back to B's entry,
    # a snapshot boundary it received ...
    assert got["c_rollback_to"] == "5"
    # ... repairs the master with the one write only it held (the update of b and the
    # delete of c B holds too), and ends equal to B (and D)
    assert "1 written" in r.stdout and "2 already-there" in r.stdout
    assert got["replicas_equal"] == "true"
    assert "n2 partition 0: would roll back to 5 against its active" in r.stdout
    # the workload's updates and deletes, as B holds them (A's 9-11 are gone)
    with sqlite3.connect(tmp_path / "cluster" / "n1" / "default.sqlite3") as c:
        # the node's keys are qualified: 0x00 (the default collection), then the key
        docs = {k[1:].decode(): (seq, bool(d)) for k, seq, d in
                c.execute("SELECT key, seq, deleted FROM docs")}  # fmt: skip
    assert docs == {"doc-a": (8, False), "doc-b": (6, False), "doc-c": (7, True),
                    "doc-d": (5, False), "doc-e": (11, False), "doc-g": (12, True),
                    "doc-h": (13, False)}  # fmt: skip
