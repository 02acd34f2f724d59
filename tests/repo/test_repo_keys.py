"""Keys of encrypted repositories (upr_cli/repo/keys.py, formats/repository.md §10): the
key sources and their one newline rule, key slots added, removed and rotated, a wrong
key and no key refused before anything is read, and the vector repository."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.repo.repo_helpers import run_upr as upr
from upr_cli.repo import access
from upr_cli.repo.access import Access
from upr_cli.repo.keys import BadKeySource, MissingKey, WrongKey, create_encrypted, read_secret
from upr_cli.repo.layout import NotARepository, RepoInfo, Repository
from upr_cli.repo.sealed import EncryptedStorage
from upr_cli.segments import SegmentReader

VECTOR = Path(__file__).resolve().parents[2] / "formats" / "vectors" / "encrypted-repo"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("UPR_KEY_FILE", "UPR_PASSPHRASE", "UPR_NEW_PASSPHRASE"):
        monkeypatch.delenv(name, raising=False)
    access.reset()
    yield
    access.reset()


def test_newline_rule_and_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`echo pw > f` and `printf pw > f` are one key, from every source; the first
    source found wins."""
    echoed, printed = tmp_path / "echoed", tmp_path / "printed"
    subprocess.run(f"echo pw > {echoed}; printf pw > {printed}", shell=True, check=True)
    repo = tmp_path / "r"
    create_encrypted(Repository(repo, access=Access(key_file=echoed)))
    assert Repository(repo, access=Access(key_file=printed)).info().version == 3
    assert read_secret(Access(key_command="echo pw")) == b"pw"
    assert read_secret(Access(key_command="printf 'pw\\n\\n'")) == b"pw\n"  # ONE newline
    monkeypatch.setenv("UPR_PASSPHRASE", "pw\n")
    assert read_secret(Access()) == b"pw"
    monkeypatch.setenv("UPR_KEY_FILE", str(printed))
    monkeypatch.setenv("UPR_PASSPHRASE", "other")
    assert read_secret(Access()) == b"pw"  # UPR_KEY_FILE before UPR_PASSPHRASE
    assert read_secret(Access(key_command="echo cmd")) == b"cmd"  # the command first
    assert read_secret(Access(key_file=echoed, key_command="echo cmd")) == b"pw"


def test_bad_sources_are_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    with pytest.raises(BadKeySource, match="is empty"):
        read_secret(Access(key_file=empty))
    with pytest.raises(BadKeySource, match="cannot read"):
        read_secret(Access(key_file=tmp_path / "missing"))
    with pytest.raises(BadKeySource, match="exited with status 3: nope"):
        read_secret(Access(key_command="echo nope >&2; exit 3"))
    assert read_secret(Access()) is None


def test_random_key_file_wrong_key_and_no_key(tmp_path: Path) -> None:
    key, other = tmp_path / "key", tmp_path / "other"
    key.write_bytes(os.urandom(32))
    other.write_bytes(os.urandom(32))
    path = tmp_path / "r"
    create_encrypted(Repository(path, access=Access(key_file=key)))
    before = sorted(p.name for p in path.rglob("*"))
    with pytest.raises(WrongKey, match=r"opens none of its 1 key slot$"):
        Repository(path, access=Access(key_file=other)).check_init()
    with pytest.raises(MissingKey, match="give its key with --key-file"):
        Repository(path, access=Access()).new_backup_dir("b", _id())
    assert sorted(p.name for p in path.rglob("*")) == before  # nothing created
    repo = Repository(path, access=Access(key_file=key))
    assert isinstance(repo.storage.inner, EncryptedStorage)  # under the pack layer
    # a Spark executor: the data key alone opens it; a wrong one is refused
    handed = repo.keyed_access()
    assert handed.key_file == key and repr(repo.storage.data_key) not in repr(handed)
    executor = Repository(path, access=Access(data_keys=handed.data_keys))
    assert isinstance(executor.storage.inner, EncryptedStorage)
    wrong = {k: bytes(32) for k in handed.data_keys}
    with pytest.raises(WrongKey, match="data key given"):
        Repository(path, access=Access(data_keys=wrong)).info()


def _id() -> object:
    from tests.repo.repo_helpers import bid

    return bid(0)


def test_repo_json_versions(tmp_path: Path) -> None:
    """A plain repository's repo.json is as before; version 3 needs its id and
    `encryption`, and older upr (versions 1, 2) refuses version 3 by its number."""
    plain = Repository(tmp_path / "p").init()
    assert set(plain.to_json()) == {"format", "version", "created"} and plain.version == 1
    key = tmp_path / "k"
    key.write_bytes(b"pw")
    r = Repository(tmp_path / "e", access=Access(key_file=key))
    create_encrypted(r)
    data = json.loads((tmp_path / "e" / "repo.json").read_text())
    assert data["version"] == 3 and len(data["id"]) == 32
    assert RepoInfo.from_json(data, "x").encryption is not None
    del data["encryption"]
    with pytest.raises(Exception, match="expected keys"):
        RepoInfo.from_json(data, "x")
    (tmp_path / "e" / "repo.json").write_text(json.dumps(data))
    with pytest.raises(NotARepository):
        Repository(tmp_path / "e", access=Access(key_file=key)).info()


def test_key_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    k1, k2, k3 = (tmp_path / n for n in ("k1", "k2", "k3"))
    for k in (k1, k2, k3):
        k.write_bytes(os.urandom(32))
    repo = str(tmp_path / "r")
    code, out, err = upr(capsys, "repo", "init", "--repo", repo, "--encrypt")
    assert code == 2 and "to encrypt it: give its key with --key-file" in err
    assert not (tmp_path / "r").exists()
    code, out, _ = upr(capsys, "repo", "init", "--repo", repo, "--encrypt", "--key-file", str(k1))
    assert code == 0 and "created encrypted repository" in out
    code, out, _ = upr(capsys, "repo", "keys", "--repo", repo, "--json")
    (first,) = json.loads(out)["key_slots"]
    code, out, _ = upr(capsys, "repo", "keys", "--repo", repo)  # the table, no key needed
    assert code == 0 and first["slot_id"] in out and first["created_at"] in out
    code, out, _ = upr(capsys, "repo", "add-key", "--repo", repo, "--key-file", str(k1),
                       "--new-key-file", str(k2), "--json")  # fmt: skip
    assert code == 0
    second = json.loads(out)["slot_id"]
    assert [s["slot_id"] for s in json.loads(out)["key_slots"]] == [first["slot_id"], second]
    # rotate k2 -> k3: k2's slot goes, k1's stays; one write of repo.json
    code, out, _ = upr(capsys, "repo", "rotate-key", "--repo", repo, "--key-file", str(k2),
                       "--new-key-file", str(k3))  # fmt: skip
    assert code == 0 and f"key slot {second} replaced by" in out
    code, _, err = upr(capsys, "info", "--repo", repo, "--key-file", str(k2))
    assert code == 2 and err.strip().endswith("the key opens none of its 2 key slots")
    code, _, err = upr(capsys, "info", "--repo", repo)
    assert code == 2 and "is encrypted: give its key" in err and len(err.splitlines()) == 1
    code, out, _ = upr(capsys, "repo", "remove-key", first["slot_id"], "--repo", repo,
                       "--key-file", str(k3))  # fmt: skip
    assert code == 0 and "(1 key slot)" in out
    code, _, err = upr(capsys, "repo", "remove-key", json.loads(
        upr(capsys, "repo", "keys", "--repo", repo, "--json")[1])["key_slots"][0]["slot_id"],
        "--repo", repo, "--key-file", str(k3))  # fmt: skip
    assert code == 2 and "is the last key slot" in err
    code, _, err = upr(capsys, "repo", "init", "--repo", repo, "--encrypt",
                       "--key-file", str(k3))  # fmt: skip
    assert code == 2 and "already a upr repository" in err
    assert upr(capsys, "info", "--repo", repo, "--key-file", str(k3))[0] == 0
    plain = str(tmp_path / "plain")
    assert upr(capsys, "repo", "init", "--repo", plain)[0] == 0
    code, _, err = upr(capsys, "repo", "keys", "--repo", plain)
    assert code == 2 and "not encrypted" in err


def test_a_key_command_never_overwrites_a_repo_json_changed_meanwhile(tmp_path: Path) -> None:
    from upr_cli.repo.keys import EncryptionKeyError, add_slot, rewrite_slots

    key = tmp_path / "k"
    key.write_bytes(b"pw")
    repo = Repository(tmp_path / "r", access=Access(key_file=key))
    create_encrypted(repo)
    info, slot, _opened = add_slot(repo, b"second")
    assert info.encryption is not None
    rewrite_slots(repo, info, (*info.encryption.keys, slot))  # another command's write
    before = (tmp_path / "r" / "repo.json").read_bytes()
    with pytest.raises(EncryptionKeyError, match="changed meanwhile"):
        rewrite_slots(repo, info, (slot,))
    assert (tmp_path / "r" / "repo.json").read_bytes() == before


def test_vector_opens_with_its_key() -> None:
    expected = json.loads((VECTOR / "expected.json").read_text())
    repo = Repository(VECTOR / "repo", access=Access(key_file=VECTOR / "key"))
    assert repo.info().version == 3
    (m,) = repo.manifests(expected["bucket"])
    assert str(m.backup_id) == expected["backup_id"]
    (entry,) = m.partitions
    (seg,) = entry.segments
    path = repo.segment_path(expected["bucket"], m.backup_id, seg.file)
    with SegmentReader(path, repo.storage) as r:
        got = [{"seq": x.seq, "key": bytes(x.key).decode(),
                "value": None if x.op == 0x58 else bytes(x.value).decode()}
               for x in r.records()]  # fmt: skip
    assert got == expected["records"]
    assert b"plaintext-must-not-show" not in path.read_bytes()
    with pytest.raises(MissingKey):
        Repository(VECTOR / "repo", access=Access()).info()
