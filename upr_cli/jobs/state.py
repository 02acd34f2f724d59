"""Which state of a bucket a restore or replay reads from the repository (chain
semantics: formats/repository.md §8): the backup `--at` names and its partitions, or,
point in time (docs/design.md "Point-in-time restore"), what a time (`--at-time`,
`repo:DIR@TIME`), per-partition seqs (`--at-seq`) or a failover (`--before-failover`)
resolves to: a backup and a seq clip per partition (`repo.pitr`). Every command that
reads a state takes its `at` through `select`, so they all resolve alike.

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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from upr_cli.collections import CollectionsManifest
from upr_cli.errors import UsageError
from upr_cli.repo import (
    BackupId,
    BrokenChain,
    Manifest,
    PlanStep,
    Repository,
    RepositoryError,
    SegmentEntry,
    plan_state,
)
from upr_cli.repo.manifest import chain_manifest
from upr_cli.repo.pitr import (
    AtFailover,
    AtSeqs,
    PitrRangeError,
    Resolution,
    looks_like_time,
    parse_time,
    resolve_failover,
    resolve_seqs,
    resolve_time,
)
from upr_cli.segments import SegmentError, SegmentReader
from upr_cli.source import backup_named
from upr_cli.storage import Storage, is_s3

#: what `select` takes: a backup (id, prefix, latest, oldest) or a time as text, seqs
#: per partition, or a failover
At = str | AtSeqs | AtFailover


@dataclass(frozen=True, slots=True)
class Selection:
    """Which backup and which partitions to read; with `point`, each partition's own
    backup and seq clip (`backup_id` is then the newest of them: the chain's end)."""

    backup_id: BackupId
    partitions: tuple[int, ...]
    point: Resolution | None = field(default=None, compare=False)

    def steps(self, manifests: Sequence[Manifest], partition: int) -> list[PlanStep]:
        """The plan of `partition`'s selected state (`chain.plan_state`)."""
        if self.point is not None and partition in self.point.picks:
            return self.point.picks[partition].steps(manifests, partition)
        return plan_state(manifests, at=self.backup_id, partition=partition)

    def collections(self, chain: Sequence[Manifest]) -> CollectionsManifest:
        """The collections of the selected state: at the chain's end, or, at a point in
        time, with only the changes the partitions' states there hold."""
        if self.point is None:
            return chain_manifest(chain)
        cut = {p: (k.backup_id, k.clip) for p, k in self.point.picks.items()}
        return chain_manifest(chain, cut)

    def keeping(self, partitions: Sequence[int]) -> Selection:
        """The same selection, of `partitions` only."""
        return Selection(self.backup_id, tuple(partitions), self.point)


def select(
    manifests: Sequence[Manifest], at: At = "latest", partitions: Sequence[int] | None = None,
    *, bucket: str = "", repo: Repository | None = None, option: str = "--at-time",
) -> Selection:  # fmt: skip
    """Resolve `at` (a backup id or a unique prefix of one, latest, oldest; a time; seqs;
    a failover) and the partitions to read. With `repo`, `--at-seq` rounds to the
    snapshot markers of the newest backup's segment headers too; `option` names a time
    in messages (`--at-time`, or `@` in `repo:DIR@TIME`)."""
    if not manifests:
        raise UsageError("the repository holds no committed backup of this bucket")
    if not isinstance(at, str) or looks_like_time(at):
        return _select_point(manifests, at, partitions, bucket, repo, option)
    bid = backup_named([m.backup_id for m in manifests], at)
    if bid is None:
        raise UsageError(f"--at: no committed backup {at!r} (see `upr info`)")
    held = sorted({e.partition for m in manifests if m.backup_id <= bid for e in m.partitions})
    if partitions is not None:
        held = [p for p in held if p in set(partitions)]
    return Selection(bid, tuple(held))


def _select_point(
    manifests: Sequence[Manifest], at: At, partitions: Sequence[int] | None, bucket: str,
    repo: Repository | None, option: str,
) -> Selection:  # fmt: skip
    if isinstance(at, AtSeqs):
        res = resolve_seqs(manifests, dict(at.seqs), _snapshots(repo, bucket))
        if partitions is not None:
            res.picks = {p: k for p, k in res.picks.items() if p in set(partitions)}
    elif isinstance(at, AtFailover):
        res = resolve_failover(manifests, at.number, partitions)
    else:
        res = resolve_time(manifests, parse_time(at, option=option), partitions,
                           bucket=bucket, option=option)  # fmt: skip
    if not res.picks:
        raise PitrRangeError(f"nothing to read at {res.how} {res.asked}: no selected partition "
                             "had a restore point by then")  # fmt: skip
    return Selection(res.newest, tuple(sorted(res.picks)), res)


def _snapshots(
    repo: Repository | None, bucket: str
) -> Callable[[BackupId, SegmentEntry], tuple[tuple[int, int], ...]] | None:
    """The snapshot markers a segment's header lists (none when it cannot be read:
    `verify` names the damage; the backups' ends still count)."""
    if repo is None:
        return None

    def snapshots_of(bid: BackupId, seg: SegmentEntry) -> tuple[tuple[int, int], ...]:
        try:
            with SegmentReader(repo.segment_path(bucket, bid, seg.file), repo.storage) as r:
                return r.header.snapshots
        except (SegmentError, OSError):
            return ()

    return snapshots_of


def check_files(
    repo: Repository, bucket: str, manifests: Sequence[Manifest], selection: Selection
) -> None:
    """Every segment file the selected state reads exists with the size its manifest
    records; otherwise `BrokenChain` naming the first one (no file is read: block
    checksums are verified as the records are read)."""
    if selection.point is None:
        bad = repo.missing_files(bucket, manifests, selection.backup_id, selection.partitions)
    else:  # each partition at its own backup (its state there reads every file it reads)
        by: dict[BackupId, list[int]] = {}
        for p in selection.partitions:
            by.setdefault(selection.point.picks[p].backup_id, []).append(p)
        bad = [line for j, ps in sorted(by.items())
               for line in repo.missing_files(bucket, manifests, j, ps)]  # fmt: skip
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
            for step in selection.steps(manifests, p)]  # fmt: skip

    def check(item: tuple[int, PlanStep]) -> tuple[int, str | None, Precheck]:
        p, step = item
        path = repo.segment_path(bucket, step.backup_id, step.name)
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
