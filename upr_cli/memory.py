"""The memory budget: one setting, `--memory-limit`, bounds every window, queue and batch
of a command in bytes as well as in items (docs/design.md "Memory").

A command hands each of its buffers a share of the limit (`MemoryLimit.share`). A buffer
admits an item while the bytes it holds stay within its share; an item larger than the
whole share still goes through, alone, once the buffer is empty, so a document larger
than the limit is never refused, only never joined by another.

`ByteWindow` bounds what is in flight between asyncio tasks (writes sent and not yet
answered), `ByteQueue` what waits between threads (a reader thread ahead of a writer).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

MIB = 1024 * 1024
#: the default budget for a command's buffers (not the interpreter's own memory)
DEFAULT_MEMORY_LIMIT = 192 * MIB
#: the smallest limit taken: below it, the fixed costs of a command dominate
MIN_MEMORY_LIMIT = 16 * MIB

_UNITS = {"": 1, "b": 1, "k": 1024, "m": MIB, "g": 1024 * MIB, "t": 1024 * 1024 * MIB}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`192MB`, `192 MiB`, `1.5g`, `65536`: bytes. K, M, G and T are powers of 1024 with
    or without `B` or `iB`, as memory quotas are counted (Couchbase's RAM quota in MB is
    MiB). Raises ValueError for anything else."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r}: not a size (e.g. 192MB, 1GiB, 65536)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class MemoryLimit:
    """A command's budget for its buffers, in bytes."""

    total: int = DEFAULT_MEMORY_LIMIT

    def share(self, fraction: float, *, floor: int = 64 * 1024) -> int:
        """`fraction` of the budget for one buffer, at least `floor` bytes."""
        return max(floor, int(self.total * fraction))


class ByteWindow:
    """Bytes and items in flight between asyncio tasks: `acquire(n)` waits while the
    window is full, `release(n)` gives back. An acquire of more than the whole window
    waits until nothing is in flight, then goes through alone."""

    def __init__(self, limit_bytes: int, limit_items: int | None = None) -> None:
        self.limit_bytes = max(1, limit_bytes)
        self.limit_items = limit_items
        self.bytes = 0
        self.items = 0
        self._changed = asyncio.Condition()

    def fits(self, n: int) -> bool:
        """Whether `n` more bytes (one more item) may go now."""
        if self.items == 0:
            return True
        if self.limit_items is not None and self.items >= self.limit_items:
            return False
        return self.bytes + n <= self.limit_bytes

    async def acquire(self, n: int) -> None:
        async with self._changed:
            while not self.fits(n):
                await self._changed.wait()
            self.bytes += n
            self.items += 1

    def take(self, n: int) -> bool:
        """Acquire without waiting: whether `n` bytes were taken."""
        if not self.fits(n):
            return False
        self.bytes += n
        self.items += 1
        return True

    async def release(self, n: int, items: int = 1) -> None:
        async with self._changed:
            self.bytes -= n
            self.items -= items
            self._changed.notify_all()


class ByteQueue(Generic[T]):
    """A queue between threads bounded in bytes and items: `put` blocks while the queue
    is full (an item larger than the bound waits for an empty queue, then goes alone);
    `get` blocks while it is empty. `close()` wakes every waiter: a `put` after it drops
    its item and returns False, a `get` on an empty closed queue returns None."""

    def __init__(self, limit_bytes: int, limit_items: int | None = None) -> None:
        self.limit_bytes = max(1, limit_bytes)
        self.limit_items = limit_items
        self.bytes = 0
        self._items: deque[tuple[T, int]] = deque()
        self._closed = False
        self._cond = threading.Condition()

    def _room(self, n: int) -> bool:
        if not self._items:
            return True
        if self.limit_items is not None and len(self._items) >= self.limit_items:
            return False
        return self.bytes + n <= self.limit_bytes

    def put(self, item: T, n: int, timeout: float | None = None) -> bool:
        """Queue `item` of `n` bytes; False when the queue was closed (or `timeout`
        passed) first."""
        with self._cond:
            if not self._until(lambda: self._closed or self._room(n), timeout) or self._closed:
                return False
            self._items.append((item, n))
            self.bytes += n
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None = None) -> T | None:
        """The next item; None when the queue is closed and empty (or `timeout` passed)."""
        with self._cond:
            if not self._until(lambda: self._closed or bool(self._items), timeout):
                return None
            if not self._items:
                return None
            item, n = self._items.popleft()
            self.bytes -= n
            self._cond.notify_all()
            return item

    def _until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait (holding the condition) until `ready()`; False if `timeout` passed first.
        (Condition.wait_for in a loop of its own: the library never calls a wait_for.)"""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left)
        return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)
