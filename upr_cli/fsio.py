"""Atomic publication of files: write under a temp name → fsync → rename → fsync directory.

Theory of operation (formats/repository.md §2.4 and §4.3, formats/segment.md
"Writing"): a file upr publishes (a segment,
a manifest, repo.json, a cluster spec) is first written whole under a temp name in the
same directory (`temp_name`: `.FINAL.tmp-RANDOM`) and fsynced; `rename` then makes it
visible under its final name in one step, and an fsync of the directory makes the
rename durable. A crash at any point leaves either the old state or the new one, plus
at most a temp file that a sweep removes (`parse_temp_name` recognises them, the segment
writer's `-body` spill files included). Every call goes through `FileOps`, so tests can
fail any of them. Writes and fsyncs of open files raise the typed error of
`upr_cli.errors.os_error`, naming the file (a full disk is `DiskFull`, exit 74); the
path-level calls raise `OSError` for the caller to name what it was doing.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from upr_cli.errors import os_error

# `.FINAL.tmp-TOKEN`, optionally with a suffix such as the segment writer's `-body`.
_TEMP = re.compile(r"\.(.+)\.tmp-([0-9a-f]{8})(?:-[a-z0-9]+)?")


_NAMES = random.Random()
os.register_at_fork(after_in_child=_NAMES.seed)


def temp_name(final: str, token: str | None = None) -> str:
    """The name a file is written under before its rename to `final`: `.FINAL.tmp-RANDOM`.

    ValueError for a name with a directory in it or a token that is not 8 hex digits.
    """
    if not final or "/" in final:
        raise ValueError(f"a temp name needs a plain file name, got {final!r}")
    if token is None:  # as `tempfile` names its files: no system call per name (a
        # follower names a thousand segments a commit), reseeded in a forked child
        token = f"{_NAMES.getrandbits(32):08x}"
    elif not re.fullmatch(r"[0-9a-f]{8}", token):
        raise ValueError(f"temp token {token!r} is not 8 lowercase hex digits")
    return f".{final}.tmp-{token}"


def parse_temp_name(name: str) -> str | None:
    """The final name a temp file was meant for, or None when `name` is not a temp name."""
    m = _TEMP.fullmatch(name)
    return m.group(1) if m else None


def temp_path(path: Path) -> Path:
    """A fresh temp name for `path`, in its directory."""
    return path.with_name(temp_name(path.name))


def _name(f: IO[bytes]) -> str | None:
    """The path a file object was opened with, if it has one."""
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else None


class FileOps:
    """The file-system calls upr makes to write and publish files (tests subclass it to
    inject failures)."""

    def open(self, path: Path) -> IO[bytes]:
        """Create a new file for reading and writing (fails if it exists)."""
        return open(path, "x+b")

    def write(self, f: IO[bytes], data: bytes) -> None:
        """Write all of `data`; a failing file system is a typed error naming the file."""
        try:
            f.write(data)
        except OSError as exc:
            raise os_error(exc, _name(f)) from None

    def fsync(self, f: IO[bytes]) -> None:
        """Flush and fsync a file (a full disk often shows here, on the buffered bytes)."""
        try:
            f.flush()
            os.fsync(f.fileno())
        except OSError as exc:
            raise os_error(exc, _name(f)) from None

    def copy(self, src: IO[bytes], dst: IO[bytes]) -> None:
        """Copy the rest of `src` into `dst`."""
        dst.flush()
        shutil.copyfileobj(src, dst, 1 << 20)

    def write_file(self, path: Path, data: bytes) -> None:
        """Create `path` (it must not exist), write all of `data`, fsync, close."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        """Atomically rename `src` to `dst`, replacing it."""
        os.replace(src, dst)

    def fsync_dir(self, path: Path) -> None:
        """fsync a directory so that entries created, renamed or removed in it are durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def mkdir(self, path: Path) -> None:
        """Create one directory (its parent must exist; it must not)."""
        os.mkdir(path)

    def remove(self, path: Path) -> None:
        """Remove a file if it exists."""
        path.unlink(missing_ok=True)

    def remove_tree(self, path: Path) -> None:
        """Remove a directory and everything in it (symlinks inside are not followed)."""
        shutil.rmtree(path)


def atomic_write(path: Path, data: bytes, ops: FileOps | None = None) -> None:
    """Publish `data` at `path`: temp file, fsync, rename, fsync the directory."""
    ops = ops or FileOps()
    tmp = temp_path(path)
    try:
        ops.write_file(tmp, data)
        ops.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a sweep removes it otherwise
            os.unlink(tmp)
        raise
    ops.fsync_dir(path.parent)


def sync_files(paths: Iterable[Path], workers: int = 8) -> None:
    """fsync many files concurrently, then each of their directories once: what a writer
    that published files without syncing does before its commit point."""
    files = list(paths)

    def one(p: Path) -> None:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fsync") as pool:
        list(pool.map(one, files))
    ops = FileOps()
    for d in sorted({p.parent for p in files}):
        ops.fsync_dir(d)
