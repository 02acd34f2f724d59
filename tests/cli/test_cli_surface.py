"""The command-line surface: lazy commands, one meaning per option, the shared source parser,
help with no arguments, and man pages that install with the package."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer

from upr_cli.cli.app import app, main
from upr_cli.cli.help import COMMANDS, load_command, reflow
from upr_cli.errors import ExitCode, UsageError
from upr_cli.source import Source, parse_partitions, parse_source

ROOT = Path(__file__).resolve().parents[2]


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


# -- lazy commands --------------------------------------------------------------------------


def test_help_imports_no_command_module() -> None:
    code = (
        "import sys\n"
        "from upr_cli.cli.app import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = ['asyncio', 'zstandard', 'sqlite_utils', 'pyspark', 'upr_cli.jobs',"
        " 'upr_cli.net', 'upr_cli.repo', 'upr_cli.cli.backup', 'upr_cli.cli.cluster']\n"
        "print('loaded:' + ','.join(m for m in heavy if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)  # fmt: skip
    assert "Commands" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "loaded:", proc.stdout.splitlines()[-1]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_listed_summary_is_the_commands_first_line(name: str) -> None:
    command = load_command(name)
    assert command.help is not None
    assert reflow(command.help).split("\n\n")[0] == reflow(COMMANDS[name][1])


def test_every_command_is_listed() -> None:
    group = typer.main.get_command(app)
    assert sorted(group.commands) == sorted(COMMANDS)  # type: ignore[attr-defined]


def test_reflow_joins_prose_and_keeps_examples() -> None:
    text = "Summary.\n\nOne paragraph\nhard-wrapped.\n\nExample:\n\n  upr a \\\n      --b\n"
    assert reflow(text) == (
        "Summary.\n\nOne paragraph hard-wrapped.\n\nExample:\n\n  upr a \\\n      --b"
    )
    long = "  upr restore --repo /backups/cb --at oldest --partitions 0-7 --dry-run upr://h/b"
    assert reflow(f"S.\n\nExample:\n\n{long}").endswith(
        "  upr restore --repo /backups/cb --at oldest --partitions 0-7 \\\n"
        "      --dry-run upr://h/b"
    )  # broken before an option, so it still pastes into a shell
    assert reflow("S.\n\nA [uuid, seq] pair.") == "S.\n\nA \\[uuid, seq] pair."


# -- no arguments: the help, exit 2, nothing else -----------------------------------------


@pytest.mark.parametrize("args", [[], ["backup"], ["cluster"], ["spark", "export"]])
def test_no_arguments_prints_the_help_and_exits_2(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    code, out, err = run_main(capsys, *args)
    assert code == ExitCode.USAGE and "Usage:" in out and err == ""


# -- one meaning per option -------------------------------------------------------------------


def test_serve_partitions_is_a_deprecated_alias_of_num_partitions(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[Any] = []

    async def serve(server: Any) -> None:
        seen.append(server.config)

    monkeypatch.setattr("upr_cli.cli.serve._serve", serve)
    base = ["serve", "--data", str(tmp_path), "--no-auth", "--port", "0"]
    assert run_main(capsys, *base, "--num-partitions", "8") == (0, "", "")
    code, out, err = run_main(capsys, *base, "--partitions", "12")
    assert (code, out) == (0, "")
    assert err == "upr: warning: --partitions is deprecated; use --num-partitions\n"
    assert run_main(capsys, *base)[0] == 0
    assert [c.partitions for c in seen] == [8, 12, None]  # None: the count on disk
    code, _out, err = run_main(capsys, *base, "--partitions", "2", "--num-partitions", "3")
    assert code == ExitCode.USAGE and "give one of them" in err
    code, _out, err = run_main(capsys, *base, "--partitions", "2000")
    assert code == ExitCode.USAGE and "--partitions" in err


def test_partitions_selects_in_every_command_and_counts_nowhere() -> None:
    def count(path: list[str], command: Any) -> list[tuple[str, str]]:
        out = [(" ".join(path), p.opts[0]) for p in command.params
               if "--partitions" in p.opts and not p.hidden and p.metavar != "LIST"]  # fmt: skip
        for name, sub in getattr(command, "commands", {}).items():
            out += count([*path, name], sub)
        return out

    assert count([], typer.main.get_command(app)) == []


# -- one parser of sources ------------------------------------------------------------------


def test_parse_source_forms() -> None:
    assert parse_source("upr://a@h/b") == Source("node", "upr://a@h/b")
    assert parse_source("repo:/r@20261121T061500.123456Z") == Source(
        "repo", "repo:/r@20261121T061500.123456Z", Path("/r"), "20261121T061500.123456Z"
    )
    assert parse_source("repo:/r").at is None
    assert parse_source("sqlite:/x.db").path == Path("/x.db")
    assert parse_source("json:/a.b").kind == "json" and parse_source("/x.json").kind == "json"


@pytest.mark.parametrize(
    ("text", "kinds", "message"),
    [
        ("ftp://u:pw@h/b", ("node", "repo"), "SOURCE 'ftp:…': unknown kind of source; a source "
                                             "is upr://… or repo:URL[@BACKUP]"),
        ("sqlite:/x", ("node", "repo"), "sqlite:PATH is not a source here"),
        ("/x.db", ("node", "sqlite"), "is a path: a SQLite store there is sqlite:/x.db"),
        ("/x.json", ("node", "repo"), "is a path: a repository there is repo:/x.json"),
        ("", ("node",), "SOURCE is empty"),
        ("repo:", ("repo",), "SOURCE repo: needs a path"),
    ],
)  # fmt: skip
def test_parse_source_errors(text: str, kinds: tuple[Any, ...], message: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_source(text, kinds)
    assert message in str(info.value) and "pw" not in str(info.value)


def test_parse_partitions() -> None:
    assert parse_partitions("0-3, 9,2") == [0, 1, 2, 3, 9]
    with pytest.raises(UsageError, match="is not a partition"):
        parse_partitions("1024")


# -- man pages --------------------------------------------------------------------------------


def test_man_pages_install_with_the_package() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    files = conf["tool"]["setuptools"]["data-files"]["share/man/man1"]
    pages = sorted(p.name for p in (ROOT / "man").glob("*.1"))
    assert sorted(Path(f).name for f in files) == pages
    assert "upr-backup.1" in pages and "upr.1" in pages
    # and the format documents they cite, every one of them
    docs = conf["tool"]["setuptools"]["data-files"]["share/doc/upr/formats"]
    assert sorted(docs) == sorted(f"formats/{p.name}" for p in (ROOT / "formats").glob("*.md"))
