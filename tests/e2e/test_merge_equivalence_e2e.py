"""`upr merge` and `upr spark merge` commit the same backup: on one chain (updates,
deletes, xattrs, expiries, a dropped collection, a rollback after an unclean restart),
through the newest and two older backups (one a later rollback cuts inside), each in
its own copy of the repository, both restore key for key to the chain's state, with the
same partition entries."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.collections_helpers import create, drop
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import wait_persisted
from upr_cli.jobs.restore import restore_to_store
from upr_cli.repo import Manifest, Repository
from upr_cli.store import Store


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Four backups: collections (one with a max TTL) and xattrs; tmp.x dropped and more
    updates and deletes; writes an unclean restart then loses; a backup after it, rolled
    back below the third's end."""
    base = tmp_path_factory.mktemp("merge-eq")
    node = Node(base / "node", "--flush-interval", "0.02", partitions=8)
    node.start()
    try:
        r = str(base / "repo")
        create(node.uri, "app.users", "tmp.x")
        create(node.uri, "app.ttl", max_ttl=3600)
        upr("load", node.uri, "--docs", "500", "--update-ratio", "0.3", "--delete-ratio", "0.1",
            "--collections", "app.users,app.ttl,tmp.x,_default._default", "--xattrs")  # fmt: skip
        wait_persisted(node.uri)
        upr("backup", node.uri, "--repo", r)
        drop(node.uri, "tmp.x")
        upr("load", node.uri, "--docs", "200", "--update-ratio", "0.5", "--delete-ratio", "0.2",
            "--seed", "2", "--collections", "app.users,_default._default")  # fmt: skip
        wait_persisted(node.uri)
        upr("backup", node.uri, "--repo", r)
        node.stop()
        node.start("--flush-interval", "3600")
        upr("load", node.uri, "--docs", "150", "--update-ratio", "0.5", "--seed", "3")
        upr("backup", node.uri, "--repo", r)
        node.kill()  # the writes since the restart were never persisted: rolled back
        node.start("--flush-interval", "0.02")
        upr("load", node.uri, "--docs", "100", "--update-ratio", "0.5", "--delete-ratio", "0.2",
            "--seed", "4", "--prefix", "after")  # fmt: skip
        wait_persisted(node.uri)
        upr("backup", node.uri, "--repo", r)
        yield base / "repo"
    finally:
        node.close()


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from upr_cli.spark.jobs import session

    s = session("local[2]", {"spark.sql.shuffle.partitions": "2"}, app="upr-merge-eq")
    yield s
    s.stop()


def restored(repo: Path, at: str, db: Path) -> tuple[Any, ...]:
    """What a restore of `at` writes: documents (tombstones too), positions, failover
    logs and collections."""
    restore_to_store(repo, db, at=at)
    with Store(db, create=False) as s:
        positions = s.positions()
        logs = {p: s.failover_log(p) for p in positions}
        return list(s.documents()), positions, logs, s.collections()


def entries(m: Manifest) -> list[tuple[Any, ...]]:
    """A merged manifest's partitions, less the segments' checksums (their headers hold
    the time they were written)."""
    return [(e.partition, e.uuid, e.failover_log, e.start_seq, e.end_seq, e.snap_start,
             e.snap_end, [(s.file, s.first_seq, s.last_seq, s.records, s.bytes)
                          for s in e.segments]) for e in m.partitions]  # fmt: skip


@pytest.mark.timeout(120)
def test_local_and_spark_merges_commit_the_same_backup(chain: Path, spark: Any,
                                                       tmp_path: Path) -> None:  # fmt: skip
    from upr_cli.spark.merge import merge as spark_merge

    ids = [str(m.backup_id) for m in Repository(chain).manifests("default")]
    rolled = Repository(chain).manifests("default")[-1]
    assert any(e.rollback is not None for e in rolled.partitions)  # the chain has one
    # the newest; the third, which the fourth cuts inside (its rollback); the second
    for n, through in enumerate((ids[-1], ids[2], ids[1])):
        local, remote = tmp_path / f"local{n}", tmp_path / f"spark{n}"
        shutil.copytree(chain, local, symlinks=True)
        shutil.copytree(chain, remote, symlinks=True)
        a = json.loads(upr("merge", "--repo", str(local), "--through", through,
                           "--json").stdout)  # fmt: skip
        b = spark_merge(spark, remote, through=through).to_json()
        for key in ("through", "merged", "partition_count", "items", "bytes_written"):
            assert a[key] == b[key], key
        ma = Repository(local).read_manifest("default", Repository(local).manifests(
            "default")[ids.index(through) + 1].backup_id)  # fmt: skip
        mb = Repository(remote).read_manifest("default", Repository(remote).manifests(
            "default")[ids.index(through) + 1].backup_id)  # fmt: skip
        assert str(ma.backup_id) == a["backup_id"] and str(mb.backup_id) == b["backup_id"]
        assert entries(ma) == entries(mb)
        assert (ma.collections, ma.collection_items, ma.merged_through, ma.totals) == (
            mb.collections, mb.collection_items, mb.merged_through, mb.totals)  # fmt: skip
        want = restored(chain, through, tmp_path / f"chain{n}.db")
        got_a = restored(local, a["backup_id"], tmp_path / f"local{n}.db")
        got_b = restored(remote, b["backup_id"], tmp_path / f"spark{n}.db")
        assert got_a == got_b  # key for key: value, cas, rev, flags, expiry, xattrs, deletions
        assert got_a == want
        assert any(d.deleted for d in got_a[0]) and any(d.xattrs for d in got_a[0])
        assert any(d.expiry for d in got_a[0])
        if through == ids[2]:  # split where the rollback cuts it, so the newest state holds
            assert any(len(e.segments) > 1 for e in ma.partitions)
            assert restored(local, ids[-1], tmp_path / f"l{n}.db") == restored(
                chain, ids[-1], tmp_path / f"c{n}.db")  # fmt: skip
