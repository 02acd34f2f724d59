"""Restore and load keep their memory bounded in bytes (issue 27, docs/design.md
"Performance"): 20 documents of 5 MB of random (barely compressible) values, all in one
partition, backed up from a real node and restored into a fresh node and into SQLite
with the default --memory-limit; each restore process's peak RSS stays under 300 MB, and
so does the node's that takes the restore. `upr load` of such documents stays under it
too."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import run, set_keys, wait_persisted
from tests.e2e.memory_helpers import large_values, peak_mb, vm_hwm_mb

DOCS, SIZE = 20, 5 * 1024 * 1024
LIMIT_MB = 300


def measured(*args: str) -> tuple[float, dict[str, object]]:
    """(peak RSS in MB, the --json summary) of one `upr ARGS` process."""
    peak, out = peak_mb(*args, "--json", "--no-progress")
    return peak, json.loads(out)


def test_restore_of_large_documents_stays_under_300_mb(node_factory: Callable[..., Node],
                                                        tmp_path: Path) -> None:  # fmt: skip
    src = node_factory("--flush-interval", "0.02", partitions=1, name="src").start()
    values = large_values(DOCS, SIZE)
    run(set_keys(src.uri, values))
    del values
    wait_persisted(src.uri, timeout=60)
    repo = tmp_path / "repo"
    upr("backup", src.uri, "--repo", str(repo), "--json")
    src.stop()

    dst = node_factory("--flush-interval", "0.02", partitions=1, name="dst").start()
    peak, summary = measured("restore", "--repo", str(repo), dst.uri)
    assert summary["written"] == DOCS and summary["documents"] == DOCS
    assert isinstance(summary["bytes"], int) and summary["bytes"] > DOCS * SIZE
    node_peak = vm_hwm_mb(dst.proc.pid) if dst.proc is not None else 0.0
    print(f"restore into a node: peak RSS {peak:.0f} MB; the node's {node_peak:.0f} MB")
    assert peak < LIMIT_MB, f"restore into a node peaked at {peak:.0f} MB"
    assert node_peak < LIMIT_MB, f"the node peaked at {node_peak:.0f} MB taking the restore"

    store_peak, stored = measured("restore", "--repo", str(repo), f"sqlite:{tmp_path / 'x.db'}")
    assert stored["written"] == DOCS
    print(f"restore into SQLite: peak RSS {store_peak:.0f} MB")
    assert store_peak < LIMIT_MB, f"restore into SQLite peaked at {store_peak:.0f} MB"


def test_load_of_large_documents_stays_under_300_mb(node_factory: Callable[..., Node]) -> None:
    dst = node_factory("--flush-interval", "0.02", partitions=4).start()
    peak, summary = measured("load", dst.uri, "--docs", "40", "--size", str(SIZE))
    assert summary["items"] == 40 and summary["errors"] == 0
    assert isinstance(summary["bytes"], int) and summary["bytes"] > 40 * SIZE
    print(f"load: peak RSS {peak:.0f} MB")
    assert peak < LIMIT_MB, f"load of 40 documents of 5 MB peaked at {peak:.0f} MB"
