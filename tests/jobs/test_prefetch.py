"""The restore's reader thread: order, errors and early close."""

from __future__ import annotations

import threading
import time

import pytest

from upr_cli.jobs.restore import prefetch


def test_yields_every_item_in_order() -> None:
    assert list(prefetch(lambda i: i * i, list(range(50)), depth=2)) == [
        (i, i * i) for i in range(50)
    ]


def test_error_in_reader_reaches_consumer_after_earlier_items() -> None:
    def fn(i: int) -> int:
        if i == 3:
            raise OSError("disk gone")
        return i

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for item, _ in prefetch(fn, list(range(10))):
            got.append(item)
    assert got == [0, 1, 2]


def test_closing_early_stops_the_thread() -> None:
    calls = []

    def fn(i: int) -> int:
        calls.append(i)
        return i

    gen = prefetch(fn, list(range(10_000)), depth=2)
    assert next(gen) == (0, 0)
    gen.close()  # joins the reader
    assert not [t for t in threading.enumerate() if t.name == "upr-restore-reader"]
    seen = len(calls)
    time.sleep(0.05)
    assert len(calls) == seen < 10  # bounded read-ahead, then nothing more
