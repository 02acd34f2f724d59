"""upr restore into a second node keeps cas, rev seq, flags, expiry; --at; dry run; corruption."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import docs, node_content_hash, wait_persisted


def load_and_back_up(src: Node, repo: Path, *load: str, persisted: bool = True) -> None:
    """`upr load` with these options, then a backup of `src` into `repo` (by default once
    the load is persisted)."""
    upr("load", src.uri, *load)
    if persisted:
        wait_persisted(src.uri)
    upr("backup", src.uri, "--repo", str(repo))


def test_restore_to_a_second_node_keeps_metadata(node_factory: type[Node], tmp_path: Path) -> None:
    src = node_factory("--flush-interval", "0.02", name="src").start()
    dst = node_factory("--flush-interval", "0.02", name="dst").start()
    repo = tmp_path / "repo"
    load_and_back_up(src, repo, "--docs", "1200", "--update-ratio", "0.3", "--delete-ratio", "0.1")
    first = docs(src.uri)
    load_and_back_up(src, repo, "--docs", "300", "--update-ratio", "0.5", "--delete-ratio", "0.2",
                     "--seed", "9", "--prefix", "doc", persisted=False)  # fmt: skip

    plan = json.loads(upr("restore", "--repo", str(repo), "--dry-run", "--json", dst.uri).stdout)
    assert plan["dry_run"] and plan["written"] == 0 and plan["documents"] == len(docs(src.uri))
    assert docs(dst.uri) == {}

    assert [(c["source"], c["target"], c["status"]) for c in plan["collections"]] == [
        ("_default._default", "_default._default", "exists")
    ]

    out = json.loads(upr("restore", "--repo", str(repo), "--json", dst.uri).stdout)
    assert out["errors"] == 0 and out["errors_by_status"] == {}
    assert out["written"] == out["documents"]
    # the same partition count on both sides: every key where it was
    assert (out["source_partitions"], out["target_partitions"], out["rehash"]) == (16, 16, False)
    assert docs(dst.uri) == docs(src.uri)  # values, cas, rev seq, flags, expiry

    # with the deletions written as tombstones too, restoring the older backup over it
    # changes nothing: the newer versions (and tombstones) win conflict resolution
    upr("restore", "--repo", str(repo), "--include-tombstones", dst.uri)
    older = json.loads(upr("restore", "--repo", str(repo), "--at", "oldest", "--json",
                           dst.uri).stdout)  # fmt: skip
    assert older["conflicts"] > 0 and docs(dst.uri) == docs(src.uri)
    # --force-updates writes the older state over it (keys deleted since stay as they are)
    upr("restore", "--repo", str(repo), "--at", "oldest", "--force-updates", dst.uri)
    now = docs(dst.uri)
    assert all(now[k] == v for k, v in first.items() if k in now)


def test_a_corrupt_segment_stops_the_restore_unless_skipped(
    node_factory: type[Node], tmp_path: Path
) -> None:
    src = node_factory("--flush-interval", "0.02", name="src").start()
    dst = node_factory("--flush-interval", "0.02", name="dst").start()
    repo = tmp_path / "repo"
    load_and_back_up(src, repo, "--docs", "500")
    seg = sorted(repo.glob("default/*/p*.seg"))[2]
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 1
    seg.write_bytes(bytes(data))
    bad = upr("restore", "--repo", str(repo), dst.uri, check=False)
    assert bad.returncode == 1 and seg.name in bad.stderr and bad.stderr.count("\n") == 1
    skipped = upr("restore", "--repo", str(repo), "--skip-corrupt", "--json", dst.uri, check=False)
    assert skipped.returncode == 4  # done, but partial: the partition left out is named
    report = json.loads(skipped.stdout)
    assert len(report["skipped"]) == 1 and seg.name in report["skipped"][0]
    assert report["written"] > 0


def test_restore_into_sqlite_matches_the_node(node_factory: type[Node], tmp_path: Path) -> None:
    from upr_cli.store import Store

    src = node_factory("--flush-interval", "0.02").start()
    repo = tmp_path / "repo"
    load_and_back_up(src, repo, "--docs", "1500", "--update-ratio", "0.3", "--delete-ratio", "0.1")
    first = node_content_hash(src.uri)
    load_and_back_up(src, repo, "--docs", "400", "--update-ratio", "0.5", "--delete-ratio", "0.2",
                     "--seed", "4", persisted=False)  # fmt: skip
    db = tmp_path / "latest.db"
    out = json.loads(upr("restore", "--repo", str(repo), f"sqlite:{db}", "--json").stdout)
    assert out["errors"] == 0 and out["errors_by_status"] == {}
    assert out["written"] == out["documents"] + out["deletions"]
    # a store has no partition count of its own: the source's partitions, no rehash
    assert (out["source_partitions"], out["target_partitions"], out["rehash"]) == (16, None, False)
    with Store(db) as s:
        assert (s.count(), s.content_hash()) == node_content_hash(src.uri)
        assert len(s.positions()) == 16  # a replay could go on from the backup
    old = tmp_path / "oldest.db"
    upr("restore", "--repo", str(repo), "--at", "oldest", f"sqlite:{old}")
    with Store(old) as s:
        assert (s.count(), s.content_hash()) == first
    bad = upr("restore", "--repo", str(repo), "--force-updates", f"sqlite:{db}", check=False)
    assert bad.returncode == 2
