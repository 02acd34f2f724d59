"""The storage of a repository: the one interface through which the repository's layout,
manifests, locks, the sweep, `verify` and the segment writer and reader reach its files
(docs/design.md "Storage").

Theory of operation: a key is a path under the repository's root. `Storage` names what
the repository needs from a store: list, stat, read (a range, or a file object for a
streaming reader), write (publish whole, replacing), write-if-absent, delete, and the
directory and streaming-write operations a local file system needs for the commit of
formats/repository.md §2.4. `LocalStorage`, the one backend for now, is a local
directory: `write` is today's temp name → fsync → rename → fsync of the directory
(`fsio.atomic_write`), `write_if_absent` links the fsynced temp file into place (link(2)
never replaces), and every system call that publishes goes through `fsio.FileOps`, so
tests can fail any of them.

A location (`--repo`, a `repo:` source) is a plain path or `s3://BUCKET/PREFIX`
(`parse_location`); an object-store location is carried as the path `s3:/BUCKET/PREFIX`
(`is_s3`, `s3_parts`, `display_location`), and `open_storage` picks the backend. Any
other scheme is refused (`UnknownScheme`) instead of naming a local directory `s3:`.
"""

from __future__ import annotations

import errno
import io
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISDIR, S_ISREG
from typing import IO, TYPE_CHECKING, Any, Protocol

from upr_cli.fsio import FileOps, atomic_write, sync_files, temp_path

if TYPE_CHECKING:
    from upr_cli.repo.access import Access

__all__ = [
    "LOCAL",
    "S3_ROOT",
    "Entry",
    "LocalStorage",
    "Stat",
    "Storage",
    "UnknownScheme",
    "display_location",
    "is_s3",
    "local_root",
    "open_storage",
    "parse_location",
    "s3_parts",
    "unwrap",
]

# `scheme://…`: a location some other backend would serve.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# errors that mean "nothing there" to a stat, as pathlib's exists() and is_dir() read them
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP})


class UnknownScheme(ValueError):
    """A repository location with a scheme no backend serves (yet)."""


def local_root(location: str) -> Path:
    """The local directory a repository location names: a plain path, as it is.

    `UnknownScheme` for `scheme://…` (object storage, `file://`): no backend serves it.
    """
    m = _SCHEME.match(location)
    if m is not None:
        raise UnknownScheme(
            f"{location!r}: {m.group(1)}:// repositories are not supported; give a local "
            "directory or s3://BUCKET/PREFIX"
        )
    return Path(location)


S3_ROOT = "s3:"
"""The first part of the path an `s3://BUCKET/PREFIX` location is carried as."""


def parse_location(location: str) -> Path:
    """The path a repository location is carried as: a plain path as it is,
    `s3://BUCKET/PREFIX` as `s3:/BUCKET/PREFIX`; `UnknownScheme` for any other scheme or
    an `s3://` location without a bucket."""
    m = _SCHEME.match(location)
    if m is None or m.group(1).lower() != "s3":
        return local_root(location)
    rest = location[m.end() :].strip("/")
    bucket = rest.split("/", 1)[0]
    if not bucket:
        raise UnknownScheme(f"{location!r}: an s3:// repository needs a bucket: s3://BUCKET/PREFIX")
    return Path(S3_ROOT, *rest.split("/"))


def is_s3(path: Path) -> bool:
    """True if `path` carries an `s3://` location (`parse_location`)."""
    return bool(path.parts) and path.parts[0] == S3_ROOT


def s3_parts(path: Path) -> tuple[str, str]:
    """(bucket, key prefix) of a path `is_s3` accepts; the prefix has no slash at either end."""
    parts = path.parts[1:]
    if not parts:
        raise UnknownScheme(f"{path}: not an s3:// location")
    return parts[0], "/".join(parts[1:])


def display_location(path: Path) -> str:
    """The location as a user writes it: `s3://BUCKET/PREFIX/…` or the path."""
    if is_s3(path):
        return "s3://" + "/".join(path.parts[1:])
    return str(path)


def unwrap(storage: Storage) -> Storage:
    """The backend under any layers (`inner`): an encrypting layer seals what it stores in
    the backend, and lock objects are the backend's own business."""
    while (inner := getattr(storage, "inner", None)) is not None:
        storage = inner
    return storage


def open_storage(root: Path, ops: FileOps | None = None, access: Access | None = None) -> Storage:
    """The backend that serves the repository at `root`: an object store for `s3:` paths
    (`upr_cli.s3`, with the endpoint and transfers of `access`, else of
    `upr_cli.repo.access.current`), else the local directory, making its system calls
    through `ops`."""
    if is_s3(root):
        from upr_cli.s3 import S3Storage

        return S3Storage.for_root(root, access)
    return LocalStorage(ops)


@dataclass(frozen=True, slots=True)
class Entry:
    """One name directly inside a directory, as listed (symbolic links not followed)."""

    name: str
    is_dir: bool
    is_file: bool


@dataclass(frozen=True, slots=True)
class Stat:
    """What a stat says about a key: its kind, size and identity."""

    is_dir: bool
    is_file: bool
    size: int
    ident: tuple[int, int]
    """(device, inode): the same file, whatever its name is now."""
    version: tuple[int, int, int, int]
    """(device, inode, size, mtime): changes whenever the file is replaced or rewritten."""


class Storage(Protocol):
    """What a repository reads and writes its files through (one implementation a
    backend)."""

    def list(self, path: Path) -> list[Entry]:
        """The entries directly inside the directory `path`; [] when it is none."""
        ...

    def stat(self, path: Path, *, follow_links: bool = False) -> Stat | None:
        """The key's kind, size and identity; None when nothing is there."""
        ...

    def read(self, path: Path, offset: int = 0, length: int = -1) -> bytes:
        """`length` bytes from `offset` (fewer at the end; all with -1);
        FileNotFoundError when missing."""
        ...

    def open_read(self, path: Path) -> IO[bytes]:
        """A file object to read a large file through, in ranges (segment readers)."""
        ...

    def write(self, path: Path, data: bytes) -> None:
        """Publish `data` at `path` whole and durably, replacing what is there."""
        ...

    def write_if_absent(self, path: Path, data: bytes) -> None:
        """Publish `data` at `path` whole and durably; FileExistsError when it exists."""
        ...

    def delete(self, path: Path) -> None:
        """Remove a file; nothing when it is missing."""
        ...

    def delete_tree(self, path: Path) -> None:
        """Remove a directory and everything in it."""
        ...

    def make_dir(self, path: Path) -> None:
        """Create one directory (FileExistsError when something is there)."""
        ...

    def make_dirs(self, path: Path) -> None:
        """Create a directory and its missing parents; nothing when it exists."""
        ...

    def remove_dir(self, path: Path) -> None:
        """Remove an empty directory (OSError when it is not empty or missing)."""
        ...

    def sync_dir(self, path: Path) -> None:
        """Make the entries created, renamed or removed in a directory durable."""
        ...

    def create(self, path: Path) -> IO[bytes]:
        """A new file (it must not exist) to write a large file into, in pieces."""
        ...

    def append(self, f: IO[bytes], data: bytes) -> None:
        """Write `data` to a file `create` handed out."""
        ...

    def copy(self, src: IO[bytes], dst: IO[bytes]) -> None:
        """Copy the rest of `src` into `dst` (a file `create` handed out)."""
        ...

    def sync(self, f: IO[bytes]) -> None:
        """Make a file `create` handed out durable."""
        ...

    def replace(self, src: Path, dst: Path) -> None:
        """Rename `src` to `dst` in one step, replacing it (the publication of a file
        written in pieces)."""
        ...

    def sync_all(self, paths: Iterable[Path]) -> None:
        """Make many published files, and their directories, durable at once."""
        ...

    def link(self, src: Path, dst: Path) -> None:
        """Give the new file `dst` the content of the file `src`, without copying its
        bytes where the backend can (a hard link; a copy inside the store); `dst` must
        not exist. Not durable until `sync_all` (or `sync_dir` of its directory)."""
        ...

    def open_lock(self, path: Path, *, create: bool) -> int:
        """A descriptor, for reading and writing, of the lock file at `path`, created
        exclusively with `create` (FileExistsError when it exists): the bucket lock
        holds its flock on it."""
        ...


class LocalStorage:
    """A repository in a local directory; every call that publishes through `ops`."""

    def __init__(self, ops: FileOps | None = None) -> None:
        self.ops = ops or FileOps()

    def __repr__(self) -> str:
        return f"LocalStorage({type(self.ops).__name__})"

    def list(self, path: Path) -> list[Entry]:
        """The entries directly inside the directory `path`; [] when it is none."""
        try:
            with os.scandir(path) as it:
                return [Entry(e.name, e.is_dir(follow_symlinks=False),
                              e.is_file(follow_symlinks=False)) for e in it]  # fmt: skip
        except (FileNotFoundError, NotADirectoryError):
            return []

    def stat(self, path: Path, *, follow_links: bool = False) -> Stat | None:
        """The key's kind, size and identity; None when nothing is there."""
        try:
            st = os.stat(path) if follow_links else os.lstat(path)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return None
            raise
        return _stat(st)

    def read(self, path: Path, offset: int = 0, length: int = -1) -> bytes:
        """`length` bytes from `offset` (fewer at the end; all with -1)."""
        with open(path, "rb") as f:
            if offset:
                f.seek(offset)
            return f.read(length)

    def open_read(self, path: Path) -> IO[bytes]:
        """A file object to read a large file through, in ranges (segment readers)."""
        return open(path, "rb")

    def write(self, path: Path, data: bytes) -> None:
        """Temp file, fsync, rename, fsync the directory (`fsio.atomic_write`)."""
        atomic_write(path, data, self.ops)

    def write_if_absent(self, path: Path, data: bytes) -> None:
        """Temp file, fsync, link into place (link(2) never replaces), fsync the
        directory; FileExistsError when `path` exists."""
        tmp = temp_path(path)
        try:
            self.ops.write_file(tmp, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:  # no hard links on this file system: rename (may replace)
                self.ops.rename(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.ops.fsync_dir(path.parent)

    def delete(self, path: Path) -> None:
        """Remove a file; nothing when it is missing."""
        self.ops.remove(path)

    def delete_tree(self, path: Path) -> None:
        """Remove a directory and everything in it (symlinks inside are not followed)."""
        self.ops.remove_tree(path)

    def make_dir(self, path: Path) -> None:
        """Create one directory (its parent must exist; FileExistsError when taken)."""
        self.ops.mkdir(path)

    def make_dirs(self, path: Path) -> None:
        """Create a directory and its missing parents; nothing when it exists."""
        path.mkdir(parents=True, exist_ok=True)

    def remove_dir(self, path: Path) -> None:
        """Remove an empty directory."""
        path.rmdir()

    def sync_dir(self, path: Path) -> None:
        """fsync a directory."""
        self.ops.fsync_dir(path)

    def create(self, path: Path) -> IO[bytes]:
        """A new file for reading and writing (it must not exist)."""
        return self.ops.open(path)

    def append(self, f: IO[bytes], data: bytes) -> None:
        """Write all of `data` (a failing file system is a typed error naming the file)."""
        self.ops.write(f, data)

    def copy(self, src: IO[bytes], dst: IO[bytes]) -> None:
        """Copy the rest of `src` into `dst`."""
        self.ops.copy(src, dst)

    def sync(self, f: IO[bytes]) -> None:
        """Flush and fsync a file."""
        self.ops.fsync(f)

    def replace(self, src: Path, dst: Path) -> None:
        """Atomically rename `src` to `dst`, replacing it."""
        self.ops.rename(src, dst)

    def sync_all(self, paths: Iterable[Path]) -> None:
        """fsync many files concurrently, then each of their directories once."""
        sync_files(paths)

    def link(self, src: Path, dst: Path) -> None:
        """A hard link; a copy (temp name, rename) on a file system without them."""
        try:
            os.link(src, dst)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP):
                raise
            tmp = temp_path(dst)
            try:
                with open(src, "rb") as f, self.ops.open(tmp) as out:
                    self.ops.copy(f, out)
                    self.ops.fsync(out)
                self.ops.rename(tmp, dst)
            finally:
                tmp.unlink(missing_ok=True)

    def open_lock(self, path: Path, *, create: bool) -> int:
        """The lock file's descriptor (O_RDWR), created with O_CREAT|O_EXCL on `create`."""
        flags = os.O_RDWR | os.O_CLOEXEC
        if create:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        return os.open(path, flags)


def _stat(st: os.stat_result) -> Stat:
    ident = (st.st_dev, st.st_ino)
    version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return Stat(S_ISDIR(st.st_mode), S_ISREG(st.st_mode), st.st_size, ident, version)


LOCAL: Storage = LocalStorage()
"""The local file system, for a reader given a path and no repository."""


class SeekableReader(io.RawIOBase):
    """A read-only, seekable view of `size` bytes (a pack's member, a large object):
    subclasses implement `read` at `self._pos`."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size, self._pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:  # each subclass reads its way
        raise io.UnsupportedOperation("read")

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)
