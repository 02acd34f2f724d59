"""net/aio.py: cancellation is never swallowed."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

import upr_cli
from upr_cli.net.aio import cancel_and_wait


def test_the_library_never_calls_asyncio_wait_for() -> None:
    """3.11's wait_for loses a cancellation that lands as its inner awaitable completes;
    the library bounds waits with asyncio.timeout instead (net/aio.py)."""
    root = Path(upr_cli.__file__).parent
    calls = [f"{path.relative_to(root)}:{n}"
             for path in sorted(root.rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\bwait_for\(", line.split("#", 1)[0])]  # fmt: skip
    assert calls == []


def test_cancel_and_wait_ends_every_task_and_reads_their_errors() -> None:
    async def main() -> None:
        async def stubborn() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(0.05)  # cleanup that takes a while
                raise

        async def fails() -> None:
            raise ValueError("boom")  # ended before the cancel: its error is read

        tasks = [asyncio.ensure_future(stubborn()), asyncio.ensure_future(fails())]
        await asyncio.sleep(0)
        await cancel_and_wait(tasks)
        assert all(t.done() for t in tasks)
        assert tasks[0].cancelled()

    asyncio.run(main())  # warnings are errors: an unread task error would fail here


def test_the_callers_own_cancellation_propagates() -> None:
    """The old pattern, `suppress(CancelledError): await task`, ate it."""

    async def main() -> bool:
        child_done = asyncio.Event()

        async def child() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await child_done.wait()  # slow to stop: the parent is cancelled meanwhile
                raise

        async def parent(kid: asyncio.Task[None]) -> None:
            await cancel_and_wait([kid])
            await asyncio.sleep(3600)  # reached only if the parent's cancel was lost

        kid = asyncio.ensure_future(child())
        await asyncio.sleep(0)
        boss = asyncio.ensure_future(parent(kid))
        await asyncio.sleep(0.01)
        boss.cancel()
        await asyncio.sleep(0.01)
        child_done.set()
        await asyncio.wait({boss}, timeout=5)
        await asyncio.wait({kid}, timeout=5)
        return boss.cancelled()

    assert asyncio.run(main())


@pytest.mark.parametrize("bounded", [True, False])
def test_a_cancel_landing_as_the_wait_completes_is_kept(bounded: bool) -> None:
    """The 3.11 race: the inner future completes and the caller is cancelled in the same
    loop turn. `asyncio.timeout` delivers the cancel; 3.11's `wait_for` drops it (3.12+
    keeps it), which is why the library never calls it."""

    async def main() -> bool:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def waiter() -> None:
            if bounded:
                async with asyncio.timeout(60):
                    await fut
            else:
                await asyncio.wait_for(fut, 60)
            await asyncio.sleep(3600)

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)
        fut.set_result(1)
        task.cancel()
        await asyncio.wait({task}, timeout=1)
        lost = not task.done()
        task.cancel()
        await asyncio.wait({task})
        return lost

    lost = asyncio.run(main())
    assert lost == (not bounded and sys.version_info < (3, 12))
