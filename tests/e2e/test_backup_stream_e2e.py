"""stream_to_segments against a real node: segments equal the stream; rollbacks recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import Replica, drain, run, wait_persisted
from upr_cli.jobs.backup_stream import PartitionResult, stream_to_segments
from upr_cli.net.uri import SourceUri
from upr_cli.segments import SegmentReader


def name(p: int, first: int, last: int) -> str:
    return f"p{p:04x}-s{first:016x}-e{last:016x}.seg"


def replica_from(results: dict, replica: Replica) -> None:  # type: ignore[type-arg]
    """Apply a run to a client-side copy: its rollback first, then its segment's records."""
    for p, res in results.items():
        h = replica.history.setdefault(p, [])
        if res.rollback is not None:
            replica.history[p] = h = [e for e in h if e[0] <= res.rollback[1]]
        if res.segment is None:
            continue
        with SegmentReader(res.segment.path) as r:
            h += [(rec.seq, rec.key, rec.op, rec.value) for rec in r.records()]
            r.verify()


def next_run(
    uri: SourceUri, where: Path, before: dict[int, PartitionResult], **kw: Any
) -> dict[int, PartitionResult]:
    """A `stream_to_segments` run into the new directory `where`, going on from where the
    run `before` ended (its positions and failover logs)."""
    where.mkdir()
    pos = {p: r.position for p, r in before.items()}
    logs = {p: r.failover_log for p, r in before.items()}
    results: dict[int, PartitionResult] = run(
        stream_to_segments(uri, where, bucket="default", positions=pos, failover_logs=logs,
                           segment_name=name, **kw)
    )  # fmt: skip
    return results


def assert_same_as_node(mine: Replica, node: Node) -> None:
    """The client-side copy holds what a fresh drain of the node holds."""
    rows, _e, _c = run(drain(node.uri))
    truth = Replica()
    truth.apply(rows, [])
    assert mine.state() == truth.state()


def test_full_then_incremental_then_after_a_crash(node_factory: type[Node], tmp_path: Path) -> None:
    node = node_factory("--flush-interval", "0.02").start()
    uri = SourceUri.parse(node.uri)
    upr("load", node.uri, "--docs", "2000", "--update-ratio", "0.2", "--delete-ratio", "0.1")
    wait_persisted(node.uri)
    d1 = tmp_path / "b1"
    d1.mkdir()
    r1 = run(stream_to_segments(uri, d1, bucket="default", positions={}, segment_name=name))
    assert len(r1) == 16 and all(r.rollback is None for r in r1.values())
    mine = Replica()
    replica_from(r1, mine)
    assert_same_as_node(mine, node)

    # incremental: only what changed, from where the first run ended
    upr(
        "load", node.uri, "--docs", "500", "--update-ratio", "0.5", "--seed", "4", "--prefix", "inc"
    )
    r2 = next_run(uri, tmp_path / "b2", r1)
    assert sum(r.items for r in r2.values()) < 700
    assert all(r2[p].start_seq == r1[p].end_seq for p in r1)
    replica_from(r2, mine)
    assert_same_as_node(mine, node)

    # a crash loses unpersisted writes that a third run... never saw; a run that saw them
    persisted = {p: h for p, (_u, h, _x) in wait_persisted(node.uri).items()}
    node.stop()
    node.start("--flush-interval", "3600")
    upr("load", node.uri, "--docs", "300", "--seed", "5", "--prefix", "lost")
    r3 = next_run(uri, tmp_path / "b3", r2)
    replica_from(r3, mine)
    node.kill()
    node.start()
    # where the third run started (the second's end) is a snapshot boundary of the chain
    r4 = next_run(uri, tmp_path / "b4", r3, boundaries={p: [r3[p].start_seq] for p in r3})
    assert {p: r.rollback for p, r in r4.items()} == {
        p: (r3[p].end_seq, persisted[p], persisted[p]) for p in r3
    }
    assert all(r4[p].start_seq == persisted[p] for p in r4)
    replica_from(r4, mine)
    assert_same_as_node(mine, node)
