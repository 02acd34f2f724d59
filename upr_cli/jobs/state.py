"""The state of a bucket at a backup, read from the repository (chain semantics:
formats/repository.md §8).

For each partition, `plan_state` names the segments (and the seq cut of each) whose
records make the state at backup K; reading them in order and keeping the latest
version of every key gives that state, deletions included (as tombstones), so a restore
can tell a deletion from absence. Memory holds one partition's keys at a time.

The manifests come from `source.open_bucket`, which has checked the chain whole
(formats/repository.md §8.8); `check_files` then makes sure, before a restore writes
anything, that every segment file the state reads is there with its recorded size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from upr_cli.errors import UsageError
from upr_cli.repo import BackupId, BrokenChain, Manifest, Repository, plan_state
from upr_cli.segments import Record, SegmentReader
from upr_cli.source import backup_named


@dataclass(frozen=True, slots=True)
class Selection:
    """Which backup and which partitions to read."""

    backup_id: BackupId
    partitions: tuple[int, ...]


def select(
    manifests: Sequence[Manifest], at: str = "latest", partitions: Sequence[int] | None = None
) -> Selection:
    """Resolve `--at` (a backup id or a unique prefix of one, latest, oldest) and the
    partitions to read."""
    if not manifests:
        raise UsageError("the repository holds no committed backup of this bucket")
    bid = backup_named([m.backup_id for m in manifests], at)
    if bid is None:
        raise UsageError(f"--at: no committed backup {at!r} (see `upr info`)")
    held = sorted({e.partition for m in manifests if m.backup_id <= bid for e in m.partitions})
    if partitions is not None:
        held = [p for p in held if p in set(partitions)]
    return Selection(bid, tuple(held))


def check_files(
    repo: Repository, bucket: str, manifests: Sequence[Manifest], selection: Selection
) -> None:
    """Every segment file the selected state reads exists with the size its manifest
    records; otherwise `BrokenChain` naming the first one (no file is read: block
    checksums are verified as the records are read)."""
    bad = repo.missing_files(bucket, manifests, selection.backup_id, selection.partitions)
    if bad:
        also = f" (and {len(bad) - 1} more: `upr verify` names them)" if len(bad) > 1 else ""
        raise BrokenChain(f"{bad[0]}{also}")


def partition_state(
    repo: Repository, bucket: str, manifests: Sequence[Manifest], at: BackupId, partition: int
) -> dict[tuple[int, bytes], Record]:
    """Latest record per (collection, key) of one partition at backup `at` (tombstones
    included); the same key in two collections is two documents."""
    latest: dict[tuple[int, bytes], Record] = {}
    for step in plan_state(manifests, at=at, partition=partition):
        path = repo.segment_path(bucket, step.backup_id, step.segment.file)
        with SegmentReader(path) as reader:
            for rec in reader.records():
                if rec.seq > step.max_seq:
                    break
                latest[rec.collection, rec.key] = rec
    return latest


def state_at(
    repo: Repository, bucket: str, manifests: Sequence[Manifest], selection: Selection
) -> Iterator[tuple[int, list[Record]]]:
    """(partition, records sorted by seq) for every selected partition at the backup."""
    for p in selection.partitions:
        records = sorted(
            partition_state(repo, bucket, manifests, selection.backup_id, p).values(),
            key=lambda r: r.seq,
        )
        yield p, records
