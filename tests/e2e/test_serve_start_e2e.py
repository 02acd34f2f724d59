"""`upr serve` at start, as real processes: one node per data directory (the lock,
upr_cli/node/lock.py), options that cannot make a node (one line, exit 2) and a
certificate outside its dates (one warning line)."""

from __future__ import annotations

import datetime
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.e2e.conftest import PASSWORD, USER, Node
from tests.e2e.e2e_helpers import docs, run, seqnos, set_keys, spawn, wait_persisted
from upr_cli.cluster.procs import ClusterError, start_node
from upr_cli.cluster.spec import ClusterSpec, NodeSpec
from upr_cli.node.lock import DataDirLock

# seconds: a start that fails takes under one; the margin is for a loaded machine
EXITS_AT_ONCE = 30.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("UPR_PASSWORD", "UPR_DEBUG")}
    return env | extra


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`upr serve ARGS` expected to exit at once (a node that serves instead fails the
    test when the timeout expires)."""
    cmd = [sys.executable, "-m", "upr_cli", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=EXITS_AT_ONCE,
                          env=env or _env(), check=False)  # fmt: skip


@dataclass
class Served:
    """A node's first stdout lines, and its stderr once it stopped."""

    lines: list[str]
    stderr: str = ""


@contextmanager
def _serving(data: Path, *args: str, env: dict[str, str] | None = None,
             lines: int = 1) -> Iterator[Served]:  # fmt: skip
    """A `upr serve --no-auth` on a free port, stopped with SIGTERM at the end of the
    block (killed if that fails), which must be a clean stop."""
    cmd = [sys.executable, "-m", "upr_cli", "serve", "--data", str(data), "--port", "0",
           "--no-auth", *args]  # fmt: skip
    with spawn(*cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
               env=env or _env()) as proc:  # fmt: skip
        assert proc.stdout is not None
        served = Served([])
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # its lines come in one write
        for _ in range(lines):
            line = proc.stdout.readline() if ready else ""
            if not line.startswith("listening"):
                proc.kill()
                raise AssertionError(f"upr serve did not start: {proc.communicate()[1]}")
            served.lines.append(line)
        yield served
        proc.send_signal(signal.SIGTERM)
        _, served.stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, served.stderr


def _one_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, proc
    assert proc.stdout == ""  # no `listening` line: it never served
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("upr: error: "), proc.stderr
    return proc.stderr


# ---------------------------------------------------------------- the lock


def test_a_second_node_on_one_data_directory_exits_at_once_naming_the_holder(
    node_factory: type[Node],
) -> None:
    first = node_factory("--flush-interval", "0.02", partitions=4).start()
    assert first.proc is not None
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    second = _serve("--data", str(first.data), "--port", "0", "--num-partitions", "4",
                    "--user", USER, "--password", PASSWORD)  # fmt: skip
    err = _one_line(second, 1)
    holder = (f"upr: error: {first.data}: data directory is locked by pid {first.proc.pid} "
              f"on host {socket.gethostname()} since ")  # fmt: skip
    assert err.startswith(holder), err
    since = datetime.datetime.fromisoformat(err[len(holder) :].strip())
    assert before - datetime.timedelta(seconds=60) <= since <= before
    # the first node serves on, and alone
    run(set_keys(first.uri, {b"mine": b'{"v":1}'}))
    assert docs(first.uri)[b"mine"][0] == b'{"v":1}'


def test_a_sigkilled_node_restarts_at_once_on_its_data_directory(
    node_factory: type[Node],
) -> None:
    node = node_factory("--flush-interval", "0.02", partitions=4).start()
    values = {f"k{i}".encode(): b'{"i":%d}' % i for i in range(20)}
    run(set_keys(node.uri, values))
    wait_persisted(node.uri)
    node.kill()  # SIGKILL: the lock file stays behind, its flock dies with the process
    assert (node.data / "node.lock").exists()
    node.start()  # at once: no lock error, no wait
    assert node.proc is not None
    assert json.loads((node.data / "node.lock").read_text())["pid"] == node.proc.pid
    assert {k: v[0] for k, v in docs(node.uri).items()} == values


def test_a_cluster_node_takes_the_same_lock(tmp_path: Path) -> None:
    """`upr cluster` starts its nodes as `upr serve` processes (cluster/procs.py): a node
    whose directory is held does not start, and the cluster says why."""
    data = tmp_path / "n0"
    data.mkdir()
    node = NodeSpec("n0", 0, str(data))
    spec = ClusterSpec("default", 4, 0, USER, PASSWORD, nodes=[node])
    held = DataDirLock(data)
    held.acquire()
    try:
        with pytest.raises(ClusterError) as refused:
            start_node(spec, node, timeout=EXITS_AT_ONCE)
        assert f"data directory is locked by pid {os.getpid()} " in str(refused.value)
    finally:
        held.release()
        if node.pid is not None:  # it started: kill it
            os.kill(node.pid, signal.SIGKILL)


# ---------------------------------------------------------------- options


def test_no_auth_ignores_upr_password_in_the_environment(tmp_path: Path) -> None:
    env = _env(UPR_PASSWORD="from-the-environment")
    with _serving(tmp_path / "node", "--num-partitions", "1", env=env) as served:
        assert served.lines[0].startswith("listening upr://127.0.0.1:")


def test_no_auth_with_users_is_a_usage_error(tmp_path: Path) -> None:
    data = str(tmp_path / "node")
    for users in (["--user", "u", "--password", "p"], ["--password", "p"]):
        err = _one_line(_serve("--data", data, "--port", "0", "--no-auth", *users), 2)
        assert "--no-auth" in err and "--user" in err, err


def test_data_that_is_a_regular_file_is_a_path_error(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("not a directory\n")
    err = _one_line(_serve("--data", str(path), "--port", "0", "--no-auth"), 2)
    assert err == f"upr: error: --data {path}: not a directory\n"
    assert path.read_text() == "not a directory\n"


def test_another_partition_count_than_the_directory_has_is_a_usage_error(
    tmp_path: Path,
) -> None:
    data = tmp_path / "node"
    with _serving(data, "--num-partitions", "2"):
        pass  # a bucket of 2 partitions
    err = _one_line(_serve("--data", str(data), "--port", "0", "--no-auth",
                           "--num-partitions", "4"), 2)  # fmt: skip
    assert "--num-partitions 4" in err and "has 2 partitions" in err, err
    # without the option, the node serves the count on disk
    with _serving(data) as served:
        port = int(served.lines[0].rsplit(":", 1)[1].split("/")[0])
        assert len(run(seqnos(f"upr://127.0.0.1:{port}/default"))) == 2


# ---------------------------------------------------------------- certificate dates


def test_an_expired_certificate_is_warned_about_at_start(tmp_path: Path) -> None:
    ca = trustme.CA()
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    not_before, not_after = now - datetime.timedelta(days=10), now - datetime.timedelta(days=1)
    leaf = ca.issue_cert("127.0.0.1", not_before=not_before, not_after=not_after)  # type: ignore[arg-type]
    cert, key = tmp_path / "node.pem", tmp_path / "node.key"
    cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-port", "0"]
    with _serving(tmp_path / "node", "--num-partitions", "1", *tls, lines=2) as served:
        pass
    warned = [line for line in served.stderr.splitlines() if " WARNING " in line]
    assert len(warned) == 1, served.stderr
    until = not_after.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert f"--tls-cert {cert}: the certificate expired on {until}" in warned[0]
    assert not_before.strftime("%Y-%m-%d %H:%M:%S UTC") in warned[0]
