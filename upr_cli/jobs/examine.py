"""`upr examine`: every version of one key across a repository's chain.

The key's partition follows the SDKs' hashing over the bucket's partition count (the
partitions of its full backups). Each version found in a segment is listed with its
backup, seq, op, cas and rev seq, and whether it is a lost write: above the cut a later
backup's rollback made (DESIGN, chain semantics), so absent from the latest state, or
taken back by a rollback in the middle of its backup (a cut-back segment,
formats/repository.md §5.6).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from upr_cli.errors import UsageError
from upr_cli.jobs.inspect import open_bucket
from upr_cli.net.bootstrap import partition_of
from upr_cli.repo import lost_cut
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


def examine(
    repo_dir: Path, key: bytes, *, bucket: str | None = None, partitions: int | None = None
) -> list[Version]:
    """Every version of `key`, oldest first."""
    repo, b, manifests = open_bucket(repo_dir, bucket)
    if not manifests:
        raise UsageError(f"{repo_dir}: no committed backup of bucket {b!r}")
    count = partitions or 1 + max(e.partition for m in manifests if m.full for e in m.partitions)
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
