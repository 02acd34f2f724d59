"""The data directory lock: one `upr serve` at a time per data directory.

Theory of operation: two nodes on one directory would both take writes and flush them
into one SQLite file, each over the other's partition state, and acknowledged writes
would be lost. So a node takes `fcntl.flock(LOCK_EX)` on `<data>/node.lock` before it
opens anything else in the directory, and holds it until it exits. The kernel drops a
flock when its holder dies, however it dies, so a SIGKILLed node never blocks its own
restart, and the flock alone decides who holds the directory: a lock file left by a
dead process, or written on another host, is taken over without a question.

The file's content (pid, host name and start time, as JSON: `upr_cli/lockholder.py`)
only names the holder in the refusal. The file is never removed: unlinking it would let
a node that opened the old file and a node that created a new one hold flocks on two
files for one path.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from datetime import UTC, datetime
from pathlib import Path

from upr_cli.errors import UprError, os_error
from upr_cli.lockholder import LockHolder

LOCK_FILE = "node.lock"
_READ_WAIT = 0.5  # seconds to wait for a holder that has the flock but not yet its content


class DataDirLocked(UprError):
    """Another live process holds the data directory's lock (exit 1)."""

    def __init__(self, message: str, *, pid: int | None, hostname: str | None) -> None:
        super().__init__(message)
        self.pid = pid
        self.hostname = hostname


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class DataDirLock:
    """The exclusive lock on a node's data directory; `acquire`, then `release`."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / LOCK_FILE
        self.holder: LockHolder | None = None
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> LockHolder:
        """Take the lock or raise `DataDirLocked` naming the holder; the directory exists."""
        if self._fd is not None:
            raise UprError(f"{self.path}: this lock object already holds the lock")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise os_error(exc, self.path, "cannot open the data directory's lock") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise os_error(exc, self.path, "cannot lock the data directory") from None
                raise self._locked(fd) from None
            me = LockHolder.me(_now())
            data = me.to_bytes()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.holder = fd, me
        return me

    def _locked(self, fd: int) -> DataDirLocked:
        """The refusal, naming the holder once it has written the file (it does so right
        after taking the flock: wait a moment for it)."""
        deadline = time.monotonic() + _READ_WAIT
        holder = LockHolder.from_bytes(os.pread(fd, 4096, 0))
        while holder is None and time.monotonic() < deadline:
            time.sleep(0.01)
            holder = LockHolder.from_bytes(os.pread(fd, 4096, 0))
        who = holder.describe() if holder else "another process (it has not written its name)"
        return DataDirLocked(
            f"{self.data_dir}: data directory is locked by {who}",
            pid=holder.pid if holder else None,
            hostname=holder.hostname if holder else None,
        )

    def release(self) -> None:
        """Drop the flock (the file stays: see the module docstring); a no-op when not held."""
        fd, self._fd, self.holder = self._fd, None, None
        if fd is not None:
            os.close(fd)
