"""The repository on disk: init, commit by manifest, crashes at every step, sweep."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.repo.repo_helpers import BUCKET, LOG, bid
from upr_cli.repo import (
    MANIFEST_COPY,
    MANIFEST_FILE,
    BackupId,
    FileOps,
    Manifest,
    PartitionEntry,
    Repository,
    RepositoryError,
    RepositoryLock,
    SegmentEntry,
    Totals,
    format_segment_name,
    parse_temp_name,
    temp_name,
)


class Crash(Exception):
    """A simulated crash at one file-system call."""


class FailingOps(FileOps):
    """FileOps that raises at call number `fail_at` (counting from 0), or never."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.calls: list[str] = []

    def _tick(self, what: str) -> None:
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise Crash(what)
        self.calls.append(what)

    def write_file(self, path: Path, data: bytes) -> None:
        self._tick(f"write {parse_temp_name(path.name)}")
        super().write_file(path, data)

    def rename(self, src: Path, dst: Path) -> None:
        self._tick(f"rename {dst.name}")
        super().rename(src, dst)

    def fsync_dir(self, path: Path) -> None:
        self._tick(f"fsync_dir {path.name}")
        super().fsync_dir(path)


def write_backup(
    repo: Repository, backup_id: BackupId, parent: BackupId | None, start: int, end: int
) -> Manifest:
    """Make the directory, write one segment file for partition 0, build the manifest."""
    d = repo.new_backup_dir(BUCKET, backup_id)
    segments: tuple[SegmentEntry, ...] = ()
    if end > start:
        name = format_segment_name(0, start + 1, end)
        (d / name).write_bytes(b"s" * 10)
        segments = (SegmentEntry(name, start + 1, end, end - start, 10, "0" * 32),)
    parts = (PartitionEntry(0, 0xBEEF, LOG, start, end, end, end, segments),)
    return Manifest(
        backup_id,
        BUCKET,
        "upr://127.0.0.1:11210/default",
        backup_id.time,
        backup_id.time + timedelta(seconds=1),
        parent is None,
        parent,
        parts,
        Totals.derive(parts, 100),
    )


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    r = Repository(tmp_path / "repo")
    r.init()
    return r


# -- repository ----------------------------------------------------------------------


def test_init_creates_repo_json_once(tmp_path: Path) -> None:
    r = Repository(tmp_path / "a" / "b")
    with pytest.raises(RepositoryError, match="not a upr repository"):
        r.info()
    info = r.init()
    data = json.loads((tmp_path / "a" / "b" / "repo.json").read_text())
    assert data["format"] == "upr-repository" and data["version"] == 1
    assert r.init() == info == r.info()  # the second init reads, does not rewrite
    assert [p.name for p in r.path.iterdir()] == ["repo.json"]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"{", "not valid JSON"),
        (b"{}", "expected keys"),
        (b'{"format": "x", "version": 1, "created": "2026-11-21T06:15:00.000000Z"}', "format"),
        (b'{"format": "upr-repository", "version": 9, "created": "2026-11-21T06:15:00.000000Z"}',
         "version 9"),
        (b'{"format": "upr-repository", "version": 1, "created": "now"}', "created"),
    ],
)  # fmt: skip
def test_bad_repo_json(tmp_path: Path, content: bytes, match: str) -> None:
    (tmp_path / "repo.json").write_bytes(content)
    with pytest.raises(RepositoryError, match=match) as info:
        Repository(tmp_path).init()
    assert "repo.json" in str(info.value)


def test_init_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(RepositoryError, match="not empty and not a upr repository"):
        Repository(tmp_path).init()
    assert not (tmp_path / "repo.json").exists()
    (tmp_path / "empty").mkdir()
    Repository(tmp_path / "empty").init()


def test_init_on_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(RepositoryError, match="not a directory"):
        Repository(tmp_path / "f").init()


def test_paths(repo: Repository) -> None:
    b = bid(0)
    assert repo.backup_dir(BUCKET, b) == repo.path / "default" / "20261121T061500.000000Z"
    assert repo.manifest_path(BUCKET, b).name == "manifest.json"
    assert repo.lock_path(BUCKET) == repo.path / "default" / "lock"
    with pytest.raises(RepositoryError, match="bucket name"):
        repo.bucket_dir("../etc")
    with pytest.raises(RepositoryError, match="segment file name"):
        repo.segment_path(BUCKET, b, "../manifest.json")


# -- commit --------------------------------------------------------------------------


def test_commit_and_list(repo: Repository) -> None:
    assert repo.backups(BUCKET) == [] and repo.buckets() == []
    m1 = write_backup(repo, bid(0), None, 0, 100)
    assert repo.backups(BUCKET) == [] and repo.incomplete(BUCKET) == [bid(0)]
    path = repo.write_manifest(m1)
    assert path == repo.manifest_path(BUCKET, bid(0))
    assert (path.parent / MANIFEST_COPY).read_bytes() == path.read_bytes()
    m2 = write_backup(repo, bid(1), bid(0), 80, 150)
    repo.write_manifest(m2)
    assert repo.backups(BUCKET) == [bid(0), bid(1)] == repo.committed(BUCKET)
    assert repo.manifests(BUCKET) == [m1, m2] and repo.incomplete(BUCKET) == []
    assert repo.read_manifest(BUCKET, bid(1)) == m2 and repo.buckets() == [BUCKET]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_commit_checks(repo: Repository) -> None:
    m1 = write_backup(repo, bid(0), None, 0, 100)
    with pytest.raises(RepositoryError, match="no such backup directory"):
        repo.write_manifest(dataclasses.replace(m1, backup_id=bid(9)))
    seg = repo.backup_dir(BUCKET, bid(0)) / m1.segment_files()[0]
    seg.write_bytes(b"short")
    with pytest.raises(RepositoryError, match="size 5 differs") as info:
        repo.write_manifest(m1)
    assert seg.name in str(info.value)
    seg.unlink()
    with pytest.raises(RepositoryError, match="is missing"):
        repo.write_manifest(m1)
    seg.write_bytes(b"s" * 10)
    repo.write_manifest(m1)
    with pytest.raises(RepositoryError, match="already committed"):
        repo.write_manifest(m1)
    m2 = write_backup(repo, bid(2), bid(1), 100, 120)  # wrong parent
    with pytest.raises(RepositoryError, match="not the newest committed backup"):
        repo.write_manifest(m2)
    with pytest.raises(RepositoryError, match="not newer"):
        repo.new_backup_dir(BUCKET, bid(0))
    assert repo.backups(BUCKET) == [bid(0)]


def test_new_backup_dir_reuses_an_uncommitted_one(repo: Repository) -> None:
    d = repo.new_backup_dir(BUCKET, bid(0))
    (d / "keep").write_text("x")
    assert repo.new_backup_dir(BUCKET, bid(0)) == d and (d / "keep").exists()


def test_next_backup_id_is_after_every_directory(repo: Repository) -> None:
    future = BackupId(datetime(2999, 1, 1, tzinfo=UTC))
    repo.new_backup_dir(BUCKET, future)
    assert repo.next_backup_id(BUCKET) == future.next()
    assert repo.next_backup_id("other") > BackupId(datetime(2020, 1, 1, tzinfo=UTC))


def test_manifest_in_the_wrong_directory(repo: Repository) -> None:
    repo.write_manifest(write_backup(repo, bid(0), None, 0, 10))
    src = repo.backup_dir(BUCKET, bid(0))
    dst = repo.new_backup_dir(BUCKET, bid(1))
    for name in (MANIFEST_FILE, MANIFEST_COPY):
        (dst / name).write_bytes((src / name).read_bytes())
    with pytest.raises(RepositoryError, match=r"is for backup 20261121T061500\.000000Z"):
        repo.read_manifest(BUCKET, bid(1))
    assert repo.backups(BUCKET) == [bid(0)]


# -- crashes -------------------------------------------------------------------------


def test_crash_after_the_temp_file_is_written(repo: Repository) -> None:
    m = write_backup(repo, bid(0), None, 0, 100)
    ops = FailingOps()
    real_rename = ops.rename

    def rename(src: Path, dst: Path) -> None:
        if dst.name == MANIFEST_FILE:
            assert src.exists() and src.read_bytes() == m.dumps()  # the temp file is whole
            raise Crash("power cut")
        real_rename(src, dst)

    ops.rename = rename  # type: ignore[method-assign]
    r = Repository(repo.path, ops=ops)
    with pytest.raises(Crash):
        r.write_manifest(m)
    d = repo.backup_dir(BUCKET, bid(0))
    assert not (d / MANIFEST_FILE).exists() and (d / MANIFEST_COPY).exists()
    # the copy's rename was the commit point: committed, read from the copy
    # (formats/repository.md §4.3)
    assert repo.backups(BUCKET) == [bid(0)] == repo.committed(BUCKET)
    assert repo.incomplete(BUCKET) == [] and repo.read_manifest(BUCKET, bid(0)) == m
    with pytest.raises(RepositoryError, match="already committed"):
        repo.write_manifest(m)
    with RepositoryLock(repo, BUCKET) as lock:  # the next backup rewrites manifest.json
        assert repo.heal(BUCKET, lock) == [(d / MANIFEST_FILE, "missing")]
    assert (d / MANIFEST_FILE).read_bytes() == m.dumps()


def test_crash_at_every_call_of_a_commit(repo: Repository) -> None:
    counting = FailingOps()
    m = write_backup(repo, bid(0), None, 0, 100)
    Repository(repo.path, ops=counting).write_manifest(m)
    calls = counting.calls
    assert calls == [
        f"write {MANIFEST_COPY}",
        f"rename {MANIFEST_COPY}",  # the commit point
        "fsync_dir 20261121T061500.000000Z",
        f"write {MANIFEST_FILE}",
        f"rename {MANIFEST_FILE}",
        "fsync_dir 20261121T061500.000000Z",
    ]
    for i in range(len(calls)):
        b = bid(1 + i)
        m = write_backup(repo, b, repo.committed(BUCKET)[-1], 100, 100 + i)
        with pytest.raises(Crash):
            Repository(repo.path, ops=FailingOps(i)).write_manifest(m)
        committed = i > calls.index(f"rename {MANIFEST_COPY}")
        assert (b in repo.backups(BUCKET)) == committed, calls[i]
        assert not [p for p in repo.backup_dir(BUCKET, b).iterdir() if p.name.startswith(".")]
        if committed:
            assert repo.read_manifest(BUCKET, b) == m
        else:
            assert b in repo.incomplete(BUCKET)
            with RepositoryLock(repo, BUCKET) as lock:
                repo.sweep(BUCKET, b.next(), lock)
            assert not repo.backup_dir(BUCKET, b).exists()


# -- damaged manifests ---------------------------------------------------------------


def test_damaged_manifest_falls_back_to_the_copy(repo: Repository) -> None:
    m = write_backup(repo, bid(0), None, 0, 100)
    path = repo.write_manifest(m)
    path.write_bytes(path.read_bytes().replace(b'"100"', b'"101"', 1))
    assert repo.read_manifest(BUCKET, bid(0)) == m
    (path.parent / MANIFEST_COPY).write_bytes(b"")
    with pytest.raises(RepositoryError, match="checksum mismatch") as info:
        repo.read_manifest(BUCKET, bid(0))
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert repo.backups(BUCKET) == [] and repo.committed(BUCKET) == [bid(0)]
    assert [b for b, _ in repo.damaged(BUCKET)] == [bid(0)]
    with pytest.raises(RepositoryError, match="checksum mismatch"):
        repo.manifests(BUCKET)
    with RepositoryLock(repo, BUCKET) as lock:
        repo.sweep(BUCKET, bid(5), lock)
    assert path.exists()  # damaged, but committed: never swept


# -- sweep ---------------------------------------------------------------------------


def test_sweep(repo: Repository) -> None:
    repo.write_manifest(write_backup(repo, bid(0), None, 0, 100))
    committed_dir = repo.backup_dir(BUCKET, bid(0))
    empty_manifest_dir = repo.new_backup_dir(BUCKET, bid(1))
    (empty_manifest_dir / MANIFEST_FILE).write_bytes(b"")  # committed, then damaged
    damaged_copy = repo.new_backup_dir(BUCKET, bid(2))
    (damaged_copy / MANIFEST_COPY).write_text("{}")  # committed, then damaged
    running = repo.new_backup_dir(BUCKET, bid(3))
    newer = repo.new_backup_dir(BUCKET, bid(4))
    bdir = repo.bucket_dir(BUCKET)
    temps = [
        committed_dir / temp_name(MANIFEST_FILE),
        running / (temp_name(format_segment_name(0, 1, 2)) + "-body"),
        bdir / temp_name("x"),
    ]
    for t in temps:
        t.write_text("partial")
    keep = [
        bdir / "notes.txt",
        bdir / "2026",
        running / "p0000-s0000000000000001-e0000000000000002.seg",
    ]
    keep[0].write_text("mine")
    keep[1].mkdir()
    keep[2].write_text("segment")
    odd_dir = bdir / temp_name("dir")
    odd_dir.mkdir()  # a directory named like a temp file: not ours
    with RepositoryLock(repo, BUCKET) as lock:
        removed = repo.sweep(BUCKET, bid(3), lock)
    assert sorted(removed) == sorted(temps)
    assert committed_dir.is_dir() and empty_manifest_dir.is_dir() and running.is_dir()
    assert damaged_copy.is_dir()
    assert newer.is_dir() and all(p.exists() for p in keep)
    assert odd_dir.is_dir()
    assert repo.backups(BUCKET) == [bid(0)]
    assert list(repo.read_manifest(BUCKET, bid(0)).segment_files())


def test_sweep_needs_the_lock(repo: Repository, tmp_path: Path) -> None:
    lock = RepositoryLock(repo, BUCKET)
    with pytest.raises(RepositoryError, match="needs this bucket's lock"):
        repo.sweep(BUCKET, bid(0), lock)
    with RepositoryLock(repo, "other") as other, pytest.raises(RepositoryError, match="lock"):
        repo.sweep(BUCKET, bid(0), other)
    with lock:
        assert repo.sweep(BUCKET, bid(0), lock) == []
