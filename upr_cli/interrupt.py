"""How SIGINT and SIGTERM end a command: one rule for every command (README "Errors and
exit codes", upr(1) EXIT STATUS).

A bounded command (backup, restore, verify, tail --until-end, replay without --follow,
load, diff, …) stopped by either signal keeps what it committed, says in one line what
that is and how to go on, and exits 128 + the signal's number: 130 for SIGINT (Ctrl-C),
143 for SIGTERM. A follower (tail while it follows, replay --follow, serve), whose normal
end is a signal, saves its position, says so in one line and exits 0.

SIGTERM takes the path of Ctrl-C (`handling`): its handler notes it and raises SIGINT, so
that asyncio.run cancels the running task and every `finally` and `async with` runs (a
backup releases its repository lock and keeps the segments it finished, a tail saves
its state) before KeyboardInterrupt ends the command; outside asyncio.run the
KeyboardInterrupt is raised where the command is. A job that ends its run itself takes
the signals on its event loop with `on_signals` (serve: a clean stop) or
`cancel_on_signals` (replay: its task cancelled, then a last checkpoint), which note the
signal for the exit status; once its results are out, its command raises `Stopped`.
Each command says beforehand what an interrupted run keeps (`keeps`) or that it follows
(`follows`); the CLI's error funnel asks `ending` for the line and the exit status.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

from upr_cli.errors import ExitCode

#: what an interrupted command says when it did not say what it keeps
GENERAL = "what it finished before the signal stays done; run the same command to finish"


class Stopped(KeyboardInterrupt):
    """A signal stopped the run and the job handled it itself (its results are out): the
    command raises this so that the run ends as every interrupted run does."""


@dataclass(frozen=True)
class Ending:
    """How a run a signal stopped ends: one line on stderr and the exit status."""

    line: str
    code: int
    follower: bool


@dataclass
class _Run:
    signal: int | None = None  # the signal that stopped the run, once noted
    words: Callable[[], str] | None = None  # what it kept (or saved, for a follower)
    follower: bool = False


_run = _Run()  # one command per process


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Run a command: SIGTERM stops it the way Ctrl-C does (in the main thread; elsewhere
    the signals are left as they are)."""
    _run.signal, _run.words, _run.follower = None, None, False
    try:
        before = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        before = None
    try:
        yield
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    note(signal.SIGTERM)
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        raise KeyboardInterrupt  # SIGINT ignored (a shell's background job): no path to take
    signal.raise_signal(signal.SIGINT)


def note(sig: int) -> None:
    """Remember the signal stopping the run (a job that handles the signals itself)."""
    if _run.signal is None:
        _run.signal = sig


@contextlib.contextmanager
def on_signals(act: Callable[[int], None]) -> Iterator[None]:
    """While the block runs in an event loop, SIGINT and SIGTERM are noted (`note`) and
    handed to `act` on the loop, instead of stopping the command the Ctrl-C way. Where
    the loop cannot install a handler (not the main thread, not Unix) they are left as
    they are: Ctrl-C then ends the run as any KeyboardInterrupt does."""
    import asyncio  # here: `upr --help` imports this module, and no asyncio (a test checks)

    loop = asyncio.get_running_loop()

    def handle(sig: int) -> None:
        note(sig)
        act(sig)

    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        # not the main thread (RuntimeError, ValueError) or not Unix (NotImplementedError):
        # no handler, and the signal keeps its default path (the docstring's last sentence)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, handle, sig)
            handled.append(sig)
    try:
        yield
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def cancel_on_signals() -> Iterator[Callable[[], bool]]:
    """SIGINT and SIGTERM cancel the running task (once, `on_signals`); yields 'did one?'."""
    import asyncio  # as in on_signals

    task = asyncio.current_task()
    stopping = False

    def stop(sig: int) -> None:
        nonlocal stopping
        if not stopping and task is not None:
            stopping = True
            task.cancel()

    with on_signals(stop):
        yield lambda: stopping


def keeps(words: Callable[[], str]) -> None:
    """Say what this bounded command keeps when a signal stops it and how to go on (asked
    only then, so the words can count what was done)."""
    _run.words, _run.follower = words, False


def follows(words: Callable[[], str]) -> None:
    """Make this command a follower: a signal is its normal end; `words` say what it
    saved and how to continue."""
    _run.words, _run.follower = words, True


def ending() -> Ending:
    """The line and exit status of the run a signal stopped (SIGINT unless another was
    noted: Ctrl-C reaches the command without a note)."""
    sig = signal.Signals(_run.signal or signal.SIGINT)
    words = _run.words() if _run.words is not None else GENERAL
    if _run.follower:
        return Ending(f"stopped by {sig.name}: {words}", ExitCode.OK, True)
    code = ExitCode.TERMINATED if sig == signal.SIGTERM else ExitCode.INTERRUPTED
    return Ending(f"interrupted by {sig.name}: {words}", code, False)
