"""Errors name the problem and exit with a documented code (README "Errors and exit codes").

Each case of the table runs `upr` as a real process: the exit code, one line on stderr
naming what is wrong, no traceback, no "internal error". The table in the README (and in
upr(1)) is checked against `ExitCode`, and every error class against the table.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import upr_cli
from tests.e2e.conftest import Node
from upr_cli.cli.app import main
from upr_cli.cli.options import restore_target
from upr_cli.errors import (
    DiskFull,
    ExitCode,
    LocalIOError,
    PathError,
    UprError,
    UsageError,
    os_error,
)

ROOT = Path(__file__).resolve().parents[2]
DEAD = "upr://admin:pw@127.0.0.1:1/default"  # nothing listens: a check that comes first wins


def upr(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`upr ARGS` as a real process (no UPR_DEBUG, no UPR_PASSWORD from the caller)."""
    env = {k: v for k, v in os.environ.items() if k not in ("UPR_DEBUG", "UPR_PASSWORD")}
    return subprocess.run([sys.executable, "-m", "upr_cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, check=False)  # fmt: skip


def fails(proc: subprocess.CompletedProcess[str], code: int, *names: str) -> None:
    """Exit `code`, one `upr: error:` line naming each of `names`, no traceback."""
    err = proc.stderr
    assert proc.returncode == code, (proc.returncode, err)
    assert err.startswith("upr: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    for name in names:
        assert name in err, (name, err)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    return int(info.value.code or 0), capsys.readouterr().err


# -- the table is the code's ------------------------------------------------------------


def _codes(text: str, start: str, end: str, row: str) -> set[int]:
    section = text[text.index(start) :]
    section = section[: section.index(end, len(start))]
    return {int(c) for c in re.findall(row, section, re.M)}


def test_readme_table_is_exit_code() -> None:
    readme = (ROOT / "README.md").read_text()
    codes = _codes(readme, "## Errors and exit codes", "\n## ", r"^\| (\d+) \|")
    assert codes == {int(c) for c in ExitCode}
    man = (ROOT / "man" / "upr.1").read_text()
    assert _codes(man, ".SH EXIT STATUS", "\n.SH ", r"^\.B (\d+)$") == {int(c) for c in ExitCode}


def _subclasses(cls: type[UprError]) -> Iterator[type[UprError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_error_exits_with_a_documented_code() -> None:
    for mod in pkgutil.walk_packages(upr_cli.__path__, "upr_cli."):
        importlib.import_module(mod.name)
    classes = list(_subclasses(UprError))
    assert len(classes) > 20
    for cls in [UprError, *classes]:
        assert cls.exit_code in set(ExitCode), f"{cls.__qualname__} exits {cls.exit_code}"


# -- the cases --------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Path]]:
    """A 16-partition node with 200 documents, and a repository holding one backup of it."""
    tmp = tmp_path_factory.mktemp("live")
    node = Node(tmp / "node", "--flush-interval", "0.02").start()
    try:
        assert upr("load", node.uri, "--docs", "200").returncode == 0
        repo = tmp / "repo"
        done = upr("backup", node.uri, "--repo", str(repo), "--no-progress")
        assert done.returncode == 0, done.stderr
        yield node, repo
    finally:
        node.kill()


@pytest.mark.parametrize(
    ("target", "names"),
    [("/tmp/x.db", ["'/tmp/x.db'", "sqlite:/tmp/x.db"]), ("foo:bar", ["'foo:bar'"]),
     ("", ["TARGET is empty"])],
)  # fmt: skip
def test_restore_target_typos(tmp_path: Path, target: str, names: list[str]) -> None:
    fails(upr("restore", "--repo", str(tmp_path), target), ExitCode.USAGE, *names)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("/tmp/x.db", "TARGET '/tmp/x.db' is a path: a SQLite store there is sqlite:/tmp/x.db"),
        ("foo:bar", "TARGET 'foo:bar': unknown kind of target"),
        ("ftp://user:pw@h/b", "TARGET 'ftp:…': unknown kind of target"),
        ("", "TARGET is empty"),
        ("sqlite:", "TARGET sqlite: needs a path"),
        ("sqlite:/no/such/dir/x.db", "TARGET sqlite:/no/such/dir/x.db: directory /no does not"),
    ],
)
def test_restore_target_is_parsed_before_anything(target: str, message: str) -> None:
    with pytest.raises(UsageError) as info:
        restore_target(target)
    assert str(info.value).startswith(message) and info.value.exit_code == ExitCode.USAGE
    assert "pw" not in str(info.value)


def test_restore_targets_that_are_fine(tmp_path: Path) -> None:
    assert restore_target("upr://a@h/b") == ("node", "upr://a@h/b")
    assert restore_target(f"sqlite:{tmp_path}/x.db") == ("sqlite", f"{tmp_path}/x.db")


def test_backup_repo_paths_that_cannot_be_a_repository(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    fails(upr("backup", DEAD, "--repo", f"{file}/sub"), ExitCode.USAGE,
          f"{file}/sub", f"{file} is not a directory")  # fmt: skip
    fails(upr("backup", DEAD, "--repo", str(file)), ExitCode.USAGE, f"{file}: exists and is not")
    if Path("/proc/self").exists():  # procfs refuses mkdir: ENOENT (EACCES when not root)
        fails(upr("backup", DEAD, "--repo", "/proc/x"), ExitCode.USAGE, "/proc/x")


def test_tail_checks_its_state_path_before_streaming(live: tuple[Node, Path]) -> None:
    node, _repo = live
    proc = upr("tail", node.uri, "--until-end", "--state", "/missing/dir/s.json")
    fails(proc, ExitCode.USAGE, "--state /missing/dir/s.json", "directory /missing does not exist")
    assert proc.stdout == ""  # nothing streamed


def test_examine_reads_the_partition_count_from_the_repository(live: tuple[Node, Path]) -> None:
    node, repo = live
    key = json.loads(upr("tail", node.uri, "--until-end", "--format", "json", "--count", "1",
                         "--partitions", "9").stdout.splitlines()[0])["key"]  # fmt: skip
    found = upr("examine", "--repo", str(repo), "--json", key)
    assert found.returncode == 0 and json.loads(found.stdout)["versions"][0]["partition"] == 9
    # --partitions selects partitions, as in every command (no longer a partition count)
    chosen = upr("examine", "--repo", str(repo), "--partitions", "8-9", "--json", key)
    assert chosen.returncode == 0 and json.loads(chosen.stdout)["versions"][0]["partition"] == 9
    fails(upr("examine", "--repo", str(repo), "--partitions", "12", key), ExitCode.USAGE,
          "--partitions", "is in partition 9", "16 partitions")  # fmt: skip
    fails(upr("examine", "--repo", str(repo), "--partitions", "32", key), ExitCode.USAGE,
          "16 partitions", "32 is not one of them")  # fmt: skip
    missing = upr("examine", "--repo", str(repo), "no-such-key")
    assert missing.returncode == ExitCode.FAILED and "no version" in missing.stdout


def test_rollback_point_without_arguments_says_what_is_missing() -> None:
    """Every option of rollback-point is optional, so the help alone (with an empty
    stderr) would not say what is wrong: the usage lines and what is missing, exit 2."""
    proc = upr("rollback-point")
    assert (proc.returncode, proc.stdout) == (ExitCode.USAGE, "")
    assert proc.stderr == (
        "Usage: upr rollback-point --server-log LOG [--client-log LOG] [OPTIONS]\n"
        "       upr rollback-point --server SOURCE --client SOURCE [OPTIONS]\n"
        "upr: error: give --server-log LOG (or --server and --client sources): see 'upr "
        "rollback-point --help'\n"
    )


# -- the same bad input exits the same in every command -------------------------------------


def _repo_commands(r: str, tmp: Path) -> list[list[str]]:
    return [
        ["backup", DEAD, "--repo", r],
        ["restore", "--repo", r, f"sqlite:{tmp}/out.db"],
        ["examine", "--repo", r, "key"],
        ["info", "--repo", r],
        ["verify", "--repo", r],
        ["salvage", "--repo", r, "--into", DEAD],
        ["replay", f"repo:{r}", "--into", f"{tmp}/s.db"],
        ["diff", f"repo:{r}", f"repo:{r}"],
        ["rollback-point", "--server", f"repo:{r}", "--client", f"repo:{r}"],
        ["spark", "export", "--repo", r, "--output", f"{tmp}/out"],
    ]


@pytest.mark.parametrize("bad", ["a file", "a repo.json that is not JSON"])
def test_a_repository_that_is_not_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, bad: str
) -> None:
    repo = tmp_path / "repo"
    if bad == "a file":
        repo.write_text("x")
        named = str(repo)
    else:
        repo.mkdir()
        (repo / "repo.json").write_text("{not json")
        named = f"{repo}/repo.json: not valid JSON"
    for args in _repo_commands(str(repo), tmp_path):  # in this process: 10 starts saved
        code, err = run_main(capsys, *args)
        assert code == ExitCode.USAGE and err.count("\n") == 1 and named in err, (args, err)
    fails(upr(*_repo_commands(str(repo), tmp_path)[0]), ExitCode.USAGE, named)  # and for real


@pytest.mark.parametrize(
    "args",
    [
        ["backup", DEAD, "--repo", "{tmp}/r"],
        ["restore", "--repo", "{tmp}", "sqlite:{tmp}/o.db"],
        ["info", "--repo", "{tmp}"],
        ["salvage", "--repo", "{tmp}", "--into", DEAD],
        ["replay", DEAD, "--into", "{tmp}/s.db"],
        ["diff", DEAD, DEAD],
        ["rollback-point", "--server", DEAD, "--client", DEAD],
        ["tail", DEAD],
    ],
)
def test_a_partition_no_bucket_has(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args] + ["--partitions", "0-3,5000"]
    code, err = run_main(capsys, *argv)
    assert code == ExitCode.USAGE and err.count("\n") == 1, err
    assert "--partitions: 5000 is not a partition (a bucket has at most 1024" in err


def test_diff_and_salvage_exit_2_when_a_source_fails(
    live: tuple[Node, Path], tmp_path: Path
) -> None:
    _node, repo = live
    fails(upr("diff", f"repo:{repo}", DEAD), ExitCode.USAGE, "cannot connect")
    fails(upr("salvage", "--repo", str(repo), "--into", DEAD), ExitCode.USAGE, "cannot connect")
    fails(upr("tail", DEAD, "--until-end"), ExitCode.FAILED, "cannot connect")  # 1 elsewhere


def test_paths_that_are_not_what_they_should_be(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    fails(upr("replay", DEAD, "--into", "/missing/dir/s.db"), ExitCode.USAGE,
          "--into /missing/dir/s.db", "directory /missing does not exist")  # fmt: skip
    fails(upr("tail", DEAD, "--state", str(tmp_path)), ExitCode.USAGE, "is a directory")
    fails(upr("cluster", "status", "--data", str(file)), ExitCode.USAGE,
          f"{file} is not a directory")  # fmt: skip
    fails(upr("spark", "export", "--repo", str(tmp_path), "--output", f"{file}/out"),
          ExitCode.USAGE, str(tmp_path))  # fmt: skip


# -- the funnel: OSError, bugs ------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "code", "names"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), ExitCode.IO_ERROR,
         ["{tmp}: no space left on device: the disk is full", "free on its file system"]),
        (OSError(errno.EIO, "Input/output error"), ExitCode.IO_ERROR,
         ["{tmp}: input/output error"]),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), ExitCode.FAILED,
         ["network error: connection reset by peer"]),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory", "{tmp}/f/x"), ExitCode.USAGE,
         ["{tmp}/f/x: {tmp}/f is not a directory"]),
    ],
)  # fmt: skip
def test_an_os_error_becomes_a_typed_error_naming_the_path(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    exc: OSError, code: int, names: list[str],
) -> None:  # fmt: skip
    (tmp_path / "f").write_text("x")
    if exc.filename:
        exc.filename = exc.filename.replace("{tmp}", str(tmp_path))

    def raises(*_a: object, **_k: object) -> None:
        raise exc

    monkeypatch.delenv("UPR_DEBUG", raising=False)
    monkeypatch.setattr("upr_cli.cli.examine.examine", raises)
    got, err = run_main(capsys, "examine", "--repo", str(tmp_path), "key")
    assert got == code and err.count("\n") == 1 and "Traceback" not in err, err
    for name in names:
        assert name.replace("{tmp}", str(tmp_path)) in err, err


def test_an_unexpected_error_is_a_bug_report_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def raises(*_a: object, **_k: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.delenv("UPR_DEBUG", raising=False)
    monkeypatch.setattr("upr_cli.cli.examine.examine", raises)
    code, err = run_main(capsys, "examine", "--repo", str(tmp_path), "key")
    assert code == ExitCode.INTERNAL and err.count("\n") == 1
    assert err.startswith("upr: error: internal error (a bug in upr: please report it")
    assert "UPR_DEBUG=1" in err and "ZeroDivisionError: division by zero" in err
    monkeypatch.setenv("UPR_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):  # the traceback, for the report
        main(["examine", "--repo", str(tmp_path), "key"])


def test_os_error_kinds(tmp_path: Path) -> None:
    full = os_error(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert isinstance(full, DiskFull) and full.exit_code == ExitCode.IO_ERROR
    assert full.free is not None and str(tmp_path) in str(full) and "disk is full" in str(full)
    quota = os_error(OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "x")))
    assert isinstance(quota, DiskFull) and "disk quota exceeded" in str(quota)
    ro = os_error(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x")))
    assert type(ro) is LocalIOError and ro.exit_code == ExitCode.IO_ERROR
    gone = os_error(FileNotFoundError(errno.ENOENT, "No such file", str(tmp_path / "a/b/c")))
    assert isinstance(gone, PathError) and f"directory {tmp_path / 'a'} does not exist" in str(gone)
    denied = os_error(PermissionError(errno.EACCES, "Permission denied", "/root/x"), doing="cannot")
    assert isinstance(denied, PathError) and str(denied) == "/root/x: cannot: permission denied"
