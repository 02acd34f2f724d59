"""`upr serve`'s KV front end and Snappy (formats/wire.md "Snappy", point 3): a client that
negotiated Snappy may write compressed values, which are stored as they came; one that
did not is refused EINVAL; a corrupt value is EINVAL naming the key; GET answers
inflated. Needs the HELLO grant and datatype check in `upr_cli/node/server.py`."""

from __future__ import annotations

from pathlib import Path

from tests.dcp.inprocess import InProcessNode, nodes, run
from upr_cli.net.bootstrap import WANTED, connect
from upr_cli.protocol import Feature, snappy
from upr_cli.protocol.messages import Get, GetResponse, Set
from upr_cli.protocol.status import Status

DOC = b'{"name":"compressible","pad":"' + b"cd" * 300 + b'"}'
JSON, SNAPPY = 0x01, 0x02


def test_compressed_writes_need_snappy_and_reads_come_back_inflated(tmp_path: Path) -> None:
    node = InProcessNode(tmp_path, partitions=1)

    async def scenario() -> None:
        async with nodes(node):
            with_snappy = await connect(node.uri, features=(*WANTED, Feature.SNAPPY))
            without = await connect(node.uri)
            try:
                assert Feature.SNAPPY in with_snappy.features
                assert Feature.SNAPPY not in without.features
                packed = snappy.deflate(DOC)
                for session, key, want in ((with_snappy, b"\x00ok", Status.SUCCESS),
                                           (without, b"\x00refused", Status.EINVAL)):  # fmt: skip
                    conn = session.conn
                    msg = Set(key=key, value=packed, datatype=SNAPPY | JSON,
                              opaque=conn.next_opaque())  # fmt: skip
                    assert (await conn.request(msg, check=False)).status == want, key
                conn = with_snappy.conn
                bad = await conn.request(Set(key=b"\x00bad", value=packed[:-9], datatype=SNAPPY,
                                             opaque=conn.next_opaque()), check=False)  # fmt: skip
                assert bad.status == Status.EINVAL
                assert b"bad" in bytes(getattr(bad, "value", b""))
                stored = node.bucket.lookup(0, b"\x00ok")
                assert stored is not None and (stored.datatype, stored.value) == (3, packed)
                for session in (with_snappy, without):
                    got = await session.conn.request(
                        Get(key=b"\x00ok", opaque=session.conn.next_opaque())
                    )
                    assert isinstance(got, GetResponse)
                    assert (got.datatype, bytes(got.value)) == (JSON, DOC)
            finally:
                await with_snappy.conn.aclose()
                await without.conn.aclose()

    run(scenario())
