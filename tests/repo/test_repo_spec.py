"""formats/repository.md and the code agree: the example loads, every field is specified."""

from __future__ import annotations

import re
from pathlib import Path

from upr_cli.repo import (
    BackupId,
    Manifest,
    SegmentName,
    format_segment_name,
    parse_temp_name,
)

SPEC = (Path(__file__).resolve().parents[2] / "formats" / "repository.md").read_text()


def example() -> bytes:
    block = re.search(r"### 5\.8 Example\s+```json\n(.*?)```", SPEC, re.S)
    assert block, "formats/repository.md lost its example manifest"
    return block.group(1).encode()


def test_the_example_manifest_loads() -> None:
    m = Manifest.loads(example())
    assert Manifest.loads(m.dumps()) == m
    entry = m.partition(3)
    assert entry is not None and entry.rollback is not None
    assert m.totals.rollbacks == 1


def test_every_field_is_in_a_table() -> None:
    m = Manifest.loads(example())
    p = m.partitions[0]
    objects = [m.to_json(), p.to_json(), p.segments[0].to_json(), m.totals.to_json()]
    assert p.rollback is not None
    objects.append(p.rollback.to_json())
    for obj in objects:
        for key in obj:
            assert f"| `{key}` |" in SPEC, f"formats/repository.md does not specify {key!r}"
    assert "| `checksum` |" in SPEC and '`{"start": decimal string' in SPEC


def test_the_grammar_examples_parse() -> None:
    assert BackupId.parse("20261121T061500.123456Z").format() == "20261121T061500.123456Z"
    name = "p03ff-s0000000000000001-e00000000000004d2.seg"
    assert name in SPEC and SegmentName.parse(name) == SegmentName(0x3FF, 1, 0x4D2)
    assert format_segment_name(3, 81, 150) in SPEC
    assert parse_temp_name(".manifest.json.tmp-1f0c9a3b") == "manifest.json"


REVISION = Path(__file__).resolve().parents[2] / "formats" / "vectors" / "revision-manifest.json"


def test_the_revision_vector_loads_and_is_specified() -> None:
    """formats/vectors/revision-manifest.json: a version 3 manifest
    (formats/repository.md §5.10) with a revision, absorbed backups, a lost_bound and a
    cut-back carried forward."""
    from upr_cli.repo.names import format_backup_dir, parse_backup_dir

    data = REVISION.read_bytes()
    m = Manifest.loads(data)
    assert m.dumps() == data  # the vector is what the writer writes, byte for byte
    assert m.version == 3 and m.revision == 2 and len(m.absorbed) == 2
    entry = m.partition(3)
    assert entry is not None and entry.lost_bound == 55 and entry.cut_backs
    for obj in (m.to_json(), entry.to_json()):
        for key in obj:
            assert f"| `{key}` |" in SPEC, f"formats/repository.md does not specify {key!r}"
    name = format_backup_dir(m.backup_id, m.revision)
    assert name == "20261124T061500.123456Z-r00000002"
    assert parse_backup_dir(name) == (m.backup_id, 2)
    assert parse_backup_dir(str(m.backup_id)) == (m.backup_id, 1)


def test_revision_directory_names_are_strict() -> None:
    import pytest

    from upr_cli.repo import RepositoryError
    from upr_cli.repo.names import parse_backup_dir

    for bad in ("20261124T061500.123456Z-r00000001", "20261124T061500.123456Z-r2",
                "20261124T061500.123456Z-r00000000", "20261124T061500.123456Z.r00000002",
                "20261124T061500.123456Z-R00000002"):  # fmt: skip
        with pytest.raises(RepositoryError):
            parse_backup_dir(bad)
