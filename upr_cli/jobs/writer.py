"""The pipelined write window that `upr load` and `upr restore` share.

Writes go through the router (net/router.py), each to its partition's active node, many
in flight at once: `send` queues a request and returns at once while the window has
room, and the window is bounded by a `ByteWindow` (upr_cli/memory.py) in bytes (the key
and value bytes of the requests in flight, a share of `--memory-limit`) and in items.
Requests leave in batches (one write per 64 requests or 256 KiB, and whenever the
window waits). Answers are taken in the order sent; each goes to the job's `on_answer`,
which counts it and may ask for one follow-up request in the same slot of the window
(`upr load` writes a key again after an ADD found it).

A node whose write queue is full answers ETMPFAIL, as kv_engine does
(docs/protocol.md §3): the write was not applied and may be sent again. The window sends it
again, at the end of the window, after one pause of the retry policy (net/retry.py:
capped exponential backoff with jitter) for the whole round: every refused write sent
before the pause goes again without a pause of its own, so a full window waits once, not
once per write. The pause grows while the node keeps refusing and starts afresh after
the first accepted write. A refusal that outlasts the router's `retry_for` is the
write's final answer (the job reports it). NOT_MY_VBUCKET and a lost connection are the
router's to follow (`Router.settle`: the newest map, the request sent again).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from upr_cli.errors import UprError
from upr_cli.memory import ByteWindow, MemoryLimit
from upr_cli.net.retry import Retry, RetryPolicy
from upr_cli.net.router import Make, Router
from upr_cli.protocol import Frame
from upr_cli.protocol.status import Status

T = TypeVar("T")

#: a follow-up request an answer asks for: (partition, request, tag)
FollowUp = tuple[int, Make, T]

# One write of the deferred requests per this many requests or bytes: few system
# calls, and the node starts on the first ones while the next are encoded.
FLUSH_ITEMS = 64
FLUSH_BYTES = 256 * 1024
# The pause before a round of refused writes goes again: short at first (a full write
# queue drains in milliseconds), doubling up to half a second while refusals go on.
FIRST_PAUSE, MAX_PAUSE = 0.002, 0.5
# After this many rounds of refusals the map is fetched again: a node whose traffic is
# still off after a restart (formats/cluster.md §3) may have been failed over meanwhile.
_REFRESH_AFTER = 3

#: the default budget of a writing command (`--memory-limit`'s default)
DEFAULT_LIMIT = MemoryLimit()

_ETMPFAIL, _NOT_MY_VBUCKET = Status.ETMPFAIL, Status.NOT_MY_VBUCKET


class WriteWindow(Generic[T]):
    """Pipelined writes bounded in bytes and items; answers handed to `on_answer(frame,
    partition, tag)` in the order sent (the module's doc)."""

    def __init__(
        self,
        router: Router,
        window: ByteWindow,
        on_answer: Callable[[Frame, int, T], FollowUp[T] | None],
    ) -> None:
        self.router, self.window, self.on_answer = router, window, on_answer
        # (answer future, partition, request, bytes, tag, round it was sent in)
        self.inflight: deque[tuple[asyncio.Future[Frame], int, Make, int, T, int]] = deque()
        self.sent = 0  # requests sent (a request sent again after ETMPFAIL counts once)
        self.settled = 0  # final answers taken
        self.resent = 0  # requests sent again after ETMPFAIL
        self._unflushed = self._unflushed_bytes = 0
        self._round = 0  # pauses taken: a refusal of a write sent before the last one
        self._retry: Retry | None = None  # the refusals' budget, None while writes go in
        self._policy = RetryPolicy(within=router.retry_for, first=FIRST_PAUSE, cap=MAX_PAUSE)

    async def send(self, vb: int, make: Make, nbytes: int, tag: T) -> None:
        """Queue one request of `nbytes` (its key and value) to partition `vb`; while the
        window is full, take answers first."""
        window = self.window
        while not window.take(nbytes):
            await self._settle()
        self.inflight.append((self.router.submit(vb, make), vb, make, nbytes, tag, self._round))
        self.sent += 1
        self._unflushed += 1
        self._unflushed_bytes += nbytes
        if self._unflushed >= FLUSH_ITEMS or self._unflushed_bytes >= FLUSH_BYTES:
            await self._flush_drained()

    def flush(self) -> None:
        """Write every request queued so far."""
        self._unflushed = self._unflushed_bytes = 0
        self.router.flush()

    async def _flush_drained(self) -> None:
        """Write every request queued so far, then wait until the sockets have taken
        them: what the transports hold unsent stays near their high-water mark, not a
        window of copies (measured: a restore of 5 MiB documents into a cluster held
        100 MB of them)."""
        self.flush()
        await self.router.drain()

    async def drain(self) -> None:
        """Wait for every answer in flight."""
        self.flush()
        while self.inflight:
            await self._settle()

    async def settle_ready(self) -> None:
        """Take the answers already in, without waiting for any."""
        if self.inflight and self.inflight[0][0].done():
            await self._settle()

    def abandon(self) -> None:
        """Forget the requests still in flight (the job stopped on an error): a pending
        answer is cancelled and a failed one's error taken, so that asyncio reports none
        of them as never retrieved."""
        while self.inflight:
            fut = self.inflight.popleft()[0]
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()

    async def _settle(self) -> None:
        """Take the oldest answer (waiting for it), then every later one already in."""
        inflight, router = self.inflight, self.router
        freed = freed_items = 0
        try:
            while inflight:
                fut, vb, make, nbytes, tag, sent_in = inflight[0]
                if not fut.done():
                    if freed_items:
                        break  # hand back what was taken before waiting
                    self.flush()
                try:
                    frame = await fut
                except (UprError, OSError):
                    frame = await router.settle(fut, vb, make)  # a lost node: the router's
                else:
                    status = frame.vbucket_or_status
                    if status == _ETMPFAIL:
                        if await self._again(sent_in):
                            inflight.popleft()
                            self.resent += 1
                            inflight.append((router.submit(vb, make), vb, make, nbytes, tag,
                                             self._round))  # fmt: skip
                            if nbytes >= FLUSH_BYTES:  # large: one at a time to the socket
                                await self._flush_drained()
                            continue
                    elif status == _NOT_MY_VBUCKET:
                        frame = await router.settle(fut, vb, make)
                    else:
                        self._retry = None
                inflight.popleft()
                self.settled += 1
                follow = self.on_answer(frame, vb, tag)
                if follow is not None:  # it takes over the slot
                    vb2, make2, tag2 = follow
                    inflight.append((router.submit(vb2, make2), vb2, make2, nbytes, tag2,
                                     self._round))  # fmt: skip
                    self.sent += 1
                else:
                    freed += nbytes
                    freed_items += 1
        finally:
            if freed_items:
                await self.window.release(freed, freed_items)

    async def _again(self, sent_in: int) -> bool:
        """Whether a write refused with ETMPFAIL goes again: after one pause per round
        (the first refusal of a write sent since the last pause takes it), until the
        refusals have lasted `retry_for`."""
        if sent_in != self._round:
            return True  # sent before the last pause: it goes again at once
        if self._retry is None:
            self._retry = self._policy.start()
        retry = self._retry
        if retry.spent:
            return False
        self.flush()
        await retry.wait()
        self._round += 1
        if retry.tries >= _REFRESH_AFTER:
            with contextlib.suppress(UprError, OSError):
                await self.router.refresh()
        return True
