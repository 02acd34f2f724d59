"""The node's history branches under the consumer: it reports `Rollback` to the right
snapshot boundary and resumes on the new branch (in-process node, tests/dcp/inprocess.py).

The branch comes from the node's own crash semantics (docs/design.md, "Snapshot
boundaries"; the UPR design specification, "Failover Log"): a node stopped uncleanly
loses what it had not flushed and, at warm-up, adds a failover entry at its last
persisted complete snapshot. A consumer that received the lost items is told
ROLLBACK to that seq when it reconnects.
"""

from __future__ import annotations

from pathlib import Path

from tests.dcp.inprocess import InProcessNode, Received, consume_until, nodes, run
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Rollback, StreamOpened
from upr_cli.position import StreamPosition


def test_a_crash_that_loses_items_the_consumer_saw_rolls_it_back(tmp_path: Path) -> None:
    async def scenario() -> tuple[Received, int, int]:
        # no flusher of its own: the scenario says what reaches the disk
        node = InProcessNode(tmp_path / "n", partitions=1, flush_interval=3600)
        async with nodes(node):
            node.write(0, 5)
            await node.bucket.flush()  # seqs 1-5 durable
            old_uuid = node.bucket.partitions[0].uuid
            got = Received()
            async with DcpConsumer(node.uri, noop_interval=0.5) as consumer:
                await consume_until(consumer, got, lambda g: len(g.records) == 5)
                node.write(0, 3, prefix="lost")  # seqs 6-8: in memory only
                await consume_until(consumer, got, lambda g: len(g.records) == 8)
                await node.stop(clean=False)  # a crash: 6-8 are gone
                await node.start()
                new_uuid = node.bucket.partitions[0].uuid
                assert new_uuid != old_uuid and node.bucket.partitions[0].high_seq == 5
                node.write(0, 2, prefix="branch")  # seqs 6-7 again, other keys
                await consume_until(consumer, got, lambda g: len(g.records) == 10)
            return got, old_uuid, new_uuid

    got, old_uuid, _new_uuid = run(scenario())
    (rb,) = got.of(Rollback)
    assert (rb.partition, rb.asked, rb.to_seq, rb.uuid) == (0, 5, 5, old_uuid)
    assert (rb.previous.uuid, rb.previous.seq) == (old_uuid, 8)
    # the rollback comes before anything of the new branch, which resumes from 5
    assert got.events.index(rb) < got.events.index(got.of(StreamOpened)[-1])
    resumed = got.of(StreamOpened)[-1].position
    assert (resumed.seq, resumed.snap_start, resumed.snap_end) == (5, 5, 5)
    assert got.seqs(0) == [1, 2, 3, 4, 5, 6, 7, 8, 6, 7]
    branch = [bytes(r.key) for r in got.records[-2:]]
    assert branch == [b"branch0", b"branch1"]
    # undoing above to_seq, as a sink does, leaves exactly the node's new history
    kept = [r for r in got.records[:8] if r.by_seqno <= rb.to_seq] + got.records[8:]
    assert [r.by_seqno for r in kept] == [1, 2, 3, 4, 5, 6, 7]


def test_after_a_rollback_the_position_moves_to_the_new_branch(tmp_path: Path) -> None:
    """Resumed at 5 on a node whose log is [(new, 5), (old, 0)], the consumer receives 6
    and 7 of branch `new`. Its position must name `new`: (old, 7) is not a state the
    node ever had, and a later reconnect from it is answered ROLLBACK(5) again, which
    makes the sink undo and redo 6 and 7 for nothing."""

    async def scenario() -> tuple[Received, int]:
        node = InProcessNode(tmp_path / "n", partitions=1, flush_interval=3600)
        async with nodes(node):
            node.write(0, 5)
            await node.bucket.flush()
            got = Received()
            async with DcpConsumer(node.uri, noop_interval=0.5) as consumer:
                await consume_until(consumer, got, lambda g: len(g.records) == 5)
                node.write(0, 3, prefix="lost")
                await consume_until(consumer, got, lambda g: len(g.records) == 8)
                await node.stop(clean=False)
                await node.start()
                node.write(0, 2, prefix="branch")
                await consume_until(consumer, got, lambda g: len(g.records) == 10)
                await node.drop_connections()
                node.write(0, 1, prefix="more")
                await consume_until(consumer, got, lambda g: len(g.records) >= 11)
                return got, consumer.positions[0].uuid == node.bucket.partitions[0].uuid

    got, on_new_branch = run(scenario())
    assert len(got.of(Rollback)) == 1, [(e.asked, e.to_seq) for e in got.of(Rollback)]
    assert got.seqs(0) == [1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8]
    assert on_new_branch


def test_a_rollback_inside_a_snapshot_goes_back_to_the_callers_boundary_below(
    tmp_path: Path,
) -> None:
    """The caller stands at 7 inside a snapshot [6, 8] of a branch the node lost above 5,
    and says the last boundary it reached is 3. ROLLBACK(5) must take it to 3, not 5:
    the state at 5 is one the caller may never have held (docs/design.md, "Snapshot
    boundaries"). The stream then resumes from 3 on the branch the node kept."""

    async def scenario() -> tuple[Received, int]:
        node = InProcessNode(tmp_path / "n", partitions=1, flush_interval=3600)
        async with nodes(node):
            node.write(0, 5)
            await node.bucket.flush()
            uuid = node.bucket.partitions[0].uuid
            node.write(0, 3, prefix="lost")
            await node.stop(clean=False)
            await node.start()
            got = Received()
            start = StreamPosition(0, uuid, 7, 6, 8)
            async with DcpConsumer(node.uri, positions={0: start}, boundaries={0: [1, 3]},
                                   noop_interval=0.5) as consumer:  # fmt: skip
                await consume_until(consumer, got, lambda g: len(g.records) == 2)
                assert consumer.boundaries(0)[:2] == [1, 3]
            return got, uuid

    got, uuid = run(scenario())
    (rb,) = got.of(Rollback)
    assert (rb.asked, rb.to_seq, rb.uuid) == (5, 3, uuid)
    assert rb.previous == StreamPosition(0, uuid, 7, 6, 8)
    assert got.of(StreamOpened)[-1].position == StreamPosition(0, uuid, 3, 3, 3)
    assert got.seqs(0) == [4, 5]
