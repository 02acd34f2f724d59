"""`upr tail` with collections: names in every line, server-side filters, system events.

The first tests pin the line formats down without a node; the others run `upr tail`
against `upr serve` with collections created and dropped through the raw management
calls (COLLECTIONS_SET_MANIFEST), and documents written with collection-prefixed keys.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.cli.json_convention import problems
from tests.e2e import collections_helpers as coll
from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import run, spawn_upr, wait_persisted
from upr_cli.collections import CollectionsManifest, ManifestChange
from upr_cli.jobs.tail import (
    CollectionNames,
    Followed,
    event_line,
    filter_text,
    json_line,
    load_state,
    save_state,
    text_line,
)
from upr_cli.net.bootstrap import connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.protocol.messages import Set

APP = CollectionsManifest().with_scope("app").with_collection("app", "users")  # scope 8, users 9


def rec(key: bytes, collection: int) -> DcpRecord:
    return DcpRecord(OP_MUTATION, 3, 12, 1, 77, 0, 0, 0, 1, memoryview(key),
                     memoryview(b'{"a":1}'), 1, collection)  # fmt: skip


# -- line formats ---------------------------------------------------------------------


def test_json_lines_name_the_scope_and_collection() -> None:
    names = CollectionNames(APP)
    users = json.loads(json_line(rec(b"u1", 9), names))
    assert (users["scope"], users["collection"], users["key"]) == ("app", "users", "u1")
    default = json.loads(json_line(rec(b"d1", 0)))  # no manifest: the default collection
    assert (default["scope"], default["collection"]) == ("_default", "_default")
    unknown = json.loads(json_line(rec(b"x", 0x44), names))
    assert unknown["scope"] is None and unknown["collection"] is None
    assert not problems(users)


def test_text_lines_prefix_keys_outside_the_default_collection() -> None:
    names = CollectionNames(APP)
    assert " key=app.users:u1 " in text_line(rec(b"u1", 9), names)
    assert " key=d1 " in text_line(rec(b"d1", 0), names)  # as before collections
    assert " key=0x44:x " in text_line(rec(b"x", 0x44), names)


def test_names_follow_created_collections_and_outlive_drops() -> None:
    names = CollectionNames(APP)
    names.json_fields(0x0B)  # cached as unknown before the creation arrives
    names.follow(ManifestChange(3, 20, "scope-created", 3, 0x0A, None, "shop"))
    names.follow(ManifestChange(3, 21, "collection-created", 4, 0x0A, 0x0B, "carts"))
    names.follow(ManifestChange(3, 22, "collection-dropped", 5, 0x0A, 0x0B))
    assert json.loads(json_line(rec(b"c", 0x0B), names))["collection"] == "carts"
    assert names.path(0x0B) == "shop.carts"  # a lagging partition still names it


def test_verbose_lines_show_manifest_changes() -> None:
    names = CollectionNames(APP)
    created = ManifestChange(3, 2**64 - 2, "collection-created", 2**63, 8, 9, "users", 60)
    obj = json.loads(event_line(created, "json", names) or "")
    assert obj == {"op": "system_event", "event": "collection-created", "partition": 3,
                   "seq": str(2**64 - 2), "scope": "app", "collection": "users", "collection_id": 9,
                   "manifest_uid": str(2**63), "max_ttl": 60}  # fmt: skip
    assert not problems(obj)
    scope = json.loads(event_line(ManifestChange(3, 5, "scope-dropped", 7, 8), "json", names) or "")
    assert scope == {"op": "system_event", "event": "scope-dropped", "partition": 3, "seq": "5",
                     "scope": "app", "scope_id": 8, "manifest_uid": "7"}  # fmt: skip
    text = event_line(created, "text", names) or ""
    assert text.startswith("# partition=3 ") and text.endswith("[collection-created]")
    assert "collection=users collection_id=0x9 " in text


def test_a_drop_names_what_it_can_and_never_prints_none() -> None:
    names = CollectionNames(APP, {0x1C: ("crash", "c1")})  # the state file's names
    old = json.loads(event_line(ManifestChange(0, 9, "collection-dropped", 22, 0x0A, 0x1C),
                                "json", names) or "")  # fmt: skip
    assert (old["scope"], old["collection"], old["collection_id"]) == ("crash", "c1", 0x1C)
    # a collection gone before the tail started, in a scope gone too: the id alone
    gone = ManifestChange(0, 9, "collection-dropped", 22, 0x0A, 0x0B)
    obj = json.loads(event_line(gone, "json", names) or "")
    assert "scope" not in obj and "collection" not in obj and obj["collection_id"] == 0x0B
    text = event_line(gone, "text", names) or ""
    assert "None" not in text and " collection_id=0xb " in text
    assert " scope=app " in (event_line(replace(gone, scope_id=8), "text", names) or "")
    scope = event_line(ManifestChange(0, 9, "scope-dropped", 22, 0x0A), "text", names) or ""
    assert "None" not in scope and " scope_id=0xa " in scope


def test_the_state_file_keeps_what_a_filter_followed_and_reads_version_2(
    tmp_path: Path,
) -> None:
    pos = {0: StreamPosition(0, 7, 12, 10, 12), 1: StreamPosition(1, 7, 3, 3, 3)}
    followed = Followed("crash.c1", {0: {0x1C}, 1: {0x1C, 0x1E}}, {0x1C: ("crash", "c1")})
    path = tmp_path / "st.json"
    save_state(path, pos, {}, {0: [10, 12]}, followed)
    data = json.loads(path.read_text())
    assert data["version"] == 3 and data["collections"] == {
        "filter": "crash.c1", "followed": {"0": [28], "1": [28, 30]},
        "names": {"28": ["crash", "c1"]}}  # fmt: skip
    assert load_state(path) == (pos, {}, {0: [10, 12]}, followed)
    save_state(path, pos, {})  # no filter: no collections
    assert "collections" not in json.loads(path.read_text())
    # a version 2 file (before collections) resumes without followed ids
    path.write_text(json.dumps({"version": 2, "positions": [pos[0].to_json()],
                                "failover_logs": {}, "boundaries": {"0": ["12"]}}))  # fmt: skip
    assert load_state(path) == ({0: pos[0]}, {}, {0: [12]}, None)
    assert filter_text([coll.Path("b"), coll.Path("a", "x")]) == "a.x,b"


# -- against upr serve ----------------------------------------------------------------


async def _write(uri: str, docs: list[tuple[int, str]]) -> None:
    """SET `{"k": key}` for each (collection id, key), the key prefixed by its id."""
    s = await connect(SourceUri.parse(uri))
    try:
        for cid, key in docs:
            k = key.encode()
            msg = Set(vbucket=partition_of(k, s.num_partitions), key=s.qualify(k, cid),
                      value=json.dumps({"k": key}).encode(), datatype=1,
                      opaque=s.conn.next_opaque())  # fmt: skip
            await s.conn.request(msg)
    finally:
        await s.conn.aclose()


def _lines(*args: str) -> list[dict[str, Any]]:
    out = upr("tail", *args, "--until-end", "--format", "json")
    return [json.loads(line) for line in out.stdout.splitlines()]


def _rows(*args: str) -> list[dict[str, Any]]:
    """The change lines (not the collection events, which have "event", not "op")."""
    return [r for r in _lines(*args) if "event" not in r]  # the changes


@pytest.fixture
def bucket(node: Node) -> Node:
    """A node with documents in the default collection, app.users and app.carts, and
    app.orders created, written to and dropped."""
    m = coll.create(node.uri, "app.users", "app.orders")
    users, orders = (m.lookup(coll.Path("app", c)) for c in ("users", "orders"))
    assert users is not None and orders is not None
    docs = [(0, f"d{i}") for i in range(5)] + [(users.id, f"u{i}") for i in range(5)]
    run(_write(node.uri, docs + [(orders.id, f"o{i}") for i in range(5)]))
    coll.drop(node.uri, "app.orders")
    carts = coll.create(node.uri, "app.carts").lookup(coll.Path("app", "carts"))
    assert carts is not None
    run(_write(node.uri, [(carts.id, "c0"), (carts.id, "c1")]))
    wait_persisted(node.uri)
    return node


def test_tail_names_every_collection_and_skips_a_dropped_one(bucket: Node) -> None:
    lines = _lines(bucket.uri)
    got = {(r["scope"], r["collection"], r["key"]) for r in lines if r.get("op") == "mutation"}
    assert got == (
        {("_default", "_default", f"d{i}") for i in range(5)}
        | {("app", "users", f"u{i}") for i in range(5)}
        | {("app", "carts", "c0"), ("app", "carts", "c1")}
    )
    assert all(not problems(r) for r in lines)
    # without -v too: every partition says app.orders was dropped (by id: it was gone
    # before the tail started, and its creation was replaced by the drop)
    drops = [r for r in lines if r.get("event") == "collection-dropped"]
    assert len(drops) == bucket.partitions and all(r["op"] == "system_event" for r in drops)
    assert {(r.get("scope"), r.get("collection")) for r in drops} == {("app", None)}
    assert all(isinstance(r["collection_id"], int) for r in drops)
    text = upr("tail", bucket.uri, "--until-end").stdout
    assert "key=app.users:u1 " in text and "key=d1 " in text and "app.orders" not in text
    shown = [line for line in text.splitlines() if line.endswith("[collection-dropped]")]
    assert len(shown) == bucket.partitions and "None" not in text
    assert f"collection_id={drops[0]['collection_id']:#x} " in shown[0]


def test_tail_filters_on_the_server_and_keys_still_match(bucket: Node) -> None:
    users = _rows(bucket.uri, "--collections", "app.users")
    assert sorted(r["key"] for r in users) == [f"u{i}" for i in range(5)]
    scope = _rows(bucket.uri, "--collections", "app")
    assert {r["collection"] for r in scope} == {"users", "carts"}
    default = _rows(bucket.uri, "--collections", ".", "--keys", "^d[12]$")
    assert sorted(r["key"] for r in default) == ["d1", "d2"]


def test_tail_verbose_shows_the_collection_events_in_seq_order(bucket: Node) -> None:
    out = upr("tail", bucket.uri, "--until-end", "--format", "json", "-v")
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert all(not problems(e) for e in lines)
    changes: dict[int, list[tuple[str, str | None, str | None]]] = {}
    seqs: dict[int, list[int]] = {}
    for e in lines:
        kind = e.get("event")
        if kind is None or kind.startswith(("collection-", "scope-")):
            seqs.setdefault(e["partition"], []).append(int(e["seq"]))
        if kind is not None and kind.startswith(("collection-", "scope-")):
            changes.setdefault(e["partition"], []).append((kind, e["scope"], e.get("collection")))
    assert len(changes) == bucket.partitions  # every active partition has the history
    for history in changes.values():
        # orders' creation was replaced by its drop (the same system row on disk), so
        # its name never reached the tail
        assert history == [
            ("scope-created", "app", None),
            ("collection-created", "app", "users"),
            ("collection-dropped", "app", None),
            ("collection-created", "app", "carts"),
        ]
    assert all(s == sorted(s) and len(s) == len(set(s)) for s in seqs.values())


def test_a_filtered_tail_shows_the_events_of_its_collections(bucket: Node) -> None:
    # kv_engine sends a filtered stream the system events of the collections (and, for a
    # scope filter, of the scope) it streams, whatever `uid` the request carries
    out = upr("tail", bucket.uri, "--until-end", "--format", "json", "-v", "--partitions", "0",
              "--collections", "app")  # fmt: skip
    kinds = [(e["event"], e.get("collection")) for e in map(json.loads, out.stdout.splitlines())
             if e.get("event", "").startswith(("collection-", "scope-"))]  # fmt: skip
    assert kinds == [("scope-created", None), ("collection-created", "users"),
                     ("collection-dropped", None), ("collection-created", "carts")]  # fmt: skip
    out = upr("tail", bucket.uri, "--until-end", "--format", "json", "-v", "--partitions", "0",
              "--collections", "app.users")  # fmt: skip
    kinds = [(e["event"], e.get("collection")) for e in map(json.loads, out.stdout.splitlines())
             if e.get("event", "").startswith(("collection-", "scope-"))]  # fmt: skip
    assert kinds == [("collection-created", "users")]


def test_a_following_tail_fails_when_its_collection_is_dropped(
    bucket: Node, tmp_path: Path
) -> None:
    # FilterEmpty (docs/protocol.md §12.4): every partition's stream ends after the drop,
    # and a follow that has nothing left to follow is an error (exit 1, one line)
    state = str(tmp_path / "st.json")
    with spawn_upr("tail", bucket.uri, "--format", "json", "-v", "--collections",
                   "app.users", "--state", state) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        seen = 0
        while seen < 5:  # the five documents: the streams are open
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            seen += "event" not in json.loads(line)
        coll.drop(bucket.uri, "app.users")
        assert proc.wait(timeout=30) == 1
        lines = [json.loads(line) for line in proc.stdout.read().splitlines()]
        stderr = proc.stderr.read()
    ends = [e for e in lines if e.get("event") == "stream_end"]
    assert {e["partition"] for e in ends} == set(range(bucket.partitions))
    assert {e["status"] for e in ends} == {7}
    drops = [e for e in lines if e.get("event") == "collection-dropped"]
    assert len(drops) == bucket.partitions and {e["collection"] for e in drops} == {"users"}
    assert "every collection --collections names was dropped" in stderr
    assert stderr.startswith("upr: error: ") and stderr.count("\n") == 1, stderr
    # a resume knows it followed app.users (no "unknown collection"); --until-end got
    # everything up to its end: a warning, exit 0
    done = upr("tail", bucket.uri, "--until-end", "--collections", "app.users", "--state",
               state, check=False)  # fmt: skip
    assert done.returncode == 0 and "upr: warning: every collection" in done.stderr
    assert done.stdout == ""  # the drops were shown by the follow already


def test_an_unknown_collection_is_one_line_and_exit_1(bucket: Node) -> None:
    for path in ("app.nope", "app.orders", "nope"):  # app.orders: dropped
        bad = upr("tail", bucket.uri, "--until-end", "--collections", path, check=False)
        assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
        assert path in bad.stderr and "Traceback" not in bad.stderr
    usage = upr("tail", bucket.uri, "--collections", "a.b.c", check=False)
    assert usage.returncode == 2 and "at most one dot" in usage.stderr


def test_a_resumed_tail_shows_the_drop_of_a_collection_re_created_meanwhile(
    node: Node, tmp_path: Path
) -> None:
    """`tail --state` of crash.c1; crash.c1 dropped and created again (a new id); the
    same command again prints the old one's drop in every partition, by its names, then
    the new one's creation and documents."""
    old = coll.create(node.uri, "crash.c1").lookup(coll.Path("crash", "c1"))
    assert old is not None
    run(_write(node.uri, [(old.id, f"a{i}") for i in range(8)]))
    state = tmp_path / "st.json"
    args = ("--until-end", "--format", "json", "--state", str(state), "--collections", "crash.c1")
    first = [json.loads(x) for x in upr("tail", node.uri, *args).stdout.splitlines()]
    assert sorted(r["key"] for r in first if "event" not in r) == [f"a{i}" for i in range(8)]
    assert json.loads(state.read_text())["collections"]["filter"] == "crash.c1"
    coll.drop(node.uri, "crash.c1")
    new = coll.create(node.uri, "crash.c1").lookup(coll.Path("crash", "c1"))
    assert new is not None and new.id != old.id
    run(_write(node.uri, [(new.id, "b0"), (0, "other")]))
    again = [json.loads(x) for x in upr("tail", node.uri, *args).stdout.splitlines()]
    drops = [r for r in again if r.get("event") == "collection-dropped"]
    assert {r["partition"] for r in drops} == set(range(node.partitions))
    assert {(r["collection_id"], r["scope"], r["collection"]) for r in drops} == {
        (old.id, "crash", "c1")}  # fmt: skip
    created = [r for r in again if r.get("event") == "collection-created"]
    assert {r["collection_id"] for r in created} == {new.id}
    rows = [r for r in again if "event" not in r]
    assert [(r["collection"], r["key"]) for r in rows] == [("c1", "b0")]  # not "other"
    for p in range(node.partitions):  # per partition: the drop before the creation
        mine = [r["event"] for r in again if r.get("partition") == p and "event" in r]
        assert mine == ["collection-dropped", "collection-created"]
    saved = json.loads(state.read_text())["collections"]["followed"]
    assert set(map(tuple, saved.values())) == {(new.id,)}
    # and once more: nothing new
    assert upr("tail", node.uri, *args).stdout == ""
