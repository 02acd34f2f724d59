"""The rule for signals in process (upr_cli/interrupt.py): SIGTERM takes the path of
Ctrl-C, so asyncio.run cancels the work and its cleanups run, and the ending says which
signal came. The commands themselves are signalled in tests/e2e/test_signals_e2e.py."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from upr_cli import interrupt
from upr_cli.interrupt import GENERAL, Ending

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signal handlers are installed in the main thread only",
)


def _wait_for_the_handler() -> None:
    for _ in range(100):  # short sleeps: the handler runs between them, wherever it came
        time.sleep(0.05)


def test_sigterm_raises_what_ctrl_c_raises_and_ends_with_143() -> None:
    with pytest.raises(KeyboardInterrupt), interrupt.handling():
        interrupt.keeps(lambda: "nothing changed; run it again")
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for_the_handler()
    assert interrupt.ending() == Ending(
        "interrupted by SIGTERM: nothing changed; run it again", 143, False
    )


def test_sigterm_cancels_the_task_of_asyncio_run_so_its_cleanups_run() -> None:
    cleaned: list[str] = []

    async def work() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(5)
        finally:
            await asyncio.sleep(0)  # an await in the cleanup still runs (a lock's release)
            cleaned.append("released")

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), interrupt.handling():
        asyncio.run(work())
    assert cleaned == ["released"] and time.monotonic() - started < 4
    assert interrupt.ending().code == 143


def test_a_follower_ends_with_0_and_ctrl_c_needs_no_note() -> None:
    with interrupt.handling():
        interrupt.follows(lambda: "positions saved in s.json")
    assert interrupt.ending() == Ending("stopped by SIGINT: positions saved in s.json", 0, True)
    with interrupt.handling():  # a new run forgets the last one's words
        pass
    assert interrupt.ending() == Ending(f"interrupted by SIGINT: {GENERAL}", 130, False)
