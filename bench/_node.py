"""What the benchmarks share: a `upr serve` child process (loopback, no auth, free port),
the `upr` command line in this interpreter, a child process timed with its own peak RSS,
and progress lines on stderr."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


UPR = [sys.executable, "-m", "upr_cli"]
_T0 = time.monotonic()


def upr(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `upr ARGS` to its end (output captured); a failure raises CalledProcessError."""
    return subprocess.run([*UPR, *args], capture_output=True, text=True, check=True)


def say(message: str) -> None:
    """A progress line on stderr, with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


#: the launcher `run_measured` starts each command through: it runs the command, waits
#: for it with wait4 and writes "MAXRSS_KB SECONDS" to the file named by argv[1]
_LAUNCHER = (
    "import os, subprocess, sys, time\n"
    "t = time.perf_counter()\n"
    "p = subprocess.Popen(sys.argv[2:])\n"
    "_pid, status, usage = os.wait4(p.pid, 0)\n"
    "secs = time.perf_counter() - t\n"
    "open(sys.argv[1], 'w').write(f'{usage.ru_maxrss} {secs}')\n"
    "sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)\n"
)


class CommandFailed(SystemExit):
    """A command `run_measured` ran exited non-zero: ends the benchmark with the command
    and the end of its stderr, unless a caller that can go on without it catches it."""

    def __init__(self, cmd: list[str], returncode: int, tail: str) -> None:
        super().__init__(f"{' '.join(cmd[2:4])} exited {returncode}: {tail}")
        self.returncode = returncode
        self.tail = tail

    @property
    def last_line(self) -> str:
        """The last non-empty line of its stderr (its one-line error)."""
        lines = [line for line in self.tail.splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(no message)"


def run_measured(cmd: list[str], *, discard: bool = False,
                 env: dict[str, str] | None = None) -> tuple[float, float, str]:  # fmt: skip
    """(seconds, the child's own peak RSS in MB, its stdout) of one command run to its
    end; `discard` sends its stdout to /dev/null instead; `env` replaces the environment.
    A failure raises `CommandFailed`.

    The command is started by a small launcher process (`_LAUNCHER`), in a session of
    its own, which reads the peak with wait4: Linux counts the peak RSS of the process
    a child was forked (or vforked) from into the child's ru_maxrss, so a command forked
    straight from a benchmark that holds a million rows would report the benchmark's
    peak, not its own. Killed as a group when the benchmark is interrupted."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            tempfile.NamedTemporaryFile("r", suffix=".rss") as usage:  # fmt: skip
        sink = subprocess.DEVNULL if discard else out
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, usage.name, *cmd],
                                stdout=sink, stderr=err, start_new_session=True,
                                env=env)  # fmt: skip
        try:
            proc.wait()
        except BaseException:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read()[-2000:].strip()
            raise CommandFailed(cmd, proc.returncode, tail)
        kb, secs = usage.read().split()
        out.seek(0)
        return float(secs), int(kb) / 1024, out.read()


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a running process in MB (0.0 when it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak_rss(pid: int) -> None:
    """Set a process's VmHWM back to its current RSS (proc(5), /proc/PID/clear_refs "5"),
    so that a later read is the peak of what happened since."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def stop_process(proc: subprocess.Popen[str], grace: float = 30.0) -> None:
    """SIGTERM, then SIGKILL when it is still running after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class BenchNode:
    """Start/stop a node; read its peak RSS. Its stderr goes to DATA.log (an unread
    pipe could fill and stall the node)."""

    def __init__(self, data: Path, partitions: int = 1024, *extra: str) -> None:
        data.parent.mkdir(parents=True, exist_ok=True)
        self.log = data.with_name(data.name + ".log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [*UPR, "serve", "--data", str(data), "--port", "0",
                 "--no-auth", "--num-partitions", str(partitions), *extra],
                stdout=subprocess.PIPE, stderr=log, text=True,
            )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening "):
            stop_process(self.proc, 5)
            raise SystemExit(f"upr serve did not start: {self.log.read_text()[-2000:]}")
        self.uri = line.split()[1]

    def __enter__(self) -> BenchNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def peak_rss_mb(self) -> float:
        """VmHWM of the node process."""
        return peak_rss_mb(self.proc.pid)

    def reset_peak(self) -> None:
        """Start the node's peak RSS afresh (see `reset_peak_rss`)."""
        reset_peak_rss(self.proc.pid)

    def wait_persisted(self, timeout: float = 600.0) -> None:
        """Poll STAT vbucket-seqno until every partition's persisted seq equals its high seq."""
        import asyncio

        from upr_cli.net.bootstrap import connect
        from upr_cli.net.uri import SourceUri

        async def done() -> bool:
            s = await connect(SourceUri.parse(self.uri))
            try:
                st = await s.conn.stats("vbucket-seqno")
            finally:
                await s.conn.aclose()
            highs = {
                k[: -len(":high_seqno")]: v for k, v in st.items() if k.endswith(":high_seqno")
            }
            return all(st[f"{vb}:last_persisted_seqno"] == h for vb, h in highs.items())

        deadline = time.monotonic() + timeout
        while not asyncio.run(done()):
            if time.monotonic() > deadline:
                raise SystemExit("the node did not persist its writes in time")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 30 s; then its stdout pipe closed."""
        stop_process(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
