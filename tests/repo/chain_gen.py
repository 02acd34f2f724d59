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
from upr_cli.segments import SegmentHeader, SegmentWriter
from upr_cli.store import Store

from tests.repo.repo_helpers import BUCKET, T0

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
    end: int = 0
    uuid: int = 0
    log: list[tuple[int, int]] = field(default_factory=list)


def _rows(p: int, first: int, n: int, rnd: random.Random, dropped: bool) -> list[DcpRecord]:
    out = []
    for seq in range(first, first + n):
        key = f"k{rnd.randrange(KEYS)}".encode()
        coll = 0 if dropped or rnd.random() < 0.6 else USERS
        if rnd.random() < 0.25:
            out.append(DcpRecord(OP_DELETION, p, seq, seq, seq * 1000 + p, 0, 0, 1700000000, 0,
                                 key, b"", 0, coll))
        else:
            value = b'{"v":%d,"p":%d}' % (seq, p)
            out.append(DcpRecord(OP_MUTATION, p, seq, seq, seq * 1000 + p, rnd.randrange(4),
                                 rnd.choice((0, 0, 1800000000)), 0, 1, key, value, 0, coll))
    return out


def _segment(d: Path, p: int, log: FailoverLog, start: int, rows: list[DcpRecord],
             sub: str = "") -> SegmentEntry:
    high = rows[-1].by_seqno
    hdr = SegmentHeader(BUCKET, p, log, start, high, ((start, high),),
                        "2026-11-26T00:00:00.000000Z", "upr://h/default", 256)
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
        for i, p in enumerate(PARTITIONS):
            writes = st.writes[i]
            if writes == 0 and not full:
                continue
            part = parts[p]
            if not part.log:
                part.uuid = next(uuids)
                part.log = [(part.uuid, 0)]
            start = 0 if full else part.end
            rollback = None
            if not full and st.rollback[i] and part.end > 0:
                start = max(0, part.end - st.rollback[i])
                branch = min(part.end, start + rnd.randrange(0, 3))
                part.uuid = next(uuids)
                part.log = [(part.uuid, max(branch, part.log[0][1])), *part.log][:8]
                rollback = RollbackRecord(part.end, start, branch, branch + rnd.randrange(0, 2))
            log = FailoverLog.of(part.log)
            segs: list[SegmentEntry] = []
            cut_backs: list[CutBack] = []
            first = start + 1
            if st.cut_back[i] and writes:
                lost_rows = _rows(p, first, 3, rnd, dropped)
                cb_seg = _segment(d, p, FailoverLog.of(part.log), start, lost_rows, sub="cut-1")
                cut_backs.append(CutBack(lost_rows[-1].by_seqno, start, (cb_seg,)))
                part.uuid = next(uuids)
                part.log = [(part.uuid, max(start, part.log[0][1])), *part.log][:8]
                log = FailoverLog.of(part.log)
            if writes:
                rows = _rows(p, first, writes, rnd, dropped)
                segs.append(_segment(d, p, log, start, rows))
                end = rows[-1].by_seqno
            else:
                end = start
            part.end = end
            entries.append(PartitionEntry(p, part.uuid, log, start, end, end, end, tuple(segs),
                                          rollback, tuple(cut_backs)))
        coll = DROPPED if dropped else APP
        m = Manifest(b, BUCKET, "upr://h/default", b.time, b.time + timedelta(seconds=1),
                     full, None if full else parent, tuple(entries), Totals.derive(entries, 1),
                     collections=coll)
        repo.write_manifest(m)
        out.append(m)
        if st.kind == "drop":
            dropped = True
    return out


def restored(repo_dir: Path, at: BackupId, db: Path) -> dict[Any, tuple[Any, ...]]:
    """What `upr restore --at` writes into a SQLite store, key for key."""
    from upr_cli.jobs.restore import restore_to_store

    restore_to_store(repo_dir, db, at=str(at))
    with Store(db, create=False) as s:
        return {(d.partition, d.collection, d.key): (d.seq, d.deleted, d.value, d.cas, d.rev_seq,
                                                     d.flags, d.expiry, d.datatype, d.xattrs)
                for d in s.documents(include_deleted=True)}
