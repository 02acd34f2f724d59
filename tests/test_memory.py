"""The memory budget's parts (upr_cli/memory.py): sizes, byte-bounded windows and
queues, and a document larger than the budget going through alone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import typer

from upr_cli.cli.options import memory_limit
from upr_cli.memory import MIB, ByteQueue, ByteWindow, MemoryLimit, parse_size


def test_sizes_parse_in_powers_of_1024() -> None:
    assert parse_size("192MB") == parse_size("192 MiB") == parse_size("192m") == 192 * MIB
    assert parse_size("1.5g") == 1536 * MIB and parse_size("65536") == 65536
    assert parse_size("4kb") == 4096
    for bad in ("", "MB", "12 parsecs", "-5MB", "1e9"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_the_option_refuses_a_tiny_or_bad_limit() -> None:
    assert memory_limit("512MB") == MemoryLimit(512 * MIB)
    assert memory_limit(MemoryLimit()) == MemoryLimit()
    for bad in ("1MB", "lots"):
        with pytest.raises(typer.BadParameter):
            memory_limit(bad)
    assert MemoryLimit(100 * MIB).share(0.25) == 25 * MIB
    assert MemoryLimit(100 * MIB).share(0.0) == 64 * 1024  # the floor


def test_window_holds_bytes_and_lets_a_huge_item_through_alone() -> None:
    async def run() -> list[str]:
        w = ByteWindow(100, limit_items=3)
        seen: list[str] = []
        assert w.take(60) and not w.take(50)  # 110 > 100
        assert w.take(40) and not w.take(1)  # full in bytes
        await w.release(60)
        await w.release(40)
        assert w.take(1) and w.take(1) and w.take(1) and not w.take(1)  # full in items
        await w.release(3, items=3)

        async def huge() -> None:
            await w.acquire(500)  # larger than the window: alone, once it is empty
            seen.append("huge")

        await w.acquire(10)
        task = asyncio.create_task(huge())
        await asyncio.sleep(0.01)
        assert seen == []
        await w.release(10)
        await asyncio.wait_for(task, 1)
        assert seen == ["huge"] and not w.take(1)
        await w.release(500)
        return seen

    assert asyncio.run(run()) == ["huge"]


def test_queue_blocks_the_producer_at_its_byte_bound() -> None:
    q: ByteQueue[int] = ByteQueue(100)
    assert q.put(1, 80) and not q.put(2, 30, timeout=0.05)  # 110 > 100
    done = threading.Event()

    def producer() -> None:
        q.put(2, 30)
        q.put(3, 1000)  # larger than the bound: waits for an empty queue
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.05)
    assert q.get() == 1 and q.get() == 2
    assert q.get(timeout=1) == 3 and done.wait(1)
    t.join()
    q.close()
    assert q.get() is None and not q.put(4, 1)
