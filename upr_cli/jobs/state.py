"""Which state of a bucket a restore or replay reads from the repository (chain
semantics: formats/repository.md §8): the backup `--at` names and its partitions.

For each partition, `plan_state` names the segments (and the seq cut of each) whose
records make the state at backup K; reading them in order and keeping the latest
version of every (collection, key) gives that state, deletions included (as
tombstones), so a restore can tell a deletion from absence (`jobs.restore.partition_state`).

The manifests come from `source.open_bucket`, which has checked the chain whole
(formats/repository.md §8.8); `check_files` then makes sure, before a restore writes
anything, that every segment file the state reads is there with its recorded size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from upr_cli.errors import UsageError
from upr_cli.repo import BackupId, BrokenChain, Manifest, Repository
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
