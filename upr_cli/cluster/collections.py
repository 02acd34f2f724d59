"""A bucket's collections manifest across a cluster: read it from every node, change it,
push it to every node (formats/cluster.md "Collections").

In Couchbase the cluster manager owns the manifest and pushes each new one to every data
node with COLLECTIONS_SET_MANIFEST (0xb9); a node refuses a manifest whose uid is lower
than its own (ERANGE), so the uid orders every change. upr has no cluster manager:
`upr collections` plays its part for one change, and `upr cluster` for the nodes it
restarts or adds, so that every node holds the same manifest.

A change reads every node of the cluster map, edits the newest manifest (the highest
uid: a node that missed a change is behind, not right), and pushes the result to every
node. It refuses before pushing anything when a node that holds partitions does not
answer. A node that comes to hold a uid at or above ours with other content took a
concurrent change: the change is made again on that manifest, a bounded number of
times. A node that refuses for any other reason is named in a `ManifestPushError`,
with the nodes that took the manifest.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from upr_cli.collections import DEFAULT, CollectionsError, Manifest, Path, check_user_name
from upr_cli.errors import UprError, UsageError
from upr_cli.net.bootstrap import Session, connect, node_uris
from upr_cli.net.connection import Connection
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.messages import CollectionsGetManifest, CollectionsSetManifest
from upr_cli.protocol.status import Status, error_for_status

ATTEMPTS = 5  # changes made again after a concurrent change, before giving up
NODE_TIMEOUT = 5.0  # seconds for a node other than the bootstrap one to answer
# kv_engine answers GET_COLLECTIONS_MANIFEST with NoCollectionsManifest (0x89) before the
# cluster manager set one: the node then has the default collection only
_NO_MANIFEST = Status.NO_COLLECTIONS_MANIFEST
_UNSUPPORTED = (Status.UNKNOWN_COMMAND, Status.NOT_SUPPORTED)
_T = TypeVar("_T")


class CollectionsUnsupported(UprError):
    """The server does not know collections (a Couchbase Server before 7.0)."""


class ManifestPushError(UprError):
    """Some nodes did not take a new manifest: the message names them and those that did."""

    def __init__(self, message: str, *, took: Sequence[str] = (),
                 failed: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.took = list(took)
        self.failed = dict(failed or {})


@dataclass(frozen=True, slots=True)
class NodeManifest:
    """One node of the cluster map and the manifest it holds."""

    node: str  # host:port, as the map lists it
    manifest: Manifest | None = None  # None: no answer, or no collections
    error: str = ""  # why it did not answer ("" when it did)
    member: bool = True  # the map gives it a partition (active or replica)
    supported: bool = True  # it knows collections


@dataclass
class Change:
    """What a manifest change did: the new manifest, the one it was made on, and where."""

    manifest: Manifest
    base: Manifest
    took: list[str] = field(default_factory=list)  # nodes that hold the new manifest
    warnings: list[str] = field(default_factory=list)  # nodes outside the map that did not
    attempts: int = 1


# -- one node -------------------------------------------------------------------------


async def get_manifest(conn: Connection) -> Manifest | None:
    """GET_COLLECTIONS_MANIFEST on a bootstrapped connection; None when the server does
    not support collections."""
    resp = await conn.request(CollectionsGetManifest(opaque=conn.next_opaque()), check=False)
    if resp.status in _UNSUPPORTED:
        return None
    if resp.status == _NO_MANIFEST:
        return Manifest()
    body = bytes(getattr(resp, "value", b""))
    if resp.status != Status.SUCCESS:
        text = body.decode(errors="replace")
        raise error_for_status(resp.status)(f"GET_COLLECTIONS_MANIFEST: {text}".rstrip(": "))
    return Manifest.from_json(body)


async def set_manifest(conn: Connection, manifest: Manifest) -> str:
    """COLLECTIONS_SET_MANIFEST on a bootstrapped connection: "" if taken, else the
    node's reason (ERANGE: it holds a newer uid)."""
    msg = CollectionsSetManifest(value=manifest.dumps(), opaque=conn.next_opaque())
    resp = await conn.request(msg, check=False)
    if resp.status == Status.SUCCESS:
        return ""
    text = bytes(getattr(resp, "value", b"")).decode(errors="replace").strip()
    name = error_for_status(resp.status).__name__
    return f"{name} (status 0x{resp.status:02x}){': ' + text if text else ''}"


async def fetch_manifest(uri: SourceUri) -> Manifest | None:
    """The manifest of the node `uri` reaches; None when it does not support collections."""
    session = await connect(uri, name="upr-collections")
    try:
        return await get_manifest(session.conn)
    finally:
        await session.conn.aclose()


# -- every node -----------------------------------------------------------------------


def _members(session: Session, count: int) -> set[int]:
    """Indices of the map's servers that hold a partition (every one without a map)."""
    rows = session.config.get("vBucketServerMap", {}).get("vBucketMap", [])
    held = {i for row in rows if isinstance(row, list) for i in row if isinstance(i, int)}
    return {i for i in held if 0 <= i < count} if held else set(range(count))


async def _on_node(session: Session | None, target: SourceUri,
                   work: Callable[[Connection], Awaitable[_T]]) -> _T:  # fmt: skip
    """Run `work` on the node `target`: over the session's connection when it is that
    node, else over a connection of its own."""
    if session is not None and (target.host, target.port) == (session.uri.host,
                                                              session.uri.port):  # fmt: skip
        return await work(session.conn)
    other = await connect(target, name="upr-collections", timeout=NODE_TIMEOUT)
    try:
        return await work(other.conn)
    finally:
        await other.conn.aclose()


def _why(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


async def _read(session: Session | None, target: SourceUri, member: bool) -> NodeManifest:
    name = f"{target.host}:{target.port}"
    try:
        manifest = await _on_node(session, target, get_manifest)
    except (UprError, OSError) as exc:
        return NodeManifest(name, error=_why(exc), member=member)
    return NodeManifest(name, manifest, member=member, supported=manifest is not None)


async def read_all(session: Session) -> tuple[list[SourceUri], list[NodeManifest]]:
    """Every node of the session's cluster map and its manifest, read at once."""
    uris = node_uris(session)
    members = _members(session, len(uris))
    got = await asyncio.gather(*(_read(session, u, i in members) for i, u in enumerate(uris)))
    return uris, list(got)


async def cluster_manifests(uri: SourceUri) -> list[NodeManifest]:
    """Every node of the cluster `uri` reaches, with the manifest it holds."""
    session = await connect(uri, name="upr-collections")
    try:
        return (await read_all(session))[1]
    finally:
        await session.conn.aclose()


def newest(nodes: Iterable[NodeManifest]) -> Manifest | None:
    """The manifest with the highest uid among the nodes' (the one most of them hold on a
    tie, then the first); None when no node has one."""
    held = [n.manifest for n in nodes if n.manifest is not None]
    if not held:
        return None
    top = max(m.uid for m in held)
    tied = [m for m in held if m.uid == top]
    count = Counter(m.dumps() for m in tied)
    return max(tied, key=lambda m: count[m.dumps()])  # max keeps the first of equals


def next_manifest(base: Manifest, edit: Callable[[Manifest], Manifest], top: int,
                  previous: Manifest | None) -> Manifest:  # fmt: skip
    """The manifest to push: `edit(base)` with a uid above every node's (`top`). When
    `base` is our own previous attempt (it won a tie on some nodes), that manifest again
    with a higher uid: the edit is in it already."""
    new = previous if previous is not None and base == previous else edit(base)
    if new.uid <= top:
        new = replace(new, uid=top + 1)  # the ids stay below uid + 8 (Manifest.next_id)
    return new


def _check_ready(nodes: list[NodeManifest]) -> None:
    """Refuse before changing anything when a member does not answer or lacks collections."""
    down = {n.node: n.error for n in nodes if n.member and n.error}
    if down:
        listed = "; ".join(f"{k} ({v})" for k, v in down.items())
        raise ManifestPushError(f"no node changed: {listed} does not answer; start it, or fail "
                                "it over, and run the command again", failed=down)  # fmt: skip
    if not any(n.supported and not n.error for n in nodes):
        raise CollectionsUnsupported("the server does not support collections (Couchbase "
                                     "Server 7.0 or later, or upr serve, does)")  # fmt: skip
    old = [n.node for n in nodes if n.member and not n.supported]
    if old:
        raise CollectionsUnsupported(
            f"no node changed: {', '.join(old)} does not support collections (a mixed cluster)"
        )


async def _push(session: Session | None, uris: list[SourceUri], nodes: list[NodeManifest],
                new: Manifest) -> dict[str, str]:  # fmt: skip
    """Push `new` to every node that answered and holds something else; failures by node."""

    async def one(target: SourceUri, held: NodeManifest) -> tuple[str, str]:
        if held.manifest == new:
            return held.node, ""
        try:
            why = await _on_node(session, target, lambda c: set_manifest(c, new))
        except (UprError, OSError) as exc:
            why = _why(exc)
        return held.node, why

    todo = [(u, n) for u, n in zip(uris, nodes, strict=True) if not n.error and n.supported]
    answers = await asyncio.gather(*(one(u, n) for u, n in todo))
    return {node: why for node, why in answers if why}


async def change(uri: SourceUri, edit: Callable[[Manifest], Manifest], *,
                 attempts: int = ATTEMPTS) -> Change:  # fmt: skip
    """Apply `edit` to the cluster's newest manifest and push the result to every node
    (the module's doc says how concurrent changes and failures are handled)."""
    session = await connect(uri, name="upr-collections")
    previous: Manifest | None = None
    try:
        for attempt in range(1, attempts + 1):
            uris, nodes = await read_all(session)
            _check_ready(nodes)
            base = newest(nodes)
            assert base is not None  # _check_ready: some node answered with one
            top = max(n.manifest.uid for n in nodes if n.manifest is not None)
            new = next_manifest(base, edit, top, previous)
            failed = await _push(session, uris, nodes, new)
            if failed and _raced(await read_all(session), new):
                previous = new
                continue
            return _outcome(Change(new, base, attempts=attempt), nodes, failed)
    finally:
        await session.conn.aclose()
    raise ManifestPushError(
        f"the manifest kept changing during {attempts} attempts (another change at the same "
        "time?): run the command again"
    )


def _outcome(out: Change, nodes: list[NodeManifest], failed: dict[str, str]) -> Change:
    """The change's record; a ManifestPushError when a member did not take it (a node
    outside the map that did not is a warning)."""
    out.took = [n.node for n in nodes if n.node not in failed and not n.error]
    missed = {n.node: failed[n.node] for n in nodes if n.member and n.node in failed}
    out.warnings = [f"{n.node} (holds no partition): {failed.get(n.node) or n.error}"
                    for n in nodes if not n.member and (n.node in failed or n.error)]  # fmt: skip
    if missed:
        listed = "; ".join(f"{k}: {v}" for k, v in missed.items())
        raise ManifestPushError(
            f"manifest uid {out.manifest.uid} not taken by {listed} (taken by "
            f"{', '.join(out.took) or 'no node'}): run the command again",
            took=out.took, failed=missed,
        )  # fmt: skip
    return out


def _raced(read: tuple[list[SourceUri], list[NodeManifest]], new: Manifest) -> bool:
    """True when a node holds a uid at or above ours with other content: a concurrent
    change reached it."""
    return any(n.manifest is not None and n.manifest.uid >= new.uid and n.manifest != new
               for n in read[1])  # fmt: skip


async def change_manifest(uri: SourceUri, edit: Callable[[Manifest], Manifest]) -> Manifest:
    """Apply `edit` to the manifest of the cluster `uri` reaches and push the result to
    every node of its map; returns the new manifest."""
    return (await change(uri, edit)).manifest


async def read_nodes(uris: Sequence[SourceUri]) -> list[NodeManifest]:
    """The manifest each node holds (its error when it does not answer), read at once."""
    return list(await asyncio.gather(*(_read(None, u, True) for u in uris)))


async def give(conn: Connection, manifest: Manifest, what: str) -> None:
    """Give one node `manifest` when it holds an older one (it keeps a newer one); a
    ManifestPushError names `what` when it refuses."""
    held = await get_manifest(conn)
    if held is None or held == manifest or held.uid > manifest.uid:
        return
    why = await set_manifest(conn, manifest)
    if why:
        raise ManifestPushError(f"{what}: collections manifest uid {manifest.uid}: {why}",
                                failed={what: why})  # fmt: skip


async def spread(uris: Sequence[SourceUri], targets: Iterable[int]) -> Manifest | None:
    """Give the nodes `targets` (indices into `uris`) the newest manifest any of `uris`
    holds, when theirs is older; the newest manifest, or None when no node has one. A
    target that does not answer or refuses is a ManifestPushError."""
    nodes = await read_nodes(uris)
    best = newest(n for n in nodes if not n.error)
    if best is None:
        return None
    want = set(targets)
    failed = {n.node: n.error for i, n in enumerate(nodes) if i in want and n.error}
    behind = [(u, n) for i, (u, n) in enumerate(zip(uris, nodes, strict=True))
              if i in want and not n.error and n.manifest is not None
              and n.manifest.uid < best.uid]  # fmt: skip
    failed |= await _push(None, [u for u, _ in behind], [n for _, n in behind], best)
    if failed:
        listed = "; ".join(f"{k}: {v}" for k, v in failed.items())
        raise ManifestPushError(f"collections manifest uid {best.uid} not delivered to "
                                f"{listed}", failed=failed)  # fmt: skip
    return best


# -- specs: `upr serve --collections` and `upr cluster init --collections` ------------


def parse_specs(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """Comma-separated `SCOPE`, `SCOPE.COLLECTION` or `SCOPE.COLLECTION:MAXTTL` specs,
    checked (a UsageError says what is wrong) and without repeats."""
    if text is None:
        return ()
    items = text.split(",") if isinstance(text, str) else [p for t in text for p in t.split(",")]
    out: list[str] = []
    for raw in (t.strip() for t in items):
        if not raw:
            continue
        path, ttl = _spec(raw)
        out.append(str(path) + (f":{ttl}" if ttl is not None else ""))
    return tuple(dict.fromkeys(out))


def _spec(text: str) -> tuple[Path, int | None]:
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
        if path.scope != DEFAULT:
            check_user_name(path.scope, "scope")
        if path.collection is not None:
            check_user_name(path.collection)
    except CollectionsError as exc:
        raise UsageError(f"{text!r}: {exc}") from None
    return path, ttl


def with_specs(manifest: Manifest, specs: Iterable[str]) -> Manifest:
    """`manifest` with every scope and collection the specs name that it lacks (a
    collection's scope too); those it has are left as they are."""
    for text in specs:
        path, ttl = _spec(text)
        if manifest.scope(path.scope) is None:
            manifest = manifest.with_scope(path.scope)
        if path.collection is not None and manifest.lookup(path) is None:
            manifest = manifest.with_collection(path.scope, path.collection, ttl)
    return manifest
