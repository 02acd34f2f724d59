"""Expired documents on the node (formats/wire.md "Collections on DCP", point 9): the read
that finds one on an active partition expires it, the expiry pager expires the rest,
each as a tombstone with a new seq that keeps its expiry, and DCP sends it as an
EXPIRATION (0x59) to a client that asked for them, as a deletion to the others."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from tests.dcp.collections_helpers import FEATURES, RawDcp, cid, create
from tests.dcp.inprocess import InProcessNode, nodes, run
from upr_cli.node.bucket import Bucket
from upr_cli.node.storage import DocRow
from upr_cli.protocol.messages import (
    Control,
    DcpOpen,
    Deletion,
    DeletionV2,
    Expiration,
    Hello,
    Message,
    Mutation,
    SelectBucket,
)
from upr_cli.protocol.status import KeyNotFound, NotMyVbucket

VB = 0
KEY, OTHER = b"\x00gone", b"\x00other"


def _run(tmp: Path, body: Callable[[Bucket], Awaitable[None]], **kw: float | None) -> None:
    async def main() -> None:
        bucket = Bucket(tmp, "default", 2, flush_interval=3600, **kw)  # type: ignore[arg-type]
        await bucket.start()
        try:
            await body(bucket)
        finally:
            await bucket.stop()

    asyncio.run(main())


def _past() -> int:
    """An absolute expiry already passed (a Unix time: above 30 days, not relative)."""
    return int(time.time()) - 60


def _expired_as(bucket: Bucket, live: DocRow) -> DocRow:
    """The key's latest version, checked to be the expiration of `live`."""
    doc = bucket.lookup(live.vbucket, live.key)
    assert doc is not None and doc.deleted
    assert doc.seq > live.seq and doc.rev_seq == live.rev_seq + 1 and doc.cas > live.cas
    assert doc.value == b"" and doc.delete_time >= _past() + 60
    assert doc.expiry == doc.delete_time  # an expiration (a deletion's is 0)
    return doc


@pytest.mark.parametrize("read", ["get", "get_meta", "touch", "delete"])
def test_a_read_that_finds_an_expired_document_expires_it(tmp_path: Path, read: str) -> None:
    async def body(bucket: Bucket) -> None:
        live = bucket.store("set", VB, KEY, b"v", expiry=_past())
        await bucket.flush()  # on disk: the read finds it there
        high = bucket.partitions[VB].high_seq
        if read == "get_meta":
            assert bucket.get_meta(VB, KEY).deleted  # answered as the tombstone
        else:
            with pytest.raises(KeyNotFound):
                if read == "get":
                    bucket.get(VB, KEY)
                elif read == "touch":
                    bucket.touch(VB, KEY, 60)
                else:
                    bucket.delete(VB, KEY)
        assert _expired_as(bucket, live).seq == high + 1  # one expiration, one new seq
        with pytest.raises(KeyNotFound):
            bucket.get(VB, KEY)
        assert bucket.partitions[VB].high_seq == high + 1  # a second read finds a tombstone

    _run(tmp_path, body)


def test_a_write_over_an_expired_document_replaces_it(tmp_path: Path) -> None:
    """As kv_engine's write path: ADD and SET take the key as absent, REPLACE and a CAS
    find nothing, and none of them writes an expiration of its own."""

    async def body(bucket: Bucket) -> None:
        old = bucket.store("set", VB, KEY, b"old", expiry=_past())
        with pytest.raises(KeyNotFound):
            bucket.store("replace", VB, KEY, b"new")
        with pytest.raises(KeyNotFound):
            bucket.store("set", VB, KEY, b"new", cas=old.cas)
        added = bucket.store("add", VB, KEY, b"new")
        assert (added.seq, added.rev_seq, added.value) == (old.seq + 1, old.rev_seq + 1, b"new")
        assert bucket.get(VB, KEY) == added

    _run(tmp_path, body)


def test_the_pager_expires_documents_in_the_queue_and_on_disk(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        await create(bucket, "app.short", max_ttl=1)  # its system row's `expiry` is 1
        on_disk = bucket.store("set", VB, KEY, b"v", expiry=_past())
        kept = bucket.store("set", VB, OTHER, b"v", expiry=int(time.time()) + 3600)
        await bucket.flush()
        queued = bucket.store("set", 1, KEY, b"v", expiry=_past())
        assert await bucket.expire_due() == 2
        _expired_as(bucket, on_disk)
        _expired_as(bucket, queued)
        assert bucket.lookup(VB, OTHER) == kept  # not due yet
        await bucket.flush()
        assert await bucket.expire_due() == 0  # tombstones are not expired again
        event_key = b"\x01c" + bytes([cid(bucket, "app.short")])
        for vb in (0, 1):  # an event row (version 1 in `expiry`) is no document to expire
            event = bucket.lookup(vb, event_key)
            assert event is not None and event.expiry == 1 and not event.deleted
        later = bucket.storage.expired([0, 1], int(time.time()) + 7200, 100)
        assert [(d.vbucket, d.key) for d in later] == [(VB, OTHER)]

    _run(tmp_path, body)


def test_a_replica_partition_never_expires_its_documents(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        await bucket.set_partition_state(1, "replica", cas=bucket.state_cas, rev=0)
        copy = DocRow(1, KEY, 1, 1, 7, 0, _past(), 0, False, 0, b"v")
        assert bucket.apply_replica(copy)
        await bucket.flush()
        assert await bucket.expire_due() == 0  # its active sends the expiration
        assert bucket.lookup(1, KEY) == copy
        with pytest.raises(NotMyVbucket):
            bucket.get(1, KEY)

    _run(tmp_path, body)


def test_the_pager_runs_in_the_background(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        live = bucket.store("set", VB, KEY, b"v", expiry=int(time.time()) + 1)
        async with asyncio.timeout(10):
            while not bucket.lookup(VB, KEY).deleted:  # type: ignore[union-attr]
                await bucket.partitions[VB].wait_change(timeout=0.2)  # the expiration wakes it
        _expired_as(bucket, live)

    _run(tmp_path, body, expiry_pager_interval=0.1)


def test_no_pager_when_its_interval_is_none(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        bucket.store("set", VB, KEY, b"v", expiry=_past())
        await asyncio.sleep(0.3)
        doc = bucket.lookup(VB, KEY)
        assert doc is not None and not doc.deleted  # until a read finds it

    _run(tmp_path, body, expiry_pager_interval=None)


# -- on DCP ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _dcp(port: int, *, open_flags: int, expiry_opcode: bool) -> AsyncIterator[RawDcp]:
    """A DCP connection opened with `open_flags`, with enable_expiry_opcode if asked."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = RawDcp(reader, writer)
    try:
        for msg in (
            Hello(agent="expiry", features=FEATURES, opaque=1),
            SelectBucket(bucket="default", opaque=2),
            DcpOpen(name="expiry", flags=open_flags, opaque=3),
        ):
            assert (await conn.request(msg)).status == 0, msg
        if expiry_opcode:
            answer = await conn.request(Control(name="enable_expiry_opcode", value="true"))
            assert answer.status == 0
        yield conn
    finally:
        await conn.aclose()


@pytest.mark.parametrize("flush", [True, False], ids=["disk", "memory"])
def test_dcp_sends_expirations_to_clients_that_asked(tmp_path: Path, flush: bool) -> None:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)

    async def scenario() -> dict[str, list[Message]]:
        async with nodes(node):
            b = node.bucket
            b.store("set", VB, KEY, b"v", expiry=_past())  # 1
            b.store("set", VB, OTHER, b"v")  # 2
            with pytest.raises(KeyNotFound):
                b.get(VB, KEY)  # 3: the expiration
            b.delete(VB, OTHER)  # 4: a deletion
            if flush:
                await b.flush()
            out = {}
            for name, flags, opcode in (("expirations", 0x21, True), ("v2", 0x21, False),
                                        ("v1", 0x01, False)):  # fmt: skip
                async with _dcp(node.config.port, open_flags=flags, expiry_opcode=opcode) as c:
                    opaque, answer = await c.stream(VB)
                    assert answer.status == 0
                    await c.read_until(lambda c=c, o=opaque: len(_data(c.of(o))) == 2, 2.0)
                    out[name] = _data(c.of(opaque))
            return out

    got = run(scenario(), 20.0)
    expired = got["expirations"][0]
    assert isinstance(expired, Expiration) and (expired.by_seqno, expired.key) == (3, b"gone")
    assert expired.rev_seqno == 2 and expired.delete_time > 0
    deleted = got["expirations"][1]
    assert isinstance(deleted, DeletionV2) and (deleted.by_seqno, deleted.key) == (4, b"other")
    # without enable_expiry_opcode an expiration is a deletion (docs/protocol.md §2.10)
    assert [type(m) for m in got["v2"]] == [DeletionV2, DeletionV2]
    assert [type(m) for m in got["v1"]] == [Deletion, Deletion]
    assert [m.by_seqno for m in got["v1"]] == [3, 4]  # type: ignore[attr-defined]


def _data(msgs: list[Message]) -> list[Message]:
    return [m for m in msgs if isinstance(m, Mutation | Deletion | DeletionV2 | Expiration)]
