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
