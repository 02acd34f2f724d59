"""The restore plan: --map-data rules, collections matched by name, what is missing or
created, partition counts and the rehash (jobs/restore_plan.py)."""

from __future__ import annotations

import asyncio
import gc
import zlib
from typing import Any

import pytest

from upr_cli.collections import CollectionsManifest, Path, with_collections
from upr_cli.errors import UsageError
from upr_cli.jobs.restore import RestoreSummary, RestoreTargetError, _NodeWriter, store_names
from upr_cli.jobs.restore_plan import (
    CREATE,
    CREATED,
    EXISTS,
    MISSING,
    MapRule,
    RestorePlan,
    RestorePlanError,
    map_path,
    parse_map_data,
    plan_collections,
    refuse_missing,
    resolve,
    source_partition_count,
)
from upr_cli.net.bootstrap import partition_of
from upr_cli.protocol import Frame, leb128
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION
from upr_cli.protocol.messages import decode_one
from upr_cli.protocol.status import Status
from upr_cli.segments import Record


def P(text: str) -> Path:
    return Path.parse(text)


def manifest(*paths: str, ttl: dict[str, int] | None = None) -> CollectionsManifest:
    """A manifest holding these scopes and collections, created in order."""
    m = CollectionsManifest()
    for text in paths:
        p = P(text)
        if m.scope(p.scope) is None:
            m = m.with_scope(p.scope)
        if p.collection is not None and m.lookup(p) is None:
            m = m.with_collection(p.scope, p.collection, (ttl or {}).get(text))
    return m


# -- --map-data --------------------------------------------------------------------------


def test_map_data_takes_scope_and_collection_rules_repeated_or_comma_separated() -> None:
    rules = parse_map_data(["app=shop,app.users=crm.people", " old.x=new.y "])
    assert rules == (
        MapRule(Path("app"), Path("shop")),
        MapRule(Path("app", "users"), Path("crm", "people")),
        MapRule(Path("old", "x"), Path("new", "y")),
    )
    assert parse_map_data(None) == () and parse_map_data("") == ()
    assert parse_map_data("a=b,a=b") == (MapRule(Path("a"), Path("b")),)  # the same twice


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("app", "give SRC=DST"),
        ("=shop", "give SRC=DST"),
        ("app=", "give SRC=DST"),
        ("app=shop.users", "a scope to a scope"),
        ("app.users=shop", "a scope to a scope"),
        ("app=shop,app=crm", "app is mapped twice"),
        ("app.a.b=x.y", "at most one dot"),
        ("bad name=x", "letters, digits"),
    ],
)
def test_map_data_refuses_what_it_cannot_mean(text: str, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        parse_map_data(text)


def test_a_collection_rule_wins_over_its_scope_rule_and_others_keep_their_names() -> None:
    rules = parse_map_data("app=shop,app.users=crm.people")
    assert map_path(Path("app", "users"), rules) == Path("crm", "people")
    assert map_path(Path("app", "orders"), rules) == Path("shop", "orders")
    assert map_path(Path("other", "orders"), rules) == Path("other", "orders")
    assert map_path(Path("_default", "_default"), rules) == Path("_default", "_default")


# -- matching by name ----------------------------------------------------------------------


def test_collections_are_matched_by_name_never_by_id() -> None:
    # the same names, created in another order: other ids on each side
    source = manifest("app.users", "app.orders", "logs.web")
    target = manifest("logs.web", "app.orders", "app.users")
    assert source.lookup(P("app.users")).id != target.lookup(P("app.users")).id  # type: ignore[union-attr]
    plans = plan_collections(source, target)
    got = {str(c.source): (c.source_id, str(c.target), c.target_id, c.status) for c in plans}
    for s, c in source.collections():
        tid = target.lookup(Path(s.name, c.name)).id  # type: ignore[union-attr]
        assert got[f"{s.name}.{c.name}"] == (c.id, f"{s.name}.{c.name}", tid, EXISTS)
    assert [str(c.source) for c in plans] == [
        "_default._default", "app.users", "app.orders", "logs.web"
    ]  # fmt: skip


def test_missing_collections_are_created_unless_told_not_to() -> None:
    source = manifest("app.users", "app.orders")
    target = manifest("app.users")
    plans = plan_collections(source, target)
    assert [(str(c.target), c.status) for c in plans] == [
        ("_default._default", EXISTS), ("app.users", EXISTS), ("app.orders", CREATE)
    ]  # fmt: skip
    no_create = plan_collections(source, target, can_create=False)
    assert [c.status for c in no_create] == [EXISTS, EXISTS, MISSING]
    plan = RestorePlan(16, 16, no_create)
    with pytest.raises(RestorePlanError, match=r"nothing written: the target lacks app\.orders "
                                               r"\(--no-create\)"):  # fmt: skip
        refuse_missing(plan, "--no-create")
    refuse_missing(RestorePlan(16, 16, plans), "--no-create")  # nothing missing: no error


def test_a_target_without_collections_takes_only_the_default_collection() -> None:
    source = manifest("app.users")
    plans = plan_collections(source, None)
    assert [(str(c.target), c.target_id, c.status) for c in plans] == [
        ("_default._default", 0, EXISTS), ("app.users", None, MISSING)
    ]  # fmt: skip
    # … so a user can send a collection there by name
    mapped = plan_collections(source, None, parse_map_data("app.users=_default._default"))
    assert [(c.target_id, c.status) for c in mapped] == [(0, EXISTS), (0, EXISTS)]
    # a backup of the default collection alone restores into any target
    assert [c.status for c in plan_collections(CollectionsManifest(), None)] == [EXISTS]


def test_rules_are_applied_and_must_name_something_in_the_backup() -> None:
    source = manifest("app.users", "app.orders")
    target = manifest("shop.users")
    plans = plan_collections(source, target, parse_map_data("app=shop"))
    assert [(str(c.target), c.status) for c in plans[1:]] == [
        ("shop.users", EXISTS), ("shop.orders", CREATE)
    ]  # fmt: skip
    with pytest.raises(UsageError, match=r"--map-data appp=shop: the backup has no scope appp"):
        plan_collections(source, target, parse_map_data("appp=shop"))
    with pytest.raises(UsageError, match=r"has no collection app\.user$"):
        plan_collections(source, target, parse_map_data("app.user=shop.user"))


def test_collections_a_filtered_backup_left_out_are_not_planned() -> None:
    source = manifest("app.users", "app.orders")
    plans = plan_collections(source, CollectionsManifest(), covers=lambda s, c: c != "orders")
    assert [str(c.source) for c in plans] == ["_default._default", "app.users"]


def test_one_change_creates_every_missing_collection_and_its_scope() -> None:
    source = manifest("app.users", "app.orders", "logs.web", ttl={"logs.web": 3600})
    target = manifest("app.users")
    plans = plan_collections(source, target)
    wanted = RestorePlan(16, 16, plans).creations()

    def edit(m: CollectionsManifest) -> CollectionsManifest:
        return with_collections(m, wanted)

    made = edit(target)
    assert made.uid > target.uid
    web = made.lookup(P("logs.web"))
    assert web is not None and web.max_ttl == 3600  # the source's max TTL comes along
    assert made.lookup(P("app.orders")) is not None
    assert edit(made) == made  # made again on a manifest that has them: no change
    resolve(plans, made)
    assert [(c.status, c.target_id) for c in plans[2:]] == [
        (CREATED, made.lookup(P("app.orders")).id),  # type: ignore[union-attr]
        (CREATED, web.id),
    ]
    # a change that did not give the collection leaves it missing
    again = plan_collections(source, target)
    resolve(again, target)
    assert [c.status for c in again] == [EXISTS, EXISTS, MISSING, MISSING]


# -- partitions ----------------------------------------------------------------------------


def test_the_plan_says_when_keys_are_rehashed() -> None:
    plans = plan_collections(manifest("app.users"), manifest("app.users"))
    plans[1].documents, plans[1].deletions = 1200, 3
    moved = RestorePlan(1024, 64, plans)
    assert moved.rehash
    lines = moved.describe()
    assert lines[0] == "rehashed from 1024 to 64 partitions"
    # no collection renamed: one name a line, so the line fits 80 columns
    assert lines[2].split() == ["app.users", "exists", "1,200", "documents,", "3", "deletions"]
    doc = moved.to_json()
    assert (doc["source_partitions"], doc["target_partitions"], doc["rehash"]) == (1024, 64, True)
    assert doc["collections"][1] == {
        "source": "app.users", "source_id": plans[1].source_id, "target": "app.users",
        "target_id": plans[1].target_id, "status": "exists", "documents": 1200, "deletions": 3,
    }  # fmt: skip
    same = RestorePlan(64, 64, plans)
    assert not same.rehash and same.describe()[0] == "partitions: 64 (no rehash)"
    store = RestorePlan(1024, None, plans)  # a store keeps the source's partitions
    assert not store.rehash and store.describe()[0].startswith("partitions: 1024")
    renamed = plan_collections(manifest("app.users"), None, parse_map_data("app=shop"))
    assert RestorePlan(64, 64, renamed).describe()[2].split()[:3] == ["app.users", "->",
                                                                      "shop.users"]  # fmt: skip


def test_the_source_count_is_one_past_the_highest_partition_held() -> None:
    assert source_partition_count(range(1024)) == 1024
    assert source_partition_count([0, 5, 63]) == 64
    assert source_partition_count([]) == 0


def test_a_key_moves_to_its_crc32_partition_over_the_target_count() -> None:
    # ((crc32(key) >> 16) & 0x7fff) % count, over the document key (docs/protocol.md §5.5)
    key = b"doc-000123"
    h = (zlib.crc32(key) >> 16) & 0x7FFF
    assert [partition_of(key, n) for n in (1024, 128, 64, 16)] == [h % n for n in
                                                                   (1024, 128, 64, 16)]  # fmt: skip
    spread = {partition_of(f"k{i}".encode(), 64) for i in range(2000)}
    assert spread == set(range(64))  # every target partition gets keys, none beyond


# -- counting and naming -------------------------------------------------------------------


def rec(op: int, seq: int, key: bytes, collection: int) -> Record:
    return Record(op, seq, 1, seq, 0, 0, 0, 0, key, b"{}", collection)


def test_the_summary_counts_each_collection_and_reports_the_plan() -> None:
    source = manifest("app.users")
    plan = RestorePlan(16, 64, plan_collections(source, source))
    summary = RestoreSummary("b", "t", False, plan=plan)
    by = plan.by_source()
    users = source.lookup(P("app.users")).id  # type: ignore[union-attr]
    summary.count([rec(OP_MUTATION, 1, b"a", 0), rec(OP_MUTATION, 2, b"a", users),
                   rec(OP_DELETION, 3, b"b", users)], by)  # fmt: skip
    summary.count([rec(OP_MUTATION, 4, b"c", users)], by)
    assert (summary.documents, summary.deletions) == (3, 1)
    assert [(c.documents, c.deletions) for c in plan.collections] == [(1, 0), (2, 1)]
    doc = summary.to_json()
    assert doc["items"] == 4 and doc["rehash"] and doc["target_partitions"] == 64


def test_a_store_records_the_names_a_restore_maps_to_under_the_source_ids() -> None:
    source = manifest("app.users", "app.orders", "shop.users")
    rules = parse_map_data("app.users=crm.people,app.orders=shop.orders")
    plan = RestorePlan(16, None, plan_collections(source, CollectionsManifest(), rules))
    names = store_names(plan, source)
    got = {c.id: str(names.path_of(c.id)) for _s, c in names.collections()}
    ids = {str(Path(s.name, c.name)): c.id for s, c in source.collections()}
    assert got == {
        0: "_default._default",
        ids["app.users"]: "crm.people",
        ids["app.orders"]: "shop.orders",
        ids["shop.users"]: "shop.users",
    }
    scope_ids = [s.id for s in names.scopes]
    assert len(set(scope_ids)) == len(scope_ids)  # a new scope name gets an id of its own
    assert names.scope("shop").id == source.scope("shop").id  # type: ignore[union-attr]


# -- the writer: where each key goes on the wire, and how it stops -------------------------


class Router:
    """A router that answers every request at once with `status`, keeping what was sent
    (the writer's view of net/router.py: submit, settle, flush)."""

    def __init__(self, partitions: int, status: int = 0, collections: bool = True) -> None:
        self.num_partitions, self.status, self.collections = partitions, status, collections
        self.retry_for = 60.0
        self.sent: list[Any] = []

    def submit(self, vb: int, make: Any) -> asyncio.Future[Frame]:
        msg = decode_one(make(1))
        assert msg.vbucket == vb  # type: ignore[attr-defined]
        self.sent.append(msg)
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        empty = memoryview(b"")
        fut.set_result(Frame(0x81, 0, 0, self.status, 1, 0, empty, empty, empty, empty))
        return fut

    async def settle(self, fut: asyncio.Future[Frame], vb: int, make: Any) -> Frame:
        return await fut

    def flush(self) -> None:
        pass


def write(router: Router, plan: RestorePlan, records: list[Record]) -> RestoreSummary:
    summary = RestoreSummary("b", "t", False, plan=plan)

    async def go() -> None:
        w = _NodeWriter(router, summary, 8, 0, plan)  # type: ignore[arg-type]
        try:
            await w.partition(records, include_tombstones=True)
            await w.drain()
        finally:
            w.abandon()

    asyncio.run(go())
    return summary


def test_each_key_goes_to_its_hash_over_the_target_count_under_the_target_id() -> None:
    source = manifest("app.users")
    target = manifest("zz.first", "zz.second", "app.users")  # app.users: another id there
    plan = RestorePlan(1024, 64, plan_collections(source, target))
    sid, tid = source.lookup(P("app.users")).id, target.lookup(P("app.users")).id  # type: ignore[union-attr]
    assert sid != tid and tid >= 0x0A
    records = [rec(OP_MUTATION, i + 1, f"key-{i}".encode(), sid if i % 2 else 0) for i in range(40)]
    records.append(rec(OP_DELETION, 99, b"gone", sid))
    router = Router(64)
    summary = write(router, plan, records)
    assert summary.written == 41 and summary.errors == {}
    for r, msg in zip(records, router.sent, strict=True):
        assert msg.vbucket == partition_of(r.key, 64)  # the document key, never the prefix
        assert msg.key == leb128.join_key(tid if r.collection else 0, r.key)
    # without Collections on the connection only the default collection is written, bare
    bare = Router(16, collections=False)
    plain = RestorePlan(1024, 16, plan_collections(CollectionsManifest(), None))
    write(bare, plain, records[:2:2])
    assert [m.key for m in bare.sent] == [b"key-0"]


def test_a_partition_the_cluster_keeps_refusing_stops_the_restore_in_one_error() -> None:
    plan = RestorePlan(16, 16, plan_collections(CollectionsManifest(), CollectionsManifest()))
    records = [rec(OP_MUTATION, i + 1, f"k{i}".encode(), 0) for i in range(20)]
    with pytest.raises(RestoreTargetError, match=r"NOT_MY_VBUCKET for 60s after 0 writes"):
        write(Router(16, Status.NOT_MY_VBUCKET), plan, records)


def test_requests_left_in_flight_by_an_error_are_not_reported_by_asyncio() -> None:
    reported: list[dict[str, Any]] = []

    async def go() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        empty = CollectionsManifest()
        w = _NodeWriter(Router(16), RestoreSummary("b", "t", False), 8, 0,
                        RestorePlan(16, 16, plan_collections(empty, empty)))  # type: ignore[arg-type]  # fmt: skip
        failed: asyncio.Future[Frame] = loop.create_future()
        failed.set_exception(OSError("connection lost"))
        pending: asyncio.Future[Frame] = loop.create_future()
        for fut in (failed, pending):
            w.inflight.append((fut, 0, lambda _o: b"", "set", b"k"))
        w.abandon()
        assert pending.cancelled() and not w.inflight
        del failed, pending, fut
        gc.collect()

    asyncio.run(go())
    assert reported == []
