"""Collections in the store (formats/store.md §3.8, §5.5): the names a source's manifest
gives its ids, the manifest changes applied between a partition's rows, and the
collections filter a store follows (formats/store.md §3.1).

Theory of operation
-------------------
* A document is (partition, collection id, key); names live apart, by id, in
  `collections` and `scopes`, since an id never changes its meaning.
* A partition's manifest changes are applied with its rows, in seq order: a drop logs
  each document of the collection as a change at the drop's seq, then deletes it, so
  the ordinary rollback (oldest entry above the target, `upr_cli.store.rollback`) puts
  it back.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from upr_cli.collections import CollectionsManifest, ManifestChange
from upr_cli.errors import UsageError
from upr_cli.sqlite import i64 as _i64
from upr_cli.store.apply import PREV_COLUMNS
from upr_cli.store.schema import set_meta

_CHANGE_KINDS = frozenset({"collection-created", "collection-dropped", "scope-created",
                           "scope-dropped"})  # fmt: skip


@dataclass(frozen=True, slots=True)
class StoredCollection:
    """A collection's names as the store recorded them (`collections`, `scopes`)."""

    id: int
    scope: str | None  # None: the store never saw its scope's name
    name: str
    max_ttl: int | None
    dropped: bool

    def __str__(self) -> str:
        return f"{self.scope}.{self.name}"


def check_changes(
    partition: int, changes: Sequence[ManifestChange], seqs: list[int], above: int
) -> int:
    """The highest seq of a partition's rows and changes, once checked (ValueError
    otherwise): changes of `partition`, of a kind the store knows, and every seq
    distinct, above `above`, and the changes in increasing order."""
    for c in changes:
        if c.partition != partition:
            raise ValueError(f"partition {partition}: a change of partition {c.partition} given")
        if c.kind not in _CHANGE_KINDS or (c.kind.startswith("collection") and c.collection_id
                                           is None):  # fmt: skip
            raise ValueError(f"partition {partition}: seq {c.seq}: not a manifest change")
    cs = [c.seq for c in changes]
    every = sorted([*seqs, *cs])
    if every[0] <= above:
        raise ValueError(
            f"partition {partition}: seq {every[0]} is not above {above}, the seq the store"
            " already holds (a stream must resume from the store's position)"
        )
    if cs != sorted(cs) or len(set(every)) != len(every):
        raise ValueError(f"partition {partition}: changes out of order or at a row's seq")
    return every[-1]


def _marks(values: Sequence[object]) -> str:
    return ", ".join("?" * len(values))


def apply_change(
    db: sqlite3.Connection, undo_window: int, change: ManifestChange, count: int, floor: int
) -> tuple[int, int]:
    """Record a change's names; a drop removes the documents of the collection (or of
    the scope's collections) in the change's partition, each logged as a change at
    the drop's seq, so a rollback below it puts them back (formats/store.md §5.5).
    Returns the partition's new (log_count, log_floor)."""
    p, seq = change.partition, _i64(change.seq)
    if change.kind == "collection-created":
        db.execute(
            "INSERT INTO collections (id, scope_id, name, max_ttl) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (id) DO UPDATE SET scope_id = excluded.scope_id,"
            " name = excluded.name, max_ttl = excluded.max_ttl, dropped = 0",
            (change.collection_id, change.scope_id, change.name or "", change.max_ttl),
        )
        return count, floor
    if change.kind == "scope-created":
        db.execute(
            "INSERT INTO scopes (id, name) VALUES (?, ?) ON CONFLICT (id)"
            " DO UPDATE SET name = excluded.name, dropped = 0",
            (change.scope_id, change.name or ""),
        )
        return count, floor
    if change.kind == "collection-dropped":
        where, args = "collection_id = ?", [change.collection_id]
        db.execute("UPDATE collections SET dropped = 1 WHERE id = ?", args)
    else:  # a scope's collections go with it (each has its own drop event as well)
        where = "collection_id IN (SELECT id FROM collections WHERE scope_id = ?)"
        args = [change.scope_id]
        db.execute("UPDATE scopes SET dropped = 1 WHERE id = ?", args)
        db.execute("UPDATE collections SET dropped = 1 WHERE scope_id = ?", args)
    if undo_window:
        count += db.execute(
            f"INSERT INTO mutation_log (partition, seq, collection_id, key, {PREV_COLUMNS},"
            " prev_xattrs) SELECT partition, ?, collection_id, key, seq, rev_seq, cas, flags,"
            " expiry, delete_time, datatype, deleted, value, xattrs FROM documents"
            " WHERE partition = ?"
            f" AND {where}",
            [seq, p, *args],
        ).rowcount
    else:
        floor = max(floor, change.seq)  # nothing is logged: the drop cannot be undone
    db.execute(f"DELETE FROM documents WHERE partition = ? AND {where}", [p, *args])
    return count, floor


def claim_filter(db: sqlite3.Connection, path: Path, collections: str) -> None:
    """`Store.claim_filter` inside its transaction (`path` names the store in errors)."""
    row = db.execute("SELECT value FROM meta WHERE key = 'collections'").fetchone()
    held = db.execute("SELECT count(*) FROM partitions").fetchone()[0]
    had = row[0] if row is not None else ""
    if held and had != collections:
        raise UsageError(
            f"{path}: the store follows "
            f"{'--collections ' + had if had else 'every collection'}, not "
            f"{'--collections ' + collections if collections else 'every collection'};"
            " give the same or use another store"
        )
    if row is None or had != collections:
        set_meta(db, "collections", collections)


def record_manifest(db: sqlite3.Connection, manifest: CollectionsManifest) -> None:
    """`Store.record_manifest` inside its transaction."""
    row = db.execute("SELECT value FROM meta WHERE key = 'manifest_uid'").fetchone()
    newer = row is None or manifest.uid >= int(row[0])
    verb = "OR REPLACE" if newer else "OR IGNORE"
    db.executemany(
        f"INSERT {verb} INTO scopes (id, name, dropped) VALUES (?, ?, 0)",
        [(sc.id, sc.name) for sc in manifest.scopes],
    )
    db.executemany(
        f"INSERT {verb} INTO collections (id, scope_id, name, max_ttl, dropped)"
        " VALUES (?, ?, ?, ?, 0)",
        [(c.id, sc.id, c.name, c.max_ttl) for sc, c in manifest.collections()],
    )
    if newer:
        # ids are never used again: one the newest manifest lacks was dropped
        sids = [sc.id for sc in manifest.scopes]
        cids = [c.id for _sc, c in manifest.collections()]
        db.execute(f"UPDATE scopes SET dropped = 1 WHERE id NOT IN ({_marks(sids)})", sids)
        db.execute(f"UPDATE collections SET dropped = 1 WHERE id NOT IN ({_marks(cids)})", cids)
        set_meta(db, "manifest_uid", str(manifest.uid))


def collections(db: sqlite3.Connection) -> dict[int, StoredCollection]:
    """Every collection the store knows a name of, by id (formats/store.md §3.8)."""
    rows = db.execute(
        "SELECT c.id, s.name, c.name, c.max_ttl, c.dropped FROM collections AS c"
        " LEFT JOIN scopes AS s ON s.id = c.scope_id ORDER BY c.id"
    )
    return {cid: StoredCollection(cid, scope, name, ttl, dropped == 1)
            for cid, scope, name, ttl, dropped in rows}  # fmt: skip
