"""Issue 32: `backup --dry-run` says what a backup would take and writes nothing;
`restore --include-data/--exclude-data` (and `--collections`) restore a subset of the
collections of a backup. Against one real `upr serve` node (created with
`--create-collections`), a real repository and SQLite targets."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli.json_convention import problems
from tests.e2e.conftest import Node
from tests.e2e.e2e_helpers import wait_persisted
from tests.repo.repo_helpers import commit_backup, run_upr
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.repo import BackupId, Repository

COLLECTIONS = "app.users,app.logs,other.x"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    data = tmp_path_factory.mktemp("opts") / "node"
    n = Node(data, "--flush-interval", "0.02", "--create-collections", COLLECTIONS,
             partitions=4).start()  # fmt: skip
    try:
        yield n
    finally:
        n.close()


def upr(capsys: pytest.CaptureFixture[str], *args: str, code: int = 0) -> str:
    got, out, err = run_upr(capsys, *args)
    assert got == code, (args, out, err)
    return out if code == 0 else err


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every directory (None) under root, by relative path."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}  # fmt: skip


def _end_seqs(repo: Path, backup_id: str) -> dict[int, tuple[int, int]]:
    m = Repository(repo).read_manifest("default", BackupId.parse(backup_id))
    return {e.partition: (e.start_seq, e.end_seq) for e in m.partitions}


def _seqs(plan: dict[str, Any]) -> dict[int, tuple[int, int]]:
    return {s["partition"]: (int(s["from"]), int(s["to"])) for s in plan["seqs"]}


def test_backup_dry_run_writes_nothing(
    node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    upr(capsys, "load", node.uri, "--docs", "60", "--collections",
        f"{COLLECTIONS},_default._default", "--no-progress")  # fmt: skip
    wait_persisted(node.uri)
    repo = tmp_path / "repo"
    # a new repository: nothing created, a full backup of every partition from 0
    plan = json.loads(upr(capsys, "backup", node.uri, "--repo", str(repo), "--dry-run", "--json"))
    assert not repo.exists()
    assert problems(plan) == []  # docs/output.md: seqs as strings, counts as integers
    assert (plan["dry_run"], plan["full"], plan["parent"]) == (True, True, None)
    assert plan["repository_exists"] is False and plan["partition_count"] == 4
    assert plan["collection_count"] == 4 and plan["rollbacks"] == []
    seqs = _seqs(plan)
    assert all(lo == 0 for lo, _hi in seqs.values())
    assert plan["estimated_items"] == sum(hi for _lo, hi in seqs.values()) >= 60
    # the backup then takes exactly those seqs
    first = json.loads(upr(capsys, "backup", node.uri, "--repo", str(repo), "--json",
                           "--no-progress"))  # fmt: skip
    assert {p: hi for p, (_lo, hi) in _end_seqs(repo, first["backup_id"]).items()} == {
        p: hi for p, (_lo, hi) in seqs.items()
    }
    assert first["items"] <= plan["estimated_items"]

    # an existing repository: byte-identical before and after, no lock left
    upr(capsys, "load", node.uri, "--docs", "10", "--prefix", "late", "--collections",
        "app.users", "--no-progress")  # fmt: skip
    wait_persisted(node.uri)
    before = _tree(repo)
    plan = json.loads(upr(capsys, "backup", node.uri, "--repo", str(repo), "--dry-run", "--json"))
    text = upr(capsys, "backup", node.uri, "--repo", str(repo), "--dry-run")
    assert _tree(repo) == before
    assert (plan["full"], plan["parent"], plan["repository_exists"]) == (
        False, first["backup_id"], True)  # fmt: skip
    assert plan["estimated_items"] == 10 and plan["partitions_with_changes"] >= 1
    assert f"an incremental backup after {first['backup_id']}" in text
    assert text.startswith("dry run, nothing written: an incremental backup")
    assert "at most 10 items" in text
    # the incremental backup takes the seqs the dry run named
    second = json.loads(upr(capsys, "backup", node.uri, "--repo", str(repo), "--json",
                            "--no-progress"))  # fmt: skip
    assert second["items"] == 10
    took = _end_seqs(repo, second["backup_id"])
    assert {p: r for p, r in _seqs(plan).items() if r[1] > r[0]} == took
    # --full: a full backup's plan, still nothing written
    before = _tree(repo)
    full = json.loads(upr(capsys, "backup", node.uri, "--repo", str(repo), "--dry-run", "--full",
                          "--json"))  # fmt: skip
    assert full["full"] is True and full["estimated_items"] == sum(
        hi for _lo, hi in _seqs(full).values()
    )
    assert _tree(repo) == before
    # what a dry run cannot do is a usage error
    err = upr(capsys, "backup", node.uri, "--repo", str(repo), "--dry-run", "--follow", code=2)
    assert "--dry-run writes nothing" in err and err.count("\n") == 1
    assert _tree(repo) == before


def test_backup_dry_run_names_the_rollbacks_it_would_record(
    node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A chain whose partitions 0 and 1 ended on a branch the live node never had (another
    failover uuid, seqs above its own): the backup would roll them back to 0."""
    repo = Repository(tmp_path / "repo")
    repo.init()
    rows = {p: [DcpRecord(OP_MUTATION, p, s, s, s, 0, 0, 0, 0, b"k%d" % s, b"v", 0, 0, b"")
                for s in range(1, 10_001, 1000)] for p in (0, 1)}  # fmt: skip
    commit_backup(repo, 0, rows)
    before = _tree(repo.path)
    plan = json.loads(upr(capsys, "backup", node.uri, "--repo", str(repo.path), "--dry-run",
                          "--json", "--partitions", "0-1"))  # fmt: skip
    assert _tree(repo.path) == before
    assert plan["full"] is False and plan["partition_count"] == 2
    got = {rb["partition"]: (rb["from"], rb["to"], rb["during_run"]) for rb in plan["rollbacks"]}
    assert got == {0: ("9001", "0", False), 1: ("9001", "0", False)}
    assert all(lo == 0 for lo, _hi in _seqs(plan).values())  # streamed again from the start
    text = upr(capsys, "backup", node.uri, "--repo", str(repo.path), "--dry-run",
               "--partitions", "0-1")  # fmt: skip
    assert "2 rollbacks it would record" in text and "9001" in text


@pytest.fixture(scope="module")
def backed_up(node: Node, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository holding 20 documents in each of 4 collections."""
    from upr_cli.cli.app import main

    repo = tmp_path_factory.mktemp("filtered") / "repo"
    args = [["load", node.uri, "--docs", "80", "--prefix", "f", "--collections",
             f"{COLLECTIONS},_default._default", "--no-progress"],
            ["backup", node.uri, "--repo", str(repo), "--no-progress"]]  # fmt: skip
    for argv in args:
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0, argv
        wait_persisted(node.uri)
    return repo


def _by_collection(db: Path) -> Counter[str]:
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT s.name || '.' || c.name FROM documents AS d "
                         "JOIN collections AS c ON c.id = d.collection_id "
                         "JOIN scopes AS s ON s.id = c.scope_id "
                         "WHERE d.deleted = 0 AND CAST(d.key AS TEXT) LIKE 'f-%'"
                         ).fetchall()  # fmt: skip
    return Counter(r[0] for r in rows)


def test_restore_a_subset_of_collections(
    backed_up: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    everything = tmp_path / "all.db"
    upr(capsys, "restore", "--repo", str(backed_up), f"sqlite:{everything}", "--no-progress")
    whole = _by_collection(everything)
    with sqlite3.connect(everything) as c:  # the whole state: its positions, for a replay
        assert c.execute("SELECT count(*) FROM partitions WHERE seq > 0").fetchone() == (4,)
    assert set(whole) == {"app.users", "app.logs", "other.x", "_default._default"}

    cases = {
        ("--include-data", "app.users"): {"app.users"},
        ("--collections", "app"): {"app.users", "app.logs"},  # a scope: all of its own
        ("--include-data", "app.logs,other.x"): {"app.logs", "other.x"},
        ("--exclude-data", "app.logs"): {"app.users", "other.x", "_default._default"},
    }
    for i, (opt, kept) in enumerate(cases.items()):
        db = tmp_path / f"sub{i}.db"
        summary = json.loads(upr(capsys, "restore", "--repo", str(backed_up), f"sqlite:{db}",
                                 *opt, "--json", "--no-progress"))  # fmt: skip
        assert problems(summary) == []
        got = _by_collection(db)
        assert got == Counter({c: whole[c] for c in kept}), (opt, got)
        left = sum(n for c, n in whole.items() if c not in kept)
        assert summary["excluded"] >= left and summary["dropped_records"] == 0, (opt, summary)
        # a store holding a subset records no positions: a replay would miss the rest
        with sqlite3.connect(db) as c:
            assert c.execute("SELECT count(*) FROM partitions WHERE seq > 0").fetchone() == (0,)

    # the text summary says what was left out
    text = upr(capsys, "restore", "--repo", str(backed_up), f"sqlite:{tmp_path}/t.db",
               "--exclude-data", "other", "--dry-run", "--no-progress")  # fmt: skip
    assert "of collections --include-data/--exclude-data left out" in text
    assert not (tmp_path / "t.db").exists()


def test_restore_refuses_a_filter_the_backup_cannot_take(
    backed_up: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    db = tmp_path / "x.db"
    for opt, why in [
        (["--include-data", "app.nope"], "--include-data: the backup holds no collection app.nope"),
        (["--exclude-data", "nope"], "--exclude-data: the backup holds no collection nope"),
        (["--include-data", "app", "--exclude-data", "app.logs"], "cannot be used together"),
        (["--exclude-data", "app,other,_default"], "leaves no collection to restore"),
    ]:
        err = upr(capsys, "restore", "--repo", str(backed_up), f"sqlite:{db}", *opt, code=2)
        assert why in err and err.count("\n") == 1, (opt, err)
        assert not db.exists()
