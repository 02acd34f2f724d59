"""`upr prune` and `upr remove` as a user runs them: dry run by default, the plan, the
JSON convention, refused input, a repository pruned twice, and revisions on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_output import at_80, whole
from tests.repo.chain_gen import Step, build, restored
from upr_cli.errors import UprError
from upr_cli.repo import Repository

STEPS = [
    Step("full", (3, 3, 3), (0, 0, 0), (False, False, False), 1),
    Step("inc", (4, 2, 3), (0, 0, 0), (False, False, False), 2),
    Step("inc", (2, 3, 1), (0, 3, 0), (False, False, True), 3),
    Step("drop", (3, 1, 2), (0, 0, 0), (False, False, False), 4),
    Step("inc", (2, 2, 2), (2, 0, 0), (False, False, False), 5),
    Step("inc", (1, 3, 2), (0, 0, 0), (False, False, False), 6),
]


def upr(*args: str, tz: str = "UTC") -> subprocess.CompletedProcess[str]:
    env = os.environ | {"TZ": tz, "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "upr_cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Path, list[Any]]:
    repo = tmp_path / "repo"
    ms = build(Repository(repo), STEPS)
    return repo, ms


def _tree(repo: Path) -> dict[str, int]:
    return {str(p.relative_to(repo)): p.stat().st_mtime_ns for p in sorted(repo.rglob("*"))}


def test_dry_run_changes_nothing_and_names_the_time_zone(chain: tuple[Path, list[Any]]) -> None:
    repo, ms = chain
    before = _tree(repo)
    r = upr("prune", "--repo", str(repo), "--keep-last", "2", tz="Europe/Paris")
    assert r.returncode == 0, r.stderr
    assert _tree(repo) == before
    assert "CET (UTC+01:00)" in r.stdout
    assert "keep 2 backups, remove 4" in r.stdout
    assert "--apply" in r.stderr  # the hint
    j = json.loads(upr("prune", "--repo", str(repo), "--keep-last", "2", "--json").stdout)
    b = j["buckets"][0]
    assert j["dry_run"] is True and b["backups_removed"] == 4 and b["kept"] == 2
    assert [x["action"] for x in b["backups"]] == ["remove"] * 4 + ["keep"] * 2
    assert b["revisions"] == [{"backup_id": str(ms[4].backup_id), "revision": 2,
                               "absorbs": [str(m.backup_id) for m in ms[:4]]}]  # fmt: skip
    assert isinstance(b["bytes_removed"], int) and b["bytes_written"] is None
    assert b["backups"][-1]["reasons"] == ["last 1"]


def test_plan_table_is_whole_at_80_columns(chain: tuple[Path, list[Any]]) -> None:
    from upr_cli.cli import prune as cli
    from upr_cli.jobs.prune import run
    from upr_cli.jobs.retention import KeepRules

    repo, ms = chain
    plan = run(repo, bucket=None, rules=KeepRules(last=2, hourly=3), apply_=False,
               drop_lost=False).buckets[0]  # fmt: skip
    t = cli._table("default: plan (--keep-last 2; times in UTC (UTC+00:00))")
    for row in cli._rows(plan):
        t.add_row(*row)
    lines = at_80(t)
    whole(lines, *(str(m.backup_id) for m in ms), "remove", "keep")
    assert "into 2026" in "\n".join(lines)  # where each removed backup's records go


@pytest.mark.parametrize("args, message", [
    (["prune", "--apply"], "give at least one keep rule"),
    (["prune"], "give at least one keep rule"),
    (["prune", "--keep-within", "soon"], "is not a duration"),
    (["prune", "--keep-last", "-1"], "greater than or equal to 0"),
    (["remove", "29991231"], "no such backup"),
    (["remove", "20261121T091500.000000Z..20261121T061500.000000Z"], "no backup of this"),
])  # fmt: skip
def test_bad_input_is_one_line(chain: tuple[Path, list[Any]], args: list[str],
                               message: str) -> None:  # fmt: skip
    repo, _ms = chain
    before = _tree(repo)
    r = upr(*args[:1], "--repo", str(repo), *args[1:])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert _tree(repo) == before


def test_remove_twice_then_prune_keeps_every_state(chain: tuple[Path, list[Any]],
                                                   tmp_path: Path) -> None:  # fmt: skip
    repo, ms = chain
    ids = [m.backup_id for m in ms]
    states = {b: restored(repo, b, tmp_path / f"b{i}.db") for i, b in enumerate(ids)}
    # a range, then the backup the first removal merged into (its revision is absorbed)
    r = upr("remove", "--repo", str(repo), f"{ids[1]}..{ids[2]}", "--apply", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["buckets"][0]["revisions"][0]["backup_id"] == str(ids[3])
    assert (repo / "default" / f"{ids[3]}-r00000002").is_dir()
    assert json.loads((repo / "repo.json").read_text())["version"] == 2
    r = upr("remove", "--repo", str(repo), str(ids[3])[:-4], "--apply")  # a unique prefix
    assert r.returncode == 0, r.stderr
    r = upr("prune", "--repo", str(repo), "--keep-last", "1", "--apply", "--json")
    assert r.returncode == 0, r.stderr
    left = Repository(repo).manifests("default")
    assert [m.backup_id for m in left] == [ids[5]]
    assert left[0].revision == 2 and left[0].full and set(left[0].absorbed) == set(ids[:5])
    assert restored(repo, ids[5], tmp_path / "after.db") == states[ids[5]]
    names = sorted(p.name for p in (repo / "default").iterdir())
    assert [n for n in names if n[:1].isdigit()] == [f"{ids[5]}-r00000002"]
    assert not [n for n in names if ".tmp-" in n]
    v = upr("verify", "--repo", str(repo))
    assert v.returncode == 0, v.stdout + v.stderr


def test_drop_lost_writes_is_counted(chain: tuple[Path, list[Any]]) -> None:
    repo, _ms = chain
    keep = json.loads(upr("prune", "--repo", str(repo), "--keep-last", "2", "--json").stdout)
    assert keep["buckets"][0]["lost_writes"] > 0  # the cut-back and the rollback's
    r = upr("prune", "--repo", str(repo), "--keep-last", "2", "--drop-lost-writes")
    assert "lost-write records dropped (--drop-lost-writes)" in r.stdout
    r = upr("prune", "--repo", str(repo), "--keep-last", "2", "--drop-lost-writes", "--apply",
            "--json")  # fmt: skip
    b = json.loads(r.stdout)["buckets"][0]
    assert b["lost_writes_dropped"] == keep["buckets"][0]["lost_writes"]


def test_remove_ranges_take_ids_or_their_starts() -> None:
    from upr_cli.jobs.prune import resolve_backups
    from upr_cli.repo import BackupId

    ids = [BackupId.parse(f"202611{d:02d}T061500.000000Z") for d in (21, 29, 30)]
    ids.append(BackupId.parse("20261201T000000.000000Z"))
    assert resolve_backups(ids, ["202611..202611"]) == set(ids[:3])  # November
    assert resolve_backups(ids, ["..20261129"]) == set(ids[:2])
    assert resolve_backups(ids, ["20261130.."]) == set(ids[2:])
    assert resolve_backups(ids, [f"{ids[1]}..{ids[2]}"]) == set(ids[1:3])
    assert resolve_backups(ids, ["202612"]) == {ids[3]}  # a unique prefix
    with pytest.raises(UprError, match="no backup of this bucket lies in that range"):
        resolve_backups(ids, ["2027.."])
    with pytest.raises(UprError, match="start of 4 backups"):
        resolve_backups(ids, ["20261"])
