"""`upr serve` keeps its memory bounded in bytes while it backfills large documents
(docs/design.md "Performance", docs/protocol.md §11): 20 documents of 5 MB of random
(barely compressible) values in 2 partitions, streamed from disk to a DCP client with
the default --memory-limit; the node's peak RSS (VmHWM) stays under 300 MB and grows by
less than 100 MB while it backfills. A backfill reads a batch bounded in bytes, not
1,000 rows of a partition at a time (which held every document of both partitions
twice: 582 MB for 40 such documents in 4 partitions)."""

from __future__ import annotations

import base64
import random
from collections.abc import Callable

from tests.e2e.conftest import Node
from tests.e2e.e2e_helpers import run, set_keys, wait_persisted
from tests.e2e.memory_helpers import vm_hwm_mb
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.net.uri import SourceUri
from upr_cli.protocol.decoder import DcpRecord

DOCS, SIZE = 20, 5 * 1024 * 1024
LIMIT_MB, GROWTH_MB = 300, 100


async def drained_bytes(uri: str) -> tuple[int, int]:
    """(records, value bytes) of a full stream of the node, nothing kept."""
    consumer = DcpConsumer(SourceUri.parse(uri), until_end=True)
    count = size = 0
    await consumer.open()
    try:
        async for batch in consumer.batches():
            for it in batch:
                if type(it) is DcpRecord:
                    count += 1
                    size += len(it.value)
            consumer.commit()
    finally:
        await consumer.aclose()
    return count, size


def test_a_backfill_of_large_documents_stays_under_300_mb(
    node_factory: Callable[..., Node],
) -> None:
    node = node_factory("--flush-interval", "0.02", partitions=2).start()
    assert node.proc is not None
    rng = random.Random(27)
    for i in range(DOCS // 10):  # ten at a time: the test process stays small too
        values = {f"big-{i}-{j}".encode(): b'{"v":"' + base64.b64encode(
            rng.randbytes(SIZE * 3 // 4)) + b'"}' for j in range(10)}  # fmt: skip
        run(set_keys(node.uri, values))
    del values
    wait_persisted(node.uri, timeout=60)
    written = vm_hwm_mb(node.proc.pid)
    count, size = run(drained_bytes(node.uri))
    assert count == DOCS and size > DOCS * SIZE
    peak = vm_hwm_mb(node.proc.pid)
    print(f"node peak RSS: {written:.0f} MB after the writes, {peak:.0f} MB after the backfill")
    assert peak < LIMIT_MB, f"the node peaked at {peak:.0f} MB backfilling {DOCS} x 5 MB"
    assert peak - written < GROWTH_MB, f"the backfill took the node from {written:.0f} MB"
