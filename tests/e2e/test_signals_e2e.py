"""SIGINT and SIGTERM end every command by one rule (README "Errors and exit codes").

A bounded command keeps what it committed, says so in one line on stderr and exits 130
(SIGINT) or 143 (SIGTERM); a follower saves its position, says so in one line and exits
0. Each command is held (SIGSTOP) as soon as it shows it is at work (a backup's first
finished segment, a restore's first segment file open, a tail's first change), so the
signal lands in the middle of the run however fast the machine is; then it is signalled
and let go (SIGCONT).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import (
    node_content_hash,
    run,
    seqnos,
    set_keys,
    spawn_upr,
    wait_persisted,
)
from upr_cli.net.bootstrap import partition_of
from upr_cli.store import Store

PARTITIONS = 16


def _workload() -> dict[bytes, bytes]:
    """Partition 0 holds most of the bytes (600 documents of 2 kB), the others a dozen
    small ones each: their streams end first, so a backup holds finished segments while
    partition 0 still streams."""
    docs: dict[bytes, bytes] = {}
    count = [0] * PARTITIONS
    i = 0
    while count[0] < 600 or min(count[1:]) < 12:
        key = b"doc-%d" % i
        p = partition_of(key, PARTITIONS)
        if p == 0 and count[0] < 600:
            docs[key] = b'{"n":%d,"pad":"%s"}' % (i, os.urandom(1000).hex().encode())
            count[0] += 1
        elif p and count[p] < 12:
            docs[key] = b'{"n":%d}' % i
            count[p] += 1
        i += 1
    return docs


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """One node with `_workload` persisted, for every test of the module."""
    node = Node(tmp_path_factory.mktemp("signals") / "node", "--flush-interval", "0.02",
                partitions=PARTITIONS)  # fmt: skip
    try:
        node.start()
        run(set_keys(node.uri, _workload()))
        wait_persisted(node.uri)
        yield node
    finally:
        node.close()


def _hold(proc: subprocess.Popen[Any], at_work: Callable[[], bool]) -> None:
    """Stop `proc` (SIGSTOP) as soon as `at_work()` says it is in the middle of its run."""
    deadline = time.monotonic() + 60
    while not at_work():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the command ended ({proc.returncode}) before it could be held")
        time.sleep(0.001)
    proc.send_signal(signal.SIGSTOP)


def _signal_held(proc: subprocess.Popen[str], sig: signal.Signals) -> tuple[str, str]:
    """Send `sig` to the held `proc`, let it go on and wait for its end: (stdout, stderr)."""
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    return proc.communicate(timeout=60)


def _reading_segments(pid: int) -> bool:
    """True once process `pid` has a segment file open."""
    try:
        fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:  # an fd closed between the listing and the link
        return False
    return any(path.endswith(".seg") for path in fds)


@pytest.mark.parametrize(("sig", "code"), [
    pytest.param(signal.SIGTERM, 143, id="SIGTERM"), pytest.param(signal.SIGINT, 130, id="SIGINT")
])  # fmt: skip
def test_a_signalled_backup_releases_its_lock_keeps_its_segments_and_resumes(
    source: Node, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    repo = tmp_path / "repo"
    with spawn_upr("backup", source.uri, "--repo", str(repo), "--no-progress") as proc:
        _hold(proc, lambda: any(repo.glob("default/*/p*.seg")))
        if any(repo.glob("default/*/manifest.json*")):
            pytest.fail("the backup was held after its commit")
        _out, err = _signal_held(proc, sig)
    assert proc.returncode == code, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"upr: error: interrupted by {sig.name}: the repository keeps "
                               "its committed backups and the segments of ")  # fmt: skip
    assert lines[0].endswith("; run the same command to resume")
    found = re.search(r"segments of (\d+) of 16 partitions", lines[0])
    assert found is not None and 1 <= int(found[1]) < PARTITIONS, lines[0]
    assert not (repo / "default" / "lock").exists()  # released, not left for a takeover
    assert not any(repo.glob("default/*/manifest.json*"))  # nothing reads as a backup
    rerun = upr("backup", source.uri, "--repo", str(repo), "--json")
    assert "stale lock" not in rerun.stderr
    assert json.loads(rerun.stdout)["reused_segments"] == int(found[1])
    assert upr("verify", "--repo", str(repo)).stdout.rstrip().endswith(": ok")


def test_a_restore_stopped_by_sigterm_exits_143_and_its_rerun_completes_it(
    source: Node, tmp_path: Path
) -> None:
    repo, db = tmp_path / "repo", tmp_path / "restored.db"
    upr("backup", source.uri, "--repo", str(repo))
    want = node_content_hash(source.uri)
    with spawn_upr("restore", "--repo", str(repo), f"sqlite:{db}", "--no-progress") as proc:
        _hold(proc, lambda: _reading_segments(proc.pid))
        _out, err = _signal_held(proc, signal.SIGTERM)
    assert proc.returncode == 143, err
    assert err.splitlines() == [
        "upr: error: interrupted by SIGTERM: the target keeps what was written (a restore "
        "writes the same versions again); run the same command to complete it"
    ]
    upr("restore", "--repo", str(repo), f"sqlite:{db}")
    with Store(db) as s:
        assert (s.count(), s.content_hash()) == want


def test_a_following_tail_saves_its_position_on_sigterm_exits_0_and_a_rerun_goes_on(
    source: Node, tmp_path: Path
) -> None:
    state = tmp_path / "tail.json"
    args = ("tail", source.uri, "--format", "json", "--partitions", "1-15", "--state", str(state))
    # unbuffered: each change reaches the pipe as the tail prints it
    with spawn_upr(*args, env=os.environ | {"PYTHONUNBUFFERED": "1"}) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()  # streaming: its first change is out
        proc.send_signal(signal.SIGTERM)
        # read through the pipe objects: their buffers hold what followed the first line
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.wait(timeout=60)
    assert proc.returncode == 0, err
    assert err.splitlines() == [
        f"upr: stopped by SIGTERM: positions saved in {state}; the same command continues "
        "from there"
    ]
    later = {k: b'{"later":true}' for k in (b"later-%d" % i for i in range(60))
             if partition_of(k, PARTITIONS)}  # fmt: skip
    run(set_keys(source.uri, later))
    again = upr(*args, "--until-end").stdout.splitlines()
    # the rerun goes on where the first run stopped: every change once, none missed
    changes = [json.loads(line) for line in [first, *out.splitlines(), *again]]
    assert first and len(changes) > len(again)
    seen = sorted((c["partition"], int(c["seq"])) for c in changes)
    highs = run(seqnos(source.uri))
    assert seen == [(p, s) for p in range(1, PARTITIONS) for s in range(1, highs[p][1] + 1)]
    assert {c["key"] for c in changes} >= {k.decode() for k in later}
