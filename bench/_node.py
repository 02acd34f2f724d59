"""A `upr serve` child process for benchmarks (loopback, no auth, free port)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path


class BenchNode:
    """Start/stop a node; read its peak RSS."""

    def __init__(self, data: Path, partitions: int = 1024, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "upr_cli", "serve", "--data", str(data), "--port", "0",
             "--no-auth", "--partitions", str(partitions), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening "):
            raise SystemExit(
                f"upr serve did not start: {self.proc.stderr.read() if self.proc.stderr else ''}"
            )
        self.uri = line.split()[1]

    def peak_rss_mb(self) -> float:
        """VmHWM of the node process."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        """SIGTERM and wait."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=600)
