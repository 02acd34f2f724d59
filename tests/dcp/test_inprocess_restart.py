"""A finite stream whose node restarts from a crash ends at the new branch's high seq, and
a lost node is waited for as long as `follow_for` says (docs/protocol.md §4.5;
in-process node, see tests/dcp/inprocess.py)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from tests.dcp.inprocess import InProcessNode, Received, consume_until, nodes, run
from upr_cli.dcp.consumer import ConsumerError, DcpConsumer, Item
from upr_cli.dcp.events import Rollback, StreamEnded
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord

PARTS = 2


def _workload(node: InProcessNode, prefix: str) -> None:
    """Creates, then updates of half of them and deletes of a quarter, per partition."""
    for vb in range(PARTS):
        node.write(vb, 40, prefix=prefix, pad=1500)
        node.write(vb, 20, prefix=prefix, pad=1501)  # updates of the first 20
        for i in range(20, 30):
            node.bucket.delete(vb, b"\x00" + f"{prefix}{i}".encode())


class _Ordered(Received):
    """What a consumer handed over, with records and rollbacks also kept in arrival
    order, so that the state they leave can be replayed as a sink would apply it."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[DcpRecord | Rollback] = []

    def take(self, batch: list[Item]) -> None:
        n = len(self.records)
        super().take(batch)
        copies = iter(self.records[n:])  # the records of the batch, copied, in order
        for it in batch:
            if type(it) is DcpRecord:
                self.order.append(next(copies))
            elif isinstance(it, Rollback):
                self.order.append(it)

    def applied(self) -> dict[tuple[int, bytes], bytes]:
        """The live documents the records leave, each rollback undoing what is above it."""
        history: dict[int, list[DcpRecord]] = {}
        for it in self.order:
            if isinstance(it, Rollback):
                history[it.partition] = [r for r in history.get(it.partition, [])
                                         if r.by_seqno <= it.to_seq]  # fmt: skip
            else:
                history.setdefault(it.vbucket, []).append(it)
        out: dict[tuple[int, bytes], bytes] = {}
        for rows in history.values():
            for r in rows:
                if r.opcode == OP_MUTATION:
                    out[(r.vbucket, bytes(r.key))] = bytes(r.value)
                else:
                    out.pop((r.vbucket, bytes(r.key)), None)
        return out


async def _truth(node: InProcessNode) -> dict[tuple[int, bytes], bytes]:
    """The node's live documents, from a stream of everything it holds."""
    got = Received()
    async with DcpConsumer(node.uri, until_end=True) as consumer:
        await consume_until(consumer, got, lambda g: consumer.finished)
    return got.state()


@pytest.mark.parametrize("taken", [0, 20, 45])
def test_a_finite_stream_ends_at_the_new_branch_after_an_unclean_restart(
    tmp_path: Path, taken: int
) -> None:
    """The node crashes with writes it never persisted while a finite stream runs, after
    the consumer took `taken` records of partition 0 (0: none yet), and restarts at once.
    The end pinned at the start lies above what the new branch holds: the stream ends at
    the new branch's high seq with the rollback handed over, instead of waiting for ever."""
    seen: dict[str, Any] = {}

    async def scenario() -> _Ordered:
        node = InProcessNode(tmp_path / "n", partitions=PARTS, flush_interval=3600)
        async with nodes(node):
            _workload(node, "a")
            await node.bucket.flush()
            persisted = {vb: node.bucket.partitions[vb].high_seq for vb in range(PARTS)}
            _workload(node, "a")  # never persisted: the crash takes it back
            got = _Ordered()
            # a small window: the node cannot send everything before the crash
            consumer = DcpConsumer(node.uri, until_end=True, buffer_size=4096, noop_interval=0.5)
            async with consumer:
                assert all(consumer.parts[vb].end > persisted[vb] for vb in range(PARTS))
                await consume_until(consumer, got, lambda g: len(g.seqs(0)) >= taken)
                assert not consumer.parts[0].done
                # a partition whose stream ended before the crash keeps its end
                seen["expect"] = {p: part.end if part.done else persisted[p]
                                  for p, part in consumer.parts.items()}  # fmt: skip
                seen["rolled"] = consumer.positions[0].seq > persisted[0]
                await node.stop(clean=False)
                await node.start()
                await consume_until(consumer, got, lambda g: consumer.finished)
                seen["ends"] = {p: part.end for p, part in consumer.parts.items()}
            seen["truth"] = await _truth(node)
            return got

    got = run(scenario(), timeout=5)
    assert seen["ends"] == seen["expect"]  # the lower of the pinned end and the new high
    ended = got.of(StreamEnded)
    assert sorted(e.partition for e in ended) == list(range(PARTS))
    assert all(e.position.seq == seen["expect"][e.partition] for e in ended)
    # past the 40 records of the persisted snapshot it held writes the crash took back
    assert seen["rolled"] == (taken > 40)
    if seen["rolled"]:  # a rollback says so
        assert 0 in {r.partition for r in got.of(Rollback)}
    assert got.applied() == seen["truth"]


@pytest.mark.slow  # 7 s; tests/e2e/test_node_outage_e2e.py checks it in the default suite
def test_a_lost_node_is_waited_for_as_long_as_follow_for_says(tmp_path: Path) -> None:
    """A single node down for longer than the five attempts the consumer used to make
    (3 to 6 s) is waited for; the notices say when the link is lost and back, and the
    catch-up hands over what was written meanwhile."""
    notices: list[str] = []

    async def scenario() -> Received:
        node = InProcessNode(tmp_path / "n", partitions=PARTS)
        async with nodes(node):
            node.write(0, 3)
            got = Received()
            async with DcpConsumer(node.uri, noop_interval=0.5, follow_for=math.inf,
                                   on_notice=notices.append) as consumer:  # fmt: skip
                await consume_until(consumer, got, lambda g: len(g.records) == 3)
                await node.stop()
                await asyncio.sleep(6.5)  # beyond the old budget of five attempts
                await node.start()
                node.write(0, 2, prefix="after")
                await consume_until(consumer, got, lambda g: len(g.records) == 5)
            return got

    got = run(scenario(), timeout=15)
    assert got.seqs(0) == [1, 2, 3, 4, 5]
    assert len(notices) == 2, notices
    assert "lost" in notices[0] and "until it is back" in notices[0]
    assert "back after" in notices[1]


def test_a_wait_of_zero_gives_up_at_once(tmp_path: Path) -> None:
    async def scenario() -> float:
        node = InProcessNode(tmp_path / "n", partitions=PARTS)
        async with nodes(node):
            node.write(0, 3)
            got = Received()
            async with DcpConsumer(node.uri, noop_interval=0.5, follow_for=0) as consumer:
                await consume_until(consumer, got, lambda g: len(g.records) == 3)
                await node.stop()
                t0 = asyncio.get_running_loop().time()
                with pytest.raises(ConsumerError, match="1 reconnect attempts failed"):
                    await consume_until(consumer, got, lambda g: False)
                return asyncio.get_running_loop().time() - t0

    assert run(scenario(), timeout=5) < 1.0
