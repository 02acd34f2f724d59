"""`--wire-compression auto|force|off`: one option, one meaning, on every command that
streams from a node (formats/wire.md "Snappy")."""

from __future__ import annotations

import pytest
import typer

from upr_cli.cli.app import main
from upr_cli.cli.options import wire_compression
from upr_cli.errors import ExitCode

STREAMING = [
    ["tail", "upr://127.0.0.1:1/default"],
    ["replay", "upr://127.0.0.1:1/default", "--into", "/tmp/never.db"],
    ["backup", "upr://127.0.0.1:1/default", "--repo", "/tmp/never-repo"],
    ["salvage", "--repo", "/tmp/never-repo", "--into", "upr://127.0.0.1:1/default"],
]


def test_wire_compression_takes_auto_force_or_off() -> None:
    assert wire_compression("auto") == "auto"
    assert wire_compression("force") == "force"
    assert wire_compression(" OFF ") == "off"
    for bad in ("on", "snappy", "", "forced"):
        with pytest.raises(typer.BadParameter, match="takes auto, force or off"):
            wire_compression(bad)


@pytest.mark.parametrize("args", STREAMING, ids=lambda a: a[0])
def test_every_streaming_command_takes_wire_compression(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*args, "--wire-compression", "fast"])
    _out, err = capsys.readouterr()
    assert info.value.code == ExitCode.USAGE
    assert "Invalid value for '--wire-compression': 'fast': takes auto, force or off" in err
    with pytest.raises(SystemExit):
        main([args[0], "--help"])
    out, _err = capsys.readouterr()
    assert "--wire-compression" in out and "force" in out
