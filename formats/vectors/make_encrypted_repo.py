"""Regenerate `encrypted-repo/`: a tiny encrypted repository (formats/repository.md §10)
and what it holds (run only when the encrypted format changes).

Usage: python formats/vectors/make_encrypted_repo.py
Writes encrypted-repo/repo (repo.json, one bucket `vec`, one full backup of partition 3
holding three documents and a deletion, every file but repo.json sealed),
encrypted-repo/key (its key file: the passphrase and a newline, which the newline rule
drops) and encrypted-repo/expected.json (the records, bytes as text). The repository id,
the data key, the salt and every file id are random: a new run writes other bytes that
decode to the same records. tests/repo/test_repo_keys.py opens it with the key.
"""

from __future__ import annotations

import json
import shutil
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from upr_cli.failover import FailoverLog  # noqa: E402
from upr_cli.protocol.decoder import OP_DELETION, OP_MUTATION, DcpRecord  # noqa: E402
from upr_cli.repo import (  # noqa: E402
    BackupId,
    Manifest,
    PartitionEntry,
    Repository,
    SegmentEntry,
    Totals,
    format_segment_name,
)
from upr_cli.repo.access import Access  # noqa: E402
from upr_cli.repo.keys import create_encrypted  # noqa: E402
from upr_cli.segments import SegmentHeader, SegmentWriter  # noqa: E402

OUT = HERE / "encrypted-repo"
BUCKET, PARTITION = "vec", 3
LOG = FailoverLog.of([(0xC0FFEE, 0)])
ID = BackupId(datetime(2026, 12, 6, 12, 0, tzinfo=UTC))
DOCS = [  # seq, key, value (None: a deletion)
    (1, b"alpha", b'{"n":1}'),
    (2, b"beta", b'{"n":2,"secret":"plaintext-must-not-show"}'),
    (3, b"gamma", b"raw bytes"),
    (4, b"alpha", None),
]


def records() -> list[DcpRecord]:
    return [DcpRecord(OP_MUTATION if v is not None else OP_DELETION, PARTITION, seq, 1,
                      1000 + seq, 0, 0, 0, 1 if v and v[:1] == b"{" else 0, k, v or b"", 0)
            for seq, k, v in DOCS]  # fmt: skip


def build(root: Path, key_file: Path) -> Manifest:
    """An encrypted repository at `root` (key in `key_file`) with one backup of DOCS."""
    repo = Repository(root, access=Access(key_file=key_file))
    create_encrypted(repo)
    d = repo.new_backup_dir(BUCKET, ID)
    high = DOCS[-1][0]
    hdr = SegmentHeader(BUCKET, PARTITION, LOG, 0, high, ((0, high),),
                        "2026-12-06T12:00:00.000000Z", "upr://h/vec", 4096)  # fmt: skip
    w = SegmentWriter(d / f"p{PARTITION:04x}.open", hdr, storage=repo.storage)
    w.add(records())
    name = format_segment_name(PARTITION, 1, high)
    i = w.finish(path=d / name)
    seg = SegmentEntry(name, i.first_seq, i.last_seq, i.records, i.bytes, i.checksum)
    entry = PartitionEntry(PARTITION, 0xC0FFEE, LOG, 0, high, high, high, (seg,))
    m = Manifest(ID, BUCKET, "upr://h/vec", ID.time, ID.time + timedelta(seconds=1), True,
                 None, (entry,), Totals.derive([entry], 1))  # fmt: skip
    repo.write_manifest(m)
    return m


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    key = OUT / "key"
    key.write_bytes(b"correct horse battery staple\n")
    build(OUT / "repo", key)
    expected = {
        "bucket": BUCKET,
        "backup_id": str(ID),
        "partition": PARTITION,
        "records": [
            {"seq": s, "key": k.decode(), "value": None if v is None else v.decode()}
            for s, k, v in DOCS
        ],
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")


if __name__ == "__main__":
    main()
