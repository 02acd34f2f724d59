"""Barrier cookies (formats/barrier.md): a cookie returns only after every partition passed."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import seqnos, wait_persisted
from upr_cli.dcp.consumer import ConsumerError, DcpConsumer
from upr_cli.dcp.events import BarrierReached
from upr_cli.net.uri import SourceUri


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
    assert first.cut == highs  # each partition's high seqno when the cookie arrived
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
