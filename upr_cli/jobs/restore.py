"""`upr restore`: the state at a backup, written to a node (or, later, a SQLite store).

The state comes from the chain (`jobs.state`). To a node, live documents go as
SET_WITH_META and deletions as DEL_WITH_META (docs/protocol.md "SET_WITH_META and
DEL_WITH_META"), keeping cas, rev seq,
flags and expiry; the target's conflict resolution decides unless `--force-updates`
(option FORCE_WITH_META_OP). A deletion is sent only where the target has the key,
unless `--include-tombstones`. Requests are pipelined, each to its partition's active node
(net/router.py: a cluster map is followed, NOT_MY_VBUCKET retried). Reading
verifies checksums: corruption stops the restore with the file and block named, or,
with `skip_corrupt`, the partition is skipped and reported.

Before anything is written, the chain the state reads is checked whole (`open_bucket`,
formats/repository.md §8.8: no damaged manifest, no missing parent, no seq gap) and
every segment file it reads is there with its size (`check_files`, unless
`skip_corrupt`): a broken chain is an error naming the missing piece, never a smaller
restore.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar

from upr_cli.jobs.state import Selection, check_files, partition_state, select
from upr_cli.net.router import Make, Router
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Frame
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.protocol.messages import DelWithMeta, Get, SetWithMeta
from upr_cli.protocol.status import Status
from upr_cli.repo import Manifest, Repository
from upr_cli.segments import Record, SegmentError
from upr_cli.source import open_bucket

T = TypeVar("T")
R = TypeVar("R")


def prefetch(
    fn: Callable[[T], R], items: Sequence[T], depth: int = 4
) -> Generator[tuple[T, R], None, None]:
    """(item, fn(item)) in order, computed by a reader thread up to `depth` items ahead.

    Reading segments then overlaps the SQLite writes, which release the GIL while SQLite
    works. fn should return its expected errors as values; anything else it raises is
    re-raised here. Closing the generator early stops the thread."""
    out: queue.Queue[tuple[T, R] | Exception | None] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(v: tuple[T, R] | Exception | None) -> bool:
        while not stop.is_set():
            try:
                out.put(v, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for it in items:
                if not put((it, fn(it))):
                    return
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            put(exc)
            return
        put(None)

    t = threading.Thread(target=run, name="upr-restore-reader", daemon=True)
    t.start()
    try:
        while (v := out.get()) is not None:
            if isinstance(v, Exception):
                raise v
            yield v
    finally:
        stop.set()
        t.join()


_SEQ, _OP = attrgetter("seq"), attrgetter("op")  # C-level getters


def states_ahead(
    repo: Repository, bucket: str, manifests: Sequence[Manifest], sel: Selection
) -> Generator[tuple[int, list[Record] | SegmentError], None, None]:
    """(partition, its state's records by seq, or the SegmentError reading it) for every
    selected partition, read on a `prefetch` thread ahead of the caller."""

    def read(p: int) -> list[Record] | SegmentError:
        try:
            state = partition_state(repo, bucket, manifests, sel.backup_id, p)
        except SegmentError as exc:
            return exc
        return sorted(state.values(), key=_SEQ)

    return prefetch(read, sel.partitions)


# Rows gathered across partitions before one store transaction: bounds memory by rows,
# not by the backup, while amortising the commit over many small partitions.
_RESTORE_BATCH_ROWS = 32_768

# FORCE_WITH_META_OP: the target skips its conflict resolution (docs/protocol.md
# "SET_WITH_META and DEL_WITH_META")
FORCE = 0x01


@dataclass
class RestoreSummary:
    """What a restore did, or (dry run) would do."""

    backup_id: str
    target: str
    dry_run: bool
    partitions: int = 0
    documents: int = 0
    deletions: int = 0
    written: int = 0
    conflicts: int = 0  # the target kept its own, newer version
    absent_deletes: int = 0  # a deletion for a key the target does not have
    errors: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    partitions_total: int = 0  # the partitions selected (for progress)

    @property
    def items(self) -> int:
        """The records of the state restored: documents and deletions."""
        return self.documents + self.deletions

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md: `items` the documents and deletions)."""
        return {
            k: getattr(self, k)
            for k in (
                "backup_id",
                "target",
                "dry_run",
                "partitions",
                "items",
                "documents",
                "deletions",
                "written",
                "conflicts",
                "absent_deletes",
                "skipped",
            )
        } | {
            "errors": sum(self.errors.values()),  # a count, as in every command
            "errors_by_status": self.errors,
            "seconds": round(self.seconds, 3),
            "items_per_s": round(self.written / self.seconds)
            if self.seconds and self.written
            else None,
        }


async def restore_to_node(
    repo_dir: Path,
    target: SourceUri,
    *,
    bucket: str | None = None,
    at: str = "latest",
    partitions: list[int] | None = None,
    keys: re.Pattern[bytes] | None = None,
    dry_run: bool = False,
    force_updates: bool = False,
    include_tombstones: bool = False,
    skip_corrupt: bool = False,
    window: int = 512,
    on_progress: Callable[[RestoreSummary], None] | None = None,
) -> RestoreSummary:
    """Write the state at `at` into a node; returns counts."""
    repo, b, manifests = open_bucket(repo_dir, bucket, at)
    sel = select(manifests, at, partitions)
    if not skip_corrupt:  # before anything is written (--skip-corrupt skips them instead)
        check_files(repo, b, manifests, sel)
    summary = RestoreSummary(str(sel.backup_id), target.redacted(), dry_run,
                             partitions_total=len(sel.partitions))  # fmt: skip
    t0 = time.monotonic()
    # Writes follow the cluster map: each to its partition's active node, retried with the
    # newer map on NOT_MY_VBUCKET (net/router.py).
    router = None if dry_run else await Router.open(target, name="upr-restore")
    options = FORCE if force_updates else 0
    writer = None if router is None else _NodeWriter(router, summary, window, options)
    try:
        for p in sel.partitions:
            try:
                state = partition_state(repo, b, manifests, sel.backup_id, p)
            except SegmentError as exc:
                if not skip_corrupt:
                    raise
                summary.skipped.append(f"partition {p}: {exc}")
                continue
            summary.partitions += 1
            records = [r for r in sorted(state.values(), key=lambda r: r.seq)
                       if keys is None or keys.search(r.key)]  # fmt: skip
            deletes = [r for r in records if r.op != OP_MUTATION]
            summary.deletions += len(deletes)
            summary.documents += len(records) - len(deletes)
            if writer is not None:
                await writer.partition(p, records, deletes, include_tombstones)
            if on_progress is not None:
                on_progress(summary)
        if writer is not None:
            await writer.drain()
    finally:
        if router is not None:
            await router.aclose()
    summary.seconds = time.monotonic() - t0
    return summary


class _NodeWriter:
    """Pipelined writes of a restore to a node: up to `window` requests in flight, each
    answer counted into the summary (written, kept newer on the target, absent, errors)."""

    def __init__(self, router: Router, summary: RestoreSummary, window: int, options: int):
        self.router, self.summary, self.window, self.options = router, summary, window, options
        self.inflight: deque[tuple[asyncio.Future[Frame], int, Make, str, bytes]] = deque()
        self.present: set[bytes] = set()  # keys the target has (GETs before deletions)

    async def partition(self, p: int, records: list[Record], deletes: list[Record],
                        include_tombstones: bool) -> None:  # fmt: skip
        """Write one partition's documents, then its deletions: all of them with
        `include_tombstones`, else only those of keys the target has."""
        for r in records:
            if r.op == OP_MUTATION:
                make = functools.partial(_set_with_meta, p, r.key, r.value, r.datatype, r.flags,
                                         r.expiry, r.rev_seq, r.cas, self.options)  # fmt: skip
                await self.send(p, make, "set", r.key)
        if deletes and not include_tombstones:  # only where the target has the key
            await self.drain()
            self.present.clear()
            for r in deletes:
                await self.send(p, functools.partial(_get, p, r.key), "get", r.key)
            await self.drain()
            self.summary.absent_deletes += len(deletes) - len(self.present)
            deletes = [r for r in deletes if r.key in self.present]
        for r in deletes:
            make = functools.partial(_del_with_meta, p, r.key, r.flags, r.rev_seq, r.cas,
                                     self.options)  # fmt: skip
            await self.send(p, make, "delete", r.key)

    async def send(self, vb: int, make: Make, kind: str, key: bytes) -> None:
        """Queue one request; with `window` in flight, wait for the oldest answer first."""
        self.inflight.append((self.router.submit(vb, make), vb, make, kind, key))
        if len(self.inflight) % 64 == 0:
            self.router.flush()
        if len(self.inflight) >= self.window:
            self.router.flush()
            await self._settle_oldest()

    async def drain(self) -> None:
        """Wait for every answer in flight."""
        self.router.flush()
        while self.inflight:
            await self._settle_oldest()

    async def _settle_oldest(self) -> None:
        fut, vb, make, kind, key = self.inflight.popleft()
        reply = await self.router.settle(fut, vb, make)
        status, summary = reply.vbucket_or_status, self.summary
        if kind == "get":
            if status == Status.SUCCESS:
                self.present.add(key)
        elif status == Status.SUCCESS:
            summary.written += 1
        elif status == Status.KEY_EEXISTS:
            summary.conflicts += 1
        elif status == Status.KEY_ENOENT and kind == "delete":
            summary.absent_deletes += 1
        else:
            name = f"0x{status:02x}"
            summary.errors[name] = summary.errors.get(name, 0) + 1


def _set_with_meta(p: int, key: bytes, value: bytes, datatype: int, flags: int, exp: int,
                   rev: int, cas: int, options: int, opaque: int) -> bytes:  # fmt: skip
    return SetWithMeta(vbucket=p, opaque=opaque, key=key, value=value, datatype=datatype,
                       flags=flags, expiration=exp, rev_seqno=rev, item_cas=cas,
                       options=options).encode()  # fmt: skip


def _del_with_meta(p: int, key: bytes, flags: int, rev: int, cas: int, options: int,
                   opaque: int) -> bytes:  # fmt: skip
    return DelWithMeta(vbucket=p, opaque=opaque, key=key, flags=flags, rev_seqno=rev,
                       item_cas=cas, options=options).encode()  # fmt: skip


def _get(p: int, key: bytes, opaque: int) -> bytes:
    return Get(vbucket=p, opaque=opaque, key=key).encode()


def restore_to_store(
    repo_dir: Path,
    db_path: Path,
    *,
    bucket: str | None = None,
    at: str = "latest",
    partitions: list[int] | None = None,
    keys: re.Pattern[bytes] | None = None,
    dry_run: bool = False,
    skip_corrupt: bool = False,
    on_progress: Callable[[RestoreSummary], None] | None = None,
) -> RestoreSummary:
    """Write the state at `at` into a SQLite store (formats/store.md): documents and
    tombstones as they were, and each partition's position and failover log from the
    chain, so a replay can continue from the backup."""
    from upr_cli.repo import resume_point
    from upr_cli.store import Store

    repo, b, manifests = open_bucket(repo_dir, bucket, at)
    sel = select(manifests, at, partitions)
    if not skip_corrupt:  # before anything is written (--skip-corrupt skips them instead)
        check_files(repo, b, manifests, sel)
    summary = RestoreSummary(str(sel.backup_id), f"sqlite:{db_path}", dry_run,
                             partitions_total=len(sel.partitions))  # fmt: skip
    t0 = time.monotonic()
    chain = [m for m in manifests if m.backup_id <= sel.backup_id]
    store = None if dry_run else Store(db_path, source=f"repo:{repo_dir}@{sel.backup_id}")
    # rows in ROW_FIELDS order, plain: the store's restore path binds them as they are
    pending: list[tuple[Any, ...]] = []
    pending_parts: list[int] = []

    def flush() -> None:
        # Several partitions' rows and their positions in one transaction: one
        # transaction per partition measured at 2/3 the rate on 1024 small partitions.
        if store is not None and pending_parts:
            with store.batch():
                summary.written += store.restore_rows(pending)
                for q in pending_parts:
                    rp = resume_point(chain, q)
                    if rp is not None and keys is None:
                        store.set_position(rp.position, rp.failover_log)
        pending.clear()
        pending_parts.clear()
        if on_progress is not None:
            on_progress(summary)

    try:
        for p, records in states_ahead(repo, b, manifests, sel):
            if isinstance(records, SegmentError):
                if not skip_corrupt:
                    raise records
                summary.skipped.append(f"partition {p}: {records}")
                continue
            summary.partitions += 1
            if keys is not None:
                records = [r for r in records if keys.search(r.key)]
            mutations = list(map(_OP, records)).count(OP_MUTATION)  # counted in C
            summary.documents += mutations
            summary.deletions += len(records) - mutations
            pending += [(r.op, p, r.seq, r.rev_seq, r.cas, r.flags, r.expiry, r.delete_time,
                         r.datatype, r.key, r.value, 0) for r in records]  # fmt: skip
            pending_parts.append(p)
            if len(pending) >= _RESTORE_BATCH_ROWS:
                flush()
        flush()
    finally:
        if store is not None:
            store.close()
    summary.seconds = time.monotonic() - t0
    return summary
