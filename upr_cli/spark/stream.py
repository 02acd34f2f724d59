"""The streaming side of the `upr` data source: offsets, planning, reading (formats/spark.md §5).

Theory of operation (formats/spark.md §5; docs/protocol.md §4)
--------------------------------------------------------------
* **Offsets** are JSON: `{"v": 1, "vbs": {"<p>": {"uuid", "seq", "snap_start",
  "snap_end"}}}` with every 64-bit value a decimal string. `latestOffset` is one cheap
  probe on the driver, STAT `vbucket-seqno` (each partition's high seq and current
  uuid); while the source is unreachable it returns the last offset it knew, so the
  query idles instead of failing.
* **Planning** (`partitions(start, end)`, on the driver): a partition whose seq moved is
  planned as the range (start, end]. When the start is no longer on the source's history
  (a failover or an unclean restart), the producer rule (docs/protocol.md §4.2) against the
  source's failover log says roll back: the range becomes (0, end] and its first row is
  a **rollback marker** (`op` = `rollback`, `seq` = 0), telling a consumer to undo what
  it holds in that partition (a rollback lands on a snapshot boundary, and the only one
  an offset is known to be is 0: formats/spark.md §5).
* **Reading** (`read`, on an executor) opens its own DCP connection and streams exactly
  the planned ranges, ending each at its planned seq (capped at what the source holds).
  A ROLLBACK met while reading (the source failed over after planning) fails the task
  with `StreamRolledBack`; the next plan resumes from the rollback point with a marker.
* **Collections**: every row names its scope and collection. Each task's consumer reads
  the source's manifest when it opens and follows the collections created on the
  stream, so a collection created inside the range is named too. The `collections`
  option filters on the source (the stream request's filter): the other collections'
  items never cross the wire, SEQNO_ADVANCED moves the stream past them. Offsets stay
  the partitions' seqs: a filter does not change what a position means.
* **Delivery**: at-least-once per row; a row can repeat after a rollback or a retried
  batch, and DCP deduplication can replace a version superseded after planning by its
  newer one (in a later batch). Applying rows in order per partition, honouring
  rollback markers, converges to the source's state (per-key exactly-once state).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from upr_cli.collections import (
    CollectionsError,
    CollectionsManifest,
    ManifestChange,
    Path,
    apply_change,
    parse_paths,
)
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.dcp.events import Event, Rollback
from upr_cli.dcp.filter import resolve_filter
from upr_cli.dcp.sink import SinkBase, drive
from upr_cli.dcp.states import partition_states
from upr_cli.errors import UprError, UsageError
from upr_cli.failover import FailoverLog, needs_rollback
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition, boundary_at
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.spark.arrow import (
    OPS,
    XATTRS_COLUMN,
    Buffer,
    Columns,
    ddl_of,
    i64,
    json_of_xattrs,
    schema_of,
    text,
)
from upr_cli.spark.plan import SparkOptionError, get_option

BATCH_ROWS = 65_536

STREAM_COLUMNS: Columns = [
    ("partition", pa.int32(), False),
    ("scope", pa.string(), True),
    ("collection", pa.string(), True),
    ("collection_id", pa.int64(), True),
    ("op", pa.string(), False),
    ("key", pa.binary(), True),
    ("id", pa.string(), True),
    ("seq", pa.int64(), False),
    ("rev_seq", pa.int64(), True),
    ("cas", pa.int64(), True),
    ("flags", pa.int64(), True),
    ("expiry", pa.int64(), True),
    ("datatype", pa.int32(), True),
    ("deleted", pa.bool_(), False),
    ("value", pa.binary(), True),
    ("json", pa.string(), True),
    ("uuid", pa.string(), False),
    XATTRS_COLUMN,  # last (version 3), NULL in a marker
]


class StreamRolledBack(UprError):
    """The source rolled a partition back while a task read it; the next plan resumes."""


def stream_schema() -> pa.Schema:
    """The Arrow schema of streamed rows."""
    return schema_of(STREAM_COLUMNS)


def stream_ddl() -> str:
    """The Spark DDL of streamed rows."""
    return ddl_of(STREAM_COLUMNS)


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """The parsed options of a streaming read."""

    source: str  # upr://… with credentials (never printed: `redacted`)
    partitions: tuple[int, ...] | None
    starting: str  # earliest | latest
    collections: tuple[Path, ...] = ()  # filtered on the source (none: every collection)

    @property
    def uri(self) -> SourceUri:
        """The source URI."""
        return SourceUri.parse(self.source)


def parse_stream_options(options: Mapping[str, str]) -> StreamOptions:
    """Check a streaming read's options; a `SparkOptionError` names the bad one."""
    from upr_cli.source import parse_partitions

    src = get_option(options, "source") or get_option(options, "path")
    if not src or not src.startswith(("upr://", "couchbase://")):
        raise SparkOptionError(
            "option source: give a live source, upr://[user[:password]@]host/bucket"
        )
    try:
        SourceUri.parse(src)
    except (UprError, ValueError) as exc:
        raise SparkOptionError(f"option source: {exc}") from None
    spec = get_option(options, "partitions")
    parts = None
    if spec:
        try:
            parts = tuple(parse_partitions(spec))
        except UprError as exc:
            raise SparkOptionError(f"option partitions: {exc}") from None
    starting = (get_option(options, "startingOffsets") or "earliest").lower()
    if starting not in ("earliest", "latest"):
        raise SparkOptionError(f"option startingOffsets: {starting!r} is not earliest or latest")
    try:
        paths = tuple(parse_paths(get_option(options, "collections")))
    except UprError as exc:
        raise SparkOptionError(f"option collections: {exc}") from None
    return StreamOptions(src, parts, starting, paths)


async def check_collections(uri: SourceUri, paths: tuple[Path, ...]) -> None:
    """On the driver, before any task: every path names something the source has (the
    tasks' consumers would refuse it too, later and once per task)."""
    from upr_cli.net.collections_manifest import fetch_collections_manifest

    try:
        resolve_filter(list(paths), await fetch_collections_manifest(uri))
    except CollectionsError as exc:
        raise SparkOptionError(f"option collections: {exc}") from None


# -- offsets ------------------------------------------------------------------------------


def to_offset(positions: Mapping[int, StreamPosition]) -> dict[str, Any]:
    """Positions as an offset (64-bit values as decimal strings)."""
    return {"v": 1, "vbs": {str(p): {"uuid": str(s.uuid), "seq": str(s.seq),
                                     "snap_start": str(s.snap_start), "snap_end": str(s.snap_end)}
                            for p, s in sorted(positions.items())}}  # fmt: skip


def from_offset(offset: Mapping[str, Any]) -> dict[int, StreamPosition]:
    """An offset back into positions; anything malformed is a UsageError."""
    try:
        if offset.get("v") != 1:
            raise ValueError(f"version {offset.get('v')!r}")
        return {int(p): StreamPosition(int(p), int(o["uuid"]), int(o["seq"]),
                                       int(o["snap_start"]), int(o["snap_end"]))
                for p, o in offset["vbs"].items()}  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"malformed upr stream offset: {exc}") from None


async def probe(uri: SourceUri, partitions: tuple[int, ...] | None) -> dict[int, tuple[int, int]]:
    """{partition: (uuid, high seq)} from STAT vbucket-seqno of each partition's active node
    (one request per node; a node that does not answer fails the probe at once)."""
    states, _n = await partition_states(
        uri, list(partitions) if partitions is not None else None, failover_logs=False,
        name="upr-spark-probe", wait_for=0.0,
    )  # fmt: skip
    return {p: (st.uuid, st.high_seq) for p, st in states.items()}


# -- planning -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Range:
    """Stream partition `partition` from `start` to seq `end`; `rollback_to` set when the
    start was no longer on the source's history (a marker row comes first)."""

    partition: int
    start: StreamPosition
    end: int
    rollback_to: int | None = None


async def plan_ranges(uri: SourceUri, start: Mapping[int, StreamPosition],
                      end: Mapping[int, StreamPosition]) -> list[Range]:  # fmt: skip
    """The ranges of a micro-batch, rollbacks by the producer rule (docs/protocol.md §4.2)."""
    moved = [p for p, e in end.items() if start.get(p, StreamPosition(p)) != e]
    if not moved:
        return []
    current = await probe(uri, tuple(moved))
    suspect = [p for p in moved if start.get(p, StreamPosition(p)).seq > 0
               and start[p].uuid != current[p][0]]  # fmt: skip
    logs: dict[int, FailoverLog] = {}
    if suspect:
        states, _n = await partition_states(uri, suspect, failover_logs=True,
                                            name="upr-spark-plan")  # fmt: skip
        logs = {p: st.failover_log for p, st in states.items() if st.failover_log is not None}
    out = []
    for p in moved:
        s = start.get(p, StreamPosition(p))
        rollback = None
        if p in logs:
            d = needs_rollback(logs[p], s, high=current[p][1])
            if d.rollback:
                # A rollback must land on a snapshot boundary the rows' consumer reached
                # (docs/design.md, "Snapshot boundaries"). An offset is not one (a
                # stream reads a little past it, and deduplication replaces versions
                # across it), so the only boundary known here is 0: the marker resets
                # the partition, and the range reads it whole on the new branch.
                r = boundary_at((), d.rollback_seq)
                entry = logs[p].entry_at(r)
                s = StreamPosition(p, entry.uuid if entry else 0, r, r, r)
                rollback = r
        if end[p].seq > s.seq or rollback is not None:
            out.append(Range(p, s, end[p].seq, rollback))
    return out


# -- reading ----------------------------------------------------------------------------------


def read_ranges(source: str, ranges: list[Range],
                collections: tuple[Path, ...] = ()) -> Iterator[pa.RecordBatch]:  # fmt: skip
    """In a task: stream the ranges and yield Arrow batches (markers first)."""
    buf = Buffer(stream_schema())
    for r in ranges:
        if r.rollback_to is not None:
            buf.add([r.partition, None, None, None, "rollback", None, None, r.rollback_to,
                     None, None, None, None, None, False, None, None, str(r.start.uuid),
                     None])  # fmt: skip
    rows = asyncio.run(_stream(SourceUri.parse(source), ranges, collections))
    for rec, uuid, (scope, coll) in rows:
        op, dtype = rec.opcode, rec.datatype
        key, value = bytes(rec.key), bytes(rec.value)  # already bytes: no copy
        js = text(value) if dtype & 7 == 1 else None
        (xa,) = json_of_xattrs([rec.xattrs], [key])
        buf.add([rec.vbucket, scope, coll, rec.collection, OPS.get(op, f"0x{op:02x}"), key,
                 text(key), rec.by_seqno, i64(rec.rev_seqno), i64(rec.cas), rec.flags,
                 rec.expiration, dtype, op != OP_MUTATION, value, js, uuid, xa])  # fmt: skip
        if len(buf) >= BATCH_ROWS:
            yield buf.take()
    if len(buf):
        yield buf.take()


Name = tuple[str | None, str | None]  # (scope, collection); None: an id without a name
Row = tuple[DcpRecord, str, Name]  # a record, the uuid of its seq's branch, its names


class _RangeSink(SinkBase):
    """Keeps every record of the planned ranges with the branch uuid of its seq and its
    collection's names; a rollback met while reading fails the task (module docstring,
    "Reading")."""

    def __init__(self, consumer: DcpConsumer) -> None:
        self.consumer = consumer
        self.rows: list[Row] = []
        self.manifest: CollectionsManifest | None = None  # the source's at open, then as changed
        self.names: dict[int, Name] = {}

    def _follow(self, manifest: CollectionsManifest) -> None:
        self.manifest = manifest
        for scope, coll in manifest.collections():  # a dropped id keeps its name
            self.names.setdefault(coll.id, (scope.name, coll.name))

    async def records(self, records: list[DcpRecord]) -> None:
        if self.manifest is None:  # None at open: a source without collections
            self._follow(self.consumer.manifest or CollectionsManifest())
        parts, names = self.consumer.parts, self.names
        for rec in records:
            part = parts[rec.vbucket]
            entry = part.log.entry_at(rec.by_seqno)  # the seq's branch
            uuid = str(entry.uuid if entry else part.uuid)
            # key and value copied: the Arrow batch outlives the received buffer
            self.rows.append((rec._replace(key=bytes(rec.key), value=bytes(rec.value),
                                           xattrs=bytes(rec.xattrs)), uuid,
                              names.get(rec.collection, (None, None))))  # fmt: skip

    async def event(self, event: Event) -> None:
        if isinstance(event, ManifestChange):  # a collection created in the range is named
            known = self.manifest or self.consumer.manifest or CollectionsManifest()
            self._follow(apply_change(known, event))
        if isinstance(event, Rollback):
            raise StreamRolledBack(
                f"partition {event.partition}: the source rolled back to seq {event.to_seq} "
                "while this task read it; the next micro-batch resumes from there"
            )

    async def batch_done(self) -> bool:
        self.consumer.commit()
        return False


async def _stream(uri: SourceUri, ranges: list[Range],
                  collections: tuple[Path, ...] = ()) -> list[Row]:  # fmt: skip
    """Every record of the ranges (key and value as bytes) with its branch uuid and names."""
    positions = {r.partition: r.start for r in ranges}
    consumer = DcpConsumer(uri, partitions=sorted(positions), positions=positions,
                           end_seqs={r.partition: r.end for r in ranges},
                           name="upr-spark-read",
                           collections=list(collections) or None)  # fmt: skip
    sink = _RangeSink(consumer)
    try:
        await consumer.open()
        await drive(consumer, sink)
    finally:
        await consumer.aclose()
    return sink.rows
