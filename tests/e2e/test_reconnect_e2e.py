"""The consumer's reconnect (capped backoff with jitter) and dead-connection timeout."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import Replica, drain, run, seqnos, wait_persisted
from upr_cli.dcp import consumer as consumer_module
from upr_cli.dcp.consumer import ConsumerError, DcpConsumer
from upr_cli.dcp.events import Rollback
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import DcpRecord

_T = TypeVar("_T")


def test_a_following_consumer_survives_a_node_crash_and_rolls_back(
    node_factory: type[Node],
) -> None:
    node = node_factory("--flush-interval", "0.02").start()
    upr("load", node.uri, "--docs", "500", "--seed", "1")
    persisted = {p: h for p, (_u, h, _pers) in wait_persisted(node.uri).items()}
    node.stop()
    node.start("--flush-interval", "3600")  # the next writes stay unpersisted
    upr("load", node.uri, "--docs", "300", "--seed", "2", "--prefix", "lost")
    highs = {p: h for p, (_u, h, _pers) in run(seqnos(node.uri)).items()}

    async def follow() -> tuple[Replica, list[Rollback]]:
        consumer = DcpConsumer(SourceUri.parse(node.uri), noop_interval=0.5, reconnect_attempts=30)
        replica, rollbacks = Replica(), []
        await consumer.open()
        killed = False
        try:
            while True:
                batch = await asyncio.wait_for(consumer.batches().__anext__(), 30)
                rows = [tuple(bytes(v) if isinstance(v, memoryview) else v for v in it)
                        for it in batch if type(it) is DcpRecord]  # fmt: skip
                events = [it for it in batch if type(it) is not DcpRecord]
                replica.apply(rows, events)
                rollbacks += [e for e in events if isinstance(e, Rollback)]
                consumer.commit()
                seen = {p: pos.seq for p, pos in consumer.positions.items()}
                if not killed and seen == highs:
                    node.kill()  # the client has seen writes the node never persisted
                    killed = True
                    await asyncio.sleep(0.5)
                    node.start()  # same port: the consumer reconnects with backoff
                if killed and len({r.partition for r in rollbacks}) == len(highs):
                    return replica, rollbacks
        finally:
            await consumer.aclose()

    replica, rollbacks = asyncio.run(follow())
    assert {r.partition: r.to_seq for r in rollbacks} == persisted
    truth = Replica()
    rows, _events, _c = run(drain(node.uri))
    truth.apply(rows, [])
    assert replica.state() == truth.state()


def test_a_silent_node_is_detected_and_reconnects_give_up_with_one_error(
    node_factory: type[Node],
) -> None:
    node = node_factory("--flush-interval", "0.02").start()
    upr("load", node.uri, "--docs", "50")

    async def go() -> float:
        consumer = DcpConsumer(SourceUri.parse(node.uri), noop_interval=0.2, dead_after=1.0,
                               reconnect_attempts=2, connect_timeout=1.0,
                               follow_for=2.0)  # fmt: skip
        await consumer.open()
        t0 = time.monotonic()
        try:
            async for batch in consumer.batches():
                consumer.commit()
                if not any(type(it) is DcpRecord for it in batch) and node.alive():
                    assert node.proc is not None
                    node.proc.send_signal(signal.SIGSTOP)  # alive but silent
                    t0 = time.monotonic()
        finally:
            await consumer.aclose()
        return t0

    try:
        with pytest.raises(ConsumerError, match="reconnect attempts failed"):
            asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGCONT)


def _run_bounded(main: Coroutine[Any, Any, _T], seconds: float) -> _T:
    """`asyncio.run` with a bound: a task that swallows its cancellation would hang
    `asyncio.run`'s shutdown (and pytest-timeout's interrupt with it), so the test fails
    in `seconds` instead, leaving the stuck tasks on a loop it closes."""
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(main)
        loop.run_until_complete(asyncio.wait({task}, timeout=seconds))
        if not task.done():
            pytest.fail(f"still running after {seconds} s: a cancelled consumer hangs")
        return task.result()
    finally:
        loop.close()


def _open_readers(prefix: str) -> list[str]:
    """Names of the connection reader tasks still running (a leaked connection's)."""
    return [t.get_name() for t in asyncio.all_tasks()
            if t.get_name().startswith(prefix) and not t.done()]  # fmt: skip


def test_a_consumer_cancelled_while_opening_leaks_no_connection(node: Node) -> None:
    """A replication link restarted by a map change is cancelled wherever it stands,
    often inside `open`: every connection it made must be closed (the node logged
    "Task was destroyed but it is pending" for their reader tasks)."""

    async def main() -> list[str]:
        leaked: list[str] = []
        for delay in [0.0, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.03]:
            consumer = DcpConsumer(SourceUri.parse(node.uri), name="upr-cancel-test")

            async def use(c: DcpConsumer = consumer) -> None:
                async with c:
                    await asyncio.sleep(3600)

            task = asyncio.ensure_future(use())
            await asyncio.sleep(delay)
            task.cancel()
            await asyncio.wait({task}, timeout=10)
            assert task.done(), f"cancelled after {delay} s, the consumer did not stop"
            await asyncio.sleep(0)
            leaked += _open_readers("reader ")
            assert not consumer._links
        return leaked

    assert _run_bounded(main(), 60) == []


def test_a_map_refresh_cut_short_closes_its_connection(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_refresh_map` asks a node it holds no link to over a connection of its own. A
    replication link cancelled (or refused) during that request left it open, and its
    reader task was later destroyed pending (seen in the long set test's node logs).
    The real `connect` runs; the task is cancelled as it returns, so the cancel lands
    on the refresh's own request."""
    real = consumer_module.connect

    async def connect_then_cancel(*args: Any, **kwargs: Any) -> Any:
        session = await real(*args, **kwargs)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        return session

    monkeypatch.setattr(consumer_module, "connect", connect_then_cancel)

    async def main() -> list[str]:
        consumer = DcpConsumer(SourceUri.parse(node.uri), name="upr-refresh-test")
        # a map naming the node, to which the consumer holds no link: the refresh connects
        consumer._config = {"vBucketServerMap": {"serverList": [f"127.0.0.1:{node.port}"]}}
        task = asyncio.ensure_future(consumer._refresh_map())
        await asyncio.wait({task}, timeout=10)
        assert task.cancelled()
        await asyncio.sleep(0)
        return _open_readers("reader upr-refresh-test")

    assert _run_bounded(main(), 30) == []
