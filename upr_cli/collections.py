"""Scopes and collections: the manifest, names and paths, and the changes DCP reports.

One model for every layer. The node keeps a `CollectionsManifest` per bucket and answers with its
JSON (GET_COLLECTIONS_MANIFEST); `upr collections` edits it and pushes it to every node
(COLLECTIONS_SET_MANIFEST, as the cluster manager does); a backup records it; a restore
maps collections by name through it. The JSON is kv_engine's: ids and the uid are hex
strings without `0x` (docs/protocol.md "Collections").

A `ManifestChange` is one DCP system event (0x5f) decoded: a collection or scope
created or dropped, at a seq of one partition.

Ids: `_default._default` is collection 0 in scope 0; ids 1 to 7 are reserved; new ones
start at 8. A dropped id is never used again: a collection dropped and created again
under the same name is a new collection with a new id and a new history.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from upr_cli.errors import UprError, UsageError

DEFAULT = "_default"
DEFAULT_ID = 0
FIRST_ID = 8  # 1-7 are reserved (docs/protocol.md "Collections")
MAX_NAME = 251  # kv_engine allows 251 bytes since 7.0 (30 before)
# A user's name: letters, digits, `_ - %`, not starting with `_` or `%` (a system name
# may: `_default`, `_system`, `_mobile`).
_NAME = re.compile(r"[A-Za-z0-9_%-][A-Za-z0-9_%$-]*")  # `$` first: reserved
_USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_%-]*")

# DCP system event ids and their value layouts (docs/protocol.md §2.15)
EVENT_COLLECTION_CREATED = 0
EVENT_COLLECTION_DROPPED = 1
EVENT_SCOPE_CREATED = 3
EVENT_SCOPE_DROPPED = 4
EVENT_COLLECTION_MODIFIED = 5
_CREATE_V0 = struct.Struct(">QII")  # manifest uid, scope id, collection id
_CREATE_V1 = struct.Struct(">QIII")  # ... then max TTL
_DROP_COLLECTION = struct.Struct(">QII")
_SCOPE = struct.Struct(">QI")  # manifest uid, scope id


class CollectionsError(UprError):
    """A manifest or a collection path that is not valid."""


_NAME_RULE = "letters, digits and _ - % only, not starting with _ or %"


def check_name(name: str, what: str = "collection") -> str:
    """`name` if it is a valid scope or collection name (kv_engine's rules), else a
    CollectionsError naming what is wrong."""
    if not name or len(name.encode()) > MAX_NAME:
        raise CollectionsError(f"{what} name {name!r}: 1 to {MAX_NAME} bytes")
    if not _NAME.fullmatch(name):
        raise CollectionsError(f"{what} name {name!r}: {_NAME_RULE}")
    return name


def check_user_name(name: str, what: str = "collection") -> str:
    """A name a user may create (no leading `_` or `%`, no `$`)."""
    check_name(name, what)
    if not _USER_NAME.fullmatch(name):
        raise CollectionsError(f"{what} name {name!r}: {_NAME_RULE}")
    return name


def creatable(text: str) -> Path:
    """The path `upr collections create` takes: a scope, or a collection in its scope,
    with names a user may create. Anything else is a UsageError (exit 2) before any
    network call: the default scope and collection exist from the start, and once the
    default collection is dropped it does not come back (formats/collections.md §1)."""
    path = Path.parse(text)
    if path.collection == DEFAULT:
        raise UsageError(f"{text!r}: the _default collection cannot be created (it exists "
                         "from the start, and once dropped it does not come back)")  # fmt: skip
    if path.scope == DEFAULT and path.collection is None:
        raise UsageError(f"{text!r}: the _default scope always exists")
    try:
        if path.scope != DEFAULT:
            check_user_name(path.scope, "scope")
        if path.collection is not None:
            check_user_name(path.collection)
    except CollectionsError as exc:
        raise UsageError(str(exc)) from None
    return path


@dataclass(frozen=True, slots=True)
class Path:
    """`scope` or `scope.collection` (collection None: the whole scope)."""

    scope: str
    collection: str | None = None

    @classmethod
    def parse(cls, text: str, *, need_collection: bool = False) -> Path:
        """Parse `S`, `S.C`, `.C` (the default scope) or `.` (the default collection)."""
        scope, dot, coll = text.strip().partition(".")
        if dot and not coll and scope:
            raise UsageError(f"{text!r}: a collection name must follow the dot")
        if dot and not scope:
            scope = DEFAULT
        if dot and not coll:
            coll = DEFAULT
        if need_collection and not dot:
            raise UsageError(f"{text!r}: give SCOPE.COLLECTION")
        if "." in coll:
            raise UsageError(f"{text!r}: a path has at most one dot (SCOPE.COLLECTION)")
        try:
            check_name(scope, "scope")
            if dot:
                check_name(coll, "collection")
        except CollectionsError as exc:
            raise UsageError(str(exc)) from None
        return cls(scope, coll if dot else None)

    def __str__(self) -> str:
        return self.scope if self.collection is None else f"{self.scope}.{self.collection}"

    def covers(self, scope: str, collection: str) -> bool:
        """True if this path names that collection or its scope."""
        return self.scope == scope and self.collection in (None, collection)


def parse_paths(text: str | Iterable[str] | None) -> list[Path]:
    """Comma-separated (or repeated) paths, in order, without repeats."""
    if text is None:
        return []
    items = text.split(",") if isinstance(text, str) else [p for t in text for p in t.split(",")]
    return list(dict.fromkeys(Path.parse(t) for t in items if t.strip()))


@dataclass(frozen=True, slots=True)
class Collection:
    """One collection: its name, id (unique in the bucket) and max TTL in seconds."""

    name: str
    id: int
    max_ttl: int | None = None


@dataclass(frozen=True, slots=True)
class Scope:
    """One scope and its collections."""

    name: str
    id: int
    collections: tuple[Collection, ...] = ()

    def collection(self, name: str) -> Collection | None:
        return next((c for c in self.collections if c.name == name), None)


@dataclass(frozen=True, slots=True)
class CollectionsManifest:
    """A bucket's collections: the uid (only grows) and the scopes in order. Named apart
    from a backup's manifest (`upr_cli.repo.manifest.Manifest`), which records one."""

    uid: int = 0
    scopes: tuple[Scope, ...] = field(
        default_factory=lambda: (Scope(DEFAULT, DEFAULT_ID, (Collection(DEFAULT, DEFAULT_ID),)),)
    )

    # -- reading --------------------------------------------------------------------

    def scope(self, name: str) -> Scope | None:
        return next((s for s in self.scopes if s.name == name), None)

    def scope_by_id(self, sid: int) -> Scope | None:
        return next((s for s in self.scopes if s.id == sid), None)

    def collections(self) -> Iterator[tuple[Scope, Collection]]:
        """Every (scope, collection), in manifest order."""
        for s in self.scopes:
            for c in s.collections:
                yield s, c

    def by_id(self, cid: int) -> tuple[Scope, Collection] | None:
        """The scope and collection of a collection id, or None (unknown or dropped)."""
        return next(((s, c) for s, c in self.collections() if c.id == cid), None)

    def path_of(self, cid: int) -> Path | None:
        found = self.by_id(cid)
        return Path(found[0].name, found[1].name) if found else None

    def lookup(self, path: Path) -> Collection | None:
        """The collection a `scope.collection` path names, or None."""
        s = self.scope(path.scope)
        return s.collection(path.collection or DEFAULT) if s is not None else None

    def ids(self, paths: Iterable[Path]) -> set[int]:
        """The collection ids the paths name (a scope path: all of its collections)."""
        return {c.id for s, c in self.collections() for p in paths if p.covers(s.name, c.name)}

    @property
    def max_id(self) -> int:
        """The highest scope or collection id in the manifest (0 if only defaults)."""
        ids = [s.id for s in self.scopes] + [c.id for _, c in self.collections()]
        return max(ids, default=0)

    # -- changing (what `upr collections` and the node's pre-create do) -------------

    def next_id(self) -> int:
        """The id a new scope or collection gets. Every id ever given is at most
        uid + 7 (each change raises the uid by at least one and gives at most one
        id), so uid + 8 was never used, even by a dropped collection."""
        return max(self.uid + FIRST_ID, self.max_id + 1)

    def with_scope(self, name: str) -> CollectionsManifest:
        check_user_name(name, "scope")
        if self.scope(name) is not None:
            raise CollectionsError(f"scope {name!r} already exists")
        sid = self.next_id()
        return replace(self, uid=sid - FIRST_ID + 1, scopes=(*self.scopes, Scope(name, sid)))

    def with_collection(
        self, scope: str, name: str, max_ttl: int | None = None
    ) -> CollectionsManifest:
        check_user_name(name, "collection")
        s = self.scope(scope)
        if s is None:
            raise CollectionsError(f"scope {scope!r} does not exist")
        if s.collection(name) is not None:
            raise CollectionsError(f"collection {scope}.{name} already exists")
        if max_ttl is not None and not 0 <= max_ttl <= 0x7FFF_FFFF:
            raise CollectionsError(f"max TTL {max_ttl}: 0 to 2147483647 seconds")
        cid = self.next_id()
        new = replace(s, collections=(*s.collections, Collection(name, cid, max_ttl or None)))
        scopes = tuple(new if x is s else x for x in self.scopes)
        return replace(self, uid=cid - FIRST_ID + 1, scopes=scopes)

    def without(self, path: Path) -> CollectionsManifest:
        """The manifest with a scope (and all its collections) or a collection dropped."""
        s = self.scope(path.scope)
        if s is None:
            raise CollectionsError(f"scope {path.scope!r} does not exist")
        if path.collection is None:
            if s.name == DEFAULT:
                raise CollectionsError("the _default scope cannot be dropped")
            scopes = tuple(x for x in self.scopes if x is not s)
        else:
            if s.collection(path.collection) is None:
                raise CollectionsError(f"collection {path} does not exist")
            new = replace(s, collections=tuple(c for c in s.collections
                                               if c.name != path.collection))  # fmt: skip
            scopes = tuple(new if x is s else x for x in self.scopes)
        return replace(self, uid=max(self.uid + 1, self.max_id - FIRST_ID + 2), scopes=scopes)

    # -- JSON (kv_engine's format) ---------------------------------------------------

    def to_json(self) -> dict[str, object]:
        def coll(c: Collection) -> dict[str, object]:
            out: dict[str, object] = {"name": c.name, "uid": f"{c.id:x}"}
            if c.max_ttl is not None:
                out["maxTTL"] = c.max_ttl
            return out

        return {
            "uid": f"{self.uid:x}",
            "scopes": [{"name": s.name, "uid": f"{s.id:x}",
                        "collections": [coll(c) for c in s.collections]}
                       for s in self.scopes],
        }  # fmt: skip

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, doc: object) -> CollectionsManifest:
        """A manifest from kv_engine's JSON, validated as COLLECTIONS_SET_MANIFEST does:
        CollectionsError says what is wrong."""
        if isinstance(doc, bytes | str):
            try:
                doc = json.loads(doc)
            except (ValueError, UnicodeDecodeError) as exc:
                raise CollectionsError(f"manifest: not JSON ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("scopes"), list):
            raise CollectionsError("manifest: an object with `uid` and `scopes` expected")
        uid = _hex(doc.get("uid"), "manifest uid")
        scopes: list[Scope] = []
        seen_ids: set[int] = set()
        for sd in doc["scopes"]:
            if not isinstance(sd, dict):
                raise CollectionsError("manifest: a scope must be an object")
            sname = check_name(_text(sd.get("name"), "scope name"), "scope")
            sid = _hex(sd.get("uid"), f"scope {sname} uid")
            colls: list[Collection] = []
            for cd in sd.get("collections", []):
                if not isinstance(cd, dict):
                    raise CollectionsError(
                        f"manifest: scope {sname}: a collection must be an object"
                    )
                cname = check_name(_text(cd.get("name"), "collection name"))
                cid = _hex(cd.get("uid"), f"collection {sname}.{cname} uid")
                ttl = cd.get("maxTTL")
                if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool)
                                        or not 0 <= ttl <= 0x7FFF_FFFF):  # fmt: skip
                    raise CollectionsError(f"collection {sname}.{cname}: maxTTL {ttl!r}")
                if any(c.name == cname for c in colls):
                    raise CollectionsError(f"manifest: collection {sname}.{cname} twice")
                if (
                    cid in seen_ids
                    or 0 < cid < FIRST_ID
                    or (cid == 0) != (sname == DEFAULT and cname == DEFAULT)
                ):
                    raise CollectionsError(f"manifest: collection {sname}.{cname}: id {cid:x}")
                seen_ids.add(cid)
                colls.append(Collection(cname, cid, ttl))
            if any(s.name == sname for s in scopes) or any(s.id == sid for s in scopes):
                raise CollectionsError(f"manifest: scope {sname} twice")
            if 0 < sid < FIRST_ID or (sid == 0) != (sname == DEFAULT):
                raise CollectionsError(f"manifest: scope {sname}: id {sid:x}")
            scopes.append(Scope(sname, sid, tuple(colls)))
        if not any(s.name == DEFAULT for s in scopes):
            raise CollectionsError("manifest: the _default scope is missing")
        return cls(uid, tuple(scopes))


def _hex(value: object, what: str) -> int:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-fA-F]{1,16}", value):
        raise CollectionsError(f"manifest: {what} must be a hex string, got {value!r}")
    return int(value, 16)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise CollectionsError(f"manifest: {what} must be a string")
    return value


# -- system events -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ManifestChange:
    """One DCP system event: a collection or scope created or dropped at `seq`."""

    partition: int
    seq: int
    kind: str  # "collection-created", "collection-dropped", "scope-created", "scope-dropped"
    manifest_uid: int
    scope_id: int
    collection_id: int | None = None  # None for scope events
    name: str | None = None  # the created collection's or scope's name; None when dropped
    max_ttl: int | None = None

    @property
    def dropped(self) -> bool:
        return self.kind.endswith("dropped")


def decode_event(partition: int, seq: int, event: int, version: int, key: bytes,
                 value: bytes) -> ManifestChange | None:  # fmt: skip
    """A system event's change (versions 0 and 1; None for events upr does not use,
    such as a collection modified or a FlatBuffers version 2 value)."""
    try:
        name = bytes(key).decode() if key else None
        if event == EVENT_COLLECTION_CREATED and version in (0, 1):
            if version == 1:
                uid, sid, cid, ttl = _CREATE_V1.unpack(value)
            else:
                (uid, sid, cid), ttl = _CREATE_V0.unpack(value), None
            return ManifestChange(partition, seq, "collection-created", uid, sid, cid, name,
                                  ttl or None)  # fmt: skip
        if event == EVENT_COLLECTION_DROPPED and version in (0, 1):
            uid, sid, cid = _DROP_COLLECTION.unpack(value[: _DROP_COLLECTION.size])
            return ManifestChange(partition, seq, "collection-dropped", uid, sid, cid)
        if event in (EVENT_SCOPE_CREATED, EVENT_SCOPE_DROPPED) and version in (0, 1):
            uid, sid = _SCOPE.unpack(value[: _SCOPE.size])
            kind = "scope-created" if event == EVENT_SCOPE_CREATED else "scope-dropped"
            return ManifestChange(partition, seq, kind, uid, sid, None,
                                  name if event == EVENT_SCOPE_CREATED else None)  # fmt: skip
    except (struct.error, UnicodeDecodeError):
        raise CollectionsError(f"partition {partition} seq {seq}: malformed system event") from None
    return None


def encode_event(change: ManifestChange) -> tuple[int, int, bytes, bytes]:
    """(event, version, key, value) of a change, as the producer sends it: version 1
    for a created collection with a max TTL, else version 0."""
    name = (change.name or "").encode()
    if change.kind == "collection-created":
        assert change.collection_id is not None
        if change.max_ttl:
            value = _CREATE_V1.pack(change.manifest_uid, change.scope_id, change.collection_id,
                                    change.max_ttl)  # fmt: skip
            return EVENT_COLLECTION_CREATED, 1, name, value
        value = _CREATE_V0.pack(change.manifest_uid, change.scope_id, change.collection_id)
        return EVENT_COLLECTION_CREATED, 0, name, value
    if change.kind == "collection-dropped":
        assert change.collection_id is not None
        value = _DROP_COLLECTION.pack(change.manifest_uid, change.scope_id, change.collection_id)
        return EVENT_COLLECTION_DROPPED, 0, b"", value
    if change.kind == "scope-created":
        return EVENT_SCOPE_CREATED, 0, name, _SCOPE.pack(change.manifest_uid, change.scope_id)
    if change.kind == "scope-dropped":
        return EVENT_SCOPE_DROPPED, 0, b"", _SCOPE.pack(change.manifest_uid, change.scope_id)
    raise ValueError(f"unknown manifest change {change.kind!r}")


def changes_between(old: CollectionsManifest, new: CollectionsManifest) -> list[ManifestChange]:
    """What going from `old` to `new` creates and drops, as changes without a partition
    or seq (the node gives each its seq per partition): drops first (collections, then
    scopes), then creations (scopes, then collections), each in manifest order."""
    uid = new.uid
    old_c = {c.id: (s, c) for s, c in old.collections()}
    new_c = {c.id: (s, c) for s, c in new.collections()}
    old_s = {s.id: s for s in old.scopes}
    new_s = {s.id: s for s in new.scopes}
    out = [ManifestChange(-1, 0, "collection-dropped", uid, s.id, cid)
           for cid, (s, _c) in old_c.items() if cid not in new_c]  # fmt: skip
    out += [ManifestChange(-1, 0, "scope-dropped", uid, sid) for sid in old_s if sid not in new_s]
    out += [ManifestChange(-1, 0, "scope-created", uid, sid, None, s.name)
            for sid, s in new_s.items() if sid not in old_s]  # fmt: skip
    out += [ManifestChange(-1, 0, "collection-created", uid, s.id, cid, c.name, c.max_ttl)
            for cid, (s, c) in new_c.items() if cid not in old_c]  # fmt: skip
    return out


def apply_change(manifest: CollectionsManifest, change: ManifestChange) -> CollectionsManifest:
    """The manifest after one change seen on a stream (a consumer that follows a
    partition's system events keeps its names this way)."""
    uid = max(manifest.uid, change.manifest_uid)
    scopes = list(manifest.scopes)
    if change.kind == "scope-created" and manifest.scope_by_id(change.scope_id) is None:
        scopes.append(Scope(change.name or f"scope-{change.scope_id:x}", change.scope_id))
    elif change.kind == "scope-dropped":
        scopes = [s for s in scopes if s.id != change.scope_id]
    elif change.kind == "collection-created" and manifest.by_id(change.collection_id or 0) is None:
        s = manifest.scope_by_id(change.scope_id) or Scope(f"scope-{change.scope_id:x}",
                                                           change.scope_id)  # fmt: skip
        new = replace(s, collections=(*s.collections, Collection(
            change.name or f"collection-{change.collection_id:x}", change.collection_id or 0,
            change.max_ttl)))  # fmt: skip
        scopes = [new if x.id == s.id else x for x in scopes]
        if all(x.id != s.id for x in scopes):
            scopes.append(new)
    elif change.kind == "collection-dropped":
        scopes = [replace(s, collections=tuple(c for c in s.collections
                                               if c.id != change.collection_id))
                  for s in scopes]  # fmt: skip
    return CollectionsManifest(uid, tuple(scopes))


# -- specs: `upr serve --create-collections` and `upr cluster init --create-collections`


def parse_specs(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """Comma-separated (or repeated) `SCOPE`, `SCOPE.COLLECTION` or
    `SCOPE.COLLECTION:MAXTTL` specs, checked and normalised; a UsageError says what is
    wrong, a scope or collection named twice included (which max TTL would win?)."""
    if text is None:
        return ()
    items = text.split(",") if isinstance(text, str) else [p for t in text for p in t.split(",")]
    out: dict[Path, str] = {}
    for raw in (t.strip() for t in items):
        if not raw:
            continue
        path, ttl = spec_item(raw)
        if path in out:
            raise UsageError(f"{raw!r}: {path} is named twice (give each scope and "
                             "collection once)")  # fmt: skip
        out[path] = str(path) + (f":{ttl}" if ttl is not None else "")
    return tuple(out.values())


def spec_item(text: str) -> tuple[Path, int | None]:
    """One spec: its path and max TTL (None: none given); a UsageError if malformed."""
    where, colon, ttl_text = text.partition(":")
    path = Path.parse(where)
    if path.scope == DEFAULT and path.collection in (None, DEFAULT):
        raise UsageError(f"{text!r}: the _default scope and collection always exist")
    ttl = None
    if colon:
        if path.collection is None:
            raise UsageError(f"{text!r}: a max TTL belongs to a collection (SCOPE.COLLECTION:S)")
        if not ttl_text.isdigit() or int(ttl_text) > 0x7FFF_FFFF:
            raise UsageError(f"{text!r}: the max TTL is 0 to 2147483647 seconds")
        ttl = int(ttl_text)
    try:
        creatable(str(path))
    except UsageError as exc:
        raise UsageError(f"{text!r}: {exc}") from None
    return path, ttl


def with_specs(manifest: CollectionsManifest, specs: Iterable[str]) -> CollectionsManifest:
    """`manifest` with every scope and collection the specs name that it lacks (a
    collection's scope too), created in spec order; those it has are left as they are
    (`spec_differences` says where a spec and the manifest disagree)."""
    return with_collections(manifest, (spec_item(text) for text in parse_specs(specs)))


def with_collections(
    manifest: CollectionsManifest, wanted: Iterable[tuple[Path, int | None]]
) -> CollectionsManifest:
    """`manifest` with every scope and collection of `wanted` (paths, each with its max
    TTL) that it lacks, a collection's scope too, created in order; those it has are
    left as they are. `manifest` itself when it lacks none."""
    for path, ttl in wanted:
        if manifest.scope(path.scope) is None:
            manifest = manifest.with_scope(path.scope)
        if path.collection is not None and manifest.lookup(path) is None:
            manifest = manifest.with_collection(path.scope, path.collection, ttl)
    return manifest


def spec_differences(manifest: CollectionsManifest, specs: Iterable[str]) -> list[str]:
    """The collections `manifest` has with another max TTL than the specs give: a spec
    only creates, so these keep theirs (one message each)."""
    out = []
    for text in parse_specs(specs):
        path, ttl = spec_item(text)
        held = manifest.lookup(path) if path.collection is not None else None
        if held is not None and (held.max_ttl or None) != (ttl or None):
            out.append(f"collection {path} exists with max TTL {_ttl_text(held.max_ttl)}, "
                       f"not {_ttl_text(ttl)}: it keeps its own (a spec only creates; drop "
                       "and create it to change it)")  # fmt: skip
    return out


def _ttl_text(ttl: int | None) -> str:
    return f"{ttl}s" if ttl else "none"
