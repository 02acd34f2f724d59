"""A partition's state in byte-bounded chunks (`partition_chunks`): the same records as
`partition_state`, whatever the bounds, a record larger than a chunk alone, and a state
larger than what may be held read again rather than held whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.repo.repo_helpers import BUCKET, commit_backup
from upr_cli.jobs.restore import _HELD, partition_chunks, partition_state
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.repo import Manifest, Repository


def _row(seq: int, key: bytes, size: int, deleted: bool = False) -> DcpRecord:
    value = b"" if deleted else bytes([seq % 251]) * size
    return DcpRecord(OP_DELETION if deleted else OP_MUTATION, 0, seq, seq, seq * 1000, 0, 0, 0,
                     0, key, value, 0, 0, b"")  # fmt: skip


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Repository, list[Manifest]]:
    """Three backups of one partition: keys written, rewritten and deleted across them,
    values from a few bytes to 200 KB."""
    rng = random.Random(5)
    r = Repository(tmp_path / "repo")
    r.init()
    out, seq = [], 0
    for n in range(3):
        rows = []
        for _ in range(60):
            seq += 1
            key = b"k%02d" % rng.randrange(40)
            rows.append(_row(seq, key, rng.choice((10, 3000, 200_000)), rng.random() < 0.15))
        out.append(commit_backup(r, n, {0: rows}, start=seq - 60))
    return r, out


@pytest.mark.parametrize(("hold", "chunk"), [(1 << 30, 1 << 30), (0, 1), (300_000, 50_000),
                                             (1_000_000, 400_000)])  # fmt: skip
def test_the_chunks_hold_the_state_whatever_the_bounds(
    chain: tuple[Repository, list[Manifest]], hold: int, chunk: int
) -> None:
    r, ms = chain
    for m in ms:
        want = partition_state(r, BUCKET, ms, m.backup_id, 0)
        got = list(partition_chunks(r, BUCKET, ms, m.backup_id, 0, hold=hold, chunk=chunk))
        records = [rec for part, _n in got for rec in part]
        assert sorted(records) == sorted(want.values())  # each key once, its latest version
        for part, n in got:
            assert n == sum(len(x.key) + len(x.value) + _HELD for x in part)
            assert len(part) == 1 or n <= chunk  # a larger record goes alone
