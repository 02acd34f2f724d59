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


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("s3pack")
    src = root / "src"
    build(Repository(src), STEPS)
    return src, observe(src, root)


@pytest.fixture(autouse=True)
def _plain_access(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("UPR_KEY_FILE", "UPR_PASSPHRASE", "UPR_FROM_KEY_FILE", "UPR_FROM_PASSPHRASE"):
        monkeypatch.delenv(name, raising=False)
    access.reset()
    yield
    access.reset()


def test_packed_backups_read_as_before_from_s3(
    chain: tuple[Path, dict[str, Any]], s3: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Restore, ls, salvage and verify (each s3 command costs a second or two: the light
    round of `observe`)."""
    dst = parse_location(f"s3://{s3}/r")
    copy_repository(chain[0], dst)
    repo = Repository(dst)
    ids = repo.backups(BUCKET)
    for b in (ids[1], ids[-1]):
        pack_backup(repo, BUCKET, b)
    assert len(proxy.requests("PUT", PACK_NAME)) == 2  # a backup's segments: one object
    assert observe(dst, tmp_path, light=True) == narrow(chain[1])


@pytest.mark.slow  # 35 s: copies to and from s3, a prune on s3
def test_a_packed_s3_repository_copies_and_prunes(
    chain: tuple[Path, dict[str, Any]], s3: str, tmp_path: Path
) -> None:
    dst = parse_location(f"s3://{s3}/r")
    check_packed_repository(*chain, dst, tmp_path, encrypted=False, light=True)
