"""The bucket lock: exclusive, held across processes, stale locks of dead holders taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.e2e_helpers import spawn
from tests.repo.repo_helpers import BUCKET
from upr_cli.repo import (
    Repository,
    RepositoryError,
    RepositoryLock,
    RepositoryLocked,
    format_time,
    parse_time,
)
from upr_cli.repo import lock as lock_module
from upr_cli.repo.lock import FRESH_SECONDS

HOLDER = """
import sys
from upr_cli.repo import Repository, RepositoryLock
lock = RepositoryLock(Repository(sys.argv[1]), "default")
lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    r = Repository(tmp_path)
    r.init()
    return r


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    with spawn(sys.executable, "-c", "pass") as proc:
        proc.wait(timeout=60)
    return proc.pid


def write_lock(path: Path, pid: int, host: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = {"pid": pid, "hostname": host or socket.gethostname(),
              "started": "2026-11-21T06:15:00.000000Z"}  # fmt: skip
    path.write_text(json.dumps(holder))


def test_acquire_and_release(repo: Repository) -> None:
    lock = RepositoryLock(repo, BUCKET)
    assert not lock.held
    me = lock.acquire()
    assert lock.held and me.pid == os.getpid() and me.hostname == socket.gethostname()
    content = json.loads(lock.path.read_text())
    assert content == {"pid": os.getpid(), "hostname": me.hostname, "started": me.started}
    assert format_time(parse_time(me.started)) == me.started  # formats/repository.md §2.5
    with pytest.raises(RepositoryError, match="already holds"):
        lock.acquire()
    lock.release()
    assert not lock.held and not lock.path.exists()
    lock.release()  # idempotent
    with RepositoryLock(repo, BUCKET) as again:
        assert again.held
    assert not lock.path.exists()


def test_second_acquire_in_the_same_process_is_refused(repo: Repository) -> None:
    with RepositoryLock(repo, BUCKET):
        with pytest.raises(RepositoryLocked, match="is locked by pid") as info:
            RepositoryLock(repo, BUCKET).acquire()
        assert info.value.pid == os.getpid() and "\n" not in str(info.value)
        with RepositoryLock(repo, "other") as other:  # other buckets are independent
            assert other.held


def test_stale_lock_of_a_dead_pid_is_taken_over(repo: Repository) -> None:
    pid = dead_pid()
    lock_path = repo.lock_path(BUCKET)
    write_lock(lock_path, pid)
    warnings: list[str] = []
    lock = RepositoryLock(repo, BUCKET, on_stale=warnings.append)
    me = lock.acquire()
    assert len(warnings) == 1 and f"pid {pid}" in warnings[0] and "stale" in warnings[0]
    assert json.loads(lock_path.read_text())["pid"] == me.pid == os.getpid()
    with pytest.raises(RepositoryLocked):
        RepositoryLock(repo, BUCKET).acquire()
    lock.release()


def test_live_holder_in_another_process_then_killed(repo: Repository) -> None:
    with spawn(sys.executable, "-c", HOLDER, str(repo.path), stdin=subprocess.PIPE,
               stdout=subprocess.PIPE, text=True) as child:  # fmt: skip
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        with pytest.raises(RepositoryLocked) as info:
            RepositoryLock(repo, BUCKET).acquire()
        assert info.value.pid == child.pid and info.value.hostname == socket.gethostname()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)  # dead before the takeover below
    warnings: list[str] = []
    with RepositoryLock(repo, BUCKET, on_stale=warnings.append) as lock:
        assert lock.held and f"pid {child.pid}" in warnings[0]


def test_live_pid_without_the_flock_is_not_taken_over(repo: Repository) -> None:
    write_lock(repo.lock_path(BUCKET), os.getpid())
    with pytest.raises(RepositoryLocked) as info:
        RepositoryLock(repo, BUCKET).acquire()
    assert info.value.pid == os.getpid()
    assert repo.lock_path(BUCKET).exists()


def test_lock_from_another_host_is_refused(repo: Repository) -> None:
    write_lock(repo.lock_path(BUCKET), dead_pid(), host="elsewhere.example")
    with pytest.raises(RepositoryLocked, match=r"elsewhere\.example") as info:
        RepositoryLock(repo, BUCKET).acquire()
    assert info.value.hostname == "elsewhere.example"
    assert "remove the lock file" in str(info.value)


@pytest.mark.parametrize(
    "content",
    [b"",  # a holder between creating and writing it
     # a live pid, but `started` is not in the form of formats/repository.md §2.5
     json.dumps({"pid": os.getpid(), "hostname": socket.gethostname(),
                 "started": "2026-11-21T06:15:00Z"}).encode()],
    ids=["empty", "started-to-the-second"],
)  # fmt: skip
def test_unreadable_lock_file(repo: Repository, content: bytes) -> None:
    path = repo.lock_path(BUCKET)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    old = time.time() - FRESH_SECONDS - 5
    os.utime(path, (old, old))
    warnings: list[str] = []
    with RepositoryLock(repo, BUCKET, on_stale=warnings.append):
        assert "unreadable" in warnings[0]


def test_a_fresh_unreadable_lock_is_waited_for(
    repo: Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Empty and young: its writer is between creating and writing it, or died there.
    Written meanwhile by a live holder → locked; never written → taken over once stale."""
    monkeypatch.setattr(lock_module, "FRESH_SECONDS", 0.4)
    path = repo.lock_path(BUCKET)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    t0 = time.monotonic()
    warnings: list[str] = []
    with RepositoryLock(repo, BUCKET, on_stale=warnings.append):
        assert "unreadable" in warnings[0]
    assert time.monotonic() - t0 >= 0.3  # waited until it was stale, not longer than needed
    path.write_bytes(b"")
    timer = threading.Timer(0.1, write_lock, (path, os.getppid()))
    timer.start()
    with pytest.raises(RepositoryLocked, match=f"pid {os.getppid()}") as info:
        RepositoryLock(repo, BUCKET).acquire()
    timer.join()
    assert info.value.pid == os.getppid()


def test_default_stale_warning_goes_to_logging(
    repo: Repository, caplog: pytest.LogCaptureFixture
) -> None:
    write_lock(repo.lock_path(BUCKET), dead_pid())
    with RepositoryLock(repo, BUCKET):
        pass
    assert any("stale" in r.getMessage() for r in caplog.records)


def test_a_lock_needs_a_repository(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match="not a upr repository"):
        RepositoryLock(Repository(tmp_path / "typo"), BUCKET).acquire()
    assert not (tmp_path / "typo").exists()
