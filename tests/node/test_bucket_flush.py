"""The node's flusher under cancellation: a caller cancelled while its flush commits
(a replication link restarted by a map change, a client gone) must not leave the
committed items queued, or every later flush fails on them (issue 7's set-test failure:
"seq 1 is not above stored seq 1")."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Awaitable
from pathlib import Path

from upr_cli.node.bucket import Bucket


async def _cancel_mid_commit(bucket: Bucket, call: Awaitable[object]) -> None:
    """Run `call` and cancel it while the writer thread is inside its commit: another
    connection holds the database's write lock, so the commit waits (busy timeout) in
    the thread, and completes once the lock is released after the cancellation."""
    blocker = sqlite3.connect(bucket.storage.path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0.3)  # the thread is now waiting for the write lock
    task.cancel()
    blocker.execute("COMMIT")
    blocker.close()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await bucket.flush()  # waits for whatever flush is still under way


def test_a_cancelled_flush_still_finishes_its_bookkeeping(tmp_path: Path) -> None:
    async def main() -> None:
        bucket = Bucket(tmp_path, "default", 4, flush_interval=3600)
        await bucket.start()
        try:
            bucket.store("set", 0, b"\x00k", b"v1")
            await _cancel_mid_commit(bucket, bucket.flush())
            part = bucket.partitions[0]
            assert len(part.queue) == 0 and part.persisted_seq == part.high_seq == 1
            bucket.store("set", 0, b"\x00k", b"v2")
            assert await bucket.flush() == 1  # before the fix: seq 1 is not above stored 1
            assert bucket.storage.get(0, b"\x00k").value == b"v2"  # type: ignore[union-attr]
        finally:
            await bucket.stop()

    asyncio.run(main())


def test_a_cancelled_state_change_leaves_a_usable_partition(tmp_path: Path) -> None:
    """SET_VBUCKET flushes first; its handler cancelled mid-flush must not wedge it."""

    async def main() -> None:
        bucket = Bucket(tmp_path, "default", 4, flush_interval=3600)
        await bucket.start()
        try:
            for i in range(5):
                bucket.store("set", 1, b"\x00k%d" % i, b"v")
            cas = bucket.state_cas
            await _cancel_mid_commit(
                bucket, bucket.set_partition_state(1, "replica", cas=cas, rev=0)
            )
            part = bucket.partitions[1]
            assert part.persisted_seq == 5 and len(part.queue) == 0
            assert bucket.storage.doc_count(1) == 5
        finally:
            await bucket.stop()

    asyncio.run(main())


def test_a_cancelled_stop_does_not_cut_the_work_it_waits_for(tmp_path: Path) -> None:
    """`stop` waits for storage work whose callers left; cancelling `stop` itself (a
    second Ctrl-C) must not cancel that work either (gather would)."""

    async def main() -> None:
        bucket = Bucket(tmp_path, "default", 4, flush_interval=3600)
        await bucket.start()
        bucket.store("set", 0, b"\x00k", b"v1")
        blocker = sqlite3.connect(bucket.storage.path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        flushing = asyncio.ensure_future(bucket.flush())
        await asyncio.sleep(0.3)  # the commit waits for the write lock in the thread
        flushing.cancel()
        stopping = asyncio.ensure_future(bucket.stop(clean=False))
        await asyncio.sleep(0.1)  # stop is now waiting for the flush
        stopping.cancel()
        await asyncio.wait({stopping, flushing})
        blocker.execute("COMMIT")
        blocker.close()
        await bucket.stop(clean=False)  # waits for the flush, which was never cut short
        part = bucket.partitions[0]
        assert len(part.queue) == 0 and part.persisted_seq == 1

    asyncio.run(main())
