"""The bucket lock: one backup (or sweep, or remove) at a time per bucket of a repository.

Theory of operation (formats/repository.md §7.1, "Writer lock"): the lock is the file
`<repo>/<bucket>/lock`, created with `O_CREAT|O_EXCL`, holding the holder's pid, host
name and start time as JSON (`upr_cli/lockholder.py`), and held with
`fcntl.flock(LOCK_EX)` for as long as the holder runs. The flock is what makes the lock
exclusive: the kernel drops it when the holder dies, whatever way it dies, so

* flock refused → a live holder: `RepositoryLocked` with its pid (this includes a
  second acquire in the same process, since flock locks belong to open files);
* flock granted on a lock file that already existed → its holder is gone, unless its
  pid is still alive on this host (then we refuse: a live process we cannot see through
  the flock, e.g. on a file system without flock) or it was written on another host
  (we cannot check its pid: refuse and say which host). A dead holder's lock is stale
  and taken over in place, keeping the same file, after a warning;
* a lock file that is empty or unreadable is a holder still writing it when it is
  younger than `FRESH_SECONDS`, and stale otherwise. `acquire` waits for such a file
  (it is written within moments, or its writer died between creating and writing it
  and it goes stale), so a run started right after a killed one takes the lock.

After the flock, the holder checks that the path still names the file it locked (a
releasing holder unlinks the file before closing it), and retries otherwise, so two
processes can never both hold locks on different files for one path.

The lock file is reached through the repository's storage (`Storage.open_lock`, `stat`,
`delete`, `make_dir`, `sync_dir`); the flock, and the reads and writes of the holder
record, work on the descriptor it hands out. A repository in object storage has no
flock: there `RepositoryLock` delegates to a lease (`upr_cli.repo.lease.LeaseLock`,
formats/repository.md §11.3).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

from upr_cli.lockholder import LockHolder
from upr_cli.repo.errors import RepositoryError, RepositoryLocked
from upr_cli.repo.lease import LeaseLock, object_storage
from upr_cli.repo.names import format_time, parse_time

if TYPE_CHECKING:
    from upr_cli.repo.layout import Repository

FRESH_SECONDS = 10.0
"""A lock file younger than this with no readable content is being written, not stale."""
_ATTEMPTS = 20
_log = logging.getLogger("upr.repo.lock")


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists on this host (signal 0 probe)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _read(fd: int) -> bytes:
    chunks: list[bytes] = []
    offset = 0
    while True:
        chunk = os.pread(fd, 4096, offset)
        if not chunk or offset > 65536:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)


def _holder(fd: int) -> LockHolder | None:
    """The holder a lock file names; None when it is empty or malformed, a `started` not
    in the form of formats/repository.md §2.5 included."""
    holder = LockHolder.from_bytes(_read(fd))
    if holder is not None:
        try:
            parse_time(holder.started)
        except RepositoryError:
            return None
    return holder


def require_held(lock: RepositoryLock, path: Path, why: str = "this needs the bucket's lock, held"
                 ) -> None:  # fmt: skip
    """RepositoryError naming `path` unless `lock` is held and is the lock at `path`: the
    changes a run makes under its bucket's lock (repair, discard, sweep) check it."""
    if not lock.held or lock.path != path:
        raise RepositoryError(f"{path}: {why}")


class Held(ABC):
    """A lock used as a context manager: `acquire` on entry, `release` on exit (the
    bucket's lock, a reader's shared lock, a remover's exclusive access)."""

    @abstractmethod
    def acquire(self) -> object:
        """Take the lock (or raise `RepositoryLocked`)."""

    @abstractmethod
    def release(self) -> None:
        """Give it back; a no-op when not held."""

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class RepositoryLock(Held):
    """Exclusive lock on one bucket of a repository; use as a context manager."""

    def __init__(
        self,
        repo: Repository,
        bucket: str,
        *,
        on_stale: Callable[[str], None] | None = None,
    ) -> None:
        self.repo = repo
        self.bucket = bucket
        self.path: Path = repo.lock_path(bucket)
        self.on_stale = on_stale or _log.warning
        self.holder: LockHolder | None = None
        self._fd: int | None = None
        s3 = object_storage(repo)
        self._lease = LeaseLock(repo, s3, bucket, self.path, self.on_stale) if s3 else None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        if self._lease is not None:
            return self._lease.lease is not None
        return self._fd is not None

    def acquire(self) -> LockHolder:
        """Take the lock or raise `RepositoryLocked`; a dead holder's stale lock is taken over.

        The repository must exist (`Repository.init`); the bucket directory is created.
        """
        if self._lease is not None:
            self.holder = self._lease.acquire()
            return self.holder
        if self._fd is not None:
            raise RepositoryError(f"{self.path}: this lock object already holds the lock")
        self.repo.info()  # a lock is taken only inside an existing repository
        storage = self.repo.storage
        parent = storage.stat(self.path.parent, follow_links=True)
        if parent is None or not parent.is_dir:
            with contextlib.suppress(FileExistsError):
                storage.make_dir(self.path.parent)
                storage.sync_dir(self.path.parent.parent)
        busy = False
        attempts = 0
        deadline = time.monotonic() + FRESH_SECONDS + 1.0
        while attempts < _ATTEMPTS:
            attempts += 1
            fd, created = self._open()
            if fd is None:
                continue
            try:
                if not self._flock(fd, wait=created):
                    raise self._locked(_holder(fd))
                if not self._same_file(fd):
                    os.close(fd)
                    continue  # released (unlinked) meanwhile: start again
                if not created and not self._may_take_over(fd):
                    os.close(fd)
                    busy = True
                    time.sleep(0.05)
                    if time.monotonic() < deadline:
                        attempts -= 1  # wait until it is written, or old enough to be stale
                    continue  # a holder still writing its lock file (or one that died so)
                me = LockHolder.me(format_time(datetime.now(UTC)))
                data = me.to_bytes()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
                os.fsync(fd)
                if created:
                    storage.sync_dir(self.path.parent)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self.holder = fd, me
            return me
        if busy:
            raise self._locked(None)
        raise RepositoryError(f"{self.path}: the lock file kept changing; try again")

    def _open(self) -> tuple[int | None, bool]:
        """Create the lock file exclusively, or open the existing one."""
        storage = self.repo.storage
        try:
            return storage.open_lock(self.path, create=True), True
        except FileExistsError:
            pass  # another holder created it first: open the existing file below
        except FileNotFoundError:  # a failed first run removed the empty bucket directory
            with contextlib.suppress(FileExistsError):
                storage.make_dir(self.path.parent)
            return None, False
        try:
            return storage.open_lock(self.path, create=False), False
        except FileNotFoundError:
            return None, False  # released between the two opens

    @staticmethod
    def _flock(fd: int, *, wait: bool) -> bool:
        """Try flock; after creating the file, wait briefly for an inspecting process."""
        deadline = time.monotonic() + (1.0 if wait else 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def _same_file(self, fd: int) -> bool:
        st = self.repo.storage.stat(self.path, follow_links=True)
        if st is None:
            return False
        mine = os.fstat(fd)
        return st.ident == (mine.st_dev, mine.st_ino)

    def _may_take_over(self, fd: int) -> bool:
        """An existing lock file whose flock we got: decide stale (True) or busy."""
        holder = _holder(fd)
        if holder is None:
            age = time.time() - os.fstat(fd).st_mtime
            if age < FRESH_SECONDS:
                return False
            self.on_stale(f"{self.path}: taking over an unreadable lock file ({age:.0f} s old)")
            return True
        if holder.hostname != socket.gethostname():
            raise RepositoryLocked(
                f"{self.path}: locked by {holder.describe()}; it cannot be checked from this "
                "host: remove the lock file if that process is gone",
                pid=holder.pid,
                hostname=holder.hostname,
            )
        if pid_alive(holder.pid):
            raise self._locked(holder)
        self.on_stale(f"{self.path}: taking over a stale lock of {holder.describe()} (dead)")
        return True

    def _locked(self, holder: LockHolder | None) -> RepositoryLocked:
        who = holder.describe() if holder else "a process that is still writing the lock file"
        return RepositoryLocked(
            f"{self.path}: bucket {self.bucket!r} is locked by {who}",
            pid=holder.pid if holder else None,
            hostname=holder.hostname if holder else None,
        )

    def release(self) -> None:
        """Remove the lock file and drop the flock; a no-op when not held."""
        if self._lease is not None:
            self.holder = None
            self._lease.release()
            return
        fd, self._fd, self.holder = self._fd, None, None
        if fd is None:
            return
        try:
            if self._same_file(fd):
                # before the flock goes: see the module docstring
                self.repo.storage.delete(self.path)
        finally:
            os.close(fd)
