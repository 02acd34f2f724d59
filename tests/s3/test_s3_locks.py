"""Locks of s3:// repositories are leases: a race is lost on a 412, a killed holder's
lease runs out and is taken over, a holder that lost its lease writes nothing more,
readers and exclusive access exclude each other; `upr repo unlock` on both backends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.s3.fault_proxy import Fault, FaultProxy
from upr_cli.cli.app import main
from upr_cli.lockholder import LockHolder
from upr_cli.repo import Repository
from upr_cli.repo.errors import RepositoryLocked
from upr_cli.repo.lock import RepositoryLock
from upr_cli.repo.readers import ExclusiveAccess, ReadLock
from upr_cli.storage import parse_location

HOLD = """
import sys, time
from upr_cli.repo import Repository
from upr_cli.repo.lock import RepositoryLock
from upr_cli.storage import parse_location
RepositoryLock(Repository(parse_location(sys.argv[1])), "default").acquire()
print("held", flush=True)
time.sleep(60)
"""


def new_repo(bucket: str) -> tuple[str, Repository]:
    url = f"s3://{bucket}/repo"
    repo = Repository(parse_location(url))
    repo.init()
    return url, repo


def cli(*args: str) -> int:
    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_a_lock_race_is_lost_on_a_412(s3: str, proxy: FaultProxy) -> None:
    url, repo = new_repo(s3)
    first = RepositoryLock(repo, "default")
    first.acquire()
    refused = rf"is locked by pid {os.getpid()} .*its lease runs until"
    with pytest.raises(RepositoryLocked, match=refused):
        RepositoryLock(Repository(parse_location(url)), "default").acquire()
    lock_puts = proxy.requests("PUT", "/repo/default/lock")
    assert [p.status for p in lock_puts] == [200, 412]  # the refusal is the 412, not a 500
    first.release()
    second = RepositoryLock(Repository(parse_location(url)), "default")
    second.acquire()
    second.release()
    assert repo.storage.stat(repo.lock_path("default")) is None


def test_a_killed_holders_lease_runs_out_and_the_next_takes_it_over(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPR_LEASE_SECONDS", "3")  # LastModified has a 1 s resolution
    url, repo = new_repo(s3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen([sys.executable, "-c", HOLD, url], stdout=subprocess.PIPE,
                          text=True, env=env) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    warned: list[str] = []
    lock = RepositoryLock(repo, "default", on_stale=warned.append)
    with pytest.raises(RepositoryLocked, match=f"locked by pid {proc.pid} "):
        lock.acquire()  # its lease is still running
    deadline = time.monotonic() + 8
    while True:
        try:
            lock.acquire()
            break
        except RepositoryLocked:
            assert time.monotonic() < deadline, "the lease never ran out"
            time.sleep(0.2)
    assert len(warned) == 1 and f"taking over a stale lock of pid {proc.pid}" in warned[0]
    lock.release()


def test_a_holder_that_lost_its_lease_writes_nothing_more(
    s3: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPR_LEASE_SECONDS", "3")  # renewed every second
    _url, repo = new_repo(s3)
    lock = RepositoryLock(repo, "default")
    lock.acquire()
    import boto3

    other = LockHolder(1, "elsewhere", "2026-12-06T00:00:00.000000Z").to_bytes()
    boto3.client("s3").put_object(Bucket=s3, Key="repo/default/lock", Body=other)
    deadline = time.monotonic() + 10
    manifest = repo.bucket_dir("default") / "20261206T000000.000000Z" / "manifest.json"
    while True:  # the next renewal meets the other holder's object: a 412
        try:
            repo.storage.write(manifest, b"{}")
            repo.storage.delete(manifest)
        except RepositoryLocked as exc:
            assert "this process lost its lock" in str(exc)
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # (lost between that write and its delete, the object is one written while held)
    boto3.client("s3").delete_object(Bucket=s3, Key=f"repo/{manifest.relative_to(repo.path)}")
    with pytest.raises(RepositoryLocked, match="this process lost its lock"):
        repo.storage.write(manifest, b"{}")  # once lost, nothing more is written
    assert repo.storage.stat(manifest) is None
    assert 412 in [p.status for p in proxy.requests("PUT", "/repo/default/lock")]
    lock.release()  # not ours any more: left alone
    assert repo.storage.read(repo.lock_path("default")) == other


def test_readers_and_exclusive_access_exclude_each_other(s3: str) -> None:
    url, repo = new_repo(s3)
    repo.storage.write(repo.bucket_dir("default") / "x", b"")
    reader = ReadLock(repo, "default", command="restore", wait=0)
    reader.acquire()
    assert reader.held and reader.registration is not None
    other = Repository(parse_location(url))
    with pytest.raises(RepositoryLocked, match=r"being read by 1 reader: restore \(pid"):
        ExclusiveAccess(other, "default", wait=0).acquire()
    reader.release()
    access = ExclusiveAccess(other, "default", wait=0)
    access.acquire()
    with pytest.raises(RepositoryLocked, match="is being changed by"):
        ReadLock(repo, "default", command="verify", wait=0.3).acquire()
    access.release()
    with ReadLock(repo, "default", command="verify", wait=0) as again:
        assert again.held


def test_a_reader_whose_credentials_cannot_write_reads_without_a_lock(
    s3: str, proxy: FaultProxy
) -> None:
    _url, repo = new_repo(s3)
    repo.storage.write(repo.bucket_dir("default") / "x", b"")
    mine = f"/{s3}/repo/default/readers/"
    proxy.add(Fault("status", 1, "PUT", mine, status=403))
    with ReadLock(repo, "default", command="restore", wait=0) as reader:
        assert reader.unlocked and reader.registration is None
    assert [r.status for r in proxy.requests("PUT", mine)] == [403]  # not retried


def test_repo_unlock_on_s3(s3: str, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("UPR_LEASE_SECONDS", "3")  # LastModified has a 1 s resolution
    url, repo = new_repo(s3)
    assert cli("repo", "unlock", "--repo", url, "--bucket", "default") == 0
    assert capsys.readouterr().out == "default: not locked\n"
    lock = RepositoryLock(repo, "default")
    lock.acquire()
    try:
        assert cli("repo", "unlock", "--repo", url, "--bucket", "default") == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"held by pid {os.getpid()}" in err
        assert "whose lease runs until" in err and "--force" in err
    finally:
        lock._lease.lease._stop.set()  # type: ignore[union-attr]  # as if SIGKILLed
    deadline = time.monotonic() + 8
    while cli("repo", "unlock", "--repo", url, "--bucket", "default", "--json") != 0:
        assert time.monotonic() < deadline, "the lease never ran out"
        capsys.readouterr()
        time.sleep(0.3)
    out = json.loads(capsys.readouterr().out)
    assert out["buckets"][0]["state"] == "removed" and not out["buckets"][0]["forced"]
    assert out["buckets"][0]["holder"]["pid"] == os.getpid()
    assert repo.storage.stat(repo.lock_path("default")) is None


def test_repo_unlock_on_a_local_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                           ) -> None:  # fmt: skip
    repo = Repository(tmp_path / "r")
    repo.init()
    (tmp_path / "r" / "default").mkdir()
    lock = tmp_path / "r" / "default" / "lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    mine = socket.gethostname()
    lock.write_bytes(LockHolder(int(dead.stdout), mine, "2026-12-06T00:00:00.000000Z").to_bytes())
    assert cli("repo", "unlock", "--repo", str(tmp_path / "r")) == 0
    assert capsys.readouterr().out.startswith("default: removed the stale lock of pid")
    assert not lock.exists()
    lock.write_bytes(LockHolder(os.getpid(), mine, "2026-12-06T00:00:00.000000Z").to_bytes())
    assert cli("repo", "unlock", "--repo", str(tmp_path / "r")) == 1
    assert "which is alive; --force removes it" in capsys.readouterr().err
    assert cli("repo", "unlock", "--repo", str(tmp_path / "r"), "--force") == 0
    assert "removed the live lock (--force)" in capsys.readouterr().out
    assert not lock.exists()
