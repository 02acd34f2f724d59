"""`upr rollback-point` as users run it: exit codes, the --json object, errors on stderr."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from upr_cli.cli.app import main

SERVER = '[["deadbeef",8],["cafebabe",0]]'
CLIENT = '[["ba5eba11",7],["cafebabe",0]]'


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_done_when_example_prints_rollback_seq_6(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "rollback-point", "--server-log", SERVER, "--client-log", CLIENT,
        "--snapshot-seq", "6", "--seen-seq", "9", "--json",
    )  # fmt: skip
    assert code == 0 and err == ""
    assert '"rollback_seq": "6"' in out
    obj = json.loads(out)
    assert obj == {
        "schema": 1,
        "rule": "seed",
        "rollback_seq": "6",
        "must_roll_back": True,
        "step": "next-entries-smaller",
        "common_ancestor": {"uuid": "3405691582", "seq": "0", "uuid_hex": "cafebabe"},
        "bound": "6",
        "explanation": [
            "logs differ: elided client entries above snapshot 6: ba5eba11@7",
            "server log with sentinel: [ffffffff@9, deadbeef@8, cafebabe@0]; "
            "client log with sentinel: [00000000@6, cafebabe@0]",
            "common ancestor cafebabe@0; next newer entries: server deadbeef@8, client 00000000@6",
            "not both sentinels: take the smaller, 6",
        ],
    }


def test_text_output_explains(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "rollback-point", "--server-log", SERVER, "--client-log", CLIENT,
        "--snapshot-seq", "6", "--seen-seq", "9",
    )  # fmt: skip
    assert code == 0
    assert "roll back to 6" in out and "common ancestor: cafebabe at seq 0" in out


def test_log_from_file(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from pathlib import Path

    p = Path(str(tmp_path)) / "server.json"
    p.write_text(SERVER)
    code, out, _ = run(
        capsys, "rollback-point", "--server-log", f"@{p}", "--client-log", CLIENT,
        "--snapshot-seq", "7", "--seen-seq", "9", "--json",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["rollback_seq"] == "7"


def test_impossible_case_exits_3_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "rollback-point", "--server-log", '[["cafebabe",0]]', "--client-log", CLIENT,
        "--snapshot-seq", "7", "--seen-seq", "9", "--json",
    )  # fmt: skip
    assert code == 3 and out == ""
    assert err.count("\n") == 1 and err.startswith("upr: error: not possible")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--server-log", "[[", "--client-log", "[]"], "not valid JSON"),
        (["--server-log", '[["cafebabe",0],["deadbeef",8]]', "--client-log", "[]"],
         "not newest-first"),
        (["--server-log", '[["0",0]]', "--client-log", "[]"], "uuid 0"),
        (["--server-log", '[["cafebabe",-1]]', "--client-log", "[]"], "negative"),
        (["--server-log", SERVER, "--client-log", "[]", "--seen-seq", "-1"], "--seen-seq"),
        (["--server-log", SERVER, "--client-log", "[]", "--seen-seq", "x"], "--seen-seq"),
        (["--server-log", "@/nonexistent/log.json", "--client-log", "[]"], "cannot read"),
        (["--server-log", SERVER, "--client-log", "[]", "--snapshot-seq", "9", "--seen-seq", "8"],
         "exceeds seen seq"),
        (["--server-log", SERVER, "--client-log", CLIENT], "needs --snapshot-seq, --seen-seq"),
        (["--server-log", SERVER, "--rule", "nope", "--client-log", "[]"], "unknown rule"),
        (["--server-log", SERVER, "--bogus"], "No such option"),
        (["--client-log", CLIENT], "give --server-log"),
        (["--rule", "dcp", "--server-log", SERVER, "--start", "3"], "--high-seq"),
        (["--rule", "dcp", "--server-log", SERVER, "--start", "3", "--high-seq", "9",
          "--uuid", "zz"], "not a hex string"),
    ],
)  # fmt: skip
def test_malformed_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    full = ["rollback-point", *args]
    if "--snapshot-seq" not in args and "--client-log" in args and args[-1] != CLIENT:
        full += ["--snapshot-seq", "1"]
    if "--seen-seq" not in args and "--client-log" in args and args[-1] != CLIENT:
        full += ["--seen-seq", "2"]
    code, out, err = run(capsys, *full)
    assert code == 2, err
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("upr: error: "), err
    assert needle in err
    assert "Traceback" not in err


def test_dcp_rule(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "rollback-point", "--rule", "dcp", "--server-log", SERVER, "--uuid", "cafebabe",
        "--start", "9", "--snap-start", "7", "--snap-end", "10", "--high-seq", "12", "--json",
    )  # fmt: skip
    obj = json.loads(out)
    assert code == 0 and obj["rollback_seq"] == "7" and obj["must_roll_back"] is True
    assert obj["step"] == "snap-start" and obj["common_ancestor"]["uuid_hex"] == "cafebabe"
    code, out, _ = run(
        capsys, "rollback-point", "--rule", "dcp", "--server-log", SERVER, "--client-log",
        '[["deadbeef",8],["cafebabe",0]]', "--start", "11", "--high-seq", "12", "--json",
    )  # fmt: skip
    obj = json.loads(out)
    assert code == 0 and obj["must_roll_back"] is False and obj["rollback_seq"] == "11"


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    from upr_cli import __version__

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out == f"upr {__version__}\n"
    code, out, _ = run(capsys, "rollback-point", "--help")
    assert code == 0 and "Example" in out and "--snapshot-seq" in out


def test_console_script_and_module_run_as_real_processes() -> None:
    for cmd in ([sys.executable, "-m", "upr_cli", "--version"],):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith("upr ")
    proc = subprocess.run(
        [sys.executable, "-m", "upr_cli", "rollback-point", "--server-log", "[", "--client-log",
         "[]", "--snapshot-seq", "0", "--seen-seq", "0"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("upr: error: --server-log: not valid JSON")
    assert proc.stderr.count("\n") == 1
