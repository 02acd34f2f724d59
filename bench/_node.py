"""What the benchmarks share: a `upr serve` child process (loopback, no auth, free port)
and the `upr` command line in this interpreter."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


UPR = [sys.executable, "-m", "upr_cli"]


def upr(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `upr ARGS` to its end (output captured); a failure raises CalledProcessError."""
    return subprocess.run([*UPR, *args], capture_output=True, text=True, check=True)


class BenchNode:
    """Start/stop a node; read its peak RSS."""

    def __init__(self, data: Path, partitions: int = 1024, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [*UPR, "serve", "--data", str(data), "--port", "0",
             "--no-auth", "--num-partitions", str(partitions), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening "):
            raise SystemExit(
                f"upr serve did not start: {self.proc.stderr.read() if self.proc.stderr else ''}"
            )
        self.uri = line.split()[1]

    def peak_rss_mb(self) -> float:
        """VmHWM of the node process."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def wait_persisted(self, timeout: float = 600.0) -> None:
        """Poll STAT vbucket-seqno until every partition's persisted seq equals its high seq."""
        import asyncio
        import time

        from upr_cli.net.bootstrap import connect
        from upr_cli.net.uri import SourceUri

        async def done() -> bool:
            s = await connect(SourceUri.parse(self.uri))
            try:
                st = await s.conn.stats("vbucket-seqno")
            finally:
                await s.conn.aclose()
            highs = {
                k[: -len(":high_seqno")]: v for k, v in st.items() if k.endswith(":high_seqno")
            }
            return all(st[f"{vb}:last_persisted_seqno"] == h for vb, h in highs.items())

        deadline = time.monotonic() + timeout
        while not asyncio.run(done()):
            if time.monotonic() > deadline:
                raise SystemExit("the node did not persist its writes in time")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM and wait."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=600)


def bare_executemany(rows: list[tuple[object, ...]], db: Path) -> float:
    """rows/s of ONE bare executemany of `documents` rows (formats/store.md column order)
    into a new store's schema, in one transaction: the reference the store is held to."""
    import time

    from upr_cli.store import Store

    with Store(db) as s:
        conn = s.db.conn
        t = time.perf_counter()
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO documents (partition, key, seq, rev_seq, cas, flags, expiry,"
            " delete_time, datatype, deleted, value, collection_id)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )
        conn.execute("COMMIT")
        return len(rows) / (time.perf_counter() - t)
