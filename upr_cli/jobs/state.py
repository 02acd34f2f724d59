"""Which state of a bucket a restore or replay reads from the repository (chain
semantics: formats/repository.md §8): the backup `--at` names and its partitions.

For each partition, `plan_state` names the segments (and the seq cut of each) whose
records make the state at backup K; reading them in order and keeping the latest
version of every (collection, key) gives that state, deletions included (as
tombstones), so a restore can tell a deletion from absence (`jobs.restore.partition_state`).

The manifests come from `source.open_bucket`, which has checked the chain whole
(formats/repository.md §8.8); `check_files` then makes sure, before a restore writes
anything, that every segment file the state reads is there with its recorded size.

`precheck` goes further, still before the first write (a node has no transaction to
undo a half-written restore): every segment the state reads is opened (its header,
footer and trailer checksums), compared with its manifest entry (partition, records,
seq range) and the CRC of every block the state reads is checked
(formats/repository.md §8.2). Blocks are read in file order and never decompressed, so
the pass costs a CRC32 per byte and holds one block at a time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from upr_cli.errors import UsageError
from upr_cli.repo import (
    BackupId,
    BrokenChain,
    Manifest,
    PlanStep,
    Repository,
    RepositoryError,
    plan_state,
)
from upr_cli.segments import SegmentError, SegmentReader
from upr_cli.source import backup_named
from upr_cli.storage import Storage, is_s3


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


class DamagedBackup(RepositoryError):
    """The pre-check found damage in segments the state reads: nothing was written."""


@dataclass
class Precheck:
    """What `precheck` read, and the damage it found per partition (one line each,
    naming the file, the block when there is one, and what is wrong)."""

    segments: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    damage: dict[int, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        """JSON form (docs/output.md, `upr restore`'s `precheck`)."""
        return {"segments": self.segments, "blocks": self.blocks, "bytes": self.bytes,
                "seconds": round(self.seconds, 3)}  # fmt: skip

    def refuse(self) -> None:
        """Raise `DamagedBackup` naming the first damage, if any was found."""
        lines = [line for p in sorted(self.damage) for line in self.damage[p]]
        if lines:
            also = (
                f" (and {len(lines) - 1} more: `upr verify` names them)" if len(lines) > 1 else ""
            )
            raise DamagedBackup(f"nothing written: {lines[0]}{also}; --skip-corrupt restores "
                                "the partitions without damage")  # fmt: skip


def precheck(
    repo: Repository,
    bucket: str,
    manifests: Sequence[Manifest],
    selection: Selection,
) -> Precheck:
    """Check every segment the selected state reads, and every block of it the state
    reads, against its checksums and its manifest entry (the module's doc); damage is
    collected per partition, never raised (`Precheck.refuse` does)."""
    t0 = time.monotonic()
    out = Precheck()
    work = [(p, step) for p in selection.partitions
            for step in plan_state(manifests, at=selection.backup_id, partition=p)]  # fmt: skip

    def check(item: tuple[int, PlanStep]) -> tuple[int, str | None, Precheck]:
        p, step = item
        path = repo.segment_path(bucket, step.backup_id, step.segment.file)
        counts = Precheck()
        return p, _check_segment(repo.storage, path, p, step, counts), counts

    # In object storage every segment is a download: `--transfers` of them at once (the
    # storage keeps what it downloaded for the restore's own reads); on disk, one by one.
    n = repo.access.transfers if is_s3(repo.path) else 1
    with contextlib.ExitStack() as stack:
        results: Iterator[tuple[int, str | None, Precheck]] = map(check, work)
        if n > 1:
            results = stack.enter_context(ThreadPoolExecutor(n, "upr-precheck")).map(check, work)
        for p, why, counts in results:
            out.segments += counts.segments
            out.blocks += counts.blocks
            out.bytes += counts.bytes
            if why is not None:
                out.damage.setdefault(p, []).append(why)
    out.seconds = time.monotonic() - t0
    return out


def _check_segment(storage: Storage, path: Path, partition: int, step: PlanStep,
                   out: Precheck) -> str | None:  # fmt: skip
    """One segment against its manifest entry and its checksums: None when sound, else
    one line saying what is wrong."""
    seg = step.segment
    try:
        st = storage.stat(path, follow_links=True)
    except OSError as exc:
        return f"{path}: cannot read: {exc.strerror}"
    if st is None:
        return f"{path}: missing (listed by backup {step.backup_id})"
    size = st.size
    if size != seg.bytes:
        return f"{path}: {size} bytes, the manifest of backup {step.backup_id} says {seg.bytes}"
    try:
        with SegmentReader(path, storage) as r:
            out.segments += 1
            h = r.header
            if h.partition != partition:
                return f"{path}: holds partition {h.partition}, the manifest says {partition}"
            if (r.record_count, r.first_seq, r.last_seq) != (seg.records, seg.first_seq,
                                                              seg.last_seq):  # fmt: skip
                return f"{path}: records or seq range differ from the manifest"
            blocks, n = r.check_blocks(step.max_seq)
    except SegmentError as exc:
        return str(exc)
    out.blocks += blocks
    out.bytes += n
    return None
