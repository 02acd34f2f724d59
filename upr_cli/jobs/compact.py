"""Compaction: one segment holding the latest record of every document of a partition.

Theory of operation (formats/repository.md §8.1-8.2, §8.9). A merge (`upr merge`,
`upr spark merge`) and a prune both replace a run of a partition's segments by the
state they add up to: for every document, (collection id, key) being its identity, only
its latest record, tombstones kept (a restore must still delete what the state
deletes). `write_latest` takes the planned pieces of that run (`plan_state`'s steps: in
chain order, then seq order, each read up to its `max_seq`; their kept seq ranges never
overlap and increase) and writes that state as ONE ordinary segment, in seq order.

Memory stays flat as the partition grows: two passes over the pieces, both streamed
block by block through the repository's storage (`repo.storage`; every block's
checksum verified as it is read, a damaged piece raises `SegmentError`).

1. Pass 1 maps every wanted document to its latest seq: `(collection, key) -> seq`,
   ints and keys only, never a value.
2. Pass 2 reads the pieces again and writes each record whose seq is its document's
   latest (it pops the entry, so the map shrinks as the file grows). The writer's
   compressed blocks are spilled to its body file every few blocks, so it never holds
   the partition either.

Left out: system events (collection and scope events: the caller records the
collections of the result in its manifest) and the records of the collection ids `keep`
rejects (a dropped collection's documents). The file is written under a temp name in
`directory`, fsynced and renamed to its segment name (formats/repository.md §2.3) by
`SegmentWriter.finish`, through the same storage; nothing is left under a final name
when a pass fails (a sweep removes the temp files a killed process leaves).

The header is the caller's. Its snapshot list should name only the caller's snapshot
(for a merge, the last snapshot of the chain's resume point): the markers inside the
compacted pieces are gone, since the records between them were compacted and the
records up to an inner marker are no longer a state the source had
(formats/repository.md §8.4).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.repo import BackupId, Repository, SegmentEntry, format_segment_name
from upr_cli.segments import Record, SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.segments.format import DATA_OPS

__all__ = ["Piece", "Written", "write_latest"]

# Rows handed to the writer at once (at most a block's raw bytes of them), and the
# compressed bytes it may hold before a spill (in blocks of the header's block size).
_BATCH = 1024
_SPILL_BLOCKS = 4


@dataclass(frozen=True, slots=True)
class Piece:
    """Records of one segment of a backup with `min_seq` < seq ≤ `max_seq` (`NO_CUT`:
    all)."""

    backup_id: BackupId
    file: str  # the manifest's segment `file` (may be "cut-K/NAME")
    max_seq: int
    min_seq: int = 0  # and seq > min_seq (a merge cut where a later rollback cuts it)


@dataclass(frozen=True, slots=True)
class Written:
    """The segment `write_latest` wrote."""

    entry: SegmentEntry  # for the manifest (file name per formats/repository.md §2.3)
    raw_bytes: int
    collections: dict[int, tuple[int, int]]  # collection id -> (mutations, deletions)


def _records(repo: Repository, bucket: str, pieces: Sequence[Piece],
             keep: Callable[[int], bool] | None) -> Iterator[Record]:  # fmt: skip
    """The wanted records of the pieces, in order, each piece cut at its `max_seq`."""
    for piece in pieces:
        path = repo.segment_path(bucket, piece.backup_id, piece.file)
        with SegmentReader(path, repo.storage) as reader:
            # data records only (no system event), from the block holding min_seq + 1 on
            for rec in reader.records(piece.min_seq + 1):
                if rec.seq > piece.max_seq:
                    break
                if rec.op in DATA_OPS and (keep is None or keep(rec.collection)):
                    yield rec


def write_latest(repo: Repository, bucket: str, partition: int, pieces: Sequence[Piece],
                 *, keep: Callable[[int], bool] | None, header: SegmentHeader,
                 directory: Path) -> Written | None:  # fmt: skip
    """Write the latest record of every document of `pieces` as one segment in
    `directory`; None (no file) when no record is left."""
    latest: dict[tuple[int, bytes], int] = {}
    for rec in _records(repo, bucket, pieces, keep):  # pass 1: seqs only
        latest[rec.collection, bytes(rec.key)] = rec.seq
    if not latest:
        return None
    writer = SegmentWriter(directory / f"p{partition:04x}.open", header, storage=repo.storage)
    limit = _SPILL_BLOCKS * header.block_size
    size = 0
    per: dict[int, list[int]] = {}  # collection id -> [mutations, deletions]
    batch: list[DcpRecord] = []
    with writer:  # aborted (temp files removed) unless finished
        for rec in _records(repo, bucket, pieces, keep):  # pass 2: the winners
            doc = rec.collection, bytes(rec.key)
            if latest.get(doc) != rec.seq:
                continue
            del latest[doc]
            per.setdefault(rec.collection, [0, 0])[rec.op != OP_MUTATION] += 1
            batch.append(rec.as_dcp(partition))
            size += 48 + len(rec.key) + len(rec.value) + len(rec.xattrs)
            if len(batch) >= _BATCH or size >= header.block_size:
                writer.add(batch)
                batch, size = [], 0
                if writer.buffered > limit:
                    writer.spill()
        writer.add(batch)
        name = format_segment_name(partition, writer.first_seq, writer.last_seq)
        info = writer.finish(path=directory / name, sync=True)
    entry = SegmentEntry(name, info.first_seq, info.last_seq, info.records, info.bytes,
                         info.checksum)  # fmt: skip
    return Written(entry, info.raw_bytes, {c: (m, d) for c, (m, d) in sorted(per.items())})
