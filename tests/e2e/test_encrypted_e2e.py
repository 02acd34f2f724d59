"""An encrypted repository end to end (formats/repository.md §10): `upr backup --encrypt`
against a real `upr serve`, an incremental backup after updates and deletions, then
every command that reads or changes a repository, given the key; the same commands
without a key or with a wrong one fail with one line and change nothing; a tampered
block is named by verify and refused by restore; a segment swapped with another of the
same repository is caught; no file but repo.json and the locks holds plaintext.

Commands run in this process (`main`, as tests/cli/test_ls_cat.py does) but the first
backup, which runs as a real process: a process start each would cost the time budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import node_content_hash, run, set_keys, wait_persisted
from upr_cli.cli.app import main
from upr_cli.repo import access
from upr_cli.store import Store

MARKERS = {b"secret-doc-%d" % i: b'{"body":"PLAINTEXT-MARKER-%d"}' % i for i in range(20)}


class Env:
    def __init__(self, node: Node, repo: Path, key: Path, base: Path) -> None:
        self.node, self.repo, self.key, self.base = node, repo, key, base

    @property
    def k(self) -> list[str]:
        return ["--key-file", str(self.key)]


def call(*args: str) -> subprocess.CompletedProcess[str]:
    """`upr ARGS` run by `main` in this process, with fresh access settings."""
    import contextlib
    import io

    access.reset()
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8") for _ in range(2))
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    access.reset()
    texts = []
    for f in (out, err):
        f.flush()
        texts.append(f.buffer.getvalue().decode())  # type: ignore[attr-defined]
    return subprocess.CompletedProcess(list(args), code, *texts)


def ok(*args: str) -> subprocess.CompletedProcess[str]:
    proc = call(*args)
    assert proc.returncode == 0, (args, proc.stderr)
    return proc


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("encrypted")
    node = Node(base / "node", "--flush-interval", "0.02").start()
    key = base / "key"
    key.write_bytes(os.urandom(32))
    repo = base / "repo"
    try:
        upr("load", node.uri, "--docs", "300", "--seed", "1")
        run(set_keys(node.uri, MARKERS))
        wait_persisted(node.uri)
        upr("backup", node.uri, "--repo", str(repo), "--no-progress", "--encrypt",
            "--key-file", str(key))  # fmt: skip
        upr("load", node.uri, "--docs", "120", "--update-ratio", "0.5", "--delete-ratio",
            "0.2", "--seed", "2")  # fmt: skip
        wait_persisted(node.uri)
        ok("backup", node.uri, "--repo", str(repo), "--no-progress", "--key-file", str(key))
        yield Env(node, repo, key, base)
    finally:
        node.kill()


def snapshot(repo: Path) -> dict[str, str]:
    return {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(repo.rglob("*"))}  # fmt: skip


def restored(env: Env, repo: Path, name: str) -> tuple[int, str]:
    db = env.base / f"{name}.db"
    ok("restore", "--repo", str(repo), *env.k, f"sqlite:{db}", "--no-progress")
    with Store(db) as s:
        return s.count(), s.content_hash()


def test_the_repository_holds_no_plaintext(env: Env) -> None:
    info = (env.repo / "repo.json").read_text()
    assert '"version": 3' in info and '"encryption"' in info
    secrets = [env.key.read_bytes(), b"default", b"PLAINTEXT-MARKER", b"secret-doc-"]
    sealed = 0
    for p in env.repo.rglob("*"):
        if not p.is_file() or p.name in ("repo.json", "lock", "lock.shared"):
            continue
        data = p.read_bytes()
        assert data[:8] == b"UPR-SEAL", p
        assert not [s for s in secrets if s in data], p
        sealed += 1
    assert sealed >= 6  # two backups: segments and both manifest files


def test_every_command_works_given_the_key(env: Env, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(env.repo, repo)
    uri, k = env.node.uri, env.k
    assert restored(env, repo, "state") == node_content_hash(uri)
    verified = ok("verify", "--repo", str(repo), *k)
    assert "problem" not in verified.stdout.lower() or "0 problems" in verified.stdout
    shown = json.loads(ok("info", "--repo", str(repo), *k, "--json").stdout)
    assert len(shown["buckets"][0]["backups"]) == 2
    assert "PLAINTEXT-MARKER-3" in ok("examine", "--repo", str(repo), *k, "secret-doc-3").stdout
    assert "secret-doc-4" in ok("ls", "--repo", str(repo), *k).stdout.split()
    assert ok("cat", "--repo", str(repo), *k, "secret-doc-5").stdout.strip() == (
        MARKERS[b"secret-doc-5"].decode()
    )
    ok("replay", f"repo:{repo}", "--into", str(tmp_path / "replayed.db"), *k, "--no-progress")
    with Store(tmp_path / "replayed.db") as s:
        assert (s.count(), s.content_hash()) == node_content_hash(uri)
    assert call("diff", uri, f"repo:{repo}", *k).returncode == 0  # identical
    assert call("salvage", "--repo", str(repo), "--into", uri, *k).returncode == 0  # dry run
    other = Node(tmp_path / "node2").start()  # restore into a node
    try:
        ok("restore", "--repo", str(repo), *k, other.uri, "--no-progress")
        assert node_content_hash(other.uri) == node_content_hash(uri)
    finally:
        other.kill()
    ok("merge", "--repo", str(repo), *k)
    ids = sorted(p.name for p in (repo / "default").iterdir() if p.is_dir())
    ok("remove", "--repo", str(repo), *k, ids[0], "--apply")
    ok("prune", "--repo", str(repo), *k, "--keep-last", "1", "--apply")
    ok("verify", "--repo", str(repo), *k)
    assert restored(env, repo, "after") == node_content_hash(uri)
    test_the_repository_holds_no_plaintext(Env(env.node, repo, env.key, env.base))


def test_no_key_or_a_wrong_key_changes_nothing(env: Env, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_bytes(os.urandom(32))
    r, uri = str(env.repo), env.node.uri
    before = snapshot(env.repo)
    commands = [
        ["verify", "--repo", r], ["info", "--repo", r], ["examine", "--repo", r, "secret-doc-1"],
        ["ls", "--repo", r], ["cat", "--repo", r, "secret-doc-1"],
        ["restore", "--repo", r, f"sqlite:{tmp_path / 'x.db'}"],
        ["replay", f"repo:{r}", "--into", str(tmp_path / "y.db")],
        ["prune", "--repo", r, "--keep-last", "1", "--apply"],
        ["remove", "--repo", r, "latest", "--apply"], ["merge", "--repo", r],
        ["diff", uri, f"repo:{r}"], ["salvage", "--repo", r, "--into", uri],
        ["backup", uri, "--repo", r, "--no-progress"],
        ["repo", "add-key", "--repo", r, "--new-key-file", str(wrong)],
    ]  # fmt: skip
    cases = (([], "is encrypted: give its key with --key-file"),
             (["--key-file", str(wrong)], "the key opens none of its 1 key slot"))  # fmt: skip
    for cmd in commands:
        for given, says in cases:
            proc = call(*cmd, *given)
            assert proc.returncode == 2, (cmd, given, proc.stderr)
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and says in lines[0], (cmd, given, proc.stderr)
    assert snapshot(env.repo) == before
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "y.db").exists()
    proc = call("backup", uri, "--repo", str(tmp_path / "plain"), "--no-progress")
    assert proc.returncode == 0  # no --encrypt: a new repository stays plaintext
    proc = call("backup", uri, "--repo", str(tmp_path / "plain"), "--encrypt", *env.k)
    assert proc.returncode == 2 and "upr repo copy --from" in proc.stderr
    proc = call("backup", uri, "--repo", str(tmp_path / "new"), "--encrypt")
    assert proc.returncode == 2 and "--encrypt needs a key" in proc.stderr
    assert not (tmp_path / "new").exists()


def test_a_tampered_block_is_named_and_refused(env: Env, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(env.repo, repo)
    seg = max((p for p in repo.rglob("p*.seg")), key=lambda p: p.stat().st_size)
    raw = bytearray(seg.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    seg.write_bytes(raw)
    proc = call("verify", "--repo", str(repo), *env.k)
    assert proc.returncode == 1 and seg.name in proc.stdout + proc.stderr
    assert "fails authentication" in proc.stdout + proc.stderr
    proc = call("restore", "--repo", str(repo), *env.k, f"sqlite:{tmp_path / 'r.db'}",
                "--no-progress")  # fmt: skip
    assert proc.returncode != 0 and seg.name in proc.stderr


def test_a_segment_swapped_with_another_is_caught(env: Env, tmp_path: Path) -> None:
    """Sealing binds no name: a whole file moved to another's name opens, and the
    manifest's per-segment size, partition and digest checks catch it."""
    repo = tmp_path / "repo"
    shutil.copytree(env.repo, repo)
    first = sorted(p for p in (repo / "default").iterdir() if p.is_dir())[0]
    a, b = sorted(first.glob("p*.seg"))[:2]
    tmp = a.with_name("swap")
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)
    proc = call("verify", "--repo", str(repo), *env.k)
    assert proc.returncode == 1 and a.name in proc.stdout + proc.stderr
