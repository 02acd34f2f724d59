"""What a port speaks, asked only after a connection to it was closed on us.

A peer that closes a connection without a word looks the same whatever it is: a plain
data port that got a TLS ClientHello, a TLS port that got a memcached request, or a node
that was killed or restarted meanwhile (docs/protocol.md §13.3). A hint about the wrong
port fits the first two only, so before giving one the client asks the port once in the
other protocol: a memcached HELLO (does a response header come back?) or a TLS
handshake that checks no certificate (does the peer speak TLS?). A port that refuses
or closes again is a node that went away: no hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from upr_cli.protocol.header import RESPONSE_MAGICS
from upr_cli.protocol.messages import Hello

PROBE_S = 2.0
"""At most this long for one probe: it runs on an error path only."""


async def answers_plain(host: str, port: int, timeout: float = PROBE_S) -> bool:
    """True when host:port answers a memcached HELLO in the binary protocol."""
    hello = Hello(agent="upr-probe", features=(), opaque=1).encode()
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(hello)
            first = await reader.readexactly(24)
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        await _close(writer)
    return first[0] in RESPONSE_MAGICS


async def answers_tls(host: str, port: int, timeout: float = PROBE_S) -> bool:
    """True when host:port speaks TLS: its handshake completes, or it refuses this
    client in TLS (an alert)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # only which protocol: nothing is sent over it
    writer = None
    try:
        async with asyncio.timeout(timeout):
            _reader, writer = await asyncio.open_connection(host, port, ssl=ctx,
                                                            server_hostname=host)  # fmt: skip
    except ssl.SSLError as exc:
        return not isinstance(exc, ssl.SSLEOFError) and exc.reason != "WRONG_VERSION_NUMBER"
    except (OSError, TimeoutError):
        return False
    finally:
        await _close(writer)
    return True


async def _close(writer: asyncio.StreamWriter | None) -> None:
    if writer is None:
        return
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(PROBE_S):
            await writer.wait_closed()
