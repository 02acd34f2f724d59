"""A command run without arguments shows its help, unless the environment answers every
required parameter: `UPR_REPO=… upr info` reads the repository as `upr info --repo …`
does (restic's RESTIC_REPOSITORY), and a command that still lacks an argument (examine's
KEY) keeps showing its help."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.repo.repo_helpers import one_backup_repo, run_upr


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return one_backup_repo(tmp_path / "repo", (1, 2))


def test_upr_repo_answers_info_and_verify(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, repo: Path
) -> None:
    monkeypatch.delenv("UPR_REPO", raising=False)
    code, out, _err = run_upr(capsys, "info")
    assert code == 2 and "Usage: upr info" in out  # the help, as before
    monkeypatch.setenv("UPR_REPO", str(repo))
    code, out, err = run_upr(capsys, "info")
    assert code == 0, err
    assert "Usage:" not in out and f"{repo}: bucket default" in out
    code, out, err = run_upr(capsys, "verify")
    assert code == 0, err
    assert out.startswith("default: 1 backup, 1 segment, 2 items")
    code, out, err = run_upr(capsys, "repo", "unlock")  # a subcommand
    assert (code, out) == (0, "default: not locked\n"), err


def test_a_missing_argument_still_shows_the_help(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, repo: Path
) -> None:
    monkeypatch.setenv("UPR_REPO", str(repo))
    code, out, _err = run_upr(capsys, "examine")  # KEY has no environment variable
    assert code == 2 and "Usage: upr examine" in out
    monkeypatch.setenv("UPR_REPO", "")  # set but empty: not an answer
    code, out, _err = run_upr(capsys, "info")
    assert code == 2 and "Usage: upr info" in out
