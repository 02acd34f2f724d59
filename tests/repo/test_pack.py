"""Packs (formats/repository.md §12): the format, the writer and the strict parser."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.repo.chain_gen import build
from tests.repo.pack_helpers import STEPS, check_packed_repository, observe, pack_backup
from tests.repo.repo_helpers import BUCKET, run_upr
from upr_cli.jobs.inspect import verify
from upr_cli.jobs.restore import restore_to_store
from upr_cli.repo import MANIFEST_FILE, BackupId, Repository, RepositoryLock, access
from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.manifests import MANIFEST_COPY
from upr_cli.repo.pack import (
    HEADER,
    PACK_NAME,
    TRAILER,
    PackedStorage,
    PackError,
    check_pack,
    load_index,
    write_pack,
)
from upr_cli.segments.format import SegmentError
from upr_cli.storage import LocalStorage, Stat
from upr_cli.store import Store

SEG1 = "p0003-s0000000000000001-e0000000000000009.seg"
SEG2 = "p0004-s0000000000000001-e0000000000000002.seg"
CUT = "cut-1/p0003-s0000000000000001-e0000000000000004.seg"


def _members(tmp: Path) -> list[tuple[str, Path]]:
    out = []
    for i, name in enumerate((SEG1, SEG2, CUT)):
        f = tmp / f"local{i}"
        f.write_bytes(bytes([i + 1]) * (100 * (i + 1)) + os.urandom(i * 70_000))
        out.append((name, f))
    return out


def test_write_pack_roundtrip(tmp_path: Path) -> None:
    d = tmp_path / "b"
    d.mkdir()
    members = _members(tmp_path)
    storage = LocalStorage()
    size = write_pack(storage, d, members)
    pack = d / PACK_NAME
    assert pack.stat().st_size == size
    assert [p.name for p in d.iterdir()] == [PACK_NAME]  # no temp file left
    index = load_index(storage, pack, size)
    assert sorted(index.members) == sorted(n for n, _ in members)
    data = pack.read_bytes()
    assert data[:8] == b"UPR-PACK"
    for name, local in members:
        m = index.members[name]
        assert data[m.offset : m.offset + m.length] == local.read_bytes()
    assert index.subdirs() == ["cut-1"]
    assert check_pack(storage, pack) == index


def test_write_pack_refuses_bad_names(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"x")
    for bad in ("manifest.json", "cut-0/" + SEG1, "../" + SEG1):
        with pytest.raises(RepositoryError):
            write_pack(LocalStorage(), tmp_path, [(bad, f)])
    with pytest.raises(RepositoryError, match="twice"):
        write_pack(LocalStorage(), tmp_path, [(SEG1, f), (SEG1, f)])
    assert not (tmp_path / PACK_NAME).exists()


@pytest.mark.parametrize("where", ["header", "member", "index", "trailer", "truncated", "cut"])
def test_damaged_pack_is_a_pack_error(tmp_path: Path, where: str) -> None:
    d = tmp_path / "b"
    d.mkdir()
    storage = LocalStorage()
    size = write_pack(storage, d, _members(tmp_path))
    pack = d / PACK_NAME
    data = bytearray(pack.read_bytes())
    ix_at, ix_len = struct.unpack(">QQ", data[-TRAILER.size : -TRAILER.size + 16])
    at = {"header": 9, "member": HEADER.size + 5, "index": ix_at + 7, "trailer": size - 10}
    if where in at:
        data[at[where]] ^= 0x40
    elif where == "truncated":
        data = data[: size - 1]
    else:
        data = data[: ix_at + ix_len // 2]
    pack.write_bytes(bytes(data))
    with pytest.raises(PackError) as exc:
        check_pack(storage, pack)
    assert isinstance(exc.value, SegmentError)
    assert str(pack) in str(exc.value) and "\n" not in str(exc.value)
    if where != "member":  # the index alone does not read the members
        with pytest.raises(PackError):
            load_index(storage, pack, len(data))


# -- a packed repository reads as before -------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_access(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("UPR_KEY_FILE", "UPR_PASSPHRASE", "UPR_FROM_KEY_FILE", "UPR_FROM_PASSPHRASE"):
        monkeypatch.delenv(name, raising=False)
    access.reset()
    yield
    access.reset()


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A plain chain (cut-backs, a rollback, collections) and what readers make of it."""
    root = tmp_path_factory.mktemp("pack")
    src = root / "src"
    build(Repository(src), STEPS)
    return src, observe(src, root)


def test_a_packed_plain_repository(chain: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    check_packed_repository(*chain, tmp_path / "dst", tmp_path, encrypted=False)


def test_a_packed_encrypted_repository(chain: tuple[Path, dict[str, Any]], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("UPR_PASSPHRASE", "a passphrase")
    monkeypatch.setenv("UPR_FROM_PASSPHRASE", "a passphrase")  # the copy of the copy
    check_packed_repository(*chain, tmp_path / "dst", tmp_path, encrypted=True)


@pytest.mark.parametrize("damage", ["index", "truncated"])
def test_a_damaged_pack_is_named_and_refused(chain: tuple[Path, dict[str, Any]], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             damage: str) -> None:  # fmt: skip
    dst = tmp_path / "r"
    shutil.copytree(chain[0], dst)
    repo = Repository(dst)
    pack = pack_backup(repo, BUCKET, repo.backups(BUCKET)[1])
    data = bytearray(pack.read_bytes())
    if damage == "index":
        (ix_at,) = struct.unpack(">Q", data[-TRAILER.size : -TRAILER.size + 8])
        data[ix_at + 9] ^= 0x01
    else:
        del data[-100:]
    pack.write_bytes(bytes(data))
    code, out, err = run_upr(capsys, "verify", "--repo", str(dst), "--json")
    assert code != 0
    problems = [p for b in json.loads(out)["buckets"] for p in b["problems"]]
    segs = [p for p in problems if p["where"].endswith(".seg")]
    assert segs and all(f"{pack}: damaged pack" in p["detail"] for p in segs)
    code, out, err = run_upr(capsys, "restore", "--repo", str(dst), f"sqlite:{tmp_path / 'x.db'}")
    assert code != 0 and not out
    assert err.count("\n") == 1 and str(pack) in err and "damaged pack" in err
    assert not (tmp_path / "x.db").exists()


def test_an_uncommitted_packed_directory_is_never_resumed(
    chain: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A follower killed between its pack and its manifest: a leftover the sweep removes,
    never the run the next backup goes on in."""
    dst = tmp_path / "r"
    shutil.copytree(chain[0], dst)
    repo = Repository(dst)
    ids = repo.backups(BUCKET)
    pack_backup(repo, BUCKET, ids[-1])
    d = repo.backup_dir(BUCKET, ids[-1])
    (d / MANIFEST_FILE).unlink()
    (d / MANIFEST_COPY).unlink()
    repo = Repository(dst)
    assert repo.resumable(BUCKET) is None
    assert repo.incomplete(BUCKET) == [] and repo.packed_leftovers(BUCKET) == [ids[-1]]
    assert repo.leftovers(BUCKET) == [ids[-1]]
    running = repo.next_backup_id(BUCKET)
    with RepositoryLock(repo, BUCKET) as lock:
        removed = repo.sweep(BUCKET, running, lock)
    assert d in removed and not d.exists()
    assert Repository(dst).backups(BUCKET) == ids[:-1]


class _Counting(LocalStorage):
    """A local directory that counts the calls that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def stat(self, path: Path, *, follow_links: bool = False) -> Stat | None:
        self.calls.append(f"stat {path.name}")
        return super().stat(path, follow_links=follow_links)

    def read(self, path: Path, offset: int = 0, length: int = -1) -> bytes:
        self.calls.append(f"read {path.name}")
        return super().read(path, offset, length)


def test_the_layer_reads_an_index_once_and_costs_one_stat_without_a_pack(
    tmp_path: Path,
) -> None:
    d = tmp_path / "20261121T061500.000000Z"
    d.mkdir()
    write_pack(LocalStorage(), d, _members(tmp_path))
    plain = tmp_path / "20261121T071500.000000Z"
    plain.mkdir()
    (plain / SEG1).write_bytes(b"a real file")
    inner = _Counting()
    s = PackedStorage(inner)
    for _ in range(3):
        assert s.read(d / SEG2) == (tmp_path / "local1").read_bytes()
        assert s.read(d / CUT, 5, 7) == (tmp_path / "local2").read_bytes()[5:12]
        assert s.stat(plain / SEG1).size == 11  # type: ignore[union-attr]
        assert s.read(plain / SEG1) == b"a real file"
    assert inner.calls.count(f"stat {PACK_NAME}") == 2  # once per directory
    assert inner.calls.count(f"read {PACK_NAME}") == 2 + 6  # its head and end, once; members
    # a window: seeks from its start and its end, reads stop at its end
    with s.open_read(d / CUT) as f:
        want = (tmp_path / "local2").read_bytes()
        assert f.seek(0, 2) == len(want)
        f.seek(-10, 2)
        assert f.read(100) == want[-10:] and f.read(1) == b""
        f.seek(3)
        assert f.read(4) == want[3:7]
    # listing: the members as files, cut-1 as a directory; the pack itself is listed too
    assert sorted(e.name for e in s.list(d)) == sorted(["cut-1", PACK_NAME, SEG1, SEG2])
    assert [e.name for e in s.list(d / "cut-1")] == [CUT.split("/")[1]]
    assert s.stat(d / "cut-1").is_dir  # type: ignore[union-attr]
    # link: the member's bytes as a real file; an existing one is refused
    dst = tmp_path / "copy.seg"
    s.link(d / CUT, dst)
    assert dst.read_bytes() == (tmp_path / "local2").read_bytes()
    with pytest.raises(FileExistsError):
        s.link(d / CUT, dst)
    # a pack written later (by another process) is found when a member is missed
    late = tmp_path / "20261121T081500.000000Z"
    late.mkdir()
    assert s.stat(late / SEG1) is None
    write_pack(LocalStorage(), late, _members(tmp_path)[:1])
    assert sorted(e.name for e in s.list(late)) == sorted([PACK_NAME, SEG1])
    assert s.stat(late / SEG1).size == 100  # type: ignore[union-attr]


VECTOR = Path(__file__).resolve().parents[2] / "formats" / "vectors" / "packed-repo"


def test_the_vector_opens(tmp_path: Path) -> None:
    """formats/vectors/packed-repo (made by make_packed_repo.py): a packed continuous
    commit with a cut-back member, read as the states it records."""
    expected = json.loads((VECTOR / "expected.json").read_text())
    root = tmp_path / "repo"
    shutil.copytree(VECTOR / "repo", root)  # readers register: not in the source tree
    bucket = expected["bucket"]
    repo = Repository(root)
    packed = BackupId.parse(expected["packed"])
    d = repo.backup_dir(bucket, packed)
    assert sorted(p.name for p in d.iterdir()) == [MANIFEST_FILE, MANIFEST_COPY, PACK_NAME]
    index = check_pack(LocalStorage(), d / PACK_NAME)
    assert list(index.members) == expected["members"]
    m = repo.read_manifest(bucket, packed)
    assert m.continuous is not None
    assert [p for r in verify(root) for p in r.problems] == []
    for at, want in expected["states"].items():
        db = tmp_path / f"{at}.db"
        restore_to_store(root, db, at=at)
        with Store(db, create=False) as s:
            got: dict[str, dict[str, str]] = {}
            for doc in s.documents(include_deleted=False):
                got.setdefault(str(doc.partition), {})[doc.key.decode()] = doc.value.decode()
        assert got == want


def test_a_paced_pack_is_synced_as_it_grows_and_reads_the_same(tmp_path: Path) -> None:
    """`write_pack(paced=N)` (a rollup's staged pack): an fsync every N bytes written,
    so no large writeback builds up; the pack is the same bytes as an unpaced one."""

    class Counting(LocalStorage):
        syncs = 0

        def sync(self, f: Any) -> None:
            Counting.syncs += 1
            super().sync(f)

    members = [(f"p{i:04x}-s0000000000000001-e0000000000000001.seg", bytes([i]) * 3000)
               for i in range(8)]  # fmt: skip
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_pack(Counting(), tmp_path / "a", members, paced=5000)
    paced_syncs = Counting.syncs
    Counting.syncs = 0
    write_pack(Counting(), tmp_path / "b", members)
    assert paced_syncs == Counting.syncs + 4  # every two members, then the final one
    assert (tmp_path / "a" / PACK_NAME).read_bytes() == (tmp_path / "b" / PACK_NAME).read_bytes()
