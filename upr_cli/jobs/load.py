"""`upr load`: a reproducible, pipelined workload of JSON documents through the KV front end.

Each of `docs` operations creates a new document, or (by the given ratios) updates or
deletes an existing one; the same seed gives the same operations. Up to `window`
requests are in flight on one connection (the server answers in order, dcp-wire §1.5).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from upr_cli.errors import UsageError
from upr_cli.net.bootstrap import active_index, connect, node_uris, partition_of
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Frame
from upr_cli.protocol.fast import encode_set
from upr_cli.protocol.header import Opcode
from upr_cli.protocol.messages import Delete
from upr_cli.protocol.status import Status

WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
)


@dataclass
class LoadSummary:
    """What a load run did."""

    ops: int = 0
    sets: int = 0
    updates: int = 0
    deletes: int = 0
    errors: int = 0
    seconds: float = 0.0
    error_statuses: dict[int, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Operations per second."""
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """A JSON object for --json."""
        return {
            "ops": self.ops,
            "sets": self.sets,
            "updates": self.updates,
            "deletes": self.deletes,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
            "ops_per_s": round(self.rate),
            "error_statuses": {f"0x{k:02x}": v for k, v in self.error_statuses.items()},
        }


def make_doc(rng: random.Random, i: int, size: int) -> bytes:
    """A JSON document of about `size` bytes."""
    doc = {
        "id": i,
        "name": f"{rng.choice(WORDS)} {rng.choice(WORDS)}",
        "age": rng.randrange(18, 90),
        "tags": rng.sample(WORDS, 3),
        "score": round(rng.random() * 1000, 2),
        "pad": "",
    }
    raw = json.dumps(doc, separators=(",", ":"))
    pad = max(0, size - len(raw))
    return raw.replace('"pad":""', '"pad":"' + "x" * pad + '"').encode()


async def load(
    uri: SourceUri,
    *,
    docs: int,
    size: int = 180,
    update_ratio: float = 0.0,
    delete_ratio: float = 0.0,
    rate: float | None = None,
    seed: int = 1,
    window: int = 512,
    prefix: str = "doc",
    on_progress: Callable[[LoadSummary], None] | None = None,
) -> LoadSummary:
    """Run the workload; returns its summary (errors are counted, not raised)."""
    if not 0 <= update_ratio <= 1 or not 0 <= delete_ratio <= 1 or update_ratio + delete_ratio > 1:
        raise UsageError("--update-ratio and --delete-ratio must be in [0, 1] and sum to at most 1")
    session = await connect(uri, name="upr-load")
    n_parts = session.num_partitions
    if n_parts == 0:
        await session.conn.aclose()
        raise UsageError(f"{uri.redacted()}: the cluster config lists no partitions")
    # Follow the cluster map: each write goes to its partition's active node, one
    # connection per node (formats/cluster.md; a single node is its own map).
    conns = []
    try:
        for u in node_uris(session):
            same = (u.host, u.port) == (session.uri.host, session.uri.port)
            conns.append(session.conn if same else (await connect(u, name="upr-load")).conn)
    except BaseException:
        for c in {id(c): c for c in [session.conn, *conns]}.values():
            await c.aclose()
        raise
    owner = [i if 0 <= i < len(conns) else 0 for i in active_index(session)]
    rng = random.Random(seed)
    live: list[str] = []
    next_id = 0
    summary = LoadSummary()
    inflight: deque[asyncio.Future[Frame]] = deque()
    started = time.monotonic()

    def flush_all() -> None:
        for c in {id(c): c for c in conns}.values():
            c.flush_writes()

    def settle(reply: Frame) -> None:
        status = reply.vbucket_or_status
        if status != Status.SUCCESS:
            summary.errors += 1
            summary.error_statuses[status] = summary.error_statuses.get(status, 0) + 1

    try:
        for i in range(docs):
            r = rng.random()
            if live and r < delete_ratio:
                key = live.pop(rng.randrange(len(live)))
                kb = key.encode()
                vb = partition_of(kb, n_parts)
                conn = conns[owner[vb]]
                opaque = conn.next_opaque()
                data = Delete(key=kb, vbucket=vb, opaque=opaque).encode()
                summary.deletes += 1
            else:
                if live and r < delete_ratio + update_ratio:
                    key = live[rng.randrange(len(live))]
                    summary.updates += 1
                else:
                    key = f"{prefix}-{next_id:09d}"
                    next_id += 1
                    live.append(key)
                    summary.sets += 1
                kb = key.encode()
                vb = partition_of(kb, n_parts)
                conn = conns[owner[vb]]
                opaque = conn.next_opaque()
                data = encode_set(Opcode.SET, vb, opaque, kb, make_doc(rng, i, size),
                                  datatype=1)  # fmt: skip
            inflight.append(conn.start_raw(data, opaque, defer=True))
            summary.ops += 1
            if len(inflight) % 64 == 0:
                flush_all()
            if len(inflight) >= window:
                flush_all()
                settle(await inflight.popleft())
                while inflight and inflight[0].done():
                    settle(inflight.popleft().result())
            if rate:
                ahead = summary.ops / rate - (time.monotonic() - started)
                if ahead > 0.001:
                    flush_all()
                    await asyncio.sleep(ahead)
            if on_progress is not None and i % 2048 == 0:
                summary.seconds = time.monotonic() - started
                on_progress(summary)
        flush_all()
        while inflight:
            settle(await inflight.popleft())
        summary.seconds = time.monotonic() - started
        return summary
    finally:
        for c in {id(c): c for c in [session.conn, *conns]}.values():
            await c.aclose()
