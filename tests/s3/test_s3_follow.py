"""`upr backup --follow` on object storage and on an encrypted repository (issue 31):
commits, rollups (16 commits become one) and the restore of the result, through moto's
S3 and through the sealed layer, against `upr serve`."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, node_factory, upr
from tests.e2e.e2e_helpers import node_content_hash, spawn_upr, wait_persisted
from tests.s3.test_s3_e2e import restored

__all__ = ["node_factory"]  # the e2e tests' fixture: nodes in tmp_path, killed at the end


def _rolled(repo: str) -> bool:
    """A rollup's revision is in the repository."""
    out = upr("info", "--repo", repo, "--json", check=False)
    if out.returncode != 0:
        return False
    return any(b["revision"] > 1 for b in json.loads(out.stdout)["buckets"][0]["backups"])


def _follow_under_load(node: Node, repo: str, *extra: str) -> dict[str, object]:
    """A follower committing every 0.1 s while a workload runs for about 3 s; SIGTERM."""
    with spawn_upr("backup", node.uri, "--repo", repo, "--follow", "--commit-every", "0.1s",
                   "--json", *extra) as follower:  # fmt: skip
        deadline = time.monotonic() + 60
        while upr("info", "--repo", repo, "--json", check=False).returncode != 0:
            assert time.monotonic() < deadline and follower.poll() is None  # catching up
            time.sleep(0.3)
        upr("load", node.uri, "--docs", "400", "--rate", "400", "--update-ratio", "0.4",
            "--delete-ratio", "0.1", "--seed", "11")  # fmt: skip
        wait_persisted(node.uri)
        time.sleep(1.0)  # the last snapshots reach a commit
        while not _rolled(repo):  # a rollup published (its worker process takes a moment)
            assert time.monotonic() < deadline + 60 and follower.poll() is None
            time.sleep(0.3)
        follower.send_signal(signal.SIGTERM)
        out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "where",
    [
        # slow (26 s): once, before the stale-revision fix of 2026-12-07, no rollup was
        # published on S3 within 60 s; five runs in a row passed since
        pytest.param("s3", marks=pytest.mark.slow),
        "encrypted",
    ],
)
def test_a_follower_on_s3_and_encrypted_restores_the_node(
    node_factory: type[Node], where: str, request: pytest.FixtureRequest, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    node = node_factory("--flush-interval", "0.02", partitions=8).start()
    monkeypatch.setenv("UPR_ROLLUP_FANOUT", "3")  # rollups of rollups within seconds
    if where == "s3":
        repo, extra = f"s3://{request.getfixturevalue('s3')}/follow", ()
    else:
        monkeypatch.setenv("UPR_PASSPHRASE", "follow-secret")
        repo, extra = str(tmp_path / "sealed"), ("--encrypt",)
    upr("load", node.uri, "--docs", "200", "--seed", "10")
    summary = _follow_under_load(node, repo, *extra)
    commits = int(summary["commits"])  # type: ignore[call-overload]
    assert commits >= 3  # a rollup's worth (UPR_ROLLUP_FANOUT=3)
    upr("verify", "--repo", repo)
    info = json.loads(upr("info", "--repo", repo, "--json").stdout)
    backups = info["buckets"][0]["backups"]
    rolled = [b for b in backups if b["revision"] > 1]
    assert rolled and len(backups) < commits  # rollups absorbed commits
    assert restored(tmp_path, repo, "latest") == node_content_hash(node.uri)
    if where == "encrypted":
        monkeypatch.delenv("UPR_PASSPHRASE")
        out = upr("restore", "--repo", repo, f"sqlite:{tmp_path / 'nokey.db'}", check=False)
        assert out.returncode == 2 and "key" in out.stderr
