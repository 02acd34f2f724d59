"""A bucket's flusher: its writer thread and every write to its storage (the UPR design
specification, "How KV mutations flow into ep-engine and write queue"; docs/design.md
"Data flows" (1. Write)).

The flusher commits every queued item in one transaction per round (group commit) and
only then advances `persisted_seq`, so OBSERVE_SEQNO tells clients when a write is
durable. A replica partition's record names its last complete snapshot
(`undo.replica_snapshot`), and the round records the ends of the snapshots it completes
as boundaries of its undo (formats/cluster.md §5).

Storage work is never cut short: a commit runs in the writer thread whatever happens to
the coroutine that asked for it, so every flush, state write and rollback runs as its
own task under the flush lock (`unbroken`), and its caller only stops waiting when
cancelled (a replication link restarted by a map change, a client gone). Before, a flush
cancelled mid-commit left its committed items queued, and every later flush failed on
them ("seq 1 is not above stored seq 1").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from upr_cli.net.aio import cancel_and_wait
from upr_cli.node import undo
from upr_cli.node.partition import Partition
from upr_cli.node.storage import DocRow
from upr_cli.node.undo import FED

if TYPE_CHECKING:
    from upr_cli.node.bucket import Bucket

log = logging.getLogger(__name__)

FLUSH_CHUNK = 50_000  # docs per transaction at most
_T = TypeVar("_T")


class Flusher:
    """The writer thread of one bucket: its flush rounds and its other storage writes."""

    def __init__(self, bucket: Bucket, pool: ThreadPoolExecutor) -> None:
        self._bucket = bucket
        self._pool = pool
        self._lock = asyncio.Lock()
        self._work: set[asyncio.Task[Any]] = set()  # storage work under way (`unbroken`)
        self._loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the flush rounds, one every `flush_interval` seconds."""
        self._loop = asyncio.get_running_loop().create_task(self._rounds(), name="flusher")

    async def stop(self) -> None:
        """Stop the rounds."""
        if self._loop is not None:
            await cancel_and_wait([self._loop])
            self._loop = None

    async def drain(self) -> None:
        """Wait for the storage work whose callers were cancelled."""
        while self._work:
            await asyncio.wait(set(self._work))  # not gather: it would cancel them

    async def _rounds(self) -> None:
        bucket = self._bucket
        while True:
            await asyncio.sleep(bucket.flush_interval)
            try:
                await self.flush()
                await undo.prune(bucket)
                if bucket.purge_age is not None:
                    await self.purge(bucket.purge_age)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("bucket %s: flush failed; will retry", bucket.name)

    def flush(self) -> Awaitable[int]:
        """Commit every queued item (group commit) and advance persisted seqnos; returns count."""
        return self.unbroken(self._flush())

    async def _flush(self) -> int:
        bucket = self._bucket
        async with self._lock:
            total = 0
            loop = asyncio.get_running_loop()
            while True:
                batches: list[tuple[Partition, list[DocRow]]] = []
                size = 0
                for part in bucket.partitions.values():
                    if len(part.queue) and size < FLUSH_CHUNK:
                        docs = part.queue.snapshot()
                        batches.append((part, docs))
                        size += len(docs)
                gen = bucket.manifest_gen
                meta = bucket.collections.meta() if gen != bucket.manifest_saved else None
                if not batches and meta is None:
                    return total
                records = []
                bounds: dict[int, list[int]] = {}
                for part, docs in batches:
                    top = docs[-1].seq
                    start, end = (undo.replica_snapshot(part, top) if part.state in FED
                                  else (top, top))  # fmt: skip
                    records.append(part.record_at(top, start, end))
                    if part.state in FED and part.undo_floor is not None:
                        # the ends of snapshots this round completes: the undo reaches the
                        # state at each, unless the queue broke it
                        bounds[part.vbucket] = sorted({
                            m.end for m in part.markers
                            if part.persisted_seq < m.end <= top and m.end not in part.broken
                        })  # fmt: skip
                docs_all = [d for _, docs in batches for d in docs]
                await loop.run_in_executor(self._pool, bucket.storage.write_batch, docs_all,
                                           records, set(bounds), bounds, meta)  # fmt: skip
                bucket.disk_gen += 1
                bucket.manifest_saved = gen
                for (part, docs), rec in zip(batches, records, strict=True):
                    part.persisted_seq = rec.high_seq
                    part.snap_start, part.snap_end = rec.snap_start, rec.snap_end
                    if part.markers:
                        part.markers = [m for m in part.markers if m.end > rec.high_seq]
                    if part.vbucket in bounds:
                        part.bounds = sorted(set(part.bounds).union(bounds[part.vbucket]))
                        part.broken = {e for e in part.broken if e > rec.high_seq}
                    part.queue.remove_flushed(docs)
                    part.notify()
                bucket.made_room()
                total += len(docs_all)

    async def persist_state(self, parts: list[Partition]) -> None:
        """Write partition records (failover log or state changed) durably."""

        async def save() -> None:
            async with self._lock:
                recs = [p.record() for p in parts]
                await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._bucket.storage.save_partitions, recs
                )

        await self.unbroken(save())

    async def purge(self, older_than: float) -> dict[int, int]:
        """Purge tombstones older than `older_than` seconds; raise purge seqnos."""
        await self.flush()
        partitions = self._bucket.partitions

        async def run() -> dict[int, int]:
            purged = await self._locked(self._bucket.storage.purge_tombstones, older_than)
            for vb, seq in purged.items():
                partitions[vb].purge_seq = max(partitions[vb].purge_seq, seq)
            return purged

        return await self.unbroken(run())

    def call(self, fn: Callable[..., _T], *args: object) -> Awaitable[_T]:
        """Run a storage call on the writer thread, between flushes (never cut short)."""
        return self.unbroken(self._locked(fn, *args))

    async def _locked(self, fn: Callable[..., _T], *args: object) -> _T:
        """A storage call on the writer thread under the flush lock; the disk generation
        moves once it is done, so a prefetch taken meanwhile is not trusted after it."""
        async with self._lock:
            try:
                return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
            finally:
                self._bucket.disk_gen += 1

    def unbroken(self, work: Coroutine[Any, Any, _T]) -> Awaitable[_T]:
        """Run storage work as its own task: a cancelled caller stops waiting, while the
        work (a commit in the writer thread and the in-memory bookkeeping after it)
        finishes under the flush lock. `drain` waits for what is left."""
        task = asyncio.ensure_future(work)
        self._work.add(task)
        task.add_done_callback(self._work.discard)
        outer = asyncio.shield(task)

        def left(_: object) -> None:
            if outer.cancelled():  # nobody will read the outcome: a failure is logged
                task.add_done_callback(self._report_abandoned)

        outer.add_done_callback(left)
        return outer

    def _report_abandoned(self, task: asyncio.Task[Any]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.error("bucket %s: storage work failed after its caller left: %s",
                      self._bucket.name, exc, exc_info=exc)  # fmt: skip
