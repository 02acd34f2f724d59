"""`examine` and `diff` at 80 columns name the columns they leave out (on stderr, so a
pipe still reads the table alone), and `examine` reads a key written
`scope.collection:key`, as `upr tail` prints one, in that collection when the backups
have it; else as the key it is; `--collection`, given, always wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_ls_cat import APP, USERS, Builder, doc
from tests.repo.repo_helpers import run_upr
from upr_cli.cli import output
from upr_cli.repo import Repository

HIDDEN = "columns hidden at {} columns: {} (--json has them)"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("examine-cols") / "repo"
    r = Repository(path)
    r.init()
    Builder(r).backup([
        (0, b"k1", doc(b"default-k1", 0)),
        (USERS, b"k1", doc(b"users-k1", 0)),
        (0, b"app.users:k1", doc(b"literal", 0)),  # a key that holds the form itself
        (0, b"nope.coll:k2", doc(b"plain", 0)),  # not a collection of the backup
    ], APP)  # fmt: skip
    return path


def examined(capsys: pytest.CaptureFixture[str], repo: Path, *args: str) -> dict[str, object]:
    code, out, err = run_upr(capsys, "examine", "--repo", str(repo), "--json", *args)
    assert code == 0, err
    doc_: dict[str, object] = json.loads(out)
    return doc_


def values(found: dict[str, object]) -> list[str]:
    versions = found["versions"]
    assert isinstance(versions, list)
    shown = [v["value"] for v in versions]  # a JSON document's value is its object
    return [(json.loads(v) if isinstance(v, str) else v)["key"] for v in shown]


def test_the_form_tail_prints(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    found = examined(capsys, repo, "app.users:k1")
    assert (found["scope"], found["collection"], found["key"]) == ("app", "users", "k1")
    assert values(found) == ["users-k1"]
    # a scope.collection the backups do not have: the key as written
    found = examined(capsys, repo, "nope.coll:k2")
    assert (found["scope"], found["collection"]) == ("_default", "_default")
    assert found["key"] == "nope.coll:k2" and values(found) == ["plain"]
    found = examined(capsys, repo, "k1")
    assert found["scope"] == "_default" and values(found) == ["default-k1"]


def test_collection_given_wins(capsys: pytest.CaptureFixture[str], repo: Path) -> None:
    found = examined(capsys, repo, "--collection", "_default._default", "app.users:k1")
    assert (found["scope"], found["key"]) == ("_default", "app.users:k1")
    assert values(found) == ["literal"]
    found = examined(capsys, repo, "--collection", "app.users", "k1")
    assert values(found) == ["users-k1"]
    code, _out, err = run_upr(capsys, "examine", "--repo", str(repo), "--collection",
                              "app.users", "app.users:k1")  # fmt: skip
    assert code == 1 and "no version of 'app.users:k1' in app.users" in _out, err


@pytest.mark.parametrize(
    ("width", "hidden"), [(80, "time, cas, value"), (105, "time, value"), (200, "")]
)
def test_examine_names_the_hidden_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, repo: Path,
    width: int, hidden: str,
) -> None:  # fmt: skip
    monkeypatch.setattr(output.stdout, "width", width)
    code, out, err = run_upr(capsys, "examine", "--repo", str(repo), "k1")
    assert code == 0 and "latest" in out, err
    if hidden:
        assert HIDDEN.format(width, hidden) in err.replace("\n", " ")
        assert "columns hidden" not in out  # the table alone on stdout
    else:
        assert "columns hidden" not in err and "cas" in out and "time" in out


def test_diff_names_the_hidden_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"0": {"failover_log": [[1234, 0]], "seq": 10}}))
    b.write_text(json.dumps({"0": {"failover_log": [[1234, 0]], "seq": 5}}))
    monkeypatch.setattr(output.stdout, "width", 80)
    code, out, err = run_upr(capsys, "diff", str(a), str(b))
    assert code == 5 and "behind" in out, err
    wide = "dcp rule, common ancestor, only in A, only in B"
    assert HIDDEN.format(80, wide) in err.replace("\n", " ")
    monkeypatch.setattr(output.stdout, "width", 120)
    code, out, err = run_upr(capsys, "diff", str(a), str(b))
    assert code == 5 and "common ancestor" in out and "columns hidden" not in err
    monkeypatch.setattr(output.stdout, "width", 80)  # identical: no table, no line
    code, out, err = run_upr(capsys, "diff", str(a), str(a))
    assert code == 0 and "columns hidden" not in err
