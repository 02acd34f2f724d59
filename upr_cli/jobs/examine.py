"""`upr examine`: every version of one key across a repository's chain.

The key's partition follows the SDKs' hashing over the bucket's partition count, read from
the repository's manifests (`partition_count`); when the backups only bound the count
from below, every partition the key could hash to is searched. `--partitions` selects
partitions, as in every command: a selection that leaves out the key's partition is
refused, naming it, rather than answered with a silent "no version". Each version found
in a segment is listed with its backup, seq, op, cas and rev seq, and whether it is a
lost write: above the cut a later backup's rollback made (formats/repository.md §8,
chain semantics), so absent from the latest state, or taken back by a rollback in the
middle of its backup (a cut-back segment, formats/repository.md §5.6).

A key is looked up in one collection, by name (`_default._default` unless told, or
unless the key reads `scope.collection:key`, as `upr tail` prints one, and the chain
has that collection: `qualified_key`): every
collection id the chain gave that name (a collection dropped and created again has a
new id, formats/repository.md §5.9), each version saying which id it is in and whether
that collection was dropped since. The partition is the key's alone: the SDKs hash the
document key, not its collection. Repositories written before collections hold only
`_default._default`.

Each version carries its time: the time of the restore point that first holds it (in a
continuous commit, the first point of its partition at or above its seq; else its
backup's `finished`: docs/design.md "Point-in-time restore"). The CAS is shown beside
it, never used to place it (writes made with SET_WITH_META keep their source's CAS).
With `at_time`, the version a restore at that time gives is marked (`at_time`): the last
version of the key among the records of the partition's state there
(`jobs.state.select`, as `restore --at-time` resolves it), deletions included.

Each version carries the xattrs its record holds (formats/segment.md, version 3; none
in older segments), a tombstone the system xattrs it kept: their names in the table,
the whole object in `--json`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from upr_cli.collections import DEFAULT
from upr_cli.collections import Path as CollectionPath
from upr_cli.errors import UsageError
from upr_cli.net.bootstrap import partition_of
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_EXPIRATION, OP_MUTATION
from upr_cli.protocol.header import DATATYPE_JSON
from upr_cli.repo import Manifest, PartitionEntry, PlanStep, lost_cut
from upr_cli.repo.manifest import collection_history
from upr_cli.repo.pitr import show_time
from upr_cli.segments import SegmentReader
from upr_cli.source import MAX_PARTITIONS, open_bucket
from upr_cli.storage import Storage

OPS = {OP_MUTATION: "mutation", OP_DELETION: "deletion", OP_EXPIRATION: "expiration"}


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
    collection: int = 0  # the collection id
    dropped: bool = False  # that collection was dropped since (its records are no state)
    xattrs: bytes = b""  # the xattr blob (formats/wire.md "Xattrs"), b"" for none
    time: datetime | None = None  # the time of the restore point that first holds it
    at_time: bool = False  # the version a restore at `--at-time` gives

    @property
    def xattr_names(self) -> list[str]:
        """The names of the version's xattrs, in stored order."""
        return [name for name, _ in xattrs.pairs(self.xattrs)]

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md: seq, cas and rev seq as decimal strings; the value
        as JSON when its datatype says so, else text; `xattrs` an object, {} for none, as
        `value` is always there)."""
        val: Any = None
        if self.op == "mutation":
            try:
                val = (
                    json.loads(self.value) if self.datatype & DATATYPE_JSON else self.value.decode()
                )
            except (ValueError, UnicodeDecodeError):
                val = self.value.hex()
        return {
            "backup_id": self.backup_id,
            "partition": self.partition,
            "seq": str(self.seq),
            "op": self.op,
            "cas": str(self.cas),
            "rev_seq": str(self.rev_seq),
            "flags": self.flags,
            "expiry": self.expiry,
            "lost": self.lost,
            "in_latest": self.in_latest,
            "collection_id": self.collection,
            "dropped": self.dropped,
            "value": val,
            "xattrs": xattrs.to_json(self.xattrs),
            "time": None if self.time is None else show_time(self.time),
            "at_time": self.at_time,
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


def key_partitions(
    key: bytes, manifests: Sequence[Manifest], selection: Sequence[int] | None, where: str
) -> list[int]:
    """The partitions that can hold `key`: its partition under the bucket's count, or,
    when the backups only bound the count from below, each one it hashes to under a
    count the backups allow. A `selection` that leaves them all out, or names a partition
    the bucket lacks, raises UsageError naming the key's partition."""
    known, exact = partition_count(manifests)
    held = {e.partition for m in manifests for e in m.partitions}
    if exact:
        candidates = {partition_of(key, known)}
    else:
        counts = range(known, MAX_PARTITIONS + 1)
        candidates = {partition_of(key, n) for n in counts} & held or {partition_of(key, known)}
    if selection is None:
        return sorted(candidates)
    has = f"{known} partitions" if exact else f"partitions up to {known - 1} at least"
    lacking = [p for p in selection if exact and p >= known]
    if lacking:
        raise UsageError(f"--partitions: {where} has {has}; {lacking[0]} is not one of them")
    chosen = sorted(candidates & set(selection))
    if not chosen:
        which = ", ".join(map(str, sorted(candidates)))
        raise UsageError(
            f"--partitions: the key {key.decode(errors='replace')!r} is in partition {which} "
            f"of {where} ({has}), which the selection leaves out"
        )
    return chosen


def examine(
    repo_dir: Path,
    key: bytes,
    *,
    bucket: str | None = None,
    partitions: Sequence[int] | None = None,
    collection: CollectionPath | None = None,
    at_time: str | None = None,
) -> list[Version]:
    """Every version of `key` in `collection` (default `_default._default`), oldest
    first, each with its time. `partitions` selects partitions (default: the key's, from
    the bucket's partition count: `key_partitions`); with `at_time`, the version a
    restore at that time gives is marked (module doc)."""
    path = collection or CollectionPath(DEFAULT, DEFAULT)
    return examine_key(repo_dir, key, bucket=bucket, partitions=partitions, collection=path,
                       at_time=at_time)[2]  # fmt: skip


def qualified_key(manifests: Sequence[Manifest], key: bytes) -> tuple[CollectionPath, bytes]:
    """The collection and key of `key` as `upr tail` prints one outside the default
    collection, `scope.collection:key`, when the chain has that collection; else
    `_default._default` and the key as given (a key may hold a colon)."""
    head, colon, rest = key.partition(b":")
    if colon and rest and b"." in head:
        try:
            path = CollectionPath.parse(head.decode(), need_collection=True)
        except (UsageError, UnicodeDecodeError):
            path = None
        if path is not None and path in {p for p, _d in collection_history(manifests).values()}:
            return path, rest
    return CollectionPath(DEFAULT, DEFAULT), key


def examine_key(
    repo_dir: Path,
    key: bytes,
    *,
    bucket: str | None = None,
    partitions: Sequence[int] | None = None,
    collection: CollectionPath | None = None,
    at_time: str | None = None,
) -> tuple[CollectionPath, bytes, list[Version]]:
    """`examine`, with the collection and key it read: without `collection`, a key given
    as `scope.collection:key` is read in that collection when the chain has it
    (`qualified_key`), else in `_default._default`."""
    from upr_cli.jobs.state import select

    with contextlib.ExitStack() as held:
        repo, b, manifests = open_bucket(repo_dir, bucket, held=held, command="examine")
        if not manifests:
            raise UsageError(f"{repo_dir}: no committed backup of bucket {b!r}")
        where = f"bucket {b!r} in {repo_dir}"
        if collection is None:
            collection, key = qualified_key(manifests, key)
        ids = collection_ids(manifests, collection, where)
        latest = manifests[-1].backup_id
        out: list[Version] = []
        for p in key_partitions(key, manifests, partitions, where):
            for m in manifests:
                entry = m.partition(p)
                if entry is None:
                    continue
                c = lost_cut(manifests, p, m.backup_id, latest)
                # its segments, then the records mid-run rollbacks took back (lost: seq above 0)
                files = [(seg.file, c) for seg in entry.segments]
                files += [(name, 0) for name, _seg in entry.cut_files()]
                for name, cut in files:
                    path = repo.segment_path(b, m.backup_id, name)
                    found = _versions(repo.storage, path, key, str(m.backup_id), p, cut, ids)
                    out += [replace(v, time=_time_of(m, entry, v.seq)) for v in found]
        kept = [v for v in out if not v.lost and not v.dropped]
        if kept:
            newest = max(kept, key=lambda v: v.seq)
            out = [replace(v, in_latest=v is newest) for v in out]
        if at_time is not None:  # resolved (and checked) even when no version was found
            sel = select(manifests, at_time, bucket=b)
            plans = {p: sel.steps(manifests, p) for p in sel.partitions}
            chosen = [v for v in out if _in_plan(plans.get(v.partition, []), v)]
            out = [replace(v, at_time=bool(chosen) and v is chosen[-1]) for v in out]
        return collection, key, out


def _time_of(m: Manifest, entry: PartitionEntry, seq: int) -> datetime:
    """The time of the restore point that first holds `seq` in backup `m`."""
    if m.continuous is not None:
        for s, t in entry.points:
            if s >= seq:
                return t
    return m.finished


def _in_plan(steps: Sequence[PlanStep], v: Version) -> bool:
    """True when the plan of a state reads the version `v`."""
    return any(str(s.backup_id) == v.backup_id and not s.file
               and s.segment.first_seq <= v.seq <= min(s.segment.last_seq, s.max_seq)
               for s in steps)  # fmt: skip


def collection_ids(
    manifests: Sequence[Manifest], path: CollectionPath, where: str
) -> dict[int, bool]:
    """Every id the chain gave the collection `path` names, with whether it was dropped
    since; a name the chain never saw is a UsageError naming what it holds."""
    if path.collection is None:
        raise UsageError(f"--collection {path}: give SCOPE.COLLECTION")
    history = collection_history(manifests)
    ids = {cid: dropped for cid, (p, dropped) in history.items() if p == path}
    if not ids:
        known = ", ".join(sorted({str(p) for p, _d in history.values()}))
        raise UsageError(f"--collection {path}: no such collection in {where} (it has {known})")
    return ids


def _versions(storage: Storage, path: Path, key: bytes, backup_id: str, p: int, cut: int,
              ids: dict[int, bool]) -> list[Version]:  # fmt: skip
    """The versions of `key` in the collections `ids` in one segment file (lost: above
    `cut`), read through the repository's `storage`."""
    out = []
    with SegmentReader(path, storage) as reader:
        for r in reader.records():
            if r.key == key and r.collection in ids:
                out.append(Version(backup_id, p, r.seq, OPS[r.op], r.cas, r.rev_seq, r.flags,
                                   r.expiry, r.value, r.datatype, r.seq > cut, False,
                                   r.collection, ids[r.collection], r.xattrs))  # fmt: skip
    return out
