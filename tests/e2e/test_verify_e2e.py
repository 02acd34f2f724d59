"""upr verify names every problem; upr info shows the chain (real node, real files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.conftest import Node, upr
from tests.e2e.e2e_helpers import wait_persisted
from upr_cli.jobs.inspect import verify


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("verify")
    node = Node(base / "node", "--flush-interval", "0.02").start()
    try:
        upr("load", node.uri, "--docs", "800", "--update-ratio", "0.2")
        wait_persisted(node.uri)
        upr("backup", node.uri, "--repo", str(base / "repo"))
        upr("load", node.uri, "--docs", "200", "--prefix", "inc")
        upr("backup", node.uri, "--repo", str(base / "repo"))
    finally:
        node.kill()
    return base / "repo"


def copy(repo: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "repo"
    shutil.copytree(repo, dst)
    return dst


def segments(repo: Path) -> list[Path]:
    return sorted(repo.glob("default/*/p*.seg"))


def check(repo: Path) -> tuple[int, dict]:  # type: ignore[type-arg]
    out = upr("verify", "--repo", str(repo), "--json", check=False)
    return out.returncode, json.loads(out.stdout)


def test_a_sound_repository_verifies(repo: Path) -> None:
    code, report = check(repo)
    assert code == 0 and report["ok"]
    (b,) = report["buckets"]
    info = json.loads(upr("info", "--repo", str(repo), "--json").stdout)
    items = sum(x["items"] for x in info["buckets"][0]["backups"])
    assert b["backup_count"] == 2 and b["items"] == items and b["segments"] == len(segments(repo))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_damage_is_named(repo: Path, tmp_path: Path, damage: str) -> None:
    r = copy(repo, tmp_path)
    seg = segments(r)[3]
    if damage == "flip":
        data = bytearray(seg.read_bytes())
        data[len(data) // 3] ^= 0x40
        seg.write_bytes(bytes(data))
        kinds = {"checksum", "corrupt"}
    elif damage == "truncate":
        seg.write_bytes(seg.read_bytes()[:-7])
        kinds = {"truncated"}
    elif damage == "delete":
        seg.unlink()
        kinds = {"missing"}
    else:
        for m in sorted(r.glob("default/*/manifest.json*"))[:2]:
            m.write_text("{")
        kinds = {"manifest"}
    code, report = check(r)
    assert code == 1 and not report["ok"]
    problems = report["buckets"][0]["problems"]
    assert {p["kind"] for p in problems} & kinds, problems
    if damage != "manifest":
        assert any(seg.name in p["where"] for p in problems)
    text = upr("verify", "--repo", str(r), check=False)
    assert text.returncode == 1 and "problem" in text.stdout
    if damage == "manifest":
        return
    # restore refuses with one line naming the segment; --skip-corrupt goes on and reports
    bad = upr("restore", "--repo", str(r), f"sqlite:{tmp_path / 'a.db'}", check=False)
    assert bad.returncode == 1 and seg.name in bad.stderr and bad.stderr.count("\n") == 1
    skipped = upr("restore", "--repo", str(r), "--skip-corrupt", "--json",
                  f"sqlite:{tmp_path / 'b.db'}", check=False)  # fmt: skip
    assert skipped.returncode == 4  # done, but partial: the partition left out is named
    report = json.loads(skipped.stdout)
    assert len(report["skipped"]) == 1 and seg.name in report["skipped"][0]
    assert report["written"] > 0


def test_info_shows_backups_and_a_partition_chain(repo: Path) -> None:
    data = json.loads(upr("info", "--repo", str(repo), "--partitions", "2", "--json").stdout)
    backups = data["buckets"][0]["backups"]
    assert [b["full"] for b in backups] == [True, False]
    assert backups[1]["parent"] == backups[0]["backup_id"]
    (part,) = data["buckets"][0]["partitions"]
    chain = part["chain"]
    assert part["partition"] == 2 and part["lost_ranges"] == []
    assert chain[0]["start"] == "0" and chain[1]["start"] == chain[0]["end"]
    assert "full" in upr("info", "--repo", str(repo)).stdout


@pytest.mark.parametrize("damage", ["flip", "zero", "delete"])
@pytest.mark.parametrize("name", ["manifest.json", "manifest.json.copy"])
def test_a_damaged_manifest_file_is_named_and_repaired(
    repo: Path, tmp_path: Path, damage: str, name: str
) -> None:
    """Either file of a pair, damaged while its twin keeps the backup readable: the
    redundancy is gone, so verify names the file and exits 1; --repair rewrites it."""
    r = copy(repo, tmp_path)
    path = sorted(r.glob(f"default/*/{name}"))[0]
    good = path.read_bytes()
    if damage == "flip":
        data = bytearray(good)
        data[len(data) // 2] ^= 0x08
        path.write_bytes(bytes(data))
    elif damage == "zero":
        path.write_bytes(good[:100] + bytes(64) + good[164:])
    else:
        path.unlink()
    (report,) = verify(r)
    assert not report.to_json()["ok"]
    (problem,) = report.to_json()["problems"]
    assert problem["kind"] == "manifest" and not problem["repaired"]
    assert problem["where"] == f"default/{path.parent.name}/{name}"
    if (name, damage) == ("manifest.json", "delete"):
        text = upr("verify", "--repo", str(r), check=False)
        assert text.returncode == 1 and f"{path.parent.name}/{name}" in text.stdout
        # the data is all there: a restore reads the copy
        upr("restore", "--repo", str(r), f"sqlite:{tmp_path / 'a.db'}")
    fixed = upr("verify", "--repo", str(r), "--repair", "--json", check=False)
    assert fixed.returncode == 0, fixed.stdout
    (problem,) = json.loads(fixed.stdout)["buckets"][0]["problems"]
    assert problem["repaired"] and path.read_bytes() == good
    assert [rep.problems for rep in verify(r)] == [[]]


# -- the JSON convention of every command (docs/output.md) ----------------------------------


def test_every_commands_json_follows_the_convention(
    node_factory: type[Node], tmp_path: Path
) -> None:
    from tests.cli.json_convention import problems

    node = node_factory("--flush-interval", "0.02").start()
    repo, db = str(tmp_path / "repo"), str(tmp_path / "x.db")
    first = upr("load", node.uri, "--docs", "300", "--json")
    again = upr("load", node.uri, "--docs", "100", "--json")
    assert json.loads(again.stdout)["overwritten"] == 100  # the same keys, written again
    wait_persisted(node.uri)
    runs = {
        "load": first,
        "backup": upr("backup", node.uri, "--repo", repo, "--json"),
        "info": upr("info", "--repo", repo, "--partitions", "0-3", "--json"),
        "verify": upr("verify", "--repo", repo, "--json"),
        "examine": upr("examine", "--repo", repo, "doc-000000001", "--json"),
        "restore": upr("restore", "--repo", repo, "--at", "2", f"sqlite:{db}", "--json"),
        "replay": upr("replay", f"repo:{repo}", "--into", str(tmp_path / "r.db"), "--json"),
        "diff": upr("diff", node.uri, f"repo:{repo}", "--json", check=False),
        "rollback-point": upr(
            "rollback-point", "--server", node.uri, "--client", f"repo:{repo}", "--json"
        ),
        "salvage": upr("salvage", "--repo", repo, "--into", node.uri, "--json", check=False),
    }
    broken = {}
    for name, proc in runs.items():
        doc = json.loads(proc.stdout)  # stdout is the one JSON document, nothing else
        assert not proc.stderr.strip().startswith(("{", "[")), name
        if found := problems(doc):
            broken[name] = found
    assert not broken, broken
    assert json.loads(runs["restore"].stdout)["items"] == 300  # --at by a prefix
