"""The links a backup runs over, for bench/backup.py's `wire_pass`: plain or TLS, with
Snappy or without, measured at the client.

* A loopback proxy in a thread of the bench counts every byte each way; the node is
  given a cluster map (SET_CLUSTER_CONFIG, as `upr cluster` does) naming the proxy's
  ports as its data ports (`kv` and `kvSSL`), so the client reaches every partition
  through it. It forwards raw bytes: a TLS link is counted with its TLS records.
* `python bench/_wire.py one-backup URI REPO [--no-snappy] [--cacert CA]` runs one full
  backup in a process of its own, with Snappy forced (`--wire-compression force`) or not
  negotiated (`off`), and prints its summary as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Proxy:
    """Loopback TCP proxies (listen port → target port), counting bytes each way."""

    def __init__(self, targets: list[int]) -> None:
        self.down = 0  # bytes node → client
        self.up = 0  # bytes client → node
        self.ports: list[int] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(targets,), daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def reset(self) -> None:
        """Counters back to 0 (between runs)."""
        self.down = self.up = 0

    def _run(self, targets: list[int]) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            for target in targets:
                server = await asyncio.start_server(
                    functools.partial(self._client, target), "127.0.0.1", 0
                )
                self.ports.append(server.sockets[0].getsockname()[1])
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _client(self, target: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:  # fmt: skip
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_w, down=False),
                             self._pipe(up_r, writer, down=True))  # fmt: skip

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    *, down: bool) -> None:  # fmt: skip
        try:
            while data := await reader.read(1 << 16):
                if down:
                    self.down += len(data)
                else:
                    self.up += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        """Stop the loop (its thread is a daemon)."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def route_through(node_port: int, plain: int, tls: int, partitions: int) -> None:
    """Give the node (plain data port `node_port`, no auth) a cluster map whose one
    server is the proxy: `plain` as its data port, `tls` as its TLS data port."""
    from upr_cli.cluster.control import map_json, push
    from upr_cli.cluster.spec import ClusterSpec, NodeSpec

    cl = ClusterSpec("default", partitions, 0, "bench", "bench")
    cl.nodes = [NodeSpec("n0", plain, tls_port=tls)]
    config = map_json(cl, [[0] for _ in range(partitions)], 1 << 20)
    asyncio.run(push(cl, NodeSpec("n0", node_port), config, {}))


def make_certs(directory: Path) -> tuple[Path, Path, Path]:
    """(CA file, certificate chain, key) for 127.0.0.1, from a trustme test CA."""
    import trustme

    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    cafile, cert, key = directory / "ca.pem", directory / "node.pem", directory / "node.key"
    ca.cert_pem.write_to_path(str(cafile))
    leaf = ca.issue_cert("127.0.0.1")
    cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    return cafile, cert, key


def one_backup(uri: str, repo: Path, *, snappy: bool, cacert: str | None) -> None:
    """One full backup of `uri` into `repo`; its summary as JSON on stdout."""
    from upr_cli.dcp.consumer import WireCompression
    from upr_cli.jobs.backup import backup
    from upr_cli.jobs.backup_stream import stream_to_segments
    from upr_cli.net.tls import ClientTls
    from upr_cli.net.uri import SourceUri

    source = SourceUri.parse(uri).with_tls(ClientTls(cafile=cacert))
    streamer = functools.partial(stream_to_segments)
    mode: WireCompression = "force" if snappy else "off"
    summary = asyncio.run(backup(source, repo, full=True, streamer=streamer, compression=mode))
    print(json.dumps(summary.to_json()))


def main() -> None:
    ap = argparse.ArgumentParser(description="one full backup, Snappy forced or not negotiated")
    ap.add_argument("command", choices=["one-backup"])
    ap.add_argument("uri")
    ap.add_argument("repo", type=Path)
    ap.add_argument("--no-snappy", action="store_true")
    ap.add_argument("--cacert")
    args = ap.parse_args()
    one_backup(args.uri, args.repo, snappy=not args.no_snappy, cacert=args.cacert)


if __name__ == "__main__":
    main()
