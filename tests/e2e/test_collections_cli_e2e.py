"""`upr collections` against a real `upr serve`: create, list and drop, the errors a
user meets, `upr serve --create-collections`, and a change made again after a concurrent one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from tests.e2e.collections_helpers import get_manifest, set_manifest
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import run
from upr_cli.collections import CollectionsManifest, Path
from upr_cli.net.collections_manifest import change, fetch_collections_manifest
from upr_cli.net.uri import SourceUri


def collections(*args: str, check: bool = True) -> tuple[int, str, str]:
    r = upr("collections", *args, check=check)
    return r.returncode, r.stdout, r.stderr


def test_create_list_and_drop(node: Node) -> None:
    uri = node.uri
    code, out, _ = collections("list", uri)
    assert code == 0 and "manifest uid 0x0" in out
    assert [line.split()[:2] for line in out.splitlines()[3:]] == [["_default", "_default"]]
    # a collection in a scope that does not exist: the scope is created with it; ids and
    # uids are hex with 0x (bare "id 17" read as decimal next to tail's decimal ids)
    _, out, _ = collections("create", uri, "app.users")
    assert out.splitlines() == ["created scope app (id 0x8)",
                                "created collection app.users (id 0x9)",
                                "manifest uid 0x2 on 1 node"]  # fmt: skip
    _, out, _ = collections("create", uri, "app.logs", "--max-ttl", "3600")
    assert out.splitlines()[0] == "created collection app.logs (id 0xa, max TTL 3600s)"
    m = get_manifest(uri)
    assert m.uid == 3 and m.lookup(Path("app", "logs")) is not None
    assert m.lookup(Path("app", "logs")).max_ttl == 3600  # type: ignore[union-attr]
    _, out, _ = collections("list", uri)
    rows = [line.split() for line in out.splitlines()[3:]]
    assert rows == [["_default", "_default", "0x0", "-"], ["app", "users", "0x9", "-"],
                    ["app", "logs", "0xa", "3600s"]]  # fmt: skip
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
    # _default._default only with --force: every client without collections sees it alone
    for path in ("_default._default", "."):
        code, out, err = collections("drop", uri, path, check=False)
        assert (code, out) == (2, "") and len(err.splitlines()) == 1, err
        assert "clients without collections then see nothing; add --force" in err
    assert get_manifest(uri).lookup(Path("_default", "_default")) is not None
    collections("drop", uri, "_default._default", "--force")
    after = get_manifest(uri)
    assert [s.name for s in after.scopes] == ["_default"] and after.scopes[0].collections == ()
    # it does not come back (it said "invalid characters" for `.`)
    for path in (".", "_default._default", "app._default"):
        code, out, err = collections("create", uri, path, check=False)
        assert (code, out) == (2, ""), (path, err)
        assert "the _default collection cannot be created" in err and len(err.splitlines()) == 1
    # a name dropped and created again is a new collection: a new id
    _, out, _ = collections("create", uri, "app.users")
    assert out.splitlines()[:2] == [
        "created scope app (id 0xd)",
        "created collection app.users (id 0xe)",
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
    rule = "letters, digits and _ - % only, not starting with _ or %"
    down = "upr://admin@127.0.0.1:1/default"
    needs_user = (f"the node requires a user: put it in the URI (upr://USER@127.0.0.1:"
                  f"{node.port}/default) and set UPR_PASSWORD")  # fmt: skip
    for args, code, why in [
        (("create", uri, "app.users"), 1, "collection app.users already exists"),
        (("create", uri, "app"), 1, "scope 'app' already exists"),
        (("drop", uri, "nope.x"), 1, "scope 'nope' does not exist"),
        (("drop", uri, "app.nope"), 1, "collection app.nope does not exist"),
        (("drop", uri, "_default"), 1, "the _default scope cannot be dropped"),
        # a name that cannot be created: always a usage error, with one message (exit
        # codes were 1 or 2 depending on where it was found)
        (("create", uri, "_system.x"), 2, f"scope name '_system': {rule}"),
        (("create", uri, "app._x"), 2, f"collection name '_x': {rule}"),
        (("create", uri, "app.%x"), 2, f"collection name '%x': {rule}"),
        (("create", uri, "app.a$b"), 2, f"collection name 'a$b': {rule}"),
        (("create", uri, "app.é"), 2, f"collection name 'é': {rule}"),
        (("create", uri, "app.bad name"), 2, f"collection name 'bad name': {rule}"),
        (("create", uri, "_default"), 2, "the _default scope always exists"),
        (("create", uri, "a.b.c"), 2, "at most one dot"),
        (("create", uri, "app", "--max-ttl", "60"), 2, "--max-ttl belongs to a collection"),
        # a missing argument: one line and the hint, for every subcommand
        (("list",), 2, "Missing argument 'URI'. (see 'upr collections list --help')"),
        (("create", uri), 2, "Missing argument 'SCOPE[.COLLECTION]'"),
        (("drop",), 2, "Missing argument 'URI'"),
        (("repair",), 2, "Missing argument 'URI'"),
        # the URI that failed, and the reason once
        (("list", down), 1, f"{down}: cannot connect to 127.0.0.1:1: "),
        # no user on a node that has users: what to give, not the server's EACCESS
        (("list", f"upr://127.0.0.1:{node.port}/default"), 1, needs_user),
    ]:
        got, out, err = collections(*args, check=False)
        assert (got, out) == (code, ""), (args, got, out, err)
        assert len(err.splitlines()) == 1 and why in err and "Traceback" not in err, (args, err)
        assert '{"error"' not in err, err
    # the names are refused before any node is asked: a URI nobody listens on is not tried
    got, _, err = collections("create", down, "app._x", check=False)
    assert got == 2 and rule in err
    assert get_manifest(uri) == before


def test_list_fits_the_terminal(node: Node) -> None:
    long = "c" * 251
    collections("create", node.uri, f"app.{long}")
    env = dict(os.environ, COLUMNS="80")
    env.pop("UPR_PASSWORD", None)
    cmd = [sys.executable, "-m", "upr_cli", "collections", "list", node.uri]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=True)
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80, r.stdout  # one long name widened every row to ~200
    folded = "".join(t for line in lines for t in line.split() if set(t) == {"c"})
    assert folded == long, r.stdout  # folded whole, not cut
    assert any(line.split()[-2:] == ["0x9", "-"] for line in lines), r.stdout


def test_serve_creates_collections_at_start(node_factory: type[Node]) -> None:
    n = node_factory("--create-collections", "app.users,app.sessions:60,.orders").start()
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
    for spec, why in [("app:60", "belongs to a collection"),
                      ("app.users:3600,app.users:60", "app.users is named twice")]:  # fmt: skip
        bad = upr("serve", "--data", str(n.data), "--no-auth", "--port", "0",
                  "--create-collections", spec, check=False)  # fmt: skip
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr
        assert len(bad.stderr.splitlines()) == 1
    # a restart with another max TTL: the spec only creates, and the node says so
    n.stop()
    n.args = ["--create-collections", "app.users,app.sessions:3600,.orders"]
    n.start()
    assert get_manifest(n.uri) == m  # unchanged
    assert n.proc is not None
    n.proc.send_signal(signal.SIGTERM)
    _, err = n.proc.communicate(timeout=60)
    n.close()
    warned = [line for line in err.splitlines() if "WARNING" in line]
    assert len(warned) == 1 and "app.sessions exists with max TTL 60s, not 3600s" in warned[0]


def test_a_change_is_made_again_on_a_concurrent_one(node: Node) -> None:
    uri = SourceUri.parse(node.uri)
    calls: list[int] = []

    def edit(m: CollectionsManifest) -> CollectionsManifest:
        calls.append(m.uid)
        if len(calls) == 1:  # another manager's change lands between our read and push
            other = threading.Thread(target=set_manifest, args=(node.uri, m.with_scope("theirs")))
            other.start()
            other.join()
        return m.with_scope("ours")

    done = run(change(uri, edit))
    assert done.attempts == 2 and calls == [0, 1]  # made again on their manifest (uid 1)
    m = run(fetch_collections_manifest(uri))
    assert m == done.manifest and {s.name for s in m.scopes} == {"_default", "theirs", "ours"}
    assert m.uid == 2


def test_a_retry_that_finds_its_change_made_succeeds(node: Node) -> None:
    # the reviewer's finding: a create that had to be made again after a concurrent
    # change said "collection race.a1 already exists" (exit 1), though it was there
    uri = SourceUri.parse(node.uri)
    calls: list[int] = []

    def edit(m: CollectionsManifest) -> CollectionsManifest:
        calls.append(m.uid)
        if len(calls) == 1:  # the same collection, and more, lands before our push
            theirs = m.with_scope("race").with_collection("race", "a1").with_scope("other")
            other = threading.Thread(target=set_manifest, args=(node.uri, theirs))
            other.start()
            other.join()
        if m.scope("race") is None:
            m = m.with_scope("race")
        return m.with_collection("race", "a1")

    done = run(change(uri, edit, done=lambda m: m.lookup(Path("race", "a1")) is not None))
    assert done.attempts == 2 and calls == [0]  # not edited again: the result holds
    held = run(fetch_collections_manifest(uri))
    assert done.manifest == held and {s.name for s in held.scopes} == {"_default", "race", "other"}
    # a retry whose target does not hold (another max TTL) is still an error
    r = upr("collections", "create", node.uri, "race.a1", "--max-ttl", "5", check=False)
    assert r.returncode == 1 and "already exists" in r.stderr
