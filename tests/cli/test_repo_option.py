"""`--repo`: a local directory or `s3://BUCKET/PREFIX` (served by the object store,
tests/s3); a location with a scheme no storage backend serves (`gs://…`, `file://…`) is
a usage error on every command that takes it, and nothing is created (`s3://` used to
make a local directory named `s3:`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from upr_cli.cli.app import main
from upr_cli.cli.options import repo_location
from upr_cli.errors import ExitCode
from upr_cli.source import parse_source
from upr_cli.storage import UnknownScheme, is_s3, local_root, parse_location, s3_parts

DEAD = "upr://127.0.0.1:1/default"  # nothing listens: the option is refused before
REPO_COMMANDS = [
    ["backup", DEAD],
    ["restore", "sqlite:/tmp/never.db"],
    ["info"],
    ["verify"],
    ["examine", "some-key"],
    ["salvage", "--into", DEAD],
    ["spark", "export", "--output", "/tmp/never-export"],
    ["spark", "merge"],
    ["repo", "unlock"],
]


def test_a_plain_path_is_the_local_directory() -> None:
    assert local_root("/backups/cb") == Path("/backups/cb")
    assert local_root("rel/dir") == Path("rel/dir")
    assert local_root("odd:name") == Path("odd:name")  # a colon without // is a file name
    assert repo_location("/backups/cb") == Path("/backups/cb")
    assert repo_location(Path("/x")) == Path("/x")


def test_s3_is_the_object_store() -> None:
    path = repo_location("s3://bucket/some/prefix/")
    assert is_s3(path) and s3_parts(path) == ("bucket", "some/prefix")
    assert parse_location("S3://B") == parse_location("s3://B")
    src = parse_source("repo:s3://bucket/p@20261121T061500.123456Z")
    assert src.path == path.parent.parent / "p" and src.at == "20261121T061500.123456Z"
    assert parse_source("repo:s3://bucket/p").at is None


@pytest.mark.parametrize("location", ["gs://b", "file:///tmp/r", "azure://c/x"])
def test_a_scheme_no_backend_serves_is_refused(location: str) -> None:
    with pytest.raises(UnknownScheme, match="repositories are not supported"):
        parse_location(location)
    with pytest.raises(typer.BadParameter, match=f"{location!r}"):
        repo_location(location)


@pytest.mark.parametrize("args", REPO_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_command_refuses_other_schemes_and_creates_nothing(
    args: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main([*args, "--repo", "gs://bucket/x"])
    _out, err = capsys.readouterr()
    assert info.value.code == ExitCode.USAGE
    assert err.count("\n") == 1, err
    # (click names the option's environment variable too, UPR_REPO, where it has one)
    assert "Invalid value for '--repo'" in err
    assert "'gs://bucket/x': gs:// repositories" in err
    assert list(tmp_path.iterdir()) == []  # no directory named `gs:`
