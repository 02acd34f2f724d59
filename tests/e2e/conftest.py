"""Real `upr serve` processes on free loopback ports (no mocks of our own node)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.e2e_helpers import reap, reap_background, spawn

USER, PASSWORD = "admin", "s3cret-pw"
START_TIMEOUT = 60.0  # seconds for `upr serve` to say it listens


class Node:
    """A `upr serve` child process; restartable on the same port and data directory."""

    def __init__(self, data: Path, *args: str, partitions: int = 16) -> None:
        self.data = data
        self.args = list(args)
        self.partitions = partitions
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None

    @property
    def uri(self) -> str:
        """upr:// URI with credentials."""
        return f"upr://{USER}:{PASSWORD}@127.0.0.1:{self.port}/default"

    def start(self, *extra: str) -> Node:
        """Start and wait for the `listening` line (reusing the port after a restart)."""
        cmd = [sys.executable, "-m", "upr_cli", "serve", "--data", str(self.data), "--port",
               str(self.port), "--num-partitions", str(self.partitions), "--user", USER,
               "--password", PASSWORD, *self.args, *extra]  # fmt: skip
        if self.alive():
            raise RuntimeError("the node is running: stop or kill it before starting it again")
        if self.proc is not None:
            reap(self.proc)  # the previous run's pipes
        for _attempt in range(50):
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)  # fmt: skip
            assert self.proc.stdout is not None
            # a node that hangs before listening fails here, not at the test's timeout
            ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT)
            line = self.proc.stdout.readline() if ready else ""
            if line.startswith("listening "):
                self.port = int(line.rsplit(":", 1)[1].split("/")[0])
                return self
            if not ready:
                reap(self.proc)
                raise RuntimeError(f"upr serve printed nothing in {START_TIMEOUT:g}s")
            err = self.proc.stderr.read() if self.proc.stderr else ""
            reap(self.proc)
            if "cannot listen" not in err:  # the old port may linger briefly after SIGKILL
                raise RuntimeError(f"upr serve did not start: {err.strip()}")
            time.sleep(0.1)
        raise RuntimeError("upr serve could not get its port back")

    def stop(self) -> int:
        """SIGTERM: a clean stop (SIGKILL if it does not end within a minute)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        finally:
            reap(self.proc)
        return code

    def kill(self) -> None:
        """SIGKILL: an unclean stop that loses unpersisted writes."""
        assert self.proc is not None
        reap(self.proc)

    def close(self) -> None:
        """Kill the process if it runs and close its pipes (fixture teardown)."""
        if self.proc is not None:
            reap(self.proc)

    def rss_kib(self) -> int:
        """Resident set size of the node process."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[type[Node]]:
    """Make nodes in tmp_path; every node still running at the end is killed."""
    made: list[Node] = []

    class Made(Node):
        def __init__(self, *args: str, partitions: int = 16, name: str = "node") -> None:
            super().__init__(tmp_path / name, *args, partitions=partitions)
            made.append(self)

    try:
        yield Made
    finally:
        for n in made:
            n.close()


@pytest.fixture
def node(node_factory: type[Node]) -> Node:
    """A started node with 16 partitions and a short flush interval."""
    return node_factory("--flush-interval", "0.02").start()


@pytest.fixture
def spawned() -> Iterator[Callable[..., subprocess.Popen[Any]]]:
    """Start processes the test owns: `spawned(*cmd, **popen)`; every one is killed,
    waited for and its pipes closed at teardown, even when the test timed out."""
    with contextlib.ExitStack() as stack:
        yield lambda *cmd, **popen: stack.enter_context(spawn(*cmd, **popen))


@pytest.fixture(autouse=True)
def _reap_background() -> Iterator[None]:
    """Processes helpers started in the background (`e2e_helpers.background`) end with
    the test that started them."""
    yield
    reap_background()


def upr(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the `upr` CLI as a real process."""
    env = dict(os.environ)
    env.pop("UPR_PASSWORD", None)
    proc = subprocess.run([sys.executable, "-m", "upr_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"upr {' '.join(args[:2])} exited {proc.returncode}: {proc.stderr}")
    return proc
