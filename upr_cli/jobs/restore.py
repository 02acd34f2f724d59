"""`upr restore`: the state at a backup, written to a node, a cluster or a SQLite store.

The state comes from the chain (`jobs.state`), one partition at a time, each key's
latest version within its collection. To a node, live documents go as SET_WITH_META
and deletions as DEL_WITH_META (docs/protocol.md "SET_WITH_META and DEL_WITH_META"),
keeping cas, rev seq, flags and expiry; the target's conflict resolution decides unless
`--force-updates` (option FORCE_WITH_META_OP). A deletion is sent only where the target
has the key, unless `--include-tombstones`. Requests are pipelined, each to its
partition's active node (net/router.py: a cluster map is followed, NOT_MY_VBUCKET
retried). Reading verifies checksums: corruption stops the restore with the file and
block named, or, with `skip_corrupt`, the partition is skipped and reported.

A node keeps each acknowledged write; it has no transaction to undo a half-written
restore. So before the first write, `jobs.state.precheck` checks every block checksum
of every segment the state reads and each segment against its manifest entry, without
decoding a record: any damage stops the restore naming the file, the block and what is
wrong (nothing written), or, with `skip_corrupt`, leaves the damaged partitions out
whole (the summary names them; the CLI exits 4). `check=False` (`--no-check`) skips
it, and the summary says so. A write that fails once writing began (a node dies, a
partition stays unavailable) ends the restore with a summary naming the items written
and the source partitions whose every write was acknowledged (`failure`, `complete`);
a restore is idempotent (the same versions lose conflict resolution to themselves), so
running it again completes it. A write the target refuses as invalid (XATTR_EINVAL: an
xattr value that is not JSON, which a backup may hold) names the key in `refused` and
the restore goes on.

Xattrs (formats/wire.md "Xattrs") go back with their documents and tombstones, all of
them by default as cbbackupmgr does: a document as SET_WITH_META whose value is the blob
then the body (datatype bit 0x04), a tombstone that kept xattrs as DEL_WITH_META whose
value is the blob alone. `keep_xattrs="user"` leaves the system xattrs (names starting
with `_`) out, `"none"` every xattr. Writes go over connections that negotiated HELLO
XATTR; a target that refuses it stops the restore before anything is written, unless no
xattr is to be written (`"none"`). A SQLite store takes the records with their xattrs.

Where each key goes (jobs/restore_plan.py): to the partition its document key hashes to
over the TARGET's partition count, in the target's collection of the same name (or the
one `--map-data` names), with the collection id in front of the key on a connection
that negotiated Collections. A SQLite store keeps the source's partitions and ids, and
records the names.

Nothing is written until everything that can refuse the restore was checked: the chain
whole (`open_bucket`, formats/repository.md §8.8: no damaged manifest, no missing
parent, no seq gap) and every segment file it reads sound (`precheck`, above; with
`check=False` only there with its size, `check_files`, unless `skip_corrupt`); the
target reached and authenticated, its partition count and
collections read, every partition with a reachable active node, every collection the
restore needs there or created. A broken chain or a target that cannot take the restore
is one error naming what is wrong, never a smaller restore or a half-written bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, Literal, TypeVar

from upr_cli.collections import DEFAULT, Collection, CollectionsManifest, Scope
from upr_cli.errors import UprError, UsageError
from upr_cli.jobs.restore_plan import (
    EXISTS,
    MISSING,
    CollectionPlan,
    MapRule,
    RestorePlan,
    RestorePlanError,
    plan_restore,
    refuse_missing,
    resolve,
    source_partition_count,
)
from upr_cli.jobs.state import At, Precheck, Selection, check_files, precheck, select
from upr_cli.jobs.writer import DEFAULT_LIMIT, WriteWindow
from upr_cli.memory import ByteQueue, ByteWindow, MemoryLimit
from upr_cli.net.bootstrap import partition_of
from upr_cli.net.collections_manifest import create_collections, fetch_collections_manifest
from upr_cli.net.router import Router
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Frame, leb128, xattrs
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.protocol.header import Magic, Opcode
from upr_cli.protocol.status import Status
from upr_cli.repo import BackupId, Manifest, PlanStep, Repository, plan_state
from upr_cli.repo.manifest import CollectionFilter
from upr_cli.repo.pitr import Resolution
from upr_cli.segments import Record, SegmentError, SegmentReader
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


_SEQ, _OP, _COLL = attrgetter("seq"), attrgetter("op"), attrgetter("collection")  # C-level
_XATTRS, _KEY, _VALUE = attrgetter("xattrs"), attrgetter("key"), attrgetter("value")

# Which xattrs a restore writes: all of them (as cbbackupmgr does), the user ones only
# (`--no-system-xattrs`), or none (`--no-xattrs`).
KeepXattrs = Literal["all", "user", "none"]


def _steps(manifests: Sequence[Manifest], at: BackupId | Selection, partition: int
           ) -> list[PlanStep]:  # fmt: skip
    """The plan of a partition's state at a backup, or as a selection names it (a point
    in time: `Selection.steps`)."""
    if isinstance(at, Selection):
        return at.steps(manifests, partition)
    return plan_state(manifests, at=at, partition=partition)


def partition_state(
    repo: Repository, bucket: str, manifests: Sequence[Manifest], at: BackupId | Selection,
    partition: int,
) -> dict[tuple[int, bytes], Record]:  # fmt: skip
    """Latest data record per (collection id, key) of one partition at backup `at` (or
    as the selection `at` names it), tombstones included: the same key in two
    collections is two documents. System event records are not data
    (`SegmentReader.records` leaves them out)."""
    latest: dict[tuple[int, bytes], Record] = {}
    for step in _steps(manifests, at, partition):
        path = repo.segment_path(bucket, step.backup_id, step.name)
        with SegmentReader(path, repo.storage) as reader:
            for rec in reader.records():
                if rec.seq > step.max_seq:
                    break
                latest[rec.collection, rec.key] = rec
    return latest


def states_ahead(
    repo: Repository, bucket: str, manifests: Sequence[Manifest], sel: Selection
) -> Generator[tuple[int, list[Record] | SegmentError], None, None]:
    """(partition, its state's records by seq, or the SegmentError reading it) for every
    selected partition, read on a `prefetch` thread ahead of the caller."""

    def read(p: int) -> list[Record] | SegmentError:
        try:
            state = partition_state(repo, bucket, manifests, sel, p)
        except SegmentError as exc:
            return exc
        return sorted(state.values(), key=_SEQ)

    return prefetch(read, sel.partitions)


# What a record costs in memory beyond its key, value and xattrs (the tuple, its ints,
# three bytes objects' headers): counted too, or a million small documents would be
# held at several times their share.
_HELD = 200


def partition_chunks(
    repo: Repository,
    bucket: str,
    manifests: Sequence[Manifest],
    at: BackupId | Selection,
    partition: int,
    *,
    hold: int,
    chunk: int,
) -> Iterator[tuple[list[Record], int]]:
    """One partition's state at backup `at` (or as a selection names it), as
    `partition_state` gives it, in chunks of about `chunk` bytes (keys, values, xattrs
    and `_HELD` per record; a larger record alone), each with its bytes. While reading,
    at most about `hold` bytes of records are kept: past that, the latest version of
    each further key is noted by its position only and its record read again, streamed,
    once the state is known (a partition of a few large documents is never held whole).
    Both reads go through the same verified blocks, so a SegmentError comes from the
    first, before any chunk."""
    steps = _steps(manifests, at, partition)
    latest: dict[tuple[int, bytes], Record] = {}
    later: dict[tuple[int, bytes], tuple[int, int]] = {}  # read again: (step, seq)
    held = 0
    storage = repo.storage
    for i, step in enumerate(steps):
        with SegmentReader(repo.segment_path(bucket, step.backup_id, step.name),
                           storage) as r:  # fmt: skip
            for rec in r.records():
                if rec.seq > step.max_seq:
                    break
                k = rec.collection, rec.key
                if held <= hold:
                    held += len(rec.value) + len(rec.xattrs) + len(rec.key) + _HELD
                    latest[k] = rec
                else:  # holding enough: note where the latest version is
                    latest.pop(k, None)
                    later[k] = (i, rec.seq)
    out: list[Record] = []
    n = 0
    for rec in sorted(latest.values(), key=_SEQ):
        size = len(rec.value) + len(rec.xattrs) + len(rec.key) + _HELD
        if out and n + size > chunk:
            yield out, n
            out, n = [], 0
        out.append(rec)
        n += size
    latest.clear()
    for i in sorted({i for i, _seq in later.values()}):
        step = steps[i]
        with SegmentReader(repo.segment_path(bucket, step.backup_id, step.name),
                           storage) as r:  # fmt: skip
            for rec in r.records():
                if rec.seq > step.max_seq:
                    break
                if later.get((rec.collection, rec.key)) == (i, rec.seq):
                    size = len(rec.value) + len(rec.xattrs) + len(rec.key) + _HELD
                    if out and n + size > chunk:
                        yield out, n
                        out, n = [], 0
                    out.append(rec)
                    n += size
    if out:
        yield out, n


# (source partition, a chunk of its state or the SegmentError reading it, last chunk)
Chunk = tuple[int, list[Record] | SegmentError, bool]
_END: Chunk = (-1, [], True)


class ChunksAhead:
    """Every selected partition's state in chunks (`partition_chunks`), read by a thread
    ahead of the writer through a `ByteQueue`: what is read ahead and what the thread
    holds while reading are each an eighth of the memory budget."""

    def __init__(self, src: _Source, memory: MemoryLimit) -> None:
        self.src = src
        ahead = memory.share(0.125)
        self.hold, self.chunk = memory.share(0.125), max(64 * 1024, ahead // 4)
        self.queue: ByteQueue[Chunk | Exception] = ByteQueue(ahead, 1024)
        self.thread = threading.Thread(target=self._run, name="upr-restore-reader", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        src, q = self.src, self.queue
        try:
            for p in src.sel.partitions:
                prev: tuple[list[Record], int] | None = None
                try:
                    for got in partition_chunks(src.repo, src.bucket, src.manifests,
                                                src.sel, p, hold=self.hold,
                                                chunk=self.chunk):  # fmt: skip
                        if prev is not None and not q.put((p, prev[0], False), prev[1]):
                            return
                        prev = got
                except SegmentError as exc:
                    if not q.put((p, exc, True), 0):
                        return
                    continue
                records, n = prev if prev is not None else ([], 0)
                if not q.put((p, records, True), n):
                    return
            q.put(_END, 0)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            q.put(exc, 0)

    def _item(self, got: Chunk | Exception | None) -> Chunk | None:
        if isinstance(got, Exception):
            raise got
        return None if got is None or got is _END else got

    def get(self) -> Chunk | None:
        """The next chunk, waiting for it; None after the last."""
        return self._item(self.queue.get())

    async def next(self, writer: _NodeWriter | None = None) -> Chunk | None:
        """The next chunk, the event loop running meanwhile (the writes sent first)."""
        got = self.queue.get(timeout=0)
        if got is None:
            if writer is not None:
                await writer.idle()
            got = await asyncio.to_thread(self.queue.get)
        return self._item(got)

    def close(self) -> None:
        """Stop the thread (a chunk it is putting is dropped) and wait for it."""
        self.queue.close()
        self.thread.join()


# Rows gathered across partitions before one store transaction: bounds memory by rows,
# not by the backup, while amortising the commit over many small partitions.
_RESTORE_BATCH_ROWS = 32_768

# FORCE_WITH_META_OP: the target skips its conflict resolution (docs/protocol.md
# "SET_WITH_META and DEL_WITH_META")
FORCE = 0x01


#: the summary's members whose JSON name is not the field's (docs/output.md "One name,
#: one type": a count is not called by the name of what it counts)
_JSON_NAMES = {"partitions": "partition_count", "dropped": "dropped_records"}


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
    conflicts: int = 0  # not written: the target has this version or a newer one
    absent_deletes: int = 0  # a deletion for a key the target does not have
    errors: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    partitions_total: int = 0  # the partitions selected (for progress)
    plan: RestorePlan | None = None  # partition counts and collections
    dropped: int = 0  # records of collections dropped by the end of the chain: not restored
    excluded: int = 0  # records of collections --include-data/--exclude-data left out
    excluded_ids: frozenset[int] = frozenset()  # those collections' ids (not in JSON)
    keep_xattrs: KeepXattrs = "all"
    xattrs: int = 0  # documents and deletions restored with xattrs
    xattrs_left_out: int = 0  # records whose xattrs `keep_xattrs` left out (some or all)
    target_xattrs: bool | None = None  # the target took HELLO XATTR (None: a store)
    precheck: Precheck | None = None  # the checksum pass before the first write (None: skipped)
    left_out: list[int] = field(default_factory=list)  # source partitions skipped as damaged
    refused: list[str] = field(default_factory=list)  # keys the target refused (XATTR_EINVAL)
    failure: str | None = None  # what stopped a restore once writing began
    complete: list[int] = field(default_factory=list)  # source partitions fully acknowledged
    bytes: int = 0  # the keys, values and xattrs of the records restored
    point: Resolution | None = None  # a point in time: per partition its backup and seq

    @property
    def partial(self) -> bool:
        """Done, but something named was left out: damaged partitions, refused keys."""
        return self.failure is None and bool(self.left_out or self.refused)

    @property
    def target_has_same_or_newer(self) -> int:
        """Writes the target refused (KEY_EEXISTS) because it has this version or a newer
        one: an identical document too (its conflict resolution finds them equal), so no
        read per document is needed to tell the two apart. `conflicts` in JSON before."""
        return self.conflicts

    @property
    def items(self) -> int:
        """The records of the state restored: documents and deletions."""
        return self.documents + self.deletions

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md: `items` the documents and deletions)."""
        return (
            {
                _JSON_NAMES.get(k, k): getattr(self, k)
                for k in (
                    "backup_id",
                    "target",
                    "dry_run",
                    "partitions",
                    "items",
                    "documents",
                    "deletions",
                    "written",
                    "target_has_same_or_newer",
                    "conflicts",  # deprecated alias of target_has_same_or_newer
                    "absent_deletes",
                    "skipped",
                    "dropped",  # as dropped_records: `dropped` is a collection's flag
                    "excluded",
                    "keep_xattrs",
                    "xattrs_left_out",
                    "target_xattrs",
                    "left_out",
                    "refused",
                    "failure",
                    "complete",
                    "bytes",
                )
            }
            | {
                "precheck": self.precheck.to_json() if self.precheck is not None else None,
                "point": self.point.to_json() if self.point is not None else None,
                # documents and deletions restored with xattrs (`xattrs` is a
                # document's own, an object, in every command)
                "with_xattrs": self.xattrs,
                "errors": sum(self.errors.values()),  # a count, as in every command
                "errors_by_status": self.errors,
                "seconds": round(self.seconds, 3),
                "items_per_s": round(self.written / self.seconds) if self.seconds else 0,
            }
            | (self.plan.to_json() if self.plan is not None else {})
        )

    def count(self, records: list[Record], plans: dict[int, CollectionPlan]) -> None:
        """Add a partition's records to the totals and to their collections' counts."""
        mutations = list(map(_OP, records)).count(OP_MUTATION)  # counted in C
        self.documents += mutations
        self.deletions += len(records) - mutations
        self.xattrs += len(records) - list(map(_XATTRS, records)).count(b"")
        self.bytes += (sum(map(len, map(_KEY, records))) + sum(map(len, map(_VALUE, records)))
                       + sum(map(len, map(_XATTRS, records))))  # fmt: skip
        colls = set(map(_COLL, records))
        if len(colls) == 1:
            (c,) = colls
            plans[c].documents += mutations
            plans[c].deletions += len(records) - mutations
            return
        for (c, op), n in Counter(zip(map(_COLL, records), map(_OP, records), strict=True)).items():
            if op == OP_MUTATION:
                plans[c].documents += n
            else:
                plans[c].deletions += n


@dataclass(frozen=True)
class _Source:
    """The backup side of a restore, checked: the chain up to the selected backup, the
    partitions to read, and the collections (by name) at the chain's end."""

    repo: Repository
    bucket: str
    manifests: list[Manifest]  # the chain, up to the selected backup
    sel: Selection
    partitions: int  # the source bucket's partition count
    names: CollectionsManifest  # the collections live at the chain's end
    checked: Precheck | None  # the pre-check (None: `check=False`)
    chosen: CollectionFilter | None = None  # --include-data or --exclude-data

    @classmethod
    def open(cls, repo_dir: Path, bucket: str | None, at: At, partitions: list[int] | None,
             skip_corrupt: bool, check: bool = True, held: contextlib.ExitStack | None = None,
             command: str = "restore", chosen: CollectionFilter | None = None,
             ) -> _Source:  # fmt: skip
        """The checked source (a broken chain, a missing file or, unless `check` is off,
        a damaged segment is an error naming it; `skip_corrupt` leaves the partitions
        of damaged segments out instead). With `held`, the bucket's shared lock is
        entered into it (`open_bucket`). `chosen` restores only the collections it
        covers; a path it names that the backup does not hold is an error, before any
        segment is read."""
        repo, b, manifests = open_bucket(repo_dir, bucket, at, held=held, command=command)
        sel = select(manifests, at, partitions, bucket=b, repo=repo)
        chain = [m for m in manifests if m.backup_id <= sel.backup_id]
        if chosen is not None:
            check_chosen(chosen, sel.collections(chain), chain[-1] if chain else None)
        checked = None
        if check:  # before anything is written
            checked = precheck(repo, b, chain, sel)
            if not skip_corrupt:
                checked.refuse()
            elif checked.damage:
                kept = tuple(p for p in sel.partitions if p not in checked.damage)
                sel = sel.keeping(kept)
        elif not skip_corrupt:  # (--skip-corrupt skips them instead)
            check_files(repo, b, manifests, sel)
        count = source_partition_count(e.partition for m in chain for e in m.partitions)
        return cls(repo, b, chain, sel, count, sel.collections(chain), checked, chosen)

    def covers(self, scope: str, collection: str) -> bool:
        """True if the selected backup holds that collection (a filtered backup holds
        only some: formats/repository.md §5.9) and --include-data/--exclude-data keep it."""
        f = self.manifests[-1].collection_filter
        held = f is None or f.covers(scope, collection)
        return held and (self.chosen is None or self.chosen.covers(scope, collection))

    def excluded_ids(self) -> frozenset[int]:
        """The ids of the collections at the chain's end that `chosen` leaves out."""
        if self.chosen is None:
            return frozenset()
        return frozenset(c.id for s, c in self.names.collections()
                         if not self.chosen.covers(s.name, c.name))  # fmt: skip

    def plan(self, target: CollectionsManifest | None, rules: Sequence[MapRule], target_partitions:
             int | None, can_create: bool) -> RestorePlan:  # fmt: skip
        """The restore plan against a target with these collections and partitions."""
        return plan_restore(self.names, target, source_partitions=self.partitions,
                            target_partitions=target_partitions, rules=rules,
                            can_create=can_create, covers=self.covers)  # fmt: skip

    def summary(self, target: str, dry_run: bool) -> RestoreSummary:
        """An empty summary of this restore, with the pre-check and what it left out."""
        damage = self.checked.damage if self.checked is not None else {}
        out = RestoreSummary(str(self.sel.backup_id), target, dry_run,
                             partitions_total=len(self.sel.partitions) + len(damage),
                             precheck=self.checked, left_out=sorted(damage),
                             point=self.sel.point, excluded_ids=self.excluded_ids())  # fmt: skip
        out.skipped += [f"partition {p}: {why}" for p in sorted(damage) for why in damage[p]]
        return out

    def states(self) -> Generator[tuple[int, list[Record] | SegmentError], None, None]:
        """Each selected partition's state (records by seq), read ahead on a thread."""
        return states_ahead(self.repo, self.bucket, self.manifests, self.sel)


def _restorable(records: list[Record], keys: re.Pattern[bytes] | None, wanted: dict[int, Any],
                summary: RestoreSummary) -> list[Record]:  # fmt: skip
    """The records a restore writes: those of `keys` (None: all) in a collection of the
    plan, with the xattrs `summary.keep_xattrs` keeps; a record of a dropped collection
    is counted as `dropped`."""
    if keys is not None:
        records = [r for r in records if keys.search(r.key)]
    if not set(map(_COLL, records)) <= wanted.keys():  # a set built in C: rarely true
        kept = [r for r in records if r.collection in wanted]
        left = len(records) - len(kept)
        if summary.excluded_ids:
            excluded = sum(1 for r in records if r.collection in summary.excluded_ids)
            summary.excluded += excluded
            left -= excluded
        summary.dropped += left
        records = kept
    if summary.keep_xattrs != "all":
        records = _without_xattrs(records, summary)
    return records


def _without_xattrs(records: list[Record], summary: RestoreSummary) -> list[Record]:
    """The records with their system xattrs (`keep_xattrs="user"`) or all their xattrs
    (`"none"`) left out, each record that changed counted."""
    out = list(records)
    for i, r in enumerate(out):
        if not r.xattrs:
            continue
        blob = b"" if summary.keep_xattrs == "none" else user_only(r.xattrs)
        if blob != r.xattrs:
            summary.xattrs_left_out += 1
            out[i] = r._replace(xattrs=blob)
    return out


def user_only(blob: bytes) -> bytes:
    """The blob with its system xattrs (names starting with `_`) left out."""
    return xattrs.encode((n, v) for n, v in xattrs.pairs(blob) if not xattrs.is_system(n))


async def restore_to_node(
    repo_dir: Path,
    target: SourceUri,
    *,
    bucket: str | None = None,
    at: At = "latest",
    partitions: list[int] | None = None,
    keys: re.Pattern[bytes] | None = None,
    dry_run: bool = False,
    force_updates: bool = False,
    include_tombstones: bool = False,
    skip_corrupt: bool = False,
    window: int = 512,
    map_data: Sequence[MapRule] = (),
    create: bool = True,
    on_progress: Callable[[RestoreSummary], None] | None = None,
    keep_xattrs: KeepXattrs = "all",
    check: bool = True,
    memory: MemoryLimit = DEFAULT_LIMIT,
    collections: CollectionFilter | None = None,
) -> RestoreSummary:
    """Write the state at `at` into a node or cluster; returns counts. Everything that
    can refuse the restore is checked before the first write (the module's doc); a
    failure once writing began is returned in `failure`, with what was done. Up to
    `window` requests and a quarter of `memory` are in flight, an eighth of it read
    ahead (`ChunksAhead`)."""
    with contextlib.ExitStack() as held:
        src = _Source.open(repo_dir, bucket, at, partitions, skip_corrupt, check, held,
                           chosen=collections)  # fmt: skip
        summary = src.summary(target.redacted(), dry_run)
        summary.keep_xattrs = keep_xattrs
        t0 = time.monotonic()
        router = await Router.open(target, name="upr-restore")
        writer: _NodeWriter | None = None
        try:
            _check_actives(router)  # before the plan, which may change the target's manifest
            summary.target_xattrs = router.xattrs
            if not dry_run:
                refuse_without_xattrs(summary)
            summary.plan = plan = await _plan_node(router, target, src, map_data, create, dry_run)
            if not dry_run:
                writer = _NodeWriter(router, summary, ByteWindow(memory.share(0.25), window),
                                     FORCE if force_updates else 0, plan)  # fmt: skip
            plans = plan.by_source()
            reader = ChunksAhead(src, memory)
            try:
                try:
                    while (got := await reader.next(writer)) is not None:
                        p, records, last = got
                        todo = _take(p, records, last, keys, plans, summary, skip_corrupt)
                        if todo is None:
                            continue
                        if writer is not None:
                            await writer.partition(todo, include_tombstones, p, last)
                        if on_progress is not None:
                            on_progress(summary)
                finally:
                    reader.close()
                if writer is not None:
                    await writer.drain()
            except (UprError, OSError) as exc:
                if writer is None or not writer.sent:
                    raise  # nothing written: one error, as before the first write
                summary.failure = str(exc) if isinstance(exc, UprError) else f"network error: {exc}"
                if isinstance(exc, SegmentError):  # the source failed, not the target: the
                    with contextlib.suppress(UprError, OSError):  # writes sent still count
                        await writer.drain()
        finally:
            if writer is not None:
                writer.abandon()
            await router.aclose()
        summary.complete.sort()
        summary.seconds = time.monotonic() - t0
        return summary


async def _plan_node(router: Router, target: SourceUri, src: _Source, rules: Sequence[MapRule],
                     create: bool, dry_run: bool) -> RestorePlan:  # fmt: skip
    """The plan against the target the router reaches: its partition count and
    collections; the missing collections created (one manifest change) unless
    `create` is off or this is a dry run. A collection the target lacks and will not
    get is an error before anything is written (in a dry run the plan shows it)."""
    count = router.num_partitions
    if count <= 0:
        raise RestorePlanError(f"{target.redacted()}: the target has no partition map "
                               "(GET_CLUSTER_CONFIG): nothing written")  # fmt: skip
    theirs = await fetch_collections_manifest(target) if router.collections else None
    plan = src.plan(theirs, rules, count, create and theirs is not None)
    if theirs is None:
        why = ("the target does not support collections; --map-data S.C=_default._default "
               "restores one into the default collection")  # fmt: skip
    else:
        why = "--no-create"
    if dry_run:
        return plan
    refuse_missing(plan, why)
    todo = plan.to_create()
    if todo:
        try:
            made = await create_collections(target, plan.creations())
        except UprError as exc:
            for c in todo:
                c.status = MISSING
            refuse_missing(plan, f"creating them failed: {exc}")
            raise
        resolve(plan.collections, made)
        refuse_missing(plan, "the target's manifest lacks them after the change")
    return plan


def refuse_without_xattrs(summary: RestoreSummary) -> None:
    """Stop a restore whose target refused HELLO XATTR before anything is written,
    unless it writes no xattr (a backup may hold some in any partition: which ones is
    known only once every partition is read)."""
    if summary.target_xattrs is False and summary.keep_xattrs != "none":
        raise RestorePlanError(f"{summary.target}: the target does not take xattrs (HELLO "
                               "XATTR refused): nothing written; --no-xattrs restores the "
                               "documents without them")  # fmt: skip


def _check_actives(router: Router) -> None:
    """Every partition of the target has a reachable active node, before the first
    write: otherwise the writes to it would retry for a minute each and leave the
    bucket half-restored."""
    lost = [vb for vb in range(router.num_partitions) if router.conn_for(vb) is None]
    if lost:
        shown = ", ".join(map(str, lost[:8])) + (f" and {len(lost) - 8} more" if len(lost) > 8
                                                 else "")  # fmt: skip
        raise RestorePlanError(f"nothing written: partition {shown} of the target has no "
                               "reachable active node")  # fmt: skip


class RestoreTargetError(UprError):
    """The target kept refusing writes after the router's retries: the restore stops."""


# Answers the router retries with the newest map until `retry_for` is spent: one that
# still comes back means the cluster is not taking writes for that partition, and every
# later write to it would wait as long.
_GAVE_UP = frozenset({Status.NOT_MY_VBUCKET, Status.ETMPFAIL})


# (kind, key as sent, source partition; -1: not tracked)
_Tag = tuple[str, bytes, int]


class _Check:
    """A source partition's plain deletions, waiting for the GETs that say which keys
    the target has."""

    __slots__ = ("deletes", "gets", "present", "sealed")

    def __init__(self) -> None:
        self.deletes: list[tuple[int, bytes, Record]] = []
        self.gets = 0  # answers still to come
        self.present: set[bytes] = set()
        self.sealed = False  # the partition's last chunk was seen


class _NodeWriter:
    """A restore's writes to a node through the shared write window (jobs/writer.py),
    each answer counted into the summary (written; not written: the target has this
    version or a newer one; absent; errors). Each key goes to its hash over the target's
    partition count, in the target's collection (the plan's ids, in front of the key
    where Collections was negotiated). Partitions follow each other in the window
    without a pause: a partition's deletion check (a GET per plain deletion) is answered
    while the next partitions are written, and its deletions sent once it is."""

    def __init__(self, router: Router, summary: RestoreSummary, window: int | ByteWindow,
                 options: int, plan: RestorePlan) -> None:  # fmt: skip
        self.router, self.summary, self.options = router, summary, options
        if not isinstance(window, ByteWindow):
            window = ByteWindow(DEFAULT_LIMIT.share(0.25), window)
        self.w: WriteWindow[_Tag] = WriteWindow(router, window, self._answer)
        self.count = router.num_partitions
        self.open: Counter[int] = Counter()  # source partition → requests not answered
        self.sealed: set[int] = set()  # partitions whose every request was sent
        self.checks: dict[int, _Check] = {}
        self.ready: list[tuple[int, _Check]] = []  # checks answered: deletions to send
        # source collection id → the bytes in front of each key on the wire
        self.prefix = {s: leb128.encode(t) if router.collections else b""
                       for s, t in plan.target_ids().items()}  # fmt: skip

    @property
    def inflight(self) -> Any:
        """The requests in flight (oldest first)."""
        return self.w.inflight

    @property
    def sent(self) -> int:
        """Requests sent so far."""
        return self.w.sent

    async def partition(self, records: list[Record], include_tombstones: bool,
                        source: int | None = None, last: bool = True) -> None:  # fmt: skip
        """Write a chunk of one source partition: its documents, then its deletions:
        all of them with `include_tombstones`, else those that kept xattrs and (once the
        partition's GETs say so) those of keys the target has. `source` (the
        partition's number) is added to `summary.complete` once every answer of its
        `last` chunk and of those before is in."""
        p = -1 if source is None else source
        count, prefix, options, send = self.count, self.prefix, self.options, self.w.send
        await self._send_ready()
        deletes: list[tuple[int, bytes, Record]] = []
        plain: list[tuple[int, bytes, Record]] = []
        self.open[p] += len(records)
        for r in records:
            vb = partition_of(r.key, count)  # the document key, not its prefix
            key = prefix[r.collection] + r.key
            if r.op != OP_MUTATION:
                # A plain deletion is written only where the target has the key; a
                # tombstone that kept xattrs is data (a transaction's or Sync Gateway's
                # metadata of a deleted document) and is always written.
                (deletes if include_tombstones or r.xattrs else plain).append((vb, key, r))
                continue
            dt, value = (
                xattrs.join(r.xattrs, r.value, r.datatype) if r.xattrs else (r.datatype, r.value)
            )
            make = functools.partial(_set_with_meta, vb, key, value, dt, r.flags, r.expiry,
                                     r.rev_seq, r.cas, options)  # fmt: skip
            await send(vb, make, len(key) + len(value), ("set", key, p))
        for vb, key, r in deletes:
            make = functools.partial(_del_with_meta, vb, key, r.flags, r.rev_seq, r.cas,
                                     options, r.xattrs)  # fmt: skip
            await send(vb, make, len(key) + len(r.xattrs), ("delete", key, p))
        if plain:
            check = self.checks.get(p)
            if check is None:
                check = self.checks[p] = _Check()
            check.deletes += plain
            check.gets += len(plain)
            for vb, key, _r in plain:
                await send(vb, functools.partial(_get, vb, key), len(key), ("get", key, p))
        if last:
            check = self.checks.get(p)
            if check is None:
                self._seal(p)
            else:
                check.sealed = True
                self._checked(p, check)

    async def idle(self) -> None:
        """The writer has nothing new to write for now: send what is queued, and the
        deletions whose check is answered."""
        await self.w.settle_ready()
        await self._send_ready()
        self.w.flush()

    async def drain(self) -> None:
        """Wait for every answer in flight, deletion checks and their deletions too."""
        while True:
            await self._send_ready()
            await self.w.drain()
            if not self.ready:
                return

    def abandon(self) -> None:
        """Forget the requests still in flight (the restore stopped on an error)."""
        self.w.abandon()

    def _seal(self, p: int) -> None:
        """Every request of partition `p` was sent: complete once all are answered."""
        if self.open[p] <= 0:
            self.open.pop(p, None)
            if p >= 0:
                self.summary.complete.append(p)
        else:
            self.sealed.add(p)

    def _checked(self, p: int, check: _Check) -> None:
        if check.sealed and check.gets == 0:
            del self.checks[p]
            self.ready.append((p, check))

    async def _send_ready(self) -> None:
        """Send the deletions of the keys the target has, for each answered check."""
        while self.ready:
            p, check = self.ready.pop(0)
            found = [d for d in check.deletes if d[1] in check.present]
            self.summary.absent_deletes += len(check.deletes) - len(found)
            self.open[p] += len(found)
            for vb, key, r in found:
                make = functools.partial(_del_with_meta, vb, key, r.flags, r.rev_seq, r.cas,
                                         self.options, r.xattrs)  # fmt: skip
                await self.w.send(vb, make, len(key), ("delete", key, p))
            self._seal(p)

    def _answer(self, reply: Frame, vb: int, tag: _Tag) -> None:
        kind, key, p = tag
        status, summary = reply.vbucket_or_status, self.summary
        if kind == "get":
            check = self.checks[p]
            if status == Status.SUCCESS:
                check.present.add(key)
            check.gets -= 1
            self._checked(p, check)
        elif status == Status.SUCCESS:
            summary.written += 1
        elif status == Status.KEY_EEXISTS:
            summary.conflicts += 1
        elif status == Status.KEY_ENOENT and kind == "delete":
            summary.absent_deletes += 1
        elif status == Status.XATTR_EINVAL:
            # kv_engine's answer to a with-meta write whose xattrs are invalid (formats/wire.md
            # "Xattrs", point 5): the target refuses that key, the restore goes on
            summary.refused.append(self._key_text(key))
        elif status in _GAVE_UP:
            raise RestoreTargetError(
                f"partition {vb}: {Status(status).name} for {self.router.retry_for:g}s after "
                f"{summary.written:,} writes; run the restore again once the cluster is stable"
            )
        else:
            name = f"0x{status:02x}"
            summary.errors[name] = summary.errors.get(name, 0) + 1
        left = self.open[p] - 1
        self.open[p] = left
        if left <= 0 and p in self.sealed:
            self.sealed.discard(p)
            del self.open[p]
            if p >= 0:
                summary.complete.append(p)

    def _key_text(self, key: bytes) -> str:
        """A key as sent, its collection prefix left out, as text."""
        if self.router.collections:
            key = key[leb128.decode(key)[1] :]
        return key.decode("utf-8", errors="backslashreplace")


# SET_WITH_META and DEL_WITH_META (docs/protocol.md §6): the header and the 28 bytes of
# extras with options in one struct call, the same bytes as `SetWithMeta(...).encode()`
_WITH_META = struct.Struct(">BBHBBHIIQIIQQI")
_GET = struct.Struct(">BBHBBHIIQ")


_REQUEST, _SWM, _DWM, _GETOP = (
    Magic.REQUEST.value,
    Opcode.SET_WITH_META.value,
    Opcode.DEL_WITH_META.value,
    Opcode.GET.value,
)  # plain ints: packed faster than enums


def _set_with_meta(p: int, key: bytes, value: bytes, datatype: int, flags: int, exp: int,
                   rev: int, cas: int, options: int, opaque: int,
                   _pack: Callable[..., bytes] = _WITH_META.pack) -> bytes:  # fmt: skip
    klen = len(key)
    return _pack(_REQUEST, _SWM, klen, 28, datatype, p, 28 + klen + len(value), opaque, 0,
                 flags, exp, rev, cas, options) + key + value  # fmt: skip


def _del_with_meta(p: int, key: bytes, flags: int, rev: int, cas: int, options: int,
                   blob: bytes, opaque: int) -> bytes:  # fmt: skip
    """A deletion; a tombstone's xattrs, if it kept some, are its value (bit 0x04)."""
    klen = len(key)
    return _WITH_META.pack(_REQUEST, _DWM, klen, 28, xattrs.XATTR if blob else 0, p,
                           28 + klen + len(blob), opaque, 0, flags, 0, rev, cas,
                           options) + key + blob  # fmt: skip


def _get(p: int, key: bytes, opaque: int) -> bytes:
    return _GET.pack(_REQUEST, _GETOP, len(key), 0, 0, p, len(key), opaque, 0) + key


def restore_to_store(
    repo_dir: Path,
    db_path: Path,
    *,
    bucket: str | None = None,
    at: At = "latest",
    partitions: list[int] | None = None,
    keys: re.Pattern[bytes] | None = None,
    dry_run: bool = False,
    skip_corrupt: bool = False,
    map_data: Sequence[MapRule] = (),
    create: bool = True,
    on_progress: Callable[[RestoreSummary], None] | None = None,
    keep_xattrs: KeepXattrs = "all",
    check: bool = True,
    memory: MemoryLimit = DEFAULT_LIMIT,
    collections: CollectionFilter | None = None,
) -> RestoreSummary:
    """Write the state at `at` into a SQLite store (formats/store.md): documents and
    tombstones as they were (with the xattrs `keep_xattrs` keeps, JSON or not), in the
    source's partitions and collection ids, the names of the collections (`--map-data`
    applied), and each partition's position and failover log from the chain, so a
    replay can continue from the backup. (`create` is for a node: a store takes any
    collection.) The pre-check runs first, as for a node: damage found leaves the
    store untouched. A transaction takes at most `_RESTORE_BATCH_ROWS` rows and a
    quarter of `memory` in keys and values. A store restored with `keys` or
    `collections` (a subset) records no positions: a replay from it would miss the rest."""
    from upr_cli.repo import resume_point
    from upr_cli.store import Store

    del create
    with contextlib.ExitStack() as held:
        src = _Source.open(repo_dir, bucket, at, partitions, skip_corrupt, check, held,
                           chosen=collections)  # fmt: skip
        summary = src.summary(f"sqlite:{db_path}", dry_run)
        summary.keep_xattrs = keep_xattrs
        summary.plan = plan = src.plan(CollectionsManifest(), map_data, None, can_create=True)
        for c in plan.collections:  # a store has every collection it is given
            c.target_id, c.status = c.source_id, EXISTS
        plans = plan.by_source()
        t0 = time.monotonic()
        chain = src.manifests
        store = None if dry_run else Store(db_path, source=f"repo:{repo_dir}@{src.sel.backup_id}")
        # rows in ROW_FIELDS order, plain: the store's restore path binds them as they are
        pending: list[tuple[Any, ...]] = []
        pending_parts: list[int] = []
        batch_bytes, flushed_at = memory.share(0.25), 0

        def flush() -> None:
            # Several partitions' rows and their positions in one transaction: one
            # transaction per partition measured at 2/3 the rate on 1024 small partitions.
            # A partition's position goes with its last chunk's rows.
            nonlocal flushed_at
            flushed_at = summary.bytes
            if store is not None and (pending_parts or pending):
                with store.batch():
                    summary.written += store.restore_rows(pending)
                    for q in pending_parts:
                        rp = resume_point(chain, q)
                        if rp is not None and keys is None and collections is None:
                            store.set_position(rp.position, rp.failover_log)
            pending.clear()
            pending_parts.clear()
            if on_progress is not None:
                on_progress(summary)

        try:
            if store is not None:
                store.record_manifest(store_names(plan, src.names))
            for p, records, last in _partitions(src, keys, plans, summary, skip_corrupt, memory):
                pending += [(r.op, p, r.seq, r.rev_seq, r.cas, r.flags, r.expiry, r.delete_time,
                             r.datatype, r.key, r.value, 0, r.collection, r.xattrs)
                            for r in records]  # fmt: skip
                if last:
                    pending_parts.append(p)
                if len(pending) >= _RESTORE_BATCH_ROWS or summary.bytes - flushed_at >= batch_bytes:
                    flush()
            flush()
        finally:
            if store is not None:
                store.close()
        summary.seconds = time.monotonic() - t0
        return summary


def _take(p: int, records: list[Record] | SegmentError, last: bool,
          keys: re.Pattern[bytes] | None, plans: dict[int, Any], summary: RestoreSummary,
          skip_corrupt: bool) -> list[Record] | None:  # fmt: skip
    """A chunk's records to restore (selected by --keys and the plan), counted in the
    summary; a corrupt partition raises, or is skipped and noted (None)."""
    if isinstance(records, SegmentError):
        if not skip_corrupt:
            raise records
        summary.skipped.append(f"partition {p}: {records}")
        summary.left_out.append(p)
        return None
    if last:
        summary.partitions += 1
    todo = _restorable(records, keys, plans, summary)
    summary.count(todo, plans)
    return todo


def _partitions(
    src: _Source,
    keys: re.Pattern[bytes] | None,
    plans: dict[int, Any],
    summary: RestoreSummary,
    skip_corrupt: bool,
    memory: MemoryLimit = DEFAULT_LIMIT,
) -> Generator[tuple[int, list[Record], bool], None, None]:
    """Each partition's records to restore in chunks (`_take`), with whether the chunk
    is the partition's last."""
    reader = ChunksAhead(src, memory)
    try:
        while (got := reader.get()) is not None:
            p, records, last = got
            todo = _take(p, records, last, keys, plans, summary, skip_corrupt)
            if todo is not None:
                yield p, todo, last
    finally:
        reader.close()


def store_names(plan: RestorePlan, source: CollectionsManifest) -> CollectionsManifest:
    """The names a store records for the source's ids: each collection under its target
    name (`--map-data`), a target scope with the id of the source scope of that name,
    else of the first scope mapped into it."""
    scope_ids: dict[str, int] = {}
    colls: dict[str, list[Collection]] = {}
    for c in plan.collections:
        found = source.by_id(c.source_id)
        assert found is not None  # the plan was made from `source`
        if c.target.scope not in scope_ids:
            named = source.scope(c.target.scope)
            sid = named.id if named else found[0].id
            taken = set(scope_ids.values()) | {s.id for s in source.scopes if s is not named}
            if named is None and sid in taken:  # its own scope keeps that id
                sid = max(taken | {source.max_id}) + 1
            scope_ids[c.target.scope] = sid
        colls.setdefault(c.target.scope, []).append(
            Collection(c.target.collection or DEFAULT, c.source_id, c.max_ttl)
        )
    scopes = tuple(Scope(name, scope_ids[name], tuple(cs)) for name, cs in colls.items())
    return CollectionsManifest(source.uid, scopes)


def check_chosen(
    chosen: CollectionFilter, names: CollectionsManifest, last: Manifest | None
) -> None:
    """Refuse --include-data/--exclude-data naming a collection or scope the backup does
    not hold (its names at the chain's end, less what a filtered backup left out), or
    leaving none of them: one error naming it, before anything is read or written."""
    from upr_cli.collections import Path as CollectionPath

    held = last.collection_filter if last is not None else None
    have = [(s.name, c.name) for s, c in names.collections()
            if held is None or held.covers(s.name, c.name)]  # fmt: skip
    unknown = [t for t in chosen.paths
               if not any(CollectionPath.parse(t).covers(s, c) for s, c in have)]  # fmt: skip
    if unknown:
        raise UsageError(f"--{chosen.mode}-data: the backup holds no collection "
                         f"{', '.join(unknown)}")  # fmt: skip
    if not any(chosen.covers(s, c) for s, c in have):
        raise UsageError(f"--{chosen.mode}-data {','.join(chosen.paths)} leaves no "
                         "collection to restore")  # fmt: skip
