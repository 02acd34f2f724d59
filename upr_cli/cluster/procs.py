"""Starting and stopping the `upr serve` processes of a local cluster.

A node runs detached (its own session) with stdout and stderr in `DATA/serve.log`; it is
up once that log shows its `listening` line (and, in a TLS cluster, its `listening-tls`
line: `upr serve` prints both at once). A TLS cluster's nodes serve TLS on a port of their
own beside the plain one; the orchestrator and the replication streams between nodes use
the plain ports, on loopback. The password goes to the node in its
environment (UPR_PASSWORD, which `upr serve` reads), never in its argv: any local user
can read a process's argv (`ps`), only its owner its environment. Stop is SIGTERM (a
clean shutdown: the node flushes and keeps its failover uuids) and a wait; `kill`
(SIGKILL) is for tests and the failover walkthrough.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from upr_cli.cluster.spec import HOST, ClusterSpec, NodeSpec
from upr_cli.errors import UprError


class ClusterError(UprError):
    """A node did not start or stop as asked, or a failover or rebalance step failed."""


def alive(pid: int | None) -> bool:
    """True while the process runs (and is not a zombie)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().split()[2] != "Z"
    return True


def start_node(spec: ClusterSpec, node: NodeSpec, *, extra: list[str] | None = None,
               timeout: float = 30.0) -> None:  # fmt: skip
    """Start a node on its port (0: any free one, then recorded) and wait until it serves."""
    data = Path(node.data)
    data.mkdir(parents=True, exist_ok=True)
    log_path = data / "serve.log"
    cmd = [sys.executable, "-m", "upr_cli", "serve", "--data", str(data), "--host", HOST,
           "--port", str(node.port), "--num-partitions", str(spec.partitions), "--bucket",
           spec.bucket, "--user", spec.user, *(extra or [])]  # fmt: skip
    if spec.tls:  # its TLS port: the one it had (0 the first time: any free one)
        cmd += ["--tls-cert", spec.tls_cert, "--tls-key", spec.tls_key,
                "--tls-port", str(node.tls_port or 0)]  # fmt: skip
        if spec.tls_client_ca:  # client certificates (docs/protocol.md §13.5)
            cmd += ["--tls-client-ca", spec.tls_client_ca, "--tls-client-auth",
                    spec.tls_client_auth or "enable"]  # fmt: skip
    env = os.environ | {"UPR_PASSWORD": spec.password}
    with open(log_path, "ab") as log:
        start = log.tell()
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_bytes()[start:].decode(errors="replace")
        ports = _listening(text.splitlines())
        if "listening" in ports and (not spec.tls or "listening-tls" in ports):
            node.port = ports["listening"]
            node.tls_port = ports.get("listening-tls")
            node.pid = proc.pid
            return
        if proc.poll() is not None:
            last = text.strip().splitlines()[-1:] or ["(no output)"]
            raise ClusterError(f"node {node.name} did not start: {last[0]} (see {log_path})")
        time.sleep(0.05)
    proc.kill()
    raise ClusterError(f"node {node.name} did not start within {timeout:g}s (see {log_path})")


def _listening(lines: list[str]) -> dict[str, int]:
    """The ports of the node's `listening URI` and `listening-tls URI` lines."""
    out = {}
    for line in lines:
        word, _, uri = line.partition(" ")
        if word in ("listening", "listening-tls") and "://" in uri:
            out[word] = int(uri.rsplit(":", 1)[1].split("/")[0])
    return out


def stop_node(node: NodeSpec, *, sig: int = signal.SIGTERM, timeout: float = 60.0) -> bool:
    """Signal a node we started and wait for it to exit; False if it was not running."""
    if node.adopted or not alive(node.pid):
        node.pid = None
        return False
    assert node.pid is not None
    os.kill(node.pid, sig)
    deadline = time.monotonic() + timeout
    while alive(node.pid):
        if time.monotonic() > deadline:
            raise ClusterError(f"node {node.name} (pid {node.pid}) did not stop in {timeout:g}s")
        time.sleep(0.05)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(node.pid, os.WNOHANG)
    node.pid = None
    return True
