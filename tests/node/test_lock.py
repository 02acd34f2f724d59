"""The data directory lock (upr_cli/node/lock.py): the flock alone decides who holds a
directory; the lock file's content only names the holder."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from upr_cli.node.lock import LOCK_FILE, DataDirLock, DataDirLocked


def test_a_second_lock_on_one_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first, second = DataDirLock(tmp_path), DataDirLock(tmp_path)
    me = first.acquire()
    try:
        # flock locks belong to open files: a second open file is refused, in this
        # process too
        with pytest.raises(DataDirLocked) as refused:
            second.acquire()
        assert refused.value.pid == os.getpid()
        assert refused.value.hostname == socket.gethostname()
        assert str(refused.value) == (
            f"{tmp_path}: data directory is locked by pid {os.getpid()} on host "
            f"{socket.gethostname()} since {me.started}"
        )
        assert not second.held
    finally:
        first.release()
    second.acquire()  # released: free again
    second.release()


@pytest.mark.parametrize(
    "content",
    [
        {"pid": 2**22 + 12345, "hostname": socket.gethostname(), "started": "2026-01-01T00:00:00Z"},
        {"pid": 1, "hostname": "another-host.example", "started": "2026-01-01T00:00:00Z"},
        None,  # unreadable
    ],
)
def test_a_lock_file_nobody_holds_never_blocks(tmp_path: Path, content: object) -> None:
    path = tmp_path / LOCK_FILE
    path.write_text("{not json" if content is None else json.dumps(content))
    lock = DataDirLock(tmp_path)
    me = lock.acquire()
    try:
        assert json.loads(path.read_text()) == {
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "started": me.started,
        }
    finally:
        lock.release()
    assert path.exists()  # kept: see the module docstring
