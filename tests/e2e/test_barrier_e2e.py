"""Barrier cookies (formats/barrier.md): a cookie returns only after every partition passed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import apply_changes, seqnos, wait_persisted
from upr_cli.dcp.consumer import ConsumerError, DcpConsumer
from upr_cli.dcp.events import BarrierReached
from upr_cli.net.bootstrap import Session, connect, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.protocol.messages import Delete, Set


async def _barrier_run(
    uri: str, highs: dict[int, int]
) -> list[tuple[BarrierReached, dict[int, int]]]:
    consumer = DcpConsumer(SourceUri.parse(uri), barriers=True, buffer_size=8 * 1024)
    await consumer.open()
    assert consumer.barriers_supported
    seen: list[tuple[BarrierReached, dict[int, int]]] = []
    try:
        await consumer.barrier(b"first")  # registered while the streams are far behind
        async for batch in consumer.batches():
            for item in batch:
                if isinstance(item, BarrierReached):
                    received = {p: pos.seq for p, pos in consumer.positions.items()}
                    seen.append((item, received))
                    if item.cookie == b"first":
                        # later writes must not move the second cookie's cut
                        await consumer.barrier(b"second")
            consumer.commit()
            if len(seen) == 2:
                return seen
    finally:
        await consumer.aclose()
    return seen


def test_cookie_comes_back_only_after_every_partition_passed_its_point(node: Node) -> None:
    upr("load", node.uri, "--docs", "4000", "--seed", "11")
    wait_persisted(node.uri)
    highs = {p: h for p, (_u, h, _pers) in asyncio.run(seqnos(node.uri)).items()}
    seen = asyncio.run(asyncio.wait_for(_barrier_run(node.uri, highs), 60))
    assert [b.cookie for b, _ in seen] == [b"first", b"second"]
    first, received = seen[0]
    # the end of the first whole snapshot at or past each partition's high seqno when the
    # cookie arrived: with nothing written meanwhile, that high seqno itself
    assert first.cut == highs
    for p, point in first.cut.items():
        assert received[p] >= point, f"partition {p} had {received[p]} < {point} at the barrier"
    second, received2 = seen[1]
    assert second.cut == highs and all(received2[p] >= s for p, s in second.cut.items())


def test_barriers_are_refused_without_the_control(node: Node) -> None:
    async def go() -> None:
        consumer = DcpConsumer(SourceUri.parse(node.uri), until_end=True)
        await consumer.open()
        try:
            with pytest.raises(ConsumerError, match="barrier"):
                await consumer.barrier(b"x")
        finally:
            await consumer.aclose()

    asyncio.run(go())


class _Source:
    """Writes through the KV front end, keeping each partition's history: on a fresh node
    the n-th write to a partition gets seq n, so the state at any seq is known."""

    def __init__(self, session: Session) -> None:
        self.s = session
        self.history: dict[int, list[tuple[bytes, bytes | None]]] = {}

    def part(self, key: bytes) -> int:
        return partition_of(key, self.s.num_partitions)

    async def set(self, key: bytes, value: bytes) -> None:
        msg = Set(vbucket=self.part(key), key=self.s.qualify(key), value=value, datatype=1,
                  opaque=self.s.conn.next_opaque())  # fmt: skip
        await self.s.conn.request(msg)
        self.history.setdefault(self.part(key), []).append((key, value))

    async def delete(self, key: bytes) -> None:
        msg = Delete(
            vbucket=self.part(key), key=self.s.qualify(key), opaque=self.s.conn.next_opaque()
        )
        await self.s.conn.request(msg)
        self.history.setdefault(self.part(key), []).append((key, None))

    def high(self, p: int) -> int:
        return len(self.history.get(p, ()))

    def state_at(self, p: int, seq: int) -> dict[bytes, bytes]:
        return apply_changes(self.history.get(p, [])[:seq])

    def keys_in(self, p: int, n: int, prefix: str) -> list[bytes]:
        keys = (f"{prefix}{i}".encode() for i in range(100_000))
        return [k for k in keys if self.part(k) == p][:n]


async def _cut_after_dedup(uri: str, persist: bool) -> None:
    """SET K=v1, barrier, SET K=v2 (and a delete either side) on open streams held back
    by flow control, so the node deduplicates K before sending it; then the rows received
    up to the cut must be, per partition, a state the partition really had. `persist`:
    wait until the node persisted everything before reading on."""
    src = _Source(await connect(SourceUri.parse(uri)))
    consumer = DcpConsumer(SourceUri.parse(uri), barriers=True, buffer_size=8 * 1024)
    received: dict[int, list[tuple[int, bytes, bytes | None]]] = {}
    try:
        ka, kb, kc = b"cut-a", b"cut-b", b"cut-c"
        pa, pb, pc = (src.part(k) for k in (ka, kb, kc))
        assert len({pa, pb, pc}) == 3
        for key in (ka, kb, kc, b"other-1", b"other-2", b"other-3"):
            await src.set(key, b'"v0"')
        await consumer.open()
        assert consumer.barriers_supported

        async def until(
            it: AsyncIterator[list[Any]], done: Callable[[], bool]
        ) -> BarrierReached | None:
            while True:
                for item in await it.__anext__():
                    if type(item) is DcpRecord:
                        op, p, seq, key, value = item[0], item[1], item[2], item[9], item[10]
                        row = (seq, bytes(key), bytes(value) if op == 0x57 else None)
                        received.setdefault(p, []).append(row)
                    elif isinstance(item, BarrierReached):
                        return item
                if done():
                    return None

        def caught_up() -> bool:
            return all(received.get(p, [(0,)])[-1][0] >= src.high(p) for p in src.history)

        async with contextlib.aclosing(consumer.batches()) as it:
            await until(it, caught_up)
            # Stop reading: the window (8 KiB) fills and every stream with news stalls
            # with its batch taken; what is written from now on waits in the node.
            for p in (pa, pb, pc):
                for k in src.keys_in(p, 12, "stall-"):
                    await src.set(k, b'"' + b"s" * 2000 + b'"')
            await asyncio.sleep(0.3)
            await src.set(ka, b'"v1"')
            await src.delete(kb)
            await src.set(kc, b'"v1"')
            points = {p: src.high(p) for p in range(src.s.num_partitions)}
            await consumer.barrier(b"dedup")
            # more than a memory batch (512 items) in front of K's newest version
            for k in src.keys_in(pa, 600, "after-"):
                await src.set(k, b'"x"')
            await src.set(ka, b'"v2"')
            await src.set(kb, b'"v2"')
            await src.delete(kc)
            while persist:  # the streams then resume with one disk snapshot of it all
                if all(pers == high for _u, high, pers in (await seqnos(uri)).values()):
                    break
                await asyncio.sleep(0.02)
            reached = await until(it, lambda: False)
        assert reached is not None and reached.cookie == b"dedup"
        assert set(reached.cut) == set(points)
        for p, rows in received.items():  # the node numbers writes as we counted them
            for seq, key, value in rows:
                assert src.history[p][seq - 1] == (key, value), (p, seq)
        for p, cut in sorted(reached.cut.items()):
            assert cut >= points[p], f"partition {p}: cut {cut} before its point {points[p]}"
            got = apply_changes([(k, v) for seq, k, v in received.get(p, []) if seq <= cut])
            assert got == src.state_at(p, cut), (
                f"partition {p}: the rows received up to cut {cut} are no state it had"
            )
        # in particular K: never v0, whatever was written before the cookie
        held = apply_changes([(k, v) for seq, k, v in received[pa] if seq <= reached.cut[pa]])
        assert held[ka] == src.state_at(pa, reached.cut[pa])[ka] in (b'"v1"', b'"v2"')
    finally:
        await consumer.aclose()
        await src.s.conn.aclose()


@pytest.mark.parametrize("flush", ["0.02", "60"], ids=["disk-backfill", "memory-queue"])
def test_cut_is_a_state_every_partition_had_despite_deduplication(
    node_factory: type[Node], flush: str
) -> None:
    """Issue 15: the cut is a snapshot end the client received whole, not the high seqno
    at arrival (a key updated across the cookie is sent once, at its newest seq). With
    --flush-interval 60 the writes stay in the node's queue and are sent in memory
    batches, of which only one holding everything queued leaves a real state."""
    node = node_factory("--flush-interval", flush).start()
    asyncio.run(asyncio.wait_for(_cut_after_dedup(node.uri, persist=flush != "60"), 60))


async def _cookie_with_the_window_full(uri: str) -> tuple[BarrierReached, int]:
    src = _Source(await connect(SourceUri.parse(uri)))
    consumer = DcpConsumer(SourceUri.parse(uri), barriers=True, buffer_size=8 * 1024)
    try:
        await src.set(b"big", b'"v0"')
        await consumer.open()
        async with contextlib.aclosing(consumer.batches()) as it:
            while not any(type(item) is DcpRecord for item in await it.__anext__()):
                pass
            # A document larger than the window, and nobody reading: the node sends it
            # whole (the window is checked before each message), so every stream has sent
            # everything and no byte more may go out until the client acknowledges.
            await src.set(b"big", b'"' + b"w" * 10_000 + b'"')
            await asyncio.sleep(0.3)
            await consumer.barrier(b"full")
            try:
                async with asyncio.timeout(10):
                    while True:
                        for item in await it.__anext__():
                            if isinstance(item, BarrierReached):
                                return item, src.part(b"big")
            except TimeoutError:
                pytest.fail("the cookie did not come back within 10 s")
    finally:
        await consumer.aclose()
        await src.s.conn.aclose()


def test_a_cookie_settled_while_the_window_is_full_still_comes_back(node: Node) -> None:
    """The cookie counts for flow control, so it waits for credit; the node must meanwhile
    go on reading the connection, whose BUFFER_ACK brings that credit."""
    reached, p = asyncio.run(asyncio.wait_for(_cookie_with_the_window_full(node.uri), 30))
    assert reached.cookie == b"full"
    assert reached.cut == {q: 2 if q == p else 0 for q in range(16)}
