"""Xattrs survive backup and restore: documents with system and user xattrs, updates that
keep or replace them, tombstones that keep their system xattrs (and one that kept a user
xattr, from DEL_WITH_META), a full and an incremental backup, a restore into a node with
another partition count, read back over DCP with xattrs; `--no-system-xattrs` leaves the
`_` names out (formats/wire.md "Xattrs", formats/segment.md "Xattrs")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import drain, run, wait_persisted, write_xattr_ops
from upr_cli.net.bootstrap import partition_of
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_MUTATION

JSON = 0x01
SYNC1 = {"_sync": {"rev": "1-a", "sequence": 1}, "app": {"owner": "u1"}}
SYNC2 = {"_sync": {"rev": "2-b", "sequence": 7}, "app": {"owner": "u2"}, "tags": ["x"]}

# key → (op, value, xattrs as JSON, cas, rev seq, flags) of the latest version
State = dict[bytes, tuple[int, bytes, dict[str, Any], int, int, int]]


def state(uri: str, partitions: int) -> State:
    """The latest version of every key a DCP stream with xattrs gives, each at its key's
    partition over `partitions`."""
    rows, _events, _consumer = run(drain(uri))
    out: State = {}
    for r in sorted(rows, key=lambda r: (r.vbucket, r.by_seqno)):
        assert r.vbucket == partition_of(r.key, partitions), r.key
        assert not r.datatype & xattrs.XATTR  # split off by the consumer
        out[r.key] = (r.opcode, r.value, xattrs.to_json(r.xattrs), r.cas, r.rev_seqno, r.flags)
    return out


def restore(repo: Path, target: str, *args: str) -> dict[str, Any]:
    proc = upr("restore", "--repo", str(repo), "--json", "--include-tombstones", *args, target)
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_xattrs_through_full_and_incremental_backup_and_restore(
    node_factory: type[Node], tmp_path: Path
) -> None:
    src = node_factory("--flush-interval", "0.02", partitions=16, name="src").start()
    repo = tmp_path / "repo"
    run(write_xattr_ops(src.uri, [
        ("meta", b"sg::1", (SYNC1, b'{"n":1}', 1)),
        ("set", b"sg::1", b'{"n":11}'),  # a plain SET keeps the xattrs
        ("meta", b"sg::2", (SYNC1, b'{"n":2}', 1)),
        ("delete", b"sg::2", None),  # the tombstone keeps _sync, drops app
        ("meta", b"sg::3", ({"_sync": {"rev": "1-c"}}, b'{"n":3}', 1)),
        ("meta", b"app::1", ({"app": {"v": 1}}, b"[1]", 1)),
        ("set", b"plain::1", b'{"p":1}'),
        ("set", b"plain::2", b'{"p":2}'),
    ]))  # fmt: skip
    wait_persisted(src.uri)
    first = state(src.uri, 16)
    assert first[b"sg::1"][1:3] == (b'{"n":11}', SYNC1)
    assert first[b"sg::2"][2] == {"_sync": SYNC1["_sync"]} and not first[b"sg::2"][1]
    upr("backup", src.uri, "--repo", str(repo))

    run(write_xattr_ops(src.uri, [
        ("meta", b"sg::1", (SYNC2, b'{"n":12}', 5)),  # replaced xattrs
        ("delmeta", b"sg::3", ({"_sync": {"rev": "2-c", "deleted": True}, "app": 3}, 9)),
        ("meta", b"sg::4", (SYNC2, b'{"n":4}', 1)),
        ("delete", b"sg::4", None),
        ("delete", b"plain::2", None),
    ]))  # fmt: skip
    wait_persisted(src.uri)
    upr("backup", src.uri, "--repo", str(repo))  # incremental
    want = state(src.uri, 16)
    assert want[b"sg::1"][2] == SYNC2
    assert want[b"sg::3"][0] != OP_MUTATION and set(want[b"sg::3"][2]) == {"_sync", "app"}
    assert want[b"sg::4"][2] == {"_sync": SYNC2["_sync"]}
    assert want[b"plain::2"][2] == {} and want[b"app::1"][2] == {"app": {"v": 1}}
    assert upr("verify", "--repo", str(repo)).returncode == 0

    plan = upr("restore", "--repo", str(repo), "--dry-run", src.uri).stdout
    assert "5 documents and deletions with xattrs" in plan, plan

    dst = node_factory("--flush-interval", "0.02", partitions=8, name="dst").start()
    out = restore(repo, dst.uri)
    assert (out["with_xattrs"], out["xattrs_left_out"], out["target_xattrs"]) == (5, 0, True)
    assert out["errors"] == 0 and out["written"] == len(want)
    assert state(dst.uri, 8) == want  # bodies, xattrs, cas, rev seqs, flags; tombstones'

    user = node_factory("--flush-interval", "0.02", partitions=4, name="user").start()
    out = restore(repo, user.uri, "--no-system-xattrs")
    assert (out["with_xattrs"], out["xattrs_left_out"], out["keep_xattrs"]) == (3, 4, "user")
    got = state(user.uri, 4)
    for key, (op, value, xa, *meta) in want.items():
        kept = {n: v for n, v in xa.items() if not n.startswith("_")}
        assert got[key] == (op, value, kept, *meta), key
