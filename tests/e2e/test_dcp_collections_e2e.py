"""Collections on DCP from a real `upr serve` (formats/wire.md "Collections on DCP"): the
client library streams every collection with its id and the system events in seq
order, a filtered stream gets its collection only, a dropped collection's documents
never come out, and all of it holds after a SIGKILL. Documents a collection's max TTL
ended reach DCP as expirations, through a read or the expiry pager."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from typing import Any

from tests.dcp.collections_helpers import FEATURES, RawDcp
from tests.e2e import collections_helpers as coll
from tests.e2e.conftest import PASSWORD, USER, Node, upr
from tests.e2e.e2e_helpers import drain, run, seqnos, wait_persisted
from upr_cli.collections import ManifestChange, Path
from upr_cli.net.bootstrap import connect, partition_of
from upr_cli.net.scram import plain_message
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.protocol.header import Feature
from upr_cli.protocol.messages import (
    Control,
    DcpOpen,
    Expiration,
    Get,
    Hello,
    Message,
    Mutation,
    SaslAuth,
    SelectBucket,
    Set,
)
from upr_cli.protocol.status import Status


async def _write(uri: str, docs: list[tuple[int, bytes, bytes]]) -> None:
    """SET (collection id, key, value) through KV on a collections connection."""
    s = await connect(SourceUri.parse(uri))
    try:
        assert s.collections, "upr serve grants HELLO Collections"
        for cid, key, value in docs:
            vb = partition_of(key, s.num_partitions)
            await s.conn.request(Set(vbucket=vb, key=s.qualify(key, cid), value=value,
                                     datatype=1, opaque=s.conn.next_opaque()))  # fmt: skip
    finally:
        await s.conn.aclose()


def _state(rows: list[DcpRecord]) -> dict[tuple[int, bytes], bytes]:
    """(collection, key) → value of the live documents a stream leaves."""
    out: dict[tuple[int, bytes], bytes] = {}
    for r in sorted(rows, key=lambda r: (r.vbucket, r.by_seqno)):
        if r.opcode == OP_MUTATION:
            out[(r.collection, bytes(r.key))] = bytes(r.value)
        else:
            out.pop((r.collection, bytes(r.key)), None)
    return out


def _in_seq_order(rows: list[DcpRecord], events: list[Any]) -> dict[int, list[ManifestChange]]:
    """Per partition, the changes; checks that records and changes came in seq order."""
    last: dict[int, int] = defaultdict(int)
    changes: dict[int, list[ManifestChange]] = defaultdict(list)
    # records and events were collected apart: their seqs interleave per partition
    seqs: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        seqs[r.vbucket].append(r.by_seqno)
    for e in events:
        if isinstance(e, ManifestChange):
            changes[e.partition].append(e)
            assert e.seq > last[e.partition]
            last[e.partition] = e.seq
    for vb, s in seqs.items():
        assert s == sorted(set(s)), f"partition {vb}: records out of order"
        assert not set(s) & {c.seq for c in changes[vb]}
    return changes


def test_collections_stream_from_a_node_across_a_drop_and_a_kill(node: Node) -> None:
    uri = node.uri
    coll.create(uri, "app.users", "app.orders")
    m = coll.get_manifest(uri)
    users, orders = (m.lookup(Path("app", c)) for c in ("users", "orders"))
    assert users is not None and orders is not None
    first = [(0, b"d%d" % i, b'{"d":%d}' % i) for i in range(20)]
    first += [(users.id, b"u%d" % i, b'{"u":%d}' % i) for i in range(20)]
    first += [(orders.id, b"o%d" % i, b'{"o":%d}' % i) for i in range(20)]
    run(_write(uri, first))
    coll.drop(uri, "app.orders")
    run(_write(uri, [(users.id, b"u0", b'{"u":"again"}'), (0, b"late", b"{}")]))

    want = {(c, k): v for c, k, v in first if c != orders.id}
    want[(users.id, b"u0")] = b'{"u":"again"}'
    want[(0, b"late")] = b"{}"

    def check() -> None:
        rows, events, consumer = run(drain(uri))
        assert consumer.collections_enabled
        assert _state(rows) == want  # not one document of the dropped collection
        changes = _in_seq_order(rows, events)
        assert len(changes) == node.partitions  # every partition had the changes
        for vb, seen in changes.items():
            # orders' creation was replaced by its drop: one event (deduplicated)
            got = [(c.kind, c.collection_id, c.name) for c in seen]
            assert got == [("scope-created", None, "app"),
                           ("collection-created", users.id, "users"),
                           ("collection-dropped", orders.id, None)], vb  # fmt: skip

        rows, _events, _c = run(drain(uri, collections=[Path("app", "users")]))
        assert {r.collection for r in rows} == {users.id}
        assert _state(rows) == {k: v for k, v in want.items() if k[0] == users.id}

    check()
    wait_persisted(uri)
    node.kill()  # the system events and the manifest are on disk: the same after a restart
    node.start()
    check()


async def _get_status(uri: str, cid: int, key: bytes) -> int:
    """The status of a GET of `key` in collection `cid`."""
    s = await connect(SourceUri.parse(uri))
    try:
        vb = partition_of(key, s.num_partitions)
        msg = Get(vbucket=vb, key=s.qualify(key, cid), opaque=s.conn.next_opaque())
        return (await s.conn.request(msg, check=False)).status
    finally:
        await s.conn.aclose()


async def _expiry_stream(port: int, high: int) -> list[Message]:
    """Partition 0 up to `high`, on a collections connection that asked for
    expirations (IncludeDeleteTimes and enable_expiry_opcode, docs/protocol.md §2.10)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    c = RawDcp(reader, writer)
    try:
        for msg in (
            Hello(agent="expiry-e2e", features=(*FEATURES, Feature.COLLECTIONS), opaque=1),
            SaslAuth(mechanism="PLAIN", payload=plain_message(USER, PASSWORD), opaque=2),
            SelectBucket(bucket="default", opaque=3),
            DcpOpen(name="expiry-e2e", flags=0x21, opaque=4),
            Control(name="enable_noop", value="true", opaque=5),
            Control(name="enable_expiry_opcode", value="true", opaque=6),
        ):
            assert (await c.request(msg)).status == 0, msg
        opaque, answer = await c.stream(0)
        assert answer.status == 0
        await c.read_until(lambda: any(getattr(m, "by_seqno", 0) >= high
                                       for m in c.of(opaque)), 10.0)  # fmt: skip
        return [m for m in c.of(opaque) if isinstance(m, Mutation | Expiration)]
    finally:
        await c.aclose()


def test_documents_a_max_ttl_ended_reach_dcp_as_expirations(node_factory: type[Node]) -> None:
    """The reviewer's case: a collection with a max TTL of 2 s. After the TTL, a read
    of one document expires it at once, and the expiry pager the others (within its
    10 s): `upr tail` no longer shows them as documents, and a client that asked for
    expirations gets one per document."""
    node = node_factory("--flush-interval", "0.02", partitions=1).start()
    made = coll.create(node.uri, "app.short", max_ttl=2)
    short = made.lookup(Path("app", "short"))
    assert short is not None
    keys = [b"s%d" % i for i in range(5)]
    run(_write(node.uri, [(short.id, k, b'{"v":1}') for k in keys]))
    time.sleep(3.5)
    assert run(_get_status(node.uri, short.id, keys[0])) == Status.KEY_ENOENT
    deadline = time.monotonic() + 30
    while True:
        out = upr("tail", node.uri, "--until-end", "--format", "json",
                  "--collections", "app.short").stdout  # fmt: skip
        rows = [json.loads(line) for line in out.splitlines()]
        last = {r["key"]: r["op"] for r in rows if "key" in r}  # records, not other lines
        if set(last) == {k.decode() for k in keys} and "mutation" not in last.values():
            break
        assert time.monotonic() < deadline, f"still documents after the TTL: {last}"
        time.sleep(1)
    # upr's consumer does not ask for expirations: it sees them as deletions
    assert set(last.values()) == {"deletion"}, last
    high = run(seqnos(node.uri))[0][1]
    seen = run(_expiry_stream(node.port, high))
    assert sorted(bytes(m.key) for m in seen) == sorted(bytes([short.id]) + k for k in keys)
    assert all(isinstance(m, Expiration) for m in seen), seen
