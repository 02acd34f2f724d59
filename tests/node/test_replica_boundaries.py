"""A replica rolls back onto a snapshot boundary (formats/cluster.md §5): inside a
deduplicated snapshot a seq is not a state the active ever had, so ROLLBACK(r) takes the
copy back to the newest boundary at or below r that its undo reaches, and only the
versions above r are lost writes."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path

from upr_cli.node.bucket import Bucket
from upr_cli.node.storage import DocRow, NodeStorage, PartitionRecord

VB = 0


def _doc(key: bytes, seq: int, value: bytes | None = None) -> DocRow:
    """A version as the active streams it (None: a tombstone)."""
    deleted = value is None
    return DocRow(VB, key, seq, seq, 1000 + seq, 0, 0, 0, deleted, 0, value or b"")


def _run(tmp: Path, body: Callable[[Bucket], Awaitable[None]]) -> None:
    async def main() -> None:
        bucket = Bucket(tmp, "default", 1, flush_interval=3600)  # flushes only when told
        await bucket.start()
        try:
            await bucket.set_partition_state(VB, "replica", cas=bucket.state_cas, rev=0)
            await body(bucket)
        finally:
            await bucket.stop()

    asyncio.run(main())


def _snapshot(bucket: Bucket, start: int, end: int, *docs: DocRow) -> None:
    bucket.replica_marker(VB, start, end)
    for d in docs:
        bucket.apply_replica(d)


def _state(bucket: Bucket) -> dict[bytes, tuple[int, bool, bytes]]:
    with sqlite3.connect(bucket.storage.path) as c:
        rows = c.execute("SELECT key, seq, deleted, value FROM docs WHERE vbucket = ?", (VB,))
        return {bytes(k): (s, bool(d), bytes(v)) for k, s, d, v in rows}


def _lost(bucket: Bucket) -> list[tuple[int, bytes, int]]:
    return [(to, d.key, d.seq) for to, d in bucket.storage.lost_writes()]


def test_rollback_inside_a_deduplicated_snapshot_goes_to_the_boundary_before(
    tmp_path: Path,
) -> None:
    """The issue's case: the active wrote K=v1 (1), J (2), K=v3 (3); this copy received
    the snapshot [0,3] without K@1. ROLLBACK(2) must not leave {J}: back to 0."""

    async def body(bucket: Bucket) -> None:
        _snapshot(bucket, 0, 3, _doc(b"J", 2, b"j"), _doc(b"K", 3, b"v3"))
        await bucket.flush()
        part = bucket.partitions[VB]
        assert await bucket.rollback_replica(VB, 2) == 0  # the newest boundary ≤ 2
        assert _state(bucket) == {}  # not {J}: a state the active never had
        assert (part.high_seq, part.persisted_seq, part.snap_start, part.snap_end) == (0,) * 4
        # J@2 comes back on the stream; only K@3, above the seq asked, is a lost write
        assert _lost(bucket) == [(2, b"K", 3)]

    _run(tmp_path, body)


def test_rollback_to_a_boundary_restores_the_versions_it_had(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        _snapshot(bucket, 0, 2, _doc(b"K", 1, b"v1"), _doc(b"D", 2, b"d1"))
        await bucket.flush()
        _snapshot(bucket, 3, 6, _doc(b"K", 4, b"v4"), _doc(b"D", 5), _doc(b"J", 6, b"j"))
        await bucket.flush()
        assert bucket.partitions[VB].boundaries() == [0, 2, 6]
        # asked 5 (inside [3,6]): back to 2, with K and D as they were there
        assert await bucket.rollback_replica(VB, 2, asked=5) == 2
        assert _state(bucket) == {b"K": (1, False, b"v1"), b"D": (2, False, b"d1")}
        assert _lost(bucket) == [(5, b"J", 6)]
        assert bucket.partitions[VB].boundaries() == [0, 2]

    _run(tmp_path, body)


def test_a_boundary_the_write_queue_deduplicated_across_is_not_reachable(
    tmp_path: Path,
) -> None:
    """Two snapshots flushed in one round: K@1 and D@2 were replaced in the queue by
    K@4 and D@5, so the state at 2 never reached the disk. A rollback the stream aimed at
    2 goes to 0 instead (the caller restarts its stream from there)."""

    async def body(bucket: Bucket) -> None:
        _snapshot(bucket, 0, 2, _doc(b"K", 1, b"v1"), _doc(b"D", 2, b"d1"))
        _snapshot(bucket, 3, 5, _doc(b"J", 3, b"j"), _doc(b"K", 4, b"v4"), _doc(b"D", 5))
        await bucket.flush()
        assert await bucket.rollback_replica(VB, 2) == 0
        assert _state(bucket) == {}  # not K and D removed for good, as undoing to 2 would
        assert sorted(_lost(bucket)) == [(2, b"D", 5), (2, b"J", 3), (2, b"K", 4)]

    _run(tmp_path, body)


def test_the_write_queue_breaks_a_boundary_before_the_flush(tmp_path: Path) -> None:
    async def body(bucket: Bucket) -> None:
        part = bucket.partitions[VB]
        _snapshot(bucket, 0, 2, _doc(b"K", 1, b"v1"), _doc(b"D", 2, b"d1"))
        assert part.boundaries() == [0, 2]  # received whole, not yet persisted
        _snapshot(bucket, 3, 5, _doc(b"J", 3, b"j"), _doc(b"K", 4, b"v4"))
        assert part.boundaries() == [0]  # K@1 gave way to K@4 in the queue
        bucket.apply_replica(_doc(b"X", 5, b"x"))
        assert part.boundaries() == [0, 5]  # [3,5] received whole
        await bucket.flush()
        assert part.boundaries() == [0, 5] and part.bounds == [0, 5]
        assert bucket.storage.boundaries() == {VB: [0, 5]}

    _run(tmp_path, body)


def test_a_snapshot_cut_short_is_no_boundary(tmp_path: Path) -> None:
    """The stream of [1,5] stopped after 3 (a pause); the next stream sends [3,6], in
    which K@4 gave way to K@6 at the active: the state at 5 is not one the active had."""

    async def body(bucket: Bucket) -> None:
        _snapshot(bucket, 0, 1, _doc(b"X", 1, b"x"))
        _snapshot(bucket, 1, 5, _doc(b"J", 3, b"j"))
        await bucket.flush()
        part = bucket.partitions[VB]
        assert part.complete_seq == 1
        _snapshot(bucket, 3, 6, _doc(b"D", 5, b"d"), _doc(b"K", 6, b"v6"))
        assert part.boundaries() == [0, 1, 6]
        await bucket.flush()
        assert part.complete_seq == 6 and part.boundaries() == [0, 1, 6]
        assert await bucket.rollback_replica(VB, 5) == 1
        assert _state(bucket) == {b"X": (1, False, b"x")}

    _run(tmp_path, body)


def test_no_reachable_boundary_resets_and_keeps_the_lost_writes(tmp_path: Path) -> None:
    """Undo pruned past every boundary at or below r: the partition is emptied, and the
    versions above r are still recorded."""

    async def body(bucket: Bucket) -> None:
        _snapshot(bucket, 0, 2, _doc(b"K", 1, b"v1"), _doc(b"J", 2, b"j"))
        await bucket.flush()
        _snapshot(bucket, 3, 4, _doc(b"K", 3, b"v3"), _doc(b"X", 4, b"x"))
        await bucket.flush()
        bucket.undo_window = 1  # the flusher's prune keeps one seq of undo: floor 3
        await bucket._prune_undo()
        part = bucket.partitions[VB]
        assert part.undo_floor == 3 and part.boundaries() == [4]
        assert await bucket.rollback_replica(VB, 3) is None
        assert _state(bucket) == {}
        assert _lost(bucket) == [(3, b"X", 4)]
        assert part.boundaries() == [0]

    _run(tmp_path, body)


def test_boundaries_survive_a_restart(tmp_path: Path) -> None:
    async def first(bucket: Bucket) -> None:
        _snapshot(bucket, 0, 2, _doc(b"K", 1, b"v1"), _doc(b"J", 2, b"j"))
        await bucket.flush()
        _snapshot(bucket, 3, 5, _doc(b"K", 4, b"v4"))
        await bucket.flush()  # persisted 4, mid-snapshot [3,5]

    _run(tmp_path, first)

    async def main() -> None:
        bucket = Bucket(tmp_path, "default", 1, flush_interval=3600)
        await bucket.start()
        try:
            part = bucket.partitions[VB]
            assert part.state == "replica" and part.persisted_seq == 4
            assert part.boundaries() == [0, 2]
            assert await bucket.rollback_replica(VB, 4) == 2
            assert _state(bucket) == {b"K": (1, False, b"v1"), b"J": (2, False, b"j")}
        finally:
            await bucket.stop()

    asyncio.run(main())


def test_a_data_directory_from_before_boundaries_is_migrated_on_open(tmp_path: Path) -> None:
    """No `boundaries` table: each replica partition's persisted state is seeded as one
    when it ends a snapshot (whole); one persisted mid-snapshot gets none."""
    with NodeStorage(tmp_path, "default") as s:
        s.save_partitions([
            PartitionRecord(0, "replica", ((7, 0),), 6, 0, 6, 6),
            PartitionRecord(1, "replica", ((7, 0),), 6, 0, 4, 8),
            PartitionRecord(2, "active", ((7, 0),), 6, 0, 6, 6),
        ])  # fmt: skip
        s.start_undo(0, 0)
        s.start_undo(1, 0)
    with sqlite3.connect(tmp_path / "default.sqlite3") as c:
        c.execute("DROP TABLE boundaries")
    with NodeStorage(tmp_path, "default") as s:
        assert s.boundaries() == {0: [6]}
    with NodeStorage(tmp_path, "default") as s:  # seeded once, then kept as it is
        s.prune_undo(0, 7)
    with NodeStorage(tmp_path, "default") as s:
        assert s.boundaries() == {}
