"""`--wire-compression` against an in-process node (formats/wire.md "Snappy"): "auto"
negotiates Snappy but never forces it, so a document stored plain travels plain and is
handed over without a per-record unpack; "force" asks the node to compress every value;
"off" does not negotiate Snappy."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

from tests.dcp.inprocess import InProcessNode, Received, consume_until, nodes, run
from upr_cli.dcp import streams as consumer_module
from upr_cli.dcp.consumer import DcpConsumer, Item, WireCompression
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import snappy
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.protocol.header import Feature

COUNT = 20


def _drain(
    tmp_path: Path, mode: WireCompression, monkeypatch: pytest.MonkeyPatch
) -> tuple[Received, list[int], tuple[bool, bool, bool]]:
    """Drain COUNT plain documents with `mode`: what arrived, the datatype of each record
    that took the unpack path, and the node's view of the link (Snappy granted, a DCP
    producer with Snappy, forced compression)."""
    unpacked: list[int] = []
    plain = consumer_module.plain_records

    def spy(out: list[Item], where: list[int]) -> None:
        unpacked.extend(cast(DcpRecord, out[i]).datatype for i in where)
        plain(out, where)

    monkeypatch.setattr(consumer_module, "plain_records", spy)

    async def scenario() -> tuple[Received, tuple[bool, bool, bool]]:
        async with nodes(InProcessNode(tmp_path, partitions=1)) as (node,):
            node.write(0, COUNT, pad=200)  # compressible: forced, each would go compressed
            got = Received()
            async with DcpConsumer(node.uri, partitions=[0], until_end=True,
                                   compression=mode) as consumer:  # fmt: skip
                await consume_until(consumer, got, lambda g: len(g.records) == COUNT)
                assert node.server is not None
                (session,) = [s for s in node.server.sessions if s.dcp is not None]
                assert session.dcp is not None
                seen = (Feature.SNAPPY in session.features, session.dcp.snappy,
                        session.dcp.force_compression)  # fmt: skip
            return got, seen

    got, seen = run(scenario())
    return got, unpacked, seen


def _values_intact(got: Received) -> None:
    assert len(got.records) == COUNT
    assert all(r.datatype == 1 and r.value.startswith(b'{"i":') for r in got.records)


def test_auto_negotiates_snappy_without_forcing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got, unpacked, seen = _drain(tmp_path, "auto", monkeypatch)
    assert seen == (True, True, False)  # granted, never forced
    assert unpacked == []  # stored plain, arrived without Snappy: the fast path
    _values_intact(got)


def test_force_asks_for_every_value_compressed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got, unpacked, seen = _drain(tmp_path, "force", monkeypatch)
    assert seen == (True, True, True)
    assert len(unpacked) == COUNT and all(dt & snappy.SNAPPY for dt in unpacked)
    _values_intact(got)


def test_off_negotiates_no_snappy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got, unpacked, seen = _drain(tmp_path, "off", monkeypatch)
    assert seen == (False, False, False)
    assert unpacked == []
    _values_intact(got)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="compression 'fast'"):
        DcpConsumer(SourceUri.parse("upr://127.0.0.1/default"), compression="fast")  # type: ignore[arg-type]
