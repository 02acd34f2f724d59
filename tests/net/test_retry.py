"""The one retry policy: bounds, capped exponential backoff with jitter, retriability."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from upr_cli.errors import UprError
from upr_cli.net.connection import ConnectionClosed, ConnectionError_
from upr_cli.net.retry import RetryPolicy, is_retriable
from upr_cli.net.scram import AuthenticationFailed
from upr_cli.protocol.status import AuthError, NotMyVbucket, TemporaryFailure


class Failing:
    """A step that fails every time: call n raises `error(n)`; `calls` counts them."""

    def __init__(self, error: Callable[[int], Exception]) -> None:
        self.error = error
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        raise self.error(self.calls)


def test_delays_double_up_to_the_cap_within_the_jitter() -> None:
    policy = RetryPolicy(attempts=10, first=0.2, cap=1.0, jitter=0.5)
    for attempt, full in [(1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (9, 1.0)]:
        for _ in range(50):
            assert full * 0.5 <= policy.delay(attempt) <= full
    assert RetryPolicy(attempts=1, first=0.3, jitter=0.0).delay(1) == 0.3


def test_a_policy_must_be_bounded() -> None:
    with pytest.raises(ValueError, match="bound"):
        RetryPolicy()


def test_the_error_says_whether_to_retry() -> None:
    assert is_retriable(ConnectionClosed("gone"))
    assert is_retriable(ConnectionError_("refused"))
    assert is_retriable(ConnectionRefusedError())
    assert is_retriable(NotMyVbucket()) and is_retriable(TemporaryFailure())
    assert not is_retriable(AuthError())
    assert not is_retriable(UprError("bad"))
    assert not is_retriable(AuthenticationFailed("no"))
    assert not is_retriable(ValueError())


def test_attempts_bound_alone() -> None:
    retry = RetryPolicy(attempts=2, first=0.001).start()
    assert not retry.spent
    asyncio.run(retry.wait())
    asyncio.run(retry.wait())
    assert retry.tries == 2 and retry.spent
    assert RetryPolicy(attempts=3).start(tries=3).spent  # carried over from an earlier budget


def test_both_bounds_must_be_spent() -> None:
    retry = RetryPolicy(attempts=1, within=0.05, first=0.001).start(tries=5)
    assert not retry.spent  # attempts used up, time not yet
    time.sleep(0.06)
    assert retry.spent
    assert not RetryPolicy(attempts=3, within=0.0).start().spent


def test_call_retries_retriable_errors_until_success() -> None:
    calls = []

    async def step() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionClosed("lost")
        return "ok"

    assert asyncio.run(RetryPolicy(attempts=5, first=0.01, cap=0.02).call(step)) == "ok"
    assert len(calls) == 3
    assert calls[1] - calls[0] >= 0.004 and calls[2] - calls[1] >= 0.009  # backed off


def test_call_raises_a_non_retriable_error_at_once() -> None:
    step = Failing(lambda _n: AuthError())
    with pytest.raises(AuthError):
        asyncio.run(RetryPolicy(attempts=5, first=0.01).call(step))
    assert step.calls == 1


def test_call_raises_the_last_error_once_the_budget_is_spent() -> None:
    step = Failing(lambda n: ConnectionClosed(f"lost {n}"))
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed, match="lost 3"):
        asyncio.run(RetryPolicy(attempts=2, first=0.005, cap=0.01).call(step))
    assert step.calls == 3 and time.monotonic() - t0 < 1.0  # two retries after the first try


def test_a_time_bound_ends_retries() -> None:
    step = Failing(lambda _n: TemporaryFailure())
    t0 = time.monotonic()
    with pytest.raises(TemporaryFailure):
        asyncio.run(RetryPolicy(within=0.1, first=0.01, cap=0.02).call(step))
    took = time.monotonic() - t0
    assert 0.1 <= took < 1.0 and step.calls >= 3


def test_a_custom_retriable_decision() -> None:
    calls = 0

    async def step() -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise UprError("tried again all the same")
        return calls

    policy = RetryPolicy(attempts=2, first=0.001)
    assert asyncio.run(policy.call(step, retriable=lambda exc: isinstance(exc, UprError))) == 2
