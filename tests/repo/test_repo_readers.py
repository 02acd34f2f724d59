"""Readers' shared lock and the exclusive access that removes under them
(formats/repository.md §7.2), with real processes holding real flocks on real files."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.e2e_helpers import spawn
from tests.repo.repo_helpers import BUCKET, commit_backup
from upr_cli.lockholder import LockHolder
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.repo import Repository, RepositoryLock, RepositoryLocked
from upr_cli.repo.readers import (
    READERS_DIR,
    SHARED_FILE,
    ExclusiveAccess,
    Reader,
    ReadLock,
    live_readers,
    registration_name,
    sweep_unless_read,
)
from upr_cli.storage import LocalStorage

# A reader process: takes ReadLock for `command` (waiting up to argv[3] s), says so, and
# holds it until its stdin closes.
READER = """
import sys
from upr_cli.repo import Repository, RepositoryLocked
from upr_cli.repo.readers import ReadLock
lock = ReadLock(Repository(sys.argv[1]), "default", command=sys.argv[2],
                wait=float(sys.argv[3]),
                on_wait=lambda h: print("waiting", h.pid if h else None, flush=True))
try:
    lock.acquire()
except RepositoryLocked as exc:
    print("refused", exc, flush=True)
    sys.exit(1)
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def _rows(n: int) -> list[DcpRecord]:
    return [DcpRecord(OP_MUTATION, 0, s, s, s * 1000, 0, 0, 0, 1, b"k%d" % s, b'{"v":%d}' % s, 0)
            for s in range(1, n + 1)]  # fmt: skip


@pytest.fixture
def repo(tmp_path: Path) -> Repository:
    r = Repository(tmp_path / "repo")
    r.init()
    commit_backup(r, 0, {0: _rows(5)})
    return r


def registrations(repo: Repository) -> list[str]:
    d = repo.bucket_dir(BUCKET) / READERS_DIR
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_names_and_the_registration_record(repo: Repository) -> None:
    got = registration_name(42, "db-1.example.com", "0a1b2c3d")
    assert got == "42-db-1.example.com-0a1b2c3d.json"
    assert registration_name(7, "h/ost x", "00000000") == "7-h_ost_x-00000000.json"
    with ReadLock(repo, BUCKET, command="verify") as lock:
        assert lock.held and lock.registration is not None
        record = json.loads(lock.registration.read_text())
        assert record["command"] == "verify" and record["pid"] == os.getpid()
        assert LockHolder.from_bytes(lock.registration.read_bytes()) is not None
        assert (repo.bucket_dir(BUCKET) / SHARED_FILE).is_file()
        (me,) = live_readers(repo, BUCKET)  # its own reader counts: another open file
        assert (me.pid, me.hostname, me.command) == (os.getpid(), socket.gethostname(), "verify")
    # the last reader out leaves the bucket as it was
    backups = [str(b) for b in repo.committed(BUCKET)]
    assert sorted(p.name for p in repo.bucket_dir(BUCKET).iterdir()) == backups
    assert live_readers(repo, BUCKET) == []


def test_exclusive_access_refuses_a_live_reader_then_waits_for_it(repo: Repository) -> None:
    with spawn(sys.executable, "-c", READER, str(repo.path), "restore", "0",
               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "held"
        with RepositoryLock(repo, BUCKET):
            with pytest.raises(RepositoryLocked) as refused:
                ExclusiveAccess(repo, BUCKET, wait=0).acquire()
            msg = str(refused.value)
            assert f"restore (pid {proc.pid} on host {socket.gethostname()} since " in msg
            assert "1 reader:" in msg and "--wait SECONDS" in msg and "\n" not in msg
            assert refused.value.pid == proc.pid
            told: list[list[Reader]] = []
            threading.Timer(0.4, proc.stdin.close).start()  # the reader finishes
            t0 = time.monotonic()
            with ExclusiveAccess(repo, BUCKET, wait=5, on_wait=told.append) as access:
                waited = time.monotonic() - t0
                assert access.held and proc.wait(timeout=5) == 0
            assert 0.3 < waited < 5
            assert [[(r.pid, r.command) for r in rs] for rs in told] == [[(proc.pid, "restore")]]
    assert not (repo.bucket_dir(BUCKET) / SHARED_FILE).exists()
    assert registrations(repo) == []


def test_a_killed_reader_does_not_count(repo: Repository) -> None:
    with spawn(sys.executable, "-c", READER, str(repo.path), "examine", "0",
               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        assert [r.pid for r in live_readers(repo, BUCKET)] == [proc.pid]
        left = registrations(repo)
        assert len(left) == 1 and left[0].startswith(f"{proc.pid}-")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=5)
    assert registrations(repo) == left  # still there, and ignored
    assert live_readers(repo, BUCKET) == []
    t0 = time.monotonic()
    with RepositoryLock(repo, BUCKET), ExclusiveAccess(repo, BUCKET, wait=0):
        assert time.monotonic() - t0 < 1.0
        assert registrations(repo) == []  # the dead reader's registration is removed


def test_a_reader_waits_for_the_exclusive_holder_or_names_it(repo: Repository) -> None:
    with RepositoryLock(repo, BUCKET) as lock, ExclusiveAccess(repo, BUCKET) as access:
        assert lock.holder is not None
        # a short wait: refused, naming the writer lock's holder (this process)
        with pytest.raises(RepositoryLocked) as refused:
            ReadLock(repo, BUCKET, command="verify", wait=0.2).acquire()
        assert lock.holder.describe() in str(refused.value)
        assert refused.value.pid == os.getpid()
        assert registrations(repo) == []  # a refused reader leaves nothing
        # a reader process waits, says once whom for, and goes on when the holder is done
        with spawn(sys.executable, "-c", READER, str(repo.path), "restore", "10",
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().split() == ["waiting", str(os.getpid())]
            # registered while it waits: a writer can name it
            assert [r.pid for r in live_readers(repo, BUCKET)] == [proc.pid]
            time.sleep(0.2)
            assert proc.poll() is None
            access.release()
            assert proc.stdout.readline().strip() == "held"
            with pytest.raises(RepositoryLocked, match="restore"):
                ExclusiveAccess(repo, BUCKET).acquire()
            proc.stdin.close()
            assert proc.wait(timeout=5) == 0


def test_readers_share(repo: Repository) -> None:
    with spawn(sys.executable, "-c", READER, str(repo.path), "restore", "0",
               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "held"
        with ReadLock(repo, BUCKET, command="verify", wait=0) as mine:
            assert mine.held
            got = sorted((r.pid, r.command) for r in live_readers(repo, BUCKET))
            assert got == sorted([(proc.pid, "restore"), (os.getpid(), "verify")])
        proc.stdin.close()
        assert proc.wait(timeout=5) == 0
    assert registrations(repo) == []


def test_a_sweep_is_skipped_while_readers_read(repo: Repository) -> None:
    leftover = repo.bucket_dir(BUCKET) / ".manifest.json.tmp-0a1b2c3d"
    leftover.write_bytes(b"x")
    running = repo.next_backup_id(BUCKET)
    with RepositoryLock(repo, BUCKET) as lock:
        with ReadLock(repo, BUCKET, command="restore"):
            assert sweep_unless_read(repo, BUCKET, running, lock) is None
            assert leftover.exists()
        assert sweep_unless_read(repo, BUCKET, running, lock) == [leftover]
    assert not leftover.exists()


class ReadOnly(LocalStorage):
    """A file system that refuses every write, as a read-only mount does."""

    def open_lock(self, path: Path, *, create: bool) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def make_dir(self, path: Path) -> None:
        if path.exists():
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))


def test_a_read_only_repository_is_read_without_a_lock(repo: Repository) -> None:
    ro = Repository(repo.path, storage=ReadOnly())
    with ReadLock(ro, BUCKET, command="restore") as lock:
        assert lock.unlocked and not lock.held
    assert registrations(repo) == [] and not (repo.bucket_dir(BUCKET) / READERS_DIR).exists()
    shutil.rmtree(repo.bucket_dir(BUCKET))  # no bucket: nothing to lock, no error
    with ReadLock(repo, BUCKET, command="restore") as lock:
        assert not lock.held and not lock.unlocked


def _unshare() -> list[str]:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs unshare(1) and mount(8)")
    return ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]


def test_commands_read_a_read_only_mount(repo: Repository, tmp_path: Path) -> None:
    """`upr restore` and `upr verify` on a repository mounted read-only (a bind mount in
    a mount namespace of their own): they read it, and create nothing in it."""
    r = repo.path
    db = tmp_path / "out.db"
    script = (f"mount --bind -o ro {r} {r} || exit 99; "
              f"{sys.executable} -m upr_cli restore --repo {r} sqlite:{db} --json && "
              f"{sys.executable} -m upr_cli verify --repo {r} --json")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    got = subprocess.run([*_unshare(), "sh", "-c", script], capture_output=True, text=True,
                         timeout=60, env=env, check=False)  # fmt: skip
    if got.returncode == 99:
        pytest.skip(f"no read-only bind mount here: {got.stderr.strip()}")
    assert got.returncode == 0, got.stderr
    restored, end = json.JSONDecoder().raw_decode(got.stdout)
    verified = json.loads(got.stdout[end:])
    assert restored["written"] == 5 and verified["ok"] is True
    backups = [str(m) for m in repo.committed(BUCKET)]
    assert sorted(p.name for p in repo.bucket_dir(BUCKET).iterdir()) == backups


def test_upr_restore_waits_for_an_exclusive_holder_and_says_so(
    repo: Repository, tmp_path: Path
) -> None:
    db = tmp_path / "out.db"
    with RepositoryLock(repo, BUCKET) as lock, ExclusiveAccess(repo, BUCKET) as access:
        holder = lock.holder
        assert holder is not None
        with spawn(sys.executable, "-m", "upr_cli", "restore", "--repo", str(repo.path),
                   f"sqlite:{db}", "--no-progress", stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True) as proc:  # fmt: skip
            deadline = time.monotonic() + 20
            while not live_readers(repo, BUCKET) and time.monotonic() < deadline:
                time.sleep(0.02)
            (waiting,) = live_readers(repo, BUCKET)
            assert (waiting.pid, waiting.command) == (proc.pid, "restore")
            time.sleep(0.2)
            assert proc.poll() is None and not db.exists()  # nothing read, nothing written
            access.release()
            _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"restore waits for {holder.describe()} to finish (up to 600 s)" in err
    assert db.exists() and registrations(repo) == []


def test_a_spark_task_reads_under_the_shared_lock(repo: Repository) -> None:
    from upr_cli.repo import RepositoryError
    from upr_cli.spark.batch import read_group
    from upr_cli.spark.plan import parse_options, plan

    opts, manifests = parse_options({"path": str(repo.path)})
    (group,) = plan(opts, manifests)
    batches = read_group(group)
    assert next(batches).num_rows == 5
    assert [(r.pid, r.command) for r in live_readers(repo, BUCKET)] == [(os.getpid(), "spark read")]
    with pytest.raises(RepositoryLocked, match="spark read"):
        ExclusiveAccess(repo, BUCKET).acquire()
    assert list(batches) == []
    assert live_readers(repo, BUCKET) == []
    # a segment removed between the plan and the task (a prune): one line saying so
    Path(group.pieces[0].path).unlink()
    with pytest.raises(RepositoryError, match=r"pruned meanwhile; run the read again$"):
        list(read_group(group))


def test_a_dead_readers_half_written_registration_goes_once_old(repo: Repository) -> None:
    d = repo.bucket_dir(BUCKET) / READERS_DIR
    d.mkdir()
    old, young = d / ".1-h-00000000.json.tmp-0a1b2c3d", d / ".2-h-00000000.json.tmp-1a2b3c4d"
    old.write_bytes(b"")
    young.write_bytes(b"")
    os.utime(old, (time.time() - 60, time.time() - 60))
    notes = d / "notes.txt"  # not ours: left alone
    notes.write_text("mine")
    with RepositoryLock(repo, BUCKET), ExclusiveAccess(repo, BUCKET):
        assert registrations(repo) == sorted([young.name, notes.name])
