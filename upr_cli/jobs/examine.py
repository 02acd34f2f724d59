"""`upr examine`: every version of one key across a repository's chain.

The key's partition follows the SDKs' hashing over the bucket's partition count, read from
the repository's manifests (`partition_count`); a count given that the repository
contradicts is refused rather than answered with a silent "no version". Each version
found in a segment is listed with its backup, seq, op, cas and rev seq, and whether it
is a lost write: above the cut a later backup's rollback made (DESIGN, chain semantics),
so absent from the latest state, or taken back by a rollback in the middle of its
backup (a cut-back segment, formats/repository.md §5.6).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from upr_cli.errors import UsageError
from upr_cli.jobs.inspect import open_bucket
from upr_cli.net.bootstrap import partition_of
from upr_cli.repo import Manifest, lost_cut
from upr_cli.segments import SegmentReader

OPS = {0x57: "mutation", 0x58: "deletion", 0x59: "expiration"}


@dataclass(frozen=True, slots=True)
class Version:
    """One stored version of the key."""

    backup_id: str
    partition: int
    seq: int
    op: str
    cas: int
    rev_seq: int
    flags: int
    expiry: int
    value: bytes
    datatype: int
    lost: bool
    in_latest: bool

    def to_json(self) -> dict[str, Any]:
        """JSON form (the value as JSON when its datatype says so, else text)."""
        val: Any = None
        if self.op == "mutation":
            try:
                val = json.loads(self.value) if self.datatype & 1 else self.value.decode()
            except (ValueError, UnicodeDecodeError):
                val = self.value.hex()
        return {
            "backup_id": self.backup_id,
            "partition": self.partition,
            "seq": self.seq,
            "op": self.op,
            "cas": str(self.cas),
            "rev_seq": self.rev_seq,
            "flags": self.flags,
            "expiry": self.expiry,
            "lost": self.lost,
            "in_latest": self.in_latest,
            "value": val,
        }


def partition_count(manifests: Sequence[Manifest]) -> tuple[int, bool]:
    """The bucket's partition count as its backups show it, and whether that is exact.

    A full backup streams every partition of the bucket, so one whose partitions are
    exactly 0..n-1 says n (exact). Otherwise (only backups of some partitions) the count
    is at least 1 + the highest partition any backup holds (a lower bound)."""
    held = {e.partition for m in manifests for e in m.partitions}
    lower = 1 + max(held, default=0)
    for m in reversed(manifests):
        ids = {e.partition for e in m.partitions}
        if m.full and ids and ids == set(range(max(ids) + 1)) and max(ids) + 1 >= lower:
            return max(ids) + 1, True
    return lower, False


def examine(
    repo_dir: Path, key: bytes, *, bucket: str | None = None, partitions: int | None = None
) -> list[Version]:
    """Every version of `key`, oldest first. `partitions` is the bucket's partition count
    (default: `partition_count`); one the repository contradicts raises UsageError."""
    repo, b, manifests = open_bucket(repo_dir, bucket)
    if not manifests:
        raise UsageError(f"{repo_dir}: no committed backup of bucket {b!r}")
    known, exact = partition_count(manifests)
    if partitions is not None and (partitions < known or (exact and partitions != known)):
        has = f"{known} partitions" if exact else f"partitions up to {known - 1}"
        raise UsageError(
            f"--partitions {partitions}: bucket {b!r} in {repo_dir} has {has}; the key's "
            f"partition depends on the count (leave --partitions out to use the repository's)"
        )
    count = partitions or known
    p = partition_of(key, count)
    latest = manifests[-1].backup_id
    out: list[Version] = []
    for m in manifests:
        entry = m.partition(p)
        if entry is None:
            continue
        c = lost_cut(manifests, p, m.backup_id, latest)
        # its segments, then the records mid-run rollbacks took back (lost: seq above 0)
        files = [(seg.file, c) for seg in entry.segments]
        files += [(name, 0) for name, _seg in entry.cut_files()]
        for name, c in files:
            with SegmentReader(repo.segment_path(b, m.backup_id, name)) as reader:
                for op, seq, rev, cas, flags, exp, _dt, dtype, k, value in reader.records():
                    if k == key:
                        out.append(
                            Version(
                                str(m.backup_id),
                                p,
                                seq,
                                OPS[op],
                                cas,
                                rev,
                                flags,
                                exp,
                                value,
                                dtype,
                                seq > c,
                                False,
                            )
                        )
    kept = [v for v in out if not v.lost]
    if kept:
        newest = max(kept, key=lambda v: v.seq)
        out = [replace(v, in_latest=v is newest) for v in out]
    return out
