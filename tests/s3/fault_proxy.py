"""A fault-injecting HTTP proxy on loopback, in front of the S3 server of the tests.

It serves one request per connection (it forwards with `Connection: close`, so the
client opens a new one for the next request), records every request it sees (method,
path, the status it answered: 0 when it answered nothing) and applies the first
`Fault` that matches a request:

* `status`: answer with that HTTP status (500, 503) without forwarding;
* `close`: read the request and close without an answer (a connection dropped
  mid-request: an upload whose answer never comes);
* `drop`: forward, then pass on only `nbytes` of the answer's body and close (a
  download cut off mid-way), or nothing at all with `nbytes=-1` (the request landed,
  its answer was lost);
* `delay`: wait `seconds` before forwarding (an answer slower than the read timeout);
* `gate`: hold the request until the test sets `gate` (a `threading.Event`), then
  forward it (a writer held in its commit for as long as the test needs);
* `hang`: never forward; hold the connection until the client goes away (a process
  stuck in a request, then killed: its request never lands).

An `Expect: 100-continue` request is answered `100 Continue` at once and forwarded
without it.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Fault:
    """What to do to the next `count` requests that match `method` and `match` (a
    substring of the path; None matches any)."""

    kind: str  # status | close | drop | delay | gate | hang
    count: int = 1
    method: str | None = None
    match: str | None = None
    status: int = 503
    nbytes: int = 0
    seconds: float = 0.0
    gate: threading.Event = field(default_factory=threading.Event)

    def matches(self, method: str, path: str) -> bool:
        """`match` is looked for in the path without its query (a listing whose prefix
        names a segment is no download of it)."""
        return (self.count > 0 and (self.method is None or self.method == method)
                and (self.match is None or self.match in path.split("?", 1)[0]))  # fmt: skip


@dataclass
class Seen:
    """One request as the proxy saw it."""

    method: str
    path: str
    status: int
    fault: str | None = None


@dataclass
class FaultProxy:
    """The proxy: `start()`, then `url`; `faults` to add, `seen` to read."""

    upstream: tuple[str, int]
    faults: list[Fault] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, *faults: Fault) -> None:
        with self._lock:
            self.faults.extend(faults)

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.seen.clear()

    def requests(self, method: str | None = None, match: str | None = None) -> list[Seen]:
        """The requests seen, by method and a substring of the path (not its query)."""
        with self._lock:
            return [s for s in self.seen if (method is None or s.method == method)
                    and (match is None or match in s.path.split("?", 1)[0])]  # fmt: skip

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.matches(method, path):
                    f.count -= 1
                    return f
        return None

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _version = lines[0].split(" ", 2)
        headers = [ln for ln in lines[1:] if ln]
        names = {ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip()
                 for ln in headers}  # fmt: skip
        if names.get("expect", "").lower() == "100-continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        length = int(names.get("content-length", "0"))
        while len(body) < length:
            chunk = conn.recv(min(1 << 20, length - len(body)))
            if not chunk:
                return
            body += chunk
        fault = self._take(method, path)
        kind = fault.kind if fault else None
        seen = Seen(method, path, 0, kind)  # recorded on arrival, its status once known
        self._record(seen)
        if fault is not None and fault.kind == "status":
            text, code = {
                403: ("Forbidden", "AccessDenied"),
                500: ("Internal Server Error", "InternalError"),
                503: ("Service Unavailable", "ServiceUnavailable"),
            }.get(fault.status, ("Error", "InternalError"))
            xml = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
            conn.sendall(f"HTTP/1.1 {fault.status} {text}\r\nContent-Type: application/xml\r\n"
                         f"Content-Length: {len(xml)}\r\nConnection: close\r\n\r\n".encode()
                         + xml)  # fmt: skip
            seen.status = fault.status
            return
        if fault is not None and fault.kind == "close":
            return
        if fault is not None and fault.kind == "hang":
            conn.settimeout(fault.seconds or 60)
            with contextlib.suppress(OSError):
                while conn.recv(65536):
                    pass
            return
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.seconds)
        if fault is not None and fault.kind == "gate":
            fault.gate.wait(fault.seconds or 60)
        keep = [h for h in headers if h.split(":", 1)[0].strip().lower()
                not in ("connection", "expect")]  # fmt: skip
        out_head = "\r\n".join([lines[0], *keep, "Connection: close"]) + "\r\n\r\n"
        up = socket.create_connection(self.upstream, timeout=30)
        try:
            up.sendall(out_head.encode("latin-1") + body)
            resp = b""
            while chunk := up.recv(1 << 20):
                resp += chunk
        finally:
            up.close()
        try:
            status = int(resp.split(b" ", 2)[1])
        except (IndexError, ValueError):
            status = 0
        if fault is not None and fault.kind == "drop":
            seen.status = status if fault.nbytes >= 0 else 0
            if fault.nbytes >= 0:
                end = resp.index(b"\r\n\r\n") + 4
                with_length = resp[:end] + resp[end : end + fault.nbytes]
                conn.sendall(with_length)
            return
        seen.status = status
        with contextlib.suppress(OSError):  # the client gave up (a timeout)
            conn.sendall(resp)
