"""Packs: the segment files of one backup directory in one file, `segments.pack`
(formats/repository.md §12).

Theory of operation: a commit of `backup --follow` must be a few objects whatever the
partition count, so its segment files (and its cut-back segments) are concatenated into
one file. A pack is a 16-byte header (magic, version, CRC-32), the members' bytes back
to back, an index (each member's path relative to the backup directory, offset, length,
CRC-32) and a fixed 32-byte trailer that locates the index (offset, length, CRC-32,
magic, its own CRC-32). `write_pack` builds one from finished local segment files through
a `Storage` (plain, sealed or an object store) under a temp name (§2.4), makes it durable
and renames it into place. `parse_index` is strict: any inconsistency is a `PackError`
(a `SegmentError`: every reader reports it as damage, one line naming the pack).

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
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.names import parse_cut_path, parse_segment_name, temp_name
from upr_cli.segments.format import SegmentError
from upr_cli.storage import Storage

__all__ = [
    "HEADER",
    "MAGIC",
    "PACK_NAME",
    "TRAILER",
    "Member",
    "NeedMore",
    "PackError",
    "PackIndex",
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


def write_pack(storage: Storage, directory: Path, members: Sequence[tuple[str, Path]]) -> int:
    """Write `directory/segments.pack` of `members` ((relative path, local file of a
    finished segment)) through `storage`: under a temp name, made durable, renamed into
    place, the directory synced. Returns the pack's size."""
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
        at = len(head)
        index: list[Member] = []
        for name, local in members:
            crc, length = 0, 0
            with open(local, "rb") as f:
                while chunk := f.read(_CHUNK):
                    storage.append(out, chunk)
                    crc = zlib.crc32(chunk, crc)
                    length += len(chunk)
            index.append(Member(name, at, length, crc))
            at += length
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
