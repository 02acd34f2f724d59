"""`upr diff` with a replay store as B: a diverged partition names its lost keys as
(collection, key) pairs, `scope.collection:key` outside the default collection."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from upr_cli.cli.app import app
from upr_cli.collections import CollectionsManifest
from upr_cli.failover import FailoverLog
from upr_cli.jobs.diff import diff_sources
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.store import Store

OLD, NEW = 0xA, 0xB
USERS = 9  # app.users in the manifest below


def rec(seq: int, key: bytes, cid: int = 0, op: int = OP_MUTATION) -> DcpRecord:
    return DcpRecord(op, 0, seq, 1, seq, 0, 0, 0, 0, key, b"v", 0, cid)


def diverged_store(tmp_path: Path) -> tuple[Path, Path]:
    """A (JSON): failed over to NEW at 40. B (a store): went on to 44 on OLD, writing
    the key k in the default collection and in app.users, and deleting d in app.users."""
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"0": {"failover_log": [{"uuid": str(NEW), "seq": "40"},
                                                     {"uuid": str(OLD), "seq": "0"}],
                                   "seq": "60"}}))  # fmt: skip
    b = tmp_path / "b.db"
    with Store(b) as s:
        s.record_manifest(CollectionsManifest().with_scope("app").with_collection("app", "users"))
        s.apply(0, [rec(1, b"d", USERS), rec(40, b"k")], StreamPosition(0, OLD, 40, 40, 40),
                FailoverLog.of([(OLD, 0)]))  # fmt: skip
        s.apply(0, [rec(41, b"k"), rec(42, b"k", USERS), rec(44, b"d", USERS, OP_DELETION)],
                StreamPosition(0, OLD, 44, 44, 44))  # fmt: skip
    return a, b


def test_the_same_key_in_two_collections_is_two_lost_keys(tmp_path: Path) -> None:
    a, b = diverged_store(tmp_path)
    (d,) = diff_sources(str(a), f"sqlite:{b}").partitions
    assert (d.status, d.diverged_at, d.lost_seqs) == ("diverged", 40, (40, 44))
    assert [(str(k), k.seq, k.deleted) for k in d.lost_keys] == [
        ("k", 41, False), ("app.users:k", 42, False), ("app.users:d", 44, True),
    ]  # fmt: skip
    assert d.to_json()["lost_keys"][:2] == [
        {"scope": "_default", "collection": "_default", "collection_id": 0, "key": "k",
         "seq": "41", "deleted": False},
        {"scope": "app", "collection": "users", "collection_id": USERS, "key": "k",
         "seq": "42", "deleted": False},
    ]  # fmt: skip
    # a store B that did not diverge names none; nor does a B that is no store
    (same,) = diff_sources(f"sqlite:{b}", f"sqlite:{b}").partitions
    assert same.status == "identical" and same.lost_keys == ()


def test_the_text_output_prints_scope_collection_key(tmp_path: Path) -> None:
    a, b = diverged_store(tmp_path)
    out = CliRunner().invoke(app, ["diff", str(a), f"sqlite:{b}"])
    assert out.exit_code == 1, out.output
    assert "partition 0: B's lost keys: k, app.users:k, app.users:d" in out.output
