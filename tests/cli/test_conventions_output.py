"""Issue 32's output conventions, each as a script or cron job meets it: `diff`'s exit
5 (behind, no rollback) apart from 1 (a divergence); `rollback-point --server/--client
--json` one object; `items_per_s` never null; every `tail --format json` line with an
`op`; restore's "not written: the target has this version or a newer one"; and
`eval "$(upr cluster env)"` where the cluster's password wins over a stale one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.json_convention import problems
from tests.repo.repo_helpers import run_upr
from upr_cli.cluster import spec
from upr_cli.collections import ManifestChange
from upr_cli.dcp.events import Rollback, Snapshot, StreamEnded, StreamOpened
from upr_cli.errors import ExitCode
from upr_cli.jobs.backup import BackupSummary
from upr_cli.jobs.replay import ReplayStats
from upr_cli.jobs.restore import RestoreSummary
from upr_cli.jobs.tail import event_line, json_line
from upr_cli.position import StreamPosition
from upr_cli.protocol.decoder import OP_DELETION, OP_EXPIRATION, OP_MUTATION, DcpRecord

ROOT = Path(__file__).resolve().parents[2]
ONE = [{"uuid": "1", "seq": "0"}]  # one branch from seq 0
FORKED = [{"uuid": "2", "seq": "8"}, *ONE]  # a failover at seq 8


def logs(path: Path, **partitions: tuple[list[dict[str, str]], int]) -> str:
    """A JSON file of failover logs: p0=(log, seq), …"""
    path.write_text(json.dumps({k[1:]: {"failover_log": log, "seq": str(seq)}
                                for k, (log, seq) in partitions.items()}))  # fmt: skip
    return str(path)


# -- diff: 0 identical, 5 only behind, 1 they differ --------------------------------------


def test_diff_exits_5_when_b_is_only_behind(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a = logs(tmp_path / "a.json", p0=(ONE, 9), p1=(ONE, 4))
    behind = logs(tmp_path / "behind.json", p0=(ONE, 7), p1=(ONE, 4))
    ahead = logs(tmp_path / "ahead.json", p0=(ONE, 12), p1=(ONE, 4))
    forked = logs(tmp_path / "forked.json", p0=(FORKED, 9), p1=(ONE, 4))
    lost = logs(tmp_path / "lost.json", p0=(ONE, 7), p1=(ONE, 6))  # 1 behind, 1 ahead

    assert ExitCode.BEHIND == 5
    code, out, _err = run_upr(capsys, "diff", a, behind, "--json")
    assert code == ExitCode.BEHIND and json.loads(out)["counts"]["behind"] == 1
    assert run_upr(capsys, "diff", a, behind)[0] == 5  # the table too
    assert run_upr(capsys, "diff", a, a)[0] == 0
    assert run_upr(capsys, "diff", a, ahead)[0] == 1  # B holds seqs A has not
    assert run_upr(capsys, "diff", a, lost)[0] == 1  # behind in one, ahead in the other
    # B behind a failover A went through, holding nothing above it: behind, no rollback
    assert run_upr(capsys, "diff", forked, behind)[0] == 5
    # B above A's failover: diverged, lost writes
    code, out, _err = run_upr(capsys, "diff", forked, ahead, "--json")
    assert code == 1 and json.loads(out)["partitions"][0]["status"] == "diverged"
    # a partition on one side only is no "behind"
    only = logs(tmp_path / "only.json", p0=(ONE, 7))
    assert run_upr(capsys, "diff", a, only)[0] == 1
    # a source that fails is still 2, never 5
    assert run_upr(capsys, "diff", a, str(tmp_path / "none.json"))[0] == 2


def test_exit_5_is_documented() -> None:
    page = (ROOT / "man" / "upr-diff.1").read_text()
    assert "5 B is only behind A on the same branch" in page
    assert ".B 5\n" in (ROOT / "man" / "upr.1").read_text()


# -- rollback-point --server/--client --json: one object ---------------------------------


def test_rollback_point_sources_json_is_one_object(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    server = logs(tmp_path / "server.json", p0=(FORKED, 9), p1=(ONE, 4))
    client = logs(tmp_path / "client.json", p0=(ONE, 9), p1=(ONE, 4))
    code, out, err = run_upr(capsys, "rollback-point", "--server", server, "--client", client,
                             "--json")  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert isinstance(doc, dict) and not problems(doc)
    assert (doc["server"], doc["client"], doc["rule"]) == (server, client, "seed")
    assert (doc["must_roll_back_count"], doc["impossible"]) == (1, 0)
    parts = {p["partition"]: p for p in doc["partitions"]}
    assert parts[0]["must_roll_back"] and parts[0]["rollback_seq"] == "8"
    assert not parts[1]["must_roll_back"] and parts[1]["error"] is None
    # an impossible history is counted, and its partition carries the error (exit 3)
    code, out, _err = run_upr(capsys, "rollback-point", "--server", client, "--client", server,
                              "--json")  # fmt: skip
    doc = json.loads(out)
    assert code == 3 and doc["impossible"] == 1 and doc["partitions"][0]["error"]


# -- items_per_s: an integer, 0 when nothing was handled ---------------------------------


def test_items_per_s_is_never_null() -> None:
    docs = {
        "backup": BackupSummary("b", "default", True, 0, 0, 0, 0).to_json(),
        "replay": ReplayStats(seconds=1.5).to_json(),
        "restore": RestoreSummary("b", "sqlite:/x.db", False).to_json(),
        "restore (no time)": RestoreSummary("b", "sqlite:/x.db", False, seconds=0).to_json(),
    }
    for name, doc in docs.items():
        assert doc["items_per_s"] == 0, name
        assert not problems(doc), name
    assert BackupSummary("b", "d", True, 10, 0, 0, 0, seconds=2.0).to_json()["items_per_s"] == 5


# -- tail --format json: one discriminator, `op`, on every line --------------------------


def _row(op: int, seq: int) -> DcpRecord:
    return DcpRecord(op, 3, seq, 1, 7, 0, 0, 0, 0, f"k{seq}".encode(),
                     b"{}" if op == OP_MUTATION else b"", 0)  # fmt: skip


def test_every_tail_json_line_has_an_op() -> None:
    at = StreamPosition(3, 0xA, 5, 5, 5)
    lines = [
        json_line(_row(OP_MUTATION, 1)),
        json_line(_row(OP_DELETION, 2)),
        json_line(_row(OP_EXPIRATION, 3)),
        event_line(ManifestChange(3, 4, "collection-created", 2, 8, 9, "users"), "json"),
        event_line(ManifestChange(3, 5, "scope-dropped", 3, 8), "json"),
        event_line(StreamOpened(3, ((0xA, 0),), at), "json"),
        event_line(Snapshot(3, 1, 5, 1), "json"),
        event_line(Rollback(3, at, 2, 0xA, 2), "json"),
        event_line(StreamEnded(3, 0, at), "json"),
    ]
    objs = [json.loads(line or "") for line in lines]
    assert [o["op"] for o in objs] == [
        "mutation", "deletion", "expiration", "system_event", "system_event",
        "stream_open", "snapshot_marker", "rollback", "stream_end",
    ]  # fmt: skip
    # the old discriminator stays: events keep "event", changes never have one
    assert [o.get("event") for o in objs[3:5]] == ["collection-created", "scope-dropped"]
    assert all("event" not in o for o in objs[:3]) and all("event" in o for o in objs[3:])
    # jq 'select(.op=="mutation")' over the whole stream: the mutation alone
    assert [o["key"] for o in objs if o["op"] == "mutation"] == ["k1"]
    # the text lines are as they were
    text = event_line(ManifestChange(3, 4, "collection-created", 2, 8, 9, "users"), "text")
    assert text is not None and "op=" not in text and text.endswith("[collection-created]")


# -- restore: "not written: the target has this version or a newer one" ------------------


def test_restore_says_not_written_for_what_the_target_has(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from upr_cli.cli.restore import _report

    summary = RestoreSummary("20261121T061500.000000Z", "upr://h/default", False,
                             partitions=1, documents=5, written=3, conflicts=2)  # fmt: skip
    _report(summary, dry_run=False, json_out=False)
    out = capsys.readouterr().out
    assert "\n2 not written: the target has this version or a newer one\n" in out
    assert "written 3; absent keys deleted 0; errors 0" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "kept newer" not in out
    doc = summary.to_json()
    assert doc["target_has_same_or_newer"] == 2
    assert doc["conflicts"] == 2  # the deprecated alias, for the scripts that read it


# -- cluster env: the cluster's password wins --------------------------------------------


def test_cluster_env_replaces_a_stale_password(tmp_path: Path) -> None:
    data = tmp_path / "cl"
    data.mkdir()
    password = "it's $ecret"  # quoting matters
    spec.save(data, spec.ClusterSpec("default", 4, 1, "admin", password,
                                     [spec.NodeSpec("n0", 11999)]))  # fmt: skip
    script = 'eval "$("$@")"; printf "%s\\n%s\\n" "$UPR_PASSWORD" "$UPR_N0"'
    cmd = ["sh", "-c", script, "sh", sys.executable, "-m", "upr_cli", "cluster", "env",
           "--data", str(data)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "UPR_PASSWORD"}
    env["PYTHONPATH"] = str(ROOT)
    uri = "upr://admin@127.0.0.1:11999/default"
    fresh = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    assert fresh.stdout.splitlines() == [password, uri] and fresh.stderr == ""
    stale = subprocess.run(cmd, env=env | {"UPR_PASSWORD": "from-an-earlier-shell"},
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert stale.stdout.splitlines() == [password, uri]
    assert "replace it with this cluster's" in stale.stderr
    same = subprocess.run(cmd, env=env | {"UPR_PASSWORD": password}, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert same.stderr == ""  # no note when nothing changes
