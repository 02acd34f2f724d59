"""One asyncio connection speaking the memcached binary protocol (aiokafka's good parts).

Theory of operation. A single reader task owns the socket's read side: it feeds a
`FrameDecoder` and hands out what arrives. Responses (magic 0x81/0x18) complete the
request waiting on their opaque; everything else the server sends (DCP stream traffic:
data rows and control frames, docs/protocol.md §1.5 "DCP is full duplex") goes, in
batches, to the `on_server` callback together with the bytes those frames occupied,
which DCP flow control must acknowledge (docs/protocol.md §7.1). One `close(reason,
exc)` path fails every waiter, and every later call raises the same `ConnectionClosed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from upr_cli.errors import RemoteProtocolError, UprError
from upr_cli.net.aio import cancel_and_wait
from upr_cli.net.probe import answers_plain
from upr_cli.net.tls import closed_by_peer, handshake_error
from upr_cli.protocol import (
    DcpRecord,
    Frame,
    FrameDecoder,
    Message,
    ResponseMessage,
    decode_message,
)
from upr_cli.protocol.header import RESPONSE_MAGICS
from upr_cli.protocol.messages import Request, StatResponse
from upr_cli.protocol.status import Status, error_context, status_error

log = logging.getLogger(__name__)

READ_SIZE = 256 * 1024
# deferred requests are joined into one write up to this many bytes
JOIN_BYTES = 256 * 1024
ServerItems = list[DcpRecord | Frame]  # data records and `Frame`s, in wire order
# A peer that is not TLS resets or closes during the handshake (docs/protocol.md §13.3).
_HANDSHAKE_ERRORS = (ssl.SSLError, ConnectionResetError, BrokenPipeError)


class ConnectionError_(UprError):
    """Connecting, or talking to, a peer failed."""


class ConnectionClosed(ConnectionError_):
    """The connection is closed; pending and later requests fail with this."""

    retriable = True


class RequestTimeout(ConnectionError_):
    """The peer did not answer in time."""

    retriable = True


class Connection:
    """A client connection: `request()` matches responses by opaque; one reader task."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        name: str = "",
        on_server: Callable[[ServerItems, int], None] | None = None,
        on_close: Callable[[ConnectionClosed], None] | None = None,
        max_body: int = 20 * 1024 * 1024,
    ) -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._decoder = FrameDecoder(max_body=max_body)
        self._pending: dict[int, asyncio.Future[list[Message]]] = {}
        self._multi: dict[int, list[Message]] = {}  # STAT: responses until the empty one
        self._raw: dict[int, asyncio.Future[Frame]] = {}  # start_raw: undecoded replies
        self._wbuf: list[bytes] = []  # deferred requests
        self._opaques = itertools.count(1)
        self._closed: ConnectionClosed | None = None
        self.on_server = on_server
        self.on_close = on_close
        self._task = asyncio.get_running_loop().create_task(
            self._read_loop(), name=f"reader {name}"
        )

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        timeout: float = 10.0,
        name: str = "",
        on_server: Callable[[ServerItems, int], None] | None = None,
        on_close: Callable[[ConnectionClosed], None] | None = None,
        tls: ssl.SSLContext | None = None,
        cafile: str | None = None,
    ) -> Connection:
        """Connect to host:port within `timeout` seconds (the TLS handshake included, and
        the certificate checked for `host`, when `tls` is given; `cafile` is the CA file
        it trusts, for the error when the certificate does not verify)."""
        extra: dict[str, Any] = {}
        if tls is not None:
            extra = {"ssl": tls, "server_hostname": host, "ssl_handshake_timeout": timeout}
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can lose a cancel (net/aio.py)
                reader, writer = await asyncio.open_connection(host, port, limit=READ_SIZE,
                                                               **extra)  # fmt: skip
        except TimeoutError:
            what = "with TLS " if tls is not None else ""
            hint = " (a plain port? it takes upr://)" if tls is not None else ""
            raise ConnectionError_(
                f"connecting {what}to {host}:{port} timed out after {timeout:g}s{hint}"
            ) from None
        except OSError as exc:
            if tls is not None and isinstance(exc, _HANDSHAKE_ERRORS):
                # closed on us: a plain port, or a node gone mid-handshake? (net/probe.py)
                plain = closed_by_peer(exc) and await answers_plain(host, port)
                raise handshake_error(exc, f"{host}:{port}", cafile=cafile, plain=plain) from None
            # asyncio's strerror repeats the address ("Connect call failed ('h', p)")
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ConnectionError_(f"cannot connect to {host}:{port}: {why}") from None
        return cls(reader, writer, name=name or f"{host}:{port}", on_server=on_server,
                   on_close=on_close)  # fmt: skip

    @property
    def collections(self) -> bool:
        """True once HELLO granted Collections: data records' keys carry a LEB128
        collection id, which the decoder splits off into `DcpRecord.collection`."""
        return self._decoder.collections

    @collections.setter
    def collections(self, on: bool) -> None:
        self._decoder.collections = on

    @property
    def closed(self) -> bool:
        """True once the connection has been closed for any reason."""
        return self._closed is not None

    def next_opaque(self) -> int:
        """A fresh opaque (never 0)."""
        return next(self._opaques) & 0xFFFFFFFF or next(self._opaques)

    # -- sending ----------------------------------------------------------------

    def send_bytes(self, data: bytes) -> None:
        """Queue raw bytes for sending (replies such as NOOP responses, buffer acks)."""
        if self._closed is not None:
            raise self._closed
        self._writer.write(data)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its high-water mark."""
        if self._closed is not None:
            raise self._closed
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            self.close("send failed", exc)
            raise self._closed or ConnectionClosed("closed") from None

    def start_request(self, msg: Request, *, multi: bool = False) -> asyncio.Future[list[Message]]:
        """Send `msg` (its opaque must be unique) and return a future of its response(s)."""
        if self._closed is not None:
            raise self._closed
        fut: asyncio.Future[list[Message]] = asyncio.get_running_loop().create_future()
        if msg.opaque in self._pending:
            raise UprError(f"opaque {msg.opaque} is already in use")
        self._pending[msg.opaque] = fut
        if multi:
            self._multi[msg.opaque] = []
        self._writer.write(msg.encode())
        return fut

    def start_raw(self, data: bytes, opaque: int, *, defer: bool = False) -> asyncio.Future[Frame]:
        """Send an encoded request; its reply comes back as an undecoded `Frame` (fast path).

        The frame's `vbucket_or_status` is the status; it is valid until the next read.
        With `defer`, the bytes wait for `flush_writes()` (one syscall for many requests).
        """
        if self._closed is not None:
            raise self._closed
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        if opaque in self._raw or opaque in self._pending:
            raise UprError(f"opaque {opaque} is already in use")
        self._raw[opaque] = fut
        if defer:
            self._wbuf.append(data)
        else:
            self.flush_writes()
            self._writer.write(data)
        return fut

    def flush_writes(self) -> None:
        """Write every deferred request: small ones joined, a few system calls for many
        of them; a large one (a value of megabytes) on its own, so that no joined copy
        of a window of large values is ever made (the transport copies again what the
        socket does not take at once)."""
        if not self._wbuf:
            return
        buf, self._wbuf = self._wbuf, []
        write = self._writer.write
        if len(buf) == 1:
            write(buf[0])
            return
        run: list[bytes] = []
        size = 0
        for data in buf:
            if size + len(data) > JOIN_BYTES and run:
                write(b"".join(run))
                run, size = [], 0
            run.append(data)
            size += len(data)
        write(b"".join(run))

    async def request(
        self, msg: Request, *, timeout: float | None = 30.0, check: bool = True
    ) -> ResponseMessage:
        """Send a request and wait for its response; a non-success status raises (if `check`)."""
        fut = self.start_request(msg)
        resp = (await self._wait(fut, msg, timeout))[0]
        assert isinstance(resp, ResponseMessage)
        if check:
            raise_for_status(resp)
        return resp

    async def stats(self, group: str = "", *, timeout: float | None = 30.0) -> dict[str, str]:
        """STAT: name/value pairs until an empty response ends them (docs/protocol.md §5.7)."""
        from upr_cli.protocol.messages import Stat

        fut = self.start_request(Stat(group=group, opaque=self.next_opaque()), multi=True)
        out: dict[str, str] = {}
        for resp in await self._wait(fut, None, timeout):
            if isinstance(resp, StatResponse):
                out[resp.name] = resp.value
            else:
                assert isinstance(resp, ResponseMessage)
                raise_for_status(resp)
        return out

    async def _wait(
        self, fut: asyncio.Future[list[Message]], msg: Request | None, timeout: float | None
    ) -> list[Message]:
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can lose a cancel (net/aio.py)
                return await asyncio.shield(fut)
        except TimeoutError:
            what = type(msg).__name__ if msg is not None else "request"
            exc = RequestTimeout(f"{self.name}: no answer to {what} within {timeout:g}s")
            self.close("request timed out", exc)
            raise exc from None

    # -- receiving ------------------------------------------------------------------

    async def _read_loop(self) -> None:
        decoder = self._decoder
        try:
            while True:
                data = await self._reader.read(READ_SIZE)
                if not data:
                    self.close("peer closed the connection")
                    return
                decoder.feed(data)
                before = decoder.consumed
                while items := decoder.read_rows(4096):
                    self._dispatch(items, decoder.consumed - before)
                    before = decoder.consumed
        except asyncio.CancelledError:
            raise
        except RemoteProtocolError as exc:
            self.close(f"protocol error from peer: {exc}", exc)
        except (ConnectionError, OSError) as exc:
            self.close(f"connection lost: {exc}", exc)
        except Exception as exc:
            log.exception("reader of %s failed", self.name)
            self.close(f"internal error: {exc}", exc)

    def _dispatch(self, items: list[DcpRecord | Frame], nbytes: int) -> None:
        server: ServerItems = []
        for item in items:
            if type(item) is Frame and item.magic in RESPONSE_MAGICS:
                nbytes -= item.size  # responses are not counted by flow control
                self._complete(item)
            else:
                server.append(item)
        if server:
            if self.on_server is None:
                raise RemoteProtocolError(f"unexpected server request opcode {_opcode(server[0])}")
            self.on_server(server, nbytes)

    def _complete(self, frame: Frame) -> None:
        raw = self._raw.pop(frame.opaque, None)
        if raw is not None:
            if not raw.done():
                raw.set_result(frame)
            return
        fut = self._pending.get(frame.opaque)
        if fut is None:
            log.debug("%s: response with unknown opaque %d dropped", self.name, frame.opaque)
            return
        msg = decode_message(frame)
        collected = self._multi.get(frame.opaque)
        if collected is not None:
            done = isinstance(msg, StatResponse) and not msg.name and not msg.value
            if isinstance(msg, ResponseMessage) and msg.status != Status.SUCCESS:
                done = True
            if not done:
                collected.append(msg)
                return
            if not isinstance(msg, StatResponse):
                collected.append(msg)
            del self._multi[frame.opaque]
            result = collected
        else:
            result = [msg]
        del self._pending[frame.opaque]
        if not fut.done():
            fut.set_result(result)

    # -- closing ----------------------------------------------------------------------

    def close(self, reason: str = "closed by us", exc: BaseException | None = None) -> None:
        """Close once: fail every waiter with ConnectionClosed(reason)."""
        if self._closed is not None:
            return
        err = ConnectionClosed(f"{self.name}: {reason}")
        err.__cause__ = exc
        self._closed = err
        waiters: list[asyncio.Future[Any]] = [*self._pending.values(), *self._raw.values()]
        for fut in waiters:
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # mark retrieved: a waiter may have gone away
        self._pending.clear()
        self._raw.clear()
        self._multi.clear()
        with contextlib.suppress(Exception):
            self._writer.close()
        if self._task is not asyncio.current_task():
            self._task.cancel()
        if self.on_close is not None:
            self.on_close(err)

    async def aclose(self) -> None:
        """Close and wait for the reader task and the socket to finish."""
        self.close()
        if self._task is not asyncio.current_task():
            await cancel_and_wait([self._task])
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def aclose_all(conns: Sequence[Connection]) -> None:
    """Close every connection at once, then wait for each: a cancelled wait leaves none
    of them open (an open one dropped leaks its reader task)."""
    for conn in conns:
        conn.close()
    for conn in conns:
        await conn.aclose()


def raise_for_status(resp: ResponseMessage) -> None:
    """Raise the status's error class for a non-success response."""
    if resp.status != Status.SUCCESS:
        body = getattr(resp, "value", b"")
        detail = error_context(body)[:200] if isinstance(body, bytes) else ""
        err = status_error(resp.status, body=body if isinstance(body, bytes) else b"",
                           opcode=getattr(resp, "opcode", None))  # fmt: skip
        if detail:
            err.args = (f"{err}: {detail}",)
        raise err


def _opcode(item: DcpRecord | Frame) -> str:
    return f"0x{item.opcode:02x}"
