"""The consumer with collections, against a scripted raw server on loopback.

`RawNode` speaks just enough of the protocol for one `DcpConsumer` (HELLO, the cluster
config, DCP_OPEN and CONTROLs, GET_ALL_VB_SEQNOS, GET_COLLECTIONS_MANIFEST, STREAM_REQ)
and plays a script of DCP messages per partition. It grants Collections or not, so both
sides of the negotiation are tested, and it keeps every stream request, so the filter
JSON the consumer sends is checked byte for byte. The node's own producer is tested
with this consumer in the e2e tests; here the consumer's side is pinned down alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from tests.dcp.inprocess import run
from upr_cli.collections import (
    CollectionsError,
    CollectionsManifest,
    ManifestChange,
    Path,
    encode_event,
    parse_paths,
)
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Rollback, StreamEnded
from upr_cli.dcp.filter import resolve_filter
from upr_cli.errors import UprError
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.protocol import FrameDecoder, Message, decode_message, leb128
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.protocol.header import Feature, Opcode
from upr_cli.protocol.messages import (
    CollectionsGetManifest,
    Control,
    DcpOpen,
    Deletion,
    GetAllVbSeqnos,
    GetAllVbSeqnosResponse,
    GetClusterConfig,
    Hello,
    HelloResponse,
    Mutation,
    Response,
    SelectBucket,
    SeqnoAdvanced,
    SnapshotMarker,
    StreamEnd,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
    SystemEvent,
)
from upr_cli.protocol.status import Status

UUID = 0xC0FFEE
# ids chosen so that one needs a two-byte LEB128 prefix (0x90)
MANIFEST = CollectionsManifest.from_json({
    "uid": "5",
    "scopes": [
        {"name": "_default", "uid": "0", "collections": [{"name": "_default", "uid": "0"}]},
        {"name": "app", "uid": "8", "collections": [
            {"name": "users", "uid": "9"}, {"name": "orders", "uid": "90"}]},
    ],
})  # fmt: skip


@dataclass
class RawNode:
    """A scripted server: one bucket of `partitions`, no authentication.

    `script[vb]` is what a stream of `vb` sends after its SUCCESS answer (messages
    whose opaque and partition the node fills in), or `scripts(node, request)` when
    given (a script per request); `on_stream` may answer a stream request with a
    status or a message instead (and change the node's manifest meanwhile)."""

    collections: bool = True
    manifest: CollectionsManifest | None = MANIFEST  # None: GET_COLLECTIONS_MANIFEST fails (0x89)
    partitions: int = 1
    highs: dict[int, int] = field(default_factory=dict)
    script: dict[int, list[Message]] = field(default_factory=dict)
    on_stream: Callable[[RawNode, StreamRequest], int | Message | None] | None = None
    scripts: Callable[[RawNode, StreamRequest], list[Message]] | None = None
    offered: list[int] = field(default_factory=list)  # HELLO features the client asked for
    streams: list[StreamRequest] = field(default_factory=list)
    port: int = 0
    _server: asyncio.Server | None = None
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    @property
    def uri(self) -> SourceUri:
        """A URI for the node."""
        return SourceUri.parse(f"upr://127.0.0.1:{self.port}/default")

    async def start(self) -> RawNode:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop listening and close every client connection."""
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        for w in self._writers:
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        decoder = FrameDecoder()
        try:
            while data := await reader.read(65536):
                decoder.feed(data)
                for frame in decoder.frames():
                    for out in self._answer(decode_message(frame)):
                        writer.write(out)
        except (ConnectionError, OSError):
            pass

    def _config(self) -> bytes:
        vbmap = [[0] for _ in range(self.partitions)]
        return json.dumps({"rev": 1, "vBucketServerMap": {
            "serverList": [f"$HOST:{self.port}"], "vBucketMap": vbmap}}).encode()  # fmt: skip

    def _answer(self, msg: Message) -> list[bytes]:
        op = msg.opaque
        if isinstance(msg, Hello):
            self.offered = list(msg.features)
            granted = tuple(
                f for f in msg.features if f == Feature.COLLECTIONS and self.collections
            )
            return [HelloResponse(opaque=op, features=granted).encode()]
        if isinstance(msg, GetClusterConfig):
            return [Response(opcode=Opcode.GET_CLUSTER_CONFIG, opaque=op, value=self._config(),
                             datatype=1).encode()]  # fmt: skip
        if isinstance(msg, SelectBucket | DcpOpen | Control):
            return [Response(opcode=msg.SCHEMA.opcodes[0], opaque=op).encode()]
        if isinstance(msg, GetAllVbSeqnos):
            seqnos = tuple((p, self.highs.get(p, 0)) for p in range(self.partitions))
            return [GetAllVbSeqnosResponse(opaque=op, seqnos=seqnos).encode()]
        if isinstance(msg, CollectionsGetManifest):
            if not self.collections:
                return [Response(opcode=Opcode.COLLECTIONS_GET_MANIFEST, opaque=op,
                                 status=Status.UNKNOWN_COMMAND).encode()]  # fmt: skip
            if self.manifest is None:
                return [Response(opcode=Opcode.COLLECTIONS_GET_MANIFEST, opaque=op,
                                 status=0x89).encode()]  # fmt: skip
            return [Response(opcode=Opcode.COLLECTIONS_GET_MANIFEST, opaque=op,
                             value=self.manifest.dumps(), datatype=1).encode()]  # fmt: skip
        if isinstance(msg, StreamRequest):
            self.streams.append(msg)
            status = self.on_stream(self, msg) if self.on_stream is not None else None
            if status is not None and not isinstance(status, int):
                return [replace(status, opaque=op).encode()]
            if status is not None:
                return [Response(opcode=Opcode.DCP_STREAM_REQ, opaque=op, status=status).encode()]
            out = [StreamRequestOk(opaque=op, failover_log=((UUID, 0),)).encode()]
            script = (self.scripts(self, msg) if self.scripts is not None
                      else self.script.get(msg.vbucket, []))  # fmt: skip
            for item in script:
                out.append(replace(item, opaque=op, vbucket=msg.vbucket).encode())
            return out
        raise AssertionError(f"RawNode: unexpected {msg!r}")


@contextlib.asynccontextmanager
async def serving(node: RawNode) -> AsyncIterator[RawNode]:
    """The node, listening until the block ends."""
    await node.start()
    try:
        yield node
    finally:
        await node.aclose()


def mutation(seq: int, cid: int, key: bytes, *, collections: bool = True) -> Mutation:
    """A mutation whose wire key carries the collection id when `collections`."""
    wire = leb128.join_key(cid, key) if collections else key
    return Mutation(by_seqno=seq, key=wire, value=b'{"k":1}', datatype=1)


def event(change: ManifestChange) -> SystemEvent:
    """The system event a producer sends for a change."""
    ev, version, key, value = encode_event(change)
    return SystemEvent(by_seqno=change.seq, event=ev, version=version, key=key, value=value)


async def drain(consumer: DcpConsumer) -> list[Any]:
    """Every item the consumer hands over until its streams end (keys as bytes)."""
    out: list[Any] = []
    async for batch in consumer.batches():
        for it in batch:
            out.append(it._replace(key=bytes(it.key), value=bytes(it.value))
                       if isinstance(it, DcpRecord) else it)  # fmt: skip
        consumer.commit()
    return out


def created(seq: int, cid: int, name: str) -> ManifestChange:
    return ManifestChange(0, seq, "collection-created", 6, 8, cid, name)


def dropped(seq: int, cid: int) -> ManifestChange:
    return ManifestChange(0, seq, "collection-dropped", 7, 8, cid)


# -- records, events and seqs -----------------------------------------------------------


def test_records_carry_their_collection_and_changes_come_in_wire_order() -> None:
    script: list[Message] = [
        SnapshotMarker(start_seqno=0, end_seqno=6, flags=0x06),
        mutation(1, 0, b"d1"),
        mutation(2, 9, b"u1"),
        event(created(3, 0x91, "carts")),
        mutation(4, 0x90, b"o1"),
        Deletion(by_seqno=5, key=leb128.join_key(0x91, b"c1")),
        SystemEvent(by_seqno=6, event=5, version=2, key=b"x", value=b"flatbuffers"),
        StreamEnd(status=0),
    ]

    async def scenario() -> None:
        async with serving(RawNode(highs={0: 6}, script={0: script})) as node:
            async with DcpConsumer(node.uri, until_end=True) as consumer:
                assert consumer.collections_enabled and consumer.manifest == MANIFEST
                items = await drain(consumer)
                assert consumer.positions[0].seq == 6  # the skipped event moved it too
            assert node.streams[0].value == b""  # no filter, no value
            assert Feature.COLLECTIONS in node.offered
        seen = [
            (it.opcode, it.collection, it.key) if isinstance(it, DcpRecord) else type(it).__name__
            for it in items
        ]
        assert seen == [
            "StreamOpened", "Snapshot",
            (OP_MUTATION, 0, b"d1"), (OP_MUTATION, 9, b"u1"),
            "ManifestChange",
            (OP_MUTATION, 0x90, b"o1"), (OP_DELETION, 0x91, b"c1"),
            "StreamEnded",
        ]  # fmt: skip
        change = next(it for it in items if isinstance(it, ManifestChange))
        assert change == created(3, 0x91, "carts")

    run(scenario())


def test_seqno_advanced_moves_a_filtered_stream_to_the_snapshot_end() -> None:
    script: list[Message] = [
        SnapshotMarker(start_seqno=0, end_seqno=10, flags=0x06),
        mutation(3, 9, b"u1"),
        SeqnoAdvanced(by_seqno=10),
        StreamEnd(status=0),
    ]

    async def scenario() -> None:
        async with serving(RawNode(highs={0: 10}, script={0: script})) as node:
            consumer = DcpConsumer(node.uri, until_end=True, collections=[Path("app", "users")])
            async with consumer:
                items = await drain(consumer)
                assert consumer.positions[0].seq == 10
                # reaching the marker's end through SEQNO_ADVANCED completes the snapshot
                assert consumer.boundaries(0) == [0, 10]
            ended = [it for it in items if isinstance(it, StreamEnded)]
            assert ended[0].position.seq == 10

    run(scenario())


# -- the filter ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("paths", "value"),
    [
        ("app.users,app.orders", {"collections": ["9", "90"]}),
        ("app", {"scope": "8"}),
        ("app,.", {"collections": ["0", "9", "90"]}),
        ("._default", {"collections": ["0"]}),
    ],
)
def test_one_filter_value_goes_with_every_stream_request(paths: str, value: object) -> None:
    end: list[Message] = [StreamEnd(status=0)]

    async def scenario() -> None:
        node = RawNode(partitions=3, script={0: end, 1: end, 2: end})
        async with serving(node):
            consumer = DcpConsumer(node.uri, until_end=True, collections=parse_paths(paths))
            async with consumer:
                await drain(consumer)
        assert sorted(r.vbucket for r in node.streams) == [0, 1, 2]
        for req in node.streams:
            assert json.loads(req.value) == value

    run(scenario())


def test_an_unknown_collection_is_a_typed_error_naming_it_before_any_stream() -> None:
    async def scenario() -> None:
        async with serving(RawNode()) as node:
            for text, named in (("app.nope", "app.nope"), ("nope", "nope"),
                                ("app.users,shop.carts", "shop.carts")):  # fmt: skip
                consumer = DcpConsumer(node.uri, collections=parse_paths(text))
                with pytest.raises(CollectionsError, match=named) as err:
                    async with consumer:
                        pass
                assert isinstance(err.value, UprError) and "\n" not in str(err.value)
            assert node.streams == []

    run(scenario())


def test_filter_empty_ends_the_stream_and_a_reopen_asks_without_dropped_ids() -> None:
    # partition 0: orders is dropped, then users; the node ends the stream (FilterEmpty).
    # partition 1: its first request is refused (the node dropped orders meanwhile),
    # and asked again without it.
    gone = CollectionsManifest.from_json(MANIFEST.without(Path("app", "orders")).dumps())
    script0: list[Message] = [
        SnapshotMarker(start_seqno=0, end_seqno=3, flags=0x06),
        mutation(1, 9, b"u1"),
        event(dropped(2, 0x90)),
        event(dropped(3, 9)),
        StreamEnd(status=7),
    ]

    def refuse_first(node: RawNode, req: StreamRequest) -> int | None:
        if req.vbucket == 1 and len([r for r in node.streams if r.vbucket == 1]) == 1:
            node.manifest = gone
            return Status.UNKNOWN_COLLECTION
        return None

    async def scenario() -> None:
        node = RawNode(partitions=2, script={0: script0, 1: [StreamEnd(status=0)]},
                       on_stream=refuse_first)  # fmt: skip
        async with serving(node):
            consumer = DcpConsumer(node.uri, collections=parse_paths("app.users,app.orders"))
            async with consumer:
                items = await drain(consumer)  # returns: both streams ended
                # each partition forgets what it saw dropped (or never held)
                assert consumer.followed(0) == set() and consumer.followed(1) == {9}
                assert consumer.filter is not None and consumer.filter.ids == {9, 0x90}
        ends = {it.partition: it.status for it in items if isinstance(it, StreamEnded)}
        assert ends == {0: 7, 1: 0}
        asked = [(r.vbucket, json.loads(r.value)["collections"]) for r in node.streams]
        assert (1, ["9", "90"]) in asked and (1, ["9"]) in asked
        changes = [it.kind for it in items if isinstance(it, ManifestChange)]
        assert changes == ["collection-dropped", "collection-dropped"]

    run(scenario())


def test_a_filter_empty_end_is_final_even_without_the_drop_seen() -> None:
    # a stream resumed above the drop's seq never sees the event, only the end
    async def scenario() -> None:
        node = RawNode(script={0: [StreamEnd(status=7)]})
        async with serving(node):
            consumer = DcpConsumer(node.uri, collections=parse_paths("app.users"))
            async with consumer:
                items = await drain(consumer)
                assert consumer.finished
        assert len(node.streams) == 1  # not reopened
        assert [(it.partition, it.status) for it in items if isinstance(it, StreamEnded)] == [
            (0, 7)
        ]

    run(scenario())


def test_a_node_behind_the_manifest_is_asked_again_with_the_same_filter() -> None:
    # a cluster node the newest manifest has not reached yet does not know app.orders
    behind = CollectionsManifest.from_json({**MANIFEST.to_json(), "uid": "4", "scopes": [
        {"name": "_default", "uid": "0", "collections": [{"name": "_default", "uid": "0"}]},
        {"name": "app", "uid": "8", "collections": [{"name": "users", "uid": "9"}]}]})  # fmt: skip

    def refuse_while_behind(node: RawNode, req: StreamRequest) -> int | None:
        if len(node.streams) == 1:
            node.manifest = behind
            return Status.UNKNOWN_COLLECTION
        node.manifest = MANIFEST  # it arrived
        return None

    async def scenario() -> None:
        node = RawNode(script={0: [StreamEnd(status=0)]}, on_stream=refuse_while_behind)
        async with serving(node):
            consumer = DcpConsumer(node.uri, collections=parse_paths("app.users,app.orders"))
            async with consumer:
                items = await drain(consumer)
                assert consumer.followed(0) == {9, 0x90}
        assert [json.loads(r.value) for r in node.streams] == [{"collections": ["9", "90"]}] * 2
        assert [it.status for it in items if isinstance(it, StreamEnded)] == [0]

    run(scenario())


def test_a_refusal_that_the_manifest_does_not_explain_stands() -> None:
    async def scenario() -> None:
        node = RawNode(on_stream=lambda node, req: Status.UNKNOWN_COLLECTION)
        async with serving(node):
            consumer = DcpConsumer(node.uri, collections=parse_paths("app.users"))
            with pytest.raises(UprError, match=r"refused \(collections app.users\)"):
                async with consumer:
                    pass

    run(scenario())


# -- servers without collections -------------------------------------------------------


def test_without_collections_every_record_is_the_default_collection() -> None:
    script: list[Message] = [
        SnapshotMarker(start_seqno=0, end_seqno=2, flags=0x06),
        mutation(1, 0, b"\x08not-an-id", collections=False),
        mutation(2, 0, b"plain", collections=False),
        StreamEnd(status=0),
    ]

    async def scenario() -> None:
        node = RawNode(collections=False, highs={0: 2}, script={0: script})
        async with serving(node):
            consumer = DcpConsumer(node.uri, until_end=True, collections=[Path.parse(".")])
            async with consumer:
                assert not consumer.collections_enabled and consumer.manifest is None
                items = await drain(consumer)
            assert node.streams[0].value == b""  # a value would be EINVAL there
            with pytest.raises(CollectionsError, match="does not support collections"):
                async with DcpConsumer(node.uri, collections=[Path("app", "users")]):
                    pass
        rows = [(it.collection, it.key) for it in items if isinstance(it, DcpRecord)]
        assert rows == [(0, b"\x08not-an-id"), (0, b"plain")]

    run(scenario())


def test_a_server_without_a_manifest_has_the_default_collection_only() -> None:
    async def scenario() -> None:
        node = RawNode(manifest=None, script={0: [StreamEnd(status=0)]})
        async with serving(node), DcpConsumer(node.uri, until_end=True) as consumer:
            assert consumer.collections_enabled and consumer.manifest == CollectionsManifest()
            await drain(consumer)

    run(scenario())


def test_resolve_filter_keeps_a_scope_open_to_collections_created_later() -> None:
    f = resolve_filter([Path("app")], MANIFEST)
    assert f is not None and f.scope == 8 and not f.empty
    f.forget(ManifestChange(0, 9, "scope-dropped", 9, 8))
    assert f.empty
    assert resolve_filter(None, MANIFEST) is None and resolve_filter([], None) is None
    assert resolve_filter([Path.parse("."), Path("_default")], None) is None


# -- per partition, and resumes across drops (docs/protocol.md §12.4) -------------------


def test_a_partition_forgets_an_id_only_once_it_handed_over_its_own_drop() -> None:
    # partition 0 sees app.users dropped and ends (FilterEmpty); partition 1's stream
    # ends before its own drop and is reopened: it must still ask for users and hand
    # over the drop, not end at once because another partition's filter is empty
    def scripts(node: RawNode, req: StreamRequest) -> list[Message]:
        if req.vbucket == 0:
            return [
                SnapshotMarker(start_seqno=0, end_seqno=2, flags=0x06),
                mutation(1, 9, b"a"),
                event(dropped(2, 9)),
                StreamEnd(status=7),
            ]
        if req.start_seqno == 0:
            return [
                SnapshotMarker(start_seqno=0, end_seqno=1, flags=0x06),
                mutation(1, 9, b"b"),
                StreamEnd(status=4),
            ]  # the state changed
        return [
            SnapshotMarker(start_seqno=1, end_seqno=2, flags=0x06),
            event(replace(dropped(2, 9), partition=1)),
            StreamEnd(status=7),
        ]

    async def scenario() -> None:
        node = RawNode(partitions=2, scripts=scripts)
        async with serving(node):
            consumer = DcpConsumer(node.uri, collections=parse_paths("app.users"))
            async with consumer:
                items = await drain(consumer)
                drops = [(it.partition, it.seq) for it in items if isinstance(it, ManifestChange)]
                assert drops == [(0, 2), (1, 2)]
                assert consumer.filter_emptied
        asked = [(r.vbucket, r.start_seqno, json.loads(r.value)) for r in node.streams]
        assert asked == [(0, 0, {"collections": ["9"]}), (1, 0, {"collections": ["9"]}),
                         (1, 1, {"collections": ["9"]})]  # fmt: skip

    run(scenario())


OLD, NEW = 0x1C, 0x1E  # crash.c1 before and after a drop and a re-create
RECREATED = CollectionsManifest.from_json({"uid": "16", "scopes": [
    {"name": "_default", "uid": "0", "collections": [{"name": "_default", "uid": "0"}]},
    {"name": "crash", "uid": "8", "collections": [{"name": "c1", "uid": "1e"}]},
]})  # fmt: skip
GONE = CollectionsManifest.from_json({"uid": "16", "scopes": [
    {"name": "_default", "uid": "0", "collections": [{"name": "_default", "uid": "0"}]},
    {"name": "crash", "uid": "8", "collections": []},
]})  # fmt: skip


def _after_drop(node: RawNode, req: StreamRequest) -> list[Message]:
    """Partition 0 above seq 5: a write to the old crash.c1 and one to the default
    collection, the old one's drop, the new one's creation, then a write to it."""
    history: list[Message] = [
        mutation(6, OLD, b"old"), mutation(7, 0, b"other"), event(dropped(8, OLD)),
        event(created(9, NEW, "c1")), mutation(10, NEW, b"new"),
    ]  # fmt: skip
    if req.value:  # filtered: the new collection only (the node refuses the old id)
        wanted = set(json.loads(req.value)["collections"])
        history = [m for m in history if isinstance(m, Mutation)
                   and f"{leb128.split_key(m.key)[0]:x}" in wanted]  # fmt: skip
    sent = [m for m in history if req.start_seqno < m.by_seqno <= req.end_seqno]
    return [SnapshotMarker(start_seqno=req.start_seqno, end_seqno=req.end_seqno, flags=0x06),
            *sent, StreamEnd(status=0)]  # fmt: skip


def _resuming(node: RawNode, **kw: Any) -> DcpConsumer:
    return DcpConsumer(node.uri, positions={0: StreamPosition(0, UUID, 5, 5, 5)},
                       collections=parse_paths("crash.c1"), **kw)  # fmt: skip


def test_a_resume_hands_over_the_drop_of_a_followed_collection_re_created_since() -> None:
    async def scenario() -> None:
        node = RawNode(manifest=RECREATED, highs={0: 9}, scripts=_after_drop)
        async with serving(node):
            async with _resuming(node, followed_ids={0: [OLD]}) as consumer:
                items = await drain(consumer)
                assert consumer.followed(0) == {NEW} and not consumer.filter_emptied
            # without the ids it followed, the resume cannot know of the old collection
            async with _resuming(node) as blind:
                missed = await drain(blind)
        got = [(it.key, it.collection) if isinstance(it, DcpRecord) else
               (it.kind, it.collection_id) for it in items
               if isinstance(it, DcpRecord | ManifestChange)]  # fmt: skip
        assert got == [(b"old", OLD), ("collection-dropped", OLD),
                       ("collection-created", NEW), (b"new", NEW)]  # fmt: skip
        # unfiltered up to the high read after the manifest, then filtered from there
        asked = [(r.start_seqno, r.end_seqno, r.value) for r in node.streams[:2]]
        assert asked[0] == (5, 9, b"") and asked[1][:1] == (9,)
        assert json.loads(asked[1][2]) == {"collections": ["1e"]}
        assert not any(isinstance(it, ManifestChange) and it.dropped for it in missed)

    run(scenario())


def test_a_resume_whose_collection_is_gone_hands_over_the_drop_then_ends() -> None:
    async def scenario() -> None:
        node = RawNode(manifest=GONE, highs={0: 10}, scripts=_after_drop)
        async with serving(node):
            async with _resuming(node, followed_ids=[OLD], until_end=True) as consumer:
                items = await drain(consumer)
                assert consumer.followed(0) == set()
            with pytest.raises(CollectionsError, match=r"crash\.c1"):
                async with _resuming(node):  # nothing says it was followed: unknown
                    pass
        kinds = [it.kind for it in items if isinstance(it, ManifestChange)]
        assert kinds == ["collection-dropped"]  # crash.c1's new id is not followed
        assert [it.key for it in items if isinstance(it, DcpRecord)] == [b"old"]

    run(scenario())


def test_a_drop_at_or_below_the_resume_position_was_seen_already() -> None:
    # the catch-up meets no drop of the followed id: it is forgotten at the high
    async def scenario() -> None:
        node = RawNode(manifest=RECREATED, highs={0: 9}, scripts=_after_drop)
        async with serving(node):
            positions = {0: StreamPosition(0, UUID, 8, 8, 8)}
            consumer = DcpConsumer(node.uri, positions=positions, followed_ids={0: [OLD]},
                                   collections=parse_paths("crash.c1"))  # fmt: skip
            async with consumer:
                items = await drain(consumer)
                assert consumer.followed(0) == {NEW}
        got = [it.kind if isinstance(it, ManifestChange) else it.key for it in items
               if isinstance(it, DcpRecord | ManifestChange)]  # fmt: skip
        assert got == ["collection-created", b"new"]
        assert node.streams[0].value == b""

    run(scenario())


def test_a_rollback_below_a_forgotten_drop_hands_it_over_again() -> None:
    # app.orders is dropped at seq 2 and forgotten once committed; a rollback to 1 takes
    # the drop back from the caller, and the source no longer knows the id: the
    # partition catches up unfiltered to its high and hands the drop over again
    def scripts(node: RawNode, req: StreamRequest) -> list[Message]:
        if req.start_seqno == 0:
            return [
                SnapshotMarker(start_seqno=0, end_seqno=1, flags=0x06),
                mutation(1, 0x90, b"o"),
                SnapshotMarker(start_seqno=2, end_seqno=3, flags=0x06),
                event(dropped(2, 0x90)),
                mutation(3, 9, b"u"),
                StreamEnd(status=4),
            ]
        if not req.value:  # the catch-up, from the rollback point
            return [
                SnapshotMarker(start_seqno=2, end_seqno=3, flags=0x06),
                mutation(2, 0, b"not-followed"),
                event(dropped(2, 0x90)),
                mutation(3, 9, b"u"),
                StreamEnd(status=0),
            ]
        return [StreamEnd(status=0)]

    def rollback_once(node: RawNode, req: StreamRequest) -> Message | None:
        if req.start_seqno == 3 and len(node.streams) == 2:
            node.manifest = CollectionsManifest.from_json(
                MANIFEST.without(Path("app", "orders")).dumps()
            )
            return StreamRequestRollback(rollback_seqno=1)
        return None

    async def scenario() -> None:
        node = RawNode(highs={0: 3}, scripts=scripts, on_stream=rollback_once)
        async with serving(node):
            consumer = DcpConsumer(node.uri, collections=parse_paths("app.users,app.orders"))
            async with consumer:
                items = await drain(consumer)
                assert consumer.followed(0) == {9}
        asked = [(r.start_seqno, r.end_seqno, r.value) for r in node.streams]
        assert asked[2][:3] == (1, 3, b"")  # unfiltered from the rollback point to the high
        assert json.loads(asked[3][2]) == {"collections": ["9"]}
        after = items[next(i for i, it in enumerate(items) if isinstance(it, Rollback)) :]
        got = [it.kind if isinstance(it, ManifestChange) else it.key for it in after
               if isinstance(it, DcpRecord | ManifestChange)]  # fmt: skip
        assert got == ["collection-dropped", b"u"]

    run(scenario())
