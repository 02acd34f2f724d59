"""The producer's side of collections (formats/wire.md "Collections on DCP"), seen on
the wire: raw DCP frames from an in-process node. A connection that negotiated
Collections gets every key with its collection id and the system events in seq order;
one that did not gets the default collection only; a stream-request value filters by
collection or scope, with SEQNO_ADVANCED past what it held back and FilterEmpty once
nothing of the filter is left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dcp.collections_helpers import RawDcp, cid, create, drop, put, raw_dcp
from tests.dcp.inprocess import InProcessNode, nodes, run
from upr_cli.collections import (
    EVENT_COLLECTION_CREATED,
    EVENT_COLLECTION_DROPPED,
    EVENT_SCOPE_CREATED,
    EVENT_SCOPE_DROPPED,
    CollectionsManifest,
    ManifestChange,
)
from upr_cli.collections import Path as CPath
from upr_cli.node.storage import DocRow
from upr_cli.node.stream_view import StreamView
from upr_cli.node.sysevents import system_row
from upr_cli.protocol.leb128 import join_key
from upr_cli.protocol.messages import (
    Control,
    Deletion,
    Message,
    Mutation,
    SeqnoAdvanced,
    SnapshotMarker,
    StreamRequest,
    SystemEvent,
)

VB = 0
SCENARIO_S = 10.0


def _items(msgs: list[Message]) -> list[tuple[str, int, object]]:
    """(kind, seq, key or event id) of the items of a stream, in order."""
    out: list[tuple[str, int, object]] = []
    for m in msgs:
        if isinstance(m, Mutation | Deletion):
            out.append(("doc", m.by_seqno, bytes(m.key)))
        elif isinstance(m, SystemEvent):
            out.append(("event", m.by_seqno, m.event))
        elif isinstance(m, SeqnoAdvanced):
            out.append(("advanced", m.by_seqno, None))
    return out


def _check_markers(msgs: list[Message]) -> None:
    """Every item lies in the snapshot its marker announced, and a SEQNO_ADVANCED is the
    last message of a snapshot, to its end."""
    marker: SnapshotMarker | None = None
    advanced = False
    for m in msgs:
        if isinstance(m, SnapshotMarker):
            marker, advanced = m, False
        elif isinstance(m, Mutation | Deletion | SystemEvent | SeqnoAdvanced):
            assert marker is not None and marker.start_seqno <= m.by_seqno <= marker.end_seqno
            assert not advanced, "an item after SEQNO_ADVANCED in one snapshot"
            if isinstance(m, SeqnoAdvanced):
                assert m.by_seqno == marker.end_seqno
                advanced = True


def _sent(msgs: list[Message]) -> list[tuple[str, int, object]]:
    """The items without SEQNO_ADVANCED (which comes where a snapshot ended, whether
    the write path persisted it or not)."""
    return [i for i in _items(msgs) if i[0] != "advanced"]


def _uid(event: SystemEvent) -> int:
    """The manifest uid a system event carries (its value's first u64)."""
    return int.from_bytes(bytes(event.value[:8]), "big")


def _high(node: InProcessNode) -> int:
    return node.bucket.partitions[VB].high_seq


async def _till(c: RawDcp, opaque: int, seq: int) -> None:
    """Read until the stream's items reach `seq`."""
    await c.read_until(lambda: any(s >= seq for _, s, _ in _items(c.of(opaque))), 2.0)


async def _three_collections(node: InProcessNode) -> None:
    """d1 (default), scope app with users and orders, then u1, o1, d2: seqs 1 to 7."""
    b = node.bucket
    put(b, VB, "_default._default", "d1")
    await create(b, "app.users", "app.orders")
    put(b, VB, "app.users", "u1")
    put(b, VB, "app.orders", "o1")
    put(b, VB, "_default._default", "d2")


@pytest.mark.parametrize("flush", [True, False], ids=["disk", "memory"])
def test_a_collections_stream_sends_ids_and_system_events_in_seq_order(
    tmp_path: Path, flush: bool
) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> list[Message]:
        async with nodes(node):
            await _three_collections(node)
            if flush:
                await node.bucket.flush()
            async with raw_dcp(node.config.port, collections=True) as c:
                opaque, answer = await c.stream(VB)
                assert answer.status == 0
                await _till(c, opaque, 7)
                await c.settle()
                return c.of(opaque)

    msgs = run(scenario(), SCENARIO_S)
    users, orders = 9, 10  # scope app is 8: new ids start there (docs/protocol.md §12.2)
    assert _items(msgs) == [
        ("doc", 1, b"\x00d1"),
        ("event", 2, EVENT_SCOPE_CREATED),
        ("event", 3, EVENT_COLLECTION_CREATED),
        ("event", 4, EVENT_COLLECTION_CREATED),
        ("doc", 5, join_key(users, b"u1")),
        ("doc", 6, join_key(orders, b"o1")),
        ("doc", 7, b"\x00d2"),
    ]
    _check_markers(msgs)
    events = [m for m in msgs if isinstance(m, SystemEvent)]
    assert [(e.key, e.version) for e in events] == [(b"app", 0), (b"users", 0), (b"orders", 0)]
    assert events[1].value[8:] == (8).to_bytes(4, "big") + users.to_bytes(4, "big")
    # one manifest (uid 3) made the three changes: as on kv_engine, only its last event
    # carries the new uid, the others the uid the partition had (0)
    assert [_uid(e) for e in events] == [0, 0, 3]


def test_a_stream_without_collections_sees_the_default_collection_only(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> list[Message]:
        async with nodes(node):
            await _three_collections(node)
            put(node.bucket, VB, "app.users", "u2")  # the last item: not for this stream
            async with raw_dcp(node.config.port, collections=False) as c:
                opaque, answer = await c.stream(VB)
                assert answer.status == 0
                await _till(c, opaque, 7)
                await c.settle()
                return c.of(opaque)

    msgs = run(scenario(), SCENARIO_S)
    assert _items(msgs) == [("doc", 1, b"d1"), ("doc", 7, b"d2")]  # no prefix, no event
    _check_markers(msgs)
    markers = [m for m in msgs if isinstance(m, SnapshotMarker)]
    assert markers[-1].end_seqno == 8  # the markers still cover every seq


def test_a_collection_filter_gets_its_collection_and_seqno_advanced(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> tuple[list[Message], list[Message]]:
        async with nodes(node):
            await _three_collections(node)
            # both streams read one snapshot from disk: a flush that fell between the
            # writes (the flusher's timer, on a busy machine) would otherwise split the
            # first stream's at that point, and the two streams would differ
            await node.bucket.flush()
            users = cid(node.bucket, "app.users")
            async with raw_dcp(node.config.port, collections=True) as c:
                opaque, answer = await c.stream(VB, {"collections": [f"{users:x}"]})
                assert answer.status == 0
                await _till(c, opaque, 7)
            # a uid hides nothing: kv_engine's filter no longer uses it
            uid = f"{node.bucket.manifest.uid:x}"
            async with raw_dcp(node.config.port, collections=True) as c2:
                again, answer = await c2.stream(VB, {"collections": [f"{users:x}"], "uid": uid})
                assert answer.status == 0
                await _till(c2, again, 7)
                return c.of(opaque), c2.of(again)

    msgs, with_uid = run(scenario(), SCENARIO_S)
    users = 9
    assert _sent(msgs) == [
        ("event", 3, EVENT_COLLECTION_CREATED),
        ("doc", 5, join_key(users, b"u1")),
    ]
    assert _items(msgs)[-1] == ("advanced", 7, None)  # the end, d2, was held back
    _check_markers(msgs)
    assert _items(with_uid) == _items(msgs)


def test_a_client_resuming_inside_a_manifest_gets_the_rest_of_its_events(
    tmp_path: Path,
) -> None:
    """One manifest creates scope app and collection users (seqs 1, 2). A third-party
    client that read seq 1 resumes there with the uid it saw last, as kv_engine's
    stream-request-value.md tells it to: it must still get the collection's creation."""
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> tuple[list[Message], list[Message]]:
        async with nodes(node):
            await create(node.bucket, "app.users")
            async with raw_dcp(node.config.port, collections=True) as c:
                first, _ = await c.stream(VB)
                await _till(c, first, 2)
            seen = next(m for m in c.of(first) if isinstance(m, SystemEvent))
            resume = json.dumps({"uid": f"{_uid(seen):x}"}).encode()
            uuid = node.bucket.partitions[VB].uuid
            async with raw_dcp(node.config.port, collections=True) as c2:
                opaque = 0x700
                answer = await c2.request(StreamRequest(
                    vbucket=VB, opaque=opaque, start_seqno=1, end_seqno=2**64 - 1,
                    vbucket_uuid=uuid, snap_start_seqno=1, snap_end_seqno=1, value=resume,
                ))  # fmt: skip
                assert answer.status == 0
                await _till(c2, opaque, 2)
                return c.of(first), c2.of(opaque)

    before, resumed = run(scenario(), SCENARIO_S)
    events = [m for m in before if isinstance(m, SystemEvent)]
    assert [(e.by_seqno, e.event, _uid(e)) for e in events] == [
        (1, EVENT_SCOPE_CREATED, 0),  # the partition's uid until the manifest is whole
        (2, EVENT_COLLECTION_CREATED, 2),
    ]
    assert _sent(resumed) == [("event", 2, EVENT_COLLECTION_CREATED)]


def test_a_scope_filter_takes_in_collections_created_in_it(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> list[Message]:
        async with nodes(node):
            b = node.bucket
            await _three_collections(node)
            app = b.manifest.scope("app")
            assert app is not None
            async with raw_dcp(node.config.port, collections=True) as c:
                opaque, answer = await c.stream(VB, {"scope": f"{app.id:x}"})
                assert answer.status == 0
                await _till(c, opaque, 7)
                await create(b, "app.logs")  # seq 8
                await create(b, "other.x")  # seqs 9 (the scope), 10 (x)
                put(b, VB, "app.logs", "l1")  # 11
                put(b, VB, "other.x", "x1")  # 12
                await _till(c, opaque, 12)
                await c.settle()
                return c.of(opaque)

    msgs = run(scenario(), SCENARIO_S)
    users, orders, logs = 9, 10, 11
    assert _sent(msgs) == [
        ("event", 2, EVENT_SCOPE_CREATED),
        ("event", 3, EVENT_COLLECTION_CREATED),
        ("event", 4, EVENT_COLLECTION_CREATED),
        ("doc", 5, join_key(users, b"u1")),
        ("doc", 6, join_key(orders, b"o1")),
        ("event", 8, EVENT_COLLECTION_CREATED),
        ("doc", 11, join_key(logs, b"l1")),
    ]
    assert _items(msgs)[-1] == ("advanced", 12, None)
    _check_markers(msgs)


def test_filter_empty_ends_a_stream_after_the_drop(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> tuple[list[Message], list[Message], int | None, int | None]:
        async with nodes(node):
            b = node.bucket
            await _three_collections(node)
            app = b.manifest.scope("app")
            assert app is not None
            async with raw_dcp(node.config.port, collections=True) as c:
                one, _ = await c.stream(VB, {"collections": [f"{cid(b, 'app.users'):x}"]})
                await _till(c, one, 5)
                await drop(b, "app.users")  # seq 8
                await c.read_until(lambda: c.end_status(one) is not None)
                scope, _ = await c.stream(VB, {"scope": f"{app.id:x}"})
                await _till(c, scope, 6)
                await drop(b, "app")  # seqs 9 (orders dropped), 10 (app dropped)
                await c.read_until(lambda: c.end_status(scope) is not None)
                return c.of(one), c.of(scope), c.end_status(one), c.end_status(scope)

    one, scope, one_end, scope_end = run(scenario(), SCENARIO_S)
    assert _items(one)[-1] == ("event", 8, EVENT_COLLECTION_DROPPED)
    assert one_end == 7  # FilterEmpty
    assert _items(scope)[-2:] == [("event", 9, EVENT_COLLECTION_DROPPED),
                                  ("event", 10, EVENT_SCOPE_DROPPED)]  # fmt: skip
    assert scope_end == 7


def test_dropping_the_default_collection_ends_a_stream_without_collections(
    tmp_path: Path,
) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> tuple[list[Message], int | None, int]:
        async with nodes(node):
            b = node.bucket
            put(b, VB, "_default._default", "d1")
            async with raw_dcp(node.config.port, collections=False) as c:
                opaque, _ = await c.stream(VB)
                await _till(c, opaque, 1)
                await drop(b, "_default._default")
                await c.read_until(lambda: c.end_status(opaque) is not None)
                _, again = await c.stream(VB)  # nothing left for such a stream
                return c.of(opaque), c.end_status(opaque), again.status

    msgs, end, again = run(scenario(), SCENARIO_S)
    assert _items(msgs) == [("doc", 1, b"d1")]  # no system event for this client
    assert end == 0  # FilterEmpty reads as OK without collections (docs/protocol.md §2.6)
    assert again == 0x88


@pytest.mark.parametrize(
    ("value", "status"),
    [
        (b"{", 0x04),
        ([1], 0x04),
        ({}, 0x04),
        ({"scope": "8", "collections": ["9"]}, 0x04),
        ({"collections": "9"}, 0x04),
        ({"collections": []}, 0x04),
        ({"collections": ["0x9"]}, 0x04),
        ({"purge_seqno": 12}, 0x04),
        ({"collections": ["77"]}, 0x88),
        ({"scope": "77"}, 0x8C),
        ({"uid": 3}, 0x04),
        ({"uid": "0x3"}, 0x04),
        ({"uid": "ff"}, 0x00),  # ahead of the node's: kv_engine no longer refuses it
        ({"sid": 3}, 0x8D),
        ({"collections": ["9"], "uid": "2", "purge_seqno": "0"}, 0x00),
    ],
)
def test_stream_request_values_are_checked(tmp_path: Path, value: object, status: int) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> tuple[int, bytes]:
        async with nodes(node):
            await _three_collections(node)
            raw = value if isinstance(value, bytes) else json.dumps(value).encode()
            async with raw_dcp(node.config.port, collections=True) as c:
                _, answer = await c.stream(VB, raw)
                return answer.status, answer.value

    got, body = run(scenario(), SCENARIO_S)
    assert got == status
    if status in (0x88, 0x8C):  # kv_engine's docs/Collections.md: the manifest uid
        assert json.loads(body)["manifest_uid"] == "3"


def test_a_value_or_no_noop_is_refused_where_collections_do_not_allow_it(
    tmp_path: Path,
) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> tuple[int, int, int]:
        async with nodes(node):
            async with raw_dcp(node.config.port, collections=False) as c:
                _, legacy = await c.stream(VB, {"uid": "0"})
            async with raw_dcp(node.config.port, collections=True, noop=False) as c:
                _, no_noop = await c.stream(VB)
                flat = await c.request(Control(name="flatbuffers_system_events", value="true"))
            return legacy.status, no_noop.status, flat.status

    # EINVAL, NOT_SUPPORTED, and NOT_SUPPORTED: events are versions 0 and 1 only
    assert run(scenario(), SCENARIO_S) == (0x04, 0x83, 0x83)


def test_a_collection_created_and_dropped_is_one_drop_event(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> list[Message]:
        async with nodes(node):
            b = node.bucket
            await create(b, "app.temp")  # 1 scope, 2 temp
            put(b, VB, "app.temp", "t1")  # 3
            await drop(b, "app.temp")  # 4 replaces 2: one row per collection
            put(b, VB, "_default._default", "d1")  # 5
            await b.flush()
            async with raw_dcp(node.config.port, collections=True) as c:
                opaque, _ = await c.stream(VB)
                await _till(c, opaque, 5)
                return c.of(opaque)

    msgs = run(scenario(), SCENARIO_S)
    # no creation at 2, and t1 (3) never goes out: its collection is gone
    assert _items(msgs) == [("event", 1, EVENT_SCOPE_CREATED),
                            ("event", 4, EVENT_COLLECTION_DROPPED),
                            ("doc", 5, b"\x00d1")]  # fmt: skip
    _check_markers(msgs)


# -- the view itself: what a stream sends of rows the purge has not reached yet ---------


class _Bucket:
    """What a StreamView reads of a bucket: its current manifest."""

    def __init__(self, manifest: CollectionsManifest) -> None:
        self.manifest = manifest


def _system_doc(change: ManifestChange) -> DocRow:
    key, flags, expiry, value, deleted = system_row(change)
    return DocRow(VB, key, change.seq, 1, 0, flags, expiry, 0, deleted, 0, value)


def test_rows_of_a_dropped_collection_are_never_sent() -> None:
    m = CollectionsManifest().with_scope("app").with_collection("app", "users")
    users = m.lookup(CPath("app", "users"))
    assert users is not None
    bucket = _Bucket(m)
    everything = StreamView(bucket, collections=True)  # type: ignore[arg-type]
    only_users = StreamView(bucket, collections=True, ids={users.id})  # type: ignore[arg-type]
    legacy = StreamView(bucket, collections=False, ids={0})  # type: ignore[arg-type]
    row = join_key(users.id, b"u1")
    assert everything.data_key(row) == row and only_users.data_key(row) == row
    assert legacy.data_key(row) is None and legacy.data_key(b"\x00d1") == b"d1"
    assert legacy.hides_all([DocRow(VB, row, 5, 1, 0, 0, 0, 0, False, 0, b"")])
    bucket.manifest = m.without(CPath("app", "users"))  # dropped; the purge comes later
    assert everything.data_key(row) is None and only_users.data_key(row) is None
    assert users.id not in everything.plain_ids()
    drop_users = ManifestChange(VB, 6, "collection-dropped", bucket.manifest.uid, 8, users.id)
    assert only_users.event(VB, 1, _system_doc(drop_users)) is not None
    assert only_users.ended and not everything.ended
    assert legacy.event(VB, 1, _system_doc(drop_users)) is None and not legacy.ended
