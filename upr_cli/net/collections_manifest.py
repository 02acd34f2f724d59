"""A bucket's collections manifest as clients see it: read it from a node (the one
reading of a GET_COLLECTIONS_MANIFEST answer, `manifest_from_answer`), read it from
every node, change it through one arbiter node, push it to every node
(formats/cluster.md "Collections"). Not a backup's manifest (`upr_cli.repo.manifest`).

In Couchbase the cluster manager owns the manifest and pushes each new one to every data
node with COLLECTIONS_SET_MANIFEST (0xb9); a node refuses a manifest whose uid is lower
than its own (ERANGE), or the same uid with other content (EINVAL). upr has no cluster
manager: `upr collections` plays its part for one change, and `upr cluster` for the
nodes it restarts or adds, so that every node holds the same manifest.

Changes are serialised by one node, the arbiter: the first node of the cluster map's
server list that holds partitions (a change refuses to start while such a node does not
answer, so every client picks the same one). A change reads every node, then the
arbiter last, edits the arbiter's manifest and pushes the result to the arbiter first.
Two clients that start from the same manifest make the same uid: the arbiter takes one
and refuses the other, which reads the arbiter again and makes its change on the
winner's manifest. Only a manifest the arbiter took is pushed to the other nodes, so no
two nodes ever hold one id under two names. A node that refuses ours because it holds
a later uid, one the arbiter holds too, has a later change that includes ours.

Nodes whose manifests diverge from the arbiter's (made by hand, or by an older upr,
which pushed to every node at once) stop every change until
`upr collections repair` gives them the arbiter's manifest (`repair`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from upr_cli.collections import (
    Collection,
    CollectionsManifest,
    Path,
    Scope,
    with_collections,
)
from upr_cli.collections import (
    parse_specs as parse_specs,  # `upr cluster init --create-collections` checks them here
)
from upr_cli.collections import (
    with_specs as with_specs,
)
from upr_cli.errors import UprError
from upr_cli.net.bootstrap import Session, connect, node_uris
from upr_cli.net.connection import Connection
from upr_cli.net.retry import RetryPolicy
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.messages import CollectionsGetManifest, CollectionsSetManifest
from upr_cli.protocol.status import Status, error_context, error_for_status

REPAIR = "`upr collections repair URI` gives every node the arbiter's manifest"
FORCE = (
    "documents may sit under either; `upr collections repair --force URI` drops these on every node"
)
ATTEMPTS = 12  # tries of a change that concurrent ones beat at the arbiter, before giving up
# a change that lost at the arbiter waits a little, jittered, so that a crowd thins out
BACKOFF = RetryPolicy(attempts=ATTEMPTS, first=0.05, cap=1.0)
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
    manifest: CollectionsManifest | None = None  # None: no answer, or no collections
    error: str = ""  # why it did not answer ("" when it did)
    member: bool = True  # the map gives it a partition (active or replica)
    supported: bool = True  # it knows collections


@dataclass
class Change:
    """What a manifest change did: the new manifest, the one it was made on, and where."""

    manifest: CollectionsManifest
    base: CollectionsManifest
    took: list[str] = field(default_factory=list)  # nodes that hold the new manifest
    warnings: list[str] = field(default_factory=list)  # nodes outside the map that did not
    attempts: int = 1
    arbiter: str = ""  # the node that took it first


# -- one node -------------------------------------------------------------------------


def manifest_from_answer(status: int, body: bytes) -> CollectionsManifest | None:
    """The manifest a GET_COLLECTIONS_MANIFEST answer carries: the one reading of "no
    manifest" for every client. A node without a manifest set yet
    (NO_COLLECTIONS_MANIFEST) holds the default collection only; one that does not know
    the command has no collections (None); any other failure is its status error, and
    JSON that is not a manifest a CollectionsError."""
    if status in _UNSUPPORTED:
        return None
    if status == _NO_MANIFEST:
        return CollectionsManifest()
    if status != Status.SUCCESS:
        text = body.decode(errors="replace")
        raise error_for_status(status)(f"GET_COLLECTIONS_MANIFEST: {text}".rstrip(": "))
    return CollectionsManifest.from_json(body)


async def get_collections_manifest(conn: Connection) -> CollectionsManifest | None:
    """GET_COLLECTIONS_MANIFEST on a bootstrapped connection (`manifest_from_answer`)."""
    resp = await conn.request(CollectionsGetManifest(opaque=conn.next_opaque()), check=False)
    return manifest_from_answer(resp.status, bytes(getattr(resp, "value", b"")))


async def set_collections_manifest(conn: Connection, manifest: CollectionsManifest) -> str:
    """COLLECTIONS_SET_MANIFEST on a bootstrapped connection: "" if taken, else the
    node's reason (ERANGE: it holds a newer uid)."""
    msg = CollectionsSetManifest(value=manifest.dumps(), opaque=conn.next_opaque())
    resp = await conn.request(msg, check=False)
    if resp.status == Status.SUCCESS:
        return ""
    text = error_context(bytes(getattr(resp, "value", b"")))
    name = error_for_status(resp.status).__name__
    return f"{name} (status 0x{resp.status:02x}){': ' + text if text else ''}"


async def fetch_collections_manifest(uri: SourceUri) -> CollectionsManifest | None:
    """The manifest of the node `uri` reaches; None when it does not support collections."""
    session = await connect(uri, name="upr-collections")
    try:
        return await get_collections_manifest(session.conn)
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
        manifest = await _on_node(session, target, get_collections_manifest)
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


def newest(nodes: Iterable[NodeManifest]) -> CollectionsManifest | None:
    """The manifest with the highest uid among the nodes' (the one most of them hold on a
    tie, then the first); None when no node has one."""
    held = [n.manifest for n in nodes if n.manifest is not None]
    if not held:
        return None
    top = max(m.uid for m in held)
    tied = [m for m in held if m.uid == top]
    count = Counter(m.dumps() for m in tied)
    return max(tied, key=lambda m: count[m.dumps()])  # max keeps the first of equals


def next_manifest(
    base: CollectionsManifest, edit: Callable[[CollectionsManifest], CollectionsManifest], top: int
) -> CollectionsManifest:
    """The manifest to push: `edit(base)` with a uid above every node's (`top`); `base`
    itself when the edit changes nothing."""
    new = edit(base)
    if new == base:
        return base
    if new.uid <= top:
        new = replace(new, uid=top + 1)  # the ids stay below uid + 8 (Manifest.next_id)
    return new


def arbiter(nodes: Sequence[NodeManifest]) -> int:
    """The index of the arbiter: the first node of the map's server list that holds
    partitions (the first node when none does)."""
    return next((i for i, n in enumerate(nodes) if n.member), 0)


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


@dataclass(frozen=True, slots=True)
class Conflict:
    """A scope or collection id a node holds otherwise than the arbiter (or cannot take)."""

    kind: str  # "scope" or "collection"
    id: int
    text: str  # the id, the node's path and the arbiter's


def conflicts(held: CollectionsManifest, target: CollectionsManifest) -> list[Conflict]:
    """What giving a node that holds `held` the arbiter's manifest `target` would lose,
    rename or be refused: an id `target` has under another name, scope or max TTL; an
    id `target` lacks when the node is not behind the arbiter (nothing says the arbiter
    dropped it); and an id of `target` the node lacks but is at or below its highest
    (the node refuses it, formats/collections.md §2). Documents may sit under either
    name, so none is given up silently."""
    out = []
    for s, c in held.collections():
        t = target.by_id(c.id)
        if t is None and held.uid < target.uid:
            continue  # dropped by a later change the node missed
        if t is None or _identity(*t) != _identity(s, c):
            there = f"{t[0].name}.{t[1].name}" if t is not None else "none"
            text = f"0x{c.id:x} {s.name}.{c.name} (the arbiter's: {there})"
            out.append(Conflict("collection", c.id, text))
    top = held.max_id
    for s, c in target.collections():
        if held.by_id(c.id) is None and c.id <= top and not any(x.id == c.id for x in out):
            text = f"0x{c.id:x} none (the arbiter's: {s.name}.{c.name})"
            out.append(Conflict("collection", c.id, text))
    for sc in held.scopes:
        ts = target.scope_by_id(sc.id)
        if ts is not None and ts.name != sc.name:
            text = f"scope 0x{sc.id:x} {sc.name} (the arbiter's: {ts.name})"
            out.append(Conflict("scope", sc.id, text))
    return out


def _identity(scope: Scope, coll: Collection) -> tuple[int, str, int | None]:
    return scope.id, coll.name, coll.max_ttl or None


def _diverged(nodes: Sequence[NodeManifest], judge: int) -> dict[str, list[Conflict]]:
    """The members whose manifests diverge from the arbiter's (index `judge`): a uid at
    or above it with other content, or conflicts; each with its conflicts."""
    target = nodes[judge].manifest
    assert target is not None
    out: dict[str, list[Conflict]] = {}
    for i, n in enumerate(nodes):
        if i == judge or not n.member or n.manifest is None or n.manifest == target:
            continue
        found = conflicts(n.manifest, target)
        if found or n.manifest.uid >= target.uid:
            out[n.node] = found
    return out


async def _read_arbiter(session: Session, uris: list[SourceUri],
                        nodes: list[NodeManifest]) -> int:  # fmt: skip
    """Read the arbiter again, after every other node: a manifest another node holds was
    taken by the arbiter before, so a node ahead of it has diverged, not raced."""
    judge = arbiter(nodes)
    nodes[judge] = again = await _read(session, uris[judge], nodes[judge].member)
    if again.error or again.manifest is None:
        raise ManifestPushError(f"no node changed: the arbiter {again.node} does not answer "
                                f"({again.error or 'no manifest'})")  # fmt: skip
    return judge


async def _push(session: Session | None, uris: list[SourceUri], nodes: list[NodeManifest],
                new: CollectionsManifest, *,
                skip: int | None = None) -> dict[str, str]:  # fmt: skip
    """Push `new` to every node that answered and holds something else (all but the
    node `skip`); failures by node."""

    async def one(target: SourceUri, held: NodeManifest) -> tuple[str, str]:
        if held.manifest == new:
            return held.node, ""
        try:
            why = await _on_node(session, target, lambda c: set_collections_manifest(c, new))
        except (UprError, OSError) as exc:
            why = _why(exc)
        return held.node, why

    todo = [(u, n) for i, (u, n) in enumerate(zip(uris, nodes, strict=True))
            if i != skip and not n.error and n.supported]  # fmt: skip
    answers = await asyncio.gather(*(one(u, n) for u, n in todo))
    return {node: why for node, why in answers if why}


async def change(uri: SourceUri, edit: Callable[[CollectionsManifest], CollectionsManifest], *,
                 done: Callable[[CollectionsManifest], bool] | None = None,
                 attempts: int = ATTEMPTS) -> Change:  # fmt: skip
    """Apply `edit` to the arbiter's manifest, push the result to the arbiter, then to
    every other node (the module's doc says why). `done(manifest)` tells a retry that
    the change is there already (an earlier attempt of ours, or the same change by
    another client): it is then complete, not an error."""
    session = await connect(uri, name="upr-collections")
    try:
        for attempt in range(1, attempts + 1):
            uris, nodes = await read_all(session)
            _check_ready(nodes)
            judge = await _read_arbiter(session, uris, nodes)
            base = nodes[judge].manifest
            assert base is not None
            diverged = _diverged(nodes, judge)
            if diverged:
                raise _divergence(nodes[judge], diverged, "no node changed")
            if attempt > 1 and done is not None and done(base):
                new = base
            else:
                new = next_manifest(base, edit, max(n.manifest.uid for n in nodes
                                                    if n.manifest is not None))  # fmt: skip
            if new != base and not await _arbiter_takes(session, uris[judge], base, new):
                await asyncio.sleep(BACKOFF.delay(attempt))
                continue
            failed = await _push(session, uris, nodes, new, skip=judge)
            failed = await _excused(session, uris, nodes, failed, new, judge)
            out = Change(new, base, attempts=attempt, arbiter=nodes[judge].node)
            return _outcome(out, nodes, failed)
    finally:
        await session.conn.aclose()
    raise ManifestPushError(
        f"the manifest kept changing during {attempts} attempts (other changes at the same "
        "time): run the command again"
    )


async def _arbiter_takes(session: Session, target: SourceUri, base: CollectionsManifest,
                         new: CollectionsManifest) -> bool:  # fmt: skip
    """Push `new` to the arbiter: True when it took it, False when a concurrent change
    took it first (the arbiter no longer holds `base`); a ManifestPushError otherwise."""
    try:
        why = await _on_node(session, target, lambda c: set_collections_manifest(c, new))
    except (UprError, OSError) as exc:  # the answer may be lost, not the manifest
        why = _why(exc)
    if not why:
        return True
    now = await _read(session, target, True)
    if now.manifest == new:
        return True
    if now.manifest is not None and now.manifest != base:
        return False
    raise ManifestPushError(f"no node changed: the arbiter {now.node} refused manifest uid "
                            f"0x{new.uid:x}: {why}", failed={now.node: why})  # fmt: skip


async def _excused(session: Session, uris: list[SourceUri], nodes: list[NodeManifest],
                   failed: dict[str, str], new: CollectionsManifest,
                   judge: int) -> dict[str, str]:  # fmt: skip
    """The failures left once the nodes that refused ours for a later manifest the
    arbiter holds too are excused: that manifest was made on ours."""
    if not failed:
        return failed
    top = await _read(session, uris[judge], True)
    if top.manifest is None:
        return failed
    index = {n.node: i for i, n in enumerate(nodes)}
    later = await asyncio.gather(*(_read(session, uris[index[k]], True) for k in failed))
    return {k: why for (k, why), n in zip(failed.items(), later, strict=True)
            if n.manifest is None or not new.uid < n.manifest.uid <= top.manifest.uid}  # fmt: skip


def _divergence(judge: NodeManifest, diverged: dict[str, list[Conflict]], what: str,
                next_step: str = REPAIR) -> UprError:  # fmt: skip
    """The one-line error for nodes whose manifests diverge from the arbiter's."""
    assert judge.manifest is not None
    parts = [f"{node}: {', '.join(c.text for c in found) or 'other content, uid not below'}"
             for node, found in diverged.items()]  # fmt: skip
    return ManifestPushError(
        f"{what}: the collections manifests diverge from the arbiter {judge.node} (uid "
        f"0x{judge.manifest.uid:x}) on {'; '.join(parts)}; {next_step}",
        failed=dict.fromkeys(diverged, "diverged"),
    )  # fmt: skip


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
            f"manifest uid 0x{out.manifest.uid:x} not taken by {listed} (taken by "
            f"{', '.join(out.took) or 'no node'}): {REPAIR} once they answer",
            took=out.took, failed=missed,
        )  # fmt: skip
    return out


async def create_collections(
    uri: SourceUri, wanted: Sequence[tuple[Path, int | None]]
) -> CollectionsManifest:
    """Create every scope and collection of `wanted` (paths, each with its max TTL) that
    the cluster `uri` reaches lacks, in one manifest change pushed to every node of its
    map (`change`); returns the new manifest."""
    return (await change(uri, lambda m: with_collections(m, wanted))).manifest


@dataclass
class Repair:
    """What `repair` did: the manifest every node holds now, and where it went."""

    manifest: CollectionsManifest
    arbiter: str
    gave: list[str] = field(default_factory=list)  # nodes given it (the arbiter first)
    dropped: list[str] = field(default_factory=list)  # conflicts dropped (--force)
    warnings: list[str] = field(default_factory=list)


async def repair(uri: SourceUri, *, force: bool = False) -> Repair:
    """Give every node the arbiter's manifest. Conflicts (`conflicts`) stop it, naming
    the nodes and ids, unless `force`: then the conflicting scopes and collections are
    dropped on every node, the arbiter included, and may be created again."""
    session = await connect(uri, name="upr-collections")
    try:
        uris, nodes = await read_all(session)
        _check_ready(nodes)
        judge = await _read_arbiter(session, uris, nodes)
        target = nodes[judge].manifest
        assert target is not None
        diverged = _diverged(nodes, judge)
        found = {node: c for node, c in diverged.items() if c}
        if found and not force:
            raise _divergence(nodes[judge], found, "no node changed", FORCE)
        gone = {(c.kind, c.id) for cs in found.values() for c in cs}
        new = _without(target, gone)
        if new != target or diverged:  # a node at or above the arbiter's uid: go above it
            top = max(n.manifest.uid for n in nodes if n.manifest is not None)
            new = replace(new, uid=max(new.uid, top + 1))
        out = Repair(new, nodes[judge].node, dropped=sorted({c.text for cs in found.values()
                                                             for c in cs}))  # fmt: skip
        if new != target:
            if not await _arbiter_takes(session, uris[judge], target, new):
                raise ManifestPushError("no node changed: the arbiter's manifest changed "
                                        "meanwhile; run the command again")  # fmt: skip
            out.gave.append(out.arbiter)
        failed = await _push(session, uris, nodes, new, skip=judge)
        out.gave += [n.node for i, n in enumerate(nodes) if i != judge and not n.error
                     and n.supported and n.manifest != new and n.node not in failed]  # fmt: skip
        change = _outcome(Change(new, target), nodes, failed)
        out.warnings = change.warnings
        return out
    finally:
        await session.conn.aclose()


def _without(m: CollectionsManifest, gone: set[tuple[str, int]]) -> CollectionsManifest:
    """`m` without the scopes and collections `gone` names, by (kind, id)."""
    scopes = tuple(replace(s, collections=tuple(c for c in s.collections
                                                if ("collection", c.id) not in gone))
                   for s in m.scopes if ("scope", s.id) not in gone)  # fmt: skip
    return m if scopes == m.scopes else replace(m, uid=m.uid + 1, scopes=scopes)


async def read_nodes(uris: Sequence[SourceUri]) -> list[NodeManifest]:
    """The manifest each node holds (its error when it does not answer), read at once."""
    return list(await asyncio.gather(*(_read(None, u, True) for u in uris)))


async def give(conn: Connection, manifest: CollectionsManifest, what: str) -> None:
    """Give one node `manifest` when it holds an older one (it keeps a newer one); a
    ManifestPushError names `what` when it refuses."""
    held = await get_collections_manifest(conn)
    if held is None or held == manifest or held.uid > manifest.uid:
        return
    why = await set_collections_manifest(conn, manifest)
    if why:
        raise ManifestPushError(f"{what}: collections manifest uid {manifest.uid}: {why}",
                                failed={what: why})  # fmt: skip


async def spread(uris: Sequence[SourceUri], targets: Iterable[int]) -> CollectionsManifest | None:
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
