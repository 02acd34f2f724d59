"""The references the SQLite paths are held to: one bare `executemany` of the same rows
into the same schema (formats/store.md), in one transaction, in this process."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Row = tuple[object, ...]


def bare_executemany(rows: list[Row], db: Path) -> float:
    """rows/s of ONE bare executemany of `documents` rows (formats/store.md column order)
    into a new store's schema, in one transaction: the reference the store is held to."""
    from upr_cli.store import Store

    with Store(db) as s:
        conn = s.db.conn
        t = time.perf_counter()
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO documents (partition, key, seq, rev_seq, cas, flags, expiry,"
            " delete_time, datatype, deleted, value, collection_id)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )
        conn.execute("COMMIT")
        return len(rows) / (time.perf_counter() - t)


def repo_rows(repo: Path) -> list[Row]:
    """The rows a restore of the repository's latest state into SQLite writes, partition
    by partition in seq order (the order it applies them)."""
    from upr_cli.jobs.restore import partition_state
    from upr_cli.jobs.state import select
    from upr_cli.protocol.decoder import OP_MUTATION
    from upr_cli.repo import Repository

    r = Repository(repo)
    manifests = r.manifests("default")
    sel = select(manifests)
    rows: list[Row] = []
    for p in sel.partitions:
        state = partition_state(r, "default", manifests, sel.backup_id, p)
        for rec in sorted(state.values(), key=lambda r: r.seq):
            value: bytes | str = rec.value.decode() if rec.datatype & 7 == 1 else rec.value
            cas = rec.cas - (1 << 64) if rec.cas >= 1 << 63 else rec.cas
            deleted = 0 if rec.op == OP_MUTATION else 1
            rows.append((p, rec.key, rec.seq, rec.rev_seq, cas, rec.flags, rec.expiry,
                         rec.delete_time, rec.datatype, deleted, value,
                         rec.collection))  # fmt: skip
    return rows


def bare_insert_rate(repo: Path, scratch: Path) -> tuple[float, int]:
    """(rows/s, rows) of one bare executemany of the rows a restore of `repo` writes."""
    rows = repo_rows(repo)
    return bare_executemany(rows, scratch / "bare.db"), len(rows)
