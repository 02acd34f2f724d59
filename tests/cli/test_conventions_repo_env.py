"""`UPR_REPO` for `--repo` (restic's RESTIC_REPOSITORY): every command that takes
`--repo` falls back to it, shows it in `--help`, and an option given still wins."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from tests.repo.repo_helpers import BUCKET, one_backup_repo, run_upr
from upr_cli.cli.app import app


def commands(cmd: Any = None, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Every command of `upr`, subcommands too, as ("repo unlock", command)."""
    cmd = cmd or typer.main.get_command(app)
    subs = getattr(cmd, "commands", None)  # a group (`upr`'s imports each as it is named)
    if subs is None:
        yield " ".join(path), cmd
        return
    for name in list(subs):
        yield from commands(subs[name], (*path, name))


def test_every_repo_option_falls_back_to_upr_repo() -> None:
    taking = {name: p for name, cmd in commands() for p in cmd.params if "--repo" in p.opts}
    assert {"backup", "restore", "info", "verify", "prune", "merge", "repo unlock"} <= set(taking)
    # salvage's --repo is one of three sources: it names UPR_REPO in its help instead
    missing = [n for n, p in taking.items() if p.envvar != "UPR_REPO" and n != "salvage"]
    assert missing == []
    assert "UPR_REPO" in (taking["salvage"].help or "")


def test_help_shows_the_env_var(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _err = run_upr(capsys, "info", "--help")
    assert code == 0 and "[env var: UPR_REPO]" in out


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return one_backup_repo(tmp_path / "repo", (1, 2, 3))


def test_info_reads_the_repository_upr_repo_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, repo: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    monkeypatch.setenv("UPR_REPO", str(repo))
    code, out, err = run_upr(capsys, "info", "--json")
    assert code == 0, err
    doc = json.dumps(json.loads(out))  # the one bucket's one backup of 3 items
    assert BUCKET in doc and '"items": 3' in doc
    # an option given wins over the environment
    code, _out, err = run_upr(capsys, "info", "--repo", str(tmp_path / "other"), "--json")
    assert code == 2 and str(tmp_path / "other") in err
    # and a bad UPR_REPO is the same usage error as a bad --repo
    monkeypatch.setenv("UPR_REPO", "gs://bucket/x")
    code, _out, err = run_upr(capsys, "info", "--json")
    assert code == 2 and "gs:// repositories are not supported" in err


def test_salvage_takes_upr_repo_only_as_its_one_source(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("UPR_REPO", str(tmp_path / "none"))
    dead = "upr://127.0.0.1:1/default"
    code, _out, err = run_upr(capsys, "salvage", "--into", dead, "--wait", "0")
    assert code == 2 and "not a upr repository" in err and str(tmp_path / "none") in err
    # --store given: UPR_REPO stays out of it (not "give exactly one of")
    store = tmp_path / "s.db"
    code, _out, err = run_upr(capsys, "salvage", "--store", str(store), "--into", dead)
    assert code == 2 and "no such store" in err
