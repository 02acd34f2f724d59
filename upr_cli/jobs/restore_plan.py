"""The plan of a restore, made before anything is written: partition counts, and where
each collection of the backup goes on the target.

Partitions. A key's partition is `((crc32(key) >> 16) & 0x7fff) % count` over the
document key alone, never its collection prefix (docs/protocol.md §5.5 and "Collections":
the collection id travels in front of the key on the wire, and the SDKs pick the
partition from the key). A node or cluster target gets every key at its
hash over the TARGET's partition count, so a 1024-partition backup restores into a
64- or 128-partition bucket and clients find every key where they look. A SQLite store
has no partition count of its own: it keeps the source's partitions, so its positions
and failover logs (one per source partition) stay true and a replay can go on.

Collections are matched by NAME, never by id: ids are given by each bucket in the
order of its own history, so the same id names different collections on two buckets.
The names of the backup's collections are those at the end of its chain
(`repo.chain_manifest`); records of a collection dropped by then are not restored (an
id is never used again, so a record whose id is not live at the end is dropped data).
`--map-data SRC=DST` renames on the way: `a=b` sends every collection of scope `a` to
scope `b` under the same name, `a.x=b.y` one collection; a collection rule wins over
its scope's rule.

The plan is made in one step (`plan_restore`: the backup's manifest and the target's in,
a plan out); the collections it says to create are made by one call of the client
library (`create_collections`, with `RestorePlan.creations()`), and `resolve` reads
their ids from the manifest that call returns.

Each planned collection is `exists` (the target has it), `create` (it will be created:
a upr target, creation allowed, not yet done), `created`, or `missing` (it cannot be
created: `--no-create`, a target without collections, or a server that refuses); a
restore with a missing collection stops before writing and names them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from upr_cli.collections import DEFAULT, DEFAULT_ID, CollectionsManifest, Path
from upr_cli.errors import UprError, UsageError

EXISTS, CREATE, CREATED, MISSING = "exists", "create", "created", "missing"


class RestorePlanError(UprError):
    """The target cannot take the restore as planned (nothing was written)."""


@dataclass(frozen=True, slots=True)
class MapRule:
    """One `--map-data SRC=DST`: two scopes, or two collections."""

    source: Path
    target: Path

    def __str__(self) -> str:
        return f"{self.source}={self.target}"


def parse_map_data(texts: str | Iterable[str] | None) -> tuple[MapRule, ...]:
    """`SRC=DST` rules, repeated or comma-separated; a UsageError says what is wrong."""
    if texts is None:
        return ()
    items = [texts] if isinstance(texts, str) else list(texts)
    rules: dict[Path, MapRule] = {}
    for text in (t.strip() for item in items for t in item.split(",")):
        if not text:
            continue
        src, eq, dst = text.partition("=")
        if not eq or not src.strip() or not dst.strip():
            raise UsageError(f"--map-data {text!r}: give SRC=DST (SCOPE=SCOPE or S.C=S.C)")
        rule = MapRule(Path.parse(src), Path.parse(dst))
        if (rule.source.collection is None) != (rule.target.collection is None):
            raise UsageError(
                f"--map-data {text!r}: map a scope to a scope (a=b) or a collection to a "
                "collection (a.x=b.y)"
            )
        if rule.source in rules and rules[rule.source] != rule:
            raise UsageError(f"--map-data: {rule.source} is mapped twice")
        rules[rule.source] = rule
    return tuple(rules.values())


def map_path(source: Path, rules: Sequence[MapRule]) -> Path:
    """Where the collection `source` (scope.collection) goes under the rules."""
    for r in rules:
        if r.source == source:
            return r.target
    for r in rules:
        if r.source.collection is None and r.source.scope == source.scope:
            return Path(r.target.scope, source.collection)
    return source


@dataclass(slots=True)
class CollectionPlan:
    """One collection of the backup: its target, whether it is there, what it holds."""

    source: Path
    source_id: int
    target: Path
    target_id: int | None  # None until the target has it
    status: str
    max_ttl: int | None = None
    documents: int = 0
    deletions: int = 0

    def to_json(self) -> dict[str, Any]:
        """JSON form: names as `scope.collection`, ids as integers (u32)."""
        return {
            "source": str(self.source),
            "source_id": self.source_id,
            "target": str(self.target),
            "target_id": self.target_id,
            "status": self.status,
            "documents": self.documents,
            "deletions": self.deletions,
        }


@dataclass(slots=True)
class RestorePlan:
    """Partition counts and the collection plan of one restore."""

    source_partitions: int
    target_partitions: int | None  # None: a SQLite store (keeps the source's partitions)
    collections: list[CollectionPlan] = field(default_factory=list)

    @property
    def rehash(self) -> bool:
        """True when keys go to other partition numbers than in the backup."""
        return self.target_partitions is not None and self.target_partitions != (
            self.source_partitions
        )

    def by_source(self) -> dict[int, CollectionPlan]:
        """The plan of each source collection id."""
        return {c.source_id: c for c in self.collections}

    def target_ids(self) -> dict[int, int]:
        """Source collection id → target collection id, for every planned collection
        the target has."""
        return {c.source_id: c.target_id for c in self.collections if c.target_id is not None}

    def missing(self) -> list[CollectionPlan]:
        """The collections the target lacks and will not get."""
        return [c for c in self.collections if c.status == MISSING]

    def to_create(self) -> list[CollectionPlan]:
        """The collections to create on the target."""
        return [c for c in self.collections if c.status == CREATE]

    def creations(self) -> list[tuple[Path, int | None]]:
        """What to create on the target, each with its source's max TTL: the argument of
        `upr_cli.net.collections_manifest.create_collections` (one change for all)."""
        return [(c.target, c.max_ttl) for c in self.to_create()]

    def to_json(self) -> dict[str, Any]:
        """JSON form (`source_partitions`, `target_partitions`, `rehash`, `collections`)."""
        return {
            "source_partitions": self.source_partitions,
            "target_partitions": self.target_partitions,
            "rehash": self.rehash,
            "collections": [c.to_json() for c in self.collections],
        }

    def describe(self) -> list[str]:
        """The plan as lines of text: counts, then one line per collection."""
        if self.target_partitions is None:
            lines = [f"partitions: {self.source_partitions} (a store keeps the source's)"]
        elif self.rehash:
            lines = [f"rehashed from {self.source_partitions} to "
                     f"{self.target_partitions} partitions"]  # fmt: skip
        else:
            lines = [f"partitions: {self.target_partitions} (no rehash)"]
        w1 = max((len(str(c.source)) for c in self.collections), default=0)
        w2 = max((len(str(c.target)) for c in self.collections), default=0)
        renamed = any(c.source != c.target for c in self.collections)
        for c in self.collections:  # "S.C -> T.D" only when a name changes (80 columns)
            names = (
                f"{c.source!s:<{w1}} -> {c.target!s:<{w2}}" if renamed else f"{c.source!s:<{w1}}"
            )
            lines.append(f"  {names}  {c.status:<7}  {c.documents:,} documents, "
                         f"{c.deletions:,} deletions")  # fmt: skip
        return lines


def source_partition_count(held: Iterable[int]) -> int:
    """The source bucket's partition count as the backups show it: one past the highest
    partition any backup of the chain holds (a backup holds every partition, even an
    empty one)."""
    return max(held, default=-1) + 1


def plan_collections(
    source: CollectionsManifest,
    target: CollectionsManifest | None,
    rules: Sequence[MapRule] = (),
    *,
    can_create: bool = True,
    covers: Callable[[str, str], bool] | None = None,
) -> list[CollectionPlan]:
    """The plan of every collection of `source` (the backup's names at the end of its
    chain) that `covers` keeps: its target path under `rules`, that path's id on
    `target` (None: the target has no collections, only `_default._default`), and
    whether it exists, will be created or is missing. A rule naming nothing in the
    backup is a UsageError (a typo would otherwise restore to the wrong place)."""
    known = {Path(s.name, c.name) for s, c in source.collections()}
    for r in rules:
        hit = r.source in known if r.source.collection else source.scope(r.source.scope)
        if not hit:
            raise UsageError(f"--map-data {r}: the backup has no {_kind(r.source)} {r.source}")
    out: list[CollectionPlan] = []
    for s, c in source.collections():
        if covers is not None and not covers(s.name, c.name):
            continue
        src = Path(s.name, c.name)
        dst = map_path(src, rules)
        if target is None:
            tid = DEFAULT_ID if dst == Path(DEFAULT, DEFAULT) else None
        else:
            found = target.lookup(dst)
            tid = None if found is None else found.id
        if tid is not None:
            status = EXISTS
        else:
            status = CREATE if can_create and target is not None else MISSING
        out.append(CollectionPlan(src, c.id, dst, tid, status, c.max_ttl))
    return out


def plan_restore(
    source: CollectionsManifest,
    target: CollectionsManifest | None,
    *,
    source_partitions: int,
    target_partitions: int | None,
    rules: Sequence[MapRule] = (),
    can_create: bool = True,
    covers: Callable[[str, str], bool] | None = None,
) -> RestorePlan:
    """The plan of a restore in one step: the backup's collections (`source`, its names
    at the end of its chain) against the target's (`target`; None: no collections) and
    its partition count (None: a SQLite store), under `rules` (`plan_collections`)."""
    plans = plan_collections(source, target, rules, can_create=can_create, covers=covers)
    return RestorePlan(source_partitions, target_partitions, plans)


def _kind(p: Path) -> str:
    return "scope" if p.collection is None else "collection"


def resolve(plans: Iterable[CollectionPlan], target: CollectionsManifest) -> None:
    """Fill in the target ids of the collections planned for creation from the manifest
    the creation made (`created`), or mark them `missing` when it lacks them."""
    for c in plans:
        if c.status != CREATE:
            continue
        found = target.lookup(c.target)
        c.target_id, c.status = (found.id, CREATED) if found else (None, MISSING)


def refuse_missing(plan: RestorePlan, why: str) -> None:
    """A RestorePlanError listing every missing collection, when there is one."""
    missing = plan.missing()
    if missing:
        names = ", ".join(sorted({str(c.target) for c in missing}))
        raise RestorePlanError(f"nothing written: the target lacks {names} ({why})")
