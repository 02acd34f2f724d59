"""Atomic publication of small files: temp name → fsync → rename → fsync directory.

Theory of operation (DESIGN "Reliability principles", STYLE 9): a file the repository
publishes is first written whole under a temp name (`names.temp_name`) in the same
directory and fsynced; `rename` then makes it visible under its final name in one step,
and an fsync of the directory makes the rename durable. A crash at any point leaves
either the old state or the new one, plus at most a temp file that `Repository.sweep`
removes. Every call goes through `DiskOps`, so tests can fail any of them (the segment
writer's `FileOps` does the same).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from upr_cli.repo.names import temp_name


class DiskOps:
    """The file-system calls the repository makes to publish or remove files."""

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


def atomic_write(path: Path, data: bytes, ops: DiskOps | None = None) -> None:
    """Publish `data` at `path`: temp file, fsync, rename, fsync the directory."""
    ops = ops or DiskOps()
    tmp = path.with_name(temp_name(path.name))
    try:
        ops.write_file(tmp, data)
        ops.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a sweep removes it otherwise
            os.unlink(tmp)
        raise
    ops.fsync_dir(path.parent)
