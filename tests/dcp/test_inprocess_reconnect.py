"""The consumer resumes a lost connection from its committed positions: nothing lost,
nothing twice (in-process node, see tests/dcp/inprocess.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dcp.inprocess import InProcessNode, Received, consume_until, nodes, run
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Rollback, StreamOpened

PARTS = 4


@pytest.mark.parametrize("how", ["drop-connections", "restart-node"])
def test_a_reconnect_resumes_without_loss_or_duplicates(tmp_path: Path, how: str) -> None:
    async def scenario() -> Received:
        async with nodes(InProcessNode(tmp_path / "n", partitions=PARTS)) as (node,):
            for vb in range(PARTS):
                node.write(vb, 5)
            got = Received()
            async with DcpConsumer(node.uri, noop_interval=0.5) as consumer:
                await consume_until(consumer, got, lambda g: len(g.records) == 5 * PARTS)
                if how == "drop-connections":
                    await node.drop_connections()
                else:
                    await node.bucket.flush()
                    await node.stop()  # clean: the history stays one branch
                    await node.start()
                for vb in range(PARTS):
                    node.write(vb, 3, prefix="after")
                await consume_until(consumer, got, lambda g: len(g.records) == 8 * PARTS)
                assert consumer.committed == consumer.positions
            return got

    got = run(scenario())
    for vb in range(PARTS):
        assert got.seqs(vb) == list(range(1, 9))  # in order, each once
    # one stream per partition before the reconnect, one after, from where each stood
    opened = got.of(StreamOpened)
    assert sorted(e.position.seq for e in opened) == [0] * PARTS + [5] * PARTS
    assert got.of(Rollback) == []


def test_an_uncommitted_tail_is_streamed_again_after_a_reconnect(tmp_path: Path) -> None:
    """The sink commits only the first snapshot; after the link drops, the consumer
    restarts from that commit, so the uncommitted items come again (at least once) and
    nothing is skipped."""

    async def scenario() -> Received:
        async with nodes(InProcessNode(tmp_path / "n", partitions=1)) as (node,):
            node.write(0, 4)
            got = Received()
            async with DcpConsumer(node.uri, noop_interval=0.5) as consumer:
                await consume_until(consumer, got, lambda g: len(g.records) == 4)
                node.write(0, 3, prefix="uncommitted")
                await consume_until(consumer, got, lambda g: len(g.records) == 7, commit=False)
                await node.drop_connections()
                await consume_until(consumer, got, lambda g: len(g.records) == 10)
            return got

    got = run(scenario())
    assert got.seqs(0) == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7]
