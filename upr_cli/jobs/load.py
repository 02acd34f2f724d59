"""`upr load`: a reproducible, pipelined workload of JSON documents through the KV front end.

Each of `docs` operations creates a new document, or (by the given ratios) updates or
deletes an existing one; the same seed gives the same operations. Up to `window`
requests are in flight; each goes to its partition's active node (net/router.py).

A new document is written with ADD, so a key an earlier run left in the bucket is
noticed (KEY_EEXISTS): it is counted as overwritten and written again with SET, unless
a later operation of this run already updated or deleted it (that one, sent after the
ADD on the same connection, is then the key's newest write and must stay so).
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


#: a new document's (key, value), while its ADD is in flight
Added = tuple[bytes, bytes] | None


@dataclass
class LoadSummary:
    """What a load run did."""

    ops: int = 0
    sets: int = 0  # new documents of this run
    updates: int = 0
    deletes: int = 0
    overwritten: int = 0  # new documents whose key an earlier run had left in the bucket
    errors: int = 0
    seconds: float = 0.0
    retries: int = 0  # requests sent again after NOT_MY_VBUCKET or a lost node
    error_statuses: dict[int, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Operations per second."""
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """A JSON object for --json (docs/output.md: `items` the operations)."""
        return {
            "items": self.ops,
            "created": self.sets,
            "updates": self.updates,
            "deletes": self.deletes,
            "overwritten": self.overwritten,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
            "items_per_s": round(self.rate),
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
    ops = _Operations(random.Random(seed), n_parts, size, update_ratio, delete_ratio, prefix)
    summary = LoadSummary()
    inflight: deque[tuple[asyncio.Future[Frame], int, Make, Added]] = deque()
    # keys whose ADD is in flight -> whether a later operation of this run has used them
    adding: dict[bytes, bool] = {}
    started = time.monotonic()

    def settle(reply: Frame, vb: int, added: Added) -> None:
        status = reply.vbucket_or_status
        superseded = adding.pop(added[0], False) if added is not None else False
        if status == Status.KEY_EEXISTS and added is not None:
            summary.overwritten += 1
            if not superseded:  # write it as planned, after the ADD on the same connection
                again = functools.partial(_set, Opcode.SET, vb, *added)
                inflight.append((router.submit(vb, again), vb, again, None))
        elif status != Status.SUCCESS:
            summary.errors += 1
            summary.error_statuses[status] = summary.error_statuses.get(status, 0) + 1

    async def settle_oldest() -> None:
        fut, vb, make, added = inflight.popleft()
        settle(await router.settle(fut, vb, make), vb, added)

    try:
        for i in range(docs):
            kb, vb, make, added = ops.next(i, summary)
            if kb in adding:
                adding[kb] = True
            if added is not None:
                adding[kb] = False
            inflight.append((router.submit(vb, make), vb, make, added))
            summary.ops += 1
            if len(inflight) % 64 == 0:
                router.flush()
            if len(inflight) >= window:
                router.flush()
                await settle_oldest()
                while inflight and inflight[0][0].done():
                    await settle_oldest()
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
            router.flush()
            await settle_oldest()
        summary.seconds = time.monotonic() - started
        summary.retries = router.retries
        return summary
    finally:
        await router.aclose()


class _Operations:
    """The workload's operations, one at a time, from the seeded generator: a delete or
    an update of a key this run created (by the ratios), else a new key."""

    def __init__(self, rng: random.Random, n_parts: int, size: int, update_ratio: float,
                 delete_ratio: float, prefix: str) -> None:  # fmt: skip
        self.rng, self.n_parts, self.size, self.prefix = rng, n_parts, size, prefix
        self.update_ratio, self.delete_ratio = update_ratio, delete_ratio
        self.live: list[str] = []
        self.next_id = 0

    def next(self, i: int, summary: LoadSummary) -> tuple[bytes, int, Make, Added]:
        """Operation `i`: its key, partition, request and (a new document) what it adds."""
        rng, live = self.rng, self.live
        r = rng.random()
        if live and r < self.delete_ratio:
            kb = live.pop(rng.randrange(len(live))).encode()
            vb = partition_of(kb, self.n_parts)
            summary.deletes += 1
            return kb, vb, functools.partial(_delete, vb, kb), None
        op = Opcode.SET
        if live and r < self.delete_ratio + self.update_ratio:
            key = live[rng.randrange(len(live))]
            summary.updates += 1
        else:
            key = f"{self.prefix}-{self.next_id:09d}"
            self.next_id += 1
            live.append(key)
            summary.sets += 1
            op = Opcode.ADD
        kb = key.encode()
        vb = partition_of(kb, self.n_parts)
        doc = make_doc(rng, i, self.size)
        added = (kb, doc) if op == Opcode.ADD else None
        return kb, vb, functools.partial(_set, op, vb, kb, doc), added


def _set(opcode: int, vb: int, key: bytes, doc: bytes, opaque: int) -> bytes:
    return encode_set(opcode, vb, opaque, key, doc, datatype=1)


def _delete(vb: int, key: bytes, opaque: int) -> bytes:
    return Delete(key=key, vbucket=vb, opaque=opaque).encode()
