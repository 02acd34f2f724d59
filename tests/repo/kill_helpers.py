"""Run a `upr` command as a real process and SIGKILL it right before its Nth change to
the file system: what the crash tests of prune, remove and merge share.

The point is found without any hook in upr itself: the command runs under a small
wrapper (`WRAPPER`) that installs a Python audit hook (PEP 578) and then runs
`python -m upr_cli`. The hook sees every call that changes the repository (a file
opened for writing or created, a rename, a hard link, a directory made or removed, a
file removed, a tree removed), writes one line per such call to a log, and on the Nth
one sends SIGKILL to its own process before the call is made: the process dies there
as it would under `kill -9`, buffers unflushed, no `finally` run. A first run of the
same command on a copy of the repository (N = 0: never kill) lists every point; a
seeded RNG picks a kind of change (`kind`) and one of its occurrences.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WRAPPER = r"""
import os, runpy, signal, sys, threading
n, log, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT
PATHS = {"os.rename": 1, "os.link": 1, "os.mkdir": 0, "os.remove": 0, "os.rmdir": 0,
         "shutil.rmtree": 0, "open": 0}
guard = threading.Lock()
count = 0

def hook(event, args):
    global count
    at = PATHS.get(event)
    if at is None:
        return
    if event == "open" and not (isinstance(args[2], int) and args[2] & WRITES):
        return
    path = args[at]
    if isinstance(path, int) or path is None:
        return
    path = os.fsdecode(os.fspath(path))
    if os.path.isabs(path) and not path.startswith(root):
        return
    name = os.path.basename(path)
    if name in ("lock", "lock.shared") or "/readers" in path or name == "readers":
        return  # the locks: not the repository's content
    with guard:
        count += 1
        os.write(fd, f"{event}\t{path}\n".encode())
        if count == n:
            os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(hook)
sys.argv = ["upr", *sys.argv[4:]]
runpy.run_module("upr_cli", run_name="__main__", alter_sys=True)
"""


@dataclass(frozen=True)
class Change:
    """One change the command made (or was about to make), as the hook saw it."""

    event: str
    path: str

    @property
    def kind(self) -> str:
        """What the change is, for picking kill points of every kind."""
        name = os.path.basename(self.path)
        if self.event == "os.rename":
            if name.endswith("-removed"):
                return "discard"  # a directory renamed away before its removal
            if name == "manifest.json.copy":
                return "commit"  # the commit point
            if name == "manifest.json":
                return "manifest"
            if name.endswith(".seg"):
                return "publish"  # a finished segment renamed into place
            return "rename"
        if self.event == "os.link":
            return "link"
        if self.event == "os.mkdir":
            return "mkdir"
        if self.event == "open":
            return "write"
        return "delete"


@dataclass(frozen=True)
class Ran:
    """How a run ended: exit status (KILLED when killed), the changes seen, its output."""

    rc: int
    changes: list[Change]
    out: str
    err: str


def run_upr(root: Path, args: list[str], log: Path, kill_at: int = 0) -> Ran:
    """Run `upr ARGS` (on repository `root`) under the wrapper, SIGKILLed right before
    change number `kill_at` (1-based; 0: never); `log` lists the changes."""
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(kill_at), str(log), str(root.resolve()), *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    changes = [Change(*line.split("\t", 1)) for line in log.read_text().splitlines()]
    return Ran(proc.returncode, changes, proc.stdout, proc.stderr)


def pick(changes: list[Change], rng: random.Random) -> tuple[int, str]:
    """A kill point: a kind of change, then one of its occurrences; (its 1-based number
    among all changes, a description)."""
    kinds = sorted({c.kind for c in changes})
    kind = rng.choice(kinds)
    where = [i for i, c in enumerate(changes, 1) if c.kind == kind]
    n = rng.choice(where)
    return n, f"before change {n}/{len(changes)} ({kind} {changes[n - 1].path})"


KILLED = -signal.SIGKILL
