"""Generated backup chains for the retention tests: updates, deletes, rollbacks (with
and without a new branch), cut-backs, full backups in the middle and a collection
dropped between two backups, written as real segment files and manifests.

A chain is described by a list of `Step`s (hypothesis draws them); `build` writes it.
Each partition follows its own model source: a seq counter and a branch (uuid) that a
rollback moves to a new uuid, entered in the failover log at the rollback seq.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.repo.repo_helpers import BUCKET, T0
from upr_cli.collections import CollectionsManifest
from upr_cli.collections import Path as CPath
from upr_cli.failover import FailoverLog
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import (
    BackupId,
    CutBack,
    Manifest,
    PartitionEntry,
    Repository,
    RollbackRecord,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.repo.manifest import CollectionCount
from upr_cli.segments import SegmentHeader, SegmentWriter
from upr_cli.store import Store

PARTITIONS = (0, 1, 2)
KEYS = 12
APP = CollectionsManifest().with_scope("app").with_collection("app", "users")
USERS = 9  # the collection id APP gives app.users
DROPPED = APP.without(CPath("app", "users"))


@dataclass(frozen=True)
class Step:
    """One backup: `kind` is "inc", "full" or "drop" (an incremental after which
    app.users is dropped); per partition a number of writes (0: not held), a rollback
    depth and a cut-back flag."""

    kind: str
    writes: tuple[int, ...]
    rollback: tuple[int, ...]  # 0: none; else how far below the previous end
    cut_back: tuple[bool, ...]
    seed: int


@dataclass
class _Part:
    """The model source of one partition: its history on the current branch."""

    hist: list[DcpRecord] = field(default_factory=list)
    seq: int = 0  # the high seqno
    uuid: int = 0
    log: list[tuple[int, int]] = field(default_factory=list)

    def branch(self, uuid: int, at: int) -> None:
        """A failover to a replica that has the history up to `at`: the rest is gone."""
        self.hist = [r for r in self.hist if r.by_seqno <= at]
        self.seq = at
        self.uuid = uuid
        self.log = [(uuid, at), *[e for e in self.log if e[1] <= at]][:64]

    def write(self, n: int, rnd: random.Random, p: int, dropped: bool) -> list[DcpRecord]:
        rows = _rows(p, self.seq + 1, n, rnd, dropped)
        self.hist += rows
        self.seq += n
        return rows

    def state(self, dropped: bool) -> list[DcpRecord]:
        """What a stream from 0 sends: the latest record of each document, by seq."""
        latest: dict[tuple[int, bytes], DcpRecord] = {}
        for r in self.hist:
            if not (dropped and r.collection == USERS):
                latest[r.collection, bytes(r.key)] = r
        return sorted(latest.values(), key=lambda r: r.by_seqno)


def _rows(p: int, first: int, n: int, rnd: random.Random, dropped: bool) -> list[DcpRecord]:
    out = []
    for seq in range(first, first + n):
        key = f"k{rnd.randrange(KEYS)}".encode()
        coll = 0 if dropped or rnd.random() < 0.6 else USERS
        if rnd.random() < 0.25:
            out.append(
                DcpRecord(
                    OP_DELETION, p, seq, seq, seq * 1000 + p, 0, 0, 1700000000, 0, key, b"", 0, coll
                )
            )
        else:
            value = b'{"v":%d,"p":%d}' % (seq, p)
            out.append(
                DcpRecord(
                    OP_MUTATION,
                    p,
                    seq,
                    seq,
                    seq * 1000 + p,
                    rnd.randrange(4),
                    rnd.choice((0, 0, 1800000000)),
                    0,
                    1,
                    key,
                    value,
                    0,
                    coll,
                )
            )
    return out


def _segment(
    d: Path, p: int, log: FailoverLog, start: int, rows: list[DcpRecord], sub: str = ""
) -> SegmentEntry:
    high = rows[-1].by_seqno
    hdr = SegmentHeader(
        BUCKET,
        p,
        log,
        start,
        high,
        ((start, high),),
        "2026-11-26T00:00:00.000000Z",
        "upr://h/default",
        256,
    )
    target = d / sub if sub else d
    target.mkdir(exist_ok=True)
    w = SegmentWriter(target / f"p{p}.open", hdr)
    w.add(rows)
    name = format_segment_name(p, rows[0].by_seqno, high)
    i = w.finish(path=target / name)
    return SegmentEntry(name, i.first_seq, i.last_seq, i.records, i.bytes, i.checksum)


def build(repo: Repository, steps: list[Step]) -> list[Manifest]:
    """Write the chain; returns its manifests, oldest first."""
    repo.init()
    parts = {p: _Part() for p in PARTITIONS}
    uuids = iter(range(0x1000, 0x100000, 0x11))
    out: list[Manifest] = []
    dropped = False
    for n, st in enumerate(steps):
        rnd = random.Random(st.seed)
        b = BackupId(T0 + timedelta(hours=n))
        parent = out[-1].backup_id if out else None
        full = parent is None or st.kind == "full"
        d = repo.new_backup_dir(BUCKET, b)
        entries = []
        counts: dict[int, list[int]] = {}  # collection id -> [mutations, deletions]
        for i, p in enumerate(PARTITIONS):
            writes = st.writes[i]
            part = parts[p]
            if writes == 0 and not full and part.log:
                continue
            if not part.log:
                part.uuid = next(uuids)
                part.log = [(part.uuid, 0)]
            prev_end = part.seq
            start = 0 if full or not out or all(m.partition(p) is None for m in out) else prev_end
            rollback = None
            if start and st.rollback[i]:  # the source failed over: a new branch
                branch = max(0, prev_end - st.rollback[i])
                part.branch(next(uuids), branch)
                start = branch
                rollback = RollbackRecord(prev_end, start, branch, branch)
            cut_backs: list[CutBack] = []
            if st.cut_back[i]:  # streamed, then taken back by a failover in mid-run
                lost_rows = part.write(3, rnd, p, dropped)
                seg = _segment(d, p, FailoverLog.of(part.log), start, lost_rows, sub="cut-1")
                cut_backs.append(CutBack(lost_rows[-1].by_seqno, start, (seg,)))
                part.branch(next(uuids), start)
            rows = part.state(dropped) if start == 0 else []
            rows += part.write(writes, rnd, p, dropped)
            log = FailoverLog.of(part.log)
            segs = (_segment(d, p, log, start, rows),) if rows else ()
            for r in rows:
                counts.setdefault(r.collection, [0, 0])[r.opcode != OP_MUTATION] += 1
            end = part.seq
            entries.append(
                PartitionEntry(
                    p, part.uuid, log, start, end, end, end, segs, rollback, tuple(cut_backs)
                )
            )
        coll = DROPPED if dropped else APP
        m = Manifest(
            b,
            BUCKET,
            "upr://h/default",
            b.time,
            b.time + timedelta(seconds=1),
            full,
            None if full else parent,
            tuple(entries),
            Totals.derive(entries, 1),
            collections=coll,
            collection_items=tuple(CollectionCount(c, *n) for c, n in sorted(counts.items())),
        )
        repo.write_manifest(m)
        out.append(m)
        if st.kind == "drop":
            dropped = True
    return out


def restored(repo_dir: Path, at: BackupId, db: Path) -> dict[Any, tuple[Any, ...]]:
    """What `upr restore --at` writes into a SQLite store, key for key."""
    from upr_cli.jobs.restore import restore_to_store

    restore_to_store(repo_dir, db, at=str(at))
    return stored(db)


def stored(db: Path) -> dict[Any, tuple[Any, ...]]:
    """A SQLite store key for key: (partition, collection, key) → fields."""
    with Store(db, create=False) as s:
        return {
            (d.partition, d.collection, d.key): (
                d.seq,
                d.deleted,
                d.value,
                d.cas,
                d.rev_seq,
                d.flags,
                d.expiry,
                d.datatype,
                d.xattrs,
            )
            for d in s.documents(include_deleted=True)
        }
