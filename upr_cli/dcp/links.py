"""The DCP consumer's connections ("links"), one per node it streams from.

A link is a session (net/bootstrap.py: HELLO, auth, bucket) turned into a DCP producer
connection: DCP_OPEN, then the controls the consumer relies on: the flow-control window
and NOOPs (docs/protocol.md §7.1, §2.12), forced compression when asked
(formats/wire.md "Snappy"), barrier cookies when asked (formats/barrier.md). Every link's
reader task hands its server items to `on_server`, which answers NOOPs at once and
queues the rest, with the link's generation: a reconnect bumps it, so that items queued
by an older connection are dropped. A link that closes queues a `Lost` marker. The
queue is the one place `DcpConsumer.batches()` waits on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from upr_cli.dcp.streams import Addr
from upr_cli.net.bootstrap import Session, connect
from upr_cli.net.connection import ConnectionClosed, ConnectionError_, ServerItems, aclose_all
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Frame
from upr_cli.protocol.dcp import OPEN_DELETED_USER_XATTRS, OPEN_PRODUCER
from upr_cli.protocol.dcp import OPEN_XATTRS as OPEN_INCLUDE_XATTRS
from upr_cli.protocol.header import Feature, Opcode
from upr_cli.protocol.messages import BufferAck, Control, DcpOpen, Response
from upr_cli.protocol.status import Status

# DCP_OPEN flags for xattrs (formats/wire.md "Xattrs"): every data message carries the
# document's xattrs, and a deletion keeps its user xattrs where the server still has them
OPEN_XATTRS = OPEN_INCLUDE_XATTRS | OPEN_DELETED_USER_XATTRS
# --wire-compression (formats/wire.md "Snappy"): negotiate Snappy without forcing it,
# force every value compressed (a slow link), or not negotiate it
WireCompression = Literal["auto", "force", "off"]
WIRE_COMPRESSION: tuple[WireCompression, ...] = ("auto", "force", "off")


class Lost:
    """Queue marker: a link's connection closed or went silent."""

    def __init__(self, reason: str, addr: Addr | None = None, gen: int = -1) -> None:
        self.reason = reason
        self.addr = addr
        self.gen = gen


@dataclass(slots=True)
class Link:
    """One connection of the consumer, to one node."""

    addr: Addr
    session: Session
    gen: int  # bumped per connection: queued items of an older one are dropped
    unacked: int = 0


Queued = tuple[Addr, int, ServerItems, int] | BaseException | Lost


class Links:
    """The consumer's links by node address, and the queue their reader tasks feed."""

    def __init__(
        self,
        *,
        name: str,
        features: tuple[Feature, ...],
        buffer_size: int,
        noop_interval: float,
        compression: WireCompression,
        want_barriers: bool,
        connect_timeout: float,
    ) -> None:
        self.name = name
        self.features = features
        self.buffer_size = buffer_size
        self.noop_interval = noop_interval
        self.compression = compression
        self.want_barriers = want_barriers
        self.connect_timeout = connect_timeout
        self.barriers_supported = False
        self.by_addr: dict[Addr, Link] = {}
        self.session: Session | None = None  # the bootstrap link's session
        self.queue: asyncio.Queue[Queued] = asyncio.Queue()
        self._locks: dict[Addr, asyncio.Lock] = {}
        self._gen = 0

    def open_conn(self, addr: Addr) -> Link:
        """The link to `addr`, which must be open (ConnectionError_ otherwise)."""
        link = self.by_addr.get(addr)
        if link is None or link.session.conn.closed:
            raise ConnectionError_(f"no open link to {addr[0]}:{addr[1]}")
        return link

    async def link(self, uri: SourceUri, addr: Addr) -> Link:
        """The open link to a node, connecting it if needed (one connection per node: a
        lock per address, so concurrent moves share it instead of replacing it)."""
        lock = self._locks.setdefault(addr, asyncio.Lock())
        async with lock:
            link = self.by_addr.get(addr)
            if link is None or link.session.conn.closed:
                await self.connect(uri, addr)
                link = self.by_addr[addr]
            return link

    async def connect(self, uri: SourceUri, addr: Addr, *, bootstrap: bool = False) -> None:
        """Connect a node's link (replacing the old one), DCP_OPEN it and set its controls."""
        queue = self.queue
        self._gen += 1
        gen = self._gen
        live = False

        def lost(exc: ConnectionClosed) -> None:
            if live:  # not a bootstrap that failed
                queue.put_nowait(Lost(str(exc), addr, gen))

        def on_server(items: ServerItems, nbytes: int) -> None:
            self.on_server(addr, gen, items, nbytes)

        session = await connect(uri.at(*addr), timeout=self.connect_timeout,
                                on_server=on_server, on_close=lost, name=self.name,
                                features=self.features)  # fmt: skip
        try:
            await self._open(session)
        except BaseException:
            await session.conn.aclose()
            raise
        live = True
        old = self.by_addr.get(addr)
        # the new link is held before anything awaits: a cancellation cannot leak it
        self.by_addr[addr] = Link(addr, session, gen)
        if bootstrap or self.session is None or self.session.conn.closed:
            self.session = session
        if len(self.by_addr) > 1:
            self.barriers_supported = False  # cookies are per connection
        if old is not None:
            await old.session.conn.aclose()

    async def _open(self, session: Session) -> None:
        conn = session.conn
        flags = OPEN_PRODUCER | (OPEN_XATTRS if Feature.XATTR in session.features else 0)
        await conn.request(DcpOpen(name=self.name, flags=flags, opaque=conn.next_opaque()))
        controls = [("connection_buffer_size", str(self.buffer_size)), ("enable_noop", "true"),
                    ("set_noop_interval", f"{self.noop_interval:g}")]  # fmt: skip
        for key, value in controls:
            await conn.request(Control(name=key, value=value, opaque=conn.next_opaque()))
        if self.compression == "force" and Feature.SNAPPY in session.features:
            # every value compressed on the wire; where refused (EINVAL), values
            # the server stores compressed still come compressed, the rest plain
            await conn.request(
                Control(name="force_value_compression", value="true",
                        opaque=conn.next_opaque()),
                check=False,
            )  # fmt: skip
        if self.want_barriers:
            # a real server answers EINVAL: no barriers, callers fall back (formats/barrier.md);
            # asked on every connection: a reconnected link is a new DCP connection
            resp = await conn.request(
                Control(name="upr_barrier_cookies", value="true", opaque=conn.next_opaque()),
                check=False,
            )
            self.barriers_supported = resp.status == Status.SUCCESS

    def on_server(self, addr: Addr, gen: int, items: ServerItems, nbytes: int) -> None:
        """Reader-task callback: answer NOOPs now, queue the rest (with its byte count)."""
        if Frame not in set(map(type, items)):  # data records alone: no NOOP among them
            self.queue.put_nowait((addr, gen, items, nbytes))
            return
        keep = []
        link = self.by_addr.get(addr)
        for it in items:
            if type(it) is Frame and it.opcode == Opcode.DCP_NOOP:
                if link is not None and link.gen == gen and not link.session.conn.closed:
                    link.session.conn.send_bytes(
                        Response(opcode=Opcode.DCP_NOOP, opaque=it.opaque).encode()
                    )
            else:
                keep.append(it)
        self.queue.put_nowait((addr, gen, keep, nbytes))

    def ack(self, link: Link, nbytes: int) -> None:
        """Acknowledge consumed bytes once a fifth of the window is pending.

        The window and the acknowledgements are docs/protocol.md §7.1.
        """
        link.unacked += nbytes
        if link.unacked >= self.buffer_size // 5 and not link.session.conn.closed:
            link.session.conn.send_bytes(BufferAck(acked=link.unacked).encode())
            link.unacked = 0

    def send(self, outbox: list[tuple[Addr, bytes]]) -> None:
        """Send each message on its node's link, where one is held."""
        for addr, data in outbox:
            link = self.by_addr.get(addr)
            if link is not None:
                link.session.conn.send_bytes(data)
        outbox.clear()

    async def aclose(self) -> None:
        """Close every link (all at once: a cancelled close leaks none)."""
        conns = [link.session.conn for link in self.by_addr.values()]
        self.by_addr.clear()
        self.session = None
        await aclose_all(conns)


__all__ = ["WIRE_COMPRESSION", "Addr", "Link", "Links", "Lost", "WireCompression"]
