"""The decisions behind pushing a collections manifest to a cluster
(upr_cli/cluster/collections.py): which manifest is newest, what a change pushes after
a concurrent one, the `--collections` specs, and the status of nodes that disagree."""

from __future__ import annotations

from pathlib import Path

import pytest

from upr_cli.cluster.collections import (
    NodeManifest,
    newest,
    next_manifest,
    parse_specs,
    with_specs,
)
from upr_cli.cluster.control import NodeStatus
from upr_cli.cluster.health import judge
from upr_cli.cluster.spec import ClusterSpec, NodeSpec
from upr_cli.collections import CollectionsError, Manifest
from upr_cli.collections import Path as CPath
from upr_cli.errors import UsageError

APP = Manifest().with_scope("app")  # uid 1
USERS = APP.with_collection("app", "users")  # uid 2
LOGS = APP.with_collection("app", "logs")  # uid 2 too: a concurrent change


def at(*manifests: Manifest | None) -> list[NodeManifest]:
    return [NodeManifest(f"127.0.0.1:{1000 + i}", m, supported=m is not None)
            for i, m in enumerate(manifests)]  # fmt: skip


def test_the_newest_manifest_is_the_highest_uid() -> None:
    assert newest(at(APP, USERS, Manifest())) == USERS
    assert newest(at(None, None)) is None
    assert newest([]) is None


def test_on_a_tie_the_manifest_most_nodes_hold_wins_then_the_first() -> None:
    assert newest(at(USERS, LOGS, LOGS)) == LOGS
    assert newest(at(USERS, LOGS)) == USERS
    assert USERS.uid == LOGS.uid and USERS != LOGS


def test_a_change_is_made_on_the_base_with_a_uid_above_every_node() -> None:
    new = next_manifest(APP, lambda m: m.with_collection("app", "users"), top=1, previous=None)
    assert new == USERS
    # a node holds uid 7 (it took changes the others missed): ours goes above it
    higher = next_manifest(APP, lambda m: m.with_collection("app", "users"), top=7,
                           previous=None)  # fmt: skip
    assert higher.uid == 8 and higher.lookup(CPath("app", "users")) is not None
    assert higher.next_id() > max(c.id for _s, c in higher.collections())


def test_after_a_tie_our_own_manifest_is_pushed_again_above_the_other() -> None:
    # our USERS won the tie on most nodes and is the base again: the edit is in it, so it
    # is not applied twice ("exists"); the same manifest goes out with a higher uid
    def edit(m: Manifest) -> Manifest:
        return m.with_collection("app", "users")

    with pytest.raises(CollectionsError, match="exists"):
        edit(USERS)
    again = next_manifest(USERS, edit, top=USERS.uid, previous=USERS)
    assert again.uid == USERS.uid + 1 and again.scopes == USERS.scopes
    # the other change won: ours is made on it
    merged = next_manifest(LOGS, edit, top=LOGS.uid, previous=USERS)
    assert {str(p) for p in map(merged.path_of, (c.id for _s, c in merged.collections()))} == {
        "_default._default", "app.logs", "app.users"}  # fmt: skip
    assert merged.uid > LOGS.uid


def test_specs_are_checked_and_normalised() -> None:
    assert parse_specs("app, app.users,.orders:60,app.users") == (
        "app", "app.users", "_default.orders:60")  # fmt: skip
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
        ("a.b.c", "at most one dot"),
    ]:
        with pytest.raises(UsageError, match=why):
            parse_specs(bad)


def test_specs_create_what_is_missing_and_keep_what_exists() -> None:
    m = with_specs(Manifest(), parse_specs("app.users:60,app.logs,inv"))
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
