"""Logs (docs/output.md "Logs"): `--log-format text|json` and `--log-level` on every
command, UPR_LOG_FORMAT and UPR_LOG, JSON lines with secrets redacted, text as always.

Cases run `upr` in this process (`main`, stderr captured) and, where the process's own
stderr and environment matter, as a real process; a real `upr serve` where a module
must log.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from tests.e2e.conftest import PASSWORD, Node
from upr_cli import logs
from upr_cli.cli.app import app, main
from upr_cli.cli.help import COMMANDS, load_command
from upr_cli.net.uri import SourceUri

NOT_A_REPO = "not a upr repository (no repo.json)"
#: a TLS source nothing listens on: --no-verify warns, then the connection fails
DEAD_TLS = "uprs://admin:pw@127.0.0.1:1/default"
NO_VERIFY = "upr: warning: --no-verify: the server certificate is not checked"


def upr(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`upr ARGS` in a process of its own, with `env` over a clean log environment."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("UPR_DEBUG", "UPR_PASSWORD", "UPR_LOG", "UPR_LOG_FORMAT")}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "upr_cli", *args], capture_output=True,
                          text=True, timeout=120, env=base | env, check=False)  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str,
        **env: str) -> tuple[int, str]:  # fmt: skip
    """`upr ARGS` in this process, with `env` over a clean log environment: (exit, stderr)."""
    for name in ("UPR_DEBUG", "UPR_PASSWORD", "UPR_LOG", "UPR_LOG_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def objects(stderr: str) -> list[dict[str, Any]]:
    """Every line of `stderr` as a JSON object (each line must be one)."""
    out = [json.loads(line) for line in stderr.splitlines()]
    for obj in out:
        assert list(obj)[:5] == ["time", "level", "command", "event", "message"], obj
        when = datetime.datetime.fromisoformat(obj["time"].replace("Z", "+00:00"))
        assert obj["time"].endswith("Z") and when.utcoffset() == datetime.timedelta(0)
    return out


Cap = pytest.CaptureFixture[str]
Env = pytest.MonkeyPatch


def test_a_failing_command_gives_one_json_error_object(
    tmp_path: Path, capsys: Cap, monkeypatch: Env
) -> None:
    missing = str(tmp_path / "none")
    proc = upr("--log-format", "json", "info", "--repo", missing)  # a real process's stderr
    assert proc.returncode == 2 and proc.stdout == ""
    code, err = run(capsys, monkeypatch, "info", "--repo", missing, "--log-format", "json")
    for obj in (*objects(proc.stderr), *objects(err)):
        assert (obj["level"], obj["event"], obj["command"]) == ("error", "error", "info")
        assert obj["message"] == f"{missing}: {NOT_A_REPO}"
        assert (obj["exit_code"], obj["kind"]) == (2, "UsageError")
    code, err = run(capsys, monkeypatch, "--log-format", "json", "info", "--bogus")
    [obj] = objects(err)
    assert code == 2 and "No such option: --bogus" in obj["message"]


def test_text_format_is_as_always(tmp_path: Path, capsys: Cap, monkeypatch: Env) -> None:
    missing = str(tmp_path / "none")
    for extra in ([], ["--log-format", "text"], ["--log-level", "notice"]):
        _, err = run(capsys, monkeypatch, "info", "--repo", missing, *extra)
        assert err == f"upr: error: {missing}: {NOT_A_REPO}\n"
        _, err = run(capsys, monkeypatch, "tail", DEAD_TLS, "--no-verify", "--until-end", *extra)
        warning, error = err.splitlines()
        assert warning.startswith(NO_VERIFY) and error.startswith("upr: error: cannot connect")


def test_a_warning_is_a_warning_object_and_levels_hide_it(capsys: Cap, monkeypatch: Env) -> None:
    tail = ("tail", DEAD_TLS, "--no-verify", "--until-end")
    _, err = run(capsys, monkeypatch, *tail, "--log-format", "json")
    warning, error = objects(err)
    assert (warning["level"], warning["event"]) == ("warning", "warning")
    assert warning["command"] == "tail"
    assert ("upr: warning: " + warning["message"]).startswith(NO_VERIFY)
    assert error["level"] == "error" and error["message"].startswith("cannot connect")
    # --log-level error: the warning is not shown, in either format; the error always is
    _, err = run(capsys, monkeypatch, *tail, "--log-level", "error")
    assert err.startswith("upr: error: cannot connect") and err.count("\n") == 1
    _, err = run(capsys, monkeypatch, *tail, "--log-level", "ERROR", "--log-format", "json")
    assert [o["event"] for o in objects(err)] == ["error"]


def test_the_environment_sets_both_and_the_options_win(
    tmp_path: Path, capsys: Cap, monkeypatch: Env
) -> None:
    missing = str(tmp_path / "none")
    proc = upr("info", "--repo", missing, UPR_LOG_FORMAT="json")  # a real process's environment
    assert objects(proc.stderr)[0]["event"] == "error"
    _, err = run(capsys, monkeypatch, "info", "--repo", missing, "--log-format", "text",
                 UPR_LOG_FORMAT="json")  # fmt: skip
    assert err.startswith("upr: error: ")
    tail = ("tail", DEAD_TLS, "--no-verify", "--until-end")
    _, err = run(capsys, monkeypatch, *tail, UPR_LOG="error", UPR_LOG_FORMAT="JSON")
    assert [o["event"] for o in objects(err)] == ["error"]
    _, err = run(capsys, monkeypatch, *tail, "--log-level", "warning", UPR_LOG="error")
    assert err.startswith(NO_VERIFY)
    # bad values: a usage error naming the option or the variable
    code, err = run(capsys, monkeypatch, "info", "--repo", missing, "--log-format", "xml")
    assert code == 2 and "--log-format" in err and "text or json" in err
    code, err = run(capsys, monkeypatch, "info", "--repo", missing, UPR_LOG_FORMAT="xml")
    assert code == 2 and err.startswith("upr: error: UPR_LOG_FORMAT: 'xml'")
    code, err = run(capsys, monkeypatch, "info", "--repo", missing, UPR_LOG="loud")
    assert code == 2 and err.startswith("upr: error: UPR_LOG: 'loud'")


def test_a_password_in_a_uri_never_appears(tmp_path: Path, capsys: Cap, monkeypatch: Env) -> None:
    target = "sqlite:upr://admin:hunter22@h/x"  # the error line quotes the target as given
    _, err = run(capsys, monkeypatch, "restore", "--repo", str(tmp_path), target,
                 "--log-format", "json")  # fmt: skip
    [obj] = objects(err)
    assert "hunter22" not in err and "upr://admin:***@h/x" in obj["message"]
    _, err = run(capsys, monkeypatch, "restore", "--repo", str(tmp_path), target)  # text
    assert "hunter22" not in err and "upr://admin:***@h/x" in err
    # fields: a SourceUri as it redacts itself, secret names whatever their value
    uri = SourceUri.parse("upr://u:hunter22@127.0.0.1:11210/b")
    rec = logs.record("info", "x", f"to {uri.host}", source=uri, password="hunter22",
                      repo_key="hunter22", token=7, note="couchbase://u:hunter22@h:1/b",
                      nested={"secret": "hunter22", "n": 1})  # fmt: skip
    assert "hunter22" not in json.dumps(rec)
    assert rec["source"] == "upr://u:***@127.0.0.1:11210/b" and rec["nested"]["n"] == 1
    assert rec["password"] == rec["repo_key"] == rec["token"] == "***"


def test_log_level_debug_shows_the_modules_records(tmp_path: Path) -> None:
    """A node serving with --log-level debug and JSON, and a tail of it at debug: the
    records of upr's module loggers, as JSON objects and as text, no password."""
    node = Node(tmp_path / "node", "--log-level", "debug", "--log-format", "json",
                partitions=2).start()  # fmt: skip
    try:
        # real processes: the tail's output stream is bound when its module is imported
        proc = upr("tail", node.uri, "--until-end", "--log-level", "debug", "--log-format", "json")
        err = proc.stderr
        assert proc.returncode == 0, err
        records = [o for o in objects(err) if o["event"] == "log"]
        opened = [o for o in records if o["logger"] == "upr_cli.dcp.opening"]
        assert opened and all(o["level"] == "debug" and o["command"] == "tail" for o in opened)
        assert "stream open from" in opened[0]["message"]
        text = upr("tail", node.uri, "--until-end", UPR_LOG="debug").stderr
        assert re.search(r"^\d{4}-\d\d-\d\d [\d:,]+ upr-tail DEBUG upr_cli\.dcp\.opening: "
                         r"partition 0: stream open from", text, re.M), text  # fmt: skip
        assert PASSWORD not in err + text
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        _, served_err = node.proc.communicate(timeout=60)
    finally:
        node.close()
    served = objects(served_err)
    assert {o["command"] for o in served} == {"serve"}
    assert any(o["level"] == "debug" and o["event"] == "log" for o in served)  # serve's own level
    assert served[-1]["event"] == "notice" and "stopped by SIGTERM" in served[-1]["message"]


def test_every_command_takes_both_options() -> None:
    def leaves(path: str, command: Any) -> list[tuple[str, Any]]:
        subs = getattr(command, "commands", None)
        if not subs:
            return [(path, command)]
        return [leaf for name, sub in subs.items() for leaf in leaves(f"{path} {name}", sub)]

    root = typer.main.get_command(app)
    commands = [("upr", root)]
    for name in COMMANDS:
        commands += leaves(name, load_command(name))
    for path, command in commands:
        opts = [o for p in command.params for o in getattr(p, "opts", ())]
        assert opts.count("--log-format") == opts.count("--log-level") == 1, path
