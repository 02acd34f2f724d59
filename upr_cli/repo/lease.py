"""Locks of a repository in object storage: leases (formats/repository.md §11.3).

Theory of operation. An object store has no flock and no process that dies with its
holder, so every lock there is an object with a lease: its body names the holder
(`LockHolder`: pid, host, start) and `lease_seconds`; its holder renews it by a
conditional PUT (`If-Match: <its ETag>`) every third of the lease from a daemon thread,
and deletes it (`If-Match`) when done. A lock object is live while the time since its
last write, by the *server's* clock (its LastModified against the Date of the answer
that read it), is under its lease; the local clock is never compared with the server's.

* **The writer lock** (`LeaseLock`, behind `RepositoryLock`): `<repo>/<bucket>/lock`,
  created with `If-None-Match: *`. A 412 means it exists: live → `RepositoryLocked`
  naming the holder and when its lease runs out; stale (a SIGKILLed holder) → taken
  over, after a warning, by a PUT `If-Match: <the stale ETag>`, so of two takers one
  wins and the other meets 412 and sees a live lock.
* **A holder that loses its lease** (a renewal refused with 412: it was taken over; or
  renewals failing for two thirds of the lease) stops: the storage checks the lease
  (`S3Storage.guards`) before each change it makes, the manifest (the commit point)
  included, and raises `RepositoryLocked` instead.
* **Readers** (`LeaseRead`, behind `ReadLock`) register `<bucket>/readers/<name>.json`
  with a lease; **exclusive access** (`LeaseExclusive`, behind `ExclusiveAccess`:
  prune, remove, a sweep) puts the marker `<bucket>/lock.shared` with a lease, then
  lists the registrations and refuses (or waits) while a live one exists; a reader,
  after registering, checks the marker and steps back while a live one exists. Each
  writes before it reads what the other wrote, and the store is strongly consistent,
  so at least one of them sees the other.

`LEASE_SECONDS` is 60 s (`UPR_LEASE_SECONDS` changes it: tests use 2 s): a SIGKILLed
backup blocks the next one for at most a minute, and a renewal has 40 s of retries
before its holder gives up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from upr_cli.lockholder import LockHolder
from upr_cli.repo.errors import RepositoryError, RepositoryLocked
from upr_cli.repo.names import format_time
from upr_cli.storage import display_location, unwrap

if TYPE_CHECKING:
    from upr_cli.repo.layout import Repository
    from upr_cli.repo.readers import Reader
    from upr_cli.s3 import S3Storage

__all__ = [
    "LEASE_SECONDS",
    "Lease",
    "LeaseExclusive",
    "LeaseLock",
    "LeaseRead",
    "LeaseState",
    "lease_seconds",
    "object_storage",
    "read_lease",
]

LEASE_SECONDS = 60.0
"""How long a lock object stays live without a renewal (`UPR_LEASE_SECONDS`)."""
_POLL = 0.2
_log = logging.getLogger("upr.repo.lease")


def lease_seconds() -> float:
    """`UPR_LEASE_SECONDS`, else `LEASE_SECONDS`."""
    try:
        value = float(os.environ.get("UPR_LEASE_SECONDS", LEASE_SECONDS))
    except ValueError:
        return LEASE_SECONDS
    return value if value > 0 else LEASE_SECONDS


def object_storage(repo: Repository) -> S3Storage | None:
    """The repository's object store, when it is in one (locks are leases there)."""
    from upr_cli.s3 import S3Storage

    backend = unwrap(repo.storage)
    return backend if isinstance(backend, S3Storage) else None


def _when(t: float) -> str:
    return format_time(datetime.fromtimestamp(t, UTC))


@dataclass(frozen=True, slots=True)
class LeaseState:
    """A lock object as read: its holder, ETag and lease, by the server's clock."""

    holder: LockHolder | None
    record: dict[str, Any]
    etag: str
    written: float
    """Its LastModified (server clock, seconds since the epoch)."""
    now: float
    """The server's Date when it was read."""
    lease: float

    @property
    def live(self) -> bool:
        """Written less than a lease ago."""
        return self.now - self.written < self.lease

    @property
    def expires(self) -> str:
        """When its lease runs out (RFC 3339, server clock)."""
        return _when(self.written + self.lease)

    def describe(self) -> str:
        """`pid N on host H since T`, or what is known."""
        return self.holder.describe() if self.holder else "an unreadable lock record"


def read_lease(storage: S3Storage, key: str) -> LeaseState | None:
    """The lock object at `key`; None when there is none."""
    try:
        body, etag, written, now = storage.get(key)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(body.decode("utf-8"))
        if not isinstance(record, dict):
            record = {}
    except ValueError:
        record = {}
    seconds = record.get("lease_seconds")
    lease = float(seconds) if isinstance(seconds, int | float) and seconds > 0 else lease_seconds()
    return LeaseState(LockHolder.from_bytes(body), record, etag, written, now, lease)


class Lease:
    """One lock object this process holds, renewed by a daemon thread every third of
    its lease; `check` raises once it is no longer ours."""

    def __init__(self, storage: S3Storage, key: str, record: dict[str, Any],
                 seconds: float | None = None) -> None:  # fmt: skip
        self.storage = storage
        self.key = key
        self.seconds = seconds or lease_seconds()
        self.record = {**record, "lease_seconds": self.seconds}
        self.etag: str | None = None
        self.lost: str | None = None
        self._renewed = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    def _body(self) -> bytes:
        return (json.dumps(self.record) + "\n").encode()

    def create(self) -> bool:
        """PUT with If-None-Match: *; False when the object exists (412)."""
        from upr_cli.s3 import PreconditionFailed

        sent = time.monotonic()
        try:
            self.etag = self.storage.put(self.key, self._body(), if_none_match=True)
        except PreconditionFailed:
            return False
        self._renewed = sent
        return True

    def take_over(self, stale_etag: str) -> bool:
        """PUT with If-Match: <the stale lease's ETag>; False when another won (412)."""
        from upr_cli.s3 import PreconditionFailed

        sent = time.monotonic()
        try:
            self.etag = self.storage.put(self.key, self._body(), if_match=stale_etag)
        except (PreconditionFailed, FileNotFoundError):
            return False
        self._renewed = sent
        return True

    def start(self) -> None:
        """Renew from a daemon thread until `release`."""
        self._thread = threading.Thread(target=self._renew, name=f"upr-lease {self.key}",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _renew(self) -> None:
        from upr_cli.s3 import PreconditionFailed

        while not self._stop.wait(self.seconds / 3):
            sent = time.monotonic()
            with self._mutex:
                if self._stop.is_set() or self.etag is None:
                    return
                try:
                    self.etag = self.storage.put(self.key, self._body(), if_match=self.etag)
                except (PreconditionFailed, FileNotFoundError):
                    self.lost = "another process took it over (412 on renewal)"
                    _log.warning("%s: lease lost: %s", self.storage.where(self.key), self.lost)
                    return
                except Exception as exc:  # noqa: BLE001 - tried again at the next tick
                    _log.warning("%s: lease not renewed: %s", self.storage.where(self.key), exc)
                    continue
                self._renewed = sent

    def check(self) -> None:
        """`RepositoryLocked` when the lease is lost or may have run out."""
        where = self.storage.where(self.key)
        if self.lost is None and time.monotonic() - self._renewed > self.seconds * 2 / 3:
            self.lost = f"not renewed for {time.monotonic() - self._renewed:.0f} s"
        if self.lost is not None:
            raise RepositoryLocked(f"{where}: this process lost its lock ({self.lost}); "
                                   "nothing more is written", pid=None, hostname=None)  # fmt: skip

    def release(self) -> None:
        """Stop renewing and delete the object, if it is still ours."""
        from upr_cli.s3 import PreconditionFailed

        self._stop.set()
        with self._mutex:
            etag, self.etag = self.etag, None
        if self._thread is not None:
            self._thread.join(timeout=5)
        if etag is None or self.lost is not None:
            return
        with contextlib.suppress(PreconditionFailed, FileNotFoundError):
            self.storage.delete_if(self.key, etag)


def _me() -> tuple[LockHolder, dict[str, Any]]:
    me = LockHolder.me(format_time(datetime.now(UTC)))
    return me, {"pid": me.pid, "hostname": me.hostname, "started": me.started}


def _locked(path: Path, what: str, state: LeaseState) -> RepositoryLocked:
    h = state.holder
    return RepositoryLocked(
        f"{display_location(path)}: {what} {state.describe()}; its lease runs until "
        f"{state.expires}", pid=h.pid if h else None,
        hostname=h.hostname if h else None)  # fmt: skip


def _hold(storage: S3Storage, path: Path, record: dict[str, Any], what: str,
          on_stale: Callable[[str], None]) -> Lease:  # fmt: skip
    """Create the lock object at `path`, or take over a stale one; `RepositoryLocked`
    naming a live holder."""
    key = storage.key(path)
    for _ in range(10):
        lease = Lease(storage, key, record)
        if lease.create():
            return lease
        state = read_lease(storage, key)
        if state is None:
            continue  # released meanwhile
        if state.live:
            raise _locked(path, what, state)
        on_stale(f"{display_location(path)}: taking over a stale lock of {state.describe()} "
                 f"(its lease ran out at {state.expires})")  # fmt: skip
        if lease.take_over(state.etag):
            return lease
    raise RepositoryError(f"{display_location(path)}: the lock kept changing; try again")


class LeaseLock:
    """The writer lock of a bucket in object storage (`RepositoryLock` delegates)."""

    def __init__(self, repo: Repository, storage: S3Storage, bucket: str, path: Path,
                 on_stale: Callable[[str], None]) -> None:  # fmt: skip
        self.repo, self.storage, self.bucket, self.path = repo, storage, bucket, path
        self.on_stale = on_stale
        self.lease: Lease | None = None

    def acquire(self) -> LockHolder:
        """Take the lock, or raise `RepositoryLocked`."""
        if self.lease is not None:
            raise RepositoryError(f"{display_location(self.path)}: this lock object already "
                                  "holds the lock")  # fmt: skip
        self.repo.info()
        me, record = _me()
        self.lease = _hold(self.storage, self.path, record,
                           f"bucket {self.bucket!r} is locked by", self.on_stale)  # fmt: skip
        self.lease.start()
        self.storage.guards.append(self.lease)
        return me

    def release(self) -> None:
        """Delete the lock object (if still ours); a no-op when not held."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        with contextlib.suppress(ValueError):
            self.storage.guards.remove(lease)
        lease.release()


class LeaseRead:
    """A reader's registration in object storage (`ReadLock` delegates)."""

    def __init__(self, repo: Repository, storage: S3Storage, bucket: str, command: str,
                 wait: float,
                 on_wait: Callable[[LockHolder | None], None] | None) -> None:  # fmt: skip
        self.repo, self.storage, self.bucket, self.command = repo, storage, bucket, command
        self.wait, self.on_wait = wait, on_wait
        self.lease: Lease | None = None
        self.unlocked = False
        """True when the credentials cannot write: read without a registration."""

    def acquire(self) -> Path | None:
        """Register; step back and wait while exclusive access is held. The
        registration's path (None: no bucket, nothing to read)."""
        from upr_cli.repo.readers import READERS_DIR, SHARED_FILE, registration_name

        bdir = self.repo.bucket_dir(self.bucket)
        if self.storage.stat(bdir) is None:
            return None
        me, record = _me()
        record["command"] = self.command
        name = registration_name(me.pid, socket.gethostname())
        path = bdir / READERS_DIR / name
        marker = self.storage.key(bdir / SHARED_FILE)
        deadline = time.monotonic() + max(self.wait, 0.0)
        told = False
        from upr_cli.s3 import AccessDenied

        while True:
            lease = Lease(self.storage, self.storage.key(path), record)
            try:
                created = lease.create()
            except AccessDenied as exc:  # read-only credentials: nothing can remove or
                _log.debug("%s: read without a lock: %s", path, exc)  # rewrite through them
                self.unlocked = True
                return None
            if not created:
                raise RepositoryError(f"{display_location(path)}: exists; try again")
            state = read_lease(self.storage, marker)
            if state is None or not state.live:
                lease.start()
                self.lease = lease
                return path
            lease.release()
            writer = LockHolder.from_bytes(self._read(self.repo.lock_path(self.bucket)))
            if time.monotonic() >= deadline:
                who = writer.describe() if writer else "a process that removes or rewrites"
                raise RepositoryLocked(
                    f"{display_location(bdir / SHARED_FILE)}: bucket {self.bucket!r} is being "
                    f"changed by {who}; {self.command} waited {self.wait:g} s",
                    pid=writer.pid if writer else None,
                    hostname=writer.hostname if writer else None)  # fmt: skip
            if not told and self.on_wait is not None:
                told = True
                self.on_wait(writer)
            time.sleep(_POLL)

    def _read(self, path: Path) -> bytes:
        try:
            return self.storage.read(path)
        except OSError:
            return b""

    def release(self) -> None:
        """Remove the registration; a no-op when not held."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()


def scan_readers(repo: Repository, storage: S3Storage, bucket: str, *,
                 remove_dead: bool) -> list[Reader]:  # fmt: skip
    """The live readers' registrations (oldest first); with `remove_dead`, the
    registrations whose lease ran out are deleted."""
    from upr_cli.repo.readers import READERS_DIR, Reader

    d = repo.bucket_dir(bucket) / READERS_DIR
    out: list[Reader] = []
    for entry in storage.list(d):
        if not entry.is_file:
            continue
        key = storage.key(d / entry.name)
        state = read_lease(storage, key)
        if state is None:
            continue
        if state.live and state.holder is not None:
            h = state.holder
            command = state.record.get("command")
            if not isinstance(command, str) or not command:
                command = "a reader"
            out.append(Reader(h.pid, h.hostname, h.started, command))
        elif not state.live and remove_dead:
            with contextlib.suppress(Exception):
                storage.delete_if(key, state.etag)
    return sorted(out, key=lambda r: (r.started, r.pid))


class LeaseExclusive:
    """Exclusive access against a bucket's readers in object storage (`ExclusiveAccess`
    delegates): the marker `lock.shared`, then no live registration."""

    def __init__(self, repo: Repository, storage: S3Storage, bucket: str, wait: float,
                 on_wait: Callable[[list[Reader]], None] | None) -> None:  # fmt: skip
        self.repo, self.storage, self.bucket = repo, storage, bucket
        self.wait, self.on_wait = wait, on_wait
        self.lease: Lease | None = None

    def acquire(self) -> None:
        """Put the marker, then wait up to `wait` for the live readers to go."""
        from upr_cli.repo.readers import SHARED_FILE, describe_readers

        path = self.repo.bucket_dir(self.bucket) / SHARED_FILE
        record = _me()[1]
        lease = _hold(self.storage, path, record,
                      f"bucket {self.bucket!r} is being changed by", _log.warning)  # fmt: skip
        lease.start()
        deadline = time.monotonic() + max(self.wait, 0.0)
        told = False
        try:
            while readers := scan_readers(self.repo, self.storage, self.bucket,
                                          remove_dead=True):  # fmt: skip
                if time.monotonic() >= deadline:
                    waited = f"waited {self.wait:g} s; " if self.wait > 0 else ""
                    raise RepositoryLocked(
                        f"{display_location(path)}: bucket {self.bucket!r} is being read by "
                        f"{describe_readers(readers)}; {waited}--wait SECONDS waits for them",
                        pid=readers[0].pid, hostname=readers[0].hostname)  # fmt: skip
                if not told and self.on_wait is not None:
                    told = True
                    self.on_wait(readers)
                time.sleep(_POLL)
        except BaseException:
            lease.release()
            raise
        self.lease = lease

    def release(self) -> None:
        """Delete the marker; a no-op when not held."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()
