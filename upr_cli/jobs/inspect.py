"""`upr info` and `upr verify`: what a repository holds, and whether all of it is sound.

`verify` reads everything (formats/segment.md: every block, footer and trailer check;
the BLAKE2b digest against the manifest; record counts and seq ranges against the
manifest), both files of every manifest, each against its own checksum (a damaged or
missing copy is named even while the other file keeps the data readable), and the chain
(formats/repository.md: each partition's seqs covered without gaps, parents present and
in order). Every problem is named; none stops the walk. A record whose xattrs hold a
value that is not JSON is a warning, not a problem (formats/wire.md "Xattrs": a node
refuses to write it, a SQLite restore keeps it). With `repair`, under the
bucket's lock, a missing or damaged manifest file is rewritten from its valid twin
(borg's `check --repair`, pgBackRest's `.copy`); nothing else is changed.

`info` also lists every collection the chain saw, by name (the chain's final names,
formats/repository.md §5.9), with its data records: mutations as `items`, deletions
and expirations as `deleted`, over the chain's backups; a collection dropped since, or
left out by a filtered backup, says so. Backups written before collections count as
the default collection's, from their segments.

Each backup's row says when it committed (`finished`, UTC), its `type` (`full`,
`incremental`, or `merged`: a backup `upr spark merge` wrote, which stands in for the
ones it merges), its parent, and its `bytes_on_disk`: the sizes of the files in its
directory as the repository's storage stats them (segments, cut-back segments and
both manifest files), one listing per backup. Each bucket and the repository (every
bucket, whatever `--bucket` selects, and repo.json) have their total on disk too.

`source.open_bucket` is how every reader gets its manifests: the chain it reads is checked
whole first (`Repository.chain`, formats/repository.md §8.8). It is also importable from
here until every reader imports it from `upr_cli.source`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

from upr_cli.errors import UsageError
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.repo import (
    MANIFEST_COPY,
    MANIFEST_FILE,
    Repository,
    RepositoryError,
    RepositoryLock,
    altered_twin,
    broken_parents,
    coverage_gaps,
    lost_ranges,
)
from upr_cli.repo.manifest import UNNAMED_SCOPE, Manifest, collection_history
from upr_cli.repo.names import format_time
from upr_cli.repo.readers import read_lock
from upr_cli.segments import Record, SegmentError, SegmentInfo, SegmentReader
from upr_cli.source import open_bucket, open_repo
from upr_cli.storage import Storage, unwrap

__all__ = ["Problem", "VerifyReport", "info", "open_bucket", "open_repo", "verify"]


@dataclass
class Problem:
    """One thing wrong, with where it is."""

    kind: str  # missing | truncated | checksum | corrupt | mismatch | gap | manifest | chain
    where: str
    detail: str
    repaired: bool = False  # `verify --repair` fixed it

    def __str__(self) -> str:
        done = "repaired: " if self.repaired else ""
        return f"{done}{self.kind}: {self.where}: {self.detail}"


@dataclass
class VerifyReport:
    """What `upr verify` found."""

    bucket: str
    backups: int = 0
    segments: int = 0
    records: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)  # sound, but worth knowing
    # interrupted runs no resume can use (not damage: the next backup removes them)
    leftovers: list[str] = field(default_factory=list)
    resumable: str | None = None  # the interrupted run the next backup goes on from

    @property
    def unrepaired(self) -> list[Problem]:
        """The problems still there (all of them without --repair)."""
        return [p for p in self.problems if not p.repaired]

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md): `ok` when no problem is left (a repaired one is
        still listed); `items` the records read."""
        return {
            "bucket": self.bucket,
            "backup_count": self.backups,  # `backups` is info's list of them
            "segments": self.segments,
            "items": self.records,
            "bytes": self.bytes,
            "ok": not self.unrepaired,
            "resumable": self.resumable,
            "leftovers": self.leftovers,
            "problems": [
                {"kind": p.kind, "where": p.where, "detail": p.detail, "repaired": p.repaired}
                for p in self.problems
            ],
            "warnings": [
                {"kind": w.kind, "where": w.where, "detail": w.detail} for w in self.warnings
            ],
        }


def _buckets(repo: Repository, bucket: str | None) -> list[str]:
    names = repo.buckets()
    if bucket is not None:
        if bucket not in names:
            raise UsageError(f"{repo.path}: no backups of bucket {bucket!r}")
        return [bucket]
    return names


#: `verify`'s progress: (segments checked, segments in all, records read, bytes read)
VerifyProgress = Callable[[int, int, int, int], None]


def verify(
    path: Path,
    bucket: str | None = None,
    *,
    repair: bool = False,
    on_progress: VerifyProgress | None = None,
) -> list[VerifyReport]:
    """Check every committed backup of every (or one) bucket; problems are collected,
    and so are the interrupted runs no resume can use (`VerifyReport.leftovers`).

    With `repair`, each bucket's lock is taken and a missing or damaged manifest file is
    rewritten from its valid twin; those problems are marked repaired. `on_progress` is
    told after each segment how many are checked, of how many, and the records and
    bytes (of segment files, as the summary counts them) read."""
    repo = open_repo(path)
    reports = []
    names = _buckets(repo, bucket)
    total = sum(
        len(e.segments) + len(e.cut_files())
        for b in names
        for m in repo.readable(b)[0]
        for e in m.partitions
    )
    done = [0, 0, 0]  # segments checked, records and bytes read (before this bucket's report)

    def tick(rep: VerifyReport) -> None:
        if on_progress is not None:
            on_progress(done[0] + rep.segments, total, done[1] + rep.records,
                        done[2] + rep.bytes)  # fmt: skip

    for b in names:
        with read_lock(repo, b, "verify"):
            rep = VerifyReport(b)
            reports.append(rep)
            if repair:
                with RepositoryLock(repo, b) as lock:
                    _check_manifests(repo, b, rep, lock)
            else:
                _check_manifests(repo, b, rep, None)
            manifests, damaged = repo.readable(b)
            rep.backups = len(manifests)
            resumable = repo.resumable(b)
            rep.resumable = None if resumable is None else str(resumable)
            rep.leftovers = [str(x) for x in repo.leftovers(b)]
            for mm in broken_parents(manifests):
                rep.problems.append(
                    Problem(
                        "chain",
                        f"{b}/{mm.backup_id}",
                        repo.describe_parent(b, mm.backup_id, mm.recorded, mm.expected, damaged),
                    )
                )
            named = collection_history(manifests)
            for m in manifests:
                counts: dict[int, list[int]] = {}
                for e in m.partitions:
                    for seg in e.segments:
                        rep.segments += 1
                        got = _check_segment(repo, b, m.backup_id, e.partition, seg, rep)
                        for cid, items, deleted in got.counts if got is not None else ():
                            t = counts.setdefault(cid, [0, 0])
                            t[0], t[1] = t[0] + items, t[1] + deleted
                        tick(rep)
                    for name, seg in e.cut_files():  # lost writes kept from a mid-run rollback
                        rep.segments += 1
                        _check_segment(repo, b, m.backup_id, e.partition, seg, rep, name)
                        tick(rep)
                _check_collections(f"{b}/{m.backup_id}", m, counts, named, rep)
            for p in sorted({e.partition for m in manifests for e in m.partitions}):
                for gap in coverage_gaps(manifests, p):
                    rep.problems.append(
                        Problem(
                            "gap",
                            f"{b}/{gap.backup_id} partition {p}",
                            f"seqs ({gap.from_seq}, {gap.to_seq}] are in no backup",
                        )
                    )
            done[0] += rep.segments
            done[1] += rep.records
            done[2] += rep.bytes
    return reports


def _check_manifests(
    repo: Repository, b: str, rep: VerifyReport, lock: RepositoryLock | None
) -> None:
    """Both manifest files of every committed backup, each on its own; with the lock,
    the bad one of a pair is rewritten from the good one. A bad file is named by its
    directory (a revision's is `<id>-rNNNNNNNN`, formats/repository.md §4.6)."""
    for bid in repo.committed(b):
        main, copy = repo.manifest_files(b, bid)
        if not main.valid and not copy.valid:
            why = f"{MANIFEST_FILE}: {main.error}; {MANIFEST_COPY}: {copy.error}"
            rep.problems.append(Problem("manifest", f"{b}/{bid}", f"damaged: {why}"))
            continue
        pair = altered_twin(main, copy)
        if pair is not None:
            bad, good = pair
            fixed = lock is not None and bad.path in repo.repair_manifest(b, bid, lock)
            rep.problems.append(Problem(
                "manifest", f"{b}/{bad.path.parent.name}/{bad.path.name}",
                f"altered outside its checksum (its twin {good.path.name} is as written"
                + ("; rewritten from it)" if fixed else "; `upr verify --repair` rewrites it)"),
                repaired=fixed,
            ))  # fmt: skip
            continue
        if main.valid and copy.valid:
            if main.data != copy.data:
                why = f"{MANIFEST_FILE} and {MANIFEST_COPY} are both valid but differ"
                rep.problems.append(
                    Problem("manifest", f"{b}/{bid}", f"{why} (not repaired: which is right?)")
                )
            continue
        bad, good = (copy, main) if main.valid else (main, copy)
        fixed = lock is not None and bad.path in repo.repair_manifest(b, bid, lock)
        rep.problems.append(
            Problem(
                "manifest",
                f"{b}/{bad.path.parent.name}/{bad.path.name}",
                f"{bad.error} (its twin {good.path.name} is valid"
                + ("; rewritten from it)" if fixed else "; `upr verify --repair` rewrites it)"),
                repaired=fixed,
            )
        )


def _check_collections(
    where: str,
    m: Manifest,
    counts: dict[int, list[int]],
    named: dict[int, Any],
    rep: VerifyReport,
) -> None:
    """A backup's records per collection agree with its manifest (`collection_items`,
    formats/repository.md §5.9), and every collection id its segments hold is one the
    chain names (a record of an id no manifest or system event names cannot be restored
    by name)."""
    if m.collections is not None or m.collection_items:  # a backup that counted them
        recorded = {c.id: [c.items, c.deleted] for c in m.collection_items}
        if recorded != counts:
            rep.problems.append(Problem(
                "mismatch", where,
                "records per collection differ from the manifest's collection_items",
            ))  # fmt: skip
    unknown = sorted(cid for cid in counts if cid and (cid not in named or named[cid][0].scope
                                                       == UNNAMED_SCOPE))  # fmt: skip
    if unknown:
        ids = ", ".join(f"0x{cid:x}" for cid in unknown[:8])
        rep.problems.append(
            Problem("collection", where, f"records of collection ids no manifest names: {ids}")
        )


def _check_segment(
    repo: Repository,
    bucket: str,
    bid: Any,
    partition: int,
    seg: Any,
    rep: VerifyReport,
    name: str | None = None,
) -> SegmentInfo | None:
    """Check one segment file against its manifest entry; its info when readable."""
    name = name or seg.file
    path = repo.segment_path(bucket, bid, name)
    where = f"{bucket}/{bid}/{name}"
    try:
        st = repo.storage.stat(path, follow_links=True)
    except SegmentError as exc:  # its backup's pack is damaged (formats/repository.md §12)
        rep.problems.append(Problem("corrupt", where, str(exc)))
        return None
    if st is None:
        rep.problems.append(Problem("missing", where, "segment file is missing"))
        return None
    size = st.size
    if size != seg.bytes:
        kind = "truncated" if size < seg.bytes else "mismatch"
        rep.problems.append(Problem(kind, where, f"{size} bytes, the manifest says {seg.bytes}"))
        return None
    odd: list[str] = []  # keys whose xattrs hold a value that is not JSON
    try:
        with SegmentReader(path, repo.storage) as r:
            info = r.verify(functools.partial(_not_json_xattrs, odd=odd))
    except SegmentError as exc:
        kind = "checksum" if "checksum" in exc.reason else "corrupt"
        block = f" block {exc.block}" if exc.block is not None else ""
        rep.problems.append(Problem(kind, where + block, exc.reason))
        return None
    if info.checksum != seg.checksum:
        rep.problems.append(Problem("checksum", where, "file digest differs from the manifest"))
    if (info.records, info.first_seq, info.last_seq) != (seg.records, seg.first_seq, seg.last_seq):
        rep.problems.append(
            Problem("mismatch", where, "records or seq range differ from the manifest")
        )
    if info.partition != partition:
        rep.problems.append(Problem("mismatch", where, f"holds partition {info.partition}"))
    if odd:
        shown = ", ".join(odd[:8]) + (f" and {len(odd) - 8} more" if len(odd) > 8 else "")
        rep.warnings.append(Problem("xattrs", where, (
            f"{len(odd):,} record{'s' if len(odd) > 1 else ''} with an xattr value that is not "
            f"JSON (a node refuses to write it; a SQLite restore keeps it): {shown}")))  # fmt: skip
    rep.records += info.records
    rep.bytes += info.bytes
    return info


def _not_json_xattrs(records: list[Record], odd: list[str]) -> None:
    """Add to `odd` each record of a block whose xattrs hold a value that is not JSON,
    as `'key' (name, …)`."""
    if not any(map(_XATTRS, records)):  # most blocks: no xattr at all
        return
    for r in records:
        if r.xattrs and (names := xattrs.not_json(r.xattrs, r.key)):
            key = r.key.decode("utf-8", errors="backslashreplace")
            odd.append(f"{key!r} ({', '.join(names)})")


_XATTRS = attrgetter("xattrs")


def info(
    path: Path, bucket: str | None = None, partitions: list[int] | None = None
) -> dict[str, Any]:
    """Backups per bucket with their type, dates, parent, items, bytes (read, written,
    on disk), ratio and rollbacks; the chain; per-partition ranges; what the repository
    and each bucket take on disk; the restorable range, its coarse stretches and the
    numbered failovers (`restorable`)."""
    # No shared lock (formats/repository.md §7.2): info reads manifests only, each whole
    # (a rename publishes it), never a segment, so it never waits for a prune or a sweep.
    # Run while one removes backups, it can report one it removed as missing: run again.
    repo = open_repo(path)
    total = sum(tree_bytes(repo.storage, repo.bucket_dir(b)) for b in repo.buckets())
    st = repo.storage.stat(repo.repo_file, follow_links=True)
    total += st.size if st is not None else 0
    out: dict[str, Any] = {"repository": str(path), "bytes_on_disk": total, "buckets": []}
    for b in _buckets(repo, bucket):
        try:
            manifests = repo.chain(b)
        except RepositoryError as exc:
            hint = "" if "upr verify" in str(exc) else " (run `upr verify` for every problem)"
            raise UsageError(f"{exc}{hint}") from None
        backups = []
        for m in manifests:
            t = m.totals
            backups.append(
                {
                    "backup_id": str(m.backup_id),
                    "full": m.full,
                    "type": backup_type(m),
                    "parent": None if m.parent is None else str(m.parent),
                    "started": format_time(m.started),
                    "finished": format_time(m.finished),
                    "items": t.items,
                    "bytes_read": t.bytes_read,
                    "bytes_written": t.bytes_written,
                    "ratio": round(t.bytes_read / t.bytes_written, 2) if t.bytes_written else None,
                    "rollback_count": t.rollbacks,  # `rollbacks` elsewhere is their list
                    "partition_count": len(m.partitions),
                    "bytes_on_disk": tree_bytes(repo.storage, repo.backup_dir(b, m.backup_id)),
                    # a prune's revision (formats/repository.md §4.6): which, and the
                    # removed backups whose records it holds
                    "revision": m.revision,
                    "absorbed": [str(x) for x in m.absorbed],
                }
            )
        resumable = repo.resumable(b)
        entry: dict[str, Any] = {
            "bucket": b,
            "bytes_on_disk": tree_bytes(repo.storage, repo.bucket_dir(b)),
            "backups": backups,
            "incomplete": [str(x) for x in repo.incomplete(b)],
            "resumable": None if resumable is None else str(resumable),
            "leftovers": [str(x) for x in repo.leftovers(b)],
            "collections": collection_counts(repo, b, manifests),
            **restorable(manifests),
        }
        if partitions is not None:
            # one object a partition (docs/output.md: `partitions` is a list of objects
            # with `partition` wherever the answer is per partition)
            ranges: list[dict[str, Any]] = []
            for p in partitions:
                chain = [
                    {
                        "backup_id": str(m.backup_id),
                        "start": str(e.start_seq),
                        "end": str(e.end_seq),
                        "uuid": str(e.uuid),
                        "items": sum(s.records for s in e.segments),
                        "rollback": None
                        if e.rollback is None
                        else {"from": str(e.rollback.from_seq), "to": str(e.rollback.to_seq)},
                    }
                    for m in manifests
                    if (e := m.partition(p)) is not None
                ]
                lost = [
                    {"backup_id": str(x.backup_id), "from": str(x.from_seq), "to": str(x.to_seq)}
                    for x in lost_ranges(manifests, p)
                ]
                ranges.append({"partition": p, "chain": chain, "lost_ranges": lost})
            entry["partitions"] = ranges
        out["buckets"].append(entry)
    return out


def restorable(manifests: Sequence[Manifest]) -> dict[str, Any]:
    """The restorable range of a chain (`restorable`: oldest restore point, last commit,
    and the coarse stretches; None without backups) and its numbered failovers
    (docs/design.md "Point-in-time restore")."""
    from upr_cli.repo.pitr import failovers, timeline

    tl = timeline(manifests)
    return {"restorable": None if tl is None else tl.to_json(),
            "failovers": [f.to_json() for f in failovers(manifests)]}  # fmt: skip


def backup_type(m: Manifest) -> str:
    """`merged` for a backup `upr spark merge` wrote (through an older backup it has
    `merged_through`; through the newest, its source says so; a merge that absorbed
    backups lists them), else `full` or `incremental`."""
    if m.merged_through is not None or m.source.startswith("merge of"):
        return "merged"
    if getattr(m, "absorbed", ()):
        return "merged"
    return "full" if m.full else "incremental"


def tree_bytes(storage: Storage, path: Path) -> int:
    """The sizes of the regular files under the directory `path` (its subdirectories'
    too), as the backend under `storage` stats them (an encrypted repository's files as
    sealed, formats/repository.md §10): what it takes on disk, blocks aside. 0 when
    absent."""
    storage = unwrap(storage)
    total = 0
    for e in storage.list(path):
        if e.is_dir:
            total += tree_bytes(storage, path / e.name)
        elif e.is_file:
            st = storage.stat(path / e.name)
            total += st.size if st is not None else 0  # removed meanwhile: not there
    return total


def collection_counts(
    repo: Repository, bucket: str, manifests: list[Manifest]
) -> list[dict[str, Any]]:
    """Every collection the chain saw, with its data records over the chain's backups
    (`items` mutations, `deleted` deletions and expirations), in id order; `dropped`
    when it no longer exists at the chain's end, `backed_up` false when the newest
    backup's filter leaves it out."""
    totals: dict[int, list[int]] = {}
    for m in manifests:
        counts = m.collection_items if m.collection_items or not m.totals.items else None
        pairs = ((c.id, c.items, c.deleted) for c in counts) if counts is not None else (
            _segment_counts(repo, bucket, m))  # fmt: skip
        for cid, items, deleted in pairs:
            t = totals.setdefault(cid, [0, 0])
            t[0] += items
            t[1] += deleted
    newest = manifests[-1] if manifests else None
    out = []
    for cid, (path, dropped) in collection_history(manifests).items():
        items, deleted = totals.get(cid, (0, 0))
        coll = path.collection or "_default"
        out.append({
            "scope": path.scope, "collection": coll, "id": cid, "items": items,
            "deletions": deleted, "dropped": dropped,
            "backed_up": newest is None or newest.backed_up(path.scope, coll),
        })  # fmt: skip
    return out


def _segment_counts(repo: Repository, bucket: str, m: Manifest) -> list[tuple[int, int, int]]:
    """A backup written before collections: its records counted from its segments (all
    in collection 0)."""
    totals: dict[int, list[int]] = {}
    for e in m.partitions:
        for seg in e.segments:
            path = repo.segment_path(bucket, m.backup_id, seg.file)
            with SegmentReader(path, repo.storage) as r:
                for rec in r.records():
                    t = totals.setdefault(rec.collection, [0, 0])
                    t[rec.op != OP_MUTATION] += 1
    return [(cid, a, b) for cid, (a, b) in sorted(totals.items())]
