"""Sealed files (upr_cli/repo/sealed.py, formats/repository.md §10.3): the format round
trip, random access, streaming writes read back and cut short, and every tamper the
format must catch: a flipped byte, swapped chunks, a cut at a chunk boundary, a chunk
from another repository, a file from another file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.repo import test_repo_storage as contract
from upr_cli.repo.sealed import HEADER, TAG, EncryptedStorage, SealedError, plain_size
from upr_cli.segments import SegmentHeader, SegmentReader, SegmentWriter
from upr_cli.segments.format import SegmentError
from upr_cli.storage import LocalStorage

C = 1024  # a small chunk: many chunks from little data
REPO_ID = bytes(range(16))
KEY = bytes(range(32))


def sealed(repo_id: bytes = REPO_ID, key: bytes = KEY) -> EncryptedStorage:
    return EncryptedStorage(LocalStorage(), repo_id, key, C)


@pytest.fixture
def store() -> EncryptedStorage:
    """The storage contract's backend (tests/repo/test_repo_storage.py): sealed."""
    return sealed()


# The storage contract, run over the sealing layer: it is a `Storage` like any backend.
test_contract_write_read_and_ranges = contract.test_write_read_and_ranges
test_contract_write_if_absent_never_replaces = contract.test_write_if_absent_never_replaces
test_contract_list_and_stat = contract.test_list_and_stat
test_contract_directories = contract.test_directories
test_contract_streaming_write_then_publish = contract.test_streaming_write_then_publish
test_contract_lock_file_descriptor = contract.test_lock_file_descriptor


def data(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


@pytest.mark.parametrize("n", [0, 1, C - 1, C, C + 1, 3 * C, 3 * C + 17])
def test_round_trip_sizes(tmp_path: Path, n: int) -> None:
    s, p = sealed(), tmp_path / "f.seg"
    s.write(p, data(n))
    raw = p.read_bytes()
    chunks = max(1, -(-n // C))
    assert len(raw) == HEADER.size + n + TAG * chunks  # every chunk full but the last
    assert raw[:8] == b"UPR-SEAL"
    assert n < 4 or data(n)[:64] not in raw
    st = s.stat(p)
    assert st is not None and st.size == n == plain_size(len(raw), C)
    assert s.read(p) == data(n)
    with s.open_read(p) as f:
        assert f.seek(0, os.SEEK_END) == n
        f.seek(0)
        assert f.read() == data(n)


def test_random_access(tmp_path: Path) -> None:
    s, p, d = sealed(), tmp_path / "f.seg", data(5 * C + 100)
    s.write(p, d)
    for off, length in [(0, 10), (C - 3, 6), (2 * C, C), (5 * C + 90, 50), (7 * C, 5),
                        (3 * C + 1, -1), (0, -1), (C, 0)]:  # fmt: skip
        want = d[off:] if length < 0 else d[off : off + length]
        assert s.read(p, off, length) == want, (off, length)
    with s.open_read(p) as f:
        f.seek(-100, os.SEEK_END)
        assert f.read(40) == d[-100:-60]
        f.seek(C + 5)
        buf = bytearray(10)
        assert f.readinto(buf) == 10 and bytes(buf) == d[C + 5 : C + 15]


def test_plain_files_pass_through(tmp_path: Path) -> None:
    s = sealed()
    (tmp_path / "b" / "readers").mkdir(parents=True)
    for rel in ("repo.json", "b/lock", "b/lock.shared", "b/readers/r1"):
        s.write(tmp_path / rel, b"plain")
        assert (tmp_path / rel).read_bytes() == b"plain"
    fd = s.open_lock(tmp_path / "b" / "lock", create=False)
    os.close(fd)


def test_streaming_writer_reads_back_and_cuts(tmp_path: Path) -> None:
    s, p, d = sealed(), tmp_path / "body", data(4 * C + 10)
    f = s.create(p)
    s.append(f, d[:100])
    s.append(f, d[100 : 3 * C])  # chunks 0, 1 sealed; chunk 2 (full) held
    s.append(f, d[3 * C :])
    f.seek(C - 5)
    assert f.read(20) == d[C - 5 : C + 15]  # a sealed chunk, read back
    f.seek(4 * C)
    assert f.read() == d[4 * C :]  # the pending one, from memory
    f.truncate(2 * C + 7)  # inside sealed chunks: re-sealed under a new file id
    f.seek(0, os.SEEK_END)
    s.append(f, b"tail")
    f.seek(0)
    assert f.read() == d[: 2 * C + 7] + b"tail"
    f.close()
    assert s.read(p) == d[: 2 * C + 7] + b"tail"
    assert s.stat(p).size == 2 * C + 11  # type: ignore[union-attr]


def test_copy_and_sync(tmp_path: Path) -> None:
    s, d = sealed(), data(3 * C)
    src = s.create(tmp_path / "a")
    s.append(src, d)
    src.seek(0)
    dst = s.create(tmp_path / "b")
    s.append(dst, b"x")
    s.copy(src, dst)
    s.sync(dst)
    with pytest.raises(ValueError, match="finished"):
        s.append(dst, b"more")  # the final chunk is sealed: no nonce is used twice
    dst.close()
    src.close()
    assert s.read(tmp_path / "b") == b"x" + d


def test_segments_through_sealed_storage(tmp_path: Path) -> None:
    """The segment writer spills, reads back, cuts and copies its body through the
    sealed layer; the reader seeks to the footer and reads blocks."""
    from upr_cli.failover import FailoverLog
    from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord

    s = sealed()
    log = FailoverLog.of([(1, 0)])
    hdr = SegmentHeader("b", 0, log, 0, 400, ((0, 400),), "2026-11-26T00:00:00.000000Z",
                        "upr://h/b", 256)  # fmt: skip
    rows = [DcpRecord(OP_MUTATION, 0, s, 1, s, 0, 0, 0, 0, b"k%d" % s, os.urandom(40), 0)
            for s in range(1, 401)]  # fmt: skip
    w = SegmentWriter(tmp_path / "p0.open", hdr, storage=s)
    w.add(rows[:150])
    w.spill()
    w.add(rows[150:300])
    w.spill()
    assert w.truncate(250) == 50  # cut inside the spilled body
    w.add(rows[250:])
    w.spill()
    info = w.finish(path=tmp_path / "p0.seg")
    assert s.stat(tmp_path / "p0.seg").size == info.bytes  # type: ignore[union-attr]
    with SegmentReader(tmp_path / "p0.seg", s) as r:
        assert [x.seq for x in r.records()] == list(range(1, 401))
    assert not [p for p in tmp_path.iterdir() if p.name != "p0.seg"]  # no scratch left
    with pytest.raises(SegmentError):  # sealed: not a segment to a plain reader
        SegmentReader(tmp_path / "p0.seg")


def _seal3(tmp_path: Path, name: str = "f.seg") -> tuple[EncryptedStorage, Path, bytearray]:
    s, p = sealed(), tmp_path / name
    s.write(p, data(3 * C - 10))
    return s, p, bytearray(p.read_bytes())


def _fails(s: EncryptedStorage, p: Path, chunk: int | None) -> SealedError:
    with pytest.raises(SealedError) as info:
        s.read(p)
    with pytest.raises(SealedError), s.open_read(p) as f:
        f.read()
    assert str(p) in str(info.value) and info.value.chunk == chunk
    assert isinstance(info.value, SegmentError)
    return info.value


def test_flipped_byte_names_file_and_chunk(tmp_path: Path) -> None:
    s, p, raw = _seal3(tmp_path)
    raw[HEADER.size + (C + TAG) + 5] ^= 1
    p.write_bytes(raw)
    err = _fails(s, p, 1)
    assert "chunk 1: fails authentication" in str(err)
    assert s.read(p, 0, 10) == data(10)  # chunk 0 is sound and read alone


def test_swapped_chunks(tmp_path: Path) -> None:
    s, p, raw = _seal3(tmp_path)
    step, h = C + TAG, HEADER.size
    a, b = raw[h : h + step], raw[h + step : h + 2 * step]
    raw[h : h + step], raw[h + step : h + 2 * step] = b, a
    p.write_bytes(raw)
    _fails(s, p, 0)


def test_truncated_at_a_chunk_boundary(tmp_path: Path) -> None:
    s, p, raw = _seal3(tmp_path)
    p.write_bytes(raw[: HEADER.size + 2 * (C + TAG)])
    assert s.stat(p).size == 2 * C  # type: ignore[union-attr]
    _fails(s, p, 1)  # chunk 1 was not sealed as the final one
    p.write_bytes(raw[: HEADER.size + 2 * (C + TAG) + 7])  # inside a tag
    with pytest.raises(SealedError, match="truncated"):
        s.open_read(p)
    p.write_bytes(raw[: HEADER.size])
    with pytest.raises(SealedError, match="truncated"):
        s.read(p)


def test_chunk_from_another_repository(tmp_path: Path) -> None:
    s, p, raw = _seal3(tmp_path)
    other = sealed(repo_id=bytes(16))  # same data key, another repository id
    with pytest.raises(SealedError):
        other.read(p)
    q = tmp_path / "g.seg"
    other.write(q, data(3 * C - 10))
    theirs = q.read_bytes()
    h = HEADER.size
    raw[h : h + C + TAG] = theirs[h : h + C + TAG]
    p.write_bytes(raw)
    _fails(s, p, 0)


def test_file_from_another_file(tmp_path: Path) -> None:
    """Chunks of one file in another's body fail (each file has its own key); a whole
    file renamed still opens: the manifests' digests catch that (test_encrypted_e2e)."""
    s, p, raw = _seal3(tmp_path)
    _, q, other = _seal3(tmp_path, "g.seg")
    h = HEADER.size
    raw[h + C + TAG :] = other[h + C + TAG :]
    p.write_bytes(raw)
    _fails(s, p, 1)
    os.replace(q, tmp_path / "renamed.seg")
    assert s.read(tmp_path / "renamed.seg") == data(3 * C - 10)


def test_wrong_data_key_and_plain_file(tmp_path: Path) -> None:
    s, p, _ = _seal3(tmp_path)
    with pytest.raises(SealedError, match="chunk 0"):
        sealed(key=bytes(32)).read(p)
    (tmp_path / "plain.seg").write_bytes(b"P" * 100)
    with pytest.raises(SealedError, match="bad magic"):
        s.read(tmp_path / "plain.seg")
