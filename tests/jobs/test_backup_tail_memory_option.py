"""`--memory-limit` on `upr backup` and `upr tail`: a size that is not one, or is below the
smallest budget, is a usage error (exit 2, one line) before anything is reached; a good
one is taken, and shared out as docs/design.md "Performance" says."""

from __future__ import annotations

import pytest

from upr_cli.cli.app import main
from upr_cli.jobs.backup_stream import budget
from upr_cli.jobs.tail import window
from upr_cli.memory import MIB, MemoryLimit

ARGV = [["backup", "upr://127.0.0.1:1/default", "--repo", "/nonexistent/repo"],
        ["tail", "upr://127.0.0.1:1/default", "--until-end", "--wait", "0"]]  # fmt: skip


@pytest.mark.parametrize("value", ["lots", "1KB", "-5MB"])
@pytest.mark.parametrize("argv", [*ARGV, ["load", "upr://127.0.0.1:1/default", "--docs", "1"],
                                  ["restore", "--repo", "/nonexistent/repo",
                                   "upr://127.0.0.1:1/default"]])  # fmt: skip
def test_a_bad_memory_limit_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], value: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--memory-limit", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--memory-limit" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", ARGV)
def test_a_memory_limit_is_taken(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--memory-limit", "64MB"])
    assert exit_.value.code == 1  # past the options: the repository or the node
    err = capsys.readouterr().err
    assert "--memory-limit" not in err and "Traceback" not in err


def test_the_default_keeps_the_windows_and_the_budget_of_before() -> None:
    assert window(MemoryLimit()) == 4 * MIB  # tail's connection_buffer_size on the wire
    assert budget(MemoryLimit()).window == 8 * MIB  # backup's
    assert budget(MemoryLimit()).held == 64 * MIB
    small = budget(MemoryLimit(16 * MIB))
    assert small.window + small.queued + small.held <= 16 * MIB
