"""`upr backup` against a real node into a repository on a full disk (a 2 MiB tmpfs).

The run fails with one line that names the path, says the disk is full and how much
space is left, and exits 74 (README "Errors and exit codes"), without a traceback. The
repository lists exactly the backups it listed before, their files untouched and no lock
left; once space is freed the same command succeeds and restores to the node's state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import node_content_hash, wait_persisted
from upr_cli.errors import ExitCode
from upr_cli.store import Store


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted on a fresh directory (skipped where it cannot be mounted)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount(8) here")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(path: Path, leave: int) -> None:
    """Create `path` taking all but `leave` bytes of its file system."""
    st = os.statvfs(path.parent)
    size = st.f_bavail * st.f_frsize - leave
    assert size > 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def committed(repo: Path) -> dict[str, bytes]:
    """Every file of the repository outside its interrupted runs' directories, by path."""
    info = json.loads(upr("info", "--repo", str(repo), "--json").stdout)
    skip = {repo / v["bucket"] / d for v in info["buckets"] for d in v.get("incomplete", [])}
    return {str(p.relative_to(repo)): p.read_bytes() for p in sorted(repo.rglob("*"))
            if p.is_file() and not any(d in p.parents for d in skip)}  # fmt: skip


def backups(repo: Path) -> list[dict[str, object]]:
    info = json.loads(upr("info", "--repo", str(repo), "--json").stdout)
    return list(info["buckets"][0]["backups"])


def test_backup_on_a_full_disk(node: Node, small_disk: Path, tmp_path: Path) -> None:
    repo = small_disk / "repo"
    upr("load", node.uri, "--docs", "300")
    wait_persisted(node.uri)
    upr("backup", node.uri, "--repo", str(repo), "--no-progress")
    before, listed = committed(repo), backups(repo)
    assert len(listed) == 1

    filler = small_disk / "filler"
    fill(filler, leave=64 * 1024)
    upr("load", node.uri, "--docs", "20000", "--seed", "2")  # ~0.6 MB of segments
    wait_persisted(node.uri)
    proc = upr("backup", node.uri, "--repo", str(repo), "--no-progress", check=False)

    err = proc.stderr
    assert proc.returncode == ExitCode.IO_ERROR == 74, err
    assert err.startswith("upr: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert str(repo) in err and "no space left on device: the disk is full" in err, err
    assert "free on its file system" in err, err
    # nothing half-written is visible: the same backups, their files untouched, no lock
    assert backups(repo) == listed
    assert committed(repo) == before
    assert not (repo / "default" / "lock").exists()
    assert upr("verify", "--repo", str(repo), check=False).returncode == 0

    filler.unlink()
    again = json.loads(upr("backup", node.uri, "--repo", str(repo), "--json").stdout)
    assert again["full"] is False and again["items"] == 20000
    assert [b["backup_id"] for b in backups(repo)] == [listed[0]["backup_id"], again["backup_id"]]
    assert upr("verify", "--repo", str(repo), check=False).returncode == 0
    db = tmp_path / "restored.db"
    upr("restore", "--repo", str(repo), f"sqlite:{db}")
    with Store(db) as s:
        assert (s.count(), s.content_hash()) == node_content_hash(node.uri)
