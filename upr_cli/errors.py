"""Error hierarchy shared by every layer, and the exit codes of the `upr` command.

Errors are split by who is at fault:

`UprError`: the base; the CLI prints its message as one line on stderr and exits with
its `exit_code` (an `ExitCode`; README "Errors and exit codes" is the table).
`LocalProtocolError`: we misused the protocol (a bug or bad arguments on our side).
`RemoteProtocolError`: the peer sent bytes that do not follow the protocol.
`UsageError`: the user gave input that cannot be acted on (exit 2); `PathError` when it is
a path that is not what it should be.
`LocalIOError`: the local file system failed a read or write (exit 74); `DiskFull` when
it has no space left.

`os_error` turns an `OSError` into one of these, naming the path.
"""

from __future__ import annotations

import errno
import os
import socket
from enum import IntEnum
from pathlib import Path


class ExitCode(IntEnum):
    """The exit status of every `upr` command (README "Errors and exit codes", upr(1))."""

    OK = 0
    """Done (diff: identical; salvage: nothing left to write back)."""
    FAILED = 1
    """The operation failed (the source or target, the network, damaged data, a held lock,
    writes that failed), or the command's documented "no": diff: the histories differ
    (diverged, B ahead, no common history, a partition on one side only: B only behind
    is BEHIND); verify: problems found; salvage: lost writes remain; examine: no version
    of the key; cat: no such document in the state."""
    USAGE = 2
    """Bad input or usage: options, values, URIs, specs, partitions the bucket cannot have,
    and paths or files that are not what they should be. diff and salvage, whose 1 is an
    answer, also exit 2 when they fail."""
    IMPOSSIBLE_HISTORY = 3
    """The failover logs describe a history that cannot happen (the UPR design
    specification's "Not possible!" case)."""
    PARTIAL = 4
    """Done, but partial: something the output names was left out (restore: partitions
    whose segments are damaged, with --skip-corrupt; keys the target refused)."""
    BEHIND = 5
    """diff: B is behind A on the same branch in some partitions and identical in the
    others, and no partition needs a rollback: the next backup or replay of B catches up
    (a check from cron: 0 and 5 are fine, 1 is not)."""
    INTERNAL = 70
    """A bug in upr (sysexits EX_SOFTWARE): the message says so; UPR_DEBUG=1 shows where."""
    IO_ERROR = 74
    """The local file system failed a read or write: disk full, quota, I/O error, read-only
    (sysexits EX_IOERR). The same command can succeed once the system is fixed."""
    INTERRUPTED = 130
    """Ctrl-C (128 + SIGINT) stopped a bounded command; what it committed is kept and one
    line says what and how to go on (upr_cli/interrupt.py). A follower exits 0."""
    TERMINATED = 143
    """SIGTERM (128 + SIGTERM) stopped a bounded command, as INTERRUPTED."""


class UprError(Exception):
    """Base of every error upr raises on purpose."""

    exit_code: int = ExitCode.FAILED


class LocalProtocolError(UprError):
    """We tried to send something the protocol does not allow."""


class RemoteProtocolError(UprError):
    """The peer sent bytes that do not follow the protocol."""


class UsageError(UprError):
    """Input given by the user is malformed or inconsistent."""

    exit_code = ExitCode.USAGE


class PathError(UsageError):
    """A path given is not what it should be: missing, not a directory, a directory where
    a file goes, not accessible."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)


class LocalIOError(UprError):
    """The local file system failed a read or write on `path` (`errno` says how)."""

    exit_code = ExitCode.IO_ERROR

    def __init__(
        self, message: str, path: str | os.PathLike[str] | None = None, err: int | None = None
    ) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.errno = err


class DiskFull(LocalIOError):
    """No space (or quota) left on the file system holding `path`; `free` bytes remain."""

    def __init__(
        self, message: str, path: str | os.PathLike[str] | None, err: int, free: int | None
    ) -> None:
        super().__init__(message, path, err)
        self.free = free


#: errnos that say the path itself is wrong (the command line must change)
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                          errno.ENAMETOOLONG, errno.ELOOP, errno.EACCES, errno.EPERM})  # fmt: skip
#: errnos of a file system without room
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_network_error(exc: OSError) -> bool:
    """True for a socket's errors (refused, reset, unreachable, timed out, no such host)."""
    return isinstance(exc, ConnectionError | TimeoutError | socket.gaierror | socket.herror) or (
        exc.filename is None
        and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EADDRINUSE,
                          errno.EADDRNOTAVAIL)
    )  # fmt: skip


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding `path` (its
    nearest existing ancestor), or None when it cannot be asked."""
    p = Path(path).absolute()
    for candidate in (p, *p.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


_IEC_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")


def size_text(n: int, *, step: int = 1024, units: tuple[str, ...] = _IEC_UNITS) -> str:
    """1536 → '1.5 KiB': whole bytes, else one decimal of the largest unit under `step`."""
    value = float(n)
    for unit in units:
        if value < step or unit == units[-1]:
            return f"{n} {unit}" if unit == units[0] else f"{value:.1f} {unit}"
        value /= step
    raise AssertionError("unreachable")


def _not_a_directory(p: Path) -> Path | None:
    """The ancestor of `p` (or `p`) that exists and is not a directory."""
    for candidate in (*reversed(p.parents), p):
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return None


def _missing_directory(p: Path) -> Path | None:
    """The highest ancestor of `p` that does not exist (None when its parent exists)."""
    for candidate in reversed(p.parents):
        if not os.path.lexists(candidate):
            return candidate
    return None


def os_error(exc: OSError, path: str | os.PathLike[str] | None = None, doing: str = "") -> UprError:
    """The typed error for `exc`, one line naming the path (`path`, else the one the
    system named): `DiskFull` (exit 74) with the free space left, `LocalIOError` (74)
    for a failing file system, `PathError` (2) for a path that is not what it should be,
    and a plain `UprError` (1) for a network error. `doing` says what was tried
    ("cannot create the repository")."""
    reason = (exc.strerror or str(exc)).rstrip(".")
    reason = reason[:1].lower() + reason[1:]
    if exc.filename is None and is_network_error(exc):  # a socket's: no path to name
        return UprError(f"network error: {reason}")
    if path is None and exc.filename is not None:
        path = os.fsdecode(exc.filename)
    code = exc.errno or 0
    where = f"{path}: " if path is not None else ""
    if doing:
        where += f"{doing}: "
    if code in _FULL_ERRNOS:
        free = free_bytes(path) if path is not None else None
        left = f", {size_text(free)} free on its file system" if free is not None else ""
        what = "no space left on device" if code == errno.ENOSPC else "disk quota exceeded"
        return DiskFull(f"{where}{what}: the disk is full{left}", path, code, free)
    if code in _PATH_ERRNOS and path is not None:
        p = Path(path)
        if code == errno.ENOTDIR and (bad := _not_a_directory(p)) is not None and bad != p:
            reason = f"{bad} is not a directory"
        elif code == errno.ENOENT and (missing := _missing_directory(p)) is not None:
            reason = f"directory {missing} does not exist"
        return PathError(f"{where}{reason}", path)
    return LocalIOError(f"{where}{reason}", path, code or None)


def check_file_path(path: str | os.PathLike[str], label: str | None = None) -> Path:
    """Check that `path` can be a file this command creates or replaces: its directory
    exists and is one, and `path` is not a directory. Raises `PathError` starting with
    `label` (default: the path; e.g. "--state s.json"); returns the path."""
    p = Path(path)
    if p.is_dir():
        raise PathError(f"{label or p}: is a directory; give a file", p)
    check_parent_dir(p, label)
    return p


def check_parent_dir(path: str | os.PathLike[str], label: str | None = None) -> None:
    """Check that `path` can be created: its directory exists, is one, and is writable.
    Raises `PathError` starting with `label` (default: the path)."""
    p = Path(path)
    where = label or str(p)
    parent = p.parent
    if not parent.exists():
        missing = _missing_directory(p) or parent
        raise PathError(f"{where}: directory {missing} does not exist", p)
    if not parent.is_dir():
        bad = _not_a_directory(parent) or parent
        raise PathError(f"{where}: {bad} is not a directory", p)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PathError(f"{where}: cannot write in directory {parent}: permission denied", p)
