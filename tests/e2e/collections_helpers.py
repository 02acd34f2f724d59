"""Collections in e2e tests without the `upr collections` command: the raw management
calls (GET/SET_COLLECTIONS_MANIFEST) as the cluster manager makes them, on one node."""

from __future__ import annotations

from tests.e2e.e2e_helpers import run
from upr_cli.collections import CollectionsManifest, Path
from upr_cli.net.bootstrap import connect
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.messages import CollectionsGetManifest, CollectionsSetManifest


async def _get(uri: str) -> CollectionsManifest:
    session = await connect(SourceUri.parse(uri))
    try:
        conn = session.conn
        resp = await conn.request(CollectionsGetManifest(opaque=conn.next_opaque()))
        return CollectionsManifest.from_json(getattr(resp, "value", b""))
    finally:
        await session.conn.aclose()


async def _set(uri: str, manifest: CollectionsManifest) -> None:
    session = await connect(SourceUri.parse(uri))
    try:
        conn = session.conn
        await conn.request(
            CollectionsSetManifest(value=manifest.dumps(), opaque=conn.next_opaque())
        )
    finally:
        await session.conn.aclose()


def get_manifest(uri: str) -> CollectionsManifest:
    """The node's manifest (GET_COLLECTIONS_MANIFEST)."""
    return run(_get(uri))  # type: ignore[no-any-return]


def set_manifest(uri: str, manifest: CollectionsManifest) -> None:
    """Push a manifest to one node (COLLECTIONS_SET_MANIFEST)."""
    run(_set(uri, manifest))


def create(uri: str, *paths: str, max_ttl: int | None = None) -> CollectionsManifest:
    """Create scopes and collections (`S` or `S.C`; a missing scope too) on one node."""
    m = get_manifest(uri)
    for text in paths:
        p = Path.parse(text)
        if m.scope(p.scope) is None:
            m = m.with_scope(p.scope)
        if p.collection is not None and m.lookup(p) is None:
            m = m.with_collection(p.scope, p.collection, max_ttl)
    set_manifest(uri, m)
    return m


def drop(uri: str, path: str) -> CollectionsManifest:
    """Drop a scope or collection on one node."""
    m = get_manifest(uri).without(Path.parse(path))
    set_manifest(uri, m)
    return m
