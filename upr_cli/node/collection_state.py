"""The node's side of collections: the bucket's manifest as the KV path checks it.

Every document key inside the node is qualified (upr_cli/node/sysevents.py): its
collection id as LEB128, then the document key. A KV request names a collection
through that prefix; `NodeCollections.collection` finds it in the current manifest or
answers UnknownCollection (0x88) with the manifest uid, as kv_engine does
(formats/collections.md §4). The manifest and the ids of dropped collections whose
documents are not yet purged are `meta` rows of the bucket's database
(formats/collections.md §2); the bucket purges those documents in the background
(formats/collections.md §3). `upr serve --create-collections` specs are applied here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from upr_cli.collections import (
    DEFAULT,
    Collection,
    CollectionsError,
    CollectionsManifest,
    ManifestChange,
    Path,
    Scope,
    spec_differences,
)
from upr_cli.collections import parse_specs as parse_specs  # `upr serve` checks specs here
from upr_cli.collections import with_specs as common_with_specs
from upr_cli.errors import UsageError
from upr_cli.protocol import leb128
from upr_cli.protocol.status import Status, StatusError

MANIFEST_KEY = "collections_manifest"
DROPPED_KEY = "collections_dropped"  # ids whose documents the purge has still to delete
MAX_RELATIVE = 30 * 24 * 3600  # an expiry up to 30 days is relative (formats/collections.md §4)
MAX_TTL = 0x7FFF_FFFF
log = logging.getLogger(__name__)


class UnknownCollectionError(StatusError):
    """UnknownCollection (0x88), with the uid of the manifest the node checked against."""

    status = int(Status.UNKNOWN_COLLECTION)

    def __init__(self, message: str, manifest_uid: int) -> None:
        super().__init__(message)
        self.manifest_uid = manifest_uid


class UnknownScopeError(UnknownCollectionError):
    """UnknownScope (0x8c), with the manifest uid."""

    status = int(Status.UNKNOWN_SCOPE)


class NodeCollections:
    """The bucket's current manifest, indexed by collection id, the dropped ids whose
    documents are still on disk, and the highest collection and scope ids the node
    ever held (an id at or below them that the manifest lacks was dropped: it never
    comes back, formats/collections.md §2)."""

    def __init__(self, manifest: CollectionsManifest | None = None, dropped: Iterable[int] = (), *,
                 high: tuple[int, int] = (0, 0)) -> None:  # fmt: skip
        self.manifest = CollectionsManifest()
        self._by_id: dict[int, Collection] = {}
        self.dropped: set[int] = set(dropped)
        self.high_collection, self.high_scope = high
        self.high_collection = max(self.high_collection, *self.dropped, 0)
        self.replace(manifest or CollectionsManifest())

    @classmethod
    def from_meta(cls, manifest: str | None, dropped: str | None) -> NodeCollections:
        """The state stored in the `meta` rows (CollectionsError if they are corrupt).
        The dropped row is a JSON object (version 2); version 1 was a bare list of the
        ids to purge, and the high-water marks are derived from the manifest and that list."""
        try:
            doc = json.loads(dropped) if dropped else []
        except ValueError:
            raise CollectionsError(f"stored dropped collections: {dropped!r}") from None
        high = (0, 0)
        if isinstance(doc, dict):
            ids, highs = doc.get("purge"), (doc.get("high_collection"), doc.get("high_scope"))
            if not all(isinstance(h, int) and h >= 0 for h in highs):
                raise CollectionsError(f"stored dropped collections: {dropped!r}")
            high = (int(highs[0] or 0), int(highs[1] or 0))
        else:
            ids = doc
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise CollectionsError(f"stored dropped collections: {dropped!r}")
        return cls(CollectionsManifest.from_json(manifest) if manifest else None, ids, high=high)

    def meta(self) -> dict[str, str]:
        """The `meta` rows that persist this state."""
        dropped = {"purge": sorted(self.dropped), "high_collection": self.high_collection,
                   "high_scope": self.high_scope}  # fmt: skip
        return {MANIFEST_KEY: self.manifest.dumps().decode(),
                DROPPED_KEY: json.dumps(dropped, separators=(",", ":"))}  # fmt: skip

    def check(self, new: CollectionsManifest) -> None:
        """What COLLECTIONS_SET_MANIFEST refuses beyond the JSON checks (CollectionsError):
        `check_successor`, and an id the current manifest lacks at or below the highest
        the node held. That id was dropped, and its documents may still wait for the
        lazy purge, which would delete the new collection's."""
        check_successor(self.manifest, new)
        for s, c in new.collections():
            if c.id not in self._by_id and c.id <= self.high_collection:
                raise CollectionsError(
                    f"collection id 0x{c.id:x} ({s.name}.{c.name}) was used before and "
                    f"dropped: a new collection takes an id above 0x{self.high_collection:x}"
                )
        for s in new.scopes:
            if self.manifest.scope_by_id(s.id) is None and s.id <= self.high_scope:
                raise CollectionsError(
                    f"scope id 0x{s.id:x} ({s.name}) was used before and dropped: a new "
                    f"scope takes an id above 0x{self.high_scope:x}"
                )

    def replace(self, manifest: CollectionsManifest) -> list[int]:
        """Take a new manifest; returns the collection ids it drops (now to purge)."""
        gone = [cid for cid in self._by_id if manifest.by_id(cid) is None]
        self.manifest = manifest
        self._by_id = {c.id: c for _, c in manifest.collections()}
        self.dropped.update(gone)
        self.high_collection = max(self.high_collection, *self._by_id, 0)
        self.high_scope = max(self.high_scope, *(s.id for s in manifest.scopes), 0)
        return gone

    def collection(self, key: bytes) -> Collection:
        """The collection a qualified key names, or UnknownCollection."""
        cid = key[0] if key and key[0] < 0x80 else leb128.split_key(key)[0]
        coll = self._by_id.get(cid)
        if coll is None:
            raise self.unknown(f"collection 0x{cid:x} is not in manifest {self.manifest.uid:x}")
        return coll

    def unknown(self, message: str, *, scope: bool = False) -> UnknownCollectionError:
        """The error for a collection (or scope) the manifest does not have."""
        cls = UnknownScopeError if scope else UnknownCollectionError
        return cls(message, self.manifest.uid)

    def collection_id(self, path: str) -> tuple[int, int]:
        """GET_COLLECTION_ID (0xbb): (manifest uid, collection id) of `scope.collection`
        (`.c` and `.` name the default scope and collection)."""
        if path.count(".") != 1:
            raise CollectionsError(f"{path!r}: a collection path is scope.collection")
        scope, _, name = path.partition(".")
        p = _path(scope or DEFAULT, name or DEFAULT)
        if self.manifest.scope(p.scope) is None:
            raise self.unknown(f"no scope {p.scope!r}", scope=True)
        coll = self.manifest.lookup(p)
        if coll is None:
            raise self.unknown(f"no collection {p}")
        return self.manifest.uid, coll.id

    def scope_id(self, path: str) -> tuple[int, int]:
        """GET_SCOPE_ID (0xbc): (manifest uid, scope id) of `scope` (`""`: the default
        scope; a `.collection` after it is ignored, as kv_engine does)."""
        if path.count(".") > 1:
            raise CollectionsError(f"{path!r}: a scope path has at most one dot")
        p = _path(path.partition(".")[0] or DEFAULT, None)
        scope = self.manifest.scope(p.scope)
        if scope is None:
            raise self.unknown(f"no scope {p.scope!r}", scope=True)
        return self.manifest.uid, scope.id


def _path(scope: str, collection: str | None) -> Path:
    try:
        return Path.parse(scope if collection is None else f"{scope}.{collection}")
    except UsageError as exc:
        raise CollectionsError(str(exc)) from None


def expiry_of(coll: Collection, expiry: int, now: int) -> int:
    """The absolute expiry a write stores: a relative one (up to 30 days) made absolute,
    then capped by the collection's max TTL, which also gives one to a write without
    (kv_engine's rule, formats/collections.md §4)."""
    if 0 < expiry <= MAX_RELATIVE:
        expiry += now
    if coll.max_ttl:
        limit = now + coll.max_ttl
        if expiry == 0 or expiry > limit:
            return limit
    return expiry


def check_successor(old: CollectionsManifest, new: CollectionsManifest) -> None:
    """What COLLECTIONS_SET_MANIFEST refuses beyond the JSON checks: an id kept with
    another name, scope or max TTL (upr has no "collection modified" event)."""
    for s, c in new.collections():
        had = old.by_id(c.id)
        if had is None:
            continue
        if (had[0].id, had[1].name, had[1].max_ttl or None) != (s.id, c.name, c.max_ttl or None):
            raise CollectionsError(
                f"collection id 0x{c.id:x} is {_held(had[0], had[1])} here, not "
                f"{_held(s, c)}: an id cannot change its name, scope or max TTL"
            )
    for s in new.scopes:
        was = old.scope_by_id(s.id)
        if was is not None and was.name != s.name:
            raise CollectionsError(
                f"scope id 0x{s.id:x} is {was.name} here, not {s.name}: an id cannot change "
                "its name"
            )


def _held(scope: Scope, coll: Collection) -> str:
    return f"{scope.name}.{coll.name}" + (f" (max TTL {coll.max_ttl}s)" if coll.max_ttl else "")


def dropped_id(change: ManifestChange) -> int | None:
    """The collection a change drops, if it drops one."""
    return change.collection_id if change.kind == "collection-dropped" else None


def with_specs(manifest: CollectionsManifest, specs: Iterable[str]) -> CollectionsManifest:
    """The manifest with every scope and collection the specs name (the missing ones
    created, in order; existing ones kept as they are, with a warning in the log when
    the spec gives another max TTL: `upr serve` logs to stderr)."""
    for text in spec_differences(manifest, specs):
        log.warning("--collections: %s", text)
    try:
        return common_with_specs(manifest, specs)
    except CollectionsError as exc:
        raise UsageError(str(exc)) from None
