"""`--memory-limit` on `upr load` and `upr restore`: a size that is not one, or is below
the smallest budget, is a usage error (exit 2, one line) before anything is reached."""

from __future__ import annotations

import pytest

from upr_cli.cli.app import main


@pytest.mark.parametrize(
    ("argv", "failure"),
    [(["load", "upr://127.0.0.1:1/default", "--docs", "1"], "cannot connect"),
     (["restore", "--repo", "/nonexistent/repo", "upr://127.0.0.1:1/default"],
      "not a upr repository")],
)  # fmt: skip
def test_a_memory_limit_is_taken(
    capsys: pytest.CaptureFixture[str], argv: list[str], failure: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--memory-limit", "64MB"])
    assert exit_.value.code != 0
    assert failure in capsys.readouterr().err  # past the options: the target or repository
