"""The node's write queue is bounded in bytes (docs/protocol.md §11): with
--memory-limit 16MB its half, 8 MiB, may wait for the flusher; a data write that would
pass it is answered ETMPFAIL (0x86), as kv_engine answers a write it has no memory for,
until a flush makes room. A document larger than the bound goes in alone, when the
queue is empty. The flusher is held off by a flush interval longer than the test."""

from __future__ import annotations

from pathlib import Path

from tests.dcp.inprocess import InProcessNode, nodes, run
from upr_cli.memory import MIB, MemoryLimit
from upr_cli.net.bootstrap import connect
from upr_cli.protocol.messages import Delete, Set, SetWithMeta
from upr_cli.protocol.status import Status

DOC = b'"' + b"x" * (MIB - 2) + b'"'  # 1 MiB of JSON


def _node(tmp_path: Path) -> InProcessNode:
    node = InProcessNode(tmp_path, partitions=1, flush_interval=3600)
    node.config.memory_limit = MemoryLimit(16 * MIB)  # a write queue of 8 MiB
    return node


def test_a_full_write_queue_answers_etmpfail_until_a_flush(tmp_path: Path) -> None:
    node = _node(tmp_path)

    async def scenario() -> None:
        async with nodes(node):
            session = await connect(node.uri)
            conn = session.conn
            try:

                async def status(msg: Set | Delete | SetWithMeta) -> int:
                    return (await conn.request(msg, check=False)).status

                got = [await status(Set(key=b"\x00k%d" % i, value=DOC, opaque=conn.next_opaque()))
                       for i in range(9)]  # fmt: skip
                assert got == [Status.SUCCESS] * 7 + [Status.ETMPFAIL] * 2  # 7 MiB + keys held
                assert node.bucket.lookup(0, b"\x00k7") is None  # refused: not stored
                meta = SetWithMeta(key=b"\x00m", value=DOC, rev_seqno=1, item_cas=1,
                                   opaque=conn.next_opaque())  # fmt: skip
                assert await status(meta) == Status.ETMPFAIL  # a with-meta write too
                # the bound is in bytes: what still fits goes in
                assert await status(Delete(key=b"\x00k0", opaque=conn.next_opaque())) == 0
                small = Set(key=b"\x00s", value=b"1", opaque=conn.next_opaque())
                assert await status(small) == Status.SUCCESS
                await node.bucket.flush()  # room again
                assert await status(Set(key=b"\x00k7", value=DOC, opaque=conn.next_opaque())) == 0
            finally:
                await conn.aclose()

    run(scenario(), timeout=10)


def test_a_document_larger_than_the_bound_goes_in_alone(tmp_path: Path) -> None:
    node = _node(tmp_path)
    big = b'"' + b"y" * (9 * MIB) + b'"'  # more than the whole write queue

    async def scenario() -> None:
        async with nodes(node):
            session = await connect(node.uri)
            conn = session.conn
            try:
                ok = await conn.request(Set(key=b"\x00big", value=big, opaque=conn.next_opaque()),
                                        check=False)  # fmt: skip
                assert ok.status == Status.SUCCESS  # the queue was empty
                small = await conn.request(Set(key=b"\x00s", value=b"1", opaque=conn.next_opaque()),
                                           check=False)  # fmt: skip
                assert small.status == Status.ETMPFAIL  # not beside it
                await node.bucket.flush()
                stored = node.bucket.lookup(0, b"\x00big")
                assert stored is not None and stored.value == big
            finally:
                await conn.aclose()

    run(scenario(), timeout=10)
