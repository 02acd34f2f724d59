"""The `Storage` contract on both backends (a local directory and s3:// on moto), and
what S3Storage adds: retries through the one policy, bounded; resumed ranged reads;
multipart uploads from a spool; one-line errors."""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.s3.fault_proxy import Fault, FaultProxy
from upr_cli import s3 as s3mod
from upr_cli.net.retry import RetryPolicy
from upr_cli.repo.errors import RepositoryError
from upr_cli.s3 import S3Error, S3Storage
from upr_cli.storage import LocalStorage, Storage, parse_location

FAST = RetryPolicy(attempts=s3mod.ATTEMPTS, first=0.01, cap=0.05)


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3mod, "POLICY", FAST)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Storage, Path]]:
    if request.param == "local":
        root = tmp_path / "repo"
        root.mkdir()
        yield LocalStorage(), root
        return
    bucket = request.getfixturevalue("s3")
    root = parse_location(f"s3://{bucket}/some/prefix")
    yield S3Storage(root), root


def names(storage: Storage, path: Path) -> dict[str, str]:
    return {e.name: "dir" if e.is_dir else "file" for e in storage.list(path)}


def test_write_read_stat_list(store: tuple[Storage, Path]) -> None:
    s, root = store
    assert s.stat(root / "missing") is None
    assert s.list(root / "missing") == []
    s.write(root / "a.json", b"0123456789")
    s.make_dirs(root / "d")
    s.write(root / "d" / "x.seg", b"xyz")
    st = s.stat(root / "a.json")
    assert st is not None and st.is_file and not st.is_dir and st.size == 10
    d = s.stat(root / "d")
    assert d is not None and d.is_dir
    assert names(s, root) == {"a.json": "file", "d": "dir"}
    assert s.read(root / "a.json") == b"0123456789"
    assert s.read(root / "a.json", 3, 4) == b"3456"
    assert s.read(root / "a.json", 8, 100) == b"89"
    s.write(root / "a.json", b"new")  # replaces
    assert s.read(root / "a.json") == b"new"
    st2 = s.stat(root / "a.json")
    assert st2 is not None and st2.version != st.version
    with pytest.raises(FileNotFoundError):
        s.read(root / "missing")


def test_write_if_absent_and_make_dir(store: tuple[Storage, Path]) -> None:
    s, root = store
    s.write_if_absent(root / "repo.json", b"one")
    with pytest.raises(FileExistsError):
        s.write_if_absent(root / "repo.json", b"two")
    assert s.read(root / "repo.json") == b"one"
    s.make_dirs(root / "b")
    s.write(root / "b" / "f", b"1")
    with pytest.raises(FileExistsError):
        s.make_dir(root / "b")  # objects under the prefix: taken, as mkdir(2) says
    with pytest.raises(OSError) as info:
        s.remove_dir(root / "b")
    assert info.value.errno in (errno.ENOTEMPTY, errno.EEXIST)


def test_pieces_replace_link_delete(store: tuple[Storage, Path]) -> None:
    s, root = store
    s.make_dirs(root / "b")
    tmp, final = root / "b" / ".p0.seg.tmp-1", root / "b" / "p0.seg"
    f = s.create(tmp)
    s.append(f, b"head-")
    src = (root.parent / "src.bin") if isinstance(s, LocalStorage) else None
    s.append(f, b"body")
    s.sync(f)
    f.close()
    assert src is None or not src.exists()
    s.replace(tmp, final)
    assert s.read(final) == b"head-body"
    assert names(s, root / "b") == {"p0.seg": "file"}  # the temp name is gone
    s.link(final, root / "b" / "p0.link")
    with pytest.raises(FileExistsError):
        s.link(final, root / "b" / "p0.link")
    assert s.read(root / "b" / "p0.link") == b"head-body"
    r = s.open_read(final)
    assert r.seek(-4, 2) == 5 and r.read() == b"body"
    r.seek(0)
    assert r.read(5) == b"head-"
    r.close()
    s.delete(root / "b" / "p0.link")
    s.delete(root / "b" / "p0.link")  # missing: nothing
    assert names(s, root / "b") == {"p0.seg": "file"}
    s.replace(root / "b", root / ".b.tmp-1234abcd")  # a directory moves whole
    assert names(s, root) == {".b.tmp-1234abcd": "dir"}
    assert names(s, root / ".b.tmp-1234abcd") == {"p0.seg": "file"}
    s.delete_tree(root / ".b.tmp-1234abcd")
    assert s.list(root) == []


def test_a_directory_on_its_way_out_is_removed_without_copies(s3: str, proxy: FaultProxy) -> None:
    root = parse_location(f"s3://{s3}/r")
    s = S3Storage(root)
    d = root / "default" / "20261206T000000.000000Z"
    for name in ("manifest.json", "manifest.json.copy", "p0000.seg", "cut-1/p0000.seg"):
        s.write(d / name, b"x")
    proxy.clear()
    s.replace(d, d.with_name(".20261206T000000.000000Z.tmp-1234abcd-removed"))  # the sweep's
    s.delete_tree(d.with_name(".20261206T000000.000000Z.tmp-1234abcd-removed"))  # discard
    assert s.list(root / "default") == []
    assert [r for r in proxy.requests("PUT") if r.status == 200] == []  # nothing copied
    deletes = [r.path.rsplit("/", 1)[-1] for r in proxy.requests("DELETE")]
    assert deletes == ["manifest.json", "manifest.json.copy"]  # the commit points first


def test_a_dropped_spool_never_reaches_the_bucket(s3: str, proxy: FaultProxy) -> None:
    root = parse_location(f"s3://{s3}/r")
    s = S3Storage(root)
    f = s.create(root / ".x.tmp")
    s.append(f, b"data")
    f.close()
    s.delete(root / ".x.tmp")
    assert proxy.requests("PUT") == []
    assert s.list(root) == []


def test_a_large_file_is_uploaded_in_parts_in_parallel(s3: str, proxy: FaultProxy) -> None:
    root = parse_location(f"s3://{s3}/r")
    s = S3Storage(root, transfers=3)
    data = bytes(range(256)) * (((2 * s3mod.PART_SIZE) + 12345) // 256)
    f = s.create(root / ".big.tmp")
    s.append(f, data)
    f.close()
    s.replace(root / ".big.tmp", root / "big")
    s.sync_all([root / "big"])  # the upload runs in the background until then
    assert len([r for r in proxy.requests("PUT", "/big") if "partNumber=" in r.path]) == 3
    assert s.read(root / "big") == data
    assert s.read(root / "big", s3mod.PART_SIZE - 2, 4) == data[s3mod.PART_SIZE - 2 :][:4]


def test_transient_errors_are_retried_a_bounded_number_of_times(
    s3: str, proxy: FaultProxy, fast_retries: None
) -> None:
    root = parse_location(f"s3://{s3}/r")
    s = S3Storage(root)
    proxy.add(Fault("status", 2, "PUT", status=503), Fault("close", 1, "PUT"))
    s.write(root / "a", b"x")  # two 503s and a dropped connection, then it lands
    assert [r.status for r in proxy.requests("PUT")] == [503, 503, 0, 200]
    proxy.clear()
    proxy.add(Fault("status", 100, "GET", status=500))
    with pytest.raises(S3Error, match=r"get failed after 6 attempts"):
        s.read(root / "a")
    assert len(proxy.requests("GET")) == s3mod.ATTEMPTS + 1  # bounded: no more


def test_a_read_cut_off_mid_body_resumes_where_it_stopped(
    s3: str, proxy: FaultProxy, fast_retries: None
) -> None:
    root = parse_location(f"s3://{s3}/r")
    s = S3Storage(root)
    data = bytes(range(256)) * 4096  # 1 MiB
    s.write(root / "seg", data)
    proxy.clear()
    proxy.add(Fault("drop", 2, "GET", nbytes=300_000))
    assert s.read(root / "seg") == data
    gets = proxy.requests("GET")
    assert [g.fault for g in gets] == ["drop", "drop", None]


def test_a_slow_answer_times_out_and_is_retried(
    s3: str, proxy: FaultProxy, fast_retries: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPR_S3_READ_TIMEOUT", "0.5")
    root = parse_location(f"s3://{s3}/r")
    s = S3Storage(root)
    s.write(root / "a", b"x")
    proxy.add(Fault("delay", 1, "GET", seconds=1.5))
    assert s.read(root / "a") == b"x"
    assert [g.fault for g in proxy.requests("GET")] == ["delay", None]


def test_write_if_absent_whose_answer_was_lost_is_its_own_success(
    s3: str, proxy: FaultProxy, fast_retries: None
) -> None:
    root = parse_location(f"s3://{s3}/r")
    s = S3Storage(root)
    proxy.add(Fault("drop", 1, "PUT", nbytes=-1))  # it lands; its answer is lost
    s.write_if_absent(root / "repo.json", b"mine")
    puts = proxy.requests("PUT")
    assert [p.status for p in puts] == [0, 412]  # the retry met its own object
    with pytest.raises(FileExistsError):
        s.write_if_absent(root / "repo.json", b"other")


def test_no_such_bucket_and_no_credentials_are_one_line(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = S3Storage(parse_location("s3://no-such-bucket-here/r"))
    with pytest.raises(S3Error, match=r"^s3://no-such-bucket-here: no such bucket$"):
        s.list(s.root)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s = S3Storage(parse_location(f"s3://{s3}/r"))
    with pytest.raises(RepositoryError, match="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        s.stat(s.root / "repo.json")


def test_a_second_reader_reads_the_spooled_copy_and_large_objects_come_in_windows(
    s3: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = parse_location(f"s3://{s3}/r")
    s = S3Storage(root)
    small, large = b"s" * 5000, bytes(range(256)) * (3 * s3mod.WINDOW // 256)
    s.write(root / "small.seg", small)
    s.write(root / "large.seg", large)
    proxy.clear()
    for _ in range(2):  # a checksum pass, then the write pass: one download
        with s.open_read(root / "small.seg") as f:
            assert f.seek(-10, 2) == 4990 and f.read() == small[-10:]
    assert len(proxy.requests("GET", "small.seg")) == 1
    monkeypatch.setenv("UPR_S3_CACHE_BYTES", "0")  # no spool: ranged reads
    with s.open_read(root / "large.seg") as f:
        f.seek(-8, 2)
        assert f.read() == large[-8:]
        f.seek(len(large) - s3mod.WINDOW + 5)
        assert f.read(10) == large[len(large) - s3mod.WINDOW + 5 :][:10]  # same window
        f.seek(0)
        assert f.read(3) == large[:3]
        assert f.read(s3mod.WINDOW) == large[3 : s3mod.WINDOW + 3]
    assert len(proxy.requests("GET", "large.seg")) == 3


def test_files_are_uploaded_transfers_at_a_time_and_settled_before_a_write(
    s3: str, proxy: FaultProxy
) -> None:
    root = parse_location(f"s3://{s3}/r")
    s = S3Storage(root, transfers=3)
    proxy.add(Fault("delay", 6, "PUT", ".seg", seconds=0.6))
    t0 = time.monotonic()
    for i in range(6):
        f = s.create(root / f".{i}.seg.tmp")
        s.append(f, b"segment %d" % i)
        f.close()
        s.replace(root / f".{i}.seg.tmp", root / f"{i}.seg")  # returns at once
    assert time.monotonic() - t0 < 0.6
    s.write(root / "manifest.json", b"{}")  # the commit point: after every segment
    assert time.monotonic() - t0 < 6 * 0.6 - 0.5  # three at a time, not one by one
    puts = [r.path.rsplit("/", 1)[-1] for r in proxy.requests("PUT")]
    assert puts[-1] == "manifest.json" and sorted(puts[:-1]) == [f"{i}.seg" for i in range(6)]
    assert s.read(root / "3.seg") == b"segment 3"
