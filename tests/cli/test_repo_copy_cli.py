"""`upr repo copy` as a user runs it: the dry run, the copy and its rerun as JSON
(docs/output.md), the summary line, refused input as one line, the source's own key
options and --transfers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.json_convention import problems
from tests.repo.chain_gen import Step, build
from upr_cli.cli.app import main
from upr_cli.repo import Repository, access

STEPS = [
    Step("full", (3, 3, 3), (0, 0, 0), (False, False, False), 1),
    Step("inc", (4, 2, 3), (0, 3, 0), (True, False, False), 2),
    Step("inc", (2, 3, 1), (0, 0, 0), (False, False, False), 3),
]


def upr(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"COLUMNS": "80", "UPR_FROM_PASSPHRASE": "not-shown"}
    return subprocess.run([sys.executable, "-m", "upr_cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        with pytest.raises(SystemExit) as info:
            main(list(args))
    finally:
        access.reset()
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_repo_copy_from_the_command_line(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    src, dst = tmp_path / "src", tmp_path / "dst"
    ids = [str(m.backup_id) for m in build(Repository(src), STEPS)]
    code, out, err = run_main(capsys, "repo", "copy", "--from", str(src), "--to", str(dst),
                              "--dry-run")  # fmt: skip
    assert code == 0, err
    assert "default: would copy 3 backups" in out and ids[1] in out
    assert not dst.exists()

    # a real process: the source's passphrase variable, --transfers, the JSON
    key = tmp_path / "src.key"  # a plaintext source opens whatever key is given
    key.write_text("k\n")
    r = upr("repo", "copy", "--from", str(src), "--to", str(dst), "--transfers", "2",
            "--from-key-file", str(key), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert problems(doc) == []
    assert (doc["backups_copied"], doc["backups_skipped"], doc["dry_run"]) == (3, 0, False)
    assert doc["buckets"][0]["copied"] == ids and isinstance(doc["bytes"], int)
    assert doc["bytes"] > 0 and doc["source"] == str(src) and doc["destination"] == str(dst)
    assert "not-shown" not in r.stdout + r.stderr

    code, out, err = run_main(capsys, "repo", "copy", "--from", str(src), "--to", str(dst))
    assert code == 0, err
    assert out.startswith("copied 0 backups (0 B) of 1 bucket from ")
    assert "; 3 already there" in out
    code, out, err = run_main(capsys, "verify", "--repo", str(dst))
    assert code == 0, out + err

    for args, message in [
        (["--from", str(src), "--to", str(src)], "are the same repository"),
        (["--from", str(tmp_path / "none"), "--to", str(dst)], "not a upr repository"),
        (["--from", str(src), "--to", str(key)], "exists and is not a directory"),
        (["--from", str(src), "--to", "ftp://h/x"], "ftp:// repositories are not supported"),
        (["--from", str(src), "--to", str(dst), "--bucket", "b2"], "no bucket 'b2'"),
    ]:  # fmt: skip
        code, out, err = run_main(capsys, "repo", "copy", *args)
        assert code == 2, (args, out, err)
        assert message in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
