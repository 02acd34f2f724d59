"""Packs (formats/repository.md §12): the format, the writer and the strict parser."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from upr_cli.repo.errors import RepositoryError
from upr_cli.repo.pack import (
    HEADER,
    PACK_NAME,
    TRAILER,
    PackError,
    check_pack,
    load_index,
    write_pack,
)
from upr_cli.segments.format import SegmentError
from upr_cli.storage import LocalStorage

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
