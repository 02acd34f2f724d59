"""`commit()` after every batch records where every partition stands, although it copies
only the partitions the batches moved (docs/design.md "Performance")."""

from __future__ import annotations

import contextlib
from pathlib import Path

from tests.dcp.inprocess import InProcessNode, nodes, run
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.position import StreamPosition


def test_each_commit_records_every_position(tmp_path: Path) -> None:
    async def scenario() -> int:
        async with nodes(InProcessNode(tmp_path, partitions=4)) as (node,):
            for vb in range(4):
                node.write(vb, 30 + 10 * vb, pad=300)
            batches = 0
            async with DcpConsumer(node.uri, until_end=True, buffer_size=4096) as consumer:
                async with contextlib.aclosing(consumer.batches()) as stream:
                    async for _batch in stream:
                        batches += 1
                        consumer.commit()
                        assert consumer.committed == consumer.positions
                        if batches == 3:  # the caller's own positions, then ours again
                            behind = {p: StreamPosition(p, s.uuid, 0, 0, 0)
                                      for p, s in consumer.positions.items()}  # fmt: skip
                            consumer.commit(behind)
                            assert consumer.committed == behind
                            consumer.commit()
                            assert consumer.committed == consumer.positions
                assert {p: s.seq for p, s in consumer.committed.items()} == {
                    0: 30, 1: 40, 2: 50, 3: 60}  # fmt: skip
            return batches

    assert run(scenario()) > 3
