"""Peak RSS of a command or a node, for the memory tests (issue 27).

A command's peak is read by a small wrapper process, not from this test process: Linux
carries the peak RSS of the process a child was forked from into the child's ru_maxrss
(exec records the old address space's high-water mark), so a command started straight
from a pytest worker that holds some hundred MB would report the worker's peak."""

from __future__ import annotations

import base64
import os
import random
import subprocess
import sys
from pathlib import Path

# Runs the command and writes its peak RSS (ru_maxrss, KiB) to the fd in argv[1].
WRAPPER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_pid, status, usage = os.wait4(proc.pid, 0)
os.write(int(sys.argv[1]), str(usage.ru_maxrss).encode())
sys.exit(os.waitstatus_to_exitcode(status))
"""


def peak_mb(*args: str, timeout: float = 120) -> tuple[float, str]:
    """(peak RSS in MB, stdout) of one `upr ARGS` process that must succeed, its peak
    from its own rusage, so that no sample can miss it."""
    env = dict(os.environ)
    env.pop("UPR_PASSWORD", None)
    read, write = os.pipe()
    try:
        proc = subprocess.run([sys.executable, "-c", WRAPPER, str(write), sys.executable, "-m",
                               "upr_cli", *args], stdin=subprocess.DEVNULL, capture_output=True,
                              env=env, pass_fds=(write,), timeout=timeout)  # fmt: skip
        os.close(write)
        write = -1
        peak = os.read(read, 64)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return int(peak) / 1024, proc.stdout.decode()


def vm_hwm_mb(pid: int) -> float:
    """A running process's peak RSS (VmHWM) in MB; 0 once it has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0  # a zombie: its memory is gone


def large_values(docs: int = 20, size: int = 5 * 1024 * 1024) -> dict[bytes, bytes]:
    """`docs` JSON documents of about `size` bytes each, of base64 random bytes (barely
    compressible), the same for every run."""
    rng = random.Random(27)
    raw = size * 3 // 4
    return {f"big-{i:02d}".encode(): b'{"v":"' + base64.b64encode(rng.randbytes(raw)) + b'"}'
            for i in range(docs)}  # fmt: skip
