"""Readers of a bucket and the exclusive access that removes or rewrites under them.

Theory of operation (formats/repository.md §7.2): a command that reads a bucket
(restore, verify, examine, replay, diff, salvage, rollback-point, the Spark readers)
holds `ReadLock`; a command that removes or rewrites what readers may be reading (prune,
remove, a merge that removes, a backup's sweep) takes `ExclusiveAccess` while it does,
on top of the bucket's writer lock (`RepositoryLock`), which it already holds.

* `<repo>/<bucket>/lock.shared` is the coordination file: a reader holds
  `flock(LOCK_SH)` on it while it reads, an exclusive holder `flock(LOCK_EX)`. The
  kernel drops a flock when its process dies, however it dies, so a dead reader never
  counts and nothing has to be cleaned up before the next exclusive holder goes on.
* `<repo>/<bucket>/readers/<pid>-<host>-<8 hex>.json` is a reader's registration: its
  `LockHolder` record plus the command's name. A reader writes it under a temp name,
  takes `flock(LOCK_EX)` on it and then renames it into place, so a registration under
  its final name is locked by its reader for as long as that reader is alive; the
  reader registers before it asks for the shared lock and removes the file when done.
  A registration whose flock another process can take belongs to a dead reader:
  `live_readers` skips it and `ExclusiveAccess` removes it. The registrations are only
  what a waiting writer names; the flock on `lock.shared` alone decides who goes.
* The exclusive holder unlinks `lock.shared` before it lets go of it (so a failed first
  backup still leaves no bucket directory behind), and so does a reader that finds
  itself the last one. Whoever gets a flock on `lock.shared` therefore checks that the
  path still names the file it locked, and starts again otherwise (the same rule as the
  writer lock's, upr_cli/repo/lock.py).
* A repository the reader cannot write (a read-only file system: EROFS, or no write
  permission: EACCES, EPERM) is read without a lock: nothing can remove or rewrite it
  under the reader either way, and a reader never fails for lack of write permission.

In object storage (no flock) `ReadLock`, `ExclusiveAccess` and `live_readers` delegate
to leases (`upr_cli.repo.lease`: registrations and the `lock.shared` marker as objects
with leases, formats/repository.md §11.3).

Every file is reached through the repository's storage (`open_lock`, `stat`, `list`,
`delete`, `make_dir`, `replace`, `remove_dir`); flocks and reads work on the descriptors
`open_lock` hands out.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from upr_cli.lockholder import LockHolder
from upr_cli.repo.errors import RepositoryError, RepositoryLocked
from upr_cli.repo.lease import LeaseExclusive, LeaseRead, object_storage, scan_readers
from upr_cli.repo.lock import Held
from upr_cli.repo.names import format_time, parse_temp_name, temp_name

if TYPE_CHECKING:
    from upr_cli.repo.layout import Repository
    from upr_cli.repo.lock import RepositoryLock
    from upr_cli.repo.names import BackupId

__all__ = [
    "READERS_DIR",
    "SHARED_FILE",
    "ExclusiveAccess",
    "ReadLock",
    "Reader",
    "live_readers",
    "read_lock",
    "registration_name",
    "sweep_unless_read",
]

SHARED_FILE = "lock.shared"
"""The readers' coordination file, `<repo>/<bucket>/lock.shared`."""
READERS_DIR = "readers"
"""The directory of the readers' registrations, `<repo>/<bucket>/readers/`."""
DEFAULT_WAIT = 600.0
"""How long a reader waits for an exclusive holder, by default (seconds)."""
STALE_TEMP_SECONDS = 10.0
"""A registration's temp file older than this, unlocked, is a dead reader's leftover."""
_POLL = 0.05
_ATTEMPTS = 50
# <pid>-<host>-<8 hex>.json; the host part is the host name with anything but letters,
# digits, '.', '_' and '-' replaced by '_', at most 64 characters.
_REGISTRATION = re.compile(r"([1-9][0-9]*)-([A-Za-z0-9._-]{1,64})-([0-9a-f]{8})\.json")
_UNWRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_log = logging.getLogger("upr.repo.readers")


@dataclass(frozen=True, slots=True)
class Reader:
    """A live reader of a bucket, as its registration names it."""

    pid: int
    hostname: str
    started: str
    command: str

    def describe(self) -> str:
        """`restore (pid N on host H since T)`."""
        return f"{self.command} (pid {self.pid} on host {self.hostname} since {self.started})"


def registration_name(pid: int, hostname: str, token: str | None = None) -> str:
    """`<pid>-<host>-<8 hex>.json`, the name of a reader's registration file."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", hostname)[:64] or "_"
    return f"{pid}-{host}-{token or secrets.token_hex(4)}.json"


def _try_flock(fd: int, how: int) -> bool:
    """flock without blocking; False when another open file holds a conflicting lock."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return False


def _read_all(fd: int) -> bytes:
    return os.pread(fd, 65536, 0)


def _parse_reader(data: bytes) -> Reader | None:
    holder = LockHolder.from_bytes(data)
    if holder is None:
        return None
    try:
        command = json.loads(data.decode("utf-8")).get("command")
    except (ValueError, AttributeError):
        return None
    if not isinstance(command, str) or not command:
        command = "a reader"
    return Reader(holder.pid, holder.hostname, holder.started, command)


def _same_file(repo: Repository, path: Path, fd: int) -> bool:
    st = repo.storage.stat(path, follow_links=True)
    if st is None:
        return False
    mine = os.fstat(fd)
    return st.ident == (mine.st_dev, mine.st_ino)


def _open_shared(repo: Repository, path: Path) -> int | None:
    """`lock.shared`'s descriptor, created when missing; None: gone meanwhile, try again."""
    storage = repo.storage
    with contextlib.suppress(FileExistsError):  # there already: open that one
        return storage.open_lock(path, create=True)
    try:
        return storage.open_lock(path, create=False)
    except FileNotFoundError:
        return None


def _flock_named(repo: Repository, path: Path, how: int, wait: float,
                 refused: Callable[[bool], None]) -> int:  # fmt: skip
    """A descriptor of `lock.shared` holding `flock(how)`, still the file `path` names
    (its last user may unlink it meanwhile: then again), polling every `_POLL` for up
    to `wait` seconds. Each refusal calls `refused(last)`, `last` once the time is up:
    it raises then."""
    deadline = time.monotonic() + max(wait, 0.0)
    while True:
        fd = _open_shared(repo, path)
        if fd is None:
            continue
        if _try_flock(fd, how):
            if _same_file(repo, path, fd):
                return fd
            os.close(fd)
            continue
        os.close(fd)
        refused(time.monotonic() >= deadline)
        time.sleep(_POLL)


def _scan(repo: Repository, bucket: str, *, remove_dead: bool) -> list[Reader]:
    """The live readers' registrations; with `remove_dead`, dead ones are removed."""
    storage = repo.storage
    d = repo.bucket_dir(bucket) / READERS_DIR
    out: list[Reader] = []
    for entry in storage.list(d):
        is_temp = parse_temp_name(entry.name) is not None
        if not entry.is_file or not (is_temp or _REGISTRATION.fullmatch(entry.name)):
            continue  # not ours: left alone
        path = d / entry.name
        try:
            fd = storage.open_lock(path, create=False)
        except FileNotFoundError:
            continue  # its reader removed it meanwhile
        except OSError as exc:
            if exc.errno in _UNWRITABLE:
                return out  # nothing writes here: no reader can hold a lock either
            raise
        try:
            if not _try_flock(fd, fcntl.LOCK_EX):
                reader = None if is_temp else _parse_reader(_read_all(fd))
                if reader is not None:
                    out.append(reader)
                continue
            # unlocked: a dead reader's registration (or its temp file, once old enough)
            if remove_dead and _same_file(repo, path, fd):
                age = time.time() - os.fstat(fd).st_mtime
                if not is_temp or age >= STALE_TEMP_SECONDS:
                    storage.delete(path)
        finally:
            os.close(fd)
    return sorted(out, key=lambda r: (r.started, r.pid))


def live_readers(repo: Repository, bucket: str) -> list[Reader]:
    """The readers of `bucket` alive now (their registrations' flocks are held), oldest
    first; dead readers' registrations are skipped."""
    s3 = object_storage(repo)
    if s3 is not None:
        return scan_readers(repo, s3, bucket, remove_dead=False)
    return _scan(repo, bucket, remove_dead=False)


def describe_readers(readers: list[Reader]) -> str:
    """`2 readers: restore (pid …), verify (pid …)`."""
    if not readers:
        return "a reader that did not register"
    noun = "reader" if len(readers) == 1 else "readers"
    return f"{len(readers)} {noun}: " + ", ".join(r.describe() for r in readers)


def _writer(repo: Repository, bucket: str) -> LockHolder | None:
    """The bucket's writer lock's holder, when its file can be read."""
    try:
        return LockHolder.from_bytes(repo.storage.read(repo.lock_path(bucket)))
    except OSError:
        return None


def read_lock(repo: Repository, bucket: str, command: str,
              warn: Callable[[str], None] | None = None) -> ReadLock:  # fmt: skip
    """The `ReadLock` a command takes: one line through `warn` (default: a logged
    warning, on stderr) when it has to wait for an exclusive holder."""
    say = warn or _log.warning

    def waiting(holder: LockHolder | None) -> None:
        who = holder.describe() if holder else "a process that removes or rewrites backups"
        say(f"{repo.bucket_dir(bucket)}: {command} waits for {who} to finish "
            f"(up to {DEFAULT_WAIT:g} s)")  # fmt: skip

    return ReadLock(repo, bucket, command=command, on_wait=waiting)


class ReadLock(Held):
    """A shared lock on one bucket, held while a command reads it; a context manager.

    `wait` is how long to wait for an exclusive holder (prune, remove, a sweep) to finish;
    `on_wait(holder)` is called once when the reader has to wait, with the bucket's writer
    lock's holder when it can be read. Then `RepositoryLocked` names the holder.
    """

    def __init__(
        self,
        repo: Repository,
        bucket: str,
        *,
        command: str,
        wait: float = DEFAULT_WAIT,
        on_wait: Callable[[LockHolder | None], None] | None = None,
    ) -> None:
        self.repo = repo
        self.bucket = bucket
        self.command = command
        self.wait = wait
        self.on_wait = on_wait
        self.path: Path = repo.bucket_dir(bucket) / SHARED_FILE
        self.registration: Path | None = None
        self.unlocked = False
        """True when the repository cannot be written and is read without a lock."""
        self._fd: int | None = None
        self._reg_fd: int | None = None
        s3 = object_storage(repo)
        self._lease = LeaseRead(repo, s3, bucket, command, wait, on_wait) if s3 else None

    @property
    def held(self) -> bool:
        """True while this object holds the shared lock."""
        if self._lease is not None:
            return self._lease.lease is not None
        return self._fd is not None

    def acquire(self) -> None:
        """Register, then take the shared lock, waiting up to `wait` seconds for an
        exclusive holder; `RepositoryLocked` when it is still there."""
        if self.held or self._reg_fd is not None:
            raise RepositoryError(f"{self.path}: this reader already holds its lock")
        if self._lease is not None:
            self.registration = self._lease.acquire()
            self.unlocked = self._lease.unlocked
            return
        self.unlocked = False
        bdir = self.repo.bucket_dir(self.bucket)
        st = self.repo.storage.stat(bdir, follow_links=True)
        if st is None or not st.is_dir:
            return  # no bucket: nothing to read or remove; the command says so itself
        try:
            self._register()
            self._take_shared()
        except OSError as exc:
            self.release()
            if exc.errno not in _UNWRITABLE:
                raise
            _log.debug("%s: cannot be written (%s): read without a lock", bdir, exc.strerror)
            self.unlocked = True
        except BaseException:
            self.release()
            raise

    def _register(self) -> None:
        storage = self.repo.storage
        d = self.repo.bucket_dir(self.bucket) / READERS_DIR
        me = LockHolder.me(format_time(datetime.now(UTC)))
        record = {"pid": me.pid, "hostname": me.hostname, "started": me.started,
                  "command": self.command}  # fmt: skip
        data = (json.dumps(record) + "\n").encode()
        for _ in range(_ATTEMPTS):
            with contextlib.suppress(FileExistsError):
                storage.make_dir(d)
            final = d / registration_name(me.pid, socket.gethostname())
            tmp = d / temp_name(final.name)
            try:
                fd = storage.open_lock(tmp, create=True)
            except (FileNotFoundError, FileExistsError):
                continue  # the directory was removed by a reader leaving: again
            try:
                # blocking: a writer's scan may hold it for a moment (it leaves a young
                # temp file alone)
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.pwrite(fd, data, 0)
                storage.replace(tmp, final)
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    storage.delete(tmp)
                raise
            self._reg_fd, self.registration = fd, final
            return
        raise RepositoryLocked(f"{d}: readers kept changing; try again", pid=None, hostname=None)

    def _take_shared(self) -> None:
        told = False

        def refused(last: bool) -> None:
            nonlocal told
            holder = _writer(self.repo, self.bucket)
            if last:
                who = holder.describe() if holder else "a process that removes or rewrites"
                raise RepositoryLocked(
                    f"{self.path}: bucket {self.bucket!r} is being changed by {who}; "
                    f"{self.command} waited {self.wait:g} s",
                    pid=holder.pid if holder else None,
                    hostname=holder.hostname if holder else None,
                )
            if not told and self.on_wait is not None:
                told = True
                self.on_wait(holder)

        self._fd = _flock_named(self.repo, self.path, fcntl.LOCK_SH, self.wait, refused)

    def release(self) -> None:
        """Drop the shared lock, then remove the registration (so a reader holding the
        flock is always registered); a no-op when not held. The last reader out removes
        `lock.shared` and the empty `readers/` directory."""
        if self._lease is not None:
            self.registration = None
            self._lease.release()
            return
        fd, self._fd = self._fd, None
        reg_fd, self._reg_fd = self._reg_fd, None
        reg, self.registration = self.registration, None
        storage = self.repo.storage
        try:
            if fd is not None:
                try:
                    last = _try_flock(fd, fcntl.LOCK_EX)  # no other reader left
                    if last and _same_file(self.repo, self.path, fd):
                        storage.delete(self.path)
                finally:
                    os.close(fd)
            if reg is not None:
                with contextlib.suppress(FileNotFoundError):
                    storage.delete(reg)
                with contextlib.suppress(OSError):
                    storage.remove_dir(reg.parent)  # only an empty one
        finally:
            if reg_fd is not None:
                os.close(reg_fd)


class ExclusiveAccess(Held):
    """Exclusive access to one bucket against its readers, for removing or rewriting;
    a context manager. The caller already holds the bucket's `RepositoryLock`.

    `wait` is how long to wait for the readers to finish (0: try once); `on_wait(readers)`
    is called once when it has to wait. Then `RepositoryLocked` names the readers.
    """

    def __init__(
        self,
        repo: Repository,
        bucket: str,
        *,
        wait: float = 0.0,
        on_wait: Callable[[list[Reader]], None] | None = None,
    ) -> None:
        self.repo = repo
        self.bucket = bucket
        self.wait = wait
        self.on_wait = on_wait
        self.path: Path = repo.bucket_dir(bucket) / SHARED_FILE
        self._fd: int | None = None
        s3 = object_storage(repo)
        self._lease = LeaseExclusive(repo, s3, bucket, wait, on_wait) if s3 else None

    @property
    def held(self) -> bool:
        """True while this object holds the exclusive access."""
        if self._lease is not None:
            return self._lease.lease is not None
        return self._fd is not None

    def acquire(self) -> None:
        """Take `flock(LOCK_EX)` on `lock.shared`, waiting up to `wait` seconds for the
        readers; then remove dead readers' registrations."""
        if self.held:
            raise RepositoryError(f"{self.path}: this object already holds exclusive access")
        if self._lease is not None:
            self._lease.acquire()
            return
        told = False

        def refused(last: bool) -> None:
            nonlocal told
            readers = live_readers(self.repo, self.bucket)
            if last:
                waited = f"waited {self.wait:g} s; " if self.wait > 0 else ""
                first = readers[0] if readers else None
                raise RepositoryLocked(
                    f"{self.path}: bucket {self.bucket!r} is being read by "
                    f"{describe_readers(readers)}; {waited}--wait SECONDS waits for them",
                    pid=first.pid if first else None,
                    hostname=first.hostname if first else None,
                )
            if not told and self.on_wait is not None:
                told = True
                self.on_wait(readers)

        self._fd = _flock_named(self.repo, self.path, fcntl.LOCK_EX, self.wait, refused)
        try:
            _scan(self.repo, self.bucket, remove_dead=True)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Unlink `lock.shared` (only if the path still names it), then drop the flock."""
        if self._lease is not None:
            self._lease.release()
            return
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _same_file(self.repo, self.path, fd):
                self.repo.storage.delete(self.path)
            with contextlib.suppress(OSError):
                self.repo.storage.remove_dir(self.repo.bucket_dir(self.bucket) / READERS_DIR)
        finally:
            os.close(fd)


def sweep_unless_read(repo: Repository, bucket: str, running: BackupId,
                      lock: RepositoryLock) -> list[Path] | None:  # fmt: skip
    """`Repository.sweep` with exclusive access against the bucket's readers, if it can
    be had at once; with readers present the sweep is skipped this time (None, logged at
    debug level): leftovers are harmless and the next run sweeps them. A backup and a
    merge call it: the rest of their runs only add files and exclude no reader."""
    access = ExclusiveAccess(repo, bucket, wait=0)
    try:
        access.acquire()
    except RepositoryLocked as exc:
        _log.debug("sweep skipped: %s", exc)
        return None
    try:
        return repo.sweep(bucket, running, lock)
    finally:
        access.release()
