"""The lock holder record (upr_cli/lockholder.py) that the repository's and the node's
locks both write: exact bytes, both forms of `started`, malformed content refused."""

from __future__ import annotations

import os
import socket

import pytest

from upr_cli.lockholder import LockHolder


@pytest.mark.parametrize(
    "started",
    ["2026-11-21T06:15:00.123456Z",  # the repository's lock (formats/repository.md §2.5)
     "2026-11-21T06:15:00Z"],  # the node's data directory lock
)  # fmt: skip
def test_round_trip_with_the_exact_bytes(started: str) -> None:
    holder = LockHolder(42, "h.example", started)
    data = holder.to_bytes()
    assert data == f'{{"pid": 42, "hostname": "h.example", "started": "{started}"}}\n'.encode()
    assert LockHolder.from_bytes(data) == holder
    assert holder.describe() == f"pid 42 on host h.example since {started}"


def test_me_is_this_process_on_this_host() -> None:
    me = LockHolder.me("2026-11-21T06:15:00Z")
    assert (me.pid, me.hostname) == (os.getpid(), socket.gethostname())


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"[]", b"\xff", b'{"pid": 5, "hostname": "h"}',
     b'{"pid": 0, "hostname": "h", "started": "2026-11-21T06:15:00Z"}',
     b'{"pid": true, "hostname": "h", "started": "2026-11-21T06:15:00Z"}',
     b'{"pid": "5", "hostname": "h", "started": "2026-11-21T06:15:00Z"}',
     b'{"pid": 5, "hostname": "", "started": "2026-11-21T06:15:00Z"}',
     b'{"pid": 5, "hostname": "h", "started": "now"}',
     b'{"pid": 5, "hostname": "h", "started": "2026-11-21T06:15:00+01:00"}',
     b'{"pid": 5, "hostname": "h", "started": "2026-11-21T06:15:00.123Z"}',
     b'{"pid": 5, "hostname": "h", "started": "2026-13-21T06:15:00Z"}'],
)  # fmt: skip
def test_malformed_content_is_none(content: bytes) -> None:
    assert LockHolder.from_bytes(content) is None
