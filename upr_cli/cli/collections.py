"""`upr collections …`: create, drop and list a bucket's scopes and collections.

The commands parse their arguments, call `upr_cli.cluster.collections` (which reads and
pushes the manifest on every node of the cluster the URI reaches) and render the result.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

import typer

from upr_cli.cli.options import JsonOutput, NodeUri
from upr_cli.cli.output import hint, keep_whole, plural, print_json, stdout, table
from upr_cli.errors import UsageError

if TYPE_CHECKING:
    from upr_cli.cluster.collections import Change, NodeManifest
    from upr_cli.collections import Manifest, ManifestChange

HELP = """Create, drop and list a bucket's scopes and collections, on every node.

A bucket's documents live in collections, grouped in scopes; `_default._default` always
exists (id 0) and holds what clients without collections write. Each change makes a new
manifest with a higher uid, as Couchbase's cluster manager does, and pushes it with
COLLECTIONS_SET_MANIFEST to every node of the cluster map that URI reaches
(formats/cluster.md "Collections"). A change refuses to start while a node that holds
partitions does not answer, and names the nodes that did not take it.

Example:

  upr collections create upr://admin@127.0.0.1:11210/default app.users
  upr collections create upr://admin@127.0.0.1:11210/default app.logs --max-ttl 86400
  upr collections list upr://admin@127.0.0.1:11210/default
  upr collections drop upr://admin@127.0.0.1:11210/default app.logs
"""

app = typer.Typer(name="collections", help=HELP, no_args_is_help=True)
Target = Annotated[
    str,
    typer.Argument(metavar="SCOPE[.COLLECTION]",
                   help="A scope, or a collection in its scope (.C: in _default)."),
]  # fmt: skip


def register(root: typer.Typer) -> None:
    """Add the `collections` command group to the app."""
    root.add_typer(app, name="collections")


@app.command(
    "create",
    no_args_is_help=True,
    help="""Create a scope, or a collection (and its scope when it does not exist).

The new scope or collection gets the next id (from 8; an id is never used twice, so a
collection dropped and created again under its name is a new collection). --max-ttl
caps the expiry of the collection's documents, in seconds: a write with no expiry or a
longer one gets this one. It is an error if the scope or collection exists.

Example:

  upr collections create upr://admin@127.0.0.1:11210/default app
  upr collections create upr://admin@127.0.0.1:11210/default app.sessions --max-ttl 3600
""",
)
def create_cmd(
    uri: NodeUri,
    target: Target,
    max_ttl: Annotated[
        int | None,
        typer.Option(
            "--max-ttl",
            min=0,
            max=0x7FFF_FFFF,
            metavar="SECONDS",
            help="The collection's max TTL (0: none).",
        ),
    ] = None,
    json_out: JsonOutput = False,
) -> None:
    """Create a scope or a collection."""
    from upr_cli.collections import Path

    path = Path.parse(target)
    if max_ttl is not None and path.collection is None:
        raise UsageError("--max-ttl belongs to a collection: give SCOPE.COLLECTION")

    def edit(m: Manifest) -> Manifest:
        if path.collection is None:
            return m.with_scope(path.scope)
        if m.scope(path.scope) is None:
            m = m.with_scope(path.scope)  # a collection's new scope is created with it
        return m.with_collection(path.scope, path.collection, max_ttl)

    _render(_change(uri, edit), json_out)


@app.command(
    "drop",
    no_args_is_help=True,
    help="""Drop a scope (with its collections) or a collection.

Its documents become unreachable at once and are purged in the background, as in
Couchbase; DCP streams carry a system event for the drop, so backups and replays remove
them too. The _default scope cannot be dropped; the _default collection can (as in
Couchbase, it does not come back).

Example:

  upr collections drop upr://admin@127.0.0.1:11210/default app.sessions
  upr collections drop upr://admin@127.0.0.1:11210/default app
""",
)
def drop_cmd(uri: NodeUri, target: Target, json_out: JsonOutput = False) -> None:
    """Drop a scope or a collection."""
    from upr_cli.collections import Path

    path = Path.parse(target)
    _render(_change(uri, lambda m: m.without(path)), json_out)


@app.command(
    "list",
    no_args_is_help=True,
    help="""List the scopes and collections: name, id (hex, as in the manifest), max TTL.

Every node of the cluster is read and the newest manifest (the highest uid) is shown; a
warning on stderr names the nodes that hold another one or do not answer. A server
without collections (before Couchbase Server 7.0) has only _default._default. --json
gives {"uid": "<decimal>", "uid_hex", "scopes": [...], "nodes": [...]}.

Example:

  upr collections list upr://admin@127.0.0.1:11210/default
  upr collections list upr://admin@127.0.0.1:11210/default --json
""",
)
def list_cmd(uri: NodeUri, json_out: JsonOutput = False) -> None:
    """List the scopes and collections."""
    from upr_cli.cluster.collections import cluster_manifests, newest
    from upr_cli.collections import Manifest
    from upr_cli.net.uri import SourceUri

    nodes = asyncio.run(cluster_manifests(SourceUri.parse(uri)))
    answered = [n for n in nodes if not n.error]
    if not answered:
        from upr_cli.cluster.collections import ManifestPushError

        raise ManifestPushError(f"no node answers: {nodes[0].node}: {nodes[0].error}")
    manifest = newest(answered)
    if manifest is None:
        hint("the server does not support collections: everything is in _default._default")
        manifest = Manifest()
    if json_out:
        print_json(manifest_json(manifest) | {"nodes": [_node_json(n) for n in nodes]})
        return
    _table(manifest, f"manifest uid {manifest.uid} (hex {manifest.uid:x}), "
                     f"{plural(len(answered), 'node')}")  # fmt: skip
    _disagreement(nodes, manifest)


# -- rendering ------------------------------------------------------------------------


def _change(uri: str, edit: Any) -> Change:
    from upr_cli.cluster.collections import change
    from upr_cli.net.uri import SourceUri

    return asyncio.run(change(SourceUri.parse(uri), edit))


def manifest_json(m: Manifest) -> dict[str, Any]:
    """A manifest as `--json` shows it (docs/output.md: the 64-bit uid a decimal string,
    next to Couchbase's hex)."""
    return {
        "uid": str(m.uid), "uid_hex": f"{m.uid:x}",
        "scopes": [{"name": s.name, "id": s.id, "id_hex": f"{s.id:x}",
                    "collections": [{"name": c.name, "id": c.id, "id_hex": f"{c.id:x}",
                                     "max_ttl": c.max_ttl} for c in s.collections]}
                   for s in m.scopes],
    }  # fmt: skip


def _node_json(n: NodeManifest) -> dict[str, Any]:
    uid = str(n.manifest.uid) if n.manifest is not None else None
    return {"node": n.node, "uid": uid, "member": n.member, "supported": n.supported,
            "error": n.error}  # fmt: skip


def _render(done: Change, json_out: bool) -> None:
    from upr_cli.collections import changes_between

    m = done.manifest
    described = [_describe(c, m, done.base) for c in changes_between(done.base, m)]
    if json_out:
        changes = [{"change": kind, "path": path, "id": cid, "id_hex": f"{cid:x}"}
                   for kind, path, cid, _ttl in described]  # fmt: skip
        print_json(manifest_json(m) | {"changes": changes, "nodes": done.took})
    else:
        for kind, path, cid, ttl in described:
            what, verb = kind.split("-")
            extra = f", max TTL {ttl}s" if ttl else ""
            _line(f"{verb} {what} {path} (id {cid:x}{extra})")
        _line(f"manifest uid {m.uid} on {plural(len(done.took), 'node')}")
    for warning in done.warnings:
        hint(f"upr: warning: not delivered to {warning}")


def _describe(c: ManifestChange, new: Manifest, old: Manifest) -> tuple[str, str, int, int | None]:
    """(kind, path, id, max TTL) of a change: a created one named from the new manifest,
    a dropped one from the old."""
    m = old if c.dropped else new
    if c.collection_id is not None:
        return c.kind, str(m.path_of(c.collection_id) or c.name), c.collection_id, c.max_ttl
    scope = m.scope_by_id(c.scope_id)
    return c.kind, scope.name if scope is not None else str(c.name), c.scope_id, None


def _table(m: Manifest, title: str) -> None:
    t = table(title)
    for col in ("scope", "collection", "id (hex)", "max TTL"):
        t.add_column(col, justify="left" if col in ("scope", "collection") else "right")
    for s, c in m.collections():
        t.add_row(s.name, c.name, f"{c.id:x}", f"{c.max_ttl}s" if c.max_ttl else "-")
    for s in m.scopes:
        if not s.collections:
            t.add_row(s.name, "(none)", "", "")
    stdout.print(keep_whole(t, "id (hex)", "max TTL"))


def _disagreement(nodes: list[NodeManifest], shown: Manifest) -> None:
    """Warn about nodes that hold another manifest or do not answer."""
    other = [f"{n.node} uid {n.manifest.uid}" for n in nodes
             if n.manifest is not None and n.manifest != shown]  # fmt: skip
    if other:
        hint(f"upr: warning: {', '.join(other)} hold another manifest (the next change, or "
             "`upr cluster start`, gives every node the newest)")  # fmt: skip
    for n in nodes:
        if n.error:
            hint(f"upr: warning: {n.node} does not answer: {n.error}")


def _line(text: str) -> None:
    stdout.print(text, markup=False, highlight=False)
