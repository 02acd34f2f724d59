"""`upr verify` knows collections: a backup's records per collection must agree with its
manifest's `collection_items`, and every collection id its segments hold must be one the
chain names (formats/repository.md §5.9)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, upr
from upr_cli.collections import CollectionsManifest
from upr_cli.repo import Repository
from upr_cli.repo.layout import MANIFEST_COPY, MANIFEST_FILE


@pytest.fixture
def repo(node_factory: type[Node], tmp_path: Path) -> Path:
    src = node_factory("--create-collections", "app.users,app.orders", name="src").start()
    upr("load", src.uri, "--docs", "600", "--collections", "app.users,app.orders",
        "--update-ratio", "0.2", "--delete-ratio", "0.1")  # fmt: skip
    out = tmp_path / "repo"
    upr("backup", src.uri, "--repo", str(out))
    return out


def _rewrite(repo: Path, **changes: object) -> None:
    """Commit the backup's manifest again with `changes` (as a tool with a bug would)."""
    r = Repository(repo)
    (m,) = r.manifests("default")
    d = r.backup_dir("default", m.backup_id)
    (d / MANIFEST_FILE).unlink()
    (d / MANIFEST_COPY).unlink()
    r.write_manifest(dataclasses.replace(m, **changes))


def _problems(repo: Path) -> list[dict[str, object]]:
    proc = upr("verify", "--repo", str(repo), "--json", check=False)
    assert proc.returncode == (0 if '"ok": true' in proc.stdout else 1), proc.stderr
    return [p for b in json.loads(proc.stdout)["buckets"] for p in b["problems"]]


def test_a_backup_with_collections_verifies(repo: Path) -> None:
    assert _problems(repo) == []


def test_counts_that_differ_from_the_manifest_are_reported(repo: Path) -> None:
    (m,) = Repository(repo).manifests("default")
    first = m.collection_items[-1]
    wrong = (*m.collection_items[:-1], dataclasses.replace(first, items=first.items + 1))
    _rewrite(repo, collection_items=wrong)
    assert [p["kind"] for p in _problems(repo)] == ["mismatch"]


def test_records_of_a_collection_nothing_names_are_reported(repo: Path) -> None:
    _rewrite(repo, collections=CollectionsManifest(), manifest_changes=())  # names forgotten
    problems = _problems(repo)
    assert [p["kind"] for p in problems] == ["collection"]
    assert "records of collection ids no manifest names: 0x" in str(problems[0]["detail"])
