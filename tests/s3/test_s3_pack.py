"""Packed continuous commits (formats/repository.md §12) in an s3:// repository: every
reader reads them as the segment files they hold; a copy and a prune too (the slow
round). tests/repo/pack_helpers.py does the packing and the checking, on moto behind
the proxy; tests/repo/test_pack.py has the plain and encrypted local rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.repo.chain_gen import build
from tests.repo.pack_helpers import STEPS, check_packed_repository, narrow, observe, pack_backup
from tests.repo.repo_helpers import BUCKET
from tests.s3.fault_proxy import FaultProxy
from upr_cli.jobs.repo_copy import copy_repository
from upr_cli.repo import Repository, access
from upr_cli.repo.pack import PACK_NAME
from upr_cli.storage import parse_location


def _chain(root: Path, steps: int) -> tuple[Path, dict[str, Any]]:
    src = root / "src"
    build(Repository(src), STEPS[:steps])
    return src, observe(src, root)


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A full backup, then one with a cut-back (each s3 command costs a second or two)."""
    return _chain(tmp_path_factory.mktemp("s3pack"), 2)


@pytest.fixture(autouse=True)
def _plain_access(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("UPR_KEY_FILE", "UPR_PASSPHRASE", "UPR_FROM_KEY_FILE", "UPR_FROM_PASSPHRASE"):
        monkeypatch.delenv(name, raising=False)
    access.reset()
    yield
    access.reset()


def test_a_packed_backup_reads_as_before_from_s3(
    short: tuple[Path, dict[str, Any]], s3: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Restore, salvage (its cut-back member) and verify: the light round of `observe`."""
    dst = parse_location(f"s3://{s3}/r")
    access.configure(transfers=8)
    copy_repository(short[0], dst)
    access.reset()
    repo = Repository(dst)
    pack_backup(repo, BUCKET, repo.backups(BUCKET)[-1])
    assert len(proxy.requests("PUT", PACK_NAME)) == 1  # a backup's segments: one object
    assert observe(dst, tmp_path, light=True) == narrow(short[1])


@pytest.mark.slow  # 35 s: copies to and from s3, a prune on s3
def test_a_packed_s3_repository_copies_and_prunes(s3: str, tmp_path: Path) -> None:
    dst = parse_location(f"s3://{s3}/r")
    check_packed_repository(*_chain(tmp_path, len(STEPS)), dst, tmp_path, encrypted=False,
                            light=True)  # fmt: skip
