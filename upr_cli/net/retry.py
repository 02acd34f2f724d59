"""One retry policy: bounded attempts, capped exponential backoff with jitter.

Theory of operation. Every loop that tries a network step again (a lost DCP link, a
partition whose active node moved, a request refused with NOT_MY_VBUCKET, a node that
does not answer yet) keeps a `Retry`: the attempts it made and when it started. The
`RetryPolicy` bounds it by a number of attempts and a time (both must be used up before
it gives up, so a flapping link gets its attempts and a slow failover gets its seconds)
and spaces attempts by a delay that doubles from `first` up to `cap`, each one drawn
from the upper `jitter` share of it so that clients that failed together do not retry
in lockstep. Whether an error is worth another attempt is the error's to say
(`retriable`, as aiokafka's errors do): a status error carries it per memcached status,
a connection that closed or timed out is retriable, a refused login is not.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from upr_cli.net.connection import ConnectionError_

_T = TypeVar("_T")


def is_retriable(exc: BaseException) -> bool:
    """Whether the step that raised `exc` may succeed if tried again: the error's own
    `retriable` when it has one; else True for a failed connection or socket."""
    flag = getattr(exc, "retriable", None)
    if isinstance(flag, bool):
        return flag
    return isinstance(exc, ConnectionError_ | OSError)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long to keep trying: at least `attempts` attempts and at least `within`
    seconds (None: that bound is already met), `first` → `cap` seconds between them."""

    attempts: int | None = None
    within: float | None = None
    first: float = 0.2
    cap: float = 10.0
    jitter: float = 0.5  # a delay is drawn from [d * (1 - jitter), d]

    def __post_init__(self) -> None:
        if self.attempts is None and self.within is None:
            raise ValueError("a retry policy needs a bound: attempts, within or both")

    def delay(self, attempt: int) -> float:
        """The pause before attempt number `attempt` (1 = the first retry), jittered."""
        base = min(self.cap, self.first * 2.0 ** max(0, attempt - 1))
        return base * random.uniform(1.0 - self.jitter, 1.0)

    def start(self, *, tries: int = 0) -> Retry:
        """A fresh budget; `tries` counts attempts an earlier budget already made."""
        return Retry(self, tries)

    async def call(
        self,
        step: Callable[[], Awaitable[_T]],
        *,
        retriable: Callable[[BaseException], bool] = is_retriable,
    ) -> _T:
        """Run `step` until it succeeds; a non-retriable error is raised at once, the
        last retriable one once the budget is spent."""
        retry = self.start()
        while True:
            try:
                return await step()
            except Exception as exc:  # noqa: BLE001 - decided below, re-raised if not retriable
                await retry.after(exc, retriable=retriable)


class Retry:
    """One operation's way through a `RetryPolicy`: attempts made, time since start."""

    def __init__(self, policy: RetryPolicy, tries: int = 0) -> None:
        self.policy = policy
        self.tries = tries
        self._started = time.monotonic()

    @property
    def elapsed(self) -> float:
        """Seconds since this budget started."""
        return time.monotonic() - self._started

    @property
    def spent(self) -> bool:
        """True once both bounds are used up: no further attempt is allowed."""
        p = self.policy
        return (p.attempts is None or self.tries >= p.attempts) and (
            p.within is None or self.elapsed > p.within
        )

    async def wait(self) -> None:
        """Count one more attempt and sleep the pause before it."""
        self.tries += 1
        await asyncio.sleep(self.policy.delay(self.tries))

    async def after(
        self, exc: BaseException, *, retriable: Callable[[BaseException], bool] = is_retriable
    ) -> None:
        """An attempt failed with `exc`: raise it when it is not retriable or the budget
        is spent, else sleep before the next attempt."""
        if not retriable(exc):
            raise exc
        if self.spent:
            raise exc
        await self.wait()


__all__ = ["Retry", "RetryPolicy", "is_retriable"]
