"""The shared write window (jobs/writer.py): bounded in bytes and items, answers in the
order sent, ETMPFAIL sent again after one pause per round; and restore's one-call
SET_WITH_META, DEL_WITH_META and GET encoders give the messages' own bytes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from upr_cli.jobs.restore import _del_with_meta, _get, _set_with_meta
from upr_cli.jobs.writer import WriteWindow
from upr_cli.memory import ByteWindow
from upr_cli.protocol import Frame
from upr_cli.protocol.messages import DelWithMeta, Get, SetWithMeta
from upr_cli.protocol.status import Status

EMPTY = memoryview(b"")


class Router:
    """The writer's view of net/router.py: answers come back one loop turn after
    `flush`, with the status `answer(n)` gives the n-th request submitted."""

    def __init__(self, answer: Any = None, retry_for: float = 60.0) -> None:
        self.answer = answer or (lambda _n: Status.SUCCESS)
        self.retry_for = retry_for
        self.submitted = 0
        self.unsent: list[tuple[asyncio.Future[Frame], int]] = []
        self.refreshes = 0
        self.drains = 0  # waits for the sockets to take what was written
        self.window: ByteWindow | None = None
        self.seen: list[tuple[int, int]] = []  # (bytes, items) in flight at each submit

    def submit(self, vb: int, make: Any) -> asyncio.Future[Frame]:
        make(1)
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self.unsent.append((fut, self.answer(self.submitted)))
        self.submitted += 1
        if self.window is not None:
            self.seen.append((self.window.bytes, self.window.items))
        return fut

    def flush(self) -> None:
        loop = asyncio.get_running_loop()
        for fut, status in self.unsent:
            frame = Frame(0x81, 0, 0, status, 1, 0, EMPTY, EMPTY, EMPTY, EMPTY)
            loop.call_soon(_answer, fut, frame)
        self.unsent.clear()

    async def drain(self) -> None:
        self.drains += 1

    async def settle(self, fut: asyncio.Future[Frame], vb: int, make: Any) -> Frame:
        return await fut

    async def refresh(self, body: bytes | None = None) -> None:
        self.refreshes += 1


def _answer(fut: asyncio.Future[Frame], frame: Frame) -> None:
    if not fut.done():
        fut.set_result(frame)


def write(router: Router, window: ByteWindow, sizes: list[int]) -> tuple[list[int], Any]:
    """Send one request per size; the statuses answered, in the order taken."""
    got: list[int] = []
    router.window = window

    async def go() -> WriteWindow[int]:
        def answer(f: Frame, _vb: int, _tag: int) -> None:
            got.append(f.vbucket_or_status)

        w: WriteWindow[int] = WriteWindow(router, window, answer)  # type: ignore[arg-type]
        try:
            for i, n in enumerate(sizes):
                await w.send(i % 4, lambda _o: b"", n, i)
            await w.drain()
        finally:
            w.abandon()
        return w

    return got, asyncio.run(go())


def test_the_window_holds_its_bytes_and_items_and_a_larger_write_goes_alone() -> None:
    router = Router()
    mib = 1024 * 1024
    got, w = write(router, ByteWindow(3 * mib, 64), [mib] * 10 + [5 * mib] + [mib] * 5)
    assert got == [Status.SUCCESS] * 16 and w.sent == 16
    assert max(b for b, items in router.seen if items > 1) <= 3 * mib
    assert (5 * mib, 1) in router.seen  # larger than the window: alone
    router = Router()
    write(router, ByteWindow(1 << 30, 8), [10] * 100)
    assert max(items for _b, items in router.seen) == 8


def test_a_full_write_queue_is_waited_out_once_per_round_not_once_per_write() -> None:
    # the node refuses the first 300 writes (its queue full), then takes everything
    router = Router(lambda n: Status.ETMPFAIL if n < 300 else Status.SUCCESS)
    t0 = time.monotonic()
    got, w = write(router, ByteWindow(1 << 20, 256), [100] * 200)
    assert got == [Status.SUCCESS] * 200  # each written in the end
    assert w.resent == 300 and w.sent == 200
    assert w._round <= 4  # a pause per round of refusals, not per refused write
    assert time.monotonic() - t0 < 5


def test_a_refusal_that_outlasts_retry_for_is_the_final_answer() -> None:
    refusing = lambda n: Status.ETMPFAIL if n % 5 == 0 or n > 40 else Status.SUCCESS  # noqa: E731
    router = Router(refusing, retry_for=0.3)
    got, _w = write(router, ByteWindow(1 << 20, 16), [10] * 40)
    assert len(got) == 40 and Status.ETMPFAIL in got and got.count(Status.SUCCESS) >= 30
    assert router.refreshes >= 1  # a refusal that lasts: the map is fetched again


def test_a_follow_up_takes_the_answered_slot() -> None:
    router = Router(lambda n: Status.KEY_EEXISTS if n == 0 else Status.SUCCESS)
    seen: list[tuple[int, int]] = []

    async def go() -> None:
        window = ByteWindow(1 << 20, 4)

        def answer(f: Frame, vb: int, tag: int) -> tuple[int, Any, int] | None:
            seen.append((tag, f.vbucket_or_status))
            return (vb, lambda _o: b"", 99) if f.vbucket_or_status == Status.KEY_EEXISTS else None

        w: WriteWindow[int] = WriteWindow(router, window, answer)  # type: ignore[arg-type]
        for i in range(3):
            await w.send(0, lambda _o: b"", 10, i)
        await w.drain()
        assert window.bytes == 0 and window.items == 0 and w.sent == 4

    asyncio.run(go())
    assert seen == [(0, Status.KEY_EEXISTS), (1, 0), (2, 0), (99, 0)]


@pytest.mark.parametrize("options", [0, 1])
@pytest.mark.parametrize("value", [b"", b'{"a":1}', bytes(range(256)) * 3])
def test_the_with_meta_encoders_give_the_messages_bytes(options: int, value: bytes) -> None:
    key = b"\x08doc-1"
    assert _set_with_meta(7, key, value, 3, 0xDEADBEEF, 17, 2**40, 2**63 + 5, options, 42) == (
        SetWithMeta(
            vbucket=7,
            opaque=42,
            key=key,
            value=value,
            datatype=3,
            flags=0xDEADBEEF,
            expiration=17,
            rev_seqno=2**40,
            item_cas=2**63 + 5,
            options=options,
        ).encode()
    )
    assert _del_with_meta(7, key, 5, 9, 11, options, value, 42) == (
        DelWithMeta(
            vbucket=7,
            opaque=42,
            key=key,
            flags=5,
            rev_seqno=9,
            item_cas=11,
            options=options,
            value=value,
            datatype=4 if value else 0,
        ).encode()
    )
    assert _get(7, key, 42) == Get(vbucket=7, opaque=42, key=key).encode()
