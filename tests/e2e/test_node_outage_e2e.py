"""Followers wait for a lone node that is down: `upr tail` and `upr replay
--follow` reconnect under one policy for up to --wait seconds, say when the link is
lost and when it is back, and catch up without losing a change (docs/protocol.md §4.5).

The node stays down for 7 s, longer than the five reconnect attempts followers used to
give up after (3 to 6 s); the slow variant keeps it down for 20 s, stopped or killed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import docs, node_rows, spawn, store_rows, wait_persisted


def _drain(pipe: object, out: list[str]) -> threading.Thread:
    def read() -> None:
        for line in pipe:  # type: ignore[attr-defined]
            out.append(line)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def _wait(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.05)


def _tail_state(lines: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for row in map(json.loads, lines):
        if row.get("op") == "mutation":
            out[row["key"]] = row["value"]
        elif "event" not in row:  # a deletion or expiration
            out.pop(row["key"], None)
    return out


def _followers_through_an_outage(node_factory: type[Node], tmp_path: Path, down: float,
                                 how: str) -> None:  # fmt: skip
    node = node_factory("--flush-interval", "0.02").start()
    upr("load", node.uri, "--docs", "300", "--update-ratio", "0.3", "--delete-ratio", "0.1",
        "--seed", "1")  # fmt: skip
    wait_persisted(node.uri)  # a kill then takes nothing back: no rollback to follow
    db = tmp_path / "r.db"
    with ExitStack() as stack:
        run = [sys.executable, "-m", "upr_cli"]
        tail = stack.enter_context(spawn(*run, "tail", node.uri, "--format", "json",
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True))  # fmt: skip
        replay = stack.enter_context(spawn(*run, "replay", node.uri, "--into", str(db),
                                           "--follow", "--no-progress", stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True))  # fmt: skip
        out: list[str] = []
        tail_err: list[str] = []
        replay_err: list[str] = []
        readers = [_drain(tail.stdout, out), _drain(tail.stderr, tail_err),
                   _drain(replay.stderr, replay_err)]  # fmt: skip
        truth = {k.decode(): json.loads(v[0]) for k, v in docs(node.uri).items()}
        _wait(lambda: _tail_state(out) == truth, 60, "tail caught up")
        _wait(lambda: db.exists() and store_rows(db) == node_rows(node.uri), 60,
              "replay caught up")  # fmt: skip
        if how == "stop":
            node.stop()
        else:
            node.kill()
        time.sleep(down)
        assert tail.poll() is None, "".join(tail_err)  # still waiting for the node
        assert replay.poll() is None, "".join(replay_err)
        node.start()
        upr("load", node.uri, "--docs", "400", "--update-ratio", "0.4", "--delete-ratio", "0.2",
            "--seed", "2", "--prefix", "after")  # fmt: skip
        wait_persisted(node.uri)
        truth = {k.decode(): json.loads(v[0]) for k, v in docs(node.uri).items()}
        assert any(k.startswith("after") for k in truth)
        _wait(lambda: _tail_state(out) == truth, 60, "tail caught up after the restart")
        _wait(lambda: store_rows(db) == node_rows(node.uri), 60,
              "replay caught up after the restart")  # fmt: skip
        for proc in (tail, replay):
            proc.send_signal(signal.SIGINT)
        for proc in (tail, replay):
            proc.wait(timeout=60)
        for r in readers:
            r.join(timeout=10)
    assert store_rows(db) == node_rows(node.uri)
    for err in ("".join(tail_err), "".join(replay_err)):
        assert "upr: connection to 127.0.0.1:" in err and " lost (" in err, err
        assert "reconnecting for up to 120s" in err, err
        assert " back after " in err, err


def test_followers_wait_for_a_node_down_beyond_the_old_five_seconds(
    node_factory: type[Node], tmp_path: Path
) -> None:
    _followers_through_an_outage(node_factory, tmp_path, 7.0, "stop")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_followers_wait_for_a_node_down_for_twenty_seconds(
    node_factory: type[Node], tmp_path: Path, how: str
) -> None:
    _followers_through_an_outage(node_factory, tmp_path, 20.0, how)
