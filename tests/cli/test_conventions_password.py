"""Passwords out of `ps` and the environment: `--password-file FILE` on every command
that takes a URI, and a prompt on a terminal when a URI names a user without a password
(none without a terminal: a cron job gets today's error, never a hang). Against a real
`upr serve` with a user, the prompt answered through a pseudo-terminal."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_conventions_repo_env import commands
from tests.e2e.conftest import PASSWORD, USER, Node
from tests.repo.repo_helpers import run_upr
from upr_cli.errors import ExitCode, UsageError
from upr_cli.net.uri import read_password_file

ROOT = Path(__file__).resolve().parents[2]


def test_every_command_that_takes_a_uri_takes_password_file() -> None:
    # a command that connects takes --cacert (docs: "every command that connects")
    connecting = {n for n, cmd in commands() for p in cmd.params if "--cacert" in p.opts}
    assert {"tail", "backup", "restore", "diff", "load", "replay", "salvage"} <= connecting
    taking = {n for n, cmd in commands() for p in cmd.params if "--password-file" in p.opts}
    assert connecting <= taking


def test_the_file_is_read_as_restic_reads_it(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_bytes(b"s3cret \n")
    assert read_password_file(f) == "s3cret "  # one trailing newline removed, nothing else
    f.write_bytes(b"a\r\n")
    assert read_password_file(f) == "a"
    for content, why in ((b"", "is empty"), (b"\n", "is empty"), (b"\xff", "not UTF-8")):
        f.write_bytes(content)
        with pytest.raises(UsageError, match=why) as info:
            read_password_file(f)
        assert info.value.exit_code == ExitCode.USAGE
    with pytest.raises(UsageError, match="cannot read it"):
        read_password_file(tmp_path / "missing")
    with pytest.raises(UsageError, match="is a directory"):
        read_password_file(tmp_path)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("pw") / "node", partitions=4).start()
    try:
        yield n
    finally:
        n.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "UPR_PASSWORD"}
    return env | {"PYTHONPATH": str(ROOT)} | extra


def _tail(node: Node, *args: str) -> list[str]:
    uri = f"upr://{USER}@127.0.0.1:{node.port}/default"  # a user, no password
    return [sys.executable, "-m", "upr_cli", "tail", uri, "--until-end", "--wait", "0", *args]


def test_password_file_authenticates_and_errors_are_one_line(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.delenv("UPR_PASSWORD", raising=False)  # and restored after the test
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # no terminal, even under pytest -s
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text(PASSWORD + "\n")
    bad.write_text("wrong\n")
    tail = _tail(node)[3:]  # in this process
    code, _out, err = run_upr(capsys, *tail, "--password-file", str(good))
    assert code == 0, err
    monkeypatch.setenv("UPR_PASSWORD", "stale")  # the file wins over the environment
    code, _out, err = run_upr(capsys, *tail, "--password-file", str(good))
    assert code == 0, err
    code, _out, err = run_upr(capsys, *tail, "--password-file", str(bad))
    assert code == 1 and "authentication failed" in err
    (tmp_path / "empty").write_text("")
    for path, why in ((tmp_path / "none", "cannot read it"),
                      (tmp_path / "empty", "the file is empty")):  # fmt: skip
        code, _out, err = run_upr(capsys, *tail, "--password-file", str(path))
        assert code == ExitCode.USAGE, err
        assert err.startswith(f"upr: error: --password-file {path}: {why}")
        assert err.count("\n") == 1 and "Traceback" not in err
    # no terminal, no password: nothing asked, today's error says what to set
    monkeypatch.delenv("UPR_PASSWORD")
    code, _out, err = run_upr(capsys, *tail)
    assert code == 1 and f"no password for {USER}: set UPR_PASSWORD" in err
    assert "Password for" not in err


def _read_until(fd: int, text: str, seconds: float = 30.0) -> str:
    seen, end = "", time.monotonic() + seconds
    while text not in seen and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            seen += chunk.decode(errors="replace")
    return seen


def test_a_terminal_is_asked_for_the_password(node: Node) -> None:
    master, slave = pty.openpty()
    # a session of its own without a controlling terminal: getpass reads the pty on
    # stdin, with echo off, and writes its prompt to stderr (here a pipe)
    proc = subprocess.Popen(_tail(node, "--format", "json"), env=_env(), stdin=slave,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip
    os.close(slave)
    try:
        assert proc.stderr is not None
        prompt = _read_until(proc.stderr.fileno(), ": ")
        assert prompt.startswith(f"Password for {USER}@127.0.0.1:{node.port}: "), prompt
        os.write(master, (PASSWORD + "\n").encode())
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert PASSWORD.encode() not in out + err  # asked without echo, never printed
