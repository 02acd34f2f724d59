"""s3:// repositories end to end, through the CLI, a real `upr serve` and moto behind
the fault proxy: backup (updates and deletes), incremental, restore, verify, merge,
prune and a `repo:s3://…@ID` source; faults mid-upload and mid-restore; retries that
run out and a rerun that completes exactly; two concurrent backups; a SIGKILLed
backup whose lease runs out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, node_factory, upr
from tests.e2e.e2e_helpers import node_content_hash, spawn_upr, wait_persisted
from tests.s3.fault_proxy import Fault, FaultProxy
from upr_cli.store import Store

__all__ = ["node_factory"]  # the e2e tests' fixture: nodes in tmp_path, killed at the end


def restored(tmp_path: Path, url: str, name: str, *extra: str) -> tuple[int, str]:
    db = tmp_path / f"{name}.db"
    upr("restore", "--repo", url, *extra, f"sqlite:{db}")
    with Store(db) as s:
        return s.count(), s.content_hash()


def at_commit(proxy: FaultProxy, proc: subprocess.Popen[str]) -> None:
    """Wait until the backup `proc` sends its manifest (the proxy holds it there)."""
    deadline = time.monotonic() + 30
    while not proxy.requests("PUT", "manifest"):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)


def backup(node: Node, url: str) -> dict[str, object]:
    out = upr("backup", node.uri, "--repo", url, "--json", "--no-progress").stdout
    return json.loads(out)  # type: ignore[no-any-return]


def test_backup_restore_verify_merge_prune_on_s3(
    node_factory: type[Node], s3: str, tmp_path: Path
) -> None:
    node = node_factory("--flush-interval", "0.02", partitions=4).start()
    url = f"s3://{s3}/cb"
    upr("load", node.uri, "--docs", "600", "--update-ratio", "0.2", "--delete-ratio", "0.1")
    wait_persisted(node.uri)
    first = backup(node, url)
    assert first["full"]
    at_first = node_content_hash(node.uri)
    upr("load", node.uri, "--docs", "150", "--update-ratio", "0.5", "--delete-ratio", "0.2",
        "--seed", "2", "--prefix", "inc")  # fmt: skip
    wait_persisted(node.uri)
    second = backup(node, url)
    assert not second["full"] and 0 < int(second["items"]) < 300  # type: ignore[call-overload]
    # a repo: source takes the same URL, the backup after the last '@'
    db = tmp_path / "replayed.db"
    upr("replay", f"repo:{url}@{first['backup_id']}", "--into", str(db))
    with Store(db) as s:
        assert (s.count(), s.content_hash()) == at_first
    merged = json.loads(upr("merge", "--repo", url, "--json").stdout)
    assert merged["merged"] == 2
    pruned = json.loads(upr("prune", "--repo", url, "--keep-last", "1", "--apply",
                            "--json").stdout)  # fmt: skip
    actions = {b["backup_id"]: b["action"] for b in pruned["buckets"][0]["backups"]}
    assert actions == {first["backup_id"]: "remove", second["backup_id"]: "remove",
                       merged["backup_id"]: "keep"}  # fmt: skip
    assert "1 backup, 4 segments" in upr("verify", "--repo", url).stdout
    assert restored(tmp_path, url, "merged") == node_content_hash(node.uri)
    # encryption and object storage combine: copied into an encrypted repository in the
    # bucket, it holds no plaintext object and restores the same
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    enc = f"s3://{s3}/enc"
    upr("repo", "copy", "--from", url, "--to", enc, "--encrypt", "--key-file", str(key))
    import boto3

    bucket = boto3.resource("s3").Bucket(s3)
    names = [o.key for o in bucket.objects.filter(Prefix="enc/")]
    assert any(n.endswith(".seg") for n in names) and any("manifest" in n for n in names)
    plain = [b"default", b"inc-0000", b'"score":', key.read_bytes()]
    for name in names:
        data = bucket.Object(name).get()["Body"].read()
        if name != "enc/repo.json":
            assert data[:8] == b"UPR-SEAL", name
            assert not [p for p in plain if p in data], name
    assert restored(tmp_path, enc, "sealed", "--key-file", str(key)) == node_content_hash(node.uri)


def test_faults_mid_upload_and_mid_restore_and_retries_that_run_out(
    node_factory: type[Node], s3: str, proxy: FaultProxy, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("UPR_S3_READ_TIMEOUT", "1")
    node = node_factory("--flush-interval", "0.02", partitions=4).start()
    url = f"s3://{s3}/cb"
    upr("load", node.uri, "--docs", "500", "--update-ratio", "0.2", "--delete-ratio", "0.1")
    wait_persisted(node.uri)
    # partition 0's uploads fail for good: one line, after a bounded number of attempts
    proxy.add(Fault("status", 10_000, "PUT", "/p0000-", status=503))
    failed = upr("backup", node.uri, "--repo", url, "--no-progress", check=False)
    assert failed.returncode == 1 and failed.stderr.count("\n") == 1, failed.stderr
    assert "failed after 6 attempts: 503 ServiceUnavailable" in failed.stderr
    tries: dict[str, int] = {}
    for r in proxy.requests("PUT", "/p0000-"):
        tries[r.path] = tries.get(r.path, 0) + 1
    assert tries and max(tries.values()) == 6
    finished = {r.path for r in proxy.requests("PUT", ".seg") if r.status == 200}
    # the rerun meets dropped connections, 500s and 503s mid-upload, and completes
    proxy.clear()
    proxy.add(Fault("close", 2, "PUT", ".seg"), Fault("status", 2, "PUT", ".seg", status=500),
              Fault("status", 1, "PUT", "manifest", status=503))  # fmt: skip
    done = backup(node, url)
    assert done["reused_segments"] == len(finished)  # the rerun resumed the failed run
    assert done["full"] and int(done["items"]) > 0  # type: ignore[call-overload]
    assert [r.fault for r in proxy.requests("PUT") if r.fault].count("close") == 2
    assert "ok" in upr("verify", "--repo", url).stdout
    # a restore whose downloads are cut off mid-body, fail or time out restores exactly
    proxy.clear()
    proxy.add(Fault("drop", 2, "GET", ".seg", nbytes=100), Fault("status", 1, "GET", ".seg"),
              Fault("delay", 1, "GET", ".seg", seconds=2.0))  # fmt: skip
    assert restored(tmp_path, url, "faulty") == node_content_hash(node.uri)
    faults = [r.fault for r in proxy.requests("GET", ".seg") if r.fault]
    assert sorted(faults) == ["delay", "drop", "drop", "status"]


def test_two_concurrent_backups_one_commits_the_other_refuses(
    node_factory: type[Node], s3: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPR_LEASE_SECONDS", "6")
    node = node_factory("--flush-interval", "0.02", partitions=4).start()
    url = f"s3://{s3}/cb"
    upr("load", node.uri, "--docs", "500")
    wait_persisted(node.uri)
    # two concurrent backups: the first holds the lock (held in its commit), the other
    # refuses in one line, naming it
    gate = Fault("gate", 1, "PUT", "manifest")
    proxy.add(gate)
    with spawn_upr("backup", node.uri, "--repo", url, "--no-progress") as first:
        at_commit(proxy, first)
        second = upr("backup", node.uri, "--repo", url, "--no-progress", check=False)
        gate.gate.set()
        assert first.wait(timeout=60) == 0
    assert second.returncode == 1 and second.stderr.count("\n") == 1, second.stderr
    assert f"is locked by pid {first.pid} " in second.stderr
    assert "its lease runs until" in second.stderr
    assert 412 in [r.status for r in proxy.requests("PUT", "cb/default/lock")]


@pytest.mark.slow  # 12 s; test_s3_locks.py checks a killed holder's lease in the default suite
def test_a_killed_backups_lease_runs_out_and_the_next_backup_takes_it_over(
    node_factory: type[Node], s3: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPR_LEASE_SECONDS", "6")
    node = node_factory("--flush-interval", "0.02", partitions=4).start()
    url = f"s3://{s3}/cb"
    upr("load", node.uri, "--docs", "300")
    wait_persisted(node.uri)
    backup(node, url)
    # a SIGKILLed backup (stuck in its commit): its lock stays until its lease runs out,
    # then the next backup takes it over (with a warning) and commits
    upr("load", node.uri, "--docs", "200", "--seed", "3", "--prefix", "k")
    wait_persisted(node.uri)
    proxy.clear()
    proxy.add(Fault("hang", 1, "PUT", "manifest", seconds=60))
    with spawn_upr("backup", node.uri, "--repo", url, "--no-progress") as killed:
        at_commit(proxy, killed)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        killed_at = time.monotonic()
    refused = upr("backup", node.uri, "--repo", url, "--no-progress", check=False)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"locked by pid {killed.pid} " in refused.stderr
    # the lease (6 s) runs out, by the server's clock (1 s resolution)
    time.sleep(max(0.0, killed_at + 7.2 - time.monotonic()))
    after = upr("backup", node.uri, "--repo", url, "--json", "--no-progress")
    assert f"taking over a stale lock of pid {killed.pid}" in after.stderr
    assert json.loads(after.stdout)["reused_segments"] > 0  # the killed run's segments
    assert not (Path(os.getcwd()) / "s3:").exists()
