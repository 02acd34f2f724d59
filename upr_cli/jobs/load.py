"""`upr load`: a reproducible, pipelined workload of JSON documents through the KV front end.

Each of `docs` operations creates a new document, or (by the given ratios) updates or
deletes an existing one; the same seed gives the same operations. Up to `window`
requests are in flight; each goes to its partition's active node (net/router.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from upr_cli.errors import UsageError
from upr_cli.net.bootstrap import partition_of
from upr_cli.net.router import Make, Router
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
    retries: int = 0  # requests sent again after NOT_MY_VBUCKET or a lost node
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
            "retries": self.retries,
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
    # Follow the cluster map: each write goes to its partition's active node, one
    # connection per node, retried with the newer map on NOT_MY_VBUCKET (net/router.py).
    router = await Router.open(uri, name="upr-load")
    n_parts = router.num_partitions
    if n_parts == 0:
        await router.aclose()
        raise UsageError(f"{uri.redacted()}: the cluster config lists no partitions")
    rng = random.Random(seed)
    live: list[str] = []
    next_id = 0
    summary = LoadSummary()
    inflight: deque[tuple[asyncio.Future[Frame], int, Make]] = deque()
    started = time.monotonic()

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
                make = functools.partial(_delete, vb, kb)
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
                make = functools.partial(_set, vb, kb, make_doc(rng, i, size))
            inflight.append((router.submit(vb, make), vb, make))
            summary.ops += 1
            if len(inflight) % 64 == 0:
                router.flush()
            if len(inflight) >= window:
                router.flush()
                settle(await router.settle(*inflight.popleft()))
                while inflight and inflight[0][0].done():
                    settle(await router.settle(*inflight.popleft()))
            if rate:
                ahead = summary.ops / rate - (time.monotonic() - started)
                if ahead > 0.001:
                    router.flush()
                    await asyncio.sleep(ahead)
            if on_progress is not None and i % 2048 == 0:
                summary.seconds = time.monotonic() - started
                on_progress(summary)
        router.flush()
        while inflight:
            settle(await router.settle(*inflight.popleft()))
        summary.seconds = time.monotonic() - started
        summary.retries = router.retries
        return summary
    finally:
        await router.aclose()


def _set(vb: int, key: bytes, doc: bytes, opaque: int) -> bytes:
    return encode_set(Opcode.SET, vb, opaque, key, doc, datatype=1)


def _delete(vb: int, key: bytes, opaque: int) -> bytes:
    return Delete(key=key, vbucket=vb, opaque=opaque).encode()
