"""A backup's segment writer takes a run of records column by column (the fast path) or
record by record (xattrs, a block filling inside the run): both write the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from upr_cli.failover import FailoverLog
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord
from upr_cli.segments import SegmentHeader, SegmentWriter

BLOB = xattrs.encode({"_sync": b'{"rev":1}'})


def _write(path: Path, rows: list[DcpRecord], cuts: list[int]) -> bytes:
    header = SegmentHeader("default", 3, FailoverLog.of([(7, 0)]), 0, len(rows), (),
                           "2026-12-06T00:00:00.000000Z", "upr://h/default", 512)  # fmt: skip
    w = SegmentWriter(path.with_suffix(".open"), header)
    at = 0
    for n in [*cuts, len(rows)]:
        w.add(rows[at : at + n])
        at += n
    w.finish(path=path, sync=False)
    return path.read_bytes()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=20), st.binary(max_size=120),
                          st.booleans(), st.booleans()), min_size=1, max_size=60),
       st.lists(st.integers(0, 9), max_size=8))  # fmt: skip
def test_runs_and_records_write_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docs: list[tuple[bytes, bytes, bool, bool]],
    cuts: list[int],
) -> None:  # fmt: skip
    rows = [DcpRecord(OP_DELETION if gone else OP_MUTATION, 3, seq, seq, seq * 3, 0, 0, 0, 1,
                      memoryview(key), memoryview(value), 0, 0, BLOB if blob else b"")
            for seq, (key, value, gone, blob) in enumerate(docs, 1)]  # fmt: skip
    fast = _write(tmp_path / f"a{len(rows)}-{len(cuts)}", rows, cuts)
    with monkeypatch.context() as m:
        m.setattr(SegmentWriter, "_add_run", lambda self, rows: False)  # record by record
        slow = _write(tmp_path / f"b{len(rows)}-{len(cuts)}", rows, cuts)
    assert fast == slow
