"""Flow control with a small window: the consumer acknowledges what it consumed, the
node never has more than a window (plus the message that crossed it) unacknowledged,
and a stream many windows long completes (docs/protocol.md §7.1; the UPR
design specification, "Flow Control"). In-process node, tests/dcp/inprocess.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dcp.inprocess import InProcessNode, Received, consume_until, nodes, run
from upr_cli.dcp.consumer import DcpConsumer
from upr_cli.node.producer import DcpSender

WINDOW = 4096
DOCS = 300  # about 270 bytes a message: some 20 windows


def test_a_small_window_is_acknowledged_and_never_overrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    peaks: list[tuple[int, int, int]] = []  # (window, outstanding, bytes of the write)
    acks: list[int] = []
    write, ack = DcpSender._send_locked, DcpSender.ack  # every counted send goes through it

    async def observed_send(self: DcpSender, msgs: list[bytes]) -> None:
        await write(self, msgs)
        peaks.append((self.window, self.outstanding, max(map(len, msgs), default=0)))

    def observed_ack(self: DcpSender, nbytes: int) -> None:
        if nbytes:
            acks.append(nbytes)
        ack(self, nbytes)

    monkeypatch.setattr(DcpSender, "_send_locked", observed_send)
    monkeypatch.setattr(DcpSender, "ack", observed_ack)

    async def scenario() -> Received:
        async with nodes(InProcessNode(tmp_path / "n", partitions=2)) as (node,):
            for vb in range(2):
                node.write(vb, DOCS // 2, pad=200)
            got = Received()
            # plain values: compressed, the padded documents would fill too few windows
            async with DcpConsumer(node.uri, until_end=True, buffer_size=WINDOW,
                                   noop_interval=0.5, compression="off") as consumer:  # fmt: skip
                await consume_until(consumer, got, lambda g: consumer.finished)
            return got

    got = run(scenario())
    assert sorted(got.seqs(0)) == sorted(got.seqs(1)) == list(range(1, DOCS // 2 + 1))
    sent = sum(len(r.key) + len(r.value) for r in got.records)
    assert sent > 10 * WINDOW  # the stream was many windows long
    assert len(acks) >= 10 and all(n > 0 for n in acks)
    assert {w for w, _o, _m in peaks} == {WINDOW}
    # a send stops once the window is full: at most the last message over it
    assert all(out < WINDOW + biggest for _w, out, biggest in peaks)
