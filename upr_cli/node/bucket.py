"""A bucket of the node: partitions, the KV write path, the flusher and start-up recovery.

Write path (the UPR design specification, "How KV mutations flow into ep-engine and write
queue"; docs/design.md "Data flows" (1. Write)): CAS check → next per-partition seqno →
write queue → acknowledged; the flusher commits every queued item in one transaction per
round (group commit) and only then advances `persisted_seq`, so OBSERVE_SEQNO tells
clients when a write is durable.

Failover entries (the UPR design specification, "Failover Log"; docs/protocol.md §4.3):
one {uuid, 0} at creation; after an unclean shutdown, one per active partition at its
last persisted complete snapshot (`snap_end` if the high seq equals it, else
`snap_start`), written to disk before the node serves. A clean shutdown flushes
everything and keeps the uuids.

Storage work is never cut short: a commit runs in the writer thread whatever happens to
the coroutine that asked for it, so every flush, state write and rollback runs as its
own task under the flush lock (`_unbroken`), and its caller only stops waiting when
cancelled (a replication link restarted by a map change, a client gone). Before, a flush
cancelled mid-commit left its committed items queued, and every later flush failed on
them ("seq 1 is not above stored seq 1").

Collections (formats/collections.md): every key here is qualified (its collection id
first). The KV methods check the collection against the bucket's manifest and apply
its max TTL; `set_manifest` weaves one system event row per change into every active
partition, each with its own seq, and the flush that persists those rows persists the
manifest in the same transaction. A dropped collection's documents are unreachable at
once and deleted later by a background purge, without tombstones.

Expiry (formats/wire.md "Collections on DCP", point 9): a live document whose expiry has
passed is expired, on an active partition only, by the first read that finds it (GET,
GAT, TOUCH, GET_META, subdoc lookup; DELETE too) and by the expiry pager, which looks
for such documents every `expiry_pager_interval` seconds: the expiration is a tombstone
with a new seq, CAS and rev seq whose expiry is its delete time (an explicit deletion's
is 0), so DCP sends it as an EXPIRATION to a client that asked for them. A write over
an expired document (SET, ADD, REPLACE) treats it as absent and replaces it, as
kv_engine's write path does, without an expiration of its own.

Snappy (formats/wire.md "Snappy"): a value that arrives compressed (datatype 0x02) is
checked to inflate and stored as it came, compressed, as Couchbase keeps it; the JSON
bit is checked on the inflated body. The producer sends stored bytes as they are to a
DCP connection that negotiated Snappy and inflates them for the others. The KV reads
(`get`, `get_meta`, `touch`) hand out the inflated document, which every client can
take whatever it negotiated.

Xattrs (formats/wire.md "Xattrs"): a version with extended attributes stores them in
kv_engine's layout, the blob in front of the body with bit 0x04 (the whole compressed as
one when it came so). A full-document write over a live document keeps its blob; a
deletion or an expiration keeps the system xattrs in the tombstone; KV reads hand out
the body alone. The sub-document commands read and write versions through `version`
and `write_version` (upr_cli/node/subdoc_kv.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from time import time_ns
from typing import Any, TypeVar, cast

from upr_cli.collections import CollectionsError, Manifest, changes_between
from upr_cli.errors import UsageError
from upr_cli.failover import FailoverLog, new_uuid
from upr_cli.net.aio import cancel_and_wait
from upr_cli.node import sysevents
from upr_cli.node.collection_state import (
    DROPPED_KEY,
    MANIFEST_KEY,
    NodeCollections,
    expiry_of,
)
from upr_cli.node.partition import (
    ACTIVE,
    ITEM_OVERHEAD,
    PENDING,
    REPLICA,
    Marker,
    Partition,
    QueueBytes,
)
from upr_cli.node.storage import (
    WRITER_CACHE_KIB,
    DocRow,
    NodeStorage,
    PartitionRecord,
    StorageError,
)
from upr_cli.protocol import leb128, snappy, xattrs
from upr_cli.protocol.status import (
    InvalidArguments,
    KeyExists,
    KeyNotFound,
    NotMyVbucket,
    OutOfRange,
    Status,
    StatusError,
    TemporaryFailure,
)

# not in the prefetched map (a prefetched None means the key is known to be absent)
_ABSENT: Any = object()


class StaleCas(StatusError):
    """KEY_EEXISTS for a state command whose bucket CAS is stale (formats/cluster.md)."""

    status = int(Status.KEY_EEXISTS)
    retriable = True


log = logging.getLogger(__name__)

FLUSH_CHUNK = 50_000  # docs per transaction at most
PURGE_CHUNK = 10_000  # rows of a dropped collection deleted per transaction
EXPIRY_CHUNK = 10_000  # expired documents the pager looks at per storage query
EXPIRY_PAGER_INTERVAL = 10.0  # seconds (kv_engine's pager waits longer: a test node should not)
DEFAULT_PARTITIONS = 1024  # a new bucket's partition count, as Couchbase's on Linux
UNDO_WINDOW = 200_000  # seqs of undo a replica partition keeps (formats/cluster.md §5)
FED = (REPLICA, PENDING)  # states fed by a replication stream
_T = TypeVar("_T")


def _new_cas() -> int:
    """A fresh, non-zero bucket CAS."""
    return random.getrandbits(63) or 1


class XattrInvalid(StatusError):
    """XATTR_EINVAL (0x87): a value marked with xattrs has a malformed blob, or an xattr
    value that is not JSON (kv_engine's validator answers it for a with-meta write;
    formats/wire.md "Xattrs")."""

    status = int(Status.XATTR_EINVAL)


def checked_datatype(datatype: int, value: bytes, key: bytes = b"") -> int:
    """Clear the JSON bit of a value that is not JSON, as a server must (see
    docs/protocol.md §1.4), looking at the body behind any xattrs; a compressed value
    must inflate (EINVAL naming the key), a blob must be well formed and each of its
    values JSON (XATTR_EINVAL)."""
    body = value
    if datatype & snappy.SNAPPY and value:
        try:
            body = snappy.inflate(value, key)
        except snappy.CorruptValueError as exc:
            raise InvalidArguments(str(exc)) from None
    if datatype & xattrs.XATTR:
        try:
            blob, body = xattrs.split(body, key)
        except xattrs.CorruptXattrsError as exc:
            raise XattrInvalid(str(exc)) from None
        bad = xattrs.not_json(blob, key)
        if bad:
            raise XattrInvalid(f"key {bytes(key)!r}: xattr {bad[0]!r} is not JSON")
    if datatype & 0x01 and not is_json(body):
        return datatype & 0x06
    return datatype & 0x07


# the C scanner json.loads ends in: (value, end) of the JSON value at an index
_scan_json: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def is_json(body: bytes) -> bool:
    """Whether `json.loads` takes `body`. An object or array in UTF-8 (what documents
    are) goes straight to the scanner json.loads ends in, without its per-call steps
    (profiled: a third of the write path's cost for small documents); anything else
    takes json.loads itself."""
    if len(body) > 1 and body[0] in b"{[" and body[1]:  # UTF-8 as json.loads detects it
        try:
            text = str(body, "utf-8")
        except UnicodeDecodeError:
            pass  # json.loads decodes with surrogatepass: let it decide
        else:
            try:
                end = _scan_json(text, 0)[1]
            except (ValueError, StopIteration, RecursionError):
                return False
            return end == len(text) or not text[end:].strip(" \t\n\r")
    try:
        json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return True


def unpacked(doc: DocRow) -> tuple[int, bytes, bytes]:
    """(datatype without the Snappy and XATTR bits, xattr blob, body) of a stored
    version: inflated, the blob split off (b"" when it has none)."""
    datatype, blob, body = xattrs.unpack(doc.datatype, doc.value, doc.key)
    return datatype, blob, bytes(body)


def plain_doc(doc: DocRow, *, keep_xattrs: bool = False) -> DocRow:
    """The document as a KV read hands it out: inflated, and its body alone with the
    XATTR bit clear (formats/wire.md "Xattrs"), unless `keep_xattrs`."""
    if not doc.datatype & (snappy.SNAPPY | xattrs.XATTR) or not doc.value:
        return doc
    if keep_xattrs or not doc.datatype & xattrs.XATTR:
        datatype, value = snappy.plain(doc.datatype, doc.value, doc.key)
        return replace(doc, datatype=datatype, value=value)
    datatype, _, body = unpacked(doc)
    return replace(doc, datatype=datatype, value=body)


def tombstone_xattrs(doc: DocRow) -> tuple[int, bytes]:
    """(datatype, value) of the tombstone that deletes `doc`: its system xattrs alone
    (formats/wire.md "Xattrs", point 3), or nothing."""
    if not doc.datatype & xattrs.XATTR or doc.deleted:
        return 0, b""
    kept = xattrs.system_only(unpacked(doc)[1])
    return (xattrs.XATTR, kept) if kept else (0, b"")


def with_old_xattrs(old: DocRow, datatype: int, value: bytes) -> tuple[int, bytes]:
    """A full-document write over `old`: the new body behind `old`'s xattr blob, all of
    it, as kv_engine's mutation path keeps it (compressed again if it came so)."""
    blob = unpacked(old)[1]
    if not blob:
        return datatype, value
    if datatype & snappy.SNAPPY and value:
        datatype, value = datatype & ~snappy.SNAPPY, snappy.inflate(value, old.key)
        return snappy.compressed(*xattrs.join(blob, value, datatype))
    return xattrs.join(blob, value, datatype)


class Bucket:
    """One bucket: its partitions, write path and flusher."""

    def __init__(
        self,
        data_dir: Path,
        name: str,
        num_partitions: int | None,
        *,
        flush_interval: float = 0.05,
        purge_age: float | None = None,
        sync_full: bool = False,
        expiry_pager_interval: float | None = EXPIRY_PAGER_INTERVAL,
        queue_limit: int | None = None,
        cache_kib: int = WRITER_CACHE_KIB,
    ) -> None:
        self.data_dir = data_dir
        self.storage = NodeStorage(data_dir, name, sync_full=sync_full, cache_kib=cache_kib)
        self.name = name
        self.num_partitions = self._partition_count(num_partitions)
        self.flush_interval = flush_interval
        self.purge_age = purge_age
        self.expiry_pager_interval = expiry_pager_interval  # None: only reads expire
        self.partitions: dict[int, Partition] = {}
        # the write queues' bytes, together, and their bound (None: unbounded): a data
        # write that would pass it is answered ETMPFAIL until a flush makes room
        self.queued = QueueBytes()
        self.queue_limit = queue_limit
        self._room: list[asyncio.Future[None]] = []  # replication waiting for room
        self._lookup = NodeStorage(data_dir, name, cache_kib=cache_kib)  # loop-thread point reads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flush-{name}")
        self._flush_lock = asyncio.Lock()
        self._work: set[asyncio.Task[Any]] = set()  # storage work under way (`_unbroken`)
        self._flusher: asyncio.Task[None] | None = None
        self._last_cas = 0
        self.started_unclean = False
        # Disk versions prefetched for a batch of writes; valid while no flush intervened.
        self._disk_gen = 0
        self._prefetched: dict[tuple[int, bytes], DocRow | None] = {}
        self._prefetched_gen = -1
        # Partition-state control (the UPR design specification, "How ns_server and
        # ep-engine guarantee ordering of partition state transitions"; formats/cluster.md §1):
        # one CAS for the bucket, new at every start and after every accepted state command;
        # the cluster map an orchestrator set, with its revision.
        self.state_cas = _new_cas()
        self._map_path = data_dir / f"{name}.cluster-map.json"
        self.cluster_map: dict[str, object] | None = None
        # a cluster node starts in its persisted states with front-end traffic off, until
        # its orchestrator turns it on (the same section of the UPR design specification,
        # step 1; formats/cluster.md §3)
        self.traffic = True
        self.undo_window = UNDO_WINDOW
        self.listeners: list[Callable[[], None]] = []  # told of map and state changes
        self.collections = NodeCollections()
        self._manifest_gen = 0  # bumped by every new manifest; the flush persists it
        self._manifest_saved = 0  # the generation on disk
        self._purger: asyncio.Task[None] | None = None
        self._pager: asyncio.Task[None] | None = None

    def _partition_count(self, wanted: int | None) -> int:
        """The bucket's partition count: the one on disk, which never changes (a key's
        partition is its hash modulo the count), else `wanted`, else the default."""
        stored = self.storage.partition_count()
        if wanted is None or stored in (0, wanted):
            return stored or wanted or DEFAULT_PARTITIONS
        self.storage.close()
        raise UsageError(
            f"--num-partitions {wanted}: the bucket in {self.storage.path} has {stored} "
            f"partitions, which cannot change (give --num-partitions {stored}, or leave it out)"
        )

    # -- life cycle -------------------------------------------------------------

    async def start(self) -> None:
        """Load or create partitions, add failover entries after an unclean stop, start flushing."""
        try:
            self.collections = NodeCollections.from_meta(
                self.storage.meta(MANIFEST_KEY), self.storage.meta(DROPPED_KEY)
            )
        except (CollectionsError, ValueError) as exc:
            raise StorageError(f"{self.storage.path}: stored collections manifest: {exc}") from None
        records = self.storage.load_partitions()
        clean = self.storage.clean_shutdown()
        fresh = not records
        changed: list[PartitionRecord] = []
        for vb in range(self.num_partitions):
            rec = records.get(vb)
            if rec is None:
                part = Partition(vb, ACTIVE, FailoverLog.initial())
                changed.append(part.record())
            else:
                part = Partition.from_record(rec)
                if not clean and part.state == ACTIVE:
                    # docs/protocol.md §4.3: at warm-up after an unclean shutdown, an
                    # entry at the last persisted complete snapshot.
                    seq = part.snap_end if part.persisted_seq == part.snap_end else part.snap_start
                    part.failover = part.failover.add_entry(new_uuid(), seq)
                    changed.append(part.record())
            part.queue.held = self.queued
            self.partitions[vb] = part
        for vb in sorted(set(records) - set(self.partitions)):
            log.warning(
                "bucket %s: partition %d on disk beyond --partitions, ignored", self.name, vb
            )
        floors = self.storage.undo_floors()
        bounds = self.storage.boundaries()
        for vb, part in self.partitions.items():
            if part.state in FED:
                if vb not in floors:
                    whole = part.persisted_seq == part.snap_end
                    self.storage.start_undo(vb, part.persisted_seq, boundary=whole)
                    bounds[vb] = [part.persisted_seq] if whole else []
                part.undo_floor = floors.get(vb, part.persisted_seq)
                part.bounds = bounds.get(vb, [])
        self.started_unclean = not clean and not fresh
        if self._map_path.exists():
            self.cluster_map = json.loads(self._map_path.read_text(encoding="utf-8"))
            self.traffic = False  # a member of a cluster: ENABLE_TRAFFIC turns it on
        if changed:
            self.storage.save_partitions(changed)
        self.storage.set_clean_shutdown(False)
        loop = asyncio.get_running_loop()
        self._flusher = loop.create_task(self._flush_loop(), name="flusher")
        if self.expiry_pager_interval:
            self._pager = loop.create_task(self._expiry_pager(), name="expiry-pager")
        self._schedule_purge()

    async def stop(self, *, clean: bool = True) -> None:
        """Stop flushing; on a clean stop flush everything and mark the shutdown clean."""
        if self._flusher is not None:
            await cancel_and_wait([self._flusher])
            self._flusher = None
        if self._purger is not None:
            await cancel_and_wait([self._purger])
            self._purger = None
        if self._pager is not None:
            await cancel_and_wait([self._pager])
            self._pager = None
        while self._work:  # storage work whose callers were cancelled ends first
            await asyncio.wait(set(self._work))  # not gather: it would cancel them
        if clean:
            await self.flush()
            self.storage.set_clean_shutdown(True)
        self._pool.shutdown(wait=True)
        self._lookup.close()
        self.storage.close()

    # -- partition-state control (formats/cluster.md) ---------------------------------

    @property
    def map_rev(self) -> int:
        """The revision of the cluster map held (0: none set)."""
        rev = (self.cluster_map or {}).get("rev", 0)
        return rev if isinstance(rev, int) else 0

    def check_control(self, cas: int, rev: int) -> None:
        """A state command must carry the bucket CAS and a map revision not older than the
        node's: a stale CAS is KEY_EEXISTS (the response carries the right CAS; retry), an
        older revision is refused (a newer orchestrator has taken over: fencing)."""
        if cas != self.state_cas:
            raise StaleCas(f"bucket CAS {cas} is stale; the current one is in this response")
        if rev < self.map_rev:
            raise InvalidArguments(f"map revision {rev} is older than this node's {self.map_rev}")

    def set_cluster_map(self, cas: int, config: dict[str, object]) -> int:
        """Store a newer cluster map (persisted atomically); returns the new bucket CAS."""
        rev = config.get("rev")
        if not isinstance(rev, int) or isinstance(rev, bool) or rev < 1:
            raise InvalidArguments("a cluster map needs an integer rev ≥ 1")
        self.check_control(cas, rev)
        if rev == self.map_rev:
            raise InvalidArguments(f"map revision {rev} is not newer than this node's")
        tmp = self._map_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config), encoding="utf-8")
        tmp.replace(self._map_path)
        self.cluster_map = config
        self.state_cas = _new_cas()
        self._changed()
        return self.state_cas

    def _changed(self) -> None:
        for fn in self.listeners:
            fn()

    async def set_partition_state(self, vb: int, state: str, *, cas: int, rev: int,
                                  failover: bool = False) -> int:  # fmt: skip
        """Change a partition's state (persisted before the answer); returns the new CAS.

        `failover` on a promotion to active adds a failover entry at the partition's last
        persisted complete snapshot (the UPR design specification, "How ns_server
        performs failover").
        """
        if not 0 <= vb < self.num_partitions:
            raise NotMyVbucket(f"partition {vb} does not exist")
        self.check_control(cas, rev)
        # one piece of work: a cancelled caller (a dropped connection) cannot leave the
        # new state persisted with the CAS not rotated or its streams not told
        return await self._unbroken(self._set_state(vb, state, failover))

    async def _set_state(self, vb: int, state: str, failover: bool) -> int:
        part = self.partitions[vb]
        await self.flush()
        if failover and state == ACTIVE:
            part.failover = part.failover.add_entry(new_uuid(), part.complete_seq)
        if state in FED and part.state not in FED:
            # from here on every replaced version is kept: a rollback can undo it, back to
            # a snapshot boundary (the state it starts from is one when it is whole: an
            # active's persisted data always is)
            whole = part.complete_seq == part.persisted_seq
            start_undo = functools.partial(self.storage.start_undo, boundary=whole)
            await self._in_pool(start_undo, vb, part.persisted_seq)
            part.undo_floor = part.persisted_seq
            part.bounds = [part.persisted_seq] if whole else []
        elif state not in FED:
            part.undo_floor = None
            part.bounds, part.broken = [], set()
        if state != part.state and state == ACTIVE:
            part.markers.clear()
            # an active partition's persisted data is one complete snapshot
            part.snap_start = part.snap_end = part.persisted_seq
        part.state = state
        await self.persist_state([part])
        self.state_cas = _new_cas()
        part.notify()  # streams of this partition check their state
        self._changed()
        return self.state_cas

    def _in_pool(self, fn: Callable[..., _T], *args: object) -> Awaitable[_T]:
        """Run a storage call on the writer thread, between flushes (never cut short)."""
        return self._unbroken(self._locked(fn, *args))

    async def _locked(self, fn: Callable[..., _T], *args: object) -> _T:
        """A storage call on the writer thread under the flush lock; the disk generation
        moves once it is done, so a prefetch taken meanwhile is not trusted after it."""
        async with self._flush_lock:
            try:
                return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
            finally:
                self._disk_gen += 1

    def _unbroken(self, work: Coroutine[Any, Any, _T]) -> Awaitable[_T]:
        """Run storage work as its own task: a cancelled caller stops waiting, while the
        work (a commit in the writer thread and the in-memory bookkeeping after it)
        finishes under the flush lock. `stop` waits for what is left."""
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
            log.error("bucket %s: storage work failed after its caller left: %s", self.name,
                      exc, exc_info=exc)  # fmt: skip

    # -- collections (formats/collections.md) -----------------------------------------

    @property
    def manifest(self) -> Manifest:
        """The bucket's current collections manifest."""
        return self.collections.manifest

    async def set_manifest(self, manifest: Manifest) -> None:
        """COLLECTIONS_SET_MANIFEST: take a manifest whose uid is not below the current
        one (an equal uid must come with the same manifest: a no-op). Each change gets
        a system event row in every active partition, with its own seq; the answer
        waits until the rows and the manifest are on disk, in one transaction.

        As kv_engine does, only the last event of the change carries the new uid; the
        ones before it carry the uid the partition had, since until the last one is
        applied the partition has not taken the new manifest whole."""
        old = self.collections.manifest
        if manifest.uid < old.uid:
            raise OutOfRange(f"manifest uid {manifest.uid:x} is below the current {old.uid:x}")
        if manifest.uid == old.uid and manifest != old:
            raise InvalidArguments(f"manifest uid {manifest.uid:x} is current, with other content")
        try:
            self.collections.check(manifest)
        except CollectionsError as exc:
            raise InvalidArguments(str(exc)) from None
        changes = changes_between(old, manifest)
        changes[:-1] = [replace(c, manifest_uid=old.uid) for c in changes[:-1]]
        if changes or manifest != old:
            now = int(time.time())
            for vb, part in sorted(self.partitions.items()):
                if part.state != ACTIVE:
                    continue  # replicas get the rows through replication
                for change in changes:
                    key, flags, expiry, value, deleted = sysevents.system_row(change)
                    prev = self.lookup(vb, key)
                    part.append(DocRow(
                        vb, key, part.high_seq + 1, prev.rev_seq + 1 if prev else 1,
                        self.next_cas(), flags, expiry, 0, deleted, now if deleted else 0, value,
                    ))  # fmt: skip
            self.collections.replace(manifest)
            self._manifest_gen += 1
        await self.flush()
        if self._manifest_saved < self._manifest_gen:  # another flush took the rows first
            await self.flush()
        self._schedule_purge()

    def _schedule_purge(self) -> None:
        """Start the background purge of dropped collections, unless it is running."""
        if self.collections.dropped and (self._purger is None or self._purger.done()):
            loop = asyncio.get_running_loop()
            self._purger = loop.create_task(self._purge_dropped(), name="purge-collections")

    async def _purge_dropped(self) -> None:
        """Delete the documents of dropped collections, partition by partition, in
        small transactions between flushes (kv_engine purges them lazily too, and sends
        no deletions for them: formats/collections.md §3)."""
        try:
            while todo := sorted(self.collections.dropped):  # a drop may come meanwhile
                await self.flush()  # the rows queued before the drop are on disk first
                for cid in todo:
                    for vb in sorted(self.partitions):
                        gone = PURGE_CHUNK
                        while gone == PURGE_CHUNK:  # a short chunk: the partition is clean
                            gone = await self._in_pool(self.storage.purge_collection, vb, cid,
                                                       PURGE_CHUNK)  # fmt: skip
                    self.collections.dropped.discard(cid)
                    log.info("bucket %s: dropped collection 0x%x purged", self.name, cid)
                self._manifest_gen += 1  # the shorter list of ids to purge goes to disk
                await self.flush()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("bucket %s: purging dropped collections failed", self.name)

    # -- the replica side ------------------------------------------------------------
    # (the UPR design specification, "How KV mutations flow into Replicas")

    def fed_partition(self, vb: int) -> Partition:
        """A partition a replication stream may write (replica or pending)."""
        part = self.partitions.get(vb)
        if part is None or part.state not in FED:
            raise NotMyVbucket(f"partition {vb} is not a replica here")
        return part

    def apply_replica(self, doc: DocRow) -> bool:
        """Take a version streamed from the active, keeping its seq, cas and rev seq.
        Versions at or below the partition's high seq (a resent stream) are skipped."""
        part = self.fed_partition(doc.vbucket)
        if doc.seq <= part.high_seq:
            return False
        self._last_cas = max(self._last_cas, doc.cas)
        old = part.queue.get(doc.key)
        if old is not None:
            part.replaced(old.seq, doc.seq)  # the queue keeps one version per key
        part.append(doc)
        if doc.deleted and doc.key[1:2] == b"c" and sysevents.is_system_key(doc.key):
            # a collection dropped on the active: its rows here are purged too (the
            # node's own manifest may have dropped it before this copy had them)
            self.collections.dropped.add(leb128.decode(doc.key, 2)[0])
            self._manifest_gen += 1
            self._schedule_purge()
        return True

    def replica_marker(self, vb: int, start: int, end: int) -> None:
        """A snapshot marker for a replica partition: its items up to `end` are one cut.
        A snapshot not received whole before a new one begins (its stream was cut short:
        a pause, a link restarted) never completes: the new stream deduplicates on its
        own, so the old snapshot's end is no boundary (nor a complete snapshot)."""
        part = self.fed_partition(vb)
        markers = part.markers
        while markers and markers[-1].end > part.high_seq:  # only the newest can be cut short
            markers.pop()
        markers.append(Marker(start, end))

    async def adopt_failover_log(self, vb: int, pairs: tuple[tuple[int, int], ...]) -> None:
        """A replica takes the active's whole failover log (docs/protocol.md §4.3), durably."""
        part = self.fed_partition(vb)
        log_ = FailoverLog.sanitised(pairs)
        if log_.entries and log_ != part.failover:
            part.failover = log_
            await self.persist_state([part])

    async def rollback_replica(self, vb: int, to_seq: int, *, asked: int | None = None
                               ) -> int | None:  # fmt: skip
        """Take a replica partition back to the newest snapshot boundary at or below
        `to_seq` that its undo reaches (formats/cluster.md §5: inside a deduplicated
        snapshot a seq is not a state the source had); returns that boundary, `to_seq`
        itself when the stream chose one the undo reaches, else a lower one (the stream
        must restart from it). None when no boundary serves: the partition was emptied
        and must stream from 0. `asked` is the server's rollback seq (default `to_seq`):
        the discarded versions above it go to `lost_writes`; those at or below it are the
        source's too and come back on the stream."""
        part = self.fed_partition(vb)
        await self.flush()
        asked = to_seq if asked is None else asked
        reachable = [b for b in part.boundaries() if b <= to_seq]
        target = reachable[-1] if reachable else None
        if target is not None and target == part.persisted_seq == part.high_seq:
            part.markers.clear()  # nothing to undo: the stream restarts from here
            part.broken.clear()
            return target
        seq = 0 if target is None else target
        part.high_seq = part.persisted_seq = part.snap_start = part.snap_end = seq
        part.markers.clear()
        part.broken.clear()
        part.failover = part.failover.prune_above(seq)
        if not part.failover.entries:
            part.failover = FailoverLog.initial()
        rec = part.record()
        if target is not None:
            part.bounds = sorted({b for b in part.bounds if b < seq} | {seq})
            undo = functools.partial(self.storage.rollback_replica, lost_above=asked)
            lost = await self._in_pool(undo, vb, seq, rec)
        else:
            part.undo_floor, part.bounds = 0, []
            reset = functools.partial(self.storage.reset_partition, lost_above=asked)
            lost = await self._in_pool(reset, rec)
        log.warning("bucket %s: replica partition %d rolled back to %d (asked %d; %s, %d "
                    "versions undone, those above %d kept in lost_writes)", self.name, vb, seq,
                    asked, "undo" if target is not None else "reset: no snapshot boundary "
                    "the undo reaches", lost, asked)  # fmt: skip
        return target

    # -- reads ---------------------------------------------------------------------

    def partition(self, vb: int, *, active: bool = True) -> Partition:
        """The partition, or NOT_MY_VBUCKET if absent or (with `active`) not active."""
        part = self.partitions.get(vb)
        if part is None or (active and part.state != ACTIVE):
            raise NotMyVbucket(f"partition {vb} is not active here")
        return part

    def lookup(self, vb: int, key: bytes) -> DocRow | None:
        """The latest version of a key, tombstones included (queue first, then disk)."""
        doc = self.partitions[vb].queue.get(key)
        if doc is None:
            # a prefetched None means known to be absent: one dict probe on the KV path
            if self._prefetched_gen == self._disk_gen:
                hit = self._prefetched.get((vb, key), _ABSENT)
                if hit is not _ABSENT:
                    return cast("DocRow | None", hit)
            doc = self._lookup.get(vb, key)
        return doc

    def prefetch(self, keys: list[tuple[int, bytes]]) -> None:
        """Read the disk versions of a batch of keys in one query (the write path's lookups)."""
        parts = self.partitions
        # each pair once: a read of many writes to one key must not fetch its value as
        # many times (120 of a 1 MB document held 114 MB at once)
        want = [(vb, k) for vb, k in dict.fromkeys(keys)
                if vb in parts and parts[vb].queue.get(k) is None]  # fmt: skip
        if not want:
            return
        found = self._lookup.get_many(want)
        self._prefetched = {pair: found.get(pair) for pair in want}
        self._prefetched_gen = self._disk_gen

    def current(self, vb: int, key: bytes) -> DocRow | None:
        """The latest version of a key of an active partition, after expiring it if it
        is a live document whose expiry has passed (the read that finds it expires it)."""
        doc = self.lookup(vb, key)
        if doc is not None and _expired(doc, time.time()):
            doc = self._expire(self.partitions[vb], doc)
        return doc

    def get(self, vb: int, key: bytes) -> DocRow:
        """A live, unexpired document (a qualified key), inflated, or KEY_ENOENT."""
        return plain_doc(self._live(vb, key))

    def _live(self, vb: int, key: bytes) -> DocRow:
        """A live, unexpired document as stored, or KEY_ENOENT."""
        self.partition(vb)
        self.collections.collection(key)
        doc = self.current(vb, key)
        if doc is None or doc.deleted:
            raise KeyNotFound(f"no such key in partition {vb}")
        return doc

    def get_meta(self, vb: int, key: bytes) -> DocRow:
        """GET_META: the key's latest version, a tombstone included (an expired document
        is expired first, and answers as one), or KEY_ENOENT if it never existed or was
        purged."""
        self.partition(vb)
        self.collections.collection(key)
        doc = self.current(vb, key)
        if doc is None:
            raise KeyNotFound(f"no such key in partition {vb}")
        return plain_doc(doc, keep_xattrs=True)

    # -- expiry ----------------------------------------------------------------------

    def _expire(self, part: Partition, old: DocRow) -> DocRow:
        """The expiration of a live document: a tombstone with a new seq, CAS and rev
        seq whose expiry is its delete time, as kv_engine's tombstones have (a deletion's
        is 0 here: DCP tells the two apart by it, and a replica can store the same from
        the DCP_EXPIRATION, which carries the delete time)."""
        now = int(time.time())
        datatype, value = tombstone_xattrs(old)
        doc = DocRow(
            vbucket=old.vbucket, key=old.key, seq=part.high_seq + 1, rev_seq=old.rev_seq + 1,
            cas=self.next_cas(), flags=old.flags, expiry=now, datatype=datatype, deleted=True,
            delete_time=now, value=value,
        )  # fmt: skip
        part.append(doc)
        return doc

    async def _expiry_pager(self) -> None:
        assert self.expiry_pager_interval
        while True:
            await asyncio.sleep(self.expiry_pager_interval)
            try:
                await self.expire_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("bucket %s: the expiry pager failed; will retry", self.name)

    async def expire_due(self) -> int:
        """The expiry pager's round: expire every live document of an active partition
        whose expiry has passed, in the write queue or on disk; returns how many."""
        now = time.time()
        count = 0
        for part in self.partitions.values():  # unflushed versions first
            if part.state == ACTIVE:
                for queued in part.queue.snapshot():
                    if _expired(queued, now) and part.get(queued.key) is queued:
                        self._expire(part, queued)
                        count += 1
        while True:
            active = [vb for vb, p in self.partitions.items() if p.state == ACTIVE]
            if not active:
                return count
            found = await self._in_pool(self.storage.expired, active, int(now), EXPIRY_CHUNK)
            done = 0
            for row in found:
                part = self.partitions[row.vbucket]
                latest = self.lookup(row.vbucket, row.key)  # a newer version may have come
                if part.state == ACTIVE and latest is not None and _expired(latest, now):
                    self._expire(part, latest)
                    done += 1
            count += done
            if len(found) < EXPIRY_CHUNK or not done:
                return count
            await self.flush()  # the next query must not find these again

    # -- writes --------------------------------------------------------------------

    def check_room(self, nbytes: int) -> None:
        """ETMPFAIL when `nbytes` more would take the write queue past its bound, as
        kv_engine answers a write it has no memory for (docs/protocol.md §11): the
        client retries once the flusher has made room. An empty queue takes a version
        of any size, alone."""
        held = self.queued.bytes
        limit = self.queue_limit
        if held and limit is not None and held + nbytes + ITEM_OVERHEAD > limit:
            raise TemporaryFailure(
                f"the write queue is full ({held >> 20} MiB of {limit >> 20} MiB not yet "
                "on disk); retry"
            )

    async def wait_room(self) -> None:
        """Wait while the write queue is at its bound (replication: its stream waits,
        held back by flow control, instead of being refused)."""
        limit = self.queue_limit
        while limit is not None and self.queued.bytes >= limit:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._room.append(fut)
            await fut

    def _made_room(self) -> None:
        waiters, self._room = self._room, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def next_cas(self) -> int:
        """A fresh CAS: nanosecond clock, strictly increasing."""
        now, last = time_ns(), self._last_cas + 1
        self._last_cas = now if now > last else last
        return self._last_cas

    def store(
        self,
        op: str,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
        cas: int = 0,
    ) -> DocRow:
        """SET / ADD / REPLACE with the memcached CAS rules; returns the new version.
        A relative expiry is made absolute, and capped by the collection's max TTL."""
        part = self.partition(vb)
        if self.queue_limit is not None:
            self.check_room(len(key) + len(value))
        now = time.time()
        expiry = expiry_of(self.collections.collection(key), expiry, int(now))
        old = self.lookup(vb, key)
        live = old is not None and not old.deleted and not _expired(old, now)
        if op == "add" and live:
            raise KeyExists("key exists")
        if op == "replace" and not live:
            raise KeyNotFound("no such key")
        if cas:
            if not live:
                raise KeyNotFound("no such key (CAS given)")
            assert old is not None
            if old.cas != cas:
                raise KeyExists("CAS mismatch")
        datatype = checked_datatype(datatype, value, key)
        if live and old is not None and old.datatype & xattrs.XATTR and not datatype & xattrs.XATTR:
            datatype, value = with_old_xattrs(old, datatype, value)
        # positional: the hot path (vbucket, key, seq, rev_seq, cas, flags, expiry,
        # datatype, deleted, delete_time, value)
        doc = DocRow(vb, key, part.high_seq + 1, (old.rev_seq + 1) if old else 1,
                     self.next_cas(), flags, expiry, datatype, False, 0, value)  # fmt: skip
        part.append(doc)
        return doc

    def delete(self, vb: int, key: bytes, *, cas: int = 0) -> DocRow:
        """DELETE: a tombstone with a new seq; KEY_ENOENT if absent, KEY_EEXISTS on CAS mismatch."""
        part = self.partition(vb)
        self.check_room(len(key))
        self.collections.collection(key)
        old = self.current(vb, key)
        if old is None or old.deleted:
            raise KeyNotFound("no such key")
        if cas and old.cas != cas:
            raise KeyExists("CAS mismatch")
        datatype, value = tombstone_xattrs(old)
        doc = DocRow(
            vbucket=vb, key=key, seq=part.high_seq + 1, rev_seq=old.rev_seq + 1,
            cas=self.next_cas(), flags=old.flags, expiry=0, datatype=datatype, deleted=True,
            delete_time=int(time.time()), value=value,
        )  # fmt: skip
        part.append(doc)
        return doc

    def version(self, vb: int, key: bytes) -> DocRow | None:
        """The key's latest version as stored, a tombstone included (an expired document
        expired first), for the sub-document commands (formats/subdoc.md)."""
        self.partition(vb)
        self.collections.collection(key)
        return self.current(vb, key)

    def write_version(self, vb: int, key: bytes, old: DocRow | None, *, value: bytes,
                      datatype: int, deleted: bool, flags: int, expiry: int,
                      cas: int) -> DocRow:  # fmt: skip
        """A new version the sub-document commands built (value and datatype as they are
        stored, blob included): the next seq and rev seq, the given CAS (from
        `next_cas`, which a macro may already hold). A relative expiry is made absolute
        and capped by the collection's max TTL; a tombstone has none."""
        part = self.partition(vb)
        self.check_room(len(key) + len(value))
        now = int(time.time())
        if not deleted:
            expiry = expiry_of(self.collections.collection(key), expiry, now)
        doc = DocRow(
            vbucket=vb, key=key, seq=part.high_seq + 1, rev_seq=(old.rev_seq + 1) if old else 1,
            cas=cas, flags=flags, expiry=0 if deleted else expiry, datatype=datatype,
            deleted=deleted, delete_time=now if deleted else 0, value=value,
        )  # fmt: skip
        self._last_cas = max(self._last_cas, cas)
        part.append(doc)
        return doc

    def touch(self, vb: int, key: bytes, expiry: int) -> DocRow:
        """TOUCH / GAT: a live document's new expiry (relative made absolute, capped by
        the collection's max TTL), as a new version: new seq, CAS and rev seq."""
        part = self.partition(vb)
        expiry = expiry_of(self.collections.collection(key), expiry, int(time.time()))
        old = self._live(vb, key)  # kept as stored: compressed stays compressed
        self.check_room(len(key) + len(old.value))
        doc = replace(old, seq=part.high_seq + 1, rev_seq=old.rev_seq + 1, cas=self.next_cas(),
                      expiry=expiry)  # fmt: skip
        part.append(doc)
        return plain_doc(doc)

    def store_with_meta(
        self,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        deleted: bool,
        flags: int,
        expiry: int,
        rev_seq: int,
        item_cas: int,
        datatype: int,
        options: int = 0,
        cas: int = 0,
    ) -> DocRow:
        """SET/DEL_WITH_META: given metadata, rev-seq conflict resolution (docs/protocol.md §6).
        The expiry is kept as given: absolute, and not capped (a restore or XDCR copies
        an item's metadata as it was)."""
        part = self.partition(vb)
        self.check_room(len(key) + len(value))
        self.collections.collection(key)
        old = self.lookup(vb, key)
        if cas and (old is None or old.cas != cas):
            raise (KeyNotFound if old is None else KeyExists)("CAS guard failed")
        force = options & (0x01 | 0x08)
        if old is not None and not force:
            theirs = (rev_seq, item_cas) if deleted else (rev_seq, item_cas, expiry, -flags)
            ours = (
                (old.rev_seq, old.cas)
                if deleted
                else (old.rev_seq, old.cas, old.expiry, -old.flags)
            )
            if theirs <= ours:
                raise KeyExists("conflict resolution kept the existing version")
        if deleted:
            datatype, value = _deleted_value(datatype, value, key)
        else:
            datatype = checked_datatype(datatype, value, key)
        doc = DocRow(
            vbucket=vb, key=key, seq=part.high_seq + 1, rev_seq=rev_seq, cas=item_cas,
            flags=flags, expiry=0 if deleted else expiry, datatype=datatype, deleted=deleted,
            delete_time=int(time.time()) if deleted else 0, value=value,
        )  # fmt: skip
        self._last_cas = max(self._last_cas, item_cas)
        part.append(doc)
        return doc

    # -- flushing -------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            try:
                await self.flush()
                await self._prune_undo()
                if self.purge_age is not None:
                    await self.purge(self.purge_age)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("bucket %s: flush failed; will retry", self.name)

    def flush(self) -> Awaitable[int]:
        """Commit every queued item (group commit) and advance persisted seqnos; returns count."""
        return self._unbroken(self._flush())

    async def _flush(self) -> int:
        async with self._flush_lock:
            total = 0
            loop = asyncio.get_running_loop()
            while True:
                batches: list[tuple[Partition, list[DocRow]]] = []
                size = 0
                for part in self.partitions.values():
                    if len(part.queue) and size < FLUSH_CHUNK:
                        docs = part.queue.snapshot()
                        batches.append((part, docs))
                        size += len(docs)
                gen = self._manifest_gen
                meta = self.collections.meta() if gen != self._manifest_saved else None
                if not batches and meta is None:
                    return total
                records = []
                bounds: dict[int, list[int]] = {}
                for part, docs in batches:
                    top = docs[-1].seq
                    start, end = _replica_snapshot(part, top) if part.state in FED else (top, top)
                    records.append(part.record_at(top, start, end))
                    if part.state in FED and part.undo_floor is not None:
                        # the ends of snapshots this round completes: the undo reaches the
                        # state at each, unless the queue broke it
                        bounds[part.vbucket] = sorted({
                            m.end for m in part.markers
                            if part.persisted_seq < m.end <= top and m.end not in part.broken
                        })  # fmt: skip
                docs_all = [d for _, docs in batches for d in docs]
                await loop.run_in_executor(self._pool, self.storage.write_batch, docs_all,
                                           records, set(bounds), bounds, meta)  # fmt: skip
                self._disk_gen += 1
                self._manifest_saved = gen
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
                if self._room:
                    self._made_room()
                total += len(docs_all)

    async def _prune_undo(self) -> None:
        """Keep about `undo_window` seqs of undo per replica partition (bounded disk)."""
        for vb, part in self.partitions.items():
            floor = part.undo_floor
            if floor is not None and part.persisted_seq - floor > 2 * self.undo_window:
                new_floor = part.persisted_seq - self.undo_window
                part.undo_floor = new_floor  # first: a floor too high is only conservative
                part.bounds = [b for b in part.bounds if b >= new_floor]
                await self._in_pool(self.storage.prune_undo, vb, new_floor)

    async def persist_state(self, parts: list[Partition]) -> None:
        """Write partition records (failover log or state changed) durably."""

        async def save() -> None:
            async with self._flush_lock:
                recs = [p.record() for p in parts]
                await asyncio.get_running_loop().run_in_executor(
                    self._pool, self.storage.save_partitions, recs
                )

        await self._unbroken(save())

    async def purge(self, older_than: float) -> dict[int, int]:
        """Purge tombstones older than `older_than` seconds; raise purge seqnos."""
        await self.flush()

        async def run() -> dict[int, int]:
            purged = await self._locked(self.storage.purge_tombstones, older_than)
            for vb, seq in purged.items():
                self.partitions[vb].purge_seq = max(self.partitions[vb].purge_seq, seq)
            return purged

        return await self._unbroken(run())


def _deleted_value(datatype: int, value: bytes, key: bytes) -> tuple[int, bytes]:
    """(datatype, value) a DEL_WITH_META leaves on its tombstone: the xattr blob it
    carries, system and user xattrs as given, stored inflated; any body is dropped
    (formats/wire.md "Xattrs", point 5). Without the XATTR bit the value is kept as
    before, with datatype 0."""
    if not datatype & xattrs.XATTR:
        return 0, value
    checked_datatype(datatype, value, key)  # inflates, and the blob must be well formed
    blob = unpacked(DocRow(0, key, 0, 0, 0, 0, 0, datatype, True, 0, value))[1]
    return (xattrs.XATTR, blob) if blob else (0, b"")


def _expired(doc: DocRow, now: float) -> bool:
    """True for a live document whose expiry has passed (a system row's `expiry` is its
    event version, never an expiry)."""
    return (not doc.deleted and 0 < doc.expiry <= now
            and not sysevents.is_system_key(doc.key))  # fmt: skip


def _replica_snapshot(part: Partition, top: int) -> tuple[int, int]:
    """(snap_start, snap_end) to record when a replica partition is persisted up to `top`:
    (top, top) if `top` ends a snapshot; else (the last complete snapshot's end, the end
    of the snapshot holding `top`), so `complete_seq` names the last complete snapshot
    (the UPR design specification's walkthrough, "UPR in action on a Cluster": B persisted
    through 7 of snapshot 6-8 and promotes at 5)."""
    complete, current = part.complete_seq, top
    for start, end in part.markers:
        if end <= top:
            complete = max(complete, end)
        elif start <= top:
            current = max(current, end)
    return (top, top) if complete >= top else (complete, current)
