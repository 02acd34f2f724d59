"""`upr merge` on one machine: the merged backup restores to the chain's state, through the
newest and an older backup; a bad `--through` is one line; a merge killed anywhere leaves
the repository as it was, and the next merge succeeds."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.repo.repo_helpers import BUCKET, commit_backup
from upr_cli.errors import UprError
from upr_cli.jobs.backup import _reusable
from upr_cli.jobs.inspect import verify
from upr_cli.jobs.merge import merge
from upr_cli.jobs.restore import restore_to_store
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import BackupId, Repository
from upr_cli.store import Store

PARTS = (0, 1, 2, 3, 5)


def rows(seqs: Sequence[int], *, keys: int, size: int = 40, delete_every: int = 0,
         salt: int = 0) -> list[DcpRecord]:  # fmt: skip
    """Records at `seqs`, cycling over `keys` keys; every `delete_every`-th a deletion."""
    out = []
    for i, s in enumerate(seqs):
        delete = delete_every and i % delete_every == delete_every - 1
        value = b"" if delete else (b'{"v":%d,"s":%d}' % (salt, s)).ljust(size, b" ")
        op = OP_DELETION if delete else OP_MUTATION
        out.append(DcpRecord(op, 0, s, s, (salt << 32) + s, 3, 0, 0, 0 if delete else 1,
                             b"k%05d" % (s % keys), value, 0, 0, b""))  # fmt: skip
    return out


def build_chain(root: Path, n: int = 60, size: int = 40) -> Repository:
    """Four backups of `PARTS`: a full one; updates and deletes; one of three partitions
    only, partition 0 rolled back below the previous end (its records above 1.5n are
    cut); more updates."""
    repo = Repository(root)
    repo.init()
    commit_backup(repo, 0, {p: rows(range(1, n + 1), keys=n, size=size) for p in PARTS})
    commit_backup(repo, 1, {p: rows(range(n + 1, 2 * n + 1), keys=n // 2, size=size,
                                    delete_every=4, salt=1) for p in PARTS},
                  start=n)  # fmt: skip
    half = n + n // 2  # partition 0 goes on from 1.5n: backup 1's records above are cut
    commit_backup(repo, 2, {0: rows(range(half + 1, 2 * n + 11), keys=n // 3, size=size,
                                    salt=2)}, start=half)  # fmt: skip
    last = rows(range(2 * n + 11, 2 * n + 31), keys=n, size=size, delete_every=3, salt=3)
    commit_backup(repo, 3, {0: last}, start=2 * n + 10)
    return repo


def upr(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "upr_cli", *args], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    if check and proc.returncode:
        raise AssertionError(f"upr {args[0]} exited {proc.returncode}: {proc.stderr}")
    return proc


def verified(repo: Path) -> None:
    """`upr verify`, in this process: no problem."""
    assert [p for r in verify(repo) for p in r.unrepaired] == []


def state(repo: Path, at: str, db: Path) -> tuple[list[Any], dict[int, Any]]:
    """The documents (tombstones too) and positions a restore of `at` writes."""
    if db.exists():
        db.unlink()
    restore_to_store(repo, db, at=at)
    with Store(db, create=False) as s:
        return list(s.documents()), s.positions()


def ids(repo: Path) -> list[str]:
    return [str(m.backup_id) for m in Repository(repo).manifests(BUCKET)]


def test_merge_restores_to_the_chains_state_through_newest_and_older(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    build_chain(root)
    before = ids(root)
    states = {b: state(root, b, tmp_path / "s.db") for b in before}
    out = json.loads(upr("merge", "--repo", str(root), "--json").stdout)
    assert set(out) == {"schema", "backup_id", "through", "merged", "partition_count", "items",
                        "bytes_written", "seconds", "items_per_s"}  # fmt: skip
    assert (out["through"], out["merged"], out["partition_count"]) == (before[-1], 4, len(PARTS))
    merged = Repository(root).read_manifest(BUCKET, Repository(root).committed(BUCKET)[-1])
    assert str(merged.backup_id) == out["backup_id"] and merged.full and merged.parent is None
    assert merged.merged_through is None
    assert sum(e.records for e in merged.partitions) == out["items"]
    assert state(root, out["backup_id"], tmp_path / "m.db") == states[before[-1]]
    # through backup 1, which backup 2 cuts at 90 (a rollback): partition 0 is merged in
    # two segments, the latest of each document up to 90 and above, so the state at
    # backup 2 and later (the merge cut at 90) stays the chain's
    cut = merge(root, through=before[1]).to_json()
    m = Repository(root).read_manifest(BUCKET, BackupId.parse(cut["backup_id"]))
    assert [(s.first_seq <= 90, s.last_seq <= 90) for s in m.partition(0).segments] == [
        (True, True), (False, False)]  # fmt: skip
    assert [len(e.segments) for e in m.partitions[1:]] == [1] * (len(PARTS) - 1)
    assert state(root, cut["backup_id"], tmp_path / "c.db") == states[before[1]]
    # through an older backup: right after it, and every state stays what it was
    older = merge(root, through=before[2][:15]).to_json()
    assert older["through"] == before[2] and older["merged"] == 4  # the merge through 1 too
    now = ids(root)
    assert now.index(older["backup_id"]) == now.index(before[2]) + 1
    m = Repository(root).read_manifest(BUCKET, BackupId.parse(older["backup_id"]))
    assert str(m.merged_through) == before[2]
    assert state(root, older["backup_id"], tmp_path / "o.db") == states[before[2]]
    first = merge(root, through="oldest").to_json()
    assert first["through"] == before[0] and first["merged"] == 1
    for b in before:
        assert state(root, b, tmp_path / "s.db") == states[b], b
    verified(root)


def test_a_bad_through_is_one_line(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    build_chain(root, n=8)
    proc = upr("merge", "--repo", str(root), "--through", "20991121T", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "upr: error: --through: no committed backup '20991121T' (see `upr info`)"
    ]
    with pytest.raises(UprError, match="not a upr repository"):
        merge(tmp_path / "none")
    assert ids(root) == ids(root)[:4]  # nothing committed


def kill_at(root: Path, point: tuple[str, int], known: set[str]) -> bool:
    """Run `upr merge` and SIGKILL it at `point`: ("dir", 0) once its backup directory
    exists, ("temp", 0) while a segment is being written, ("segments", k) once k segments
    are published. False when it finished first."""
    bdir = root / BUCKET
    proc = subprocess.Popen([sys.executable, "-m", "upr_cli", "merge", "--repo", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while proc.poll() is None:
            new = [d for d in os.listdir(bdir) if d not in known and d[:1].isdigit()]
            names = os.listdir(bdir / new[0]) if new else []
            kind, k = point
            published = sum(n.endswith(".seg") and not n.startswith(".") for n in names)
            temp = any(".tmp-" in n for n in names)
            if new and (kind == "dir" or (kind == "temp" and temp) or published >= k > 0):
                os.kill(proc.pid, signal.SIGKILL)
                break
        return proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
def test_a_killed_merge_leaves_every_state_and_the_next_merge_succeeds(tmp_path: Path) -> None:
    """SIGKILL at seeded random points of a merge of several partitions (its directory
    made, a segment being written, k segments published); after each, the repository
    verifies, every backup restores as before, and a last merge succeeds and sweeps what
    the killed ones left."""
    root = tmp_path / "repo"
    build_chain(root, n=120, size=300)
    before = ids(root)
    states = {b: state(root, b, tmp_path / "s.db") for b in before}
    rng = random.Random(29)
    points = [("dir", 0), ("temp", 0), *(("segments", k) for k in range(1, len(PARTS)))]
    for point in rng.sample(points, 3):
        assert kill_at(root, point, set(before) | set(os.listdir(root / BUCKET))), point
        assert ids(root) == before, point  # nothing committed
        assert Repository(root).incomplete(BUCKET), point  # it left its directory
        verified(root)
        for b in before:
            assert state(root, b, tmp_path / "s.db") == states[b], (point, b)
    # the next backup never resumes a killed merge's directory with its segments
    (left,) = Repository(root).incomplete(BUCKET)
    d = Repository(root).backup_dir(BUCKET, left)
    assert kill_at(root, ("segments", 2), set(os.listdir(root / BUCKET)))
    assert Repository(root).resumable(BUCKET) is not None
    newest = Repository(root).backup_dir(BUCKET, Repository(root).incomplete(BUCKET)[-1])
    assert sum(n.endswith(".seg") for n in os.listdir(newest)) >= 2 and d != newest
    assert _reusable(newest, list(PARTS), {}, Repository(root).storage) == {}
    assert not [n for n in os.listdir(newest) if n.endswith(".seg")]
    out = merge(root).to_json()
    assert ids(root) == [*before, out["backup_id"]]
    assert Repository(root).incomplete(BUCKET) == []  # the killed runs' directories swept
    verified(root)
    assert state(root, out["backup_id"], tmp_path / "m.db") == states[before[-1]]


def test_a_second_merge_through_the_same_backup_says_it_exists(tmp_path: Path) -> None:
    """The merge through an older B sorts right after B; asked again, upr says that
    backup already is the merge (exit 1, one line), not a placement error."""
    root = tmp_path / "repo"
    build_chain(root)
    b = ids(root)[1]
    merged = json.loads(upr("merge", "--repo", str(root), "--through", b, "--json").stdout)
    again = upr("merge", "--repo", str(root), "--through", b, check=False)
    assert again.returncode == 1, again.stderr
    assert again.stderr.count("\n") == 1, again.stderr
    assert f"backup {merged['backup_id']} already is the merge through it" in again.stderr
