"""A DCP connection's streams encode their next messages only once its flow-control
window has room (issue 27: the streams waiting for one replication link's window held
an encoded copy of a 5 MiB document each). DcpSender, node/producer.py."""

from __future__ import annotations

import asyncio
from functools import partial

from upr_cli.node.producer import DcpSender


def test_messages_are_made_only_once_the_window_has_room() -> None:
    async def scenario() -> tuple[list[str], list[int]]:
        written: list[bytes] = []
        sender = DcpSender(written.append, lambda: asyncio.sleep(0))
        sender.set_window(100)
        made: list[str] = []

        def make(name: str, size: int) -> list[bytes]:
            made.append(name)
            return [b"x" * size]

        await sender.send_made(lambda: make("first", 150))  # crosses the window
        waiting = [asyncio.ensure_future(sender.send_made(partial(make, n, 10)))
                   for n in ("a", "b", "c")]  # fmt: skip
        for _ in range(5):
            await asyncio.sleep(0)
        assert made == ["first"]  # the window is full: nothing else is encoded yet
        sender.ack(150)
        await asyncio.gather(*waiting)
        return made, [len(w) for w in written]

    made, written = asyncio.run(scenario())
    assert made == ["first", "a", "b", "c"]  # in the order asked, one make each
    assert written == [150, 10, 10, 10]


def test_without_flow_control_messages_are_made_at_once() -> None:
    async def scenario() -> list[int]:
        written: list[bytes] = []
        sender = DcpSender(written.append, lambda: asyncio.sleep(0))
        await sender.send_made(lambda: [b"m1", b"m2"])
        return [len(w) for w in written]

    assert asyncio.run(scenario()) == [4]  # one write for the batch
