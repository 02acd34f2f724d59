"""A DCP connection's barrier cookies (formats/barrier.md, our extension).

A cookie records, per partition streamed when it arrives, the partition's high seqno
(its point). Each stream settles it once it has sent whole a snapshot ending at or past
that point, or once it ends; the cookie then goes back, in arrival order, carrying per
partition that end (its cut): the client then holds a state every partition had. The
stream loop reports each snapshot sent whole (`sent_whole`) as soon as its last message
went to the sender, before any await, so a cookie sent later follows every row up to
its cut on the connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from upr_cli.protocol.header import DATATYPE_JSON
from upr_cli.protocol.messages import Barrier
from upr_cli.protocol.status import InvalidArguments


@dataclass(slots=True)
class PendingBarrier:
    """A barrier cookie waiting until every recorded partition passed its point.

    `points`: per partition streamed when the cookie arrived, its high seqno then. `cut`:
    per partition settled so far, the end of the first whole snapshot sent at or past the
    point (or what its stream had sent whole when it ended). It is never the point itself:
    deduplication may have sent the point's key only later, at its newest seq.
    """

    cookie: bytes
    opaque: int
    points: dict[int, int]
    cut: dict[int, int] = field(default_factory=dict)


class BarrierCookies:
    """The pending cookies of one connection, and per partition the end of the last
    snapshot its stream sent whole (the stream's start until then)."""

    def __init__(self, send: Callable[[list[bytes]], Awaitable[None]]) -> None:
        self._send = send  # the connection's counted send (DcpSender.send)
        self._pending: list[PendingBarrier] = []  # in arrival order
        self._task: asyncio.Task[None] | None = None  # sends settled cookies back
        self.sent_end: dict[int, int] = {}

    def register(self, cookie: bytes, opaque: int, points: dict[int, int]) -> None:
        """Note a cookie and its points (per open stream, the partition's high seqno)."""
        if not 1 <= len(cookie) <= 250:
            raise InvalidArguments("a barrier cookie has 1 to 250 bytes")
        if any(b.cookie == cookie for b in self._pending):
            raise InvalidArguments("this barrier cookie is already pending")
        b = PendingBarrier(cookie, opaque, points)
        for vb, point in points.items():
            if self.sent_end[vb] >= point:  # caught up: the client holds that state already
                b.cut[vb] = self.sent_end[vb]
        self._pending.append(b)
        self.release()

    def sent_whole(self, vb: int, end: int) -> None:
        """The stream of `vb` sent a snapshot ending at `end` whole, and the client now holds
        a state the partition had at `end`: settle the cookies whose point it reaches.

        Called as soon as the snapshot's last message went to the sender, before any await,
        so a cookie sent later follows every row up to its cut on the connection.
        """
        self.sent_end[vb] = end
        for b in self._pending:
            point = b.points.get(vb)
            if point is not None and vb not in b.cut and end >= point:
                b.cut[vb] = end
        self.release()

    def stream_gone(self, vb: int) -> None:
        """The stream of `vb` ended or was closed: it holds no cookie back any longer; its
        cut is what it had sent whole (before a new stream of `vb` resets `sent_end`)."""
        for b in self._pending:
            if vb in b.points and vb not in b.cut:
                b.cut[vb] = self.sent_end[vb]
        self.release()

    def release(self) -> None:
        """Have the settled cookies at the head of the queue sent back, in arrival order.

        A task of their own sends them: a cookie counts for flow control, and waiting for
        credit would stall the caller, which may be the connection's read loop (BARRIER,
        CLOSE_STREAM, STREAM_REQ), the very loop that must read the BUFFER_ACK bringing it.
        """
        if not self._pending or len(self._pending[0].cut) < len(self._pending[0].points):
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._send_settled(), name="barrier cookies"
            )

    async def _send_settled(self) -> None:
        try:
            while self._pending and len(self._pending[0].cut) == len(self._pending[0].points):
                b = self._pending.pop(0)
                cut = {str(vb): str(seq) for vb, seq in sorted(b.cut.items())}
                body = json.dumps({"cut": cut}, separators=(",", ":")).encode()
                msg = Barrier(opaque=b.opaque, cookie=b.cookie, datatype=DATATYPE_JSON, value=body)
                await self._send([msg.encode()])
        except (ConnectionError, OSError):
            return  # the connection is gone, and its pending cookies with it

    def drop(self) -> list[asyncio.Task[None]]:
        """Forget the pending cookies, which die with the connection (formats/barrier.md);
        returns the task sending settled ones, for the caller to cancel."""
        self._pending.clear()
        return [] if self._task is None else [self._task]
