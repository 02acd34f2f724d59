"""`upr backup --dry-run`: what a backup would take, with nothing written.

Theory of operation
-------------------
A backup decides everything it streams before its first record: the chain it continues
(none: a full backup), each partition's start (where the newest backup holding it
ended, or the rollback point the live failover log forces: `decide_starts`, the rules
of a real run) and its end (the high seq read at the start). A dry run makes those
same decisions and stops there. It reads the source (its collections manifest, each
partition's failover log and high seq: `_check_source`, `_live_state`) and the
repository's manifests (and, only for a partition that needs a rollback, the snapshot
boundaries in its segments' headers), and never writes: no repository is created, no
lock taken, no leftover swept, no damaged manifest healed (a chain that a real run
would heal or refuse is reported as the error the run would give, or a warning).

The estimate of items is the sum, over partitions, of the seqs between the start and
the high seq: an upper bound, since a key changed twice in that range comes once (DCP
deduplicates) and a filter of collections leaves records out. Segments an interrupted
run left, which a real run reuses, are not counted off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upr_cli.collections import CollectionsManifest
from upr_cli.collections import Path as CollectionPath
from upr_cli.errors import UsageError
from upr_cli.jobs.backup import (
    PartitionRollback,
    _check_source,
    _checked_chain,
    _live_state,
    checked_filter,
    collection_filter,
    decide_starts,
)
from upr_cli.net.uri import SourceUri
from upr_cli.repo import Manifest, Repository


@dataclass(frozen=True, slots=True)
class PartitionRange:
    """One partition's seqs a backup would stream: from `from_seq` (exclusive) to `to_seq`."""

    partition: int
    from_seq: int
    to_seq: int

    @property
    def items(self) -> int:
        """The seqs in the range: at most this many items."""
        return max(0, self.to_seq - self.from_seq)

    def to_json(self) -> dict[str, Any]:
        """Seqs as decimal strings (docs/output.md), the count as an integer."""
        return {"partition": self.partition, "from": str(self.from_seq),
                "to": str(self.to_seq), "items": self.items}  # fmt: skip


@dataclass
class BackupPlan:
    """What a backup would take (`upr backup --dry-run`, text and --json)."""

    bucket: str
    repo: str
    full: bool  # no chain to continue (a new repository or bucket, or --full)
    parent: str | None  # the backup an incremental one would continue
    ranges: list[PartitionRange]
    collections: int
    rollbacks: list[PartitionRollback] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    repository_exists: bool = True

    @property
    def estimated_items(self) -> int:
        """The sum of the seq ranges: an upper bound on the items streamed."""
        return sum(r.items for r in self.ranges)

    @property
    def changed(self) -> list[PartitionRange]:
        """The partitions with seqs to stream."""
        return [r for r in self.ranges if r.items]

    def to_json(self) -> dict[str, Any]:
        """JSON form: counts as integers, seqs as decimal strings."""
        return {
            "dry_run": True,
            "bucket": self.bucket,
            "repo": self.repo,
            "repository_exists": self.repository_exists,
            "full": self.full,
            "parent": self.parent,
            "partition_count": len(self.ranges),
            "partitions_with_changes": len(self.changed),
            "estimated_items": self.estimated_items,
            "collection_count": self.collections,  # as backup's: `collections` is a list
            "rollbacks": [rb.to_json() for rb in self.rollbacks],
            "warnings": self.warnings,
            "seqs": [r.to_json() for r in self.ranges],
        }


async def plan_backup(
    uri: SourceUri,
    repo_dir: Path,
    *,
    full: bool = False,
    partitions: list[int] | None = None,
    include: Sequence[CollectionPath] = (),
    exclude: Sequence[CollectionPath] = (),
) -> BackupPlan:
    """What `backup` with these arguments would stream now, with nothing written."""
    if uri.bucket is None:
        raise UsageError("the source URI names no bucket")
    bucket = uri.bucket
    repo = Repository(repo_dir)
    repo.check_init()  # not a repository, not empty: the error a real run gives
    chosen = collection_filter(include, exclude)
    collections = await _check_source(uri, repo, bucket, full=full, chosen=chosen)
    exists = repo.storage.stat(repo.repo_file, follow_links=True) is not None
    manifests: list[Manifest] = []
    if exists and not full and repo.committed(bucket):
        manifests = _checked_chain(repo, bucket, repo_dir)
    checked_filter(bucket, chosen, collections, manifests)
    count, live_logs, seqs = await _live_state(uri, None)
    wanted = partitions if partitions is not None else list(range(count))
    warnings: list[str] = []
    decisions = decide_starts(repo, bucket, manifests, live_logs, seqs, warnings.append)
    ranges, rollbacks = [], []
    for p in wanted:
        d = decisions.get(p)
        start = d.position.seq if d is not None else 0
        ranges.append(PartitionRange(p, start, seqs.get(p, (0, 0))[0]))
        rb = d.rollback if d is not None else None
        if rb is not None:
            rollbacks.append(PartitionRollback(p, rb.from_seq, rb.to_seq, rb.seed_rule_seq,
                                               rb.producer_seq, False, 0))  # fmt: skip
    m = collections or CollectionsManifest()
    n = sum(1 for s, c in m.collections() if chosen is None or chosen.covers(s.name, c.name))
    parent = str(manifests[-1].backup_id) if manifests else None
    return BackupPlan(bucket, str(repo_dir), parent is None, parent, ranges, n, rollbacks,
                      warnings, exists)  # fmt: skip
