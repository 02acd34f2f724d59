"""Writing segment files: blocks compressed off the caller's hot path, atomic publication.

Theory of operation: records are packed into a raw block until it reaches `block_size`,
then the block is compressed as one zstd frame and appended to a temporary body file.
The header carries facts known only at the end of a stream (the range end, which may
pass the pinned end to finish a snapshot, and the markers covered), so `finish()`
assembles the file then: preamble and header, the body copied by the kernel (compressed
bytes: about an eighth of the raw size), footer, trailer; fsync, rename to the final
name, fsync the directory (docs/design.md "Reliability"). Before that nothing is visible
under the final name. Every file is written through the repository's storage
(`upr_cli.storage.Storage`: `create`, `append`, `copy`, `sync`, `replace`, `sync_dir`,
`delete`), whose local backend makes its system calls through `upr_cli.fsio.FileOps`, so
tests can fail any of them; a caller that finishes many segments without syncing makes
them durable together with `Storage.sync_all`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import zlib
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import replace
from operator import lt
from pathlib import Path
from typing import IO

import zstandard

from upr_cli.collections import ManifestChange
from upr_cli.errors import LocalProtocolError
from upr_cli.failover import FailoverLog
from upr_cli.fsio import FileOps, temp_path
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.segments.format import (
    BLOB_LEN,
    BLOCK_ENTRY,
    CRC,
    END_MAGIC,
    FOOTER_FIXED,
    MAGIC,
    OP_SYSTEM_EVENT,
    OPS,
    PREAMBLE,
    RECORD_HEAD,
    TRAILER,
    VERSION,
    XATTR,
    BlockInfo,
    Record,
    SegmentHeader,
    SegmentInfo,
    Tally,
    block_stats,
    parse_block,
    tally_counts,
)
from upr_cli.storage import LocalStorage, Storage

__all__ = ["DEFAULT_LEVEL", "SegmentWriter", "new_compressor"]

# Level 7: with one segment per partition, blocks are often ~100 KB; measured there
# (formats/segment.md, Decisions) level 3 falls 6% short of `zstd -3` on the whole stream,
# level 7 matches it at ~150 MB/s of raw input, off the event loop (zstd drops the GIL).
DEFAULT_LEVEL = 7


def new_compressor(level: int = DEFAULT_LEVEL) -> zstandard.ZstdCompressor:
    """A zstd compressor as segments use it (content size written, no zstd checksum)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)


class SegmentWriter:
    """Write one segment: `add` rows, then `finish` (or `abort`).

    `header` gives everything known when the stream starts; `finish` may set the range
    end and the snapshot markers covered, which are known only at the end. Compressed
    blocks stay in memory until `spill()` (called by the owner under memory pressure)
    moves them to a temporary body file, so small segments cost one file, not two.
    """

    def __init__(
        self,
        path: Path,
        header: SegmentHeader,
        *,
        level: int = DEFAULT_LEVEL,
        fs: FileOps | None = None,
        storage: Storage | None = None,
        compressor: zstandard.ZstdCompressor | None = None,
    ) -> None:
        self.path = path
        self.header = header
        # `fs`: the system calls of a local storage (tests fail them one by one)
        self.storage: Storage = storage or LocalStorage(fs)
        self._block_size = header.block_size
        # A compression context costs about half a megabyte: writers used from one thread
        # (a backup has one per partition) share one (`new_compressor`).
        self._zstd = compressor or new_compressor(level)
        self._tmp = temp_path(path)
        self._body_path = self._tmp.with_name(self._tmp.name + "-body")
        self._body: IO[bytes] | None = None  # opened by the first spill
        self._out: IO[bytes] | None = None
        self._frames: list[bytes] = []  # compressed blocks not spilled yet
        self._frames_len = 0
        self._spilled = 0
        # a block is laid out by column: heads, keys, xattr blobs (of the records that
        # have some), values
        self._heads: list[bytes] = []
        self._keys: list[bytes] = []
        self._xattrs: list[bytes] = []
        self._values: list[bytes] = []
        self._raw_len = 0
        self._raw_count = 0
        self._raw_first = 0
        self._last_seq = header.start_seq
        self._first_seq = 0
        self._blocks: list[BlockInfo] = []  # offsets relative to the body
        self._records = 0
        self._raw_total = 0
        # per block, records per (collection, op) and the manifest changes of its system
        # events, read off each block as it is compressed (a truncation drops whole
        # blocks' and recounts the records it keeps)
        self._stats: list[tuple[Tally, list[ManifestChange]]] = []
        self._done = False

    def add(self, rows: Iterable[DcpRecord]) -> None:
        """Append DCP records with increasing seqs above the start; a record's xattrs
        (`DcpRecord.xattrs`) go to the block's xattrs column.

        Any failure (a write error, a record out of order) aborts the whole segment.
        """
        if self._done:
            raise LocalProtocolError("segment already finished")
        rows = rows if isinstance(rows, list) else list(rows)
        try:
            if not rows or self._add_run(rows):
                return
        except BaseException:
            self.abort()
            raise
        # record by record: each unpacked at once (a field read by name
        # costs a call), the block's running length and count kept in locals
        pack, xbit, ops, block_size = RECORD_HEAD.pack, XATTR, OPS, self._block_size
        heads, keys, values, last = self._heads, self._keys, self._values, self._last_seq
        raw_len, count = self._raw_len, self._raw_count
        try:
            for r in rows:
                op, _vb, seq, rev, cas, flags, exp, dtime, dt, key, value, _op, cid, blob = r
                if seq <= last or op not in ops:
                    raise LocalProtocolError(
                        f"record seq {seq} (op 0x{op:02x}) does not follow {last}"
                    )
                if not count:
                    self._raw_first = seq
                    if not self._first_seq:
                        self._first_seq = seq
                k, v = bytes(key), bytes(value)
                if blob or dt & xbit:  # rare
                    self._raw_len = raw_len
                    dt, v = self._add_xattrs(r, dt, v)
                    raw_len = self._raw_len
                heads.append(pack(op, dt, len(k), len(v), seq, rev, cas, flags, exp, dtime,
                                  cid))  # fmt: skip
                keys.append(k)
                values.append(v)
                raw_len += 48 + len(k) + len(v)
                count += 1
                last = seq
                if raw_len >= block_size:
                    self._last_seq, self._raw_len, self._raw_count = last, raw_len, count
                    self._flush_block()
                    heads, keys, values = self._heads, self._keys, self._values
                    raw_len, count = self._raw_len, self._raw_count
        except BaseException:
            self.abort()
            raise
        self._last_seq, self._raw_len, self._raw_count = last, raw_len, count

    def _add_run(self, rows: list[DcpRecord]) -> bool:
        """Append a run of records column by column, at C speed (a backup's hot path);
        False, with nothing changed, when the run needs `add`'s record-by-record path: a
        record with xattrs, one out of order or of an unknown op, or a block that fills
        inside the run."""
        (ops, _vb, seqs, revs, cas, flags, exps, dtimes, dts, keys, values, _op, cids,
         blobs) = zip(*rows, strict=True)  # fmt: skip
        if (seqs[0] <= self._last_seq or not all(map(lt, seqs, seqs[1:]))
                or not _OPS.issuperset(ops) or any(blobs)
                or not _XATTR_DTS.isdisjoint(dts)):  # fmt: skip
            return False
        k, v = list(map(bytes, keys)), list(map(bytes, values))
        klen, vlen = list(map(len, k)), list(map(len, v))
        size = 48 * len(rows) + sum(klen) + sum(vlen)
        if self._raw_len + size >= self._block_size:
            return False
        heads = list(map(RECORD_HEAD.pack, ops, dts, klen, vlen, seqs, revs, cas, flags, exps,
                         dtimes, cids))  # fmt: skip
        if not self._raw_count:
            self._raw_first = seqs[0]
            if not self._first_seq:
                self._first_seq = seqs[0]
        self._heads += heads
        self._keys += k
        self._values += v
        self._raw_len += size
        self._raw_count += len(rows)
        self._last_seq = seqs[-1]
        return True

    def _add_xattrs(self, r: DcpRecord, dt: int, v: bytes) -> tuple[int, bytes]:
        """Put a record's blob in the xattrs column; (its head datatype, its body). A
        value that still holds its blob (XATTR bit set, `xattrs` empty) is split here."""
        blob = bytes(r.xattrs)
        if not blob:
            blob, v = xattrs.split(v, r.key)
        elif len(blob) < 4 or BLOB_LEN.unpack_from(blob)[0] + 4 != len(blob):
            raise xattrs.CorruptXattrsError(r.key, "blob length does not match")
        if r.opcode == OP_SYSTEM_EVENT:
            raise LocalProtocolError(f"record seq {r.by_seqno}: a system event has no xattrs")
        if blob:
            self._xattrs.append(blob)
            self._raw_len += len(blob)
            return dt | XATTR, v
        return dt & ~XATTR, v

    def _flush_block(self) -> None:
        if not self._raw_count:
            return
        data = self._raw_block()
        self._stats.append(block_stats(data, self._raw_count, self.header.partition))
        frame = self._zstd.compress(data)
        offset = self._spilled + self._frames_len
        self._blocks.append(BlockInfo(offset, self._raw_first, self._last_seq, len(frame),
                                      len(data), self._raw_count, zlib.crc32(frame)))  # fmt: skip
        self._records += self._raw_count
        self._raw_total += len(data)
        self._frames.append(frame)
        self._frames_len += len(frame)
        self._heads, self._keys, self._xattrs, self._values = [], [], [], []
        self._raw_len, self._raw_count = 0, 0

    def _raw_block(self) -> bytes:
        """The records not yet in a block, laid out by column."""
        columns = (self._heads, self._keys, self._xattrs, self._values)
        return b"".join(b"".join(c) for c in columns)

    @property
    def buffered(self) -> int:
        """Bytes held in memory: raw records waiting for a block, plus unspilled blocks."""
        return self._raw_len + self._frames_len

    @property
    def done(self) -> bool:
        """Finished or aborted: nothing more can be added, spilled or finished."""
        return self._done

    def spill(self) -> None:
        """Compress buffered records and move every block to the body file (frees memory)."""
        if self._done:
            raise LocalProtocolError("segment already finished")
        try:
            self._flush_block()
            if self._frames:
                if self._body is None:
                    self._body = self.storage.create(self._body_path)
                self.storage.append(self._body, b"".join(self._frames))
                self._spilled += self._frames_len
                self._frames, self._frames_len = [], 0
        except BaseException:
            self.abort()
            raise

    def truncate(self, seq: int, into: SegmentWriter | None = None) -> int:
        """Drop every record above `seq`, moving them to `into` when given; returns how
        many went.

        For a source that rolled back in the middle of a stream (docs/protocol.md §4.4): the
        records above the rollback seq belong to an abandoned branch (a backup keeps them
        as lost writes, `into`). Whole blocks above it are cut off (from memory or the
        body file); the one block it falls inside is decompressed and its records up to
        `seq` are buffered again, so memory stays bounded by one block (and `into` spills
        past four).
        """
        if self._done:
            raise LocalProtocolError("segment already finished")
        try:
            self._flush_block()
            keep = bisect_right([b.last_seq for b in self._blocks], seq)
            if keep == len(self._blocks):
                return 0
            gone = self._blocks[keep:]
            kept: list[Record] = []
            dctx = zstandard.ZstdDecompressor()
            for i, b in enumerate(gone):
                if i and into is None:
                    break
                raw = dctx.decompress(self._frame(b), max_output_size=b.raw_len)
                records = parse_block(raw, b.record_count, VERSION)
                if not i:
                    kept = [r for r in records if r.seq <= seq]
                if into is not None:
                    into.add(_rows(r for r in records if r.seq > seq))
                    if into.buffered > 4 * self._block_size:
                        into.spill()  # memory stays bounded: the cut can be a whole run
            cut = gone[0]
            if cut.offset >= self._spilled:  # every block from the cut on is in memory
                self._frames = self._frames[: len(self._frames) - len(gone)]
            else:
                assert self._body is not None
                self._body.truncate(cut.offset)
                self._body.seek(cut.offset)
                self._spilled, self._frames = cut.offset, []
            self._frames_len = sum(len(f) for f in self._frames)
            self._blocks = self._blocks[:keep]
            self._stats = self._stats[:keep]
            self._records -= sum(b.record_count for b in gone)
            self._raw_total -= sum(b.raw_len for b in gone)
            self._last_seq = self._blocks[-1].last_seq if self._blocks else self.header.start_seq
            if not self._blocks:
                self._first_seq = 0
        except BaseException:
            self.abort()
            raise
        self.add(_rows(kept))
        return sum(b.record_count for b in gone) - len(kept)

    def _frame(self, b: BlockInfo) -> bytes:
        """One compressed block, from memory or the body file."""
        if b.offset >= self._spilled:
            at = self._spilled
            for frame in self._frames:
                if at == b.offset:
                    return frame
                at += len(frame)
            raise LocalProtocolError(f"no block at offset {b.offset}")
        assert self._body is not None
        self._body.seek(b.offset)
        frame = self._body.read(b.compressed_len)
        self._body.seek(0, os.SEEK_END)
        return frame

    def _all_stats(self) -> list[tuple[Tally, list[ManifestChange]]]:
        """Every block's, and the records not yet in a block."""
        if not self._raw_count:
            return self._stats
        raw = self._raw_block()
        return [*self._stats, block_stats(raw, self._raw_count, self.header.partition)]

    @property
    def counts(self) -> tuple[tuple[int, int, int], ...]:
        """(collection id, mutations, deletions and expirations) of the records added."""
        return tally_counts(t for t, _c in self._all_stats())

    @property
    def event_count(self) -> int:
        """System event records added (the footer's `events`)."""
        return sum(n for t, _c in self._all_stats() for (_i, op), n in t.items()
                   if op == OP_SYSTEM_EVENT)  # fmt: skip

    @property
    def changes(self) -> list[ManifestChange]:
        """The manifest changes of the system events added, in seq order."""
        return [c for _t, cs in self._all_stats() for c in cs]

    @property
    def first_seq(self) -> int:
        """The seq of the first record added (0 if none)."""
        return self._first_seq

    @property
    def last_seq(self) -> int:
        """The seq of the last record added (the start seq if none)."""
        return self._last_seq

    def finish(
        self,
        *,
        end_seq: int | None = None,
        snapshots: tuple[tuple[int, int], ...] | None = None,
        sync: bool = True,
        path: Path | None = None,
        failover_log: FailoverLog | None = None,
    ) -> SegmentInfo:
        """Assemble header, body, footer and trailer under the temp name and rename it.

        `failover_log` replaces the header's when the stream returned a newer one (a
        reopened stream: the same history, newer entries). With `sync` (the default) the
        file and its directory are fsynced; a caller that writes many segments may pass
        False and make them durable together before its commit point (`Storage.sync_all`).
        """
        if self._done:
            raise LocalProtocolError("segment already finished")
        if path is not None:  # named only now (e.g. by its first and last record seq)
            self.path = path
        h = self.header
        if end_seq is not None or snapshots is not None:
            h = replace(h, end_seq=h.end_seq if end_seq is None else end_seq,
                        snapshots=h.snapshots if snapshots is None else snapshots)  # fmt: skip
        if failover_log is not None:
            h = replace(h, failover_log=failover_log)
        try:
            self._flush_block()
            if self._last_seq > h.end_seq:
                raise LocalProtocolError(f"records reach seq {self._last_seq} > end {h.end_seq}")
            digest = hashlib.blake2b(digest_size=16)
            head = h.to_bytes()
            pre = PREAMBLE.pack(MAGIC, VERSION, 0, len(head)) + head
            pre += CRC.pack(zlib.crc32(pre))
            base = len(pre)
            body_len = self._spilled + self._frames_len
            last = self._blocks[-1].last_seq if self._blocks else 0
            footer = FOOTER_FIXED.pack(len(self._blocks), self.event_count, self._records,
                                       self._raw_total,
                                       self._first_seq, last) + b"".join(
                BLOCK_ENTRY.pack(base + b.offset, b.first_seq, b.last_seq, b.compressed_len,
                                 b.raw_len, b.record_count, b.crc) for b in self._blocks
            )  # fmt: skip
            tail = footer + TRAILER.pack(base + body_len, len(footer), zlib.crc32(footer),
                                         END_MAGIC)  # fmt: skip
            store = self.storage
            self._out = out = store.create(self._tmp)
            store.append(out, pre)
            digest.update(pre)
            if self._body is not None:  # spilled blocks first, in order
                self._body.seek(0)
                store.copy(self._body, out)
                self._body.seek(0)
                while chunk := self._body.read(1 << 20):
                    digest.update(chunk)
                self._body.close()
                store.delete(self._body_path)
            rest = b"".join(self._frames) + tail
            store.append(out, rest)
            digest.update(rest)
            if sync:
                store.sync(out)
            out.close()
            store.replace(self._tmp, self.path)
            if sync:
                store.sync_dir(self.path.parent)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self.header = h
        self._frames = []
        size = base + body_len + len(tail)
        return SegmentInfo(
            str(self.path), h.partition, h.start_seq, h.end_seq, self._first_seq, last,
            self._records, self._raw_total, size, digest.hexdigest(), self.counts,
            tuple(self.changes),
        )  # fmt: skip

    def abort(self) -> None:
        """Drop the temporary files; nothing appears under the final name."""
        self._done = True
        self._frames = []
        for f in (self._body, self._out):
            if f is not None and not f.closed:
                f.close()
        for p in (self._body_path, self._tmp):
            with contextlib.suppress(OSError):  # a sweep removes `.NAME.tmp-*` leftovers later
                self.storage.delete(p)

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if not self._done:
            self.abort()


_OPS = frozenset(OPS)
_XATTR_DTS = frozenset(d for d in range(256) if d & XATTR)  # datatypes with the XATTR bit


def _rows(records: Iterable[Record]) -> Iterator[DcpRecord]:
    """Reader records as the DCP records `add` takes (the vbucket is unused: 0)."""
    for r in records:
        yield r.as_dcp(0)
