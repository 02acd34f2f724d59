"""CLI errors of replay, diff and salvage: one line on stderr, exit 2, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from upr_cli.cli.app import main


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay", "repo:/x", "--into", "s.db", "--follow"], "apply to a live source"),
        (["replay", "ftp://x", "--into", "s.db"], "a source is upr://"),
        (["replay", "repo:/no/such/repo", "--into", "{tmp}/s.db"], "/no/such/repo"),
        (
            ["replay", "upr://127.0.0.1:1/default", "--into", "s.db", "--undo-window", "-1"],
            "--undo-window",
        ),
        (["replay", "repo:/x", "--into", "s.db", "--memory-limit", "lots"], "not a size"),
        (["replay", "repo:/x", "--into", "s.db", "--memory-limit", "1MB"], "at least 16MB"),
        (["diff", "nonsense", "sqlite:/x"], "a source is"),
        (["diff", "sqlite:{tmp}/missing.db", "{tmp}/a.json"], "no such store"),
        (["diff", "{tmp}/bad.json", "{tmp}/bad.json"], "not a JSON file"),
        (["salvage", "--into", "upr://127.0.0.1:1/default"], "exactly one of --repo"),
        (["salvage", "--repo", "/x", "--store", "/y", "--into", "upr://h/b"], "exactly one of"),
        (["salvage", "--repo", "/x"], "--into upr://"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    code, _out, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in args], capsys)
    assert code == 2, err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_diff_json_files_exit_1_when_they_differ(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    log = [{"uuid": "2", "seq": "5"}, {"uuid": "1", "seq": "0"}]
    a.write_text(json.dumps({"0": {"failover_log": log, "seq": "9"}}))
    b.write_text(json.dumps({"0": {"failover_log": [{"uuid": "1", "seq": "0"}], "seq": "7"}}))
    code, out, _err = run_cli(["diff", str(a), str(b), "--json"], capsys)
    assert code == 1 and json.loads(out)["partitions"][0]["diverged_at"] == "5"
    code, out, _err = run_cli(["diff", str(a), str(a)], capsys)
    assert code == 0 and "identical" in out
