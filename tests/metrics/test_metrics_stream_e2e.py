"""`replay --follow`, `tail` and `upr serve` with --metrics-port (docs/metrics.md §2-§4):
a real HTTP client (urllib) scrapes each running process, and the values are checked
against what the process did (replay's --json summary, the lines tail printed, the
documents loaded into the node)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import spawn_upr
from tests.metrics.metrics_helpers import Samples, free_port, one, scrape, until
from tests.repo.repo_helpers import run_upr

B = {"bucket": "default"}


def _load(node: Node, docs: int, seed: int) -> None:
    upr("load", node.uri, "--docs", str(docs), "--size", "100", "--seed", str(seed))


def _caught_up(port: int, prefix: str, items: int) -> Samples | None:
    """The scrape once `items` were taken and a lag poll found nothing behind."""
    got = scrape(port)
    done = one(got, f"{prefix}_items_total", **B) == items
    return got if done and sum(got[f"{prefix}_lag_seqs"].values()) == 0 else None


def test_replay_follow_says_what_it_applied(node: Node, tmp_path: Path) -> None:
    port, db = free_port(), tmp_path / "replica.db"
    _load(node, 120, 1)
    t0 = time.time()
    with spawn_upr("replay", node.uri, "--into", str(db), "--follow", "--metrics-port",
                   str(port), "--json") as replay:  # fmt: skip
        until(lambda: _caught_up(port, "upr_replay", 120), replay, "the first 120 applied")
        _load(node, 80, 2)  # the keys of 80 of them again: 80 updates
        got = until(lambda: _caught_up(port, "upr_replay", 200), replay, "80 more applied")
        t1 = time.time()
        replay.send_signal(signal.SIGTERM)
        out, err = replay.communicate(timeout=60)
    assert replay.returncode in (0, 130, 143), err
    summary = json.loads(out)
    assert one(got, "upr_replay_items_total", **B) == summary["applied"] == 200
    assert one(got, "upr_replay_bytes_total", **B) == summary["bytes"] > 200 * 100
    assert summary["commits"] - one(got, "upr_replay_commits_total", **B) in (0, 1)
    assert t0 <= one(got, "upr_replay_last_apply_timestamp_seconds", **B) <= t1
    assert one(got, "upr_replay_lag_seconds", **B) == 0
    for name in ("upr_rollbacks_total", "upr_lost_writes_total", "upr_reconnects_total"):
        assert one(got, name, **B) == 0, name
    assert "upr_errors_total" not in got
    assert one(got, "process_resident_memory_bytes") > 1 << 20
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT count(*) FROM documents").fetchone()[0] == 120
    assert f"metrics on http://127.0.0.1:{port}/metrics" in err
    # a rerun on the caught-up store is not behind: its lag counts from what it holds
    with spawn_upr("replay", node.uri, "--into", str(db), "--follow", "--metrics-port",
                   str(port)) as again:  # fmt: skip
        got = until(lambda: (g := scrape(port)) and "upr_replay_lag_seqs" in g and g, again,
                    "a lag poll of the rerun")  # fmt: skip
        assert one(got, "upr_replay_lag_seqs", **B) == 0
        assert one(got, "upr_replay_items_total", **B) == 0
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=60)


def test_tail_counts_what_it_printed_per_partition_and_a_reconnect(
    node: Node, tmp_path: Path
) -> None:
    port, printed = free_port(), tmp_path / "changes.jsonl"
    _load(node, 60, 3)
    with printed.open("w") as sink, spawn_upr(
        "tail", node.uri, "--format", "json", "--metrics-port", str(port),
        "--metrics-per-partition", "--wait", "30", stdout=sink,
    ) as tail:  # fmt: skip
        got = until(lambda: _caught_up(port, "upr_tail", 60), tail, "60 changes streamed")
        lines = [json.loads(x) for x in printed.read_text().splitlines()]
        assert len(lines) == one(got, "upr_tail_items_total", **B) == 60
        nbytes = sum(len(x["key"]) + len(json.dumps(x["value"], separators=(",", ":")))
                     for x in lines)  # fmt: skip
        assert one(got, "upr_tail_bytes_total", **B) == nbytes
        assert {dict(k)["partition"] for k in got["upr_tail_lag_seqs"]} == {
            str(p) for p in range(node.partitions)}  # fmt: skip
        assert len(got["upr_tail_lag_seconds"]) == node.partitions
        assert set(got["upr_tail_lag_seconds"].values()) == {0}
        node.stop()
        node.start()
        until(lambda: one(scrape(port), "upr_reconnects_total", **B) >= 1, tail,
              "the reconnect counted")  # fmt: skip
        _load(node, 10, 4)
        got = until(lambda: _caught_up(port, "upr_tail", 70), tail, "10 more streamed")
        assert one(got, "upr_rollbacks_total", **B) == 0
        assert one(got, "upr_errors_total", kind="link", **B) >= 1  # the link lost
        tail.send_signal(signal.SIGTERM)
        tail.communicate(timeout=60)


def test_serve_counts_connections_writes_and_dcp_streams(
    node_factory: type[Node], tmp_path: Path
) -> None:
    port = free_port()
    node = node_factory("--flush-interval", "0.02", "--metrics-port", str(port)).start()
    got = scrape(port)
    assert one(got, "upr_node_items_written_total", **B) == 0
    assert one(got, "upr_node_dcp_streams", **B) == 0
    _load(node, 40, 5)
    got = scrape(port)
    assert one(got, "upr_node_items_written_total", **B) == 40
    assert one(got, "upr_node_connections", **B) == 0  # the loader has gone
    assert one(got, "process_resident_memory_bytes") > 1 << 20
    with spawn_upr("tail", node.uri, "--format", "json", stdout=subprocess.DEVNULL) as tail:
        got = until(lambda: (g := scrape(port)) and one(g, "upr_node_dcp_streams", **B)
                    == node.partitions and g, tail, "the tail's streams")  # fmt: skip
        assert one(got, "upr_node_connections", **B) >= 1
        # every document goes out, each over 100 bytes (the streams open first)
        got = until(lambda: (g := scrape(port)) and one(g, "upr_node_dcp_sent_bytes_total",
                                                         **B) > 40 * 100 and g,
                    tail, "the documents sent")  # fmt: skip
        sent = one(got, "upr_node_dcp_sent_bytes_total", **B)
        tail.send_signal(signal.SIGTERM)
        tail.communicate(timeout=60)
    got = until(lambda: (g := scrape(port)) and one(g, "upr_node_dcp_streams", **B) == 0
                and g, None, "the streams closed")  # fmt: skip
    assert one(got, "upr_node_dcp_sent_bytes_total", **B) >= sent  # a counter: kept
    assert node.stop() in (0, 130, 143)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay", "upr://u:p@127.0.0.1:1/default", "--into", "{tmp}/x.db",
          "--metrics-port", "9"], "--metrics-port is for a replay that follows"),
        (["replay", "upr://u:p@127.0.0.1:1/default", "--into", "{tmp}/x.db", "--follow",
          "--metrics-file", "{tmp}/x.prom"], "--metrics-file is for a one-shot replay"),
        (["tail", "upr://u:p@127.0.0.1:1/default", "--until-end", "--metrics-port", "9"],
         "--metrics-port is for a tail that follows"),
        (["tail", "upr://u:p@127.0.0.1:1/default", "--metrics-per-partition"],
         "--metrics-host and --metrics-per-partition go with --metrics-port"),
    ],
)  # fmt: skip
def test_metrics_options_that_mean_nothing_are_usage_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], message: str
) -> None:
    code, _out, err = run_upr(capsys, *(a.format(tmp=tmp_path) for a in args))
    assert code == 2
    assert message in err and len(err.splitlines()) == 1
