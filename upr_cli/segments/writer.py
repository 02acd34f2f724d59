"""Writing segment files: blocks compressed off the caller's hot path, atomic publication.

Theory of operation: records are packed into a raw block until it reaches `block_size`,
then the block is compressed as one zstd frame and appended to a temporary file in the
destination directory. `finish()` writes the footer and trailer, fsyncs, renames to the
final name and fsyncs the directory (STYLE 9); before that nothing is visible under the
final name. All file-system calls go through `FileOps`, so tests can fail any of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import zstandard

from upr_cli.errors import LocalProtocolError
from upr_cli.segments.format import (
    BLOCK_ENTRY,
    CRC,
    END_MAGIC,
    FOOTER_FIXED,
    MAGIC,
    OPS,
    PREAMBLE,
    RECORD_HEAD,
    TRAILER,
    VERSION,
    BlockInfo,
    SegmentHeader,
    SegmentInfo,
)


class FileOps:
    """The file-system calls a writer makes (tests subclass it to inject failures)."""

    def open(self, path: Path) -> IO[bytes]:
        """Create a new file for writing (fails if it exists)."""
        return open(path, "xb")

    def write(self, f: IO[bytes], data: bytes) -> None:
        """Write all of `data`."""
        f.write(data)

    def fsync(self, f: IO[bytes]) -> None:
        """Flush and fsync a file."""
        f.flush()
        os.fsync(f.fileno())

    def rename(self, src: Path, dst: Path) -> None:
        """Atomically rename."""
        os.replace(src, dst)

    def fsync_dir(self, path: Path) -> None:
        """fsync a directory so a rename in it is durable."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: Path) -> None:
        """Remove a file if it exists."""
        path.unlink(missing_ok=True)


def temp_name(path: Path) -> Path:
    """The temporary name a segment is written under (sweepable: `.NAME.tmp-*`)."""
    return path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")


class SegmentWriter:
    """Write one segment; `add` rows, then `finish` (or `abort`)."""

    def __init__(
        self,
        path: Path,
        header: SegmentHeader,
        *,
        level: int = 3,
        fs: FileOps | None = None,
    ) -> None:
        self.path = path
        self.header = header
        self.fs = fs or FileOps()
        self._block_size = header.block_size
        self._zstd = zstandard.ZstdCompressor(level=level, write_content_size=True,
                                              write_checksum=False)  # fmt: skip
        self._tmp = temp_name(path)
        self._file: IO[bytes] | None = None
        self._digest = hashlib.blake2b(digest_size=16)
        self._offset = 0
        self._raw: list[bytes] = []
        self._raw_len = 0
        self._raw_count = 0
        self._raw_first = 0
        self._last_seq = header.start_seq
        self._first_seq = 0
        self._blocks: list[BlockInfo] = []
        self._records = 0
        self._raw_total = 0
        self._done = False
        self._open()

    def _open(self) -> None:
        head = self.header.to_bytes()
        pre = PREAMBLE.pack(MAGIC, VERSION, 0, len(head)) + head
        self._file = self.fs.open(self._tmp)
        try:
            self._write(pre + CRC.pack(zlib.crc32(pre)))
        except BaseException:
            self.abort()
            raise

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        self.fs.write(self._file, data)
        self._digest.update(data)
        self._offset += len(data)

    def add(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """Append DCP rows (`ROW_FIELDS` order); seqs must increase within (start, end].

        Any failure (a write error, a record out of order) aborts the whole segment.
        """
        if self._done:
            raise LocalProtocolError("segment already finished")
        pack = RECORD_HEAD.pack
        end = self.header.end_seq
        raw, last = self._raw, self._last_seq
        try:
            for op, _vb, seq, rev, cas, flags, exp, dtime, datatype, key, value, _opq in rows:
                if seq <= last or seq > end or op not in OPS:
                    raise LocalProtocolError(
                        f"record seq {seq} (op 0x{op:02x}) does not follow {last} within "
                        f"({self.header.start_seq}, {end}]"
                    )
                if not self._raw_count:
                    self._raw_first = seq
                    if not self._first_seq:
                        self._first_seq = seq
                k, v = bytes(key), bytes(value)
                rec = pack(op, datatype, len(k), len(v), seq, rev, cas, flags, exp, dtime, 0)
                raw.append(rec)
                raw.append(k)
                raw.append(v)
                self._raw_len += 48 + len(k) + len(v)
                self._raw_count += 1
                last = seq
                if self._raw_len >= self._block_size:
                    self._last_seq = last
                    self._flush_block()
                    raw = self._raw
        except BaseException:
            self.abort()  # a failed write or a bad record: the segment is abandoned whole
            raise
        self._last_seq = last

    def _flush_block(self) -> None:
        if not self._raw_count:
            return
        data = b"".join(self._raw)
        frame = self._zstd.compress(data)
        self._blocks.append(BlockInfo(self._offset, self._raw_first, self._last_seq, len(frame),
                                      len(data), self._raw_count, zlib.crc32(frame)))  # fmt: skip
        self._records += self._raw_count
        self._raw_total += len(data)
        self._write(frame)
        self._raw, self._raw_len, self._raw_count = [], 0, 0

    def finish(self) -> SegmentInfo:
        """Write footer and trailer, fsync, rename into place, fsync the directory."""
        if self._done:
            raise LocalProtocolError("segment already finished")
        try:
            self._flush_block()
            last = self._blocks[-1].last_seq if self._blocks else 0
            footer = FOOTER_FIXED.pack(len(self._blocks), 0, self._records, self._raw_total,
                                       self._first_seq, last) + b"".join(
                BLOCK_ENTRY.pack(b.offset, b.first_seq, b.last_seq, b.compressed_len, b.raw_len,
                                 b.record_count, b.crc) for b in self._blocks
            )  # fmt: skip
            footer_offset = self._offset
            self._write(footer)
            self._write(TRAILER.pack(footer_offset, len(footer), zlib.crc32(footer), END_MAGIC))
            assert self._file is not None
            self.fs.fsync(self._file)
            self._file.close()
            self.fs.rename(self._tmp, self.path)
            self.fs.fsync_dir(self.path.parent)
        except BaseException:
            self.abort()
            raise
        self._done = True
        h = self.header
        return SegmentInfo(str(self.path), h.partition, h.start_seq, h.end_seq, self._first_seq,
                           last, self._records, self._raw_total, self._offset,
                           self._digest.hexdigest())  # fmt: skip

    def abort(self) -> None:
        """Drop the temporary file; nothing appears under the final name."""
        self._done = True
        if self._file is not None and not self._file.closed:
            self._file.close()
        with contextlib.suppress(OSError):  # a sweep removes `.NAME.tmp-*` leftovers later
            self.fs.remove(self._tmp)

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if not self._done:
            self.abort()
