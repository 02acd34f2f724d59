"""Crashes and purges: failover entries, rollbacks, rollback to 0 after a purge."""

from __future__ import annotations

import time
from pathlib import Path

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import Replica, drain, failover_logs, run, seqnos, wait_persisted
from upr_cli.dcp.events import Rollback
from upr_cli.position import StreamPosition


def test_sigkill_loses_unpersisted_writes_and_clients_roll_back_exactly(
    node_factory: type[Node],
) -> None:
    node = node_factory("--flush-interval", "0.02").start()
    upr("load", node.uri, "--docs", "800", "--seed", "1")
    persisted = {p: high for p, (_u, high, _pers) in wait_persisted(node.uri).items()}
    before = run(failover_logs(node.uri))
    assert node.stop() == 0  # clean: uuids kept
    node.start("--flush-interval", "3600")  # from now on nothing is persisted
    assert run(failover_logs(node.uri)) == before
    upr(
        "load",
        node.uri,
        "--docs",
        "600",
        "--update-ratio",
        "0.5",
        "--seed",
        "2",
        "--prefix",
        "lost",
    )
    highs = {p: high for p, (_u, high, _pers) in run(seqnos(node.uri)).items()}
    assert all(highs[p] > persisted[p] for p in highs)
    # a client sees every write, the unpersisted ones included
    replica = Replica()
    rows, events, consumer = run(drain(node.uri))
    replica.apply(rows, events)
    seen = consumer.committed
    assert {p: pos.seq for p, pos in seen.items()} == highs

    node.kill()
    node.start()
    logs = run(failover_logs(node.uri))
    for p, entries in logs.items():
        # a new entry at exactly the persisted seq, the old history behind it
        assert entries[0][1] == persisted[p] and entries[1:] == before[p]
    # the persisted seq ended the disk snapshot the client received: a boundary it knows
    bounds = {p: consumer.boundaries(p) for p in seen}
    assert all(persisted[p] in bounds[p] for p in persisted)
    # resuming without its boundaries, a client can only go back to 0 (always correct)
    _rows, blind, _c = run(drain(node.uri, positions=seen, partitions=[0]))
    assert [(e.asked, e.to_seq) for e in blind if isinstance(e, Rollback)] == [(persisted[0], 0)]
    # with them, it is told to roll back to exactly the persisted seq, and goes there
    rows, events, consumer = run(drain(node.uri, positions=seen, boundaries=bounds))
    rollbacks = {e.partition: e for e in events if isinstance(e, Rollback)}
    assert set(rollbacks) == set(highs)
    assert {p: e.to_seq for p, e in rollbacks.items()} == persisted
    assert {p: e.asked for p, e in rollbacks.items()} == persisted
    assert all(e.uuid == before[p][0][0] for p, e in rollbacks.items())
    replica.apply(rows, events)
    # and ends equal to the node
    fresh_rows, _e, _c = run(drain(node.uri))
    truth = Replica()
    truth.apply(fresh_rows, [])
    assert replica.state() == truth.state()
    assert not any(k.startswith(b"lost-") for k in truth.state())


def test_purged_tombstones_force_a_rollback_to_zero(node_factory: type[Node]) -> None:
    node = node_factory("--flush-interval", "0.02", "--purge-age", "0").start()
    upr("load", node.uri, "--docs", "600", "--delete-ratio", "0.3", "--seed", "5")
    wait_persisted(node.uri)
    _rows, _events, consumer = run(drain(node.uri))
    start = consumer.committed
    # positions below the purge seq of a partition that purged tombstones
    time.sleep(0.3)
    stats = run(_purge_seqnos(node.uri))
    purged = {p: s for p, s in stats.items() if s > 0}
    assert purged, "the node should have purged tombstones"
    positions = {}
    for p, purge_seq in purged.items():
        uuid = start[p].uuid
        positions[p] = StreamPosition(p, uuid, 1, 1, 1) if purge_seq > 1 else start[p]
    low = {p for p, s in purged.items() if s > 1}
    assert low
    _rows, events, _c = run(drain(node.uri, partitions=sorted(positions), positions=positions))
    rb = {e.partition: e.to_seq for e in events if isinstance(e, Rollback)}
    assert {p: rb.get(p) for p in low} == dict.fromkeys(low, 0)


async def _purge_seqnos(uri: str) -> dict[int, int]:
    from upr_cli.net.bootstrap import connect
    from upr_cli.net.uri import SourceUri

    s = await connect(SourceUri.parse(uri))
    try:
        st = await s.conn.stats("vbucket-seqno")
    finally:
        await s.conn.aclose()
    return {p: int(st[f"vb_{p}:purge_seqno"]) for p in range(s.num_partitions)}


def test_clean_restart_keeps_data_and_uuids(node_factory: type[Node], tmp_path: Path) -> None:
    node = node_factory("--flush-interval", "5").start()
    upr("load", node.uri, "--docs", "300", "--seed", "9")
    before = run(seqnos(node.uri))
    assert node.stop() == 0  # flushes everything on the way out
    node.start()
    after = run(seqnos(node.uri))
    assert {p: (u, h, h) for p, (u, h, _pers) in before.items()} == after
