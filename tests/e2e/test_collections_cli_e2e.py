"""`upr collections` against a real `upr serve`: create, list and drop, the errors a
user meets, `upr serve --collections`, and a change made again after a concurrent one."""

from __future__ import annotations

import json
import threading

from tests.e2e.collections_helpers import get_manifest, set_manifest
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import run
from upr_cli.cluster.collections import change, fetch_manifest
from upr_cli.collections import Manifest, Path
from upr_cli.net.uri import SourceUri


def collections(*args: str, check: bool = True) -> tuple[int, str, str]:
    r = upr("collections", *args, check=check)
    return r.returncode, r.stdout, r.stderr


def test_create_list_and_drop(node: Node) -> None:
    uri = node.uri
    code, out, _ = collections("list", uri)
    assert code == 0 and "manifest uid 0" in out
    assert [line.split()[:2] for line in out.splitlines()[3:]] == [["_default", "_default"]]
    # a collection in a scope that does not exist: the scope is created with it
    _, out, _ = collections("create", uri, "app.users")
    assert out.splitlines() == ["created scope app (id 8)", "created collection app.users (id 9)",
                                "manifest uid 2 on 1 node"]  # fmt: skip
    _, out, _ = collections("create", uri, "app.logs", "--max-ttl", "3600")
    assert out.splitlines()[0] == "created collection app.logs (id a, max TTL 3600s)"
    m = get_manifest(uri)
    assert m.uid == 3 and m.lookup(Path("app", "logs")) is not None
    assert m.lookup(Path("app", "logs")).max_ttl == 3600  # type: ignore[union-attr]
    _, out, _ = collections("list", uri)
    rows = [line.split() for line in out.splitlines()[3:]]
    assert rows == [["_default", "_default", "0", "-"], ["app", "users", "9", "-"],
                    ["app", "logs", "a", "3600s"]]  # fmt: skip
    doc = json.loads(collections("list", uri, "--json")[1])
    assert doc["uid"] == "3" and doc["uid_hex"] == "3"
    app = doc["scopes"][1]
    assert (app["name"], app["id"], app["id_hex"]) == ("app", 8, "8")
    assert app["collections"][1] == {"name": "logs", "id": 10, "id_hex": "a", "max_ttl": 3600}
    assert doc["nodes"] == [{"node": f"127.0.0.1:{node.port}", "uid": "3", "member": True,
                             "supported": True, "error": ""}]  # fmt: skip
    # a scope with its collections; then the _default collection (allowed, as in Couchbase)
    done = json.loads(collections("drop", uri, "app", "--json")[1])
    assert [(c["change"], c["path"]) for c in done["changes"]] == [
        ("collection-dropped", "app.users"), ("collection-dropped", "app.logs"),
        ("scope-dropped", "app")]  # fmt: skip
    collections("drop", uri, "_default._default")
    after = get_manifest(uri)
    assert [s.name for s in after.scopes] == ["_default"] and after.scopes[0].collections == ()
    # a name dropped and created again is a new collection: a new id
    _, out, _ = collections("create", uri, "app.users")
    assert out.splitlines()[:2] == [
        "created scope app (id d)",
        "created collection app.users (id e)",
    ]
    # the manifest survives a SIGKILL
    held = get_manifest(uri)
    node.kill()
    node.start()
    assert held.uid == 7 and get_manifest(node.uri) == held


def test_errors_are_one_line_and_change_nothing(node: Node) -> None:
    uri = node.uri
    collections("create", uri, "app.users")
    before = get_manifest(uri)
    for args, code, why in [
        (("create", uri, "app.users"), 1, "collection app.users already exists"),
        (("create", uri, "app"), 1, "scope 'app' already exists"),
        (("drop", uri, "nope.x"), 1, "scope 'nope' does not exist"),
        (("drop", uri, "app.nope"), 1, "collection app.nope does not exist"),
        (("drop", uri, "_default"), 1, "the _default scope cannot be dropped"),
        (("create", uri, "_system.x"), 1, "not starting with _"),
        (("create", uri, "app.bad name"), 2, "letters, digits"),
        (("create", uri, "a.b.c"), 2, "at most one dot"),
        (("create", uri, "app", "--max-ttl", "60"), 2, "--max-ttl belongs to a collection"),
        (("list", "upr://admin:pw@127.0.0.1:1/default"), 1, "cannot connect to 127.0.0.1:1"),
    ]:
        got, out, err = collections(*args, check=False)
        assert (got, out) == (code, ""), (args, got, out, err)
        assert len(err.splitlines()) == 1 and why in err and "Traceback" not in err, (args, err)
    assert get_manifest(uri) == before


def test_serve_creates_collections_at_start(node_factory: type[Node]) -> None:
    n = node_factory("--collections", "app.users,app.sessions:60,.orders").start()
    m = get_manifest(n.uri)
    made = [(str(m.path_of(c.id)), c.id) for _s, c in m.collections()]
    # in spec order: scope app 8, app.users 9, app.sessions a, _default.orders b
    assert made == [("_default._default", 0), ("_default.orders", 0xB), ("app.users", 9),
                    ("app.sessions", 0xA)]  # fmt: skip
    sessions = m.lookup(Path("app", "sessions"))
    assert sessions is not None and sessions.max_ttl == 60
    # a restart keeps them (none created again: the same manifest)
    n.stop()
    n.start()
    assert get_manifest(n.uri) == m
    # a bad spec: one line, exit 2, no node
    bad = upr("serve", "--data", str(n.data), "--no-auth", "--port", "0", "--collections",
              "app:60", check=False)  # fmt: skip
    assert bad.returncode == 2 and "belongs to a collection" in bad.stderr
    assert len(bad.stderr.splitlines()) == 1


def test_a_change_is_made_again_on_a_concurrent_one(node: Node) -> None:
    uri = SourceUri.parse(node.uri)
    calls: list[int] = []

    def edit(m: Manifest) -> Manifest:
        calls.append(m.uid)
        if len(calls) == 1:  # another manager's change lands between our read and push
            other = threading.Thread(target=set_manifest, args=(node.uri, m.with_scope("theirs")))
            other.start()
            other.join()
        return m.with_scope("ours")

    done = run(change(uri, edit))
    assert done.attempts == 2 and calls == [0, 1]  # made again on their manifest (uid 1)
    m = run(fetch_manifest(uri))
    assert m == done.manifest and {s.name for s in m.scopes} == {"_default", "theirs", "ours"}
    assert m.uid == 2
