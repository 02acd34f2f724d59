"""The collections filter a DCP stream asks for (docs/protocol.md "Collections"): paths
resolved to ids against the source's manifest, and the STREAM_REQ value that names them.

Each partition's stream holds its own copy (`dcp/streams.py`), since a drop is forgotten
per partition once the caller committed past it (docs/protocol.md §12.4).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from upr_cli.collections import DEFAULT, CollectionsError, CollectionsManifest, ManifestChange, Path


@dataclass(slots=True)
class StreamFilter:
    """What a filtered stream asks for (docs/protocol.md "Collections"): one scope's
    id, or a set of collection ids. Each partition holds its own copy and forgets a
    dropped id once the caller committed past that partition's drop
    (docs/protocol.md §12.4)."""

    scope: int | None = None
    ids: set[int] = field(default_factory=set)  # for a scope: its collections known
    gone: bool = False  # the scope was dropped

    @property
    def empty(self) -> bool:
        """True once nothing the filter names exists any more."""
        return self.gone if self.scope is not None else not self.ids

    def copy(self) -> StreamFilter:
        """A partition's own copy."""
        return StreamFilter(self.scope, set(self.ids), self.gone)

    def value(self) -> bytes:
        """The STREAM_REQ value, ids as hex strings (kv_engine's form). No `uid`: a
        producer leaves out the system events whose manifest uid is at or below it, and
        the events one manifest makes on a partition share its uid on a upr node, so
        even the uid seen at the start position would hide the rest of them
        (docs/protocol.md §12.4)."""
        doc = (
            {"scope": f"{self.scope:x}"}
            if self.scope is not None
            else {"collections": [f"{c:x}" for c in sorted(self.ids)]}
        )
        return json.dumps(doc, separators=(",", ":")).encode()

    def admit(self, change: ManifestChange) -> None:
        """A collection created in the filter's scope streams from now on."""
        if (change.kind == "collection-created" and change.scope_id == self.scope
                and change.collection_id is not None):  # fmt: skip
            self.ids.add(change.collection_id)

    def forget(self, change: ManifestChange) -> None:
        """Follow a drop: the id (or the scope) is gone for good, never reused."""
        if change.kind == "collection-dropped" and change.collection_id is not None:
            self.ids.discard(change.collection_id)
        elif change.kind == "scope-dropped" and change.scope_id == self.scope:
            self.gone = True


def resolve_filter(
    paths: list[Path] | None, manifest: CollectionsManifest | None, *, lenient: bool = False
) -> StreamFilter | None:
    """The filter that streams `paths` from a source with `manifest` (None: a source
    without collections, where only `_default._default` exists); None streams all.
    A path the manifest does not know is a CollectionsError naming it, unless
    `lenient` (a resume whose followed collections were dropped): it is left out."""
    if not paths:
        return None
    if manifest is None:
        other = [str(p) for p in paths if not p.covers(DEFAULT, DEFAULT)]
        if other:
            raise CollectionsError(
                f"unknown collection {', '.join(other)}: the source does not support "
                "collections (only _default._default exists there)"
            )
        return None
    missing = [
        str(p) for p in paths
        if (manifest.scope(p.scope) if p.collection is None else manifest.lookup(p)) is None
    ]  # fmt: skip
    if missing and not lenient:
        many = "s" if len(missing) > 1 else ""
        raise CollectionsError(
            f"unknown collection{many} {', '.join(missing)} (the source's manifest uid "
            f"{manifest.uid:x})"
        )
    if len(paths) == 1 and paths[0].collection is None and not missing:
        scope = manifest.scope(paths[0].scope)
        assert scope is not None
        return StreamFilter(scope=scope.id, ids={c.id for c in scope.collections})
    ids = manifest.ids(paths)
    if not ids and not lenient:
        raise CollectionsError(f"{', '.join(map(str, paths))}: no collection to stream")
    return StreamFilter(ids=ids)


__all__ = ["StreamFilter", "resolve_filter"]
