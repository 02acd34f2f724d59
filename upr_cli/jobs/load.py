"""`upr load`: a reproducible, pipelined workload of JSON documents through the KV front end.

Each of `docs` operations creates a new document, or (by the given ratios) updates or
deletes an existing one; the same seed gives the same operations. Up to `window`
requests, and a quarter of `memory` in their keys and values, are in flight in the
write window `upr restore` shares (jobs/writer.py: a write the node refuses as
ETMPFAIL, its write queue full, goes again after a pause); each goes to its
partition's active node (net/router.py).

A new document is written with ADD, so a key an earlier run left in the bucket is
noticed (KEY_EEXISTS): it is counted as overwritten and written again with SET, unless
a later operation of this run already updated or deleted it (that one, sent after the
ADD on the same connection, is then the key's newest write and must stay so).

Collections (docs/protocol.md "Collections"). The connections offer Collections in
HELLO; where the server grants it, every key goes out as LEB128(collection id) + key
(`leb128.join_key`), the default collection's being 0. With `collections`, the paths
are resolved to ids from the manifest (GET_COLLECTIONS_MANIFEST) before anything is
written, so an unknown one fails the run with nothing written. New documents go to the
collections round robin (new key n to collection n mod k, in the order given), and an
update or delete goes to the collection of the document it picks: the spread is exact
and the same seed gives the same workload. The partition is the CRC32 of the document
key alone, without the id, as the SDKs hash it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from upr_cli.collections import DEFAULT, CollectionsError, CollectionsManifest, Path
from upr_cli.errors import UsageError
from upr_cli.jobs.writer import DEFAULT_LIMIT, FollowUp, WriteWindow
from upr_cli.memory import ByteWindow, MemoryLimit
from upr_cli.net.bootstrap import partition_of
from upr_cli.net.collections_manifest import manifest_from_answer
from upr_cli.net.router import Make, Router
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Frame, leb128, subdoc
from upr_cli.protocol.fast import encode_set
from upr_cli.protocol.header import DATATYPE_JSON, Feature, Opcode
from upr_cli.protocol.messages import CollectionsGetManifest, Delete
from upr_cli.protocol.status import Status, StatusError, status_error
from upr_cli.protocol.subdoc import Spec

WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
)


#: a new document's (wire key, value), while its ADD is in flight
Added = tuple[bytes, bytes] | None


@dataclass
class CollectionCounts:
    """What a load run did in one collection."""

    path: Path
    id: int
    created: int = 0
    updates: int = 0
    deletes: int = 0

    def to_json(self) -> dict[str, object]:
        """One entry of the summary's `collections`."""
        return {"scope": self.path.scope, "collection": self.path.collection,
                "collection_id": self.id, "items": self.created + self.updates + self.deletes,
                "created": self.created, "updates": self.updates,
                "deletes": self.deletes}  # fmt: skip


def _default_counts() -> list[CollectionCounts]:
    return [CollectionCounts(Path(DEFAULT, DEFAULT), 0)]


@dataclass
class LoadSummary:
    """What a load run did."""

    ops: int = 0
    sets: int = 0  # new documents of this run
    updates: int = 0
    deletes: int = 0
    overwritten: int = 0  # new documents whose key an earlier run had left in the bucket
    errors: int = 0
    seconds: float = 0.0
    bytes: int = 0  # the keys and values of the operations sent
    retries: int = 0  # requests sent again after NOT_MY_VBUCKET, ETMPFAIL or a lost node
    error_statuses: dict[int, int] = field(default_factory=dict)
    collections: list[CollectionCounts] = field(default_factory=_default_counts)

    @property
    def rate(self) -> float:
        """Operations per second."""
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """A JSON object for --json (docs/output.md: `items` the operations)."""
        return {
            "items": self.ops,
            "created": self.sets,
            "updates": self.updates,
            "deletes": self.deletes,
            "overwritten": self.overwritten,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
            "items_per_s": round(self.rate),
            "bytes": self.bytes,
            "retries": self.retries,
            "error_statuses": {f"0x{k:02x}": v for k, v in self.error_statuses.items()},
            "collections": [c.to_json() for c in self.collections],
        }


def make_doc(rng: random.Random, i: int, size: int) -> bytes:
    """A JSON document of about `size` bytes."""
    doc = {
        "id": i,
        "name": f"{rng.choice(WORDS)} {rng.choice(WORDS)}",
        "age": rng.randrange(18, 90),
        "tags": rng.sample(WORDS, 3),
        "score": round(rng.random() * 1000, 2),
        "pad": "",
    }
    raw = json.dumps(doc, separators=(",", ":"))
    pad = max(0, size - len(raw))
    return raw.replace('"pad":""', '"pad":"' + "x" * pad + '"').encode()


async def load(
    uri: SourceUri,
    *,
    docs: int,
    size: int = 180,
    update_ratio: float = 0.0,
    delete_ratio: float = 0.0,
    rate: float | None = None,
    seed: int = 1,
    window: int = 512,
    prefix: str = "doc",
    collections: list[Path] | None = None,
    with_xattrs: bool = False,
    on_progress: Callable[[LoadSummary], None] | None = None,
    memory: MemoryLimit = DEFAULT_LIMIT,
) -> LoadSummary:
    """Run the workload; returns its summary (errors are counted, not raised)."""
    if not 0 <= update_ratio <= 1 or not 0 <= delete_ratio <= 1 or update_ratio + delete_ratio > 1:
        raise UsageError("--update-ratio and --delete-ratio must be in [0, 1] and sum to at most 1")
    # Follow the cluster map: each write goes to its partition's active node, one
    # connection per node, retried with the newer map on NOT_MY_VBUCKET (net/router.py).
    router = await Router.open(uri, name="upr-load")
    try:
        n_parts = router.num_partitions
        if n_parts == 0:
            raise UsageError(f"{uri.redacted()}: the cluster config lists no partitions")
        if with_xattrs and not router.xattrs:
            raise UsageError(f"{uri.redacted()}: the server does not support xattrs (HELLO did "
                             "not grant XATTR); run without --xattrs")  # fmt: skip
        summary = LoadSummary(collections=await _targets(router, collections))
        # Where Collections was granted every key carries its id, the default's too.
        ids = Feature.COLLECTIONS in router.features
        prefixes = [leb128.encode(c.id) if ids else b"" for c in summary.collections]
        ops = _Operations(random.Random(seed), n_parts, size, update_ratio, delete_ratio,
                          prefix, prefixes)  # fmt: skip
        ops.xattrs = with_xattrs
        # the window is the run's one buffer: a quarter of the budget, as a document in
        # flight is held as generated, as encoded and in the socket's buffer
        await _run(router, ops, summary, docs, ByteWindow(memory.share(0.25), window), rate,
                   on_progress)  # fmt: skip
        summary.retries += router.retries
        return summary
    finally:
        await router.aclose()


async def _run(router: Router, ops: _Operations, summary: LoadSummary, docs: int,
               window: ByteWindow, rate: float | None,
               on_progress: Callable[[LoadSummary], None] | None) -> None:  # fmt: skip
    """Send the `docs` operations through the shared write window (jobs/writer.py) and
    settle every answer."""
    # wire keys whose ADD is in flight -> whether a later operation of this run used them
    adding: dict[bytes, bool] = {}
    started = time.monotonic()

    def settle(reply: Frame, vb: int, added: Added) -> FollowUp[Added] | None:
        status = reply.vbucket_or_status
        superseded = adding.pop(added[0], False) if added is not None else False
        if status == Status.KEY_EEXISTS and added is not None:
            summary.overwritten += 1
            if not superseded:  # write it as planned, after the ADD on the same connection
                return vb, functools.partial(_set, Opcode.SET, vb, *added), None
        elif status != Status.SUCCESS:
            summary.errors += 1
            summary.error_statuses[status] = summary.error_statuses.get(status, 0) + 1
        return None

    writer = WriteWindow(router, window, settle)
    try:
        for i in range(docs):
            kb, vb, make, added, nbytes = ops.next(i, summary)
            if kb in adding:
                adding[kb] = True
            if added is not None:
                adding[kb] = False
            await writer.send(vb, make, nbytes, added)
            summary.ops += 1
            summary.bytes += nbytes
            if rate:
                ahead = summary.ops / rate - (time.monotonic() - started)
                if ahead > 0.001:
                    writer.flush()
                    await asyncio.sleep(ahead)
            if on_progress is not None and i % 2048 == 0:
                summary.seconds = time.monotonic() - started
                on_progress(summary)
        await writer.drain()
    finally:
        writer.abandon()
        summary.retries += writer.resent
    summary.seconds = time.monotonic() - started


async def _targets(router: Router, paths: list[Path] | None) -> list[CollectionCounts]:
    """The collections to write to, resolved to ids before anything is written (a scope
    path: each of its collections, in manifest order)."""
    if not paths:
        return _default_counts()
    where = router.uri.redacted()
    if Feature.COLLECTIONS not in router.features:
        raise CollectionsError(
            f"{where}: the server does not support collections (HELLO did not grant them); "
            "run without --collections"
        )
    manifest = await _manifest(router)
    out: dict[int, CollectionCounts] = {}
    for path in paths:
        scope = manifest.scope(path.scope)
        found = [c for c in scope.collections if path.covers(scope.name, c.name)] if scope else []
        if not found:
            why = (f"scope {path.scope} does not exist" if scope is None
                   else f"collection {path} does not exist" if path.collection
                   else f"scope {path.scope} has no collections")  # fmt: skip
            raise CollectionsError(f"--collections: {why} in {where} (manifest uid "
                                   f"{manifest.uid:x}); nothing was written")  # fmt: skip
        for c in found:
            out.setdefault(c.id, CollectionCounts(Path(path.scope, c.name), c.id))
    return list(out.values())


async def _manifest(router: Router) -> CollectionsManifest:
    """The bucket's collections manifest (GET_COLLECTIONS_MANIFEST on a node of the map;
    every node holds the same one), read as every client reads it."""
    reply = await router.request(0, lambda opaque: CollectionsGetManifest(opaque=opaque).encode())
    status = reply.vbucket_or_status
    try:
        manifest = manifest_from_answer(status, bytes(reply.value))
        why = "" if manifest is not None else str(status_error(status))
    except StatusError as err:
        manifest, why = None, str(err)
    if manifest is None:
        raise CollectionsError(
            f"{router.uri.redacted()}: cannot read the collections manifest: {why}"
        )
    return manifest


class _Operations:
    """The workload's operations, one at a time, from the seeded generator: a delete or
    an update of a key this run created (by the ratios), else a new key, in the next
    collection round robin. The generator draws the same numbers whatever the
    collections, so a seed gives the same operations with or without them."""

    def __init__(self, rng: random.Random, n_parts: int, size: int, update_ratio: float,
                 delete_ratio: float, prefix: str, ids: list[bytes]) -> None:  # fmt: skip
        self.rng, self.n_parts, self.size, self.prefix = rng, n_parts, size, prefix
        self.update_ratio, self.delete_ratio = update_ratio, delete_ratio
        self.ids = ids  # each collection's LEB128 id, or b"" without Collections
        self.live: list[tuple[str, int]] = []  # (key, collection index)
        self.next_id = 0
        self.xattrs = False  # write through SUBDOC_MULTI_MUTATION with xattrs

    def next(self, i: int, summary: LoadSummary) -> tuple[bytes, int, Make, Added, int]:
        """Operation `i`: its wire key, partition, request, (a new document) what it
        adds, and its key and value bytes."""
        rng, live = self.rng, self.live
        r = rng.random()
        if live and r < self.delete_ratio:
            key, c = live.pop(rng.randrange(len(live)))
            kb = key.encode()
            vb = partition_of(kb, self.n_parts)
            summary.deletes += 1
            summary.collections[c].deletes += 1
            wire = self.ids[c] + kb
            return wire, vb, functools.partial(_delete, vb, wire), None, len(wire)
        op = Opcode.SET
        if live and r < self.delete_ratio + self.update_ratio:
            key, c = live[rng.randrange(len(live))]
            summary.updates += 1
            summary.collections[c].updates += 1
        else:
            key = f"{self.prefix}-{self.next_id:09d}"
            c = self.next_id % len(self.ids)
            self.next_id += 1
            live.append((key, c))
            summary.sets += 1
            summary.collections[c].created += 1
            op = Opcode.ADD
        kb = key.encode()
        vb = partition_of(kb, self.n_parts)  # the document key's partition, without the id
        wire = self.ids[c] + kb
        doc = make_doc(rng, i, self.size)
        added = (wire, doc) if op == Opcode.ADD else None
        write = _with_xattrs(i) if self.xattrs else _set
        return wire, vb, functools.partial(write, op, vb, wire, doc), added, len(wire) + len(doc)


def _set(opcode: int, vb: int, key: bytes, doc: bytes, opaque: int) -> bytes:
    return encode_set(opcode, vb, opaque, key, doc, datatype=DATATYPE_JSON)


def _with_xattrs(i: int) -> Callable[[int, int, bytes, bytes, int], bytes]:
    """A writer of operation `i` as one SUBDOC_MULTI_MUTATION (formats/subdoc.md): a
    system xattr `_sync` with the new CAS (a macro the node expands) and the operation,
    a user xattr `meta` with the operation, and the body, created (ADD) or replaced."""
    op = str(i).encode()
    specs = (
        Spec(subdoc.DICT_UPSERT, "_sync.cas", subdoc.CAS_MACRO, _SYNC | subdoc.EXPAND_MACROS),
        Spec(subdoc.DICT_UPSERT, "_sync.op", op, _SYNC),
        Spec(subdoc.DICT_UPSERT, "meta.op", op, _SYNC),
    )

    def write(opcode: int, vb: int, key: bytes, doc: bytes, opaque: int) -> bytes:
        flags = subdoc.ADD if opcode == Opcode.ADD else subdoc.MKDOC
        body = Spec(subdoc.SET_DOC, "", doc)
        return subdoc.multi_mutation(vb, opaque, key, (*specs, body), doc_flags=flags)

    return write


_SYNC = subdoc.XATTR_PATH | subdoc.MKDIR_P


def _delete(vb: int, key: bytes, opaque: int) -> bytes:
    return Delete(key=key, vbucket=vb, opaque=opaque).encode()
