"""An in-process node and consumer pair: `NodeServer` and `DcpConsumer` in one event loop.

No subprocess: the node listens on a free loopback port inside the test's loop, data is
written with the bucket's own API, and the consumer streams over real TCP. A scenario
runs in well under a second, so the consumer's logic (rollback, reconnect, partition
moves, flow control) is tested where it lives rather than through `upr serve`.

`run` bounds a scenario's time and then checks that it left no task behind: pytest runs
with warnings as errors, so a socket left open fails the test as well.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from upr_cli.dcp.consumer import DcpConsumer, Item
from upr_cli.dcp.events import Event
from upr_cli.net.uri import SourceUri
from upr_cli.node.bucket import Bucket
from upr_cli.node.server import NodeConfig, NodeServer
from upr_cli.protocol.decoder import OP_MUTATION, DcpRecord

_T = TypeVar("_T")
SCENARIO_S = 2.0  # a scenario taking longer than this is a failure, not a slow pass


def run(scenario: Coroutine[Any, Any, _T], timeout: float = SCENARIO_S) -> _T:
    """Run a scenario in a fresh loop, fail it after `timeout` seconds, and fail it too
    if any task outlived it (a consumer or node that did not close everything)."""

    async def main() -> _T:
        async with asyncio.timeout(timeout):
            result = await scenario
        for _ in range(20):  # closing transports finish within a few loop turns
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if not left:
                return result
            await asyncio.sleep(0)
        raise AssertionError(f"tasks left running: {[t.get_name() for t in left]}")

    return asyncio.run(main())


class InProcessNode:
    """A `NodeServer` without authentication on 127.0.0.1; restartable on its port."""

    def __init__(self, data: Path, *, partitions: int = 4, flush_interval: float = 0.02) -> None:
        self.config = NodeConfig(data_dir=data, port=0, partitions=partitions, no_auth=True,
                                 flush_interval=flush_interval)  # fmt: skip
        self.server: NodeServer | None = None

    async def start(self) -> InProcessNode:
        """Open the bucket (recovering as `upr serve` does) and listen; the port is kept
        across restarts, so a consumer's reconnect finds the node again."""
        server = NodeServer(self.config)
        await server.start()
        self.config.port = server.port
        self.server = server
        return self

    async def stop(self, *, clean: bool = True) -> None:
        """Stop the node; `clean=False` loses what was not flushed, as a crash does."""
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop(clean=clean)

    async def drop_connections(self) -> None:
        """Close every client connection, as a network failure would."""
        assert self.server is not None
        for session in list(self.server.sessions):
            await session.aclose()

    @property
    def bucket(self) -> Bucket:
        """The node's only bucket."""
        assert self.server is not None
        return self.server.buckets[self.config.bucket]

    @property
    def uri(self) -> SourceUri:
        """A URI for the node (no credentials: it runs with --no-auth)."""
        return SourceUri.parse(f"upr://127.0.0.1:{self.config.port}/{self.config.bucket}")

    @property
    def address(self) -> str:
        """host:port, as a cluster map lists the node."""
        return f"127.0.0.1:{self.config.port}"

    def write(self, vb: int, count: int, *, prefix: str = "k", pad: int = 0) -> list[int]:
        """SET `count` keys `<prefix><i>` in partition `vb` (JSON values, `pad` bytes
        longer than the smallest); returns their seqs."""
        return [
            self.bucket.store("set", vb, b"\x00" + f"{prefix}{i}".encode(),  # qualified: _default
                              b'{"i":%d,"pad":"%s"}' % (i, b"x" * pad), datatype=1).seq
            for i in range(count)
        ]  # fmt: skip

    async def wait_for(self, what: str, pred: Callable[[], bool], timeout: float = 1.5) -> None:
        """Poll the node's state until `pred` holds."""
        try:
            async with asyncio.timeout(timeout):
                while not pred():  # noqa: ASYNC110 - the node has no event for every state
                    await asyncio.sleep(0.005)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None


@contextlib.asynccontextmanager
async def nodes(*made: InProcessNode) -> AsyncIterator[tuple[InProcessNode, ...]]:
    """Start the nodes; stop every one still running at the end, whatever happened."""
    try:
        for n in made:
            await n.start()
        yield made
    finally:
        for n in made:
            await n.stop()


@dataclass
class Received:
    """What a consumer handed over: records (key and value as bytes) and events, in order."""

    records: list[DcpRecord] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def take(self, batch: list[Item]) -> None:
        """Keep a batch's items; records are copied out of the receive buffer."""
        for it in batch:
            if type(it) is DcpRecord:
                self.records.append(it._replace(key=bytes(it.key), value=bytes(it.value)))
            else:
                self.events.append(it)  # type: ignore[arg-type]

    def seqs(self, vb: int) -> list[int]:
        """The seqs received for a partition, in arrival order."""
        return [r.by_seqno for r in self.records if r.vbucket == vb]

    def of(self, kind: type[_T]) -> list[_T]:
        """The events of one type, in order."""
        return [e for e in self.events if isinstance(e, kind)]

    def state(self) -> dict[tuple[int, bytes], bytes]:
        """(partition, key) → value of the live documents the records leave."""
        out: dict[tuple[int, bytes], bytes] = {}
        for r in self.records:
            if r.opcode == OP_MUTATION:
                out[(r.vbucket, bytes(r.key))] = bytes(r.value)
            else:
                out.pop((r.vbucket, bytes(r.key)), None)
        return out


async def consume_until(
    consumer: DcpConsumer,
    got: Received,
    done: Callable[[Received], bool],
    *,
    commit: bool = True,
    on_batch: Callable[[list[Item]], Awaitable[None]] | None = None,
) -> None:
    """Take batches (committing each, as a durable sink would) until `done(got)`."""
    if done(got):
        return
    async with contextlib.aclosing(consumer.batches()) as batches:  # no generator left open
        async for batch in batches:
            got.take(batch)
            if on_batch is not None:
                await on_batch(batch)
            if commit:
                consumer.commit()
            if done(got):
                return
