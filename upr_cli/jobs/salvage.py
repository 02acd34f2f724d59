"""`upr salvage`: find the lost writes of a failover and write back those still safe to.

Theory of operation (the UPR design specification, "Replica C repairs master and rolls
back to common snapshot sequence"; docs/design.md "Salvage": writes a failover took back
are not gone while some copy still holds them). A *lost write* is the newest version of
a key, in some partition, above a rollback cut r: a former master acknowledged it, the
current history does not have it.

* **Where they come from.** From a repository: the records above each cut the chain
  recorded (formats/repository.md "Chains", `lost_ranges`), the records a rollback in
  the middle of a backup took back (its cut-back segments, formats/repository.md §5.6),
  plus the records above the rollback point the chain's head would get from the current
  master now (producer rule, docs/protocol.md §4.2), which covers a failover no backup
  has seen yet. From a replay store: the versions its rollbacks took back
  (`lost_writes`, formats/store.md §3.5), plus its documents above the rollback point
  the master would give it now.
* **What is safe.** A lost write may go back only where the key has not changed on the
  master since r. The master says what changed: a DCP stream of the partition from r
  (on the master's branch at r) to its high seq names every key written or deleted
  after r (tombstones included). Such a key is a **conflict**, reported with both
  versions and never written. A partition the master cannot stream from r (its
  tombstones were purged above r) makes all its lost writes conflicts.
* **Writing.** `--apply` writes each safe one with a CAS guard, so a change made between
  the check and the write turns it into a conflict instead of being overwritten: a GET
  absent. The value, flags and expiry come back; the master assigns a new cas and seq.
  The dry run (default) only lists.
* **Xattrs.** A version carries its xattr blob (formats/wire.md "Xattrs") beside its
  body, from every holder: a backup's records, a store's documents, a replica node's
  rows (stored as kv_engine lays them out, blob before body, split here). Two versions
  are the same only with the same xattrs: a master version that differs from a lost
  one only in its xattrs is a change, so a conflict. A SET cannot carry xattrs (the
  node, as kv_engine, takes datatype XATTR from with-meta writes only), so `--apply`
  writes a version with xattrs in two steps: the body, flags and expiry with the CAS
  guard, then its xattrs, each upserted whole by one SUBDOC_MULTI_MUTATION guarded by
  the cas the first step returned (kv_engine's sub-document path, as the SDKs'
  `mutate_in` writes them). Xattrs the master's version had under other names stay.
  When the second step is refused, the body stays written and the reason says which
  xattrs were left out.
* **Collections.** A key is (collection id, key): the same key in two collections is
  two lost writes. Ids are the bucket's own (salvage writes back to the bucket the
  versions came from), so a version goes back to its collection by id; a collection
  the master dropped since makes its lost writes conflicts, never written elsewhere.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from upr_cli.collections import DEFAULT
from upr_cli.collections import Path as CollectionPath
from upr_cli.dcp.consumer import DcpConsumer, WireCompression
from upr_cli.dcp.events import Event, Rollback
from upr_cli.dcp.sink import SinkBase, drive
from upr_cli.errors import UprError, UsageError
from upr_cli.failover import FailoverLog, needs_rollback
from upr_cli.jobs.rollback_point import node_states
from upr_cli.net.router import Router, RouterError
from upr_cli.net.uri import SourceUri
from upr_cli.node_files import DocRow, is_system_key, read_lost_writes
from upr_cli.position import StreamPosition
from upr_cli.protocol import leb128, snappy, subdoc, xattrs
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.protocol.messages import (
    Add,
    Delete,
    Get,
    Set,
)
from upr_cli.protocol.status import Status
from upr_cli.segments.format import OP_SYSTEM_EVENT
from upr_cli.store import Document

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from upr_cli.segments import Record


def _text_or_b64(name: str, data: bytes) -> dict[str, str]:
    """{name: text} when `data` is UTF-8, else {name_b64: base64}."""
    try:
        return {name: data.decode()}
    except UnicodeDecodeError:
        return {f"{name}_b64": base64.b64encode(data).decode()}


@dataclass(frozen=True, slots=True)
class Version:
    """One version of a key (a record or document): what salvage shows and writes."""

    seq: int
    deleted: bool
    value: bytes
    cas: int
    rev_seq: int
    flags: int
    expiry: int
    datatype: int  # the body's: never the XATTR bit (the blob is apart, in `xattrs`)
    xattrs: bytes = b""  # the xattr blob (formats/wire.md "Xattrs"); b"": none

    @classmethod
    def of(cls, d: Document) -> Version:
        """A stored document's version."""
        return cls(d.seq, d.deleted, bytes(d.value), d.cas, d.rev_seq, d.flags, d.expiry,
                   d.datatype, bytes(d.xattrs))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """JSON form: the value as text when it is UTF-8, else base64; the xattrs as an
        object of name -> value ({} for none)."""
        value = _text_or_b64("value", self.value)
        return {
            "seq": str(self.seq),
            "deleted": self.deleted,
            "cas": str(self.cas),
            "rev_seq": str(self.rev_seq),
            "flags": self.flags,
            "expiry": self.expiry,
            **value,
            "xattrs": xattrs.to_json(self.xattrs),
        }


@dataclass
class LostItem:
    """A lost write and what salvage made of it."""

    partition: int
    key: bytes
    cut: int  # the rollback seq above which it was lost
    lost: Version
    origin: str  # "backup <id>", "head vs master", "store rollback", "store vs master"
    outcome: str = "pending"  # would-write | written | conflict | already-gone | error
    master: Version | None = None  # the master's version, for a conflict
    reason: str = ""
    store_ids: list[int] = field(default_factory=list)  # lost_writes rows, for --store
    collection: int = 0  # the collection id (0: `_default._default`)
    path: CollectionPath | None = None  # its scope and name, where the holder records them

    @property
    def shown_key(self) -> bytes:
        """The key as salvage prints it: `scope.collection:key` outside the default
        collection (`#id:key` when the holder has no name for it)."""
        if not self.collection:
            return self.key
        where = str(self.path) if self.path is not None else f"#{self.collection:x}"
        return where.encode() + b":" + self.key

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        key = _text_or_b64("key", self.key)
        path = self.path or (CollectionPath(DEFAULT, DEFAULT) if not self.collection else None)
        return {
            "partition": self.partition,
            "collection_id": self.collection,
            "scope": path.scope if path is not None else None,
            "collection": path.collection if path is not None else None,
            **key,
            "cut": str(self.cut),
            "origin": self.origin,
            "outcome": self.outcome,
            "reason": self.reason,
            "lost_version": self.lost.to_json(),
            "master": None if self.master is None else self.master.to_json(),
        }


@dataclass
class SalvageReport:
    """Every lost write found, and the counts per outcome."""

    source: str
    target: str
    dry_run: bool
    items: list[LostItem] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        """Lost writes per outcome."""
        out: dict[str, int] = {}
        for it in self.items:
            out[it.outcome] = out.get(it.outcome, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "source": self.source,
            "target": self.target,
            "dry_run": self.dry_run,
            "lost_writes": len(self.items),
            "items": len(self.items),  # a count, as in every command: the list is `writes`
            "counts": self.counts,
            "writes": [it.to_json() for it in self.items],
        }


def _seg_versions(records: Iterable[Record]) -> Iterator[tuple[int, bytes, Version]]:
    """The collection id, key and version of each data record of a segment (the reader
    hands the xattr blob out apart from the body); system events are no writes."""
    for r in records:
        if r.op != OP_SYSTEM_EVENT:
            yield r.collection, bytes(r.key), Version(
                r.seq, r.op != OP_MUTATION, bytes(r.value), r.cas, r.rev_seq, r.flags,
                r.expiry, r.datatype, bytes(r.xattrs),
            )  # fmt: skip


def same_xattrs(a: bytes, b: bytes) -> bool:
    """The same xattrs: the same names with the same JSON values, in any order (a server
    may keep the pairs in another order, or respace a value)."""
    return a == b or xattrs.to_json(a) == xattrs.to_json(b)


def _same(a: Version, b: Version) -> bool:
    """The same content (a written-back version gets a new cas and seq): deleted or not,
    the same xattrs, and for a live one the same value, flags and expiry."""
    if not same_xattrs(a.xattrs, b.xattrs):
        return False
    if a.deleted or b.deleted:
        return a.deleted == b.deleted
    return (a.value, a.flags, a.expiry) == (b.value, b.flags, b.expiry)


def _record_version(rec: DcpRecord) -> Version:
    """A streamed record's version (the consumer has split its xattrs off)."""
    return Version(rec.by_seqno, rec.opcode != OP_MUTATION, bytes(rec.value), rec.cas,
                   rec.rev_seqno, rec.flags, rec.expiration, rec.datatype,
                   bytes(rec.xattrs))  # fmt: skip


def node_version(d: DocRow) -> Version:
    """A node row's version: stored as kv_engine lays a document out (compressed when
    its datatype has Snappy, the xattr blob before the body when it has XATTR), handed
    out as a consumer record is (inflated, the blob apart, both bits clear). A value
    that does not inflate or split is a typed error naming the key."""
    datatype, value = snappy.plain(d.datatype, d.value, d.key)
    blob = b""
    if datatype & xattrs.XATTR and value:
        blob, value = xattrs.split(value, d.key)
    datatype &= ~xattrs.XATTR
    return Version(d.seq, d.deleted, value, d.cas, d.rev_seq, d.flags, d.expiry, datatype, blob)


# -- the master ----------------------------------------------------------------------------


async def _master_logs(
    uri: SourceUri, partitions: list[int]
) -> tuple[dict[int, FailoverLog], dict[int, int], int]:
    """The master's failover log and high seq per partition, and its partition count."""
    states, n = await node_states(uri, partitions)
    return {p: st.log for p, st in states.items()}, {p: st.seen_seq for p, st in states.items()}, n


def rollback_cut(master_log: FailoverLog, high: int, pos: StreamPosition) -> int | None:
    """Where a holder at `pos` would be rolled back to by the master (None: no rollback)."""
    d = needs_rollback(master_log, pos, high=high)
    return d.rollback_seq if d.rollback else None


async def _changed_since(
    uri: SourceUri,
    cuts: dict[int, int],
    logs: dict[int, FailoverLog],
    *,
    wait: float = 120.0,
    on_notice: Callable[[str], None] | None = None,
    compression: WireCompression = "auto",
) -> tuple[dict[int, dict[tuple[int, bytes], Version]], set[int]]:
    """Per partition, the (collection, key)s the master changed after the cut (newest
    version each);
    and the partitions it cannot stream from the cut (everything there conflicts)."""
    positions = {}
    for p, r in cuts.items():
        entry = logs[p].entry_at(r) if p in logs else None
        positions[p] = StreamPosition(p, entry.uuid if entry else 0, r, r, r)
    consumer = DcpConsumer(
        uri,
        partitions=sorted(cuts),
        positions=positions,
        until_end=True,
        name="upr-salvage",
        follow_for=wait,
        on_notice=on_notice,  # a master that goes away: docs/protocol.md §4.5
        compression=compression,
    )
    sink = _ChangedSink(consumer, cuts)
    try:
        await consumer.open()
        await drive(consumer, sink)
    finally:
        await consumer.aclose()
    return sink.changed, sink.unknown


class _ChangedSink(SinkBase):
    """The newest version of every key the master streams after the cut, per partition;
    a partition it rolls back instead cannot say what changed (`unknown`)."""

    def __init__(self, consumer: DcpConsumer, cuts: dict[int, int]) -> None:
        self.consumer = consumer
        self.changed: dict[int, dict[tuple[int, bytes], Version]] = {p: {} for p in cuts}
        self.unknown: set[int] = set()

    async def records(self, records: list[DcpRecord]) -> None:
        for rec in records:
            if rec.vbucket not in self.unknown:
                self.changed[rec.vbucket][rec.collection, bytes(rec.key)] = _record_version(rec)

    async def event(self, event: Event) -> None:
        if isinstance(event, Rollback):
            self.unknown.add(event.partition)  # the master cannot say what changed after r

    async def batch_done(self) -> bool:
        self.consumer.commit()
        return False


async def _write_back(uri: SourceUri, items: list[LostItem], num_partitions: int) -> None:
    """CAS-guarded writes of the safe items (module docstring), each to its partition's
    active node (net/router.py follows the cluster map)."""
    router = await Router.open(uri, name="upr-salvage")
    try:
        for it in items:
            vb = it.partition
            try:
                key = router.qualify(it.key, it.collection)
            except RouterError as exc:  # a collection on a master without collections
                it.outcome, it.reason = "conflict", str(exc)
                continue
            got = await router.request(vb, functools.partial(_get, vb, key))
            if got.vbucket_or_status == Status.UNKNOWN_COLLECTION:
                it.outcome = "conflict"
                it.reason = f"collection {it.collection:#x} no longer exists on the master"
                continue
            present = got.vbucket_or_status == Status.SUCCESS
            cas = got.cas if present else 0
            if it.lost.deleted:
                if not present:
                    it.outcome, it.reason = "already-gone", "the master does not have the key"
                    continue
                make: Any = lambda o, vb=vb, key=key, cas=cas: Delete(  # noqa: E731
                    vbucket=vb, key=key, cas=cas, opaque=o
                ).encode()
            else:  # SET guarded by the cas just read, or ADD when the key is absent
                kind = Set if present else Add
                make = lambda o, vb=vb, key=key, it=it, cas=cas, kind=kind: kind(  # noqa: E731
                    vbucket=vb, key=key, value=it.lost.value, flags=it.lost.flags,
                    expiration=it.lost.expiry, cas=cas, datatype=it.lost.datatype, opaque=o,
                ).encode()  # fmt: skip
            resp = await router.request(vb, make)
            status = resp.vbucket_or_status
            if status == Status.SUCCESS:
                it.outcome = "written"
                if it.lost.xattrs and not it.lost.deleted:
                    it.reason = await _put_xattrs(router, vb, key, it.lost, resp.cas)
            elif status in (Status.KEY_EEXISTS, Status.KEY_ENOENT):
                it.outcome = "conflict"
                it.reason = "the key changed on the master during the salvage"
                if present:
                    flags = int.from_bytes(bytes(got.extras[:4]), "big") if got.extras else 0
                    it.master = Version(0, False, bytes(got.value), got.cas, 0, flags, 0,
                                        got.datatype)  # fmt: skip
            else:
                it.outcome, it.reason = "error", f"status 0x{status:02x}"
    finally:
        await router.aclose()


def _get(vb: int, key: bytes, opaque: int) -> bytes:
    return Get(vbucket=vb, key=key, opaque=opaque).encode()


async def _put_xattrs(router: Router, vb: int, key: bytes, v: Version, cas: int) -> str:
    """The second step of writing back a version with xattrs (module docstring): each of
    its xattrs upserted whole, guarded by the cas of the body just written, its expiry
    kept. "" when they are written, else why not (the body stays written)."""
    names = ", ".join(xattrs.to_json(v.xattrs))
    if not router.xattrs:
        return f"written without its xattrs {names}: the master did not grant HELLO XATTR"
    pairs = xattrs.pairs(v.xattrs, key)
    for at in range(0, len(pairs), MAX_SPECS):
        chunk = pairs[at : at + MAX_SPECS]
        resp = await router.request(vb, functools.partial(xattr_upserts, vb, key, chunk,
                                                          v.expiry, cas))  # fmt: skip
        status = resp.vbucket_or_status
        if status != Status.SUCCESS:
            return (f"written without its xattrs {names}: the master answered status "
                    f"0x{status:02x} to SUBDOC_MULTI_MUTATION")  # fmt: skip
        cas = resp.cas
    return ""


#: kv_engine's limit on the paths of one sub-document command
MAX_SPECS = 16


def xattr_upserts(vb: int, key: bytes, pairs: list[tuple[str, bytes]], expiry: int, cas: int,
                  opaque: int) -> bytes:  # fmt: skip
    """SUBDOC_MULTI_MUTATION: each (name, JSON text) pair upserted as a whole xattr
    (formats/wire.md "Xattrs"), guarded by `cas`; a u32 expiry in the extras keeps the
    document's (without it the server clears it, as kv_engine does)."""
    specs = [subdoc.Spec(subdoc.DICT_UPSERT, name, text, subdoc.XATTR_PATH) for name, text in pairs]
    return subdoc.multi_mutation(vb, opaque, key, specs, cas=cas, expiry=expiry)


async def _resolve(
    uri: SourceUri,
    report: SalvageReport,
    logs: dict[int, FailoverLog],
    num_partitions: int,
    apply: bool,
    wait: float = 120.0,
    on_notice: Callable[[str], None] | None = None,
    compression: WireCompression = "auto",
) -> None:
    """Decide each item against the master, then (apply) write the safe ones."""
    items = report.items
    cuts: dict[int, int] = {}
    for it in items:
        cuts[it.partition] = min(cuts.get(it.partition, it.cut), it.cut)
    changed, unknown = (await _changed_since(uri, cuts, logs, wait=wait, on_notice=on_notice,
                                              compression=compression)
                        if cuts else ({}, set()))  # fmt: skip
    safe = judge(items, changed, unknown)
    if apply and safe:
        await _write_back(uri, safe, num_partitions)


def judge(items: list[LostItem], changed: dict[int, dict[tuple[int, bytes], Version]],
          unknown: set[int]) -> list[LostItem]:  # fmt: skip
    """Each item's outcome against what the master changed after the cut (`changed`, per
    partition; `unknown`: partitions it could not say for); the safe ones returned."""
    safe = []
    for it in items:
        newer = changed.get(it.partition, {}).get((it.collection, it.key))
        if it.partition in unknown:
            it.outcome = "conflict"
            it.reason = f"the master cannot stream partition {it.partition} from seq {it.cut}"
        elif newer is not None and newer.seq > it.cut and _same(newer, it.lost):
            it.outcome, it.master = "already-there", newer
            it.reason = f"the master holds this version again (seq {newer.seq})"
        elif newer is not None and newer.seq > it.cut:
            it.outcome, it.master = "conflict", newer
            it.reason = f"the key changed on the master at seq {newer.seq}, after the cut"
        else:
            it.outcome = "would-write"
            safe.append(it)
    return safe


def _named(items: list[LostItem], names: dict[int, CollectionPath]) -> list[LostItem]:
    """The items with their collections' names, where the holder recorded them."""
    for it in items:
        it.path = names.get(it.collection)
    return items


def _newest(items: list[LostItem]) -> list[LostItem]:
    """One item per (partition, collection, key): the newest lost version, checked from
    the lowest cut any of its findings had (every store row merged into it is marked
    together)."""
    best: dict[tuple[int, int, bytes], LostItem] = {}
    for it in items:
        k = (it.partition, it.collection, it.key)
        cur = best.get(k)
        if cur is None:
            best[k] = it
            continue
        keep = it if it.lost.seq > cur.lost.seq else cur
        keep.cut = min(cur.cut, it.cut)
        keep.store_ids = sorted(set(cur.store_ids) | set(it.store_ids))
        best[k] = keep
    return sorted(best.values(), key=lambda it: (it.partition, it.lost.seq))


# -- from a repository ---------------------------------------------------------------------


def _repo_items(
    repo_dir: Path, bucket: str | None, logs: dict[int, FailoverLog] | None, highs: dict[int, int]
) -> tuple[list[LostItem], list[int]]:
    """Lost writes a repository holds: above recorded cuts, and above the head's rollback
    point against the master (`logs`/`highs`)."""
    from upr_cli.repo import format_cut_path, lost_ranges, plan_state, resume_point
    from upr_cli.repo.manifest import collection_history
    from upr_cli.segments import SegmentReader
    from upr_cli.source import open_bucket

    repo, b, manifests = open_bucket(repo_dir, bucket)
    held = sorted({e.partition for m in manifests for e in m.partitions})
    names = {cid: path for cid, (path, _dropped) in collection_history(manifests).items()}
    items: list[LostItem] = []
    for p in held:
        for rng in lost_ranges(manifests, p):
            m = next(m for m in manifests if m.backup_id == rng.backup_id)
            entry = m.partition(p)
            assert entry is not None
            for seg in entry.segments:
                if seg.last_seq <= rng.from_seq:
                    continue
                with SegmentReader(repo.segment_path(b, rng.backup_id, seg.file),
                                   repo.storage) as reader:  # fmt: skip
                    for cid, key, v in _seg_versions(reader.records()):
                        if rng.from_seq < v.seq <= rng.to_seq:
                            origin = f"backup {rng.backup_id}"
                            items.append(LostItem(p, key, rng.from_seq, v, origin, collection=cid))
        for m in manifests:  # records a mid-run rollback took back (repository.md §5.6)
            entry = m.partition(p)
            for k, c in enumerate(entry.cut_backs if entry is not None else (), 1):
                for seg in c.segments:
                    path = repo.segment_path(b, m.backup_id, format_cut_path(k, seg.file))
                    with SegmentReader(path, repo.storage) as reader:
                        items += [LostItem(p, key, c.to_seq, v,
                                           f"backup {m.backup_id} (cut back mid-run)",
                                           collection=cid)
                                  for cid, key, v in _seg_versions(reader.records())]  # fmt: skip
        if logs is None or p not in logs:
            continue
        rp = resume_point(manifests, p)
        if rp is None:
            continue
        pos = rp.position
        r = rollback_cut(logs[p], highs.get(p, 0), pos)
        if r is None or r >= pos.seq:
            continue
        latest: dict[tuple[int, bytes], Version] = {}
        at = manifests[-1].backup_id
        for step in plan_state(manifests, at=at, partition=p):
            with SegmentReader(repo.segment_path(b, step.backup_id, step.segment.file),
                               repo.storage) as reader:  # fmt: skip
                for cid, key, v in _seg_versions(reader.records()):
                    if v.seq > step.max_seq:
                        break
                    if v.seq > r:
                        latest[cid, key] = v
        items += [LostItem(p, k, r, v, "head vs master", collection=cid)
                  for (cid, k), v in latest.items()]  # fmt: skip
    return _named(_newest(items), names), held


def salvage_repo(
    repo_dir: Path,
    target: SourceUri,
    *,
    bucket: str | None = None,
    apply: bool = False,
    partitions: list[int] | None = None,
    wait: float = 120.0,
    on_notice: Callable[[str], None] | None = None,
    compression: WireCompression = "auto",
) -> SalvageReport:
    """Find a repository's lost writes and (apply) write back the safe ones to `target`.
    The master's changes are streamed waiting up to `wait` seconds for it if it goes away
    (as every salvage: `on_notice` hears when the link is lost and when it is back)."""
    from upr_cli.source import open_bucket

    with contextlib.ExitStack() as reading:
        _repo, _b, manifests = open_bucket(repo_dir, bucket, held=reading, command="salvage")
        held = sorted({e.partition for m in manifests for e in m.partitions})
        if partitions is not None:
            held = [p for p in held if p in set(partitions)]
        report = SalvageReport(f"repo:{repo_dir}", target.redacted(), not apply)

        async def go() -> None:
            logs, highs, n = await _master_logs(target, held)
            items, _ = _repo_items(repo_dir, bucket, logs, highs)
            report.items = [it for it in items if it.partition in set(held)]
            await _resolve(target, report, logs, n, apply, wait, on_notice, compression)

        asyncio.run(go())
        return report


# -- from a replay store ---------------------------------------------------------------------


def salvage_store(
    db_path: Path,
    target: SourceUri,
    *,
    apply: bool = False,
    partitions: list[int] | None = None,
    wait: float = 120.0,
    on_notice: Callable[[str], None] | None = None,
    compression: WireCompression = "auto",
) -> SalvageReport:
    """Lost writes a replay store holds (its rollbacks' `lost_writes`, and its documents
    above the rollback point the master would give it now); (apply) write back the safe
    ones and mark them salvaged in the store."""
    from upr_cli.store import Store

    report = SalvageReport(f"sqlite:{db_path}", target.redacted(), not apply)
    with Store(db_path, create=False) as store:
        positions = store.positions()
        wanted = sorted(positions if partitions is None else set(positions) & set(partitions))

        async def go() -> None:
            logs, highs, n = await _master_logs(target, wanted)
            items: list[LostItem] = []
            for w in store.lost_writes(wanted):
                d = w.document
                item = LostItem(d.partition, bytes(d.key), w.rolled_back_to, Version.of(d),
                                "store rollback", store_ids=[w.id],
                                collection=d.collection)  # fmt: skip
                items.append(item)
            for p in wanted:
                if p not in logs:
                    continue
                r = rollback_cut(logs[p], highs.get(p, 0), positions[p])
                if r is None:
                    continue
                for d in store.documents_above(p, r):
                    items.append(LostItem(p, bytes(d.key), r, Version.of(d), "store vs master",
                                          collection=d.collection))  # fmt: skip
            names = {cid: CollectionPath(c.scope or "?", c.name)
                     for cid, c in store.collections().items()}  # fmt: skip
            report.items = _named(_newest(items), names)
            await _resolve(target, report, logs, n, apply, wait, on_notice, compression)

        asyncio.run(go())
        if apply:
            store.mark_salvaged(
                i
                for it in report.items
                if it.outcome in ("written", "already-gone", "already-there")
                for i in it.store_ids
            )
    return report


# -- from a replica node's data directory ------------------------------------------------


def salvage_node_data(
    data_dir: Path, target: SourceUri, *, bucket: str = "default", apply: bool = False,
    partitions: list[int] | None = None, wait: float = 120.0,
    on_notice: Callable[[str], None] | None = None, compression: WireCompression = "auto",
) -> SalvageReport:  # fmt: skip
    """Lost writes a replica node's rollbacks kept (its `lost_writes` table, read from
    its data directory; the node may be running): the UPR design specification, "Replica C
    repairs master and rolls back to common snapshot sequence"."""
    if not (data_dir / f"{bucket}.sqlite3").exists():
        raise UsageError(f"--node-data {data_dir}: no node database for bucket {bucket!r}")
    report = SalvageReport(f"node-data:{data_dir}", target.redacted(), not apply)
    lost = read_lost_writes(data_dir, bucket)
    want = None if partitions is None else set(partitions)
    items = []
    for cut, d in lost:
        # node keys are qualified (upr_cli/node_files.py); system event rows are no
        # document's write
        if (want is not None and d.vbucket not in want) or is_system_key(d.key):
            continue
        cid, key = leb128.split_key(d.key)
        items.append(LostItem(d.vbucket, bytes(key), cut, node_version(d), "replica rollback",
                              collection=cid))  # fmt: skip

    async def go() -> None:
        logs, _highs, n = await _master_logs(target, sorted({it.partition for it in items}))
        report.items = _newest(items)
        await _resolve(target, report, logs, n, apply, wait, on_notice, compression)

    asyncio.run(go())
    return report


def check_target(to: str | None) -> SourceUri:
    """The --into URI (the current master), required."""
    if not to:
        raise UsageError("--into upr://… (the current master) is required")
    try:
        return SourceUri.parse(to)
    except UprError:
        raise
    except ValueError as exc:
        raise UsageError(f"--into: {exc}") from None


__all__ = [
    "LostItem",
    "SalvageReport",
    "Version",
    "check_target",
    "salvage_node_data",
    "salvage_repo",
    "salvage_store",
]
