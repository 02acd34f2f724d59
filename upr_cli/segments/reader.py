"""Reading segment files: structure checked on open, every block verified as it is read.

Opening reads only the preamble, header, trailer and footer (checks 1-3 of
formats/segment.md); blocks are read, CRC-checked, decompressed and parsed one at a time
(checks 4-5), so a reader streams files of any size in bounded memory and can start at
any seq through the block index. The file is read through a file object that the
repository's storage hands out (`Storage.open_read`; the local file system by default).

Version 1 files (before collections) read as files whose records are all in collection 0
and that hold no system event; version 1 and 2 files (before xattrs) as files whose
records have no xattrs. A record with xattrs comes out as the consumer produced it: the
blob in `Record.xattrs`, the value its body, the XATTR bit clear (formats/segment.md
"Xattrs"). `records()` hands out data records only,
so a reader that predates collections never meets a system event; `records(events=True)`
interleaves them in seq order and `changes()` decodes them (formats/segment.md
"System events").
"""

from __future__ import annotations

import hashlib
import zlib
from bisect import bisect_left
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import zstandard

from upr_cli.collections import ManifestChange
from upr_cli.errors import UprError
from upr_cli.segments.format import (
    BLOCK_ENTRY,
    CRC,
    END_MAGIC,
    FOOTER_FIXED,
    MAGIC,
    MAX_HEADER,
    OP_SYSTEM_EVENT,
    PREAMBLE,
    TRAILER,
    VERSIONS,
    BlockInfo,
    Record,
    SegmentError,
    SegmentHeader,
    SegmentInfo,
    block_stats,
    parse_block,
    tally_counts,
)
from upr_cli.storage import LOCAL, Storage


class SegmentReader:
    """A verified view of one segment file."""

    def __init__(self, path: Path | str, storage: Storage = LOCAL) -> None:
        self.path = Path(path)
        try:
            self._f: IO[bytes] = storage.open_read(self.path)
        except OSError as exc:
            raise SegmentError(self.path, f"cannot open: {exc.strerror or exc}") from None
        try:
            self._load()
        except BaseException:
            self._f.close()
            raise
        # made on the first block decompressed: a pass that checks checksums only
        # (`check_blocks`) opens many files and never needs one
        self._dctx: zstandard.ZstdDecompressor | None = None

    def _read_at(self, offset: int, n: int) -> bytes:
        self._f.seek(offset)
        data = self._f.read(n)
        if len(data) != n:
            raise SegmentError(self.path, f"truncated: wanted {n} bytes at offset {offset}")
        return data

    def _load(self) -> None:
        f, p = self._f, self.path
        size = f.seek(0, 2)
        self.size = size
        minimum = PREAMBLE.size + CRC.size + FOOTER_FIXED.size + TRAILER.size
        if size < minimum:
            raise SegmentError(p, f"truncated: {size} bytes is smaller than any segment")
        magic, version, _flags, header_len = PREAMBLE.unpack(self._read_at(0, PREAMBLE.size))
        if magic != MAGIC:
            raise SegmentError(p, "not a segment file (bad magic)")
        if version not in VERSIONS:
            raise SegmentError(p, f"unsupported segment version {version}")
        self.version = version
        if not 2 <= header_len <= min(MAX_HEADER, size - minimum):
            raise SegmentError(p, f"bad header length {header_len}")
        pre = self._read_at(0, PREAMBLE.size + header_len)
        (crc,) = CRC.unpack(self._read_at(PREAMBLE.size + header_len, CRC.size))
        if zlib.crc32(pre) != crc:
            raise SegmentError(p, "header checksum mismatch")
        self.header = SegmentHeader.from_bytes(pre[PREAMBLE.size :], p)
        footer_offset, footer_len, footer_crc, end = TRAILER.unpack(
            self._read_at(size - TRAILER.size, TRAILER.size)
        )
        if end != END_MAGIC:
            raise SegmentError(p, "truncated or damaged: trailer magic missing")
        body_start = PREAMBLE.size + header_len + CRC.size
        if footer_offset < body_start or footer_offset + footer_len + TRAILER.size != size:
            raise SegmentError(p, "truncated or damaged: footer position does not match the size")
        footer = self._read_at(footer_offset, footer_len)
        if zlib.crc32(footer) != footer_crc:
            raise SegmentError(p, "footer checksum mismatch")
        count, events, records, raw_bytes, first, last = FOOTER_FIXED.unpack_from(footer)
        if events > records or (version == 1 and events):
            raise SegmentError(p, f"footer counts {events} system events in {records} records")
        if footer_len != FOOTER_FIXED.size + BLOCK_ENTRY.size * count:
            raise SegmentError(p, f"footer length {footer_len} does not hold {count} blocks")
        fixed, entry = FOOTER_FIXED.size, BLOCK_ENTRY.size
        blocks = [
            BlockInfo(*BLOCK_ENTRY.unpack_from(footer, fixed + i * entry)) for i in range(count)
        ]
        pos, prev_last, total, raw_total = body_start, self.header.start_seq, 0, 0
        for i, b in enumerate(blocks):
            if b.offset != pos:
                raise SegmentError(p, f"block starts at {b.offset}, expected {pos}", i)
            if (
                not (prev_last < b.first_seq <= b.last_seq <= self.header.end_seq)
                or b.record_count < 1
            ):
                raise SegmentError(p, f"block seqs [{b.first_seq}, {b.last_seq}] out of order", i)
            pos += b.compressed_len
            prev_last = b.last_seq
            total += b.record_count
            raw_total += b.raw_len
        if pos != footer_offset:
            raise SegmentError(p, f"blocks end at {pos}, the footer starts at {footer_offset}")
        if total != records or raw_total != raw_bytes:
            raise SegmentError(p, "footer totals do not match its block entries")
        if blocks and (first != blocks[0].first_seq or last != blocks[-1].last_seq):
            raise SegmentError(p, "footer first/last seq do not match its block entries")
        self.blocks = blocks
        self.record_count = records
        self.event_count = events  # system event records (0 in every version 1 file)
        self.raw_bytes = raw_bytes
        self.first_seq, self.last_seq = first, last
        self._last_seqs = [b.last_seq for b in blocks]

    def block_records(self, i: int) -> list[Record]:
        """Read, verify and parse block `i`."""
        return self._block(i)[1]

    def _block(self, i: int) -> tuple[bytes, list[Record]]:
        b, p = self.blocks[i], self.path
        frame = self._read_at(b.offset, b.compressed_len)
        if zlib.crc32(frame) != b.crc:
            raise SegmentError(p, "block checksum mismatch", i)
        if self._dctx is None:
            self._dctx = zstandard.ZstdDecompressor()
        try:
            raw = self._dctx.decompress(frame, max_output_size=b.raw_len)
        except zstandard.ZstdError as exc:
            raise SegmentError(p, f"block does not decompress: {exc}", i) from None
        if len(raw) != b.raw_len:
            raise SegmentError(p, f"block holds {len(raw)} bytes, expected {b.raw_len}", i)
        try:
            out = parse_block(raw, b.record_count, self.version)
        except ValueError as exc:
            raise SegmentError(p, str(exc), i) from None
        if len(out) != b.record_count or out[0].seq != b.first_seq or out[-1].seq != b.last_seq:
            raise SegmentError(p, "records do not match the block index", i)
        return raw, out

    def check_blocks(self, to_seq: int | None = None) -> tuple[int, int]:
        """Check the CRC of every block that holds a seq ≤ to_seq (None: every block),
        reading the file in order without decompressing or parsing anything; a mismatch
        raises SegmentError naming the block. Returns (blocks, bytes) checked."""
        upto = len(self.blocks) if to_seq is None else bisect_left(self._last_seqs, to_seq) + 1
        blocks = self.blocks[: min(upto, len(self.blocks))]
        if not blocks:
            return 0, 0
        f, crc32 = self._f, zlib.crc32
        f.seek(blocks[0].offset)
        for i, b in enumerate(blocks):
            frame = f.read(b.compressed_len)
            if len(frame) != b.compressed_len:
                raise SegmentError(self.path, f"truncated: block {i} cut at offset {b.offset}", i)
            if crc32(frame) != b.crc:
                raise SegmentError(self.path, "block checksum mismatch", i)
        return len(blocks), blocks[-1].offset + blocks[-1].compressed_len - blocks[0].offset

    def records(self, from_seq: int = 0, *, events: bool = False) -> Iterator[Record]:
        """Every data record with seq ≥ from_seq, verified block by block; with `events`
        the system event records too, in seq order among them."""
        start = bisect_left(self._last_seqs, from_seq)
        skip = not events and self.event_count > 0  # files without events: no test a record
        for i in range(start, len(self.blocks)):
            for rec in self.block_records(i):
                if rec.seq >= from_seq and not (skip and rec.op == OP_SYSTEM_EVENT):
                    yield rec

    def changes(self) -> list[ManifestChange]:
        """The manifest changes of the file's system events, in seq order (events upr
        does not use are left out; a malformed one raises SegmentError)."""
        if not self.event_count:
            return []
        p = self.header.partition
        out = []
        for rec in self.records(events=True):
            if rec.op == OP_SYSTEM_EVENT:
                change = self._change(rec, p)
                if change is not None:
                    out.append(change)
        return out

    def _change(self, rec: Record, partition: int) -> ManifestChange | None:
        try:
            return rec.change(partition)
        except UprError as exc:  # CollectionsError: the event's value does not fit
            raise SegmentError(self.path, f"seq {rec.seq}: {exc}") from None

    def verify(self, on_records: Callable[[list[Record]], None] | None = None) -> SegmentInfo:
        """Read everything (every check of formats/segment.md); returns the file's info,
        with its per-collection counts and manifest changes. `on_records` is given each
        block's records (system events included) as they are read."""
        tallies, changes = [], []
        for i, b in enumerate(self.blocks):
            raw, records = self._block(i)
            if on_records is not None:
                on_records(records)
            try:
                tally, more = block_stats(raw, b.record_count, self.header.partition, self.version)
            except UprError as exc:  # CollectionsError: an event's value does not fit
                raise SegmentError(self.path, str(exc), i) from None
            tallies.append(tally)
            changes += more
        events = sum(n for t in tallies for (_c, op), n in t.items() if op == OP_SYSTEM_EVENT)
        if events != self.event_count:
            raise SegmentError(self.path, f"{events} system events, the footer says "
                               f"{self.event_count}")  # fmt: skip
        digest = hashlib.blake2b(digest_size=16)
        self._f.seek(0)
        while chunk := self._f.read(1 << 20):
            digest.update(chunk)
        h = self.header
        return SegmentInfo(str(self.path), h.partition, h.start_seq, h.end_seq, self.first_seq,
                           self.last_seq, self.record_count, self.raw_bytes, self.size,
                           digest.hexdigest(), tally_counts(tallies), tuple(changes))  # fmt: skip

    def close(self) -> None:
        """Close the file."""
        self._f.close()

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
