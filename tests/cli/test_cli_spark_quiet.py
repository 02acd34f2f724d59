"""`upr spark …` keeps the JVM's start-up lines (its warnings, log4j's "Setting default
log level", Ivy's resolution, Spark's timestamped log lines) off the command's stderr,
in a log file removed when the command succeeds, and its summary's `seconds` is the wall
time, Spark's start-up (`startup_seconds`) included. One export of a tiny repository in
Spark local mode: Spark's start-up alone takes seconds."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.repo.repo_helpers import commit_backup
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord
from upr_cli.repo import Repository

ROOT = Path(__file__).resolve().parents[2]
#: what the JVM and Spark write on their own: a JVM warning, log4j's and Spark's
#: timestamped lines ("26/12/07 02:05:56 WARN …"), Spark's default-log-level lines, Ivy
CHATTER = re.compile(r"^(WARNING|WARN|ERROR|INFO|\d\d/\d\d/\d\d \d\d:\d\d:\d\d|Setting default "
                     r"log level|To adjust logging level|:: |Ivy)|ivy", re.IGNORECASE)  # fmt: skip

needs_spark = pytest.mark.skipif(
    importlib.util.find_spec("pyspark") is None or shutil.which("java") is None,
    reason="needs the spark extra and Java (make system-deps)",
)


@pytest.mark.slow  # a real Spark session: 35-55 s on two cores (make test-slow)
@needs_spark
def test_export_keeps_the_jvm_off_stderr_and_reports_wall_time(tmp_path: Path) -> None:
    r = Repository(tmp_path / "repo")
    r.init()
    rows = [DcpRecord(OP_MUTATION, 0, s, s, s, 0, 0, 0, 0, f"k{s}".encode(), b"v", 0)
            for s in (1, 2, 3)]  # fmt: skip
    commit_backup(r, 0, {0: rows})
    tmp = tmp_path / "tmp"  # the log file's place: TMPDIR
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    env.pop("UPR_LOG", None)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "upr_cli", "spark", "export", "--repo", str(r.path), "--to",
         str(tmp_path / "out"), "--master", "local[1]", "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=280, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    chatter = [line for line in done.stderr.splitlines() if not line.startswith("upr")]
    assert chatter == [], done.stderr
    assert not any(CHATTER.search(line) for line in done.stderr.splitlines())
    summary = json.loads(done.stdout)
    assert summary["items"] == 3
    # the wall time: Spark's start-up and the job, within what the process took
    assert 0 < summary["startup_seconds"] < summary["seconds"] <= elapsed
    assert list(tmp.glob("upr-spark-*.log")) == []  # removed on success


def test_the_log_stays_when_the_command_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from upr_cli import logs
    from upr_cli.cli import spark

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    logs.reset()
    with pytest.raises(RuntimeError), spark._jvm_output() as out:
        assert out is not None
        out.write(b"26/12/07 02:05:56 WARN NativeCodeLoader: ...\n")
        raise RuntimeError("the job failed")
    (log,) = tmp_path.glob("upr-spark-*.log")
    assert b"NativeCodeLoader" in log.read_bytes()
    assert f"Spark's own log (the JVM's output): {log}" in capsys.readouterr().err
    with spark._jvm_output() as out:  # success: the log goes
        assert out is not None
    assert list(tmp_path.glob("upr-spark-*.log")) == [log]
    with pytest.raises(RuntimeError), spark._jvm_output():  # failed before the JVM: empty
        raise RuntimeError("no pyspark")
    assert list(tmp_path.glob("upr-spark-*.log")) == [log]
    assert "Spark's own log" not in capsys.readouterr().err
    logs.set_level("debug")  # --log-level debug: the JVM keeps the command's stderr
    try:
        with spark._jvm_output() as out:
            assert out is None
    finally:
        logs.reset()
