"""The storage contract (upr_cli/storage.py): one suite, run against every backend (the
local directory today), and the local backend's commit at every step of a crash."""

from __future__ import annotations

import ast
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from upr_cli.fsio import FileOps, parse_temp_name
from upr_cli.storage import LocalStorage, Storage

BACKENDS: dict[str, Callable[[], Storage]] = {"local": LocalStorage}


@pytest.fixture(params=sorted(BACKENDS))
def store(request: pytest.FixtureRequest) -> Storage:
    return BACKENDS[request.param]()


def test_write_read_and_ranges(store: Storage, tmp_path: Path) -> None:
    p = tmp_path / "a.json"
    store.write(p, b"0123456789")
    assert store.read(p) == b"0123456789"
    assert store.read(p, 3, 4) == b"3456"
    assert store.read(p, 8, 10) == b"89"  # fewer at the end
    store.write(p, b"new")  # replaces
    assert store.read(p) == b"new"
    with pytest.raises(FileNotFoundError):
        store.read(tmp_path / "missing")
    assert [e.name for e in store.list(tmp_path)] == ["a.json"]  # no temp file left


def test_write_if_absent_never_replaces(store: Storage, tmp_path: Path) -> None:
    p = tmp_path / "repo.json"
    store.write_if_absent(p, b"first")
    with pytest.raises(FileExistsError):
        store.write_if_absent(p, b"second")
    assert store.read(p) == b"first"
    assert [e.name for e in store.list(tmp_path)] == ["repo.json"]


def test_list_and_stat(store: Storage, tmp_path: Path) -> None:
    store.make_dir(tmp_path / "d")
    store.write(tmp_path / "f", b"abc")
    (tmp_path / "link").symlink_to(tmp_path / "d")
    entries = {e.name: (e.is_dir, e.is_file) for e in store.list(tmp_path)}
    assert entries == {"d": (True, False), "f": (False, True), "link": (False, False)}
    assert store.list(tmp_path / "f") == [] and store.list(tmp_path / "nothing") == []
    f = store.stat(tmp_path / "f")
    assert f is not None and f.is_file and not f.is_dir and f.size == 3
    link = store.stat(tmp_path / "link")
    assert link is not None and not link.is_dir  # the link itself
    followed = store.stat(tmp_path / "link", follow_links=True)
    assert followed is not None and followed.is_dir
    assert store.stat(tmp_path / "nothing") is None
    assert store.stat(tmp_path / "f" / "under-a-file") is None
    before = f.version
    store.write(tmp_path / "f", b"abc")  # replaced: a new version, same size
    after = store.stat(tmp_path / "f")
    assert after is not None and after.version != before


def test_directories(store: Storage, tmp_path: Path) -> None:
    d = tmp_path / "a" / "b"
    store.make_dirs(d)
    store.make_dirs(d)  # nothing when it exists
    with pytest.raises(FileExistsError):
        store.make_dir(d)
    store.write(d / "x", b"1")
    with pytest.raises(OSError):
        store.remove_dir(d)  # not empty
    store.delete(d / "x")
    store.delete(d / "x")  # nothing when missing
    store.remove_dir(d)
    store.make_dir(d)
    store.write(d / "y", b"2")
    store.sync_dir(d)
    store.delete_tree(tmp_path / "a")
    assert store.stat(tmp_path / "a") is None


def test_streaming_write_then_publish(store: Storage, tmp_path: Path) -> None:
    body = store.create(tmp_path / "body")
    store.append(body, b"middle")
    body.seek(0)
    out = store.create(tmp_path / "tmp")
    with pytest.raises(FileExistsError):
        store.create(tmp_path / "tmp")
    store.append(out, b"head-")
    store.copy(body, out)
    store.append(out, b"-tail")
    store.sync(out)
    out.close()
    body.close()
    store.replace(tmp_path / "tmp", tmp_path / "final")
    store.sync_all([tmp_path / "final"])
    with store.open_read(tmp_path / "final") as f:
        f.seek(5)
        assert f.read(6) == b"middle"
    assert store.read(tmp_path / "final") == b"head-middle-tail"


def test_lock_file_descriptor(store: Storage, tmp_path: Path) -> None:
    p = tmp_path / "lock"
    with pytest.raises(FileNotFoundError):
        store.open_lock(p, create=False)
    fd = store.open_lock(p, create=True)
    try:
        with pytest.raises(FileExistsError):
            store.open_lock(p, create=True)
        os.pwrite(fd, b"holder", 0)
        again = store.open_lock(p, create=False)
        try:
            assert os.pread(again, 6, 0) == b"holder"
            st = store.stat(p)
            assert st is not None and st.ident == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        finally:
            os.close(again)
    finally:
        os.close(fd)


class Crash(Exception):
    """A simulated crash at one file-system call."""


class CrashAt(FileOps):
    """FileOps that crashes at call number `at` of write_file, rename and fsync_dir."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.calls = 0

    def _tick(self) -> None:
        if self.calls == self.at:
            raise Crash
        self.calls += 1

    def write_file(self, path: Path, data: bytes) -> None:
        self._tick()
        super().write_file(path, data)

    def rename(self, src: Path, dst: Path) -> None:
        self._tick()
        super().rename(src, dst)

    def fsync_dir(self, path: Path) -> None:
        self._tick()
        super().fsync_dir(path)


@pytest.mark.parametrize("at", range(3))
def test_local_write_is_old_or_new_at_every_crash(tmp_path: Path, at: int) -> None:
    p = tmp_path / "manifest.json"
    LocalStorage().write(p, b"old")
    with pytest.raises(Crash):
        LocalStorage(CrashAt(at)).write(p, b"new")
    assert LocalStorage().read(p) == (b"old" if at < 2 else b"new")  # renamed, not synced
    assert [q.name for q in tmp_path.iterdir() if parse_temp_name(q.name)] == []


# -- the repository reaches its files only through its storage ------------------------

ROOT = Path(__file__).resolve().parents[2]
THROUGH_STORAGE = [
    "upr_cli/repo/layout.py",
    "upr_cli/repo/manifests.py",
    "upr_cli/repo/sweep.py",
    "upr_cli/repo/lock.py",
    "upr_cli/segments/reader.py",
    "upr_cli/segments/writer.py",
    "upr_cli/jobs/backup.py",
    "upr_cli/jobs/backup_stream.py",
    "upr_cli/jobs/compact.py",
    "upr_cli/jobs/merge.py",
    "upr_cli/jobs/state.py",
    "upr_cli/jobs/restore.py",
    "upr_cli/jobs/examine.py",
    "upr_cli/jobs/inspect.py",
    "upr_cli/jobs/ls.py",
    "upr_cli/jobs/cat.py",
    "upr_cli/source.py",
]
# file-system calls of pathlib, os and shutil: a call by one of these names must be made
# on a storage (`self.storage.stat(…)`, `store.create(…)`)
FS_CALLS = {
    "exists", "is_dir", "is_file", "iterdir", "glob", "rglob", "mkdir", "rmdir", "unlink",
    "read_bytes", "read_text", "write_bytes", "write_text", "touch", "rename", "replace",
    "lstat", "scandir", "listdir", "link", "remove", "rmtree", "makedirs", "lexists",
}  # fmt: skip
# what the lock does on the descriptor `Storage.open_lock` hands out, and the writer on
# the file objects of `Storage.create`
ON_DESCRIPTORS = {"kill", "pread", "pwrite", "ftruncate", "fsync", "fstat", "close"}
# called by bare name: the builtin, and fsio's helpers that reach files beside a storage
BY_NAME = {"open", "FileOps", "sync_files", "atomic_write"}


def fs_calls_outside_storage(source: str) -> list[str]:
    """Calls a module makes to the file system other than through a storage."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in BY_NAME:
                out.append(f"{f.id}() at line {node.lineno}")
            elif isinstance(f, ast.Attribute):
                receiver = ast.unparse(f.value)
                if receiver == "os" and f.attr not in ON_DESCRIPTORS:
                    out.append(f"os.{f.attr} at line {node.lineno}")
                elif f.attr in FS_CALLS and not receiver.endswith(("storage", "store")):
                    out.append(f"{receiver}.{f.attr} at line {node.lineno}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if "shutil" in names or (isinstance(node, ast.ImportFrom) and node.module == "shutil"):
                out.append(f"shutil imported at line {node.lineno}")
    return out


def test_the_checker_finds_file_system_calls() -> None:
    found = fs_calls_outside_storage(
        "p.exists()\nos.scandir(d)\nopen(p)\nimport shutil\nsync_files(ps)\nFileOps().sync(d)\n"
    )
    assert sorted(found) == [
        "FileOps() at line 6", "open() at line 3", "os.scandir at line 2",
        "p.exists at line 1", "shutil imported at line 4", "sync_files() at line 5",
    ]  # fmt: skip
    fine = "self.storage.stat(p)\nstore.replace(a, b)\nos.fstat(fd)\nlayout.storage.list(d)\n"
    assert fs_calls_outside_storage(fine) == []


@pytest.mark.parametrize("module", THROUGH_STORAGE)
def test_repository_files_are_reached_through_storage(module: str) -> None:
    assert fs_calls_outside_storage((ROOT / module).read_text()) == []
