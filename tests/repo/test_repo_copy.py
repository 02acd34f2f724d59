"""`upr repo copy` (upr_cli/jobs/repo_copy.py): a copy restores, verifies and `info`s
exactly as its source; it is verified as it goes (a corrupt source file stops it, and
the destination keeps only whole backups), resumable after a SIGKILL at a seeded point,
idempotent, and it refuses a destination that is not a copy of its source.

The source is a generated chain (tests/repo/chain_gen.py: updates, deletes, rollbacks,
cut-backs, full backups in the middle, a dropped collection) that `upr remove` then
merged forward into two revisions (absorbed backups, carried lost writes) and `upr
merge` merged through an older backup (`merged_through`).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from tests.repo.chain_gen import Step, build, restored
from tests.repo.kill_helpers import KILLED, pick, run_upr
from tests.repo.repo_helpers import BUCKET
from upr_cli.errors import UsageError
from upr_cli.jobs.inspect import info, verify
from upr_cli.jobs.merge import merge
from upr_cli.jobs.prune import run as prune
from upr_cli.jobs.repo_copy import (
    CHUNK,
    CorruptSource,
    Diverged,
    SourceAccess,
    copy_repository,
    source_access,
)
from upr_cli.repo import MANIFEST_FILE, BackupId, Repository, access, layout
from upr_cli.repo.access import Access
from upr_cli.repo.layout import NotARepository
from upr_cli.storage import LocalStorage

STEPS = [
    Step("full", (5, 5, 5), (0, 0, 0), (False, False, False), 1),
    Step("inc", (4, 3, 0), (0, 0, 0), (True, False, False), 2),
    Step("inc", (3, 4, 5), (0, 3, 0), (False, False, False), 3),
    Step("full", (2, 2, 2), (0, 0, 0), (False, False, False), 4),
    Step("drop", (3, 0, 4), (0, 0, 0), (False, False, False), 5),
    Step("inc", (4, 4, 4), (0, 0, 6), (False, False, False), 6),
    Step("inc", (2, 5, 1), (0, 0, 0), (False, True, False), 7),
    Step("inc", (3, 3, 3), (1, 0, 0), (False, False, False), 8),
]


def _source(root: Path) -> Path:
    src = root / "src"
    ids = [str(m.backup_id) for m in build(Repository(src), STEPS)]
    prune(src, bucket=None, rules=None, names=[ids[1], ids[5]], apply_=True, drop_lost=False)
    merge(src, through=ids[3], bucket=None)
    return src


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _source(tmp_path_factory.mktemp("copy"))


@pytest.fixture(autouse=True)
def _fresh_access() -> Any:
    access.reset()
    yield
    access.reset()


def _info(path: Path) -> dict[str, Any]:
    out = info(path, partitions=[0, 1, 2])
    del out["repository"]
    return out


def _sizes_dropped(value: Any) -> Any:
    """`value` without its bytes_on_disk figures (sealed files are larger than plain)."""
    if isinstance(value, dict):
        return {k: _sizes_dropped(v) for k, v in value.items() if k != "bytes_on_disk"}
    if isinstance(value, list):
        return [_sizes_dropped(v) for v in value]
    return value


def _ids(path: Path) -> list[BackupId]:
    return Repository(path).backups(BUCKET)


def _states(path: Path, work: Path) -> dict[str, Any]:
    return {str(b): restored(path, b, work / f"{path.name}-{b}.db") for b in _ids(path)}


def _clean(path: Path) -> None:
    reports = verify(path)
    assert [p for r in reports for p in r.problems] == []
    assert [
        x for r in reports for x in (*r.leftovers, *([r.resumable] if r.resumable else []))
    ] == []


def test_the_copy_restores_verifies_and_infos_as_the_source(source: Path, tmp_path: Path) -> None:
    src_repo = Repository(source)
    ms = src_repo.readable(BUCKET)[0]
    # the source has what the copy must carry: revisions, absorbed backups, a merge
    # through an older backup, rollbacks, cut-backs (lost writes), collections
    assert any(m.revision > 1 and m.absorbed for m in ms)
    assert any(m.merged_through is not None for m in ms)
    assert any(e.rollback is not None for m in ms for e in m.partitions)
    assert any(e.cut_backs for m in ms for e in m.partitions)
    dst = tmp_path / "dst"
    access.configure(transfers=3)
    result = copy_repository(source, dst)
    assert result.copied == len(ms) and result.skipped == 0
    assert result.bytes == sum(s.bytes for m in ms for e in m.partitions
                               for s in (*e.segments, *(x for _, x in e.cut_files())))  # fmt: skip
    assert _info(dst) == _info(source)
    assert _states(dst, tmp_path) == _states(source, tmp_path)
    _clean(dst)
    for m in ms:  # the manifest files are the source's, byte for byte
        d = Repository(dst).backup_dir(BUCKET, m.backup_id)
        assert d.name == src_repo.backup_dir(BUCKET, m.backup_id).name
        assert (d / MANIFEST_FILE).read_bytes() == (
            src_repo.backup_dir(BUCKET, m.backup_id) / MANIFEST_FILE
        ).read_bytes()

    # idempotent: nothing left to copy, nothing written
    def files() -> list[tuple[Path, int]]:
        return sorted((p, p.stat().st_mtime_ns) for p in dst.rglob("*") if p.is_file())

    before = files()
    again = copy_repository(source, dst)
    assert (again.copied, again.skipped, again.bytes) == (0, len(ms), 0)
    assert files() == before


def test_a_dry_run_lists_what_would_be_copied_and_changes_nothing(
    source: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "dst"
    plan = copy_repository(source, dst, dry_run=True)
    assert not dst.exists()
    ids = [str(b) for b in _ids(source)]
    assert plan.dry_run and plan.buckets[0].copied == ids and plan.bytes > 0
    copy_repository(source, dst, bucket=BUCKET)
    again = copy_repository(source, dst, dry_run=True)
    assert again.buckets[0].copied == [] and again.buckets[0].skipped == ids


def test_a_corrupt_source_segment_stops_the_copy_and_leaves_whole_backups(
    source: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    shutil.copytree(source, src)
    repo = Repository(src)
    ids = _ids(src)
    bad_id = ids[4]
    m = repo.read_manifest(BUCKET, bad_id)
    seg = repo.segment_path(BUCKET, bad_id, m.partitions[-1].segments[-1].file)
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x40
    seg.write_bytes(bytes(data))
    dst = tmp_path / "dst"
    with pytest.raises(CorruptSource) as exc:
        copy_repository(src, dst)
    msg = str(exc.value)
    assert "\n" not in msg and str(seg) in msg and "corrupt source segment" in msg
    assert _ids(dst) == ids[:4]  # the backups before it, whole; nothing of it
    assert not any(p.name.startswith(str(bad_id)) for p in (dst / BUCKET).iterdir())
    _clean(dst)
    # a missing one is named too
    seg.unlink()
    with pytest.raises(CorruptSource, match="source segment missing"):
        copy_repository(src, dst)
    assert _ids(dst) == ids[:4]


def test_a_destination_with_other_backups_is_refused(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    copy_repository(source, dst)
    # another chain under the same ids (other records): not a copy of this source
    other = tmp_path / "other"
    build(Repository(other), [Step(s.kind, s.writes, s.rollback, s.cut_back, s.seed + 10)
                              for s in STEPS])  # fmt: skip
    before = _info(dst)
    with pytest.raises(Diverged, match="holds a different backup"):
        copy_repository(other, dst)
    assert _info(dst) == before
    # a destination holding a backup the source does not have
    fresh = tmp_path / "fresh"
    build(Repository(fresh), STEPS[:2])
    with pytest.raises(Diverged, match="which the source does not"):
        copy_repository(fresh, dst)


def test_a_copy_follows_a_prune_of_its_source(source: Path, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    shutil.copytree(source, src)
    copy_repository(src, dst)
    # the source is pruned: a third revision of a backup absorbs every older one
    older = Repository(src).backups(BUCKET)[-3]
    prune(src, bucket=None, rules=None, names=[f"..{older}"], apply_=True, drop_lost=False)
    newest = Repository(src).readable(BUCKET)[0]
    assert [m.revision for m in newest] == [3, 1] and len(newest[0].absorbed) == 7
    again = copy_repository(src, dst)
    assert (again.copied, again.skipped) == (1, 1)
    assert _info(dst) == _info(src)
    assert _states(dst, tmp_path) == _states(src, tmp_path)
    _clean(dst)
    # nothing stale is left: the older revision and the absorbed backups are swept
    assert sorted(p.name for p in (dst / BUCKET).iterdir()) == sorted(
        p.name for p in (src / BUCKET).iterdir()
    )
    # a backup the source removed outright stays in the destination: refused
    prune(src, bucket=None, rules=None, names=[str(newest[-1].backup_id)], apply_=True,
          drop_lost=False)  # fmt: skip
    with pytest.raises(Diverged, match="which the source does not"):
        copy_repository(src, dst)


def test_bad_locations_are_refused(source: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="are the same repository"):
        copy_repository(source, source)
    with pytest.raises(UsageError, match="nested"):
        copy_repository(source, source / "inside")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine\n")
    with pytest.raises(NotARepository, match="not empty and not a upr repository"):
        copy_repository(source, notes)
    assert sorted(p.name for p in notes.iterdir()) == ["todo.txt"]
    with pytest.raises(NotARepository):
        copy_repository(tmp_path / "nothing", tmp_path / "dst")
    with pytest.raises(UsageError, match="no bucket 'nope'"):
        copy_repository(source, tmp_path / "dst", bucket="nope")
    assert not (tmp_path / "dst").exists()


def test_the_source_has_its_own_key_options(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("UPR_KEY_FILE", str(tmp_path / "dst.key"))
    monkeypatch.setenv("UPR_PASSPHRASE", "destination")
    monkeypatch.delenv("UPR_FROM_KEY_FILE", raising=False)
    monkeypatch.delenv("UPR_FROM_PASSPHRASE", raising=False)
    access.configure(transfers=5, key_file=tmp_path / "cli.key")
    a = source_access()
    assert isinstance(a, SourceAccess) and a.transfers == 5
    assert a.key_path() is None and a.passphrase() is None and a.key_command is None
    monkeypatch.setenv("UPR_FROM_KEY_FILE", str(tmp_path / "src.key"))
    monkeypatch.setenv("UPR_FROM_PASSPHRASE", "s3cr3t-src")
    assert a.key_path() == tmp_path / "src.key" and a.passphrase() == b"s3cr3t-src"
    b = source_access(tmp_path / "given.key", "echo k")
    assert b.key_path() == tmp_path / "given.key" and b.key_command == "echo k"
    # the repository keeps what it was opened with; by default the command's
    assert Repository(tmp_path / "r", access=b).access is b
    assert Repository(tmp_path / "r").access is access.current()
    assert "s3cr3t" not in repr(b)


def test_encrypt_creates_an_encrypted_destination(source: Path, tmp_path: Path) -> None:
    pytest.importorskip("upr_cli.repo.keys")
    key = tmp_path / "k"
    key.write_bytes(b"a passphrase\n")
    access.configure(key_file=key)
    dst = tmp_path / "dst"
    result = copy_repository(source, dst, encrypt=True)
    assert result.encrypted and result.copied == len(_ids(source))
    assert _sizes_dropped(_info(dst)) == _sizes_dropped(_info(source))
    assert _states(dst, tmp_path) == _states(source, tmp_path)
    _clean(dst)
    some = next(p for p in (dst / BUCKET).rglob("*.seg"))
    assert some.read_bytes() != (source / BUCKET / some.relative_to(dst / BUCKET)).read_bytes()
    access.reset()
    plain = tmp_path / "plain"
    copy_repository(source, plain)
    access.configure(key_file=key)
    with pytest.raises(UsageError, match="plaintext repository exists"):
        copy_repository(source, plain, encrypt=True)
    # back from the encrypted copy: never a plaintext one by omission, only on purpose
    keyed = Access(key_file=key)
    with pytest.raises(UsageError, match="is encrypted: give --encrypt"):
        copy_repository(dst, tmp_path / "out", access=keyed)
    assert not (tmp_path / "out").exists()
    access.reset()
    result = copy_repository(dst, tmp_path / "out", decrypt=True, access=keyed)
    assert not result.encrypted and _states(tmp_path / "out", tmp_path) == _states(source, tmp_path)


# -- a copy SIGKILLed at a seeded point, then run again --------------------------------


def test_a_copy_killed_at_a_seeded_point_completes_when_run_again(
    source: Path, tmp_path: Path
) -> None:
    want_info = _info(source)
    ids = [str(b) for b in _ids(source)]
    full = run_upr(tmp_path / "probe", ["repo", "copy", "--from", str(source), "--to",
                                        str(tmp_path / "probe"), "--transfers", "2"],
                   tmp_path / "probe.log")  # fmt: skip
    assert full.rc == 0, full.err
    assert len(full.changes) > 20
    rng = random.Random(30)
    for i in range(int(os.environ.get("UPR_COPY_KILLS", "3"))):
        dst = tmp_path / f"dst{i}"
        n, where = pick(full.changes, rng)
        args = ["repo", "copy", "--from", str(source), "--to", str(dst), "--transfers", "2"]
        killed = run_upr(dst, args, tmp_path / f"kill{i}.log", kill_at=n)
        assert killed.rc == KILLED, (where, killed.err)
        if (dst / "repo.json").exists():
            # what was committed before the kill is a prefix of the chain, whole
            got = [str(b) for b in _ids(dst)]
            assert got == ids[: len(got)], where
            assert [p for r in verify(dst) for p in r.problems
                    if p.kind != "manifest"] == [], where  # fmt: skip
        again = run_upr(dst, [*args, "--json"], tmp_path / f"again{i}.log")
        assert again.rc == 0, (where, again.err)
        out = json.loads(again.out)
        assert out["backups_copied"] + out["backups_skipped"] == len(ids), where
        assert _info(dst) == want_info, where
        _clean(dst)
        # (a kill while repo.json is raised to version 2 leaves its temp file at the
        # root, as it would in a prune: no sweep looks there)
        stray = [p for p in dst.rglob("*") if ".tmp-" in p.name and p.parent != dst]
        assert stray == [], where


class _Counting(LocalStorage):
    """The source's local storage, counting the files open for reading at once and the
    largest read asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.guard = threading.Lock()
        self.open = self.most = self.largest = 0

    def open_read(self, path: Path) -> IO[bytes]:
        storage = self
        f = super().open_read(path)

        class Reader(io.BufferedReader):
            def read(self, n: int | None = -1) -> bytes:
                with storage.guard:
                    storage.largest = max(storage.largest, n if n is not None else -1)
                time.sleep(0.01)  # long enough for the other threads to open theirs
                return f.read(n)

            def close(self) -> None:
                if not f.closed:  # once, whoever closes it (`with`, the collector)
                    with storage.guard:
                        storage.open -= 1
                    f.close()
                super().close()

        with self.guard:
            self.open += 1
            self.most = max(self.most, self.open)
        return Reader(io.BytesIO())


def test_files_are_copied_transfers_at_a_time_in_chunks(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _Counting()
    real = layout.open_storage

    def storage(root: Path, ops: Any = None, settings: Any = None) -> Any:
        return counting if root == source else real(root, ops, settings)

    monkeypatch.setattr(layout, "open_storage", storage)
    access.configure(transfers=2)
    copy_repository(source, tmp_path / "dst")
    assert counting.most == 2  # several at once, never more than --transfers
    assert counting.largest == CHUNK  # never a whole file at once
    access.configure(transfers=1)
    counting.most = 0
    copy_repository(source, tmp_path / "dst1")
    assert counting.most == 1
