"""The e2e fixtures (real `upr serve` nodes on free loopback ports) for the scrape tests,
and a small chain of three backups for the one-shot `--metrics-file` tests."""

from pathlib import Path

import pytest

from tests.e2e.conftest import _reap_background, node, node_factory, spawned
from tests.repo.chain_gen import Step, build
from upr_cli.repo import Repository

STEPS = [
    Step("full", (3, 3, 3), (0, 0, 0), (False, False, False), 1),
    Step("inc", (4, 2, 3), (0, 0, 0), (False, False, False), 2),
    Step("inc", (2, 3, 1), (0, 0, 0), (False, False, False), 3),
]


@pytest.fixture
def repo(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A repository holding a full backup and incrementals of bucket default: the first
    `BACKUPS` of STEPS when the test module sets it, else all three."""
    path = tmp_path / "repo"
    build(Repository(path), STEPS[: getattr(request.module, "BACKUPS", len(STEPS))])
    return path


__all__ = ["_reap_background", "node", "node_factory", "repo", "spawned"]
