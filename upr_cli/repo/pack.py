"""Packs: the segment files of one backup directory in one file, `segments.pack`
(formats/repository.md §12).

Theory of operation: a commit of `backup --follow` must be a few objects whatever the
partition count, so its segment files (and its cut-back segments) are concatenated into
one file. A pack is a 16-byte header (magic, version, CRC-32), the members' bytes back
to back, an index (each member's path relative to the backup directory, offset, length,
CRC-32) and a fixed 32-byte trailer that locates the index (offset, length, CRC-32,
magic, its own CRC-32). `write_pack` builds one from finished local segment files through
a `Storage` (plain, sealed or an object store) under a temp name
(formats/repository.md §2.4), makes it durable and renames it into place.
`parse_index` is strict: any inconsistency is a `PackError` (a `SegmentError`: every
reader reports it as damage, one line naming the pack).

`PackedStorage` is the layer every reader reaches the repository through
(`Repository.storage` puts it outermost, over the sealing layer of an encrypted
repository): a path `D/NAME` or `D/cut-K/NAME` whose NAME is a segment name and that
`D/segments.pack` lists reads as the member (`open_read` a seekable window, `read`,
`stat`, `list`, `link` as a real file's copy), so readers keep opening segments by path.
Each directory's index is read once and cached (committed directories never change); the
cache entry is forgotten when this process writes, replaces or deletes in the directory.
A directory without a pack costs one stat of `D/segments.pack`, once; a cached "no pack"
is checked again before a member is reported missing (another process may have written
the pack since).
"""

from __future__ import annotations

import contextlib
import errno
import struct
import threading
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Final, cast

from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.names import parse_backup_dir, parse_cut_path, parse_segment_name, temp_name
from upr_cli.segments.format import SegmentError
from upr_cli.storage import Entry, SeekableReader, Stat, Storage

__all__ = [
    "HEADER",
    "MAGIC",
    "PACK_NAME",
    "TRAILER",
    "Member",
    "NeedMore",
    "PackError",
    "PackIndex",
    "PackedStorage",
    "check_pack",
    "encode_index",
    "load_index",
    "parse_index",
    "write_pack",
]

PACK_NAME = "segments.pack"
"""The pack of a backup directory: `<backup-dir>/segments.pack`."""
MAGIC = b"UPR-PACK"
"""The first 8 bytes of a pack, and the trailer's magic."""
FORMAT_VERSION = 1
"""The pack format version this code writes and reads."""
HEADER = struct.Struct(">8sHHI")
"""magic, version, flags (0), CRC-32 of the 12 bytes before it: 16 bytes."""
TRAILER = struct.Struct(">QQI8sI")
"""index offset, index length, index CRC-32, magic, CRC-32 of the 28 bytes before it."""
_COUNT = struct.Struct(">I")
_ENTRY = struct.Struct(">QQIH")  # offset, length, CRC-32, name length; then the name
_CHUNK = 1 << 20
_TAIL_READ = 64 * 1024  # one read of a pack's end holds the trailer and most indexes
_NAME_MAX = 4 + 1 + 45 + 10  # "cut-9999/" + a segment name, with room


class PackError(SegmentError):
    """A pack that cannot be read: a bad header, trailer or index, or a truncated file.
    A `SegmentError`, so verify names the pack and restore refuses it."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(path, f"damaged pack: {reason}")


@dataclass(frozen=True, slots=True)
class Member:
    """One member of a pack: where its bytes are, and their CRC-32."""

    name: str
    offset: int
    length: int
    crc: int


@dataclass(frozen=True, slots=True)
class PackIndex:
    """A pack's parsed index: its members by relative path, and the pack's size."""

    path: Path
    size: int
    members: dict[str, Member]

    def subdirs(self) -> list[str]:
        """The `cut-K` directories members live in, in order."""
        return sorted({n.split("/", 1)[0] for n in self.members if "/" in n})


def _check_member_name(name: str) -> None:
    """A member's path: a segment name, or `cut-K/` and a segment name."""
    if "/" in name:
        parse_cut_path(name)
    else:
        parse_segment_name(name)


def encode_index(members: Sequence[Member]) -> bytes:
    """The index's bytes: a count, then each member's offset, length, CRC-32, name."""
    out = [_COUNT.pack(len(members))]
    for m in members:
        raw = m.name.encode()
        out.append(_ENTRY.pack(m.offset, m.length, m.crc, len(raw)) + raw)
    return b"".join(out)


def write_pack(
    storage: Storage, directory: Path, members: Sequence[tuple[str, Path | bytes]],
    *, paced: int = 0,
) -> int:  # fmt: skip
    """Write `directory/segments.pack` of `members` ((relative path, local file of a
    finished segment, or its bytes)) through `storage`: under a temp name, made durable,
    renamed into place, the directory synced. Returns the pack's size.

    `paced` (bytes, a plain local file system only) syncs the file every that many
    bytes: background work (a rollup) then never leaves a large backlog of dirty pages
    that another process's fsync (the follower's next commit) would wait behind."""
    seen: set[str] = set()
    for name, _ in members:
        try:
            _check_member_name(name)
        except RepositoryError as exc:
            raise RepositoryError(f"{directory / PACK_NAME}: member {exc}") from None
        if name in seen:
            raise RepositoryError(f"{directory / PACK_NAME}: member {name!r} given twice")
        seen.add(name)
    head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0)
    head = head[:12] + struct.pack(">I", zlib.crc32(head[:12]))
    final = directory / PACK_NAME
    tmp = directory / temp_name(PACK_NAME)
    out = storage.create(tmp)
    try:
        storage.append(out, head)
        at = synced = len(head)
        index: list[Member] = []
        for name, local in members:
            crc, length = 0, 0
            if isinstance(local, bytes):  # a finished segment held in memory
                storage.append(out, local)
                crc, length = zlib.crc32(local), len(local)
            else:
                with open(local, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        storage.append(out, chunk)
                        crc = zlib.crc32(chunk, crc)
                        length += len(chunk)
            index.append(Member(name, at, length, crc))
            at += length
            if paced and at - synced >= paced:
                storage.sync(out)
                synced = at
        raw = encode_index(index)
        storage.append(out, raw)
        tail = TRAILER.pack(at, len(raw), zlib.crc32(raw), MAGIC, 0)
        tail = tail[:28] + struct.pack(">I", zlib.crc32(tail[:28]))
        storage.append(out, tail)
        storage.sync(out)
        out.close()
        storage.replace(tmp, final)
    except BaseException:
        out.close()
        with contextlib.suppress(OSError):
            storage.delete(tmp)
        raise
    storage.sync_dir(directory)
    return at + len(raw) + len(tail)


def parse_index(path: Path, size: int, head: bytes, tail: bytes) -> PackIndex:
    """The index of the pack at `path` of `size` bytes, from its first 16 bytes (`head`)
    and its last bytes (`tail`: at least the trailer, ideally the index too). Strict:
    anything out of place is a `PackError`. When `tail` does not hold the whole index,
    `NeedMore` says how many bytes of the end to read instead."""
    if size < HEADER.size + _COUNT.size + TRAILER.size:
        raise PackError(path, f"truncated: {size} bytes")
    if len(head) < HEADER.size:
        raise PackError(path, "truncated header")
    magic, version, flags, crc = HEADER.unpack(head[: HEADER.size])
    if magic != MAGIC:
        raise PackError(path, "not a pack (bad magic)")
    if crc != zlib.crc32(head[:12]):
        raise PackError(path, "header checksum mismatch")
    if version != FORMAT_VERSION or flags != 0:
        raise PackError(path, f"unsupported version {version} (flags {flags})")
    if len(tail) < TRAILER.size:
        raise PackError(path, "truncated trailer")
    trailer = tail[-TRAILER.size :]
    ix_at, ix_len, ix_crc, magic2, tcrc = TRAILER.unpack(trailer)
    if magic2 != MAGIC or tcrc != zlib.crc32(trailer[:28]):
        raise PackError(path, "bad trailer (truncated or overwritten)")
    if ix_at < HEADER.size or ix_at + ix_len + TRAILER.size != size or ix_len < _COUNT.size:
        raise PackError(path, f"trailer places the index at {ix_at}+{ix_len} in {size} bytes")
    if ix_len + TRAILER.size > len(tail):
        raise NeedMore(ix_len + TRAILER.size)
    raw = tail[len(tail) - TRAILER.size - ix_len : len(tail) - TRAILER.size]
    if zlib.crc32(raw) != ix_crc:
        raise PackError(path, "index checksum mismatch")
    return PackIndex(path, size, _decode_index(path, raw, ix_at))


class NeedMore(Exception):
    """`parse_index` needs `n` bytes of the pack's end."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.n = n


def _decode_index(path: Path, raw: bytes, end: int) -> dict[str, Member]:
    (count,) = _COUNT.unpack_from(raw, 0)
    pos, at = _COUNT.size, HEADER.size
    members: dict[str, Member] = {}
    for i in range(count):
        if pos + _ENTRY.size > len(raw):
            raise PackError(path, f"index ends inside entry {i}")
        offset, length, crc, nlen = _ENTRY.unpack_from(raw, pos)
        pos += _ENTRY.size
        if nlen > _NAME_MAX or pos + nlen > len(raw):
            raise PackError(path, f"index entry {i}: bad name length {nlen}")
        try:
            name = raw[pos : pos + nlen].decode()
            _check_member_name(name)
        except (UnicodeDecodeError, RepositoryError):
            raise PackError(path, f"index entry {i}: bad member name") from None
        pos += nlen
        if offset != at or offset + length > end:
            raise PackError(path, f"member {name}: at {offset}+{length}, expected at {at}")
        if name in members:
            raise PackError(path, f"member {name} listed twice")
        members[name] = Member(name, offset, length, crc)
        at = offset + length
    if pos != len(raw) or at != end:
        raise PackError(path, "index does not cover the pack exactly")
    return members


def load_index(storage: Storage, path: Path, size: int) -> PackIndex:
    """Read and parse the index of the pack at `path` (`size` bytes) through `storage`:
    one read for a small pack, else its head and its end (and the index, when it is
    larger than one read of the end)."""
    try:
        if size <= _TAIL_READ:
            data = storage.read(path)
            if len(data) != size:
                raise PackError(path, f"{len(data)} bytes read, {size} expected")
            head, tail = data, data
        else:
            head = storage.read(path, 0, HEADER.size)
            tail = storage.read(path, size - _TAIL_READ, _TAIL_READ)
        try:
            return parse_index(path, size, head, tail)
        except NeedMore as more:
            tail = storage.read(path, size - more.n, more.n)
            return parse_index(path, size, head, tail)
    except FileNotFoundError:
        raise PackError(path, "disappeared while being read") from None
    except NeedMore:
        raise PackError(path, "index larger than the trailer says") from None


def check_pack(storage: Storage, path: Path) -> PackIndex:
    """Read the whole pack at `path` and check every part's CRC-32 (verify's deep look);
    its index, or a `PackError`."""
    st = storage.stat(path, follow_links=True)
    if st is None or not st.is_file:
        raise PackError(path, "missing")
    index = load_index(storage, path, st.size)
    with storage.open_read(path) as f:
        for m in sorted(index.members.values(), key=lambda m: m.offset):
            f.seek(m.offset)
            crc, left = 0, m.length
            while left:
                chunk = f.read(min(left, _CHUNK))
                if not chunk:
                    raise PackError(path, f"member {m.name}: truncated")
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
            if crc != m.crc:
                raise PackError(path, f"member {m.name}: checksum mismatch")
    return index


# -- the storage layer ---------------------------------------------------------------


class _Window(SeekableReader):
    """A seekable read-only view of `length` bytes at `offset` of another file object:
    a member of a pack, as if it were its own file."""

    def __init__(self, f: IO[bytes], offset: int, length: int, name: str) -> None:
        super().__init__(length)
        self._f, self._offset = f, offset
        self.name = name

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._size - self._pos)
        n = left if size is None or size < 0 else min(size, left)
        if n == 0:
            return b""
        self._f.seek(self._offset + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


_ABSENT: Final = "absent"


class _Pack:
    """A directory's pack, as cached: its index, its stat, its members' stats."""

    __slots__ = ("_stats", "index", "stat")

    def __init__(self, index: PackIndex, stat: Stat) -> None:
        self.index, self.stat = index, stat
        self._stats: dict[str, Stat] = {}

    def member_stat(self, m: Member) -> Stat:
        """A member's stat: a regular file of its length (the pack's identity)."""
        st = self._stats.get(m.name)
        if st is None:
            st = self._stats[m.name] = replace(self.stat, is_dir=False, is_file=True,
                                               size=m.length)  # fmt: skip
        return st


class PackedStorage:
    """A `Storage` over another (`inner`) where the members of each backup directory's
    `segments.pack` read as the segment files they were (module docstring). Every other
    call passes through."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        # directory -> its pack, "absent" (or no backup directory), or the pack's damage
        self._packs: dict[Path, _Pack | str | PackError] = {}
        self._guard = threading.Lock()

    def __repr__(self) -> str:
        return f"PackedStorage({self.inner!r})"

    def __getattr__(self, name: str) -> Any:
        """The encrypting layer's key and repository id, when `inner` is one (what an
        executor is shipped)."""
        if name in ("data_key", "repo_id", "chunk_size"):
            return getattr(self.inner, name)
        raise AttributeError(name)

    # -- the cache ---------------------------------------------------------------------

    def _pack(self, d: Path, *, fresh: bool = False) -> _Pack | None:
        """The pack of the backup directory `d` (cached), None when it has none (or is
        no backup directory); a damaged pack is a `PackError`. `fresh` looks again for
        one found absent."""
        known = self._packs.get(d)  # one lookup, no lock: the hot path of every read
        if known is None or (fresh and known == _ABSENT):
            known = self._load(d)
            with self._guard:
                self._packs[d] = known
        if isinstance(known, _Pack):
            return known
        if isinstance(known, PackError):
            raise known
        return None

    def _load(self, d: Path) -> _Pack | str | PackError:
        if not _is_backup_dir(d):
            return _ABSENT
        path = d / PACK_NAME
        st = self.inner.stat(path, follow_links=True)
        if st is None or not st.is_file:
            return _ABSENT
        try:
            return _Pack(load_index(self.inner, path, st.size), st)
        except PackError as exc:
            return exc

    def forget(self, path: Path) -> None:
        """Drop what is cached about the directory `path` is in (or is)."""
        with self._guard:
            for d in (path, path.parent, path.parent.parent):
                self._packs.pop(d, None)

    def _member(self, path: Path, *, fresh: bool = False) -> tuple[_Pack, Member] | None:
        """The pack member `path` names, if it is one."""
        where = _member_place(path)
        if where is None:
            return None
        pack = self._pack(where[0], fresh=fresh)
        if pack is None:
            return None
        m = pack.index.members.get(where[1])
        return None if m is None else (pack, m)

    def _missed(self, path: Path) -> tuple[_Pack, Member] | None:
        """A second look at a path neither the cached index nor `inner` has: the pack
        may have been written by another process since it was found absent."""
        where = _member_place(path)
        if where is None:
            return None
        absent = self._packs.get(where[0]) == _ABSENT
        return self._member(path, fresh=True) if absent else None

    # -- names and sizes -----------------------------------------------------------------

    def list(self, path: Path) -> list[Entry]:
        """`inner`'s entries, and in a backup directory with a pack its members and
        their `cut-K` directories; in `cut-K`, the members there."""
        entries = self.inner.list(path)
        sub = path.name.startswith("cut-")
        listed = any(e.name == PACK_NAME for e in entries)
        if not sub and not listed and path not in self._packs:
            with self._guard:  # the listing says: no pack here (no stat needed)
                self._packs[path] = _ABSENT
            return entries
        pack = self._pack(path.parent if sub else path, fresh=listed)
        if pack is None:
            return entries
        if sub:
            prefix = path.name + "/"
            extra = [Entry(n[len(prefix) :], False, True)
                     for n in pack.index.members if n.startswith(prefix)]  # fmt: skip
        else:
            extra = [Entry(n, False, True) for n in pack.index.members if "/" not in n]
            extra += [Entry(s, True, False) for s in pack.index.subdirs()]
        names = {e.name for e in entries}
        return entries + [e for e in extra if e.name not in names]

    def stat(self, path: Path, *, follow_links: bool = False) -> Stat | None:
        """A member's stat is a regular file of its size; a `cut-K` directory only the
        pack holds is a directory."""
        hit = self._member(path)
        if hit is not None:
            return hit[0].member_stat(hit[1])
        st = self.inner.stat(path, follow_links=follow_links)
        if st is not None:
            return st
        hit = self._missed(path)
        if hit is not None:
            return hit[0].member_stat(hit[1])
        if path.name.startswith("cut-"):
            pack = self._pack(path.parent)
            if pack is not None and path.name in pack.index.subdirs():
                return replace(pack.stat, is_dir=True, is_file=False, size=0)
        return None

    # -- reading -------------------------------------------------------------------------

    def read(self, path: Path, offset: int = 0, length: int = -1) -> bytes:
        """A member's bytes from `offset` (`length` of them, fewer at its end)."""
        hit = self._member(path)
        if hit is None:
            try:
                return self.inner.read(path, offset, length)
            except FileNotFoundError:
                hit = self._missed(path)
                if hit is None:
                    raise
        index, m = hit[0].index, hit[1]
        start = min(offset, m.length)
        n = m.length - start if length < 0 else min(length, m.length - start)
        if n == 0:
            return b""
        data = self.inner.read(index.path, m.offset + start, n)
        if len(data) != n:
            raise PackError(index.path, f"member {m.name}: truncated")
        return data

    def open_read(self, path: Path) -> IO[bytes]:
        """A member: a seekable read-only window on it in the pack."""
        hit = self._member(path)
        if hit is None:
            try:
                return self.inner.open_read(path)
            except FileNotFoundError:
                hit = self._missed(path)
                if hit is None:
                    raise
        index, m = hit[0].index, hit[1]
        f = self.inner.open_read(index.path)
        return cast(IO[bytes], _Window(f, m.offset, m.length, str(path)))

    def link(self, src: Path, dst: Path) -> None:
        """A member: its bytes written as a real file at `dst` (FileExistsError when it
        exists); else as `inner`."""
        self.forget(dst)
        hit = self._member(src)
        if hit is None:
            self.inner.link(src, dst)
            return
        if self.inner.stat(dst) is not None:
            raise FileExistsError(errno.EEXIST, "file exists", str(dst))
        tmp = dst.with_name(temp_name(dst.name))
        out = self.inner.create(tmp)
        try:
            with self.open_read(src) as f:
                while chunk := f.read(_CHUNK):
                    self.inner.append(out, chunk)
            self.inner.sync(out)
            out.close()
            self.inner.replace(tmp, dst)
        except BaseException:
            out.close()
            with contextlib.suppress(OSError):
                self.inner.delete(tmp)
            raise

    # -- writing: as `inner`, forgetting the directory's cached index ---------------------

    def write(self, path: Path, data: bytes) -> None:
        """As `inner`."""
        self.forget(path)
        self.inner.write(path, data)

    def write_if_absent(self, path: Path, data: bytes) -> None:
        """As `inner`."""
        self.forget(path)
        self.inner.write_if_absent(path, data)

    def create(self, path: Path) -> IO[bytes]:
        """As `inner`."""
        self.forget(path)
        return self.inner.create(path)

    def append(self, f: IO[bytes], data: bytes) -> None:
        """As `inner`."""
        self.inner.append(f, data)

    def copy(self, src: IO[bytes], dst: IO[bytes]) -> None:
        """As `inner`."""
        self.inner.copy(src, dst)

    def sync(self, f: IO[bytes]) -> None:
        """As `inner`."""
        self.inner.sync(f)

    def replace(self, src: Path, dst: Path) -> None:
        """As `inner`."""
        self.forget(src)
        self.forget(dst)
        self.inner.replace(src, dst)
        self.forget(dst)

    def delete(self, path: Path) -> None:
        """As `inner`."""
        self.forget(path)
        self.inner.delete(path)

    def delete_tree(self, path: Path) -> None:
        """As `inner`; every cached index under `path` forgotten."""
        with self._guard:
            for d in [d for d in self._packs if d == path or path in d.parents]:
                del self._packs[d]
        self.inner.delete_tree(path)

    def make_dir(self, path: Path) -> None:
        """As `inner`."""
        self.forget(path)
        self.inner.make_dir(path)

    def make_dirs(self, path: Path) -> None:
        """As `inner`."""
        self.forget(path)
        self.inner.make_dirs(path)

    def remove_dir(self, path: Path) -> None:
        """As `inner`."""
        self.forget(path)
        self.inner.remove_dir(path)

    def sync_dir(self, path: Path) -> None:
        """As `inner`."""
        self.inner.sync_dir(path)

    def sync_all(self, paths: Iterable[Path]) -> None:
        """As `inner`."""
        self.inner.sync_all(paths)

    def open_lock(self, path: Path, *, create: bool) -> int:
        """As `inner`."""
        return self.inner.open_lock(path, create=create)


def _is_backup_dir(d: Path) -> bool:
    """`d`'s name is a backup directory's (formats/repository.md §2.2)."""
    name = d.name
    if len(name) < 23 or name[8:9] != "T":
        return False
    try:
        parse_backup_dir(name)
    except RepositoryError:
        return False
    return True


def _member_place(path: Path) -> tuple[Path, str] | None:
    """(backup directory, member path) for a path that could be a pack's member."""
    name = path.name
    if len(name) != 45 or not name.endswith(".seg"):
        return None
    parent = path.parent
    if parent.name.startswith("cut-"):
        d, rel = parent.parent, f"{parent.name}/{name}"
    else:
        d, rel = parent, name
    return d, rel
