"""A bucket of the node: partitions, the KV write path, the flusher and start-up recovery.

Write path (the UPR design specification, "How KV mutations flow into ep-engine and write
queue"; docs/design.md "Data flows" (1. Write)): CAS check → next per-partition seqno →
write queue → acknowledged; the flusher (upr_cli/node/flusher.py) commits every queued
item in one transaction per round (group commit) and only then advances
`persisted_seq`, so OBSERVE_SEQNO tells clients when a write is durable. Every other
storage write runs on the flusher's writer thread too, never cut short.

Around this module: the flusher, a replica partition's undo and rollback
(upr_cli/node/undo.py), collections changes and the purge of dropped collections
(upr_cli/node/bucket_manifest.py) and the expiry pager (upr_cli/node/expiry.py).

Failover entries (the UPR design specification, "Failover Log"; docs/protocol.md §4.3):
one {uuid, 0} at creation; after an unclean shutdown, one per active partition at its
last persisted complete snapshot (`snap_end` if the high seq equals it, else
`snap_start`), written to disk before the node serves. A clean shutdown flushes
everything and keeps the uuids.

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
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from time import time_ns
from typing import Any, cast

from upr_cli.collections import CollectionsError, CollectionsManifest
from upr_cli.errors import UsageError
from upr_cli.failover import FailoverLog, new_uuid
from upr_cli.net.aio import cancel_and_wait
from upr_cli.node import bucket_manifest, expiry, sysevents, undo
from upr_cli.node.collection_state import (
    DROPPED_KEY,
    MANIFEST_KEY,
    NodeCollections,
    expiry_of,
)
from upr_cli.node.expiry import expired
from upr_cli.node.flusher import Flusher
from upr_cli.node.partition import ACTIVE, ITEM_OVERHEAD, Partition, QueueBytes
from upr_cli.node.state_control import StaleCas, StateControl
from upr_cli.node.storage import (
    WRITER_CACHE_KIB,
    DocRow,
    NodeStorage,
    PartitionRecord,
    StorageError,
)
from upr_cli.node.undo import FED, UNDO_WINDOW
from upr_cli.protocol import leb128, snappy, xattrs
from upr_cli.protocol.header import DATATYPE_JSON
from upr_cli.protocol.status import (
    InvalidArguments,
    KeyExists,
    KeyNotFound,
    NotMyVbucket,
    Status,
    StatusError,
    TemporaryFailure,
)

# the datatype bits of a value's body (compressed, with xattrs), and every bit a node keeps
_BODY_BITS = snappy.SNAPPY | xattrs.XATTR
_KNOWN_BITS = DATATYPE_JSON | _BODY_BITS

# not in the prefetched map (a prefetched None means the key is known to be absent)
_ABSENT: Any = object()


log = logging.getLogger(__name__)

EXPIRY_PAGER_INTERVAL = 10.0  # seconds (kv_engine's pager waits longer: a test node should not)
DEFAULT_PARTITIONS = 1024  # a new bucket's partition count, as Couchbase's on Linux


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
    if datatype & DATATYPE_JSON and not is_json(body):
        return datatype & _BODY_BITS
    return datatype & _KNOWN_BITS


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
    """One bucket: its partitions, KV writes and reads, the replica write path, and the
    parts that own the rest (its flusher, its state control)."""

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
        self.num_partitions = _partition_count(self.storage, num_partitions)
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
        self.flusher = Flusher(self, self._pool)  # the writer thread: every storage write
        self._last_cas = 0
        self.started_unclean = False
        # Disk versions prefetched for a batch of writes; valid while no flush intervened
        # (the flusher moves `disk_gen` after every write).
        self.disk_gen = 0
        self._prefetched: dict[tuple[int, bytes], DocRow | None] = {}
        self._prefetched_gen = -1
        # the bucket CAS and the cluster map (formats/cluster.md §1)
        self.control = StateControl(self, data_dir / f"{name}.cluster-map.json")
        # a cluster node starts in its persisted states with front-end traffic off, until
        # its orchestrator turns it on (the same section of the UPR design specification,
        # step 1; formats/cluster.md §3)
        self.traffic = True
        self.undo_window = UNDO_WINDOW
        self.listeners: list[Callable[[], None]] = []  # told of map and state changes
        self.collections = NodeCollections()
        self.manifest_gen = 0  # bumped by every new manifest; the flush persists it
        self.manifest_saved = 0  # the generation on disk
        self._purger: asyncio.Task[None] | None = None
        self._pager: asyncio.Task[None] | None = None

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
        parts, changed = _partitions(records, self.num_partitions, clean, self.queued)
        self.partitions.update(parts)
        for vb in sorted(set(records) - set(parts)):
            log.warning(
                "bucket %s: partition %d on disk beyond --partitions, ignored", self.name, vb
            )
        undo.load(self.storage, self.partitions)
        self.started_unclean = not clean and not fresh
        if self.control.load_map():
            self.traffic = False  # a member of a cluster: ENABLE_TRAFFIC turns it on
        if changed:
            self.storage.save_partitions(changed)
        self.storage.set_clean_shutdown(False)
        self.flusher.start()
        if self.expiry_pager_interval:
            self._pager = asyncio.get_running_loop().create_task(
                expiry.pager(self), name="expiry-pager"
            )
        self._schedule_purge()

    async def stop(self, *, clean: bool = True) -> None:
        """Stop flushing; on a clean stop flush everything and mark the shutdown clean."""
        await self.flusher.stop()
        if self._purger is not None:
            await cancel_and_wait([self._purger])
            self._purger = None
        if self._pager is not None:
            await cancel_and_wait([self._pager])
            self._pager = None
        await self.flusher.drain()  # storage work whose callers were cancelled ends first
        if clean:
            await self.flush()
            self.storage.set_clean_shutdown(True)
        self._pool.shutdown(wait=True)
        self._lookup.close()
        self.storage.close()

    # -- partition-state control (formats/cluster.md) ---------------------------------

    @property
    def state_cas(self) -> int:
        """The bucket CAS a state command must carry."""
        return self.control.cas

    @property
    def cluster_map(self) -> dict[str, object] | None:
        """The cluster map an orchestrator set (None: none)."""
        return self.control.cluster_map

    @property
    def map_rev(self) -> int:
        """The revision of the cluster map held (0: none set)."""
        return self.control.map_rev

    def set_cluster_map(self, cas: int, config: dict[str, object]) -> int:
        """Store a newer cluster map (persisted atomically); returns the new bucket CAS."""
        return self.control.set_cluster_map(cas, config)

    async def set_partition_state(self, vb: int, state: str, *, cas: int, rev: int,
                                  failover: bool = False) -> int:  # fmt: skip
        """Change a partition's state (persisted before the answer); returns the new CAS
        (`StateControl.set_partition_state`)."""
        return await self.control.set_partition_state(vb, state, cas=cas, rev=rev,
                                                      failover=failover)  # fmt: skip

    # -- collections (formats/collections.md) -----------------------------------------

    @property
    def manifest(self) -> CollectionsManifest:
        """The bucket's current collections manifest."""
        return self.collections.manifest

    async def set_manifest(self, manifest: CollectionsManifest) -> None:
        """COLLECTIONS_SET_MANIFEST: take a manifest whose uid is not below the current
        one (an equal uid must come with the same manifest: a no-op). Each change gets
        a system event row in every active partition, with its own seq; the answer
        waits until the rows and the manifest are on disk, in one transaction
        (`bucket_manifest.set_manifest`)."""
        await bucket_manifest.set_manifest(self, manifest)
        self._schedule_purge()

    def _schedule_purge(self) -> None:
        """Start the background purge of dropped collections, unless it is running."""
        if self.collections.dropped and (self._purger is None or self._purger.done()):
            loop = asyncio.get_running_loop()
            self._purger = loop.create_task(bucket_manifest.purge_dropped(self),
                                            name="purge-collections")  # fmt: skip

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
            self.manifest_gen += 1
            self._schedule_purge()
        return True

    def replica_marker(self, vb: int, start: int, end: int) -> None:
        """A snapshot marker for a replica partition (`undo.marker`)."""
        undo.marker(self.fed_partition(vb), start, end)

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
        `to_seq` that its undo reaches, and return it (None: emptied; `undo.rollback`).
        `asked` (default `to_seq`): the server's rollback seq."""
        return await undo.rollback(self, vb, to_seq, to_seq if asked is None else asked)

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
            if self._prefetched_gen == self.disk_gen:
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
        self._prefetched_gen = self.disk_gen

    def current(self, vb: int, key: bytes) -> DocRow | None:
        """The latest version of a key of an active partition, after expiring it if it
        is a live document whose expiry has passed (the read that finds it expires it)."""
        doc = self.lookup(vb, key)
        if doc is not None and expired(doc, time.time()):
            doc = self.expire(self.partitions[vb], doc)
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

    def expire(self, part: Partition, old: DocRow) -> DocRow:
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

    async def expire_due(self) -> int:
        """The expiry pager's round: expire every live document of an active partition
        whose expiry has passed, in the write queue or on disk; returns how many."""
        return await expiry.expire_due(self)

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

    def made_room(self) -> None:
        """A flush made room in the write queue: wake the replication streams waiting."""
        if not self._room:
            return
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
        live = old is not None and not old.deleted and not expired(old, now)
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

    def flush(self) -> Awaitable[int]:
        """Commit every queued item (group commit) and advance persisted seqnos; returns count."""
        return self.flusher.flush()

    def persist_state(self, parts: list[Partition]) -> Awaitable[None]:
        """Write partition records (failover log or state changed) durably."""
        return self.flusher.persist_state(parts)

    def purge(self, older_than: float) -> Awaitable[dict[int, int]]:
        """Purge tombstones older than `older_than` seconds; raise purge seqnos."""
        return self.flusher.purge(older_than)

    def _prune_undo(self) -> Awaitable[None]:
        """Keep about `undo_window` seqs of undo per replica partition (`undo.prune`)."""
        return undo.prune(self)


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


def _partitions(
    records: dict[int, PartitionRecord], count: int, clean: bool, queued: QueueBytes
) -> tuple[dict[int, Partition], list[PartitionRecord]]:
    """A bucket's `count` partitions made from their stored records (or new), their
    write queues counted in `queued`, and the records to save: the new partitions', and
    after an unclean shutdown every active's, with a failover entry at its last
    persisted complete snapshot (docs/protocol.md §4.3)."""
    parts: dict[int, Partition] = {}
    changed: list[PartitionRecord] = []
    for vb in range(count):
        rec = records.get(vb)
        if rec is None:
            part = Partition(vb, ACTIVE, FailoverLog.initial())
            changed.append(part.record())
        else:
            part = Partition.from_record(rec)
            if not clean and part.state == ACTIVE:
                seq = part.snap_end if part.persisted_seq == part.snap_end else part.snap_start
                part.failover = part.failover.add_entry(new_uuid(), seq)
                changed.append(part.record())
        part.queue.held = queued
        parts[vb] = part
    return parts, changed


def _partition_count(storage: NodeStorage, wanted: int | None) -> int:
    """A bucket's partition count: the one on disk, which never changes (a key's
    partition is its hash modulo the count), else `wanted`, else the default."""
    stored = storage.partition_count()
    if wanted is None or stored in (0, wanted):
        return stored or wanted or DEFAULT_PARTITIONS
    storage.close()
    raise UsageError(
        f"--num-partitions {wanted}: the bucket in {storage.path} has {stored} "
        f"partitions, which cannot change (give --num-partitions {stored}, or leave it out)"
    )


# StaleCas: the node answers it with the bucket CAS (upr_cli/node/server.py imports it here)
__all__ = ["EXPIRY_PAGER_INTERVAL", "Bucket", "StaleCas", "XattrInvalid", "unpacked"]
