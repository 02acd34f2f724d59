"""Xattrs through a repository: the state a restore reads keeps each record's xattrs, the
latest version's, and `keep_xattrs` leaves system or all xattrs out, counted.

Repositories are built with the library (real segment files and manifests:
`repo_helpers.commit_backup`); the restore runs as a dry run into a SQLite path, which reads
and counts everything and writes nothing (the store's own xattrs are its tests')."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.repo.repo_helpers import BUCKET, commit_backup
from upr_cli.jobs.restore import (
    KeepXattrs,
    RestoreSummary,
    partition_state,
    refuse_without_xattrs,
    restore_to_store,
    user_only,
)
from upr_cli.jobs.restore_plan import RestorePlanError
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import Manifest, Repository

SYNC = xattrs.encode([("_sync", '{"rev":"1-a"}')])
BOTH = xattrs.encode([("_sync", '{"rev":"2-b"}'), ("app", '{"v":2}')])
USER = xattrs.encode([("app", '{"v":3}')])
TOMB = xattrs.encode([("_sync", '{"rev":"3-c","deleted":true}')])


def _row(seq: int, key: bytes, blob: bytes = b"", deleted: bool = False) -> DcpRecord:
    op = OP_DELETION if deleted else OP_MUTATION
    value = b"" if deleted else b'{"seq":%d}' % seq
    return DcpRecord(op, 0, seq, seq, seq * 1000, 0, 0, 0, 0 if deleted else 1, key, value, 0,
                     0, blob)  # fmt: skip


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Repository, list[Manifest]]:
    """A full backup and an incremental one: documents gaining, changing and losing
    xattrs, a tombstone keeping its system xattrs, a plain one."""
    r = Repository(tmp_path / "repo")
    r.init()
    full = [_row(1, b"a", SYNC), _row(2, b"b", BOTH), _row(3, b"c"), _row(4, b"d", USER),
            _row(5, b"e", SYNC)]  # fmt: skip
    incr = [_row(6, b"a", BOTH), _row(7, b"b"), _row(8, b"c", TOMB, True),
            _row(9, b"e", b"", True)]  # fmt: skip
    return r, [commit_backup(r, 0, {0: full}), commit_backup(r, 1, {0: incr}, start=5)]


def test_the_state_keeps_each_latest_versions_xattrs(
    repo: tuple[Repository, list[Manifest]],
) -> None:
    r, chain = repo
    state = partition_state(r, BUCKET, chain, chain[-1].backup_id, 0)
    got = {key: (rec.op, rec.xattrs, rec.value[:1]) for (_c, key), rec in state.items()}
    assert got == {
        b"a": (OP_MUTATION, BOTH, b"{"),
        b"b": (OP_MUTATION, b"", b"{"),  # an update without xattrs dropped them
        b"c": (OP_DELETION, TOMB, b""),  # a tombstone that kept its system xattrs
        b"d": (OP_MUTATION, USER, b"{"),
        b"e": (OP_DELETION, b"", b""),
    }
    then = partition_state(r, BUCKET, chain, chain[0].backup_id, 0)
    assert then[0, b"b"].xattrs == BOTH and then[0, b"c"].xattrs == b""


@pytest.mark.parametrize(
    ("keep", "with_xattrs", "left_out"),
    [("all", 3, 0), ("user", 2, 2), ("none", 0, 3)],
)
def test_keep_xattrs_is_counted(
    repo: tuple[Repository, list[Manifest]], tmp_path: Path, keep: KeepXattrs,
    with_xattrs: int, left_out: int,
) -> None:  # fmt: skip
    """All (a, c, d carry xattrs); user only (a keeps `app`, d its own; c's tombstone
    and a lose `_sync`); none."""
    r, _chain = repo
    s = restore_to_store(r.path, tmp_path / "x.db", dry_run=True, keep_xattrs=keep)
    assert (s.documents, s.deletions) == (3, 2)
    assert (s.xattrs, s.xattrs_left_out) == (with_xattrs, left_out)
    out = s.to_json()
    got = (out["with_xattrs"], out["xattrs_left_out"], out["keep_xattrs"])
    assert got == (with_xattrs, left_out, keep)
    assert out["target_xattrs"] is None
    assert not (tmp_path / "x.db").exists()


def test_user_only_leaves_the_system_xattrs_out() -> None:
    assert user_only(BOTH) == xattrs.encode([("app", '{"v":2}')])
    assert user_only(SYNC) == b""
    assert user_only(USER) == USER
    assert xattrs.to_json(user_only(BOTH)) == {"app": {"v": 2}}


def test_a_target_refusing_xattrs_stops_the_restore_unless_none_are_written() -> None:
    """The check made before the first write (the target's HELLO answer is known)."""
    s = RestoreSummary("b", "upr://h/default", False, target_xattrs=False)
    keeps: tuple[KeepXattrs, ...] = ("all", "user")
    for keep in keeps:
        s.keep_xattrs = keep
        with pytest.raises(RestorePlanError, match=r"does not take xattrs.*--no-xattrs"):
            refuse_without_xattrs(s)
    s.keep_xattrs = "none"
    refuse_without_xattrs(s)
    refuse_without_xattrs(RestoreSummary("b", "t", False, target_xattrs=True))
    refuse_without_xattrs(RestoreSummary("b", "t", False))  # a store: no HELLO
