"""asyncio helpers that keep cancellation: it is never swallowed.

Two traps this module and its callers avoid:

- Python 3.11's `asyncio.wait_for` returns the inner result when the caller is
  cancelled in the same loop turn as the inner awaitable completes, and the caller's
  cancellation is lost (3.12 rebuilt it on `asyncio.timeout`). A consumer cancelled
  while opening then went on to stream, and whoever cancelled it waited forever. The
  library therefore bounds waits with `async with asyncio.timeout(...)`, never
  `wait_for`.
- `with suppress(CancelledError): await task` after `task.cancel()` also eats a
  cancellation aimed at the caller while it waits. `cancel_and_wait` waits with
  `asyncio.wait`, which raises only for the caller's own cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until every one has ended; the caller's own cancellation
    propagates. A task that ended with an error (before or while stopping) is logged:
    nobody else will read it."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    for task in tasks:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.warning("%s ended with an error: %r", _name(task), exc, exc_info=exc)


def _name(task: asyncio.Future[Any]) -> str:
    return task.get_name() if isinstance(task, asyncio.Task) else "a task"
