"""The worker thread shared by replay and backup: order, backpressure, errors, close."""

from __future__ import annotations

import asyncio
import functools
import gc
import threading

import pytest

from upr_cli.jobs.worker import GC_YOUNG, Worker, rare_gc


class Boom(Exception):
    pass


def _fail() -> None:
    raise Boom("disk on fire")


def test_jobs_run_in_order_on_one_thread_and_done_sees_each_result() -> None:
    async def main() -> tuple[list[int], set[str], list[int]]:
        ran: list[int] = []
        threads: set[str] = set()
        seen: list[int] = []

        def job(i: int) -> int:
            ran.append(i)
            threads.add(threading.current_thread().name)
            return i * 10

        async with Worker("t-order", max_queued=2) as w:
            for i in range(20):
                await w.submit(functools.partial(job, i), seen.append)
            await w.drain()
            assert await w.run(lambda: len(ran)) == 20
        await asyncio.sleep(0)  # `done` callbacks run on the loop
        return ran, threads, seen

    ran, threads, seen = asyncio.run(main())
    assert ran == list(range(20))
    assert len(threads) == 1 and threading.main_thread().name not in threads
    assert seen == [i * 10 for i in range(20)]


def test_an_error_in_the_worker_surfaces_in_the_caller() -> None:
    """A failed job that nobody awaited is raised by the next submit that reaps it, or
    by drain; its `done` is not called; later jobs still settle (no hang)."""

    async def by_submit() -> list[str]:
        called: list[str] = []
        async with Worker("t-err", max_queued=0) as w:
            await asyncio.sleep(0)
            with pytest.raises(Boom):
                await w.submit(_fail, lambda _r: called.append("done"))
            assert w.pending == 0
            assert await w.run(lambda: 7) == 7  # the thread goes on for cleanup jobs
        return called

    async def by_drain() -> None:
        gate = threading.Event()
        async with Worker("t-err2", max_queued=5) as w:
            await w.submit(gate.wait)
            await w.submit(_fail)
            await w.submit(lambda: None)
            gate.set()
            with pytest.raises(Boom):
                await w.drain()
            await w.drain()  # the jobs after the failed one settled too

    assert asyncio.run(by_submit()) == []
    asyncio.run(by_drain())


def test_an_error_in_run_is_raised_by_its_await() -> None:
    async def main() -> None:
        async with Worker("t-run") as w:
            with pytest.raises(Boom):
                await w.run(_fail)

    asyncio.run(main())


def test_the_queue_bound_applies_backpressure() -> None:
    """With `max_queued` jobs waiting behind a busy thread, the next submit waits until
    the oldest finished; the loop itself stays free meanwhile."""

    async def main() -> None:
        gate = threading.Event()
        async with Worker("t-bound", max_queued=2) as w:
            await w.submit(gate.wait)
            await w.submit(lambda: None)  # two queued: allowed without waiting
            assert w.pending == 2
            third = asyncio.create_task(w.submit(lambda: None))
            await asyncio.sleep(0.1)
            assert not third.done()  # held back: the thread is still on the first job
            gate.set()
            await asyncio.wait_for(third, 5)
            assert w.pending <= 2

    asyncio.run(main())


def test_close_joins_the_thread_after_every_queued_job() -> None:
    async def main() -> tuple[list[int], Worker]:
        ran: list[int] = []
        gate = threading.Event()

        def slow(i: int) -> None:
            gate.wait()
            ran.append(i)

        w = Worker("t-close", max_queued=10)
        async with w:
            for i in range(5):
                await w.submit(functools.partial(slow, i))
            await w.submit(_fail)  # its error is retrieved at close, not raised there
            asyncio.get_running_loop().call_later(0.05, gate.set)
        return ran, w

    ran, w = asyncio.run(main())
    assert ran == [0, 1, 2, 3, 4]
    assert not any(t.name.startswith("t-close") for t in threading.enumerate())
    with pytest.raises(RuntimeError):  # joined: it takes no more work
        w._pool.submit(lambda: None)


def test_a_cancelled_caller_does_not_skip_a_queued_job() -> None:
    """Cancelling the task waiting on a job leaves the job to run; close waits for it."""

    async def main() -> list[str]:
        ran: list[str] = []
        gate = threading.Event()
        async with Worker("t-cancel", max_queued=0) as w:
            await w.submit(lambda: None)
            waiter = asyncio.create_task(w.run(gate.wait))
            await asyncio.sleep(0.05)
            queued = asyncio.create_task(w.run(lambda: ran.append("after")))
            await asyncio.sleep(0.05)
            queued.cancel()
            waiter.cancel()
            for task in (queued, waiter):
                with pytest.raises(asyncio.CancelledError):
                    await task
            gate.set()
        return ran

    assert asyncio.run(main()) == ["after"]


def test_young_collections_are_rare_while_the_worker_is_open() -> None:
    before = gc.get_threshold()

    async def main() -> int:
        async with Worker("t-gc"):
            return gc.get_threshold()[0]

    assert asyncio.run(main()) >= GC_YOUNG
    assert gc.get_threshold() == before
    with rare_gc():
        assert gc.get_threshold()[0] >= GC_YOUNG
    assert gc.get_threshold() == before


def test_discard_waits_for_every_job_and_drops_their_errors() -> None:
    """For a caller already failing: every queued job settles, none of their errors is
    raised there or later."""

    async def main() -> list[int]:
        ran: list[int] = []
        gate = threading.Event()
        async with Worker("t-discard", max_queued=10) as w:
            await w.submit(gate.wait)
            await w.submit(_fail)
            await w.submit(functools.partial(ran.append, 1))
            await w.submit(_fail)
            gate.set()
            await w.discard()
            assert w.pending == 0
            await w.drain()  # nothing left to raise
        return ran

    assert asyncio.run(main()) == [1]
