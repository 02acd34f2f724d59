"""The decisions behind pushing a collections manifest to a cluster
(upr_cli/net/collections_manifest.py): which node is the arbiter, which manifest is newest,
what a change pushes, which nodes diverge and with which conflicts, the `--collections`
specs, and the status of nodes that disagree."""

from __future__ import annotations

from pathlib import Path

import pytest

from upr_cli.cluster.control import NodeStatus
from upr_cli.cluster.health import judge
from upr_cli.cluster.spec import ClusterSpec, NodeSpec
from upr_cli.collections import CollectionsManifest
from upr_cli.collections import Path as CPath
from upr_cli.collections import parse_specs as common_parse
from upr_cli.errors import UsageError
from upr_cli.net.collections_manifest import (
    NodeManifest,
    _diverged,
    arbiter,
    conflicts,
    newest,
    next_manifest,
    parse_specs,
    with_specs,
)
from upr_cli.net.collections_manifest import parse_specs as cluster_parse
from upr_cli.node.collection_state import parse_specs as node_parse

APP = CollectionsManifest().with_scope("app")  # uid 1
USERS = APP.with_collection("app", "users")  # uid 2
LOGS = APP.with_collection("app", "logs")  # uid 2 too: a concurrent change


def at(*manifests: CollectionsManifest | None) -> list[NodeManifest]:
    return [NodeManifest(f"127.0.0.1:{1000 + i}", m, supported=m is not None)
            for i, m in enumerate(manifests)]  # fmt: skip


def test_the_newest_manifest_is_the_highest_uid() -> None:
    assert newest(at(APP, USERS, CollectionsManifest())) == USERS
    assert newest(at(None, None)) is None
    assert newest([]) is None


def test_on_a_tie_the_manifest_most_nodes_hold_wins_then_the_first() -> None:
    assert newest(at(USERS, LOGS, LOGS)) == LOGS
    assert newest(at(USERS, LOGS)) == USERS
    assert USERS.uid == LOGS.uid and USERS != LOGS


def test_a_change_is_made_on_the_base_with_a_uid_above_every_node() -> None:
    new = next_manifest(APP, lambda m: m.with_collection("app", "users"), top=1)
    assert new == USERS
    # a node holds uid 7 (it took changes the others missed): ours goes above it
    higher = next_manifest(APP, lambda m: m.with_collection("app", "users"), top=7)
    assert higher.uid == 8 and higher.lookup(CPath("app", "users")) is not None
    assert higher.next_id() > max(c.id for _s, c in higher.collections())
    # an edit that changes nothing keeps the base (no new uid to push)
    assert next_manifest(USERS, lambda m: m, top=5) is USERS


def test_the_arbiter_is_the_first_member_of_the_map() -> None:
    nodes = at(USERS, USERS, USERS)
    assert arbiter(nodes) == 0
    nodes[0] = NodeManifest("127.0.0.1:1000", USERS, member=False)  # failed over
    assert arbiter(nodes) == 1
    assert arbiter([NodeManifest("a", USERS, member=False)]) == 0


# the race of the reviewer's finding: two changes made on one base, each taken by some
# nodes, give one id two names (n0, n1: X; n2: Y)
X = APP.with_collection("app", "x")  # uid 2, id 9
Y = APP.with_collection("app", "y")  # uid 2, id 9 too


def test_conflicts_name_every_id_held_otherwise() -> None:
    assert X.lookup(CPath("app", "x")).id == Y.lookup(CPath("app", "y")).id == 9  # type: ignore[union-attr]
    assert [(c.kind, c.id) for c in conflicts(Y, X)] == [("collection", 9)]
    assert "0x9 app.y (the arbiter's: app.x)" in conflicts(Y, X)[0].text
    # a node behind the arbiter that missed a drop: no conflict (the drop is later)
    dropped = X.without(CPath("app", "x"))
    assert conflicts(X, dropped) == []
    # a node at or above the arbiter's uid with a collection it lacks: nothing says the
    # arbiter dropped it
    ahead = X.with_collection("app", "more")
    assert [c.id for c in conflicts(ahead, X)] == [ahead.max_id]
    # an id of the arbiter's that the node lacks below its highest: the node refuses it
    mine = APP.with_collection("app", "a").with_collection("app", "b")  # ids 9, 10
    theirs = APP.with_collection("app", "c")  # id 9 = c
    found = conflicts(theirs.with_collection("app", "d").with_collection("app", "e"), mine)
    assert {c.id for c in found} >= {9, 10}
    # a scope id under two names
    s1 = CollectionsManifest().with_scope("one")
    s2 = CollectionsManifest().with_scope("two")
    assert [(c.kind, c.id) for c in conflicts(s2, s1)] == [("scope", 8)]
    assert conflicts(X, X) == []


def test_divergence_is_found_against_the_arbiter() -> None:
    same = _diverged(at(X, X, X), 0)
    assert same == {}
    behind = _diverged(at(X, APP, X), 0)  # missed a change: catching up is normal
    assert behind == {}
    race = _diverged(at(X, X, Y), 0)
    assert list(race) == ["127.0.0.1:1002"] and race["127.0.0.1:1002"][0].id == 9
    # the same uid with other content but no collection in conflict is still divergence
    scoped = _diverged(at(X, APP.with_scope("z")), 0)
    assert list(scoped) == ["127.0.0.1:1001"]
    # a node outside the map (failed over) is not judged
    out = at(X, Y)
    out[1] = NodeManifest(out[1].node, Y, member=False)
    assert _diverged(out, 0) == {}


def test_specs_are_checked_and_normalised() -> None:
    assert parse_specs("app, app.users,.orders:60") == ("app", "app.users", "_default.orders:60")
    assert parse_specs(["a.b", "c"]) == ("a.b", "c")
    assert parse_specs(None) == ()
    for bad, why in [
        ("app:60", "belongs to a collection"),
        ("app.users:-1", "0 to 2147483647"),
        ("app.users:2147483648", "0 to 2147483647"),
        ("_default", "always exist"),
        (".", "always exist"),
        ("_sys.x", "not starting with _"),
        ("app._x", "not starting with _"),
        ("app.a$b", "not starting with _"),
        ("a.b.c", "at most one dot"),
        # named twice: which max TTL would win? (the first did, silently)
        ("app.users:3600,app.users:60", "named twice"),
        ("app.users,app.users", "named twice"),
        ("app,app", "named twice"),
    ]:
        with pytest.raises(UsageError, match=why):
            parse_specs(bad)


def test_one_spec_parser_serves_node_and_cluster() -> None:
    assert cluster_parse is node_parse is common_parse


def test_specs_create_what_is_missing_and_keep_what_exists() -> None:
    m = with_specs(CollectionsManifest(), parse_specs("app.users:60,app.logs,inv"))
    users = m.lookup(CPath("app", "users"))
    assert users is not None and users.max_ttl == 60
    assert m.scope("inv") is not None and m.scope("app") is not None
    assert with_specs(m, ["app.users", "inv"]) == m  # nothing to create: the same manifest
    more = with_specs(m, ["app.users", "inv.items"])
    assert more.uid > m.uid and more.lookup(CPath("inv", "items")) is not None


def _status(name: str, port: int, uid: int | None, role: str) -> NodeStatus:
    return NodeStatus(name, port, True, roles={0: role}, states={role: 1}, highs={0: 5},
                      manifest_uid=uid)  # fmt: skip


def test_status_flags_members_whose_manifests_differ(tmp_path: Path) -> None:
    cl = ClusterSpec("default", 1, 1, "admin", "pw",
                     [NodeSpec("n0", 1, adopted=True), NodeSpec("n1", 2, adopted=True)],
                     rev=1, vbmap=[[0, 1]])  # fmt: skip
    same = judge(tmp_path, cl, [_status("n0", 1, 3, "active"), _status("n1", 2, 3, "replica")])
    assert same.actions == [] and not same.degraded
    differ = judge(tmp_path, cl, [_status("n0", 1, 3, "active"), _status("n1", 2, 2, "replica")])
    ((why, command),) = differ.actions
    assert "n0 uid 3, n1 uid 2" in why and command == f"upr cluster start --data {tmp_path}"
    assert differ.to_json()["nodes"][1]["manifest_uid"] == "2"
    # a node without collections (None) is not a disagreement
    old = judge(tmp_path, cl, [_status("n0", 1, 3, "active"), _status("n1", 2, None, "replica")])
    assert old.actions == []
