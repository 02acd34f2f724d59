"""Issue 32: one meaning per option name. `salvage --into URI`, `spark export --output
DIR`, `--master URL` on backup and restore, `--create-collections` on serve and
`cluster init`; each old spelling still works, prints one `upr: warning: … is
deprecated; use …` line on stderr (a JSON object with --log-format json), is hidden
from --help, and given beside its new name is a usage error. `backup` and `restore`
take `--collections` as `--include-data`. Every run here stops at a usage error or a
missing repository before any node or Spark session would be needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from tests.repo.repo_helpers import run_upr
from upr_cli.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
DEAD = "upr://127.0.0.1:1/default"  # nothing listens


def _cases(tmp: Path) -> list[tuple[list[str], list[str], str, str]]:
    """(argv with the old spelling, argv with the new one, old, new): each stops with the
    same error either way, after the option was parsed."""
    missing = str(tmp / "no-repo")
    return [
        (["salvage", "--repo", missing, "--to", DEAD],
         ["salvage", "--repo", missing, "--into", DEAD], "--to", "--into"),
        (["spark", "export", "--repo", missing, "--to", str(tmp / "out")],
         ["spark", "export", "--repo", missing, "--output", str(tmp / "out")],
         "--to", "--output"),
        (["backup", DEAD, "--repo", missing, "--follow", "--spark", "local[1]"],
         ["backup", DEAD, "--repo", missing, "--follow", "--master", "local[1]"],
         "--spark", "--master"),
        (["restore", "--repo", missing, "--spark", "local[1]", f"sqlite:{tmp}/o.db"],
         ["restore", "--repo", missing, "--master", "local[1]", f"sqlite:{tmp}/o.db"],
         "--spark", "--master"),
        (["serve", "--data", str(tmp / "n"), "--no-auth", "--collections", "app:60"],
         ["serve", "--data", str(tmp / "n"), "--no-auth", "--create-collections", "app:60"],
         "--collections", "--create-collections"),
        (["cluster", "init", "--nodes", "1", "--data", str(tmp / "cl"), "--collections",
          "app:60"],
         ["cluster", "init", "--nodes", "1", "--data", str(tmp / "cl"),
          "--create-collections", "app:60"], "--collections", "--create-collections"),
    ]  # fmt: skip


def test_an_old_spelling_works_and_warns_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for old_argv, new_argv, old, new in _cases(tmp_path):
        code_new, _out, err_new = run_upr(capsys, *new_argv)
        code_old, _out, err_old = run_upr(capsys, *old_argv)
        assert code_new == code_old == 2, (old_argv, err_old, err_new)
        assert "deprecated" not in err_new, (new_argv, err_new)
        warning = f"upr: warning: {old} is deprecated; use {new}"
        lines = err_old.splitlines()
        assert lines[0] == warning and len(lines) == 2, (old_argv, err_old)
        assert lines[1] == err_new.strip(), (old_argv, err_old, err_new)  # the same answer
        assert not (tmp_path / "no-repo").exists() and not (tmp_path / "cl").exists()


def test_the_warning_follows_the_log_format(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _out, err = run_upr(capsys, "salvage", "--log-format", "json", "--repo",
                              str(tmp_path / "none"), "--to", DEAD)  # fmt: skip
    assert code == 2
    first = json.loads(err.splitlines()[0])
    assert (first["level"], first["event"]) == ("warning", "warning")
    assert first["message"] == "--to is deprecated; use --into"
    assert first["command"] == "salvage"


def test_both_spellings_at_once_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _out, err = run_upr(capsys, "salvage", "--repo", str(tmp_path), "--into", DEAD,
                              "--to", DEAD)  # fmt: skip
    assert code == 2 and "--to is the old spelling of --into: give one of them" in err
    code, _out, err = run_upr(capsys, "spark", "export", "--repo", str(tmp_path))
    assert code == 2 and "--output DIR" in err and err.count("upr: error") == 1


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, _err = run_upr(capsys, *argv, "--help")
    assert code == 0
    return out


def test_help_shows_the_new_names_only(capsys: pytest.CaptureFixture[str]) -> None:
    shown = {
        ("salvage",): ("--into", "--to"),
        ("spark", "export"): ("--output", "--to"),
        ("backup",): ("--master", "--spark"),
        ("restore",): ("--master", "--spark"),
        ("serve",): ("--create-collections", "--collections"),
        ("cluster", "init"): ("--create-collections", "--collections"),
    }
    for argv, (new, old) in shown.items():
        text = _help(capsys, *argv)
        options = text[text.index("Options") :]
        assert f"{new} " in options, argv
        assert not any(w.strip("│ ,") == old for w in options.split()), (argv, old)
    # cluster failover keeps --to NODE
    assert "--to " in _help(capsys, "cluster", "failover")


def test_backup_and_restore_take_collections_as_include_data(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    repo = str(tmp_path / "r")
    for argv in (["backup", DEAD, "--repo", repo],
                 ["restore", "--repo", repo, f"sqlite:{tmp_path}/o.db"]):  # fmt: skip
        command = typer.main.get_command(app).commands[argv[0]]  # type: ignore[attr-defined]
        (param,) = [p for p in command.params if "--include-data" in p.opts]
        assert "--collections" in param.opts and not param.hidden, argv[0]
        # the same option: given under both names, it is one list, and beside
        # --exclude-data the same refusal as --include-data
        code, _out, err = run_upr(capsys, *argv, "--collections", "a", "--exclude-data", "b")
        assert code == 2 and "--include-data and --exclude-data cannot be used together" in err


def test_pages_name_the_new_spellings() -> None:
    pages = {
        "salvage": ["--into"],
        "spark": ["--output"],
        "backup": ["--master", "--dry-run", "--collections"],
        "restore": ["--master", "--include-data", "--exclude-data", "--collections"],
        "serve": ["--create-collections"],
        "cluster": ["--create-collections"],
    }
    for name, options in pages.items():
        man = (ROOT / "man" / f"upr-{name}.1").read_text().replace("\\-", "-")
        doc = (ROOT / "docs" / "commands" / f"{name}.md").read_text()
        for option in options:
            assert option in man, (name, option)
            assert option in doc, (name, option)
