"""Backup, verify and tail keep their memory bounded in bytes (issue 27, docs/design.md
"Performance"): 20 documents of 5 MB of random (barely compressible) values, backed up
from a real node, the repository verified and the bucket tailed, each with the default
--memory-limit (the tail with the smallest, whose window is smaller than one document:
each goes through alone); each process's peak RSS stays under 300 MB."""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from pathlib import Path

from tests.e2e.conftest import Node
from tests.e2e.e2e_helpers import run, set_keys, wait_persisted
from tests.e2e.memory_helpers import peak_mb

DOCS, SIZE = 20, 5 * 1024 * 1024
LIMIT_MB = 300


def test_backup_verify_and_tail_of_large_documents_stay_under_300_mb(
    node_factory: Callable[..., Node], tmp_path: Path
) -> None:
    src = node_factory("--flush-interval", "0.02", partitions=4).start()
    rng = random.Random(27)
    run(set_keys(src.uri, {f"big-{i:02d}".encode(): b'{"v":"' + base64.b64encode(
        rng.randbytes(SIZE * 3 // 4)) + b'"}' for i in range(DOCS)}))  # fmt: skip
    wait_persisted(src.uri, timeout=60)
    repo = tmp_path / "repo"

    peak, _ = peak_mb("backup", src.uri, "--repo", str(repo), "--json")
    print(f"backup: peak RSS {peak:.0f} MB")
    assert peak < LIMIT_MB, f"backup peaked at {peak:.0f} MB"

    peak, _ = peak_mb("verify", "--repo", str(repo), "--json")
    print(f"verify: peak RSS {peak:.0f} MB")
    assert peak < LIMIT_MB, f"verify peaked at {peak:.0f} MB"

    # the smallest limit: a flow-control window smaller than one document, which still
    # goes through, alone
    peak, out = peak_mb("tail", src.uri, "--until-end", "--format", "json",
                        "--memory-limit", "16MB")  # fmt: skip
    assert out.count("\n") == DOCS
    print(f"tail: peak RSS {peak:.0f} MB")
    assert peak < LIMIT_MB, f"tail peaked at {peak:.0f} MB"
