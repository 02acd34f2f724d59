"""Bounded commands through a node restarted from a crash.

A lone node holding writes it never persisted is SIGKILLed while `upr backup`, `upr tail
--until-end` or `upr replay` streams from it, and restarts at once: its restart is a new
failover entry below those writes, so the ends the command pinned at its start are
never reached there. Each command must end within seconds, exit 0, record the rollback
as after a failover, and leave its result whole (docs/protocol.md §4.5).

Kill points: the moment the command's first stream opened (its ends are pinned), plus
a delay drawn from a fixed seed, on a workload of a size drawn too. The default suite
runs one point per command, the kill sent by the thread that reads the line, and
requires that the kill lands while the command streams (on a busy machine the command
may outrun it: a fresh node and workload are tried again, up to DEFAULT_TRIES times);
`-m slow` four more each, where a command may also have finished before the kill (its
next run then rolls back, and the end state is checked the same way).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import docs, node_rows, spawn, store_rows, wait_persisted

SEED = 2026_12_06
_rng = random.Random(SEED)
# (seconds after the first stream opened, operations in the last unpersisted load)
SLOW_POINTS = [(round(_rng.uniform(0.0, 0.04), 3), _rng.choice([4000, 12000])) for _ in range(4)]
DEFAULT_POINT = (0.0, 2000)
DEFAULT_TRIES = 3
ENDS_WITHIN = 15.0  # seconds from the restart to the command's exit


def _prepare(node_factory: type[Node], where: Path) -> Node:
    """A node (its data in `where`) whose last writes, updates and deletes too, are not
    persisted."""
    node = node_factory("--flush-interval", "0.02", name=str(where / "node")).start()
    upr("load", node.uri, "--docs", "600", "--size", "500", "--seed", "1")
    wait_persisted(node.uri)
    node.stop()
    node.start("--flush-interval", "3600")  # from now on nothing is persisted
    _more(node, seed=2, ops=800)
    return node


def _more(node: Node, *, seed: int, ops: int) -> None:
    upr("load", node.uri, "--docs", str(ops), "--size", "500", "--update-ratio", "0.5",
        "--delete-ratio", "0.2", "--seed", str(seed), "--prefix", f"more{seed}")  # fmt: skip


def _crash_during(node: Node, delay: float, *args: str,
                  stdout: Path) -> tuple[int, float, str]:  # fmt: skip
    """Run `upr ARGS`; SIGKILL the node `delay` seconds after the first stream opened and
    restart it at once. Returns the exit status, the seconds from the restart to the
    exit, and stderr."""
    env = {**os.environ, "UPR_LOG": "DEBUG"}  # "stream open" lines mark the kill point
    env.pop("UPR_PASSWORD", None)
    lines: list[str] = []
    opened = threading.Event()
    cmd = (sys.executable, "-m", "upr_cli", *args)
    with stdout.open("w") as out, spawn(*cmd, stdout=out, stderr=subprocess.PIPE, text=True,
                                        env=env) as proc:  # fmt: skip

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                if "stream open from" in line and not opened.is_set():
                    if delay == 0:
                        node.kill()  # at once, from this thread: the command streams on
                    opened.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert opened.wait(60), "".join(lines)[-3000:]
        if delay > 0:
            time.sleep(delay)
            node.kill()
        node.start()
        restarted = time.monotonic()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after the restart: {''.join(lines)[-3000:]}")
        took = time.monotonic() - restarted
        reader.join(timeout=10)
    err = "".join(lines)
    if "lost (" in err:  # the link was lost mid-stream: it says so, and that it came back
        assert "back after" in err, err[-3000:]
    return code, took, err


def _rerun_through_a_crash(node: Node, tmp_path: Path, point: tuple[float, int],
                          *args: str) -> tuple[str, str, str]:  # fmt: skip
    """Run `upr ARGS` (what it keeps then holds the node's unpersisted writes), write
    more, and run it again through a crash at `point`: it must exit 0 within ENDS_WITHIN
    of the restart. Returns the first run's stdout, the second's, and the second's
    stderr."""
    first = upr(*args).stdout
    _more(node, seed=3, ops=point[1])
    code, took, err = _crash_during(node, point[0], *args, stdout=tmp_path / "out")
    assert code == 0, err[-3000:]
    assert took < ENDS_WITHIN, took
    return first, (tmp_path / "out").read_text(), err


def _mid_stream(err: str) -> bool:
    """Whether the kill landed while the command streamed (its link lost)."""
    return " lost (" in err


def _backup_through_a_crash(node_factory: type[Node], tmp_path: Path,
                            point: tuple[float, int]) -> bool:  # fmt: skip
    node = _prepare(node_factory, tmp_path)
    repo = tmp_path / "repo"
    backup = ("backup", node.uri, "--repo", str(repo), "--no-progress", "--json")
    _, out, err = _rerun_through_a_crash(node, tmp_path, point, *backup)
    summary = json.loads(out)
    rolled = {rb["partition"] for rb in summary["rollbacks"]}
    again = json.loads(upr(*backup).stdout)  # the lock went with the run: the next one runs
    if mid := _mid_stream(err):
        # the first backup holds writes the crash took back: every partition rolled back
        # in the run (or its follow-up), and the next one has nothing to roll back
        assert rolled == set(range(node.partitions)), summary
        assert again["rollbacks"] == []
    rolled |= {rb["partition"] for rb in again["rollbacks"]}
    assert rolled == set(range(node.partitions))
    db = tmp_path / "restored.db"  # restore checks the chain before it writes
    upr("restore", "--repo", str(repo), f"sqlite:{db}")
    assert store_rows(db) == node_rows(node.uri)
    return mid


def _tail_state(*outputs: str) -> dict[str, Any]:
    """The documents tail outputs leave, read in order: changes per partition, each
    rollback undoing those above its `to_seq`."""
    history: dict[int, list[dict[str, Any]]] = {}
    for text in outputs:
        for row in map(json.loads, text.splitlines()):
            p = row["partition"]
            if row.get("event") == "rollback":
                history[p] = [c for c in history.get(p, []) if int(c["seq"]) <= int(row["to_seq"])]
            elif "event" not in row:  # a change (events also have an op)
                history.setdefault(p, []).append(row)
    out: dict[str, Any] = {}
    for changes in history.values():
        for c in sorted(changes, key=lambda c: int(c["seq"])):
            if c["op"] == "mutation":
                out[c["key"]] = c["value"]
            else:
                out.pop(c["key"], None)
    return out


def _tail_through_a_crash(node_factory: type[Node], tmp_path: Path,
                          point: tuple[float, int]) -> bool:  # fmt: skip
    node = _prepare(node_factory, tmp_path)
    state = tmp_path / "tail.json"
    tail = ("tail", node.uri, "--until-end", "--format", "json", "-v", "--state", str(state))
    first, crashed, err = _rerun_through_a_crash(node, tmp_path, point, *tail)
    if mid := _mid_stream(err):
        rows = [json.loads(line) for line in crashed.splitlines()]
        assert any(row.get("event") == "rollback" for row in rows)  # the rollbacks show
    # a resume rolls back the partitions whose streams had ended before the crash: what
    # the three runs printed is the node's state, nothing lost
    resumed = upr(*tail).stdout
    truth = {key.decode(): json.loads(doc[0]) for key, doc in docs(node.uri).items()}
    assert _tail_state(first, crashed, resumed) == truth
    return mid


def _replay_through_a_crash(node_factory: type[Node], tmp_path: Path,
                            point: tuple[float, int]) -> bool:  # fmt: skip
    node = _prepare(node_factory, tmp_path)
    db = tmp_path / "r.db"
    replay = ("replay", node.uri, "--into", str(db), "--no-progress", "--json")
    _, out, err = _rerun_through_a_crash(node, tmp_path, point, *replay)
    stats = json.loads(out)
    if mid := _mid_stream(err):
        assert stats["rollbacks"] and "rolled back from seq" in err  # undone, and printed
    # a rerun rolls back the partitions whose streams had ended before the crash
    upr(*replay)
    assert store_rows(db) == node_rows(node.uri)
    return mid


CASES: dict[str, Any] = {
    "backup": _backup_through_a_crash,
    "tail": _tail_through_a_crash,
    "replay": _replay_through_a_crash,
}


@pytest.mark.parametrize("command", sorted(CASES))
def test_a_bounded_command_ends_after_its_node_restarts_from_a_crash(
    node_factory: type[Node], tmp_path: Path, command: str
) -> None:
    for attempt in range(DEFAULT_TRIES):
        where = tmp_path / f"try{attempt}"
        where.mkdir()
        if CASES[command](node_factory, where, DEFAULT_POINT):
            return  # the kill landed mid-stream: the case checked what it is for
    pytest.fail(f"the command ended before the kill in each of {DEFAULT_TRIES} tries")


@pytest.mark.slow
@pytest.mark.parametrize("point", SLOW_POINTS, ids=lambda p: f"{p[0]}s-{p[1]}ops")
@pytest.mark.parametrize("command", sorted(CASES))
def test_a_bounded_command_ends_after_a_crash_at_any_point(
    node_factory: type[Node], tmp_path: Path, command: str, point: tuple[float, int]
) -> None:
    CASES[command](node_factory, tmp_path, point)
