"""Encryption at rest: every file of an encrypted repository sealed in authenticated
chunks (formats/repository.md §10.3).

Theory of operation: `EncryptedStorage` is a `Storage` over another one (`inner`: the
local directory, an object store) that seals what it writes and opens what it reads.
It reaches its files only through `inner`'s methods, so it works over any backend.
Three kinds of file stay as they are: `repo.json` (it says how to unlock the rest), the
bucket's lock files (`lock`, `lock.shared`) and the readers' registrations
(`readers/*`): pid and host records that `open_lock` hands out as descriptors.

A sealed file is a 32-byte header (magic, format version, flags, chunk size C, a random
16-byte file id) then chunks: chunk i is AES-256-GCM of plaintext bytes [i*C, (i+1)*C)
plus its 16-byte tag. Every chunk is full but the last, which carries the "final" flag
(an empty file is one empty final chunk), so the plaintext size follows from the sealed
size alone (`stat` reports it without a read) and a file cut at a chunk boundary fails:
its new last chunk was not sealed as final. Each file has its own key (HKDF-SHA256 of
the data key and the file id) and chunk i's nonce is (i, final), so no two chunks of a
key share a nonce unless they hold the same bytes; the associated data binds the
repository id, the header, i and the final flag, so a chunk moved, swapped, dropped or
taken from another file or repository fails to open. A chunk that fails is a
`SealedError` (a `SegmentError`: `verify` names the file and the chunk, `restore`
refuses it).

Reads decrypt only the chunks they need (`read` with a range, `open_read`'s file object
caching its current chunk). A file `create` hands out seals full chunks as data arrives
and holds the last full one until more data or the end (`sync`, `close`) sets its final
flag; it reads back what it holds (the segment writer spills its body to such a file,
then reads it back, and can cut it short: a cut inside sealed chunks re-seals the kept
chunks under a new file id, so a chunk index is never reused for other bytes).
"""

from __future__ import annotations

import os
import secrets
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import IO, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from upr_cli.segments.format import SegmentError
from upr_cli.storage import Entry, Stat, Storage

__all__ = [
    "CHUNK_SIZE",
    "HEADER",
    "MAGIC",
    "TAG",
    "EncryptedStorage",
    "SealedError",
    "is_plain",
    "plain_size",
    "seal",
]

MAGIC = b"UPR-SEAL"
"""The first 8 bytes of every sealed file."""
FORMAT_VERSION = 1
"""The sealed-file format version this code writes and reads."""
HEADER = struct.Struct(">8sHHI16s")
"""magic, format version, flags (0), chunk size, file id: 32 bytes."""
TAG = 16
"""AES-GCM's tag, after each chunk's ciphertext."""
CHUNK_SIZE = 64 * 1024
"""Plaintext bytes per chunk of a new repository (repo.json records it)."""
_NONCE = struct.Struct(">QI")  # chunk index, final flag: 12 bytes
_AAD_TAIL = struct.Struct(">QB")  # chunk index, final flag
_FILE_KEY_INFO = b"upr sealed file v1\x00"
_PLAIN_NAMES = frozenset({"repo.json", "lock", "lock.shared"})
_READERS_DIR = "readers"


class SealedError(SegmentError):
    """A sealed file that cannot be opened: a bad header or layout, or a chunk that
    fails authentication (damaged, moved, truncated, from another file or repository).
    A `SegmentError`, so every reader of segments reports it as damage."""

    def __init__(self, path: object, reason: str, chunk: int | None = None) -> None:
        self.chunk = chunk
        super().__init__(path, reason if chunk is None else f"chunk {chunk}: {reason}")


def is_plain(path: Path) -> bool:
    """True for the files an encrypted repository keeps unsealed: `repo.json`, the
    bucket's `lock` and `lock.shared`, and `readers/*` (formats/repository.md §10.3)."""
    return path.name in _PLAIN_NAMES or path.parent.name == _READERS_DIR


def plain_size(sealed: int, chunk: int) -> int:
    """The plaintext size of a sealed file of `sealed` bytes (a malformed size gives a
    size no manifest records: the reader names the damage)."""
    body = max(0, sealed - HEADER.size)
    n = max(1, -(-body // (chunk + TAG)))
    return max(0, body - TAG * n)


def _file_key(data_key: bytes, file_id: bytes) -> AESGCM:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_FILE_KEY_INFO + file_id)
    return AESGCM(hkdf.derive(data_key))


class _Sealer:
    """The key and associated data of one sealed file (one header)."""

    def __init__(self, repo_id: bytes, data_key: bytes, chunk: int, file_id: bytes) -> None:
        self.chunk = chunk
        self.file_id = file_id
        self.header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, chunk, file_id)
        self._aad = bytes([len(repo_id)]) + repo_id + self.header
        self._aes = _file_key(data_key, file_id)

    def seal(self, index: int, data: bytes | bytearray | memoryview, final: bool) -> bytes:
        nonce = _NONCE.pack(index, final)
        return self._aes.encrypt(nonce, bytes(data), self._aad + _AAD_TAIL.pack(index, final))

    def open(self, path: object, index: int, data: bytes, final: bool) -> bytes:
        if len(data) < TAG:
            raise SealedError(path, f"truncated: {len(data)} bytes, less than a tag", index)
        nonce = _NONCE.pack(index, final)
        try:
            return self._aes.decrypt(nonce, data, self._aad + _AAD_TAIL.pack(index, final))
        except InvalidTag:
            raise SealedError(
                path, "fails authentication (damaged, truncated, moved or not this "
                "repository's)", index,
            ) from None  # fmt: skip


class _Keys:
    """What every sealed file of one repository shares."""

    def __init__(self, repo_id: bytes, data_key: bytes, chunk: int) -> None:
        self.repo_id, self.data_key, self.chunk = repo_id, data_key, chunk

    def new(self) -> _Sealer:
        return _Sealer(self.repo_id, self.data_key, self.chunk, secrets.token_bytes(16))

    def parse(self, path: object, header: bytes) -> _Sealer:
        if len(header) < HEADER.size:
            raise SealedError(path, f"truncated: {len(header)} bytes, no sealed-file header")
        magic, version, flags, chunk, file_id = HEADER.unpack(header[: HEADER.size])
        if magic != MAGIC:
            raise SealedError(path, "not a sealed file (bad magic): not written encrypted")
        if version != FORMAT_VERSION or flags:
            raise SealedError(path, f"unsupported sealed-file version {version} (flags {flags})")
        if chunk != self.chunk:
            raise SealedError(path, f"chunk size {chunk} is not the repository's {self.chunk}")
        return _Sealer(self.repo_id, self.data_key, chunk, file_id)


def seal(keys: _Keys, data: bytes) -> bytes:
    """A whole sealed file holding `data`."""
    s = keys.new()
    c = keys.chunk
    view = memoryview(data)
    n = max(1, -(-len(data) // c))
    parts = [s.header]
    parts += [s.seal(i, view[i * c : (i + 1) * c], i == n - 1) for i in range(n)]
    return b"".join(parts)


class EncryptedStorage:
    """A `Storage` that seals every file it stores in `inner` but `repo.json`, the lock
    files and the readers' registrations (module docstring)."""

    def __init__(self, inner: Storage, repo_id: bytes, data_key: bytes,
                 chunk_size: int = CHUNK_SIZE) -> None:  # fmt: skip
        if len(data_key) != 32:
            raise ValueError("a data key is 32 bytes")
        self.inner = inner
        self.repo_id = repo_id
        self._keys = _Keys(repo_id, data_key, chunk_size)

    def __repr__(self) -> str:
        return f"EncryptedStorage({self.inner!r})"

    @property
    def data_key(self) -> bytes:
        """The repository's data key (`Repository.keyed_access` hands it to executors)."""
        return self._keys.data_key

    @property
    def chunk_size(self) -> int:
        """Plaintext bytes per chunk."""
        return self._keys.chunk

    # -- names and sizes -------------------------------------------------------------

    def list(self, path: Path) -> list[Entry]:
        """The entries of a directory, as `inner` lists them."""
        return self.inner.list(path)

    def stat(self, path: Path, *, follow_links: bool = False) -> Stat | None:
        """`inner`'s stat, the size of a sealed file as its plaintext's."""
        st = self.inner.stat(path, follow_links=follow_links)
        if st is None or not st.is_file or is_plain(path):
            return st
        return replace(st, size=plain_size(st.size, self._keys.chunk))

    # -- reading ---------------------------------------------------------------------

    def read(self, path: Path, offset: int = 0, length: int = -1) -> bytes:
        """The plaintext range, decrypting only the chunks it needs."""
        if is_plain(path):
            return self.inner.read(path, offset, length)
        c, step = self._keys.chunk, self._keys.chunk + TAG
        first = offset // c
        start = HEADER.size + first * step
        if offset == 0:
            head_and = self._read_range(path, 0, length, step)
            header, raw = head_and[: HEADER.size], head_and[HEADER.size :]
        else:
            header = self.inner.read(path, 0, HEADER.size)
            need = -1 if length < 0 else length + offset - first * c
            raw = self._read_range(path, start, need, step, 0)
        sealer = self._keys.parse(path, header)
        if not raw and offset == 0:
            raise SealedError(path, "truncated: no chunk after the header", 0)
        return self._open_run(sealer, path, first, raw, wanted=(length, offset - first * c))

    def _read_range(self, path: Path, at: int, length: int, step: int,
                    header: int = HEADER.size) -> bytes:  # fmt: skip
        """The sealed bytes from `at` covering `length` plaintext bytes (all with -1) and
        one byte more: whether more follows says whether the last chunk is final."""
        if length < 0:
            return self.inner.read(path, at, -1)
        chunks = max(1, -(-length // (step - TAG)))
        return self.inner.read(path, at, header + chunks * step + 1)

    def _open_run(self, s: _Sealer, path: Path, first: int, raw: bytes,
                  wanted: tuple[int, int]) -> bytes:  # fmt: skip
        """Open consecutive chunks from chunk `first`; the plaintext of `wanted`
        (length, skip). A run that ends with a partial chunk, or where the file ends,
        ends with the final chunk."""
        length, skip = wanted
        step = s.chunk + TAG
        n = -(-len(raw) // step) if raw else 0
        if length >= 0:
            n = min(n, max(1, -(-(length + skip) // s.chunk)))
        out = []
        for j in range(n):
            piece = raw[j * step : (j + 1) * step]
            final = len(raw) <= (j + 1) * step
            out.append(s.open(path, first + j, piece, final))
        data = b"".join(out)[skip:]
        return data if length < 0 else data[:length]

    def open_read(self, path: Path) -> IO[bytes]:
        """A seekable read-only file object of the plaintext."""
        f = self.inner.open_read(path)
        if is_plain(path):
            return f
        try:
            return cast(IO[bytes], SealedReader(f, path, self._keys))
        except BaseException:
            f.close()
            raise

    # -- writing ---------------------------------------------------------------------

    def write(self, path: Path, data: bytes) -> None:
        """Publish `data` sealed (as `inner.write`: whole, replacing)."""
        self.inner.write(path, data if is_plain(path) else seal(self._keys, data))

    def write_if_absent(self, path: Path, data: bytes) -> None:
        """Publish `data` sealed (as `inner.write_if_absent`)."""
        self.inner.write_if_absent(path, data if is_plain(path) else seal(self._keys, data))

    def create(self, path: Path) -> IO[bytes]:
        """A new sealed file to write in pieces (`SealedWriter`)."""
        f = self.inner.create(path)
        if is_plain(path):
            return f
        return cast(IO[bytes], SealedWriter(self.inner, f, path, self._keys))

    def append(self, f: IO[bytes], data: bytes) -> None:
        """Add `data` to a file `create` handed out."""
        if isinstance(f, SealedWriter):
            f.write(data)
        else:
            self.inner.append(f, data)

    def copy(self, src: IO[bytes], dst: IO[bytes]) -> None:
        """Copy the rest of `src`'s plaintext into `dst` (a file `create` handed out)."""
        if not isinstance(dst, SealedWriter):
            self.inner.copy(src, dst)
            return
        while data := src.read(1 << 20):
            dst.write(data)

    def sync(self, f: IO[bytes]) -> None:
        """Seal the last chunk (final: nothing more can be added) and sync the file."""
        if isinstance(f, SealedWriter):
            f.finish()
            self.inner.sync(f.raw)
        else:
            self.inner.sync(f)

    # -- everything else: as `inner` does it ------------------------------------------

    def delete(self, path: Path) -> None:
        """As `inner`."""
        self.inner.delete(path)

    def delete_tree(self, path: Path) -> None:
        """As `inner`."""
        self.inner.delete_tree(path)

    def make_dir(self, path: Path) -> None:
        """As `inner`."""
        self.inner.make_dir(path)

    def make_dirs(self, path: Path) -> None:
        """As `inner`."""
        self.inner.make_dirs(path)

    def remove_dir(self, path: Path) -> None:
        """As `inner`."""
        self.inner.remove_dir(path)

    def sync_dir(self, path: Path) -> None:
        """As `inner`."""
        self.inner.sync_dir(path)

    def replace(self, src: Path, dst: Path) -> None:
        """As `inner`: the associated data binds no name, so a renamed file still opens."""
        self.inner.replace(src, dst)

    def sync_all(self, paths: Iterable[Path]) -> None:
        """As `inner`."""
        self.inner.sync_all(paths)

    def link(self, src: Path, dst: Path) -> None:
        """As `inner`: a linked or copied file opens under its new name."""
        self.inner.link(src, dst)

    def open_lock(self, path: Path, *, create: bool) -> int:
        """As `inner`: lock files hold pids and host names, no data, and stay plain."""
        return self.inner.open_lock(path, create=create)


class _Cursor(ABC):
    """A position in a sealed file's plaintext, read chunk by chunk: what a reader and
    a writer reading back share."""

    path: Path
    _pos: int
    _s: _Sealer

    @property
    @abstractmethod
    def size(self) -> int:
        """Plaintext bytes in the file."""

    @abstractmethod
    def _chunk(self, index: int) -> bytes:
        """The plaintext of chunk `index` (b"" past the end)."""

    def _read(self, n: int) -> bytes:
        end = self.size if n < 0 else min(self.size, self._pos + n)
        out = []
        c = self._s.chunk
        while self._pos < end:
            i, at = divmod(self._pos, c)
            piece = self._chunk(i)[at : at + end - self._pos]
            if not piece:
                break
            out.append(piece)
            self._pos += len(piece)
        return b"".join(out)

    def read(self, n: int = -1) -> bytes:
        """Up to `n` plaintext bytes from the position (the rest with -1)."""
        return self._read(n)

    def readinto(self, b: bytearray | memoryview) -> int:
        """`read` into a buffer."""
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move in the plaintext (a writer writes at the end only)."""
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.path}: negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        """The plaintext position."""
        return self._pos


class SealedReader(_Cursor):
    """A read-only, seekable file object of a sealed file's plaintext: chunks opened on
    demand, the current one cached."""

    def __init__(self, f: IO[bytes], path: Path, keys: _Keys) -> None:
        self.raw, self.path = f, path
        f.seek(0)
        self._s = keys.parse(path, f.read(HEADER.size))
        sealed = f.seek(0, os.SEEK_END)
        c = self._s.chunk
        body = sealed - HEADER.size
        self._chunks = max(1, -(-body // (c + TAG)))
        last = body - (self._chunks - 1) * (c + TAG)
        if last < TAG:
            raise SealedError(path, f"truncated: the last chunk has {max(last, 0)} bytes",
                              self._chunks - 1)  # fmt: skip
        self._size = plain_size(sealed, c)
        self._pos = 0
        self._cached: tuple[int, bytes] | None = None

    def _chunk(self, index: int) -> bytes:
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        step = self._s.chunk + TAG
        self.raw.seek(HEADER.size + index * step)
        data = self.raw.read(step)
        plain = self._s.open(self.path, index, data, index == self._chunks - 1)
        self._cached = (index, plain)
        return plain

    @property
    def size(self) -> int:
        """Plaintext bytes in the file."""
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def close(self) -> None:
        """Close the sealed file."""
        self._cached = None
        self.raw.close()

    def __enter__(self) -> SealedReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class SealedWriter(_Cursor):
    """A new sealed file written in pieces: full chunks sealed as data arrives, the last
    full one held until more data or `finish` (by `sync` or `close`) seals it as final.
    Writes go at the end; reads go anywhere (the pending chunk from memory); `truncate`
    cuts it short (re-sealing under a new file id when sealed chunks are cut)."""

    def __init__(self, inner: Storage, f: IO[bytes], path: Path, keys: _Keys) -> None:
        self.inner, self.raw, self.path, self._keys = inner, f, path, keys
        self._s = keys.new()
        self._sealed = 0  # chunks in the file (sealed not final)
        self._pending = bytearray()  # plaintext after them
        self._finished = False
        self._pos = 0
        inner.append(f, self._s.header)

    @property
    def size(self) -> int:
        """Plaintext bytes written."""
        return self._sealed * self._s.chunk + len(self._pending)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append `data` (only at the end, only before `finish`)."""
        if self._finished:
            raise ValueError(f"{self.path}: a sealed file cannot grow once finished")
        if self._pos != self.size:
            raise ValueError(f"{self.path}: a sealed file is written at its end only")
        self._pending += data
        c = self._s.chunk
        out = []
        full = (len(self._pending) - 1) // c  # the last full chunk stays pending
        if full > 0:
            with memoryview(self._pending) as view:
                for j in range(full):
                    out.append(self._s.seal(self._sealed + j, view[j * c : (j + 1) * c], False))
            del self._pending[: full * c]
            self._sealed += full
        if out:
            self.raw.seek(0, os.SEEK_END)
            self.inner.append(self.raw, b"".join(out))
        self._pos = self.size
        return len(data)

    def finish(self) -> None:
        """Seal what is pending as the final chunk; nothing can be added after."""
        if self._finished:
            return
        self.raw.seek(0, os.SEEK_END)
        self.inner.append(self.raw, self._s.seal(self._sealed, self._pending, True))
        self._finished = True

    def _chunk(self, index: int) -> bytes:
        if index >= self._sealed:
            return bytes(self._pending) if index == self._sealed and not self._finished else b""
        step = self._s.chunk + TAG
        self.raw.seek(HEADER.size + index * step)
        return self._s.open(self.path, index, self.raw.read(step), False)

    def read(self, n: int = -1) -> bytes:
        """Up to `n` plaintext bytes from the position (reading back before `finish`)."""
        if self._finished:
            raise ValueError(f"{self.path}: finished: reopen it to read it")
        return self._read(n)

    def truncate(self, size: int | None = None) -> int:
        """Cut the plaintext to `size` bytes (at most its size)."""
        if self._finished:
            raise ValueError(f"{self.path}: a finished sealed file cannot be cut")
        size = self._pos if size is None else size
        if size >= self.size:
            return self.size
        c = self._s.chunk
        if size >= self._sealed * c:
            del self._pending[size - self._sealed * c :]
            return size
        # cut inside sealed chunks: keep whole chunks below `size`, the last one (full or
        # not) pending, and re-seal the kept ones under a new file id, so no chunk index
        # of the old key is ever sealed again with other bytes
        keep, rest = divmod(size, c)
        if not rest and keep:
            keep -= 1
            rest = c
        pending = self._chunk(keep)[:rest]
        old = self._s
        self._s = new = self._keys.new()
        step = c + TAG
        self.raw.seek(0)
        self.inner.append(self.raw, new.header)
        for i in range(keep):
            self.raw.seek(HEADER.size + i * step)
            plain = old.open(self.path, i, self.raw.read(step), False)
            self.raw.seek(HEADER.size + i * step)
            self.inner.append(self.raw, new.seal(i, plain, False))
        self.raw.truncate(HEADER.size + keep * step)
        self._sealed, self._pending = keep, bytearray(pending)
        return size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return not self._finished

    def flush(self) -> None:
        """Nothing to do: chunks are written when sealed."""

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def close(self) -> None:
        """Finish (seal the final chunk) and close the file."""
        if self.raw.closed:
            return
        try:
            self.finish()
        finally:
            self.raw.close()

    def __enter__(self) -> SealedWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
