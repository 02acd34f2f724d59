"""`upr ls` and `upr cat` list and print exactly what `upr restore --at K` writes.

A repository is built with the library (real segment files and manifests, as
tests/repo/repo_helpers.py does): four partitions, keys at their CRC32 partition, three
collections. Backup 0 is full; backup 1 updates, deletes and adds keys and comes after
`app.logs` was dropped; backup 2 adds more, and partition 0 was rolled back below
backup 1's end (backup 1's records above the rollback seq are lost writes, not state).
At each backup, the keys `ls` lists and the bodies `cat` prints are compared with the
documents a restore into a SQLite store holds, key for key. The commands run as
processes, as a user runs them. `upr info --partitions` on the same repository lists
partition 0's chain, its rollback and the ranges it took back.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

from tests.repo.repo_helpers import BUCKET, LOG, bid
from upr_cli.cli.app import main
from upr_cli.collections import CollectionsManifest
from upr_cli.collections import Path as CollectionPath
from upr_cli.failover import FailoverLog
from upr_cli.jobs.restore import restore_to_store
from upr_cli.net.bootstrap import partition_of
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import (
    Manifest,
    PartitionEntry,
    Repository,
    RollbackRecord,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.segments import SegmentHeader, SegmentWriter

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 4
APP = (CollectionsManifest().with_scope("app").with_collection("app", "users")
       .with_collection("app", "logs"))  # fmt: skip
NO_LOGS = APP.without(CollectionPath("app", "logs"))
BRANCH = FailoverLog.of([(0xCAFE, 2), (0xBEEF, 0)])  # partition 0 after its failover
XATTRS = xattrs.encode([("_sync", '{"rev":"1-a"}')])


def cid(manifest: CollectionsManifest, path: str) -> int:
    found = manifest.lookup(CollectionPath.parse(path))
    assert found is not None
    return found.id


USERS, LOGS = cid(APP, "app.users"), cid(APP, "app.logs")


@dataclass
class Builder:
    """Backups of a bucket of PARTITIONS partitions, seqs counted per partition."""

    repo: Repository
    ends: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(PARTITIONS), 0))
    n: int = 0

    def backup(self, changes: list[tuple[int, bytes, bytes | None]],
               collections: CollectionsManifest, rollback: tuple[int, int] | None = None,
               ) -> Manifest:  # fmt: skip
        """Commit the next backup of `changes` (collection id, key, value or None for a
        deletion), each at its key's partition; `rollback` = (partition, seq): that
        partition's stream restarted at seq on a new branch."""
        b, parent = bid(self.n), bid(self.n - 1) if self.n else None
        d = self.repo.new_backup_dir(BUCKET, b)
        starts = dict(self.ends)
        if rollback is not None:
            starts[rollback[0]] = rollback[1]
        rows: dict[int, list[DcpRecord]] = {p: [] for p in range(PARTITIONS)}
        seqs = dict(starts)
        for coll, key, value in changes:
            p = partition_of(key, PARTITIONS)
            seqs[p] += 1
            s = seqs[p]
            op, dt = (OP_MUTATION, 1) if value is not None else (OP_DELETION, 0)
            blob = XATTRS if key.endswith(b"x") else b""
            rows[p].append(DcpRecord(op, p, s, s, s * 1000 + self.n, 7, 0, 0, dt, key,
                                     value or b"", 0, coll, blob))  # fmt: skip
        entries = []
        for p in range(PARTITIONS):
            log = BRANCH if rollback is not None and p == rollback[0] else LOG
            uuid = log.entries[0].uuid
            start, end = starts[p], seqs[p]
            segs: tuple[SegmentEntry, ...] = ()
            if rows[p]:
                hdr = SegmentHeader(BUCKET, p, log, start, end, ((start, end),),
                                    "2026-11-26T00:00:00.000000Z", "upr://h/default",
                                    128)  # fmt: skip
                w = SegmentWriter(d / f"p{p}.open", hdr)
                w.add(rows[p])
                name = format_segment_name(p, rows[p][0].by_seqno, end)
                i = w.finish(path=d / name)
                segs = (SegmentEntry(name, i.first_seq, i.last_seq, i.records, i.bytes,
                                     i.checksum),)  # fmt: skip
            rb = None
            if rollback is not None and p == rollback[0]:
                rb = RollbackRecord(self.ends[p], start, None, start)
            entries.append(PartitionEntry(p, uuid, log, start, end, end, end, segs, rb))
        self.ends = seqs
        m = Manifest(b, BUCKET, "upr://h/default", b.time, b.time + timedelta(seconds=1),
                     parent is None, parent, tuple(entries), Totals.derive(entries, 1),
                     collections=collections)  # fmt: skip
        self.repo.write_manifest(m)
        self.n += 1
        return m


def doc(key: bytes, n: int) -> bytes:
    return b'{"key":"%s","v":%d}' % (key, n)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lscat") / "repo"
    r = Repository(path)
    r.init()
    b = Builder(r)
    keys = [b"k%d" % i for i in range(16)] + [b"kx", b"\xffbin", b"new\nline"]
    first = [(0, k, doc(k, 0)) for k in keys]
    first += [(USERS, b"u%d" % i, doc(b"u%d" % i, 0)) for i in range(6)]
    first += [(USERS, b"k1", doc(b"users-k1", 0))]  # the same key in two collections
    first += [(LOGS, b"l%d" % i, doc(b"l%d" % i, 0)) for i in range(3)]
    b.backup(first, APP)
    second = [(0, k, doc(k, 1)) for k in keys[:8]]  # updates
    second += [(0, k, None) for k in keys[8:12]]  # deletions
    second += [(USERS, b"u0", None), (0, b"later", doc(b"later", 1))]
    b.backup(second, NO_LOGS)  # app.logs was dropped in between
    # partition 0's failover took back what backup 1 wrote there above its seq 2
    p0 = [k for k in keys if partition_of(k, PARTITIONS) == 0]
    assert len(p0) >= 2
    third = [(0, b"k15", doc(b"k15", 2)), (USERS, b"u5", doc(b"u5", 2))]
    b.backup(third, NO_LOGS, rollback=(0, 2))
    return path


def upr(*args: str, ok: bool = True) -> subprocess.CompletedProcess[bytes]:
    """The command run as a process, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "upr_cli", *args], capture_output=True,
                          env=env, timeout=60, check=False)  # fmt: skip
    if ok:
        assert proc.returncode == 0, proc.stderr.decode()
    return proc


Run = Callable[..., subprocess.CompletedProcess[bytes]]


@pytest.fixture
def run(capsysbinary: pytest.CaptureFixture[bytes]) -> Run:
    """The command run by `main` in this process (what `upr` runs, without a
    process's start-up: a second each would cost the budget); its exit status,
    stdout and stderr as a process's."""

    def call(*args: str, ok: bool = True) -> subprocess.CompletedProcess[bytes]:
        capsysbinary.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsysbinary.readouterr()
        if ok:
            assert code == 0, err.decode()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return call


def restored(repo: Path, at: str, tmp: Path) -> dict[tuple[int, bytes], bytes]:
    """The live documents a restore at `at` writes into a SQLite store."""
    db = tmp / f"{at}.db"
    restore_to_store(repo, db, at=at)
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT collection_id, key, CAST(value AS BLOB) FROM documents "
                            "WHERE deleted = 0").fetchall()  # fmt: skip
    return {(c, bytes(k)): bytes(v) for c, k, v in rows}


@pytest.mark.parametrize("n", [0, 1, 2])
def test_ls_and_cat_match_what_restore_writes(repo: Path, tmp_path: Path, n: int,
                                              run: Run) -> None:  # fmt: skip
    at = str(bid(n))
    want = restored(repo, at, tmp_path)
    ids = {"_default._default": 0, "app.users": USERS, "app.logs": LOGS}
    got = json.loads(run("ls", "--repo", str(repo), "--at", at, "--json").stdout)
    assert got["backup_id"] == at and got["items"] == len(got["keys"])
    listed = {(ids[f"{k['scope']}.{k['collection']}"], k["key"]) for k in got["keys"]}
    assert listed == {(c, k.decode(errors="backslashreplace")) for c, k in want}
    # partition, then seq order
    order = [(k["partition"], int(k["seq"])) for k in got["keys"]]
    assert order == sorted(order)
    # the text form: one line per key, the same keys
    ls = upr if n == 2 else run  # once as a process
    lines = ls("ls", "--repo", str(repo), "--at", at).stdout.decode().splitlines()
    assert len(lines) == len(want)
    assert "app.users u1" in lines and "_default._default new\\nline" in lines
    assert "_default._default \\xffbin" in lines
    # cat prints each body as restored (one per collection, the key at its partition)
    for c, key in [(0, b"k1"), (USERS, b"k1"), (0, b"k15"), (0, b"\xffbin")]:
        coll = "app.users" if c == USERS else "_default._default"
        if (c, key) in want:
            cat = upr if (n, c, key) == (2, 0, b"\xffbin") else run  # once as a process
            body = cat("cat", "--repo", str(repo), "--at", at, "--collection", coll,
                       os.fsdecode(key)).stdout  # fmt: skip
            assert body == want[c, key]


def test_deleted_updated_rolled_back_and_dropped(repo: Path, run: Run) -> None:
    r = str(repo)
    latest = run("ls", "--repo", r, "--deleted").stdout.decode().splitlines()
    assert "deleted _default._default k8" in latest and "live    _default._default k0" in latest
    assert not any(" app.logs " in line for line in latest)  # dropped before backup 1
    old = run("ls", "--repo", r, "--at", str(bid(0)), "--collection", "app").stdout.decode()
    assert "app.logs l0" in old.splitlines() and "_default" not in old
    assert run("ls", "--repo", r, "--collection", "app.logs").stdout == b""
    empty = json.loads(run("ls", "--repo", r, "--collection", "app.logs", "--json").stdout)
    assert (empty["keys"], empty["items"], empty["bucket"]) == ([], 0, BUCKET)
    # an update, then the rollback: partition 0's update in backup 1 above seq 2 is lost
    p0 = sorted(k for k in (b"k%d" % i for i in range(8)) if partition_of(k, PARTITIONS) == 0)
    assert p0
    v1 = json.loads(run("cat", "--repo", r, "--at", str(bid(1)), "--json", p0[-1].decode()).stdout)
    v2 = json.loads(run("cat", "--repo", r, "--json", p0[-1].decode()).stdout)
    assert v1["value"]["v"] == 1 and v1["stored_in"] == str(bid(1))
    assert v2["value"]["v"] == 0 and v2["stored_in"] == str(bid(0))  # backup 1's was lost
    assert isinstance(v2["seq"], str) and isinstance(v2["cas"], str) and v2["flags"] == 7
    kx = json.loads(run("cat", "--repo", r, "--json", "kx").stdout)
    assert kx["xattrs"] == {"_sync": {"rev": "1-a"}}
    # deleted, absent, dropped: exit 1, one line
    for args, why in [(["k9"], "deleted at seq"), (["nope"], "no such document"),
                      (["--collection", "app.logs", "l0"], "dropped")]:  # fmt: skip
        proc = run("cat", "--repo", r, *args, ok=False)
        err = proc.stderr.decode()
        assert proc.returncode == 1 and why in err and err.count("\n") == 1, err


def test_typed_errors(repo: Path, tmp_path: Path, run: Run) -> None:
    r = str(repo)
    cases = [
        (["ls", "--repo", r, "--at", "19990101"], "no committed backup"),
        (["ls", "--repo", r, "--collection", "app.nope"], "no such collection"),
        (["cat", "--repo", r, "--collection", "nope.x", "k1"], "no such collection"),
        (["ls", "--repo", str(tmp_path / "none")], "not a upr repository"),
        (["ls", "--repo", r, "--at", "2026"], "is the start of 3 backups"),
    ]
    for args, why in cases:
        proc = upr(*args, ok=False)
        err = proc.stderr.decode()
        assert proc.returncode == 2 and why in err and err.count("\n") == 1, err


def test_info_partitions_lists_each_partition_with_its_chain_and_lost_ranges(
    repo: Path, run: Run
) -> None:
    """`info --partitions`: one object a partition (docs/output.md "One name, one type"),
    its chain and the ranges its rollbacks took back, as the text shows them."""
    r = str(repo)
    doc = json.loads(run("info", "--repo", r, "--partitions", "0,1", "--json").stdout)
    parts = doc["buckets"][0]["partitions"]
    assert [p["partition"] for p in parts] == [0, 1]
    p0, p1 = parts
    assert [c["backup_id"] for c in p0["chain"]] == [str(bid(n)) for n in range(3)]
    assert p0["chain"][2]["rollback"]["to"] == "2" and p1["lost_ranges"] == []
    lost = p0["lost_ranges"]
    assert (
        lost
        and lost[0]["from"] == "2"
        and {x["backup_id"] for x in lost} <= {str(bid(0)), str(bid(1))}
    )
    text = run("info", "--repo", r, "--partitions", "0").stdout.decode()
    assert "partition 0:" in text and "rolled back" in text
    for x in lost:
        assert f"lost writes: {x['backup_id']} seqs ({x['from']}, {x['to']}]" in text
