"""A damaged repository never restores silently wrong, and its committed data is never swept.

Repositories here are built with the library: real segment files (`SegmentWriter`), real
manifests and copies, in a temp directory. Each partition's "source" is a list of
updates and deletions with increasing seqs; an incremental backup holds what came since
the one before, a full backup the latest version of every key from seq 0 (as a DCP
stream from 0 sends it). formats/repository.md §4.1, §4.4, §6 and §8.8 are the rules.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.repo.repo_helpers import BUCKET, LOG, bid
from upr_cli.errors import UprError
from upr_cli.jobs.inspect import info, verify
from upr_cli.jobs.restore import restore_to_store
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import (
    MANIFEST_COPY,
    MANIFEST_FILE,
    BackupId,
    Manifest,
    PartitionEntry,
    Repository,
    RepositoryError,
    RepositoryLock,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.segments import SegmentHeader, SegmentWriter
from upr_cli.store import Store

PARTITIONS = (0, 3)


@dataclass
class Source:
    """One partition's history: (seq, key, deleted, value), seqs increasing from 1."""

    partition: int
    ops: list[tuple[int, bytes, bool, bytes]] = field(default_factory=list)

    @property
    def high(self) -> int:
        return self.ops[-1][0] if self.ops else 0

    def write(self, key: int, deleted: bool) -> None:
        seq = self.high + 1
        self.ops.append((seq, f"k{key}".encode(), deleted, b"" if deleted else f"v{seq}".encode()))

    def since(self, seq: int, *, dedup: bool) -> list[tuple[int, bytes, bool, bytes]]:
        ops = [o for o in self.ops if o[0] > seq]
        if dedup:  # a stream from 0: the latest version of each key only
            ops = sorted({o[1]: o for o in ops}.values())
        return ops


def _rows(p: int, ops: list[tuple[int, bytes, bool, bytes]]) -> list[DcpRecord]:
    return [DcpRecord(OP_DELETION if deleted else OP_MUTATION, p, seq, seq, seq * 1000 + 7, 0, 0,
                      0, 0, key, value, 0)
            for seq, key, deleted, value in ops]  # fmt: skip


class Builder:
    """Commits backups of `Source`s into a repository, as `upr backup` would."""

    def __init__(self, root: Path) -> None:
        self.repo = Repository(root)
        self.repo.init()
        self.sources = {p: Source(p) for p in PARTITIONS}
        self.ends: dict[int, int] = {}
        self.count = 0

    def backup(self, full: bool = False) -> Manifest:
        b = bid(self.count)
        parent = None if full or self.count == 0 else bid(self.count - 1)
        d = self.repo.new_backup_dir(BUCKET, b)
        entries = []
        for p, src in self.sources.items():
            start = 0 if parent is None else self.ends.get(p, 0)
            ops = src.since(start, dedup=start == 0)
            segments: tuple[SegmentEntry, ...] = ()
            if ops:
                hdr = SegmentHeader(BUCKET, p, LOG, start, src.high, ((start, src.high),),
                                    "2026-11-21T00:00:00.000000Z", "upr://h/b", 256)  # fmt: skip
                w = SegmentWriter(d / f"p{p}.open", hdr)
                w.add(_rows(p, ops))
                name = format_segment_name(p, ops[0][0], ops[-1][0])
                i = w.finish(path=d / name)
                segments = (SegmentEntry(name, i.first_seq, i.last_seq, i.records, i.bytes,
                                         i.checksum),)  # fmt: skip
            entries.append(PartitionEntry(p, 0xBEEF, LOG, start, src.high, src.high, src.high,
                                          segments))  # fmt: skip
            self.ends[p] = src.high
        m = Manifest(b, BUCKET, "upr://h/default", b.time, b.time + timedelta(seconds=1),
                     parent is None, parent, tuple(entries), Totals.derive(entries, 1))  # fmt: skip
        self.repo.write_manifest(m)
        self.count += 1
        return m

    def dir(self, i: int) -> Path:
        return self.repo.backup_dir(BUCKET, bid(i))


def three_backups(root: Path) -> Builder:
    """A full backup, then two incrementals; every one updates and deletes."""
    b = Builder(root)
    for round_, ops in enumerate([[(0, False), (1, False), (2, False), (1, True)],
                                  [(0, False), (2, True), (3, False)],
                                  [(3, False), (0, True), (4, False)]]):  # fmt: skip
        for key, deleted in ops:
            for p in PARTITIONS:
                b.sources[p].write(key + round_ * p, deleted)
        b.backup()
    return b


def restored(root: Path, db: Path, at: str = "latest") -> list[Any]:
    """What `upr restore sqlite:DB` writes: every document and tombstone, and positions."""
    restore_to_store(root, db, at=at)
    with Store(db) as s:
        return [list(s.documents()), s.positions()]


def sweep(repo: Repository, running: BackupId) -> list[Path]:
    with RepositoryLock(repo, BUCKET) as lock:
        return repo.sweep(BUCKET, running, lock)


# -- one lost manifest.json: read from the copy, never swept ---------------------------


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_a_lost_manifest_is_read_from_its_copy_and_never_swept(tmp_path: Path, lost: int) -> None:
    b = three_backups(tmp_path / "r")
    good = restored(b.repo.path, tmp_path / "good.db")
    oldest = restored(b.repo.path, tmp_path / "oldest.db", "oldest")
    before = b.repo.manifests(BUCKET)
    (b.dir(lost) / MANIFEST_FILE).unlink()
    assert b.repo.committed(BUCKET) == [bid(0), bid(1), bid(2)]
    assert b.repo.incomplete(BUCKET) == []
    assert b.repo.manifests(BUCKET) == before
    assert restored(b.repo.path, tmp_path / "after.db") == good
    assert restored(b.repo.path, tmp_path / "after-oldest.db", "oldest") == oldest
    assert sweep(b.repo, bid(3)) == [] and b.dir(lost).is_dir()
    # verify names the lost file and exits non-zero; --repair rewrites it from the copy
    (rep,) = verify(b.repo.path)
    assert [(p.kind, p.where) for p in rep.problems] == [
        ("manifest", f"{BUCKET}/{bid(lost)}/{MANIFEST_FILE}")
    ]
    (rep,) = verify(b.repo.path, repair=True)
    assert rep.problems[0].repaired and not rep.unrepaired
    assert (b.dir(lost) / MANIFEST_FILE).read_bytes() == (b.dir(lost) / MANIFEST_COPY).read_bytes()
    (rep,) = verify(b.repo.path)
    assert rep.problems == []


@pytest.mark.parametrize("damage", ["flip", "zero", "delete", "truncate"])
@pytest.mark.parametrize("name", [MANIFEST_FILE, MANIFEST_COPY])
def test_verify_names_a_damaged_manifest_file_and_repair_heals_it(
    tmp_path: Path, damage: str, name: str
) -> None:
    b = three_backups(tmp_path / "r")
    path = b.dir(1) / name
    twin = b.dir(1) / (MANIFEST_COPY if name == MANIFEST_FILE else MANIFEST_FILE)
    original = path.read_bytes()
    _damage(path, damage, 0.4)
    assert b.repo.read_manifest(BUCKET, bid(1)).dumps() == original  # still readable
    (rep,) = verify(b.repo.path)
    assert not rep.to_json()["ok"]
    assert [(p.kind, p.where) for p in rep.problems] == [("manifest", f"{BUCKET}/{bid(1)}/{name}")]
    assert twin.name in rep.problems[0].detail
    (rep,) = verify(b.repo.path, repair=True)
    assert rep.to_json()["ok"] and rep.problems[0].repaired
    assert path.read_bytes() == original
    assert verify(b.repo.path)[0].problems == []


def test_two_damaged_files_make_a_damaged_backup_that_readers_refuse(tmp_path: Path) -> None:
    b = three_backups(tmp_path / "r")
    for name in (MANIFEST_FILE, MANIFEST_COPY):
        _damage(b.dir(1) / name, "flip", 0.5)
    with pytest.raises(RepositoryError, match=f"backup {bid(1)} is damaged: ") as e:
        b.repo.manifests(BUCKET)
    msg = str(e.value)
    assert str(b.dir(1) / MANIFEST_FILE) in msg and str(b.dir(1) / MANIFEST_COPY) in msg
    assert "\n" not in msg
    with pytest.raises(UprError, match=f"backup {bid(1)} is damaged"):
        restore_to_store(b.repo.path, tmp_path / "x.db")
    assert not (tmp_path / "x.db").exists()  # nothing written
    restored(b.repo.path, tmp_path / "oldest.db", "oldest")  # its state does not need it
    assert sweep(b.repo, bid(3)) == [] and b.dir(1).is_dir()
    (rep,) = verify(b.repo.path, repair=True)  # nothing to repair it from
    assert not any(p.repaired for p in rep.problems)
    assert {p.kind for p in rep.unrepaired} == {"manifest", "chain", "gap"}


# -- both files lost: the chain is broken, and says where ------------------------------


@pytest.mark.parametrize("lost", [0, 1])
def test_a_backup_that_lost_both_manifest_files_breaks_the_chain(tmp_path: Path, lost: int) -> None:
    b = three_backups(tmp_path / "r")
    for name in (MANIFEST_FILE, MANIFEST_COPY):
        (b.dir(lost) / name).unlink()
    with pytest.raises(RepositoryError) as e:
        b.repo.manifests(BUCKET)
    msg = str(e.value)
    assert f"backup {bid(lost)}, the parent of backup {bid(lost + 1)}, has no" in msg
    assert str(b.dir(lost)) in msg and "segment files remain" in msg
    with pytest.raises(UprError, match=f"the parent of backup {bid(lost + 1)}"):
        restore_to_store(b.repo.path, tmp_path / "x.db")
    assert not (tmp_path / "x.db").exists()
    # named as a parent: never swept, though it looks like an interrupted run
    assert b.repo.incomplete(BUCKET) == [bid(lost)]
    assert sweep(b.repo, bid(3)) == [] and b.dir(lost).is_dir()
    (rep,) = verify(b.repo.path)
    assert any(p.kind == "chain" and "has no manifest.json" in p.detail for p in rep.problems)
    # a new full backup starts a chain that readers accept; the old pieces stay
    for p in PARTITIONS:
        b.sources[p].write(9, False)
    b.ends.clear()
    b.backup(full=True)
    assert [m.backup_id for m in b.repo.manifests(BUCKET)][-1] == bid(3)
    restored(b.repo.path, tmp_path / "new.db")
    with pytest.raises(RepositoryError, match="the parent of backup"):
        b.repo.chain(BUCKET, bid(2))
    assert sweep(b.repo, bid(4)) == [] and b.dir(lost).is_dir()


def test_a_missing_middle_directory_is_named_with_its_gap(tmp_path: Path) -> None:
    b = three_backups(tmp_path / "r")
    shutil.rmtree(b.dir(1))
    with pytest.raises(RepositoryError, match=f"backup {bid(1)}, the parent of .* is gone"):
        b.repo.manifests(BUCKET)
    (rep,) = verify(b.repo.path)
    gaps = [p for p in rep.problems if p.kind == "gap"]
    assert {p.where for p in gaps} == {f"{BUCKET}/{bid(2)} partition {p}" for p in PARTITIONS}


def test_sweep_removes_only_what_an_interrupted_run_provably_left(tmp_path: Path) -> None:
    b = three_backups(tmp_path / "r")
    interrupted = b.repo.new_backup_dir(BUCKET, bid(5))  # no manifest, no copy, not named
    (interrupted / format_segment_name(0, 99, 99)).write_bytes(b"x")
    running = bid(6)
    assert sweep(b.repo, running) == [interrupted]
    # a damaged manifest's parent link cannot be read: nothing older than it is removed
    old = b.repo.bucket_dir(BUCKET) / str(bid(1).next())  # older than the damaged one
    old.mkdir()
    for name in (MANIFEST_FILE, MANIFEST_COPY):
        (b.dir(2) / name).write_bytes(b"{")
    assert sweep(b.repo, running) == [] and old.is_dir()


def test_interrupted_runs_are_resumable_or_leftovers_never_backups(tmp_path: Path) -> None:
    """The newest uncommitted directory after every committed backup, holding a segment,
    is the run the next backup resumes (formats/repository.md §4.5); every other one is
    a leftover no resume can use. `info` and `verify` name both; neither is a backup."""
    b = three_backups(tmp_path / "r")
    older = b.repo.bucket_dir(BUCKET) / str(bid(1).next())  # behind committed backups
    older.mkdir()
    (older / format_segment_name(0, 99, 99)).write_bytes(b"x")
    newest = b.repo.new_backup_dir(BUCKET, bid(5))  # a run that finished no segment
    assert (b.repo.resumable(BUCKET), b.repo.leftovers(BUCKET)) == (None, [bid(1).next(), bid(5)])
    (rep,) = verify(b.repo.path)
    assert rep.backups == 3 and rep.problems == []
    assert (rep.resumable, rep.leftovers) == (None, [older.name, newest.name])
    (newest / format_segment_name(3, 1, 4)).write_bytes(b"x")  # it finished a segment
    entry = info(b.repo.path)["buckets"][0]
    assert len(entry["backups"]) == 3
    assert (entry["resumable"], entry["leftovers"]) == (newest.name, [older.name])
    assert verify(b.repo.path)[0].to_json()["leftovers"] == [older.name]


def test_a_missing_segment_is_named_before_anything_is_written(tmp_path: Path) -> None:
    b = three_backups(tmp_path / "r")
    seg = next(b.dir(1).glob("p*.seg"))
    seg.unlink()
    with pytest.raises(UprError, match=rf"{seg.name}: missing \(listed by backup {bid(1)}\)"):
        restore_to_store(b.repo.path, tmp_path / "x.db")
    assert not (tmp_path / "x.db").exists()


# -- the property: one damaged file, then either the good restore or a named error ----


def _damage(path: Path, how: str, where: float) -> None:
    data = bytearray(path.read_bytes())
    i = min(int(where * len(data)), max(len(data) - 1, 0))
    if how == "delete":
        path.unlink()
        return
    if how == "flip" and data:
        data[i] ^= 1 << (i % 8)
    elif how == "zero":
        data[i : i + 16] = bytes(len(data[i : i + 16]))
    elif how == "truncate":
        del data[i:]
    path.write_bytes(bytes(data))


def _files(root: Path) -> Iterator[Path]:
    yield from sorted(p for p in root.rglob("*") if p.is_file() and p.name != "lock")


repos = st.lists(  # per backup: full?, and per partition the writes (key, deleted)
    st.tuples(
        st.booleans(),
        st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=6),
        st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=6),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(repos, st.data())
def test_one_damaged_file_gives_the_good_restore_or_an_error_naming_it(
    tmp_path_factory: pytest.TempPathFactory, spec: list[Any], data: st.DataObject
) -> None:
    base = tmp_path_factory.mktemp("prop")
    b = Builder(base / "r")
    for i, (full, *writes) in enumerate(spec):
        for p, ws in zip(PARTITIONS, writes, strict=True):
            for key, deleted in ws:
                b.sources[p].write(key, deleted)
        b.backup(full=full or i == 0)
    good = restored(b.repo.path, base / "good.db")
    victim = data.draw(st.sampled_from(list(_files(b.repo.path))), label="file")
    how = data.draw(st.sampled_from(["delete", "flip", "zero", "truncate"]), label="damage")
    before = victim.read_bytes()
    _damage(victim, how, data.draw(st.floats(0, 1), label="where"))
    changed = not victim.exists() or victim.read_bytes() != before
    try:
        got = restored(b.repo.path, base / "got.db")
    except UprError as exc:
        msg = str(exc)
        assert victim.name in msg, msg
        if victim.parent != b.repo.path:  # a backup's file: its backup is named too
            assert victim.parent.name in msg or victim.parent.parent.name in msg, msg
    else:
        assert got == good, (victim, how)
    if not changed:
        return
    # verify names the damaged file (or fails naming it); --repair heals a manifest file
    try:
        reports = verify(b.repo.path)
    except UprError as exc:
        assert victim.name in str(exc)
        return
    if victim == b.repo.repo_file:  # no checksum: a flip can leave it valid, and harmless
        assert b.repo.info()
        return
    where = [f"{BUCKET}/{victim.relative_to(b.repo.path / BUCKET)}", str(victim.parent.name)]
    assert any(where[0] in p.where or (where[1] in p.where and p.kind == "manifest")
               for r in reports for p in r.problems), (victim, reports)  # fmt: skip
    # committed data is never swept
    dirs = sorted(p for p in (b.repo.path / BUCKET).iterdir() if p.is_dir())
    sweep(b.repo, bid(len(spec)))
    assert all(d.is_dir() for d in dirs)
    if victim.name in (MANIFEST_FILE, MANIFEST_COPY):
        verify(b.repo.path, repair=True)
        assert victim.read_bytes() == before
        assert all(not r.problems for r in verify(b.repo.path))
