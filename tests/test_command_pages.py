"""Every command has a page in docs/commands/, and the page names every option its
`--help` lists.

The pages are the command reference the README links to (one a command; a group such
as `upr cluster` has one page for all its subcommands). What a page says is prose; what
is checked is what goes stale: a command without a page, and an option `--help` shows
that its page never mentions. Options are read from the click command `--help` renders
(hidden ones left out, as `--help` leaves them out), and each is looked for on the page
as a whole word (`--key` is not found in `--key-file`). An option many commands share
may instead be described once, in the index's "Options several commands share"
section (docs/commands/README.md), which counts as part of every page.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from upr_cli.cli.app import app
from upr_cli.cli.help import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "commands"


def _walk(command: Any, path: list[str], ctx: Any) -> list[tuple[list[str], Any]]:
    found = [(path, command)]
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            found += _walk(command.get_command(ctx, name), [*path, name], ctx)
    return found


def _commands() -> list[tuple[list[str], Any]]:
    root = typer.main.get_command(app)
    with typer.Context(root) as ctx:  # type: ignore[arg-type]
        return [(path, cmd) for path, cmd in _walk(root, [], ctx) if path]


COMMAND_PATHS = _commands()


def long_options(command: Any) -> list[str]:
    """The long options `command --help` lists (both names of an `--a/--b` flag)."""
    names: list[str] = []
    for param in command.params:
        if param.param_type_name != "option" or param.hidden:
            continue
        names += [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]
    return [n for n in names if n != "--help"]


def mentions(text: str, option: str) -> bool:
    """Whether `option` appears on the page as itself, not as the start of a longer one."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_mentions_is_whole_word() -> None:
    assert mentions("`--key FILE`", "--key")
    assert mentions("--apply/--dry-run", "--dry-run")
    assert not mentions("`--key-file FILE`", "--key")
    assert not mentions("`--no-key`", "--key")


def shared_options_section() -> str:
    """The index's section on options several commands share (up to the next `## `)."""
    index = (PAGES / "README.md").read_text()
    start = index.index("## Options several commands share")
    end = index.find("\n## ", start + 1)
    return index[start : end if end >= 0 else len(index)]


def test_every_command_has_a_page() -> None:
    missing = [name for name in COMMANDS if not (PAGES / f"{name}.md").exists()]
    assert not missing, f"docs/commands/ has no page for: {', '.join(missing)}"
    index = (PAGES / "README.md").read_text()
    unlisted = [name for name in COMMANDS if f"]({name}.md)" not in index]
    assert not unlisted, f"docs/commands/README.md does not link: {', '.join(unlisted)}"


def test_no_page_without_a_command() -> None:
    stray = [p.name for p in PAGES.glob("*.md") if p.stem not in COMMANDS and p.stem != "README"]
    assert not stray, f"pages of no command: {', '.join(stray)}"


@pytest.mark.parametrize("path,command", COMMAND_PATHS, ids=[" ".join(p) for p, _ in COMMAND_PATHS])
def test_page_names_every_option(path: list[str], command: Any) -> None:
    page = PAGES / f"{path[0]}.md"
    assert page.exists(), f"no page {page.relative_to(ROOT)} for `upr {' '.join(path)}`"
    text = page.read_text() + shared_options_section()
    if len(path) > 1:
        assert f"upr {' '.join(path)}" in text, f"{page.name} never names `upr {' '.join(path)}`"
    missing = [o for o in long_options(command) if not mentions(text, o)]
    assert not missing, (
        f"`upr {' '.join(path)} --help` lists {', '.join(missing)}, "
        f"which {page.relative_to(ROOT)} never mentions"
    )


def test_the_readme_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    unlinked = [name for name in COMMANDS if f"](docs/commands/{name}.md)" not in readme]
    assert not unlinked, f"README.md does not link the page of: {', '.join(unlinked)}"
