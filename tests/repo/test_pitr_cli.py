"""Point-in-time restore through the commands (docs/design.md "Point-in-time restore"):
a repository whose continuous commits are written as real segment files and version 4
manifests (the follower that writes them is tested on its own), then `restore
--at-time` into SQLite compared key for key with the state the model had at each time,
`--at-seq`, `--before-failover`, `info --json`, `replay` and `diff` of `repo:DIR@TIME`,
`ls` and `cat --at-time`, and `examine`'s times and mark."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.cli.json_convention import problems
from tests.repo.repo_helpers import BUCKET, LOG, T0
from tests.repo.repo_helpers import run_upr as upr
from upr_cli.failover import FailoverLog
from upr_cli.net.bootstrap import partition_of
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import (
    BackupId,
    Manifest,
    PartitionEntry,
    Repository,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.repo.pitr import show_time
from upr_cli.segments import SegmentHeader, SegmentWriter
from upr_cli.store import Store

# an expiry long past at every time of the chain (2020-01-01): restored as it is
PAST = int(datetime(2020, 1, 1, tzinfo=UTC).timestamp())


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def _key(label: str, p: int) -> str:
    """A key that hashes to partition p of 3 (so cat and examine find it there)."""
    return next(k for i in range(10_000) if partition_of((k := f"{label}-{i}").encode(), 3) == p)


PARTS = {"k0": 0, "k1": 0, "k4": 0, "k2": 1, "k3": 1, "k6": 1, "k5": 2}
KEYS = {label: _key(label, p) for label, p in PARTS.items()}


@dataclass
class Model:
    """The source: per partition its seq and, per time, the snapshots it sent."""

    seqs: dict[int, int] = field(default_factory=dict)
    sent: list[tuple[float, int, DcpRecord]] = field(default_factory=list)  # (time, p, rec)

    def write(self, t: float, p: int, key: str, value: str | None, expiry: int = 0) -> DcpRecord:
        seq = self.seqs.get(p, 0) + 1
        self.seqs[p] = seq
        op = OP_MUTATION if value is not None else OP_DELETION
        assert PARTS[key] == p
        rec = DcpRecord(
            op,
            p,
            seq,
            seq,
            1_000_000 + seq * 7 + p,
            5 if value else 0,
            expiry,
            0,
            1 if value else 0,
            KEYS[key].encode(),
            (value or "").encode(),
            0,
        )
        self.sent.append((t, p, rec))
        return rec

    def state(self, t: float) -> dict[tuple[int, bytes], tuple[Any, ...]]:
        """(partition, key) → (seq, deleted, value, cas, flags, expiry) at time t."""
        out: dict[tuple[int, bytes], tuple[Any, ...]] = {}
        for when, p, r in self.sent:
            if when <= t:
                out[p, bytes(r.key)] = (
                    r.by_seqno,
                    r.opcode != OP_MUTATION,
                    bytes(r.value),
                    r.cas,
                    r.flags,
                    r.expiration,
                )
        return out


def _segment(
    repo: Repository,
    d: Path,
    p: int,
    start: int,
    rows: list[DcpRecord],
    snaps: tuple[tuple[int, int], ...],
) -> SegmentEntry:
    high = rows[-1].by_seqno
    hdr = SegmentHeader(
        BUCKET, p, LOG, start, high, snaps, "2026-11-26T00:00:00.000000Z", "upr://h/default", 128
    )
    w = SegmentWriter(d / f"p{p}.open", hdr, storage=repo.storage)
    w.add(rows)
    name = format_segment_name(p, rows[0].by_seqno, high)
    i = w.finish(path=d / name)
    return SegmentEntry(name, i.first_seq, i.last_seq, i.records, i.bytes, i.checksum)


def commit(
    repo: Repository,
    model: Model,
    ident: float,
    finished: float,
    parent: Manifest | None,
    since: float | None,
) -> Manifest:
    """Commit what the model sent in (previous commit, `finished`]: one snapshot per
    time, each a restore point (seq, time) when continuous."""
    b = BackupId(at(ident))
    d = repo.new_backup_dir(BUCKET, b)
    lo = -1.0 if parent is None else (parent.finished - T0).total_seconds()
    entries = []
    for p in sorted({p for t, p, _r in model.sent if lo < t <= finished}):
        rows = [(t, r) for t, q, r in model.sent if q == p and lo < t <= finished]
        prev = None if parent is None else _end(parent, p)
        start = rows[0][1].by_seqno - 1 if prev is None else prev
        ends: dict[float, int] = {}
        for t, r in rows:
            ends[t] = r.by_seqno
        bounds, s0 = [], start
        for e in ends.values():
            bounds.append((s0 + 1, e))
            s0 = e
        seg = _segment(repo, d, p, start, [r for _t, r in rows], tuple(bounds))
        end = rows[-1][1].by_seqno
        points = tuple((s, at(t)) for t, s in ends.items()) if since is not None else ()
        entries.append(PartitionEntry(p, 0xBEEF, LOG, start, end, end, end, (seg,), points=points))
    if parent is None:  # a full backup holds every partition, an empty one too
        held = {e.partition for e in entries}
        entries += [
            PartitionEntry(p, 0, FailoverLog(), 0, 0, 0, 0) for p in range(3) if p not in held
        ]
    m = Manifest(
        b,
        BUCKET,
        "upr://h/default",
        b.time,
        at(finished),
        parent is None,
        None if parent is None else parent.backup_id,
        tuple(entries),
        Totals.derive(entries, 1),
        continuous=None if since is None else at(since),
    )
    repo.write_manifest(m)
    return m


def _end(m: Manifest, p: int) -> int | None:
    e = m.partition(p)
    return None if e is None else e.end_seq


@dataclass
class Built:
    root: Path
    model: Model
    manifests: list[Manifest]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    repo = Repository(tmp_path_factory.mktemp("pitr") / "repo")
    repo.init()
    return build(repo)


def build(repo: Repository) -> Built:
    """An ordinary full backup, three continuous commits; the follower was stopped from
    60 s to 100 s (a coarse stretch). Partition 2 is empty until 50 s."""
    m = Model()
    m.write(0, 0, "k0", '{"v":1}')
    m.write(0, 0, "k1", '{"v":1}')
    m.write(0, 1, "k2", '{"v":1}', expiry=PAST)
    m.write(0, 1, "k3", '{"v":1}')
    b0 = commit(repo, m, 0, 1, None, None)
    m.write(10, 0, "k0", '{"v":2}')
    m.write(20, 0, "k1", None)
    m.write(20, 0, "k4", '{"v":1}')
    m.write(25, 1, "k3", '{"v":2}')
    c1 = commit(repo, m, 2, 30, b0, since=1)
    m.write(40, 0, "k0", '{"v":3}')
    m.write(50, 2, "k5", '{"v":1}')
    c2 = commit(repo, m, 31, 60, c1, since=30)
    m.write(110, 1, "k2", None)
    m.write(110, 1, "k6", '{"v":1}')
    c3 = commit(repo, m, 101, 120, c2, since=100)
    return Built(repo.path, m, [b0, c1, c2, c3])


def stored(db: Path) -> dict[tuple[int, bytes], tuple[Any, ...]]:
    with Store(db, create=False) as s:
        return {
            (d.partition, bytes(d.key)): (
                d.seq,
                d.deleted,
                bytes(d.value),
                d.cas,
                d.flags,
                d.expiry,
            )
            for d in s.documents(include_deleted=True)
        }


@pytest.mark.parametrize("t", [1, 5, 10, 15, 22, 45, 55, 80, 110, 120])
def test_restore_at_time_is_the_state_then_key_for_key(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str], t: float
) -> None:
    db = tmp_path / "then.db"
    code, out, err = upr(
        capsys,
        "restore",
        "--repo",
        str(built.root),
        "--at-time",
        show_time(at(t)),
        f"sqlite:{db}",
        "--json",
    )
    assert code == 0, err
    assert stored(db) == built.model.state(t)
    assert problems(json.loads(out)) == []
    point = json.loads(out)["point"]
    assert point["by"] == "time"
    coarse = 60 < t < 100  # the follower was stopped from 60 s to 100 s
    assert point["max_lag_seconds"] == (t - 60 if coarse else 0)
    assert point["not_restored"] == []


def test_the_expired_document_keeps_its_expiry(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "x.db"
    args = ["--repo", str(built.root), "--at-time", show_time(at(45)), "--no-check"]
    assert upr(capsys, "restore", *args, f"sqlite:{db}")[0] == 0
    # restored with its expiry, long past: the target expires it, as Couchbase does
    assert stored(db)[1, KEYS["k2"].encode()][5] == PAST
    assert stored(db) == built.model.state(45)


def test_restore_text_names_the_coarse_stretch(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _err = upr(
        capsys,
        "restore",
        "--repo",
        str(built.root),
        "--at-time",
        show_time(at(80)),
        f"sqlite:{tmp_path / 'a.db'}",
    )
    assert code == 0
    assert f"restored the state at {show_time(at(80))}" in out
    assert f"coarse stretch {show_time(at(60))} to {show_time(at(100))}" in out
    assert "the state given is 20 s before it" in out
    assert all(len(line) <= 80 for line in out.splitlines())


@pytest.mark.parametrize("when", ["2026-11-21T06:14:00Z", "2026-11-21T06:18:00Z", "-1h"])
def test_a_time_outside_the_range_writes_nothing(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str], when: str
) -> None:
    db = tmp_path / "none.db"
    code, _out, err = upr(
        capsys, "restore", "--repo", str(built.root), "--at-time", when, f"sqlite:{db}"
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "outside the restorable range of bucket default" in lines[0]
    assert f"{show_time(at(1))} to {show_time(at(120))}" in lines[0]
    assert not db.exists()


def test_usage_errors(built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = f"sqlite:{tmp_path / 'u.db'}"
    for args in (
        ["--at-time", "yesterday"],
        ["--at-seq", "0"],
        ["--at-time", "-5m", "--at", "latest"],
        ["--at-time", "-5m", "--at-seq", "0:1"],
        ["--before-failover", "1"],
    ):
        code, _out, err = upr(capsys, "restore", "--repo", str(built.root), *args, db)
        assert code == 2, args
        assert len(err.strip().splitlines()) == 1, err


def test_at_seq_restores_only_the_named_partitions(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "s.db"
    code, out, err = upr(
        capsys, "restore", "--repo", str(built.root), "--at-seq", "0:4", f"sqlite:{db}", "--json"
    )
    assert code == 0, err
    # seq 4 is inside the snapshot 4-5 (20 s): rounded down to 3, the state at 10 s
    want = {k: v for k, v in built.model.state(10).items() if k[0] == 0}
    assert stored(db) == want
    assert json.loads(out)["point"]["notices"] == [
        "partition 0: seq 4 is inside a snapshot: restored to the snapshot boundary below it, 3"
    ]


def test_info_json_has_the_range_stretches_and_failovers(
    built: Built, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _err = upr(capsys, "info", "--repo", str(built.root), "--json")
    assert code == 0
    assert problems(json.loads(out)) == []
    b = json.loads(out)["buckets"][0]
    assert b["restorable"] == {
        "oldest": show_time(at(1)),
        "last": show_time(at(120)),
        "coarse": [
            {"start_time": show_time(at(60)), "end_time": show_time(at(100)), "seconds": 40.0}
        ],
    }
    assert b["failovers"] == []
    code, out, _err = upr(capsys, "info", "--repo", str(built.root))
    assert f"restorable: {show_time(at(1))} to {show_time(at(120))}" in out
    assert f"  {show_time(at(60))} to {show_time(at(100))} (40 s)" in out


def test_replay_and_diff_of_a_repository_at_a_time(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "r.db"
    spec = f"repo:{built.root}@{show_time(at(22))}"
    code, _out, err = upr(capsys, "replay", spec, "--into", str(db))
    assert code == 0, err
    assert stored(db) == built.model.state(22)
    with Store(db, create=False) as s:
        assert s.positions()[0].seq == 5  # the restore point's seq, not C1's end
    code, out, err = upr(capsys, "diff", spec, f"sqlite:{db}", "--json")
    assert code == 0, err
    assert {d["status"] for d in json.loads(out)["partitions"]} == {"identical"}
    code, out, err = upr(capsys, "diff", spec, f"repo:{built.root}", "--json")
    assert code == 1, err
    assert {d["partition"]: d["status"] for d in json.loads(out)["partitions"]} == {
        0: "ahead",
        1: "ahead",
        2: "no-common-history",
    }  # empty at 22 s: no log yet


def test_ls_and_cat_at_a_time(built: Built, capsys: pytest.CaptureFixture[str]) -> None:
    t = show_time(at(15))
    code, out, err = upr(capsys, "ls", "--repo", str(built.root), "--at-time", t)
    assert code == 0, err
    want = ["_default._default"] * 4 + [KEYS[k] for k in ("k0", "k1", "k2", "k3")]
    assert sorted(out.split()) == sorted(want)
    code, out, _err = upr(capsys, "cat", "--repo", str(built.root), "--at-time", t, KEYS["k0"])
    assert (code, out) == (0, '{"v":2}')
    code, out, _err = upr(
        capsys, "cat", "--repo", str(built.root), "--at-time", show_time(at(45)), KEYS["k0"]
    )
    assert (code, out) == (0, '{"v":3}')
    code, _out, _err = upr(
        capsys, "cat", "--repo", str(built.root), "--at-time", show_time(at(22)), KEYS["k1"]
    )
    assert code == 1  # deleted at 20 s


def test_examine_shows_times_and_marks_the_version_at_a_time(
    built: Built, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = upr(
        capsys,
        "examine",
        "--repo",
        str(built.root),
        KEYS["k0"],
        "--json",
        "--at-time",
        show_time(at(15)),
    )
    assert code == 0, err
    vs = json.loads(out)["versions"]
    assert [(v["seq"], v["time"], v["at_time"]) for v in vs] == [
        ("1", show_time(at(1)), False),
        ("3", show_time(at(10)), True),
        ("6", show_time(at(40)), False),
    ]
    assert all(v["cas"] for v in vs)


def test_failovers_in_info_and_before_failover(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Failover 1 rolls partition 0 back by 2 seqs; failover 2 cuts partition 1 back in
    mid-run. --before-failover gives each partition's old branch, lost writes included."""
    from tests.repo.chain_gen import Step, build, restored
    from tests.repo.repo_helpers import bid
    from upr_cli.segments import SegmentReader

    root = tmp_path / "repo"
    repo = Repository(root)
    no = (False, False, False)
    ms = build(
        repo,
        [
            Step("full", (5, 5, 5), (0, 0, 0), no, 1),
            Step("inc", (4, 4, 4), (0, 0, 0), no, 2),
            Step("inc", (3, 3, 3), (2, 0, 0), no, 3),
            Step("inc", (2, 2, 2), (0, 0, 0), (False, True, False), 4),
        ],
    )
    code, out, _err = upr(capsys, "info", "--repo", str(root), "--json")
    assert code == 0
    assert problems(json.loads(out)) == []
    events = json.loads(out)["buckets"][0]["failovers"]
    cb = ms[3].partition(1).cut_backs[0]  # type: ignore[union-attr]
    assert [(f["number"], f["backup_id"], f["partitions"]) for f in events] == [
        (1, str(bid(2)), [0]),
        (2, str(bid(3)), [1]),
    ]
    assert events[0]["lost_ranges"] == [
        {"partition": 0, "backup_id": str(bid(1)), "from_seq": "7", "to_seq": "9"}
    ]
    assert events[1]["lost_ranges"] == [
        {
            "partition": 1,
            "backup_id": str(bid(3)),
            "from_seq": str(cb.to_seq),
            "to_seq": str(cb.from_seq),
        }
    ]
    code, out, _err = upr(capsys, "info", "--repo", str(root))
    assert "failover 2: " in out and "partition 1; lost writes in 3 seqs" in out

    db = tmp_path / "f1.db"
    assert (
        upr(capsys, "restore", "--repo", str(root), "--before-failover", "1", f"sqlite:{db}")[0]
        == 0
    )
    assert stored_all(db) == restored(root, bid(1), tmp_path / "want1.db")

    db = tmp_path / "f2.db"
    code, out, err = upr(
        capsys, "restore", "--repo", str(root), "--before-failover", "2", f"sqlite:{db}"
    )
    assert code == 0, err
    base = restored(root, bid(2), tmp_path / "want2.db")
    cut: dict[tuple[int, int, bytes], int] = {}
    path = repo.segment_path(BUCKET, bid(3), f"cut-1/{cb.segments[0].file}")
    with SegmentReader(path, repo.storage) as r:
        for rec in r.records():
            cut[1, rec.collection, rec.key] = rec.seq
    got = stored_all(db)
    assert set(got) == set(base) | set(cut)
    for k, v in got.items():
        assert v[0] == cut[k] if k in cut else v == base[k]
    assert (
        f"partition 1: with the records the run received before its rollback to seq "
        f"{cb.to_seq} (lost writes)" in out
    )


def stored_all(db: Path) -> dict[Any, tuple[Any, ...]]:
    """As `chain_gen.restored` reads a store: (partition, collection, key) → fields."""
    from tests.repo.chain_gen import stored

    return stored(db)


def test_an_encrypted_repository_goes_through_the_same_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from upr_cli.repo import access
    from upr_cli.repo.access import Access
    from upr_cli.repo.keys import create_encrypted

    key = tmp_path / "key"
    key.write_text("a passphrase\n")
    repo = Repository(tmp_path / "enc", access=Access(key_file=key))
    create_encrypted(repo)
    enc = build(repo)
    monkeypatch.setenv("UPR_KEY_FILE", str(key))
    access.reset()
    try:
        db = tmp_path / "e.db"
        args = ["--repo", str(enc.root), "--at-time", show_time(at(22))]
        code, _out, err = upr(capsys, "restore", *args, f"sqlite:{db}")
        assert code == 0, err
        assert stored(db) == enc.model.state(22)
        m = enc.manifests[1]
        sealed = repo.segment_path(BUCKET, m.backup_id, m.partitions[0].segments[0].file)
        assert b"k0" not in sealed.read_bytes()  # the plain file holds the keys
    finally:
        access.reset()
