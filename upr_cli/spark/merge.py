"""`upr spark merge`: one full backup equal to the chain's state through a backup.

Theory of operation (formats/repository.md §8; docs/design.md "Data flows" (6. Spark)).
The driver takes the bucket's lock, picks a new backup id and directory, and plans the
state at B from the manifests (`plan.plan`, view `state`: whole partitions per task,
balanced by bytes). Each Spark task reads its partitions' pieces (checksums verified),
keeps the latest record of every document, (collection, key) being its identity,
tombstones included (a restore of the merge must delete what the chain's state
deletes), leaves out the collections dropped by B and the system events (the merge
starts from the collections at B, which its manifest records), and writes one ordinary
segment per partition into the new backup's directory, fsynced, on storage every
executor shares; it returns
the segments' infos. Only after every task succeeded does the driver write the manifest
(the commit point, repository.md): full, no parent, each partition's uuid, failover log
and last snapshot taken from the chain's resume point at B. A failed or interrupted
merge leaves an uncommitted directory that the next backup or merge sweeps.

Through the newest backup, the merge is simply the newest backup. Through an older one
B it sorts right after B (B's id plus one microsecond) and records `merged_through: B`:
the backups after B continue from it as they did from B (formats/repository.md §8.9),
so the chain's state at every later backup is unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from upr_cli.errors import UsageError
from upr_cli.failover import FailoverLog
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.repo import (
    BackupId,
    Manifest,
    PartitionEntry,
    Repository,
    RepositoryLock,
    SegmentEntry,
    Totals,
    format_segment_name,
    resume_point,
)
from upr_cli.repo.manifest import CollectionCount, chain_manifest
from upr_cli.repo.readers import sweep_unless_read
from upr_cli.segments import Record, SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.spark.batch import wanted
from upr_cli.spark.plan import Group, parse_options, plan


@dataclass(frozen=True, slots=True)
class PartitionSpec:
    """What a task needs to write one partition's merged segment (small, picklable)."""

    partition: int
    failover_log: list[dict[str, str]]  # FailoverLog.to_json()
    end_seq: int
    snapshot: tuple[int, int]


@dataclass
class MergeSummary:
    """What `upr spark merge` committed."""

    backup_id: str
    through: str
    merged: int  # backups the state was read from
    partitions: int
    records: int
    bytes_written: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """JSON form (docs/output.md §4: the records written are `items`)."""
        return {"backup_id": self.backup_id, "through": self.through, "merged": self.merged,
                "partitions": self.partitions, "items": self.records,
                "bytes_written": self.bytes_written,
                "seconds": round(self.seconds, 3)}  # fmt: skip


def _state_records(group: Group, partition: int) -> list[Record]:
    """The latest record of every document of one partition (tombstones kept), by seq."""
    latest: dict[tuple[int, bytes], Record] = {}
    for piece in group.pieces:
        if piece.partition != partition:
            continue
        with SegmentReader(piece.path) as reader:
            for rec in reader.records():
                if rec.seq > piece.max_seq:
                    break
                if wanted(rec, group.keep):
                    latest[rec.collection, bytes(rec.key)] = rec
    return sorted(latest.values(), key=lambda r: r.seq)


def write_group(group: Group, specs: dict[int, PartitionSpec], bucket: str, directory: str,
                source: str) -> list[dict[str, Any]]:  # fmt: skip
    """In a task: one merged segment per partition of the group; their infos."""
    out = []
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    for p in sorted({piece.partition for piece in group.pieces}):
        spec = specs[p]
        records = _state_records(group, p)
        if not records:
            continue
        header = SegmentHeader(bucket, p, FailoverLog.from_json(spec.failover_log), 0,
                               spec.end_seq, (spec.snapshot,), created, source)  # fmt: skip
        writer = SegmentWriter(Path(directory) / f"p{p:04x}.open", header)
        try:
            writer.add(rec.as_dcp(p) for rec in records)
            name = format_segment_name(p, records[0].seq, records[-1].seq)
            info = writer.finish(path=Path(directory) / name, sync=True)
        except BaseException:
            writer.abort()
            raise
        per: dict[int, list[int]] = {}  # collection id -> [mutations, deletions]
        for rec in records:
            per.setdefault(rec.collection, [0, 0])[rec.op != OP_MUTATION] += 1
        out.append({"partition": p, "file": name, "first_seq": info.first_seq,
                    "last_seq": info.last_seq, "records": info.records, "bytes": info.bytes,
                    "checksum": info.checksum, "raw_bytes": info.raw_bytes,
                    "collections": per})  # fmt: skip
    return out


def merge(spark: Any, repo_dir: Path, *, through: str = "latest",
          bucket: str | None = None) -> MergeSummary:  # fmt: skip
    """Write and commit the merged full backup; returns its summary."""
    from upr_cli.spark.jobs import spark_error

    t0 = time.monotonic()
    opts, manifests = parse_options(
        {"path": str(repo_dir), "at": through} | ({"bucket": bucket} if bucket else {})
    )
    repo = Repository(opts.repo)
    with RepositoryLock(repo, opts.bucket) as lock:
        manifests = [m for m in repo.manifests(opts.bucket) if str(m.backup_id) <= opts.at]
        b_id = manifests[-1].backup_id
        if str(b_id) != opts.at:
            raise UsageError(f"--through: backup {opts.at} is no longer committed")
        newest = repo.committed(opts.bucket)[-1]
        after: BackupId | None = None
        if b_id == newest:
            backup_id = repo.next_backup_id(opts.bucket)
        else:  # right after B, before the backups continuing from B (formats/repository.md §8.9)
            backup_id = BackupId(b_id.time + timedelta(microseconds=1))
            after = b_id
        sweep_unless_read(repo, opts.bucket, backup_id, lock)  # not under a reader
        directory = repo.new_backup_dir(opts.bucket, backup_id, after=after)
        specs: dict[int, PartitionSpec] = {}
        for p in opts.partitions:
            rp = resume_point(manifests, p)
            if rp is not None:
                pos = rp.position
                specs[p] = PartitionSpec(p, rp.failover_log.to_json(), pos.seq,
                                         (pos.snap_start, pos.snap_end))  # fmt: skip
        groups = plan(opts, manifests)
        source = f"merge of {manifests[0].backup_id}..{opts.at}"
        args = (specs, opts.bucket, str(directory), source)
        try:
            rdd = spark.sparkContext.parallelize(groups, max(1, len(groups)))
            infos = rdd.flatMap(lambda g: write_group(g, *args)).collect()
        except Exception as exc:  # noqa: BLE001 - Spark wraps everything; report one line
            raise spark_error(exc) from None
        by_p = {i["partition"]: i for i in infos}
        entries = []
        for p, spec in sorted(specs.items()):
            i = by_p.get(p)
            segs = () if i is None else (
                SegmentEntry(i["file"], i["first_seq"], i["last_seq"], i["records"], i["bytes"],
                             i["checksum"]),
            )  # fmt: skip
            log = FailoverLog.from_json(spec.failover_log)
            entries.append(PartitionEntry(p, log.latest.uuid if log.entries else 0, log, 0,
                                          spec.end_seq, *spec.snapshot, segs))  # fmt: skip
        per: dict[int, list[int]] = {}
        for i in infos:
            for cid, (items, deleted) in i["collections"].items():
                got = per.setdefault(cid, [0, 0])
                got[0], got[1] = got[0] + items, got[1] + deleted
        counts = tuple(CollectionCount(cid, *n) for cid, n in sorted(per.items()))
        now = datetime.now(UTC)
        manifest = Manifest(
            backup_id=backup_id, bucket=opts.bucket, source=source, started=now, finished=now,
            full=True, parent=None, partitions=tuple(entries),
            totals=Totals.derive(entries, sum(i["raw_bytes"] for i in infos)),
            merged_through=after, collections=chain_manifest(manifests),
            collection_items=counts,
        )  # fmt: skip
        repo.write_manifest(manifest)
    return MergeSummary(str(backup_id), opts.at, len(manifests), len(entries),
                        sum(i["records"] for i in infos), manifest.totals.bytes_written,
                        time.monotonic() - t0)  # fmt: skip
