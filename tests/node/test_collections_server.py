"""The node's KV front end with collections, over real TCP with raw frames: HELLO
Collections, collection-prefixed keys, UnknownCollection with the manifest uid, the
COLLECTIONS_* commands, and TOUCH / GAT / GET_META / SUBDOC lookups as the SDK sends
them (formats/collections.md §4, §5)."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from upr_cli.collections import CollectionsManifest
from upr_cli.collections import Path as CPath
from upr_cli.node.server import NodeConfig, NodeServer
from upr_cli.protocol import Frame, FrameDecoder
from upr_cli.protocol.header import Feature
from upr_cli.protocol.messages import (
    CollectionsGetId,
    CollectionsGetManifest,
    CollectionsGetScopeId,
    CollectionsSetManifest,
    Delete,
    DelWithMeta,
    Get,
    GetClusterConfig,
    Hello,
    Message,
    SelectBucket,
    Set,
    SetWithMeta,
    UnknownRequest,
)
from upr_cli.protocol.status import Status

USERS = (
    CollectionsManifest().with_scope("app").with_collection("app", "users")
)  # users: id 9, uid 2


class Client:
    """One raw connection: send a request, read its response frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder()
        self.opaque = 0

    async def call(self, msg: Message) -> Frame:
        self.writer.write(msg.encode())
        while True:
            frames = self.decoder.read_rows(1, data_rows=False)
            if frames:
                frame = frames[0]
                assert isinstance(frame, Frame)
                return frame
            data = await self.reader.read(1 << 16)
            assert data, "the node closed the connection"
            self.decoder.feed(data)

    async def ok(self, msg: Message) -> Frame:
        frame = await self.call(msg)
        assert frame.vbucket_or_status == 0, (frame.vbucket_or_status, bytes(frame.value))
        return frame


@asynccontextmanager
async def _node(tmp: Path) -> AsyncIterator[NodeServer]:
    server = NodeServer(NodeConfig(data_dir=tmp, port=0, partitions=4, no_auth=True))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def _client(server: NodeServer, *, collections: bool) -> AsyncIterator[Client]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    client = Client(reader, writer)
    try:
        # XATTR as the SDK asks it: its lookups carry xattr paths (formats/subdoc.md)
        features = (Feature.JSON, Feature.XATTR, *((Feature.COLLECTIONS,) if collections else ()))
        hello = await client.ok(Hello(agent="test", features=features))
        granted = struct.unpack(f">{len(hello.value) // 2}H", hello.value)
        assert (Feature.COLLECTIONS in granted) == collections
        await client.ok(SelectBucket(bucket="default"))
        yield client
    finally:
        writer.close()
        await writer.wait_closed()


def _run(tmp: Path, body: Callable[[NodeServer], Awaitable[None]]) -> None:
    async def main() -> None:
        async with asyncio.timeout(10), _node(tmp) as server:
            await body(server)

    asyncio.run(main())


def _set(key: bytes, value: bytes = b"{}", vb: int = 0) -> Set:
    return Set(key=key, value=value, flags=0, expiration=0, vbucket=vb, datatype=1)


def test_keys_carry_their_collection_on_a_collections_connection(tmp_path: Path) -> None:
    async def body(server: NodeServer) -> None:
        async with _client(server, collections=True) as c, _client(server, collections=False) as d:
            await c.ok(CollectionsSetManifest(value=USERS.dumps()))
            await c.ok(_set(b"\x09u", b'{"in":"users"}'))
            await d.ok(_set(b"u", b'{"in":"default"}'))
            assert bytes((await c.ok(Get(key=b"\x09u"))).value) == b'{"in":"users"}'
            assert bytes((await c.ok(Get(key=b"\x00u"))).value) == b'{"in":"default"}'
            assert bytes((await d.ok(Get(key=b"u"))).value) == b'{"in":"default"}'
            await c.ok(Delete(key=b"\x09u"))
            assert (await c.call(Get(key=b"\x09u"))).vbucket_or_status == Status.KEY_ENOENT
            stored = server.buckets["default"].lookup(0, b"\x00u")
            assert stored is not None and stored.value == b'{"in":"default"}'

    _run(tmp_path, body)


def test_an_unknown_collection_is_0x88_with_the_manifest_uid(tmp_path: Path) -> None:
    async def body(server: NodeServer) -> None:
        async with _client(server, collections=True) as c, _client(server, collections=False) as d:
            await c.ok(CollectionsSetManifest(value=USERS.dumps()))
            for msg in (_set(b"\x0ak"), Get(key=b"\x0ak"), Delete(key=b"\x0ak"),
                        UnknownRequest(opcode=0x1C, extras=b"\0\0\0\5", key=b"\x0ak")):  # fmt: skip
                frame = await c.call(msg)
                assert frame.vbucket_or_status == Status.UNKNOWN_COLLECTION
                assert frame.datatype == 1
                assert json.loads(bytes(frame.value))["manifest_uid"] == "2"
            # the default collection dropped: a connection without collections reaches nothing
            no_default = USERS.without(CPath("_default", "_default"))
            await c.ok(CollectionsSetManifest(value=no_default.dumps()))
            frame = await d.call(_set(b"k"))
            assert frame.vbucket_or_status == Status.UNKNOWN_COLLECTION
            assert json.loads(bytes(frame.value))["manifest_uid"] == "3"

    _run(tmp_path, body)


def test_malformed_collection_ids_are_einval(tmp_path: Path) -> None:
    async def body(server: NodeServer) -> None:
        async with _client(server, collections=True) as c:
            for key in (b"\x80\x00k", b"\x80\x80\x80\x80\x80\x01k", b"\x09", b""):
                frame = await c.call(_set(key) if key else Get(key=key))
                assert frame.vbucket_or_status == Status.EINVAL, key

    _run(tmp_path, body)


def test_set_and_get_manifest(tmp_path: Path) -> None:
    async def body(server: NodeServer) -> None:
        async with _client(server, collections=False) as c:
            first = await c.ok(CollectionsGetManifest())
            assert (
                CollectionsManifest.from_json(bytes(first.value)) == CollectionsManifest()
            )  # before any set
            await c.ok(CollectionsSetManifest(value=USERS.dumps()))
            got = await c.ok(CollectionsGetManifest())
            assert CollectionsManifest.from_json(bytes(got.value)) == USERS and got.datatype == 1
            bad = await c.call(CollectionsSetManifest(value=b"{not json"))
            assert bad.vbucket_or_status == Status.EINVAL
            assert "not JSON" in json.loads(bytes(bad.value))["error"]["context"]
            lower = await c.call(
                CollectionsSetManifest(value=CollectionsManifest().with_scope("x").dumps())
            )
            assert lower.vbucket_or_status == Status.ERANGE
            await c.ok(CollectionsSetManifest(value=USERS.dumps()))  # the same again: fine

    _run(tmp_path, body)


def test_collection_and_scope_ids(tmp_path: Path) -> None:
    async def body(server: NodeServer) -> None:
        async with _client(server, collections=True) as c:
            await c.ok(CollectionsSetManifest(value=USERS.dumps()))
            for msg in (CollectionsGetId(value=b"app.users"), CollectionsGetId(key=b"app.users")):
                frame = await c.ok(msg)
                assert (frame.opcode, bytes(frame.extras)) == (0xBB, struct.pack(">QI", 2, 9))
            frame = await c.ok(CollectionsGetScopeId(value=b"app"))
            assert (frame.opcode, bytes(frame.extras)) == (0xBC, struct.pack(">QI", 2, 8))
            frame = await c.ok(CollectionsGetId(value=b"."))
            assert bytes(frame.extras) == struct.pack(">QI", 2, 0)
            expect = {b"nope.users": Status.UNKNOWN_SCOPE, b"app.nope": Status.UNKNOWN_COLLECTION,
                      b"app": Status.EINVAL, b"app.x y": Status.EINVAL}  # fmt: skip
            for path, status in expect.items():
                frame = await c.call(CollectionsGetId(value=path))
                assert frame.vbucket_or_status == status, path
            frame = await c.call(CollectionsGetScopeId(value=b"nope"))
            assert frame.vbucket_or_status == Status.UNKNOWN_SCOPE
            assert json.loads(bytes(frame.value))["manifest_uid"] == "2"

    _run(tmp_path, body)


def test_touch_gat_get_meta_and_lookup_in(tmp_path: Path) -> None:
    async def body(server: NodeServer) -> None:
        async with _client(server, collections=True) as c:
            await c.ok(CollectionsSetManifest(value=USERS.dumps()))
            await c.ok(Set(key=b"\x09u", value=b'{"a":1}', flags=7, expiration=0, datatype=1))
            await c.ok(UnknownRequest(opcode=0x1C, extras=struct.pack(">I", 4_000_000_000),
                                      key=b"\x09u"))  # fmt: skip
            gat = await c.ok(UnknownRequest(opcode=0x1D, extras=struct.pack(">I", 4_000_000_001),
                                            key=b"\x09u"))  # fmt: skip
            assert (bytes(gat.extras), bytes(gat.value)) == (struct.pack(">I", 7), b'{"a":1}')
            meta = await c.ok(UnknownRequest(opcode=0xA0, extras=b"\x02", key=b"\x09u"))
            assert struct.unpack(">IIIQB", meta.extras) == (0, 7, 4_000_000_001, 3, 1)
            assert meta.cas == gat.cas
            specs = b"".join(struct.pack(">BBH", op, fl, len(p)) + p for op, fl, p in (
                (0xC5, 4, b"$document.flags"), (0xC5, 4, b"$document.exptime"),
                (0xC5, 4, b"user_xattr"), (0, 0, b"")))  # fmt: skip
            look = await c.call(UnknownRequest(opcode=0xD0, key=b"\x09u", value=specs))
            assert look.vbucket_or_status == 0xCC  # one path failed (no user xattrs here)
            results, body = [], bytes(look.value)
            while body:
                status, n = struct.unpack_from(">HI", body)
                results.append((status, body[6 : 6 + n]))
                body = body[6 + n :]
            assert results == [(0, b"7"), (0, b"4000000001"), (0xC0, b""), (0, b'{"a":1}')]
            await c.ok(Delete(key=b"\x09u"))
            gone = await c.ok(UnknownRequest(opcode=0xA0, extras=b"\x02", key=b"\x09u"))
            assert struct.unpack(">IIIQB", gone.extras)[0] == 1  # deleted
            missing = await c.call(UnknownRequest(opcode=0x1C, extras=b"\0\0\0\1", key=b"\x09x"))
            assert missing.vbucket_or_status == Status.KEY_ENOENT

    _run(tmp_path, body)


def test_with_meta_takes_collection_prefixed_keys(tmp_path: Path) -> None:
    async def body(server: NodeServer) -> None:
        async with _client(server, collections=True) as c:
            await c.ok(CollectionsSetManifest(value=USERS.dumps()))
            await c.ok(SetWithMeta(key=b"\x09r", value=b"{}", flags=1, expiration=0,
                                   rev_seqno=5, item_cas=99, datatype=1))  # fmt: skip
            doc = server.buckets["default"].lookup(0, b"\x09r")
            assert doc is not None and (doc.rev_seq, doc.cas) == (5, 99)
            await c.ok(DelWithMeta(key=b"\x09r", value=b"", flags=0, expiration=0,
                                   rev_seqno=6, item_cas=100))  # fmt: skip
            frame = await c.call(SetWithMeta(key=b"\x0ar", value=b"{}", flags=1, expiration=0,
                                             rev_seqno=5, item_cas=99))  # fmt: skip
            assert frame.vbucket_or_status == Status.UNKNOWN_COLLECTION

    _run(tmp_path, body)


def test_the_terse_config_says_collections(tmp_path: Path) -> None:
    async def body(server: NodeServer) -> None:
        async with _client(server, collections=True) as c:
            await c.ok(CollectionsSetManifest(value=USERS.dumps()))
            frame = await c.ok(GetClusterConfig())
            config = json.loads(bytes(frame.value))
            assert "collections" in config["bucketCapabilities"]
            assert config["collectionsManifestUid"] == "2"

    _run(tmp_path, body)


def test_serve_precreates_collections(tmp_path: Path) -> None:
    async def main() -> None:
        config = NodeConfig(data_dir=tmp_path, port=0, partitions=2, no_auth=True,
                            collections=("app.users,app.short:60", "logs"))  # fmt: skip
        for _ in range(2):  # the second start finds them and changes nothing
            server = NodeServer(config)
            await server.start()
            try:
                m = server.buckets["default"].manifest
                assert m.lookup(CPath("app", "users")) is not None and m.scope("logs")
                assert m.lookup(CPath("app", "short")).max_ttl == 60  # type: ignore[union-attr]
                assert m.uid == 4 and server.buckets["default"].partitions[0].high_seq == 4
            finally:
                await server.stop()

    asyncio.run(main())
