"""Deferred requests leave in few writes, but a large one never in a joined copy
(issue 27: a restore's writer joined a window of 5 MiB requests into one 37 MB buffer,
which the transport then copied twice). Connection.flush_writes, net/connection.py, on
a real loopback socket."""

from __future__ import annotations

import asyncio

from upr_cli.net.connection import JOIN_BYTES, Connection


def test_small_requests_are_joined_and_a_large_one_goes_alone() -> None:
    small = [bytes([i]) * 1000 for i in range(40)]
    large = [bytes([100 + i]) * (1 << 20) for i in range(3)]
    requests = [*small[:10], large[0], *small[10:30], *large[1:], *small[30:]]

    async def scenario() -> tuple[list[int], bytes]:
        got = bytearray()
        done = asyncio.Event()
        want = sum(map(len, requests))

        async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while len(got) < want:
                chunk = await reader.read(1 << 16)
                if not chunk:
                    break
                got.extend(chunk)
            done.set()
            writer.close()

        server = await asyncio.start_server(peer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sizes: list[int] = []
        write = writer.write

        def recorded(data: bytes | bytearray | memoryview) -> None:
            sizes.append(len(data))
            write(data)

        writer.write = recorded  # type: ignore[method-assign]
        conn = Connection(reader, writer, name="t")
        for opaque, data in enumerate(requests, 1):
            conn.start_raw(data, opaque, defer=True)
        conn.flush_writes()
        await asyncio.wait_for(done.wait(), 10)
        await conn.aclose()
        server.close()
        await server.wait_closed()
        return sizes, bytes(got)

    sizes, got = asyncio.run(scenario())
    assert got == b"".join(requests)  # every byte, in order
    assert len(sizes) < len(requests) // 4  # the small ones went joined
    assert sizes.count(1 << 20) == 3  # each large one alone, never inside a joined copy
    assert all(n <= JOIN_BYTES for n in sizes if n != 1 << 20)
