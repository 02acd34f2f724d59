"""load → tail, end to end with real processes."""

from __future__ import annotations

import json
import signal
import time

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import drain, run, spawn_upr, wait_persisted
from upr_cli.protocol.decoder import OP_MUTATION


def test_load_then_tail_shows_exactly_the_latest_version_of_every_key(node: Node) -> None:
    out = upr("load", node.uri, "--docs", "3000", "--update-ratio", "0.3", "--delete-ratio",
              "0.15", "--seed", "7", "--json")  # fmt: skip
    summary = json.loads(out.stdout)
    assert summary["errors"] == 0 and summary["items"] == 3000
    wait_persisted(node.uri)
    tail = upr("tail", node.uri, "--until-end", "--format", "json")
    lines = [json.loads(line) for line in tail.stdout.splitlines()]
    # every key once: the disk holds one version per key (dedup)
    keys = [(r["key"]) for r in lines]
    assert len(keys) == len(set(keys))
    live = {r["key"]: r["value"] for r in lines if r["op"] == "mutation"}
    deleted = {r["key"] for r in lines if r["op"] == "deletion"}
    assert len(live) == summary["created"] - summary["deletes"]
    assert len(deleted) == summary["deletes"]
    # the latest version: compare with what the node returns for each key, via the library
    rows, _events, _c = run(drain(node.uri))
    mutations = [r for r in rows if r.opcode == OP_MUTATION]
    assert {bytes(r.key).decode(): json.loads(r.value) for r in mutations} == live
    # each partition's seqs strictly increase
    last: dict[int, int] = {}
    for r in lines:
        assert int(r["seq"]) > last.get(r["partition"], 0)
        last[r["partition"]] = int(r["seq"])
        assert set(r) >= {"partition", "seq", "op", "key", "cas", "rev_seq", "flags", "expiry"}


def test_tail_filters_count_and_text(node: Node) -> None:
    upr("load", node.uri, "--docs", "400", "--seed", "3")
    wait_persisted(node.uri)
    some = upr("tail", node.uri, "--until-end", "--format", "json", "--partitions", "0-3,9")
    parts = {json.loads(line)["partition"] for line in some.stdout.splitlines()}
    assert parts <= {0, 1, 2, 3, 9} and len(parts) >= 3
    keyed = upr("tail", node.uri, "--until-end", "--format", "json", "--keys", "7$")
    assert all(json.loads(line)["key"].endswith("7") for line in keyed.stdout.splitlines())
    assert len(upr("tail", node.uri, "--count", "5", "--format", "json").stdout.splitlines()) == 5
    text = upr("tail", node.uri, "--until-end", "-v", "--partitions", "0")
    assert "[snapshot]" in text.stdout and "mutation key=doc-" in text.stdout
    assert "[stream_end]" in text.stdout


def test_tail_errors_are_one_line(node: Node) -> None:
    bad = upr("tail", node.uri.replace("s3cret-pw", "nope"), "--until-end", check=False)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    assert "authentication failed" in bad.stderr and "nope" not in bad.stderr
    gone = upr("tail", "upr://a:b@127.0.0.1:1/default", "--until-end", check=False)
    assert gone.returncode == 1 and gone.stderr.startswith("upr: error: cannot connect")
    usage = upr("tail", node.uri, "--format", "xml", check=False)
    assert usage.returncode == 2 and usage.stderr.count("\n") == 1


def test_follow_mode_sees_new_writes_and_ctrl_c_ends_it_with_0(node: Node) -> None:
    with spawn_upr("tail", node.uri, "--format", "json", "--from", "now") as proc:
        time.sleep(1.5)
        upr("load", node.uri, "--docs", "50", "--prefix", "live")
        deadline = time.monotonic() + 20
        seen = 0
        assert proc.stdout is not None
        while seen < 50 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line and json.loads(line)["key"].startswith("live-"):
                seen += 1
        assert seen == 50
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0  # a follower's end (README "Errors and exit codes")
        assert proc.stderr is not None
        assert proc.stderr.read() == ("upr: stopped by SIGINT: no --state, so no position saved "
                                      "(--state FILE keeps one)\n")  # fmt: skip
