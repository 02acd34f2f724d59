"""`upr examine` with xattrs: names in the table (readable at 80 columns), values in --json."""

from __future__ import annotations

import io
import json

from rich.cells import cell_len
from rich.console import Console

from tests.cli.json_convention import problems
from upr_cli.cli import examine as examine_cli
from upr_cli.jobs.examine import Version
from upr_cli.protocol import xattrs

BACKUP = "20261121T061500.123456Z"
BLOB = xattrs.encode({"_sync": '{"rev":"1-a","history":["1-a"]}', "meta": '"x"',
                      "_txn": '{"id":7}', "appinfo": "[1, 2]"})  # fmt: skip


def versions() -> list[Version]:
    return [
        Version(BACKUP, 12, 10, "mutation", 1 << 62, 7, 0, 0, b'{"a":1}', 1, False, False,
                xattrs=BLOB),
        Version(BACKUP, 12, 1234567, "deletion", 5, 8, 0, 0, b"", 0, True, False,
                xattrs=xattrs.system_only(BLOB)),
        Version(BACKUP, 12, 20, "mutation", 6, 9, 0, 0, b'{"b":2}', 1, False, True),
    ]  # fmt: skip


def render(width: int, given: list[Version]) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, legacy_windows=False).print(
        examine_cli.versions_table("user::1042", given, width=width)
    )
    return buf.getvalue()


def test_the_table_names_the_xattrs_and_keeps_its_columns_whole_at_80() -> None:
    text = render(80, versions())
    assert all(cell_len(line) <= 80 for line in text.splitlines()), text
    for cell in (BACKUP, "1234567", "lost write", "superseded", "latest", "deletion", "xattrs"):
        assert cell in text, text
    assert "…" not in text
    # the names fold into the room left, whole: the tombstone's kept system xattrs too
    words = text.replace(",", " ").split()
    assert {"_sync", "meta", "_txn", "appinfo"} <= set(words)
    tomb = text[text.index("1234567") :].split(BACKUP)[0]
    assert "_sync" in tomb and "_txn" in tomb and "meta" not in tomb
    wide = render(130, versions())
    assert "_sync, meta, _txn, appinfo" in wide and str(1 << 62) in wide


def test_no_xattrs_no_column() -> None:
    assert "xattrs" not in render(120, versions()[2:])


def test_json_has_the_values_and_an_empty_object_for_none() -> None:
    docs = [json.loads(json.dumps(v.to_json())) for v in versions()]
    assert docs[0]["xattrs"] == {"_sync": {"rev": "1-a", "history": ["1-a"]}, "meta": "x",
                                 "_txn": {"id": 7}, "appinfo": [1, 2]}  # fmt: skip
    assert docs[0]["value"] == {"a": 1}
    assert docs[1]["xattrs"] == {"_sync": {"rev": "1-a", "history": ["1-a"]}, "_txn": {"id": 7}}
    assert docs[1]["value"] is None and docs[2]["xattrs"] == {}
    for doc in docs:
        assert not problems({k: v for k, v in doc.items() if k != "xattrs"})
