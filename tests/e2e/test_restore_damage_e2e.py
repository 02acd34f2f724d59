"""A restore from a damaged repository writes nothing, or (--skip-corrupt) every partition
without damage; a target that fails part-way is summarised and a rerun completes; keys
whose xattrs a node refuses are named and the rest is written (exit 4 when partial)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import docs
from tests.repo.repo_helpers import commit_backup
from upr_cli.jobs.restore import RestoreSummary, restore_to_node
from upr_cli.net.bootstrap import partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import Repository
from upr_cli.segments import SegmentReader
from upr_cli.store import Store

PARTS = 4  # few partitions, a few hundred documents: the restore reads the last one last


def write_repo(path: Path, rows: list[DcpRecord]) -> Path:
    """A repository (built with the library: real segment files and manifest) holding
    one full backup of `rows`, each in the partition its key hashes to over PARTS."""
    repo = Repository(path)
    repo.init()
    parts = {}
    for p in range(PARTS):
        mine = [r for r in rows if partition_of(bytes(r.key), PARTS) == p]
        parts[p] = [r._replace(vbucket=p, by_seqno=seq) for seq, r in enumerate(mine, 1)]
    commit_backup(repo, 0, parts)
    return path


def doc(i: int, blob: bytes = b"", key: bytes | None = None) -> DcpRecord:
    """Document `doc-i` (or `key`): a JSON value, its own cas, rev seq and flags."""
    return DcpRecord(OP_MUTATION, 0, 0, 1 + i % 3, (1000 + i) << 16, i, 0, 0, 1,
                     key or b"doc-%d" % i, b'{"n":%d}' % i, 0, 0, blob)  # fmt: skip


@pytest.fixture
def backed_up(tmp_path: Path) -> tuple[Path, dict[bytes, Any]]:
    """A repository of 240 documents in 4 partitions, and those documents as a node's
    stream gives them back (value, cas, rev seq, flags, expiry)."""
    rows = [doc(i) for i in range(240)]
    want = {bytes(r.key): (r.value, r.cas, r.rev_seqno, r.flags, 0) for r in rows}
    return write_repo(tmp_path / "repo", rows), want


def flip_in_block(repo: Path, partition: int) -> Path:
    """Flip one byte inside block 0 of `partition`'s segment (its CRC no longer matches)."""
    (seg,) = repo.glob(f"default/*/p{partition:04x}-*.seg")
    with SegmentReader(seg) as r:
        at = r.blocks[0].offset + r.blocks[0].compressed_len // 2
    data = bytearray(seg.read_bytes())
    data[at] ^= 0x10
    seg.write_bytes(bytes(data))
    return seg


def test_damage_stops_the_restore_before_the_first_write_unless_skip_corrupt(
    backed_up: tuple[Path, dict[bytes, Any]], node_factory: type[Node], tmp_path: Path
) -> None:
    repo, source = backed_up
    dst = node_factory("--flush-interval", "0.02", partitions=PARTS, name="dst").start()
    seg = flip_in_block(repo, PARTS - 1)  # the partition a restore reads last

    bad = upr("restore", "--repo", str(repo), dst.uri, check=False)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    assert f"{seg.name}, block 0: block checksum mismatch" in bad.stderr
    assert "nothing written" in bad.stderr
    assert docs(dst.uri) == {}  # not 3 partitions of 4
    # a SQLite target beside it: the store is not even created
    db = tmp_path / "r.db"
    bad_db = upr("restore", "--repo", str(repo), f"sqlite:{db}", check=False)
    assert bad_db.returncode == 1 and seg.name in bad_db.stderr and not db.exists()

    # --skip-corrupt: every other partition, the one left out named, exit 4
    out = upr("restore", "--repo", str(repo), "--skip-corrupt", "--json", dst.uri, check=False)
    assert out.returncode == 4, out.stderr
    report = json.loads(out.stdout)
    assert report["left_out"] == [PARTS - 1] and report["failure"] is None
    assert seg.name in report["skipped"][0] and report["precheck"]["blocks"] > 0
    want = {k: v for k, v in source.items() if partition_of(k, PARTS) != PARTS - 1}
    assert docs(dst.uri) == want and report["written"] == len(want)
    text = upr("restore", "--repo", str(repo), "--skip-corrupt", f"sqlite:{db}", check=False)
    assert text.returncode == 4
    assert f"left out (damaged segments): partition {PARTS - 1}" in text.stdout
    assert "checked before writing: 4 segments" in text.stdout
    with Store(db) as s:
        assert s.count() == len(want)

    # --no-check: the damage is met while writing; the summary says what was done
    late = upr("restore", "--repo", str(repo), "--no-check", dst.uri, check=False)
    assert late.returncode == 1
    assert late.stdout.startswith("stopped part-way restoring backup ")
    assert "checksums not checked before writing (--no-check)" in late.stdout
    assert "block checksum mismatch" in late.stderr
    assert "source partitions complete: partitions 0-2; run the same restore again" in late.stderr


def test_a_target_that_dies_part_way_is_summarised_and_a_rerun_completes(
    backed_up: tuple[Path, dict[bytes, Any]], node_factory: type[Node]
) -> None:
    repo, source = backed_up
    dst = node_factory("--flush-interval", "0.02", partitions=PARTS, name="dst").start()

    def die_after_two(s: RestoreSummary) -> None:
        if s.partitions == 2 and dst.alive():
            dst.kill()  # SIGKILL: the node dies with writes in flight

    summary = asyncio.run(restore_to_node(repo, SourceUri.parse(dst.uri), window=8,
                                          on_progress=die_after_two))  # fmt: skip
    total = len(source)
    assert summary.failure is not None and 0 < summary.written < total
    assert 0 in summary.complete and set(summary.complete) <= {0, 1}

    dst.start()  # same port and data; the restore is run again as it was
    again = json.loads(upr("restore", "--repo", str(repo), "--json", dst.uri).stdout)
    assert again["failure"] is None and again["written"] + again["conflicts"] == total
    assert again["complete"] == list(range(PARTS))
    assert docs(dst.uri) == source
    # idempotent: once more, every version is already there
    third = json.loads(upr("restore", "--repo", str(repo), "--json", dst.uri).stdout)
    assert (third["written"], third["conflicts"]) == (0, total)
    assert docs(dst.uri) == source


ODD = xattrs.encode([("_sync", b'{"rev":"1-a"}'), ("app", b"not json")])  # well formed
GOOD = xattrs.encode([("app", b'{"v":1}')])


def test_xattr_values_that_are_not_json_warn_verify_and_are_named_by_a_node_restore(
    node_factory: type[Node], tmp_path: Path
) -> None:
    # 8 documents, two with an xattr value that is not JSON, and a tombstone keeping one
    rows = [doc(i, ODD if i in (3, 6) else GOOD if i % 2 else b"", b"k%d" % i) for i in range(8)]
    gone = DcpRecord(OP_DELETION, 0, 0, 2, 9 << 16, 0, 0, 0, 0, b"gone", b"", 0, 0, ODD)
    repo = write_repo(tmp_path / "repo", [*rows, gone])
    checked = upr("verify", "--repo", str(repo), "--json", check=False)
    assert checked.returncode == 0  # a warning, not a problem
    (b,) = json.loads(checked.stdout)["buckets"]
    assert b["ok"] and b["problems"] == [] and {w["kind"] for w in b["warnings"]} == {"xattrs"}
    named = " ".join(w["detail"] for w in b["warnings"])  # one a segment holding some
    assert all(f"'{k}' (app)" in named for k in ("k3", "k6", "gone"))
    text = upr("verify", "--repo", str(repo))
    assert f"ok, {len(b['warnings'])} warning" in text.stdout and "warning: xattrs:" in text.stdout

    dst = node_factory("--flush-interval", "0.02", partitions=PARTS, name="dst").start()
    out = upr("restore", "--repo", str(repo), "--json", dst.uri, check=False)
    assert out.returncode == 4, out.stderr
    report = json.loads(out.stdout)
    assert sorted(report["refused"]) == ["gone", "k3", "k6"] and report["errors"] == 0
    assert report["written"] == 6
    assert sorted(docs(dst.uri)) == [b"k%d" % i for i in range(8) if i not in (3, 6)]
    again = upr("restore", "--repo", str(repo), dst.uri, check=False)
    assert again.returncode == 4 and "3 keys: " in again.stdout and "k3" in again.stdout

    db = tmp_path / "odd.db"  # a store keeps them as they are
    assert upr("restore", "--repo", str(repo), f"sqlite:{db}").returncode == 0
    with Store(db) as s:
        kept = {d.key: d.xattrs for d in s.documents()}
    # the store's xattrs are JSON text (formats/store.md §3.9): a value that is not JSON
    # is kept as a string
    assert xattrs.to_json(kept[b"k3"]) == {"_sync": {"rev": "1-a"}, "app": "not json"}
    assert kept[b"gone"] == kept[b"k3"] and kept[b"k1"] == GOOD
