"""A lost manifest never means a silent wrong restore, and the next backup never destroys
the backup that lost it (formats/repository.md §4.1, §4.4, §8.8). Real `upr serve`, real
`upr backup` and `upr restore` processes; a chain of a full backup and two incrementals,
each after updates and deletions."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import node_content_hash, run, wait_persisted
from upr_cli.jobs.backup import backup
from upr_cli.jobs.inspect import info, verify
from upr_cli.net.bootstrap import BootstrapError
from upr_cli.net.uri import SourceUri
from upr_cli.store import Store

WHICH = {"full": 0, "middle": 1, "newest": 2}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Path, list[Any]]]:
    """(the live node, a repository of three backups, the good restore of its newest)."""
    base = tmp_path_factory.mktemp("integrity")
    node = Node(base / "node", "--flush-interval", "0.02").start()
    repo = base / "repo"
    try:
        for seed, prefix in ((1, "a"), (2, "a"), (3, "b")):
            upr("load", node.uri, "--docs", "250", "--update-ratio", "0.4", "--delete-ratio",
                "0.15", "--seed", str(seed), "--prefix", prefix)  # fmt: skip
            wait_persisted(node.uri)
            upr("backup", node.uri, "--repo", str(repo), "--no-progress")
        good = restored(repo, base / "good.db")
        assert good[0] == node_content_hash(node.uri)
        yield node, repo, good
    finally:
        node.kill()


def restored(repo: Path, db: Path, *args: str) -> list[Any]:
    """`upr restore` into SQLite: (live count, content hash), every row, the positions."""
    upr("restore", "--repo", str(repo), *args, f"sqlite:{db}")
    with Store(db) as s:
        return [(s.count(), s.content_hash()), list(s.documents()), s.positions()]


def backup_dirs(repo: Path) -> list[Path]:
    return sorted(p for p in (repo / "default").iterdir() if p.is_dir())


def _copy(good_repo: Path, tmp_path: Path, which: str) -> tuple[Path, Path, list[Path]]:
    """A copy of the good repository, the directory of backup `which` in it, its segments."""
    repo = tmp_path / "repo"
    shutil.copytree(good_repo, repo)
    d = backup_dirs(repo)[WHICH[which]]
    return repo, d, sorted(d.glob("p*.seg"))


@pytest.mark.parametrize("which", list(WHICH))
def test_a_lost_manifest_is_read_from_its_copy_and_the_next_backup_keeps_the_backup(
    chain: tuple[Node, Path, list[Any]], tmp_path: Path, which: str
) -> None:
    node, good_repo, good = chain
    repo, d, segments = _copy(good_repo, tmp_path, which)
    (d / "manifest.json").unlink()
    assert restored(repo, tmp_path / "a.db") == good  # not a smaller or older state
    out = upr("backup", node.uri, "--repo", str(repo), "--no-progress")
    assert "manifest.json: missing; rewritten from its twin" in out.stderr
    assert sorted(d.glob("p*.seg")) == segments  # nothing of it was swept
    assert (d / "manifest.json").read_bytes() == (d / "manifest.json.copy").read_bytes()
    assert [r.problems for r in verify(repo)] == [[]]
    assert len(backup_dirs(repo)) == 4


@pytest.mark.parametrize("which", ["full", "middle"])
def test_a_backup_that_lost_both_manifest_files_stops_restore_and_backup_naming_it(
    chain: tuple[Node, Path, list[Any]], tmp_path: Path, which: str
) -> None:
    node, good_repo, good = chain
    repo, d, segments = _copy(good_repo, tmp_path, which)
    for name in ("manifest.json", "manifest.json.copy"):
        (d / name).unlink()
    bad = upr("restore", "--repo", str(repo), f"sqlite:{tmp_path / 'a.db'}", check=False)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
    assert f"{d}: backup {d.name}, the parent of backup" in bad.stderr
    assert "has no manifest.json and no manifest.json.copy" in bad.stderr
    assert not (tmp_path / "a.db").exists()  # nothing was written
    refused = upr("backup", node.uri, "--repo", str(repo), "--no-progress", check=False)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert d.name in refused.stderr and "--full" in refused.stderr
    assert sorted(d.glob("p*.seg")) == segments and len(backup_dirs(repo)) == 3
    # a new chain: the broken one stays as it is, for a repair from another copy
    upr("backup", node.uri, "--repo", str(repo), "--full", "--no-progress")
    assert sorted(d.glob("p*.seg")) == segments and len(backup_dirs(repo)) == 4
    assert restored(repo, tmp_path / "b.db")[0] == good[0]


def test_the_newest_backup_that_lost_both_files_is_resumed_by_the_next_run(
    chain: tuple[Node, Path, list[Any]], tmp_path: Path
) -> None:
    """With no later backup naming it, it cannot be told from an interrupted run: the
    next backup reuses its segments, and the chain again restores the source."""
    node, good_repo, good = chain
    repo = tmp_path / "repo"
    shutil.copytree(good_repo, repo)
    d = backup_dirs(repo)[-1]
    for name in ("manifest.json", "manifest.json.copy"):
        (d / name).unlink()
    out = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json").stdout)
    assert out["reused_segments"] > 0 and out["backup_id"] == d.name
    assert backup_dirs(repo)[-1] == d and (d / "manifest.json").exists()
    assert restored(repo, tmp_path / "a.db")[:2] == good[:2]


def tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under `root` (itself included): its mtime in ns and, for a file, its bytes."""
    out: dict[str, tuple[int, bytes | None]] = {".": (root.lstat().st_mtime_ns, None)}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = (p.lstat().st_mtime_ns,
                                          p.read_bytes() if p.is_file() else None)  # fmt: skip
    return out


def test_a_backup_that_fails_before_its_first_record_leaves_the_repository_as_it_was(
    chain: tuple[Node, Path, list[Any]], tmp_path: Path
) -> None:
    """An unknown bucket, a wrong password or an unknown collection is found before
    anything is created: no phantom bucket for `info` to list (formats/repository.md §4.2)."""
    node, good_repo, _good = chain
    repo = tmp_path / "repo"
    shutil.copytree(good_repo, repo)
    before = tree(repo)
    nosuch = node.uri.replace("/default", "/nosuchbucket")
    proc = upr("backup", nosuch, "--repo", str(repo), "--no-progress", check=False)
    assert proc.returncode == 1 and "cannot select bucket 'nosuchbucket'" in proc.stderr
    proc = upr("backup", node.uri, "--repo", str(repo), "--full", "--include-data",
               "nosuch.coll", "--no-progress", check=False)  # fmt: skip
    assert proc.returncode == 1 and "unknown collection nosuch.coll" in proc.stderr
    wrong = SourceUri.parse(node.uri.replace(":s3cret-pw@", ":wrong@"))
    with pytest.raises(BootstrapError, match="authentication failed"):
        run(backup(wrong, repo))
    with pytest.raises(BootstrapError, match="cannot select bucket"):
        run(backup(SourceUri.parse(nosuch), tmp_path / "new"))
    assert tree(repo) == before
    assert not (tmp_path / "new").exists()
    assert [b["bucket"] for b in info(repo)["buckets"]] == ["default"]
