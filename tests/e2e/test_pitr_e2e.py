"""Point-in-time restore from a follower's commits, against `upr serve` (issue 31).

Batches of creates, updates, deletes, xattrs and collection changes, with pauses between
them; a follower commits throughout. In each pause, once the follower has the batch, the
node's whole state is captured and the time noted. Afterwards `restore --at-time` of each
noted time gives, key for key, the state captured then: value, cas, rev, flags, expiry,
xattrs, deletions and collection.
"""

from __future__ import annotations

import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import drain, run, spawn_upr, wait_persisted
from tests.e2e.test_follow_e2e import _backups, _caught_up, _load, _wait_for
from upr_cli.protocol.decoder import OP_MUTATION
from upr_cli.store import Store

Row = tuple[Any, ...]


Key = tuple[int, int, bytes]  # partition, collection id, key


def _node_state(uri: str) -> dict[Key, Row]:
    """Every key's newest version on the node, tombstones and xattrs included."""
    rows, _events, _c = run(drain(uri))
    out: dict[Key, Row] = {}
    for r in sorted(rows, key=lambda r: (r.vbucket, r.by_seqno)):
        out[(r.vbucket, r.collection, bytes(r.key))] = (
            r.by_seqno, r.opcode != OP_MUTATION, bytes(r.value), r.cas, r.rev_seqno,
            r.flags, r.expiration, r.collection, bytes(r.xattrs),
        )  # fmt: skip
    return out


def _restored(repo: Path, db: Path, *how: str) -> dict[Key, Row]:
    upr("restore", "--repo", str(repo), *how, f"sqlite:{db}")
    with Store(db, create=False) as s:
        return {
            (d.partition, d.collection, d.key): (
                d.seq, d.deleted, d.value, d.cas, d.rev_seq, d.flags, d.expiry, d.collection,
                d.xattrs)
            for d in s.documents()
        }  # fmt: skip


def test_restore_at_each_noted_time_gives_the_state_captured_then(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPR_ROLLUP_FANOUT", "2")  # points read back from rollups too
    repo = tmp_path / "repo"
    upr(*_load(node, 300, 1))
    noted: list[tuple[str, dict[Key, Row]]] = []
    with spawn_upr("backup", node.uri, "--repo", str(repo), "--follow", "--commit-every",
                   "0.2s") as follower:  # fmt: skip
        _wait_for(lambda: bool(_backups(repo)), what="the catch-up")
        batches: list[list[list[str]]] = [
            [["collections", "create", node.uri, "app.a"],
             [*_load(node, 200, 2), "--collections", "app.a", "--xattrs"]],
            [_load(node, 250, 3)],
            [["collections", "create", node.uri, "app.b"],
             [*_load(node, 150, 4), "--collections", "app.a,app.b"]],
            [["collections", "drop", node.uri, "app.a"], _load(node, 100, 5)],
        ]  # fmt: skip
        for batch in batches:
            for cmd in batch:
                upr(*cmd)
            wait_persisted(node.uri)
            _wait_for(lambda: _caught_up(repo, node), what="the follower to take the batch")
            state = _node_state(node.uri)
            time.sleep(0.05)
            noted.append((datetime.now(UTC).isoformat().replace("+00:00", "Z"), state))
            time.sleep(0.4)  # a pause: nothing is written
        follower.send_signal(signal.SIGTERM)
        _out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    for i, (when, state) in enumerate(noted):
        got = _restored(repo, tmp_path / f"at{i}.db", "--at-time", when)
        assert got == state, f"batch {i}: {len(got)} keys restored, {len(state)} captured"
    assert any(m.revision > 1 for m in _backups(repo))  # rollups happened
