"""`--wait`: one option, one meaning, on every command that streams from a node
(docs/protocol.md §4.5)."""

from __future__ import annotations

import math

import pytest
import typer

from upr_cli.cli.app import main
from upr_cli.cli.options import wait_seconds
from upr_cli.errors import ExitCode

STREAMING = [
    ["tail", "upr://127.0.0.1:1/default"],
    ["replay", "upr://127.0.0.1:1/default", "--into", "/tmp/never.db"],
    ["backup", "upr://127.0.0.1:1/default", "--repo", "/tmp/never-repo"],
    ["salvage", "--repo", "/tmp/never-repo", "--into", "upr://127.0.0.1:1/default"],
]


def test_wait_takes_seconds_zero_or_forever() -> None:
    assert wait_seconds("120") == 120.0
    assert wait_seconds("0") == 0.0
    assert wait_seconds("2.5") == 2.5
    assert wait_seconds("forever") == math.inf
    assert wait_seconds("Forever") == math.inf
    assert wait_seconds(120.0) == 120.0  # the default, already a number
    for bad in ("-1", "soon", "nan", ""):
        with pytest.raises(typer.BadParameter, match=r"seconds \(0: no waiting\) or forever"):
            wait_seconds(bad)


@pytest.mark.parametrize("args", STREAMING, ids=lambda a: a[0])
def test_every_streaming_command_takes_wait(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*args, "--wait", "soon"])
    _out, err = capsys.readouterr()
    assert info.value.code == ExitCode.USAGE
    assert "Invalid value for '--wait': 'soon': takes seconds (0: no waiting) or forever" in err
    with pytest.raises(SystemExit):
        main([args[0], "--help"])
    out, _err = capsys.readouterr()
    assert "--wait" in out and "forever" in out
