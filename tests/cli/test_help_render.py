"""Every command's help, rendered at 80 columns as a new user's terminal shows it, reads well.

- No ragged paragraph: a prose line is never followed by a line of the same paragraph
  whose first word would have fit on it (what a hard-wrapped docstring rewrapped by Rich
  looks like).
- No example line wrapped onto the next line at the left margin.
- Metavars are plain names: no `{uri}`, `<bool>`, `<int range> [x>=1]`, `<list[str]>`.
- No help cites a document a user does not have.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from rich.cells import cell_len
from typer.testing import CliRunner

from upr_cli.cli.app import app

WIDTH = 80
CODE_LIKE = ("<bool>", "<int", "<float", "<str>", "<path>", "<list", "[x>=", "[x<", "<text")
NOT_OURS = (
    "seed 000", "dcp-wire", "DESIGN", "STYLE", "reference/", "../shared",  # citations: ignore
)  # fmt: skip


def _walk(command: Any, path: list[str], ctx: Any) -> Iterator[tuple[list[str], Any]]:
    yield path, command
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            yield from _walk(sub, [*path, name], ctx)


def _commands() -> list[tuple[list[str], Any]]:
    root = typer.main.get_command(app)
    with typer.Context(root) as ctx:  # type: ignore[arg-type]
        return list(_walk(root, [], ctx))


COMMANDS = _commands()
IDS = [" ".join(path) or "upr" for path, _cmd in COMMANDS]


def render(path: list[str]) -> str:
    """`upr PATH --help` as an 80-column terminal shows it."""
    result = CliRunner().invoke(
        app, [*path, "--help"], env={"COLUMNS": str(WIDTH)}, terminal_width=WIDTH
    )
    assert result.exit_code == 0, result.output
    return result.output


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def ragged(text: str, width: int = WIDTH) -> list[str]:
    """The problems of the description (above the first panel): lines a paragraph's next
    word would have fitted on, and example lines wrapped back to the margin."""
    top = text.split("╭", 1)[0].splitlines()
    # a line holding only a zero-width space shows blank (see upr_cli/cli/help.py)
    lines = [line.replace("\u200b", "").rstrip() for line in top if "Usage:" not in line]
    out = []
    for line, after in itertools.pairwise(lines):
        if not line.strip() or not after.strip():
            continue
        if _indent(line) > 1 and _indent(after) == 1:
            out.append(f"example wrapped: {line.strip()!r} / {after.strip()!r}")
        elif _indent(line) == 1 and _indent(after) == 1:
            word = after.split()[0]
            if len(line) + 1 + len(word) <= width - 1:  # Rich keeps one column of padding
                out.append(f"ragged: {line.strip()!r} / {after.strip()!r}")
    return out


def test_the_checks_catch_what_they_should() -> None:
    hard_wrapped = "\n".join(
        [
            " The first run streams every partition from 0; later runs stream",
            " each",
            " partition from where the newest backup ended.",
        ]
    )
    assert len(ragged(hard_wrapped)) == 2
    assert ragged(" A long example follows.\n\n   upr backup upr://h/b --repo /x\n --full\n")
    assert not ragged(" One paragraph.\n\n Another one.\n\n   upr backup \\\n       --full\n")


@pytest.mark.parametrize("path", [p for p, _c in COMMANDS], ids=IDS)
def test_help_reads_well_at_80_columns(path: list[str]) -> None:
    text = render(path)
    assert not ragged(text), "\n".join(ragged(text))
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert "{" not in usage and "<" not in usage, usage
    found = [c for c in CODE_LIKE if c in text]
    assert not found, f"code-like metavars {found} in `upr {' '.join(path)} --help`"
    cited = [c for c in NOT_OURS if c in text]
    assert not cited, f"`upr {' '.join(path)} --help` cites {cited}"
    assert max(cell_len(line) for line in text.splitlines()) <= WIDTH


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_metavars_are_plain_names(path: list[str], command: Any) -> None:
    with typer.Context(command) as ctx:
        for param in command.get_params(ctx):
            shown = param.display_type_rich(ctx) if hasattr(param, "display_type_rich") else ""
            assert not shown or re.fullmatch(r"[A-Za-z0-9=|_.\-]+", shown), (param.name, shown)
            for piece in param.get_usage_pieces(ctx):
                assert "{" not in piece and "<" not in piece, (param.name, piece)


def test_rollback_point_help_keeps_its_brackets() -> None:
    text = " ".join(render(["rollback-point"]).split())
    assert "[uuid, seq] pairs" in text
    assert "--start SEQ dcp rule: the start seqno" in text.replace("│", " ").replace("  ", " ")
