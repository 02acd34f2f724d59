"""`upr info` and `upr verify`: what a repository holds, and whether all of it is sound.

`verify` reads everything (formats/segment.md: every block, footer and trailer check;
the BLAKE2b digest against the manifest; record counts and seq ranges against the
manifest) and the chain (formats/repository.md: each partition's seqs covered without
gaps, parents in order). Every problem is named; none stops the walk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upr_cli.errors import UsageError
from upr_cli.repo import (
    Manifest,
    Repository,
    RepositoryError,
    broken_parents,
    coverage_gaps,
    lost_ranges,
)
from upr_cli.segments import SegmentError, SegmentReader


@dataclass
class Problem:
    """One thing wrong, with where it is."""

    kind: str  # missing | truncated | checksum | corrupt | mismatch | gap | manifest | chain
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.where}: {self.detail}"


@dataclass
class VerifyReport:
    """What `upr verify` found."""

    bucket: str
    backups: int = 0
    segments: int = 0
    records: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "bucket": self.bucket,
            "backups": self.backups,
            "segments": self.segments,
            "records": self.records,
            "bytes": str(self.bytes),
            "ok": not self.problems,
            "problems": [
                {"kind": p.kind, "where": p.where, "detail": p.detail} for p in self.problems
            ],
        }


def _buckets(repo: Repository, bucket: str | None) -> list[str]:
    names = repo.buckets()
    if bucket is not None:
        if bucket not in names:
            raise UsageError(f"{repo.path}: no backups of bucket {bucket!r}")
        return [bucket]
    return names


def open_repo(path: Path) -> Repository:
    """An existing repository (its repo.json is checked); a missing one is a usage error."""
    if not (path / "repo.json").exists():
        raise UsageError(f"{path}: not a upr repository (no repo.json)")
    repo = Repository(path)
    repo.info()
    return repo


def open_bucket(path: Path, bucket: str | None) -> tuple[Repository, str, list[Manifest]]:
    """The repository, the bucket (given, or the only one it holds) and its committed
    manifests, oldest first; an ambiguous or missing bucket is a usage error."""
    repo = open_repo(path)
    names = repo.buckets()
    b = bucket or (names[0] if len(names) == 1 else None)
    if b is None:
        raise UsageError(f"{path}: holds buckets {', '.join(names) or 'none'}; give --bucket")
    return repo, b, list(repo.manifests(b))


def verify(path: Path, bucket: str | None = None) -> list[VerifyReport]:
    """Check every committed backup of every (or one) bucket; problems are collected."""
    repo = open_repo(path)
    reports = []
    for b in _buckets(repo, bucket):
        rep = VerifyReport(b)
        reports.append(rep)
        for bid, reason in repo.damaged(b):
            rep.problems.append(Problem("manifest", f"{b}/{bid}", reason))
        damaged = {bid for bid, _ in repo.damaged(b)}
        manifests = [repo.read_manifest(b, bid) for bid in repo.committed(b) if bid not in damaged]
        rep.backups = len(manifests)
        for mm in broken_parents(manifests):
            rep.problems.append(
                Problem(
                    "chain", f"{b}/{mm.backup_id}", f"parent {mm.recorded}, expected {mm.expected}"
                )
            )
        for m in manifests:
            for e in m.partitions:
                for seg in e.segments:
                    rep.segments += 1
                    _check_segment(repo, b, m.backup_id, e.partition, seg, rep)
                for name, seg in e.cut_files():  # lost writes kept from a mid-run rollback
                    rep.segments += 1
                    _check_segment(repo, b, m.backup_id, e.partition, seg, rep, name)
        for p in sorted({e.partition for m in manifests for e in m.partitions}):
            for gap in coverage_gaps(manifests, p):
                rep.problems.append(
                    Problem(
                        "gap",
                        f"{b}/{gap.backup_id} partition {p}",
                        f"seqs ({gap.from_seq}, {gap.to_seq}] are in no backup",
                    )
                )
    return reports


def _check_segment(
    repo: Repository,
    bucket: str,
    bid: Any,
    partition: int,
    seg: Any,
    rep: VerifyReport,
    name: str | None = None,
) -> None:
    name = name or seg.file
    path = repo.segment_path(bucket, bid, name)
    where = f"{bucket}/{bid}/{name}"
    if not path.exists():
        rep.problems.append(Problem("missing", where, "segment file is missing"))
        return
    size = path.stat().st_size
    if size != seg.bytes:
        kind = "truncated" if size < seg.bytes else "mismatch"
        rep.problems.append(Problem(kind, where, f"{size} bytes, the manifest says {seg.bytes}"))
        return
    try:
        with SegmentReader(path) as r:
            info = r.verify()
    except SegmentError as exc:
        kind = "checksum" if "checksum" in exc.reason else "corrupt"
        block = f" block {exc.block}" if exc.block is not None else ""
        rep.problems.append(Problem(kind, where + block, exc.reason))
        return
    if info.checksum != seg.checksum:
        rep.problems.append(Problem("checksum", where, "file digest differs from the manifest"))
    if (info.records, info.first_seq, info.last_seq) != (seg.records, seg.first_seq, seg.last_seq):
        rep.problems.append(
            Problem("mismatch", where, "records or seq range differ from the manifest")
        )
    if info.partition != partition:
        rep.problems.append(Problem("mismatch", where, f"holds partition {info.partition}"))
    rep.records += info.records
    rep.bytes += info.bytes


def info(
    path: Path, bucket: str | None = None, partitions: list[int] | None = None
) -> dict[str, Any]:
    """Backups per bucket with items, bytes, ratio, rollbacks; the chain; per-partition ranges."""
    repo = open_repo(path)
    out: dict[str, Any] = {"repository": str(path), "buckets": {}}
    for b in _buckets(repo, bucket):
        try:
            manifests = repo.manifests(b)
        except RepositoryError as exc:
            raise UsageError(f"{exc} (run `upr verify` for every problem)") from None
        backups = []
        for m in manifests:
            t = m.totals
            backups.append(
                {
                    "backup_id": str(m.backup_id),
                    "full": m.full,
                    "parent": None if m.parent is None else str(m.parent),
                    "started": m.started.isoformat(),
                    "items": t.items,
                    "bytes_read": str(t.bytes_read),
                    "bytes_written": str(t.bytes_written),
                    "ratio": round(t.bytes_read / t.bytes_written, 2) if t.bytes_written else None,
                    "rollbacks": t.rollbacks,
                    "partitions": len(m.partitions),
                }
            )
        entry: dict[str, Any] = {
            "backups": backups,
            "incomplete": [str(x) for x in repo.incomplete(b)],
        }
        if partitions is not None:
            ranges: dict[str, Any] = {}
            for p in partitions:
                ranges[str(p)] = [
                    {
                        "backup_id": str(m.backup_id),
                        "start": str(e.start_seq),
                        "end": str(e.end_seq),
                        "uuid": str(e.uuid),
                        "records": sum(s.records for s in e.segments),
                        "rollback": None
                        if e.rollback is None
                        else {"from": str(e.rollback.from_seq), "to": str(e.rollback.to_seq)},
                    }
                    for m in manifests
                    if (e := m.partition(p)) is not None
                ]
                lost = lost_ranges(manifests, p)
                if lost:
                    ranges[str(p)].append(
                        {
                            "lost": [
                                {
                                    "backup_id": str(x.backup_id),
                                    "from": str(x.from_seq),
                                    "to": str(x.to_seq),
                                }
                                for x in lost
                            ]
                        }
                    )
            entry["partitions"] = ranges
        out["buckets"][b] = entry
    return out
