"""`upr collections …`: create, drop and list a bucket's scopes and collections.

The commands parse their arguments, call `upr_cli.net.collections_manifest` (which reads and
pushes the manifest on every node of the cluster the URI reaches) and render the result.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from upr_cli.cli.options import (
    CaCert,
    ClientCert,
    ClientKey,
    JsonOutput,
    NodeUri,
    NoVerify,
    PasswordFile,
    tls_source,
)
from upr_cli.cli.output import hint, keep_whole, plural, print_json, stdout, table
from upr_cli.errors import UsageError

if TYPE_CHECKING:
    from upr_cli.collections import CollectionsManifest, ManifestChange
    from upr_cli.net.collections_manifest import Change, NodeManifest
    from upr_cli.net.uri import SourceUri

_T = TypeVar("_T")

HELP = """Create, drop and list a bucket's scopes and collections, on every node.

A bucket's documents live in collections, grouped in scopes; `_default._default` always
exists (id 0) and holds what clients without collections write. Each change makes a new
manifest with a higher uid, as Couchbase's cluster manager does, and pushes it with
COLLECTIONS_SET_MANIFEST to every node of the cluster map that URI reaches: first to
the arbiter (the first node of the map that holds partitions), which serialises
concurrent changes, then to the others (formats/cluster.md "Collections"). A change
refuses to start while a node that holds partitions does not answer, or while nodes
diverge from the arbiter; `repair` gives them the arbiter's manifest.

Example:

  upr collections create upr://admin@127.0.0.1:11210/default app.users
  upr collections create upr://admin@127.0.0.1:11210/default app.logs --max-ttl 86400
  upr collections list upr://admin@127.0.0.1:11210/default
  upr collections drop upr://admin@127.0.0.1:11210/default app.logs
  upr collections repair upr://admin@127.0.0.1:11210/default

Over TLS (uprs://… or couchbases://…, default port 11207) every node of the map is
reached on its TLS data port; --cacert FILE (or UPR_CACERT) names the CA, --cert and
--key a client certificate.

Example (over TLS):

  upr collections list uprs://admin@db.example.com/default --cacert ca.pem
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
    help="""Create a scope, or a collection (and its scope when it does not exist).

The new scope or collection gets the next id (from 8; an id is never used twice, so a
collection dropped and created again under its name is a new collection). --max-ttl
caps the expiry of the collection's documents, in seconds: a write with no expiry or a
longer one gets this one. It is an error if the scope or collection exists. A name not
allowed (letters, digits and _ - % only, not starting with _ or %; the _default scope
and collection exist from the start, and a dropped _default collection never comes
back) is a usage error (exit 2), found before any node is asked.

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
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Create a scope or a collection."""
    from upr_cli.collections import creatable

    path = creatable(target)
    if max_ttl is not None and path.collection is None:
        raise UsageError("--max-ttl belongs to a collection: give SCOPE.COLLECTION")

    def edit(m: CollectionsManifest) -> CollectionsManifest:
        if path.collection is None:
            return m.with_scope(path.scope)
        if m.scope(path.scope) is None:
            m = m.with_scope(path.scope)  # a collection's new scope is created with it
        return m.with_collection(path.scope, path.collection, max_ttl)

    def done(m: CollectionsManifest) -> bool:
        if path.collection is None:
            return m.scope(path.scope) is not None
        held = m.lookup(path)
        return held is not None and (held.max_ttl or None) == (max_ttl or None)

    _render(_change(_uri(uri, cacert, no_verify, cert, key), edit, done), json_out)


@app.command(
    "drop",
    help="""Drop a scope (with its collections) or a collection.

Its documents become unreachable at once and are purged in the background, as in
Couchbase; DCP streams carry a system event for the drop, so backups and replays remove
them too. The _default scope cannot be dropped. The _default collection can, with
--force only: as in Couchbase it never comes back, and clients without collections
(which see only it) then see nothing.

Example:

  upr collections drop upr://admin@127.0.0.1:11210/default app.sessions
  upr collections drop upr://admin@127.0.0.1:11210/default app
""",
)
def drop_cmd(
    uri: NodeUri,
    target: Target,
    force: Annotated[
        bool, typer.Option("--force", help="Allow dropping _default._default (for good).")
    ] = False,
    json_out: JsonOutput = False,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Drop a scope or a collection."""
    from upr_cli.collections import DEFAULT, Path

    path = Path.parse(target)
    if (path.scope, path.collection) == (DEFAULT, DEFAULT) and not force:
        raise UsageError("_default._default: dropping it purges its documents, it never comes "
                         "back, and clients without collections then see nothing; add --force "
                         "to drop it")  # fmt: skip

    def gone(m: CollectionsManifest) -> bool:
        return m.scope(path.scope) is None or (
            path.collection is not None and m.lookup(path) is None
        )

    source = _uri(uri, cacert, no_verify, cert, key)
    _render(_change(source, lambda m: m.without(path), gone), json_out)


@app.command(
    "list",
    help="""List the scopes and collections: name, id (0x hex), max TTL.

Every node of the cluster is read and the newest manifest (the highest uid) is shown; a
warning on stderr names the nodes that hold another one or do not answer. Long names
fold within the terminal's width (COLUMNS). A server
without collections (before Couchbase Server 7.0) has only _default._default. --json
gives {"uid": "<decimal>", "uid_hex", "scopes": [...], "nodes": [...]}.

Example:

  upr collections list upr://admin@127.0.0.1:11210/default
  upr collections list upr://admin@127.0.0.1:11210/default --json
""",
)
def list_cmd(
    uri: NodeUri,
    json_out: JsonOutput = False,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """List the scopes and collections."""
    from upr_cli.collections import CollectionsManifest
    from upr_cli.net.collections_manifest import cluster_manifests, newest

    source = _uri(uri, cacert, no_verify, cert, key)
    nodes = _run(source, cluster_manifests(source))
    answered = [n for n in nodes if not n.error]
    if not answered:
        from upr_cli.net.collections_manifest import ManifestPushError

        raise ManifestPushError(f"no node answers: {nodes[0].node}: {nodes[0].error}")
    manifest = newest(answered)
    if manifest is None:
        hint("the server does not support collections: everything is in _default._default")
        manifest = CollectionsManifest()
    if json_out:
        print_json(manifest_json(manifest) | {"nodes": [_node_json(n) for n in nodes]})
        return
    _table(manifest, f"manifest uid 0x{manifest.uid:x}, {plural(len(answered), 'node')}")
    _disagreement(nodes, manifest)


@app.command(
    "repair",
    help="""Give every node the arbiter's manifest when the nodes' manifests differ.

The arbiter is the first node of the cluster map that holds partitions: every change
goes to it first. Nodes behind it (they missed a change) get its manifest. Nodes that
diverge (their own changes, by hand or by an older upr) get it too, unless they
hold a scope or collection id that the arbiter has under another name, or one the
arbiter does not have: documents may sit under either, so repair refuses, naming the
nodes and ids. --force then drops every such scope and collection on every node, the
arbiter included (create them again afterwards: they get new ids). `upr cluster start`
gives nodes that are behind the newest manifest, but does not repair a divergence.

Example:

  upr collections repair upr://admin@127.0.0.1:11210/default
  upr collections repair upr://admin@127.0.0.1:11210/default --force
""",
)
def repair_cmd(
    uri: NodeUri,
    force: Annotated[
        bool,
        typer.Option("--force", help="Drop conflicting scopes and collections everywhere."),
    ] = False,
    json_out: JsonOutput = False,
    password_file: PasswordFile = None,
    cacert: CaCert = None,
    no_verify: NoVerify = False,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Give every node the arbiter's manifest."""
    from upr_cli.net.collections_manifest import repair

    source = _uri(uri, cacert, no_verify, cert, key)
    done = _run(source, repair(source, force=force))
    if json_out:
        print_json(manifest_json(done.manifest) | {
            "arbiter": done.arbiter, "gave": done.gave, "dropped_collections": done.dropped,
        })  # fmt: skip
    else:
        for text in done.dropped:
            _line(f"dropped collection {text}" if not text.startswith("scope") else
                  f"dropped {text}")  # fmt: skip
        given = f"given to {', '.join(done.gave)}" if done.gave else "every node holds it"
        _line(f"manifest uid 0x{done.manifest.uid:x} of the arbiter {done.arbiter}: {given}")
    for warning in done.warnings:
        hint(f"upr: warning: not delivered to {warning}")


# -- rendering ------------------------------------------------------------------------


def _uri(text: str, cacert: CaCert, no_verify: bool, cert: ClientCert, key: ClientKey
         ) -> SourceUri:  # fmt: skip
    """The node URI with the TLS options (used when it is uprs:// or couchbases://)."""
    from upr_cli.net.uri import SourceUri

    return tls_source(SourceUri.parse(text), cacert, no_verify, cert, key)


def _change(uri: SourceUri, edit: Any, done: Any) -> Change:
    from upr_cli.net.collections_manifest import change

    return _run(uri, change(uri, edit, done=done))


def _run(uri: SourceUri, work: Coroutine[Any, Any, _T]) -> _T:
    """Run `work`; a failure to reach `uri` says which URI (credentials left out)."""
    from upr_cli.errors import UprError

    try:
        return asyncio.run(work)
    except UprError as exc:
        text = _readable(str(exc))
        shown = uri.redacted()
        if text.startswith(("cannot connect", "connecting to")) and shown not in text:
            text = f"{shown}: {text}"
        exc.args = (text,)
        raise


def _readable(text: str) -> str:
    """`text` with a JSON error body in it (`{"error": {"context": ...}}`, from a status
    error) replaced by its context."""
    from upr_cli.protocol.status import error_context

    at = text.find("{")
    return text if at < 0 else text[:at] + error_context(text[at:].encode())


def manifest_json(m: CollectionsManifest) -> dict[str, Any]:
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
            _line(f"{verb} {what} {path} (id 0x{cid:x}{extra})")
        _line(f"manifest uid 0x{m.uid:x} on {plural(len(done.took), 'node')}")
    for warning in done.warnings:
        hint(f"upr: warning: not delivered to {warning}")


def _describe(
    c: ManifestChange, new: CollectionsManifest, old: CollectionsManifest
) -> tuple[str, str, int, int | None]:
    """(kind, path, id, max TTL) of a change: a created one named from the new manifest,
    a dropped one from the old."""
    m = old if c.dropped else new
    if c.collection_id is not None:
        return c.kind, str(m.path_of(c.collection_id) or c.name), c.collection_id, c.max_ttl
    scope = m.scope_by_id(c.scope_id)
    return c.kind, scope.name if scope is not None else str(c.name), c.scope_id, None


def _table(m: CollectionsManifest, title: str) -> None:
    t = table(title)
    for col in ("scope", "collection"):
        t.add_column(col, overflow="fold")  # a 251-byte name folds, never widens the rows
    for col in ("id", "max TTL"):
        t.add_column(col, justify="right", no_wrap=True)
    for s, c in m.collections():
        t.add_row(s.name, c.name, f"0x{c.id:x}", f"{c.max_ttl}s" if c.max_ttl else "-")
    for s in m.scopes:
        if not s.collections:
            t.add_row(s.name, "(none)", "", "")
    stdout.print(keep_whole(t, "id", "max TTL"), width=_width())


def _width() -> int:
    """The table's width: COLUMNS or the terminal's when there is one (piped: 200, as
    every table, upr_cli/cli/output.py)."""
    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return shutil.get_terminal_size((200, 24)).columns
    return 200


def _disagreement(nodes: list[NodeManifest], shown: CollectionsManifest) -> None:
    """Warn about nodes that hold another manifest or do not answer."""
    other = [f"{n.node} uid 0x{n.manifest.uid:x}" for n in nodes
             if n.manifest is not None and n.manifest != shown]  # fmt: skip
    if other:
        hint(f"upr: warning: {', '.join(other)} hold another manifest (`upr collections "
             "repair` gives every node the arbiter's)")  # fmt: skip
    for n in nodes:
        if n.error:
            hint(f"upr: warning: {n.node} does not answer: {n.error}")


def _line(text: str) -> None:
    stdout.print(text, markup=False, highlight=False)
