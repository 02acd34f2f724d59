"""The JSON convention of docs/output.md as a check: what a `--json` document breaks.

64-bit protocol values (seqs, uuids, cas, rev seqs) are decimal strings; counts, bytes
and partition numbers are integers; the number of items a command handled is `items`,
never one of the names it had before the convention; a document's `schema` version is
an integer.
"""

from __future__ import annotations

from typing import Any

#: fields holding a 64-bit protocol value: a decimal string (or null)
SIXTY_FOUR = frozenset({
    "seq", "cas", "uuid", "rev_seq", "a_seq", "b_seq", "diverged_at", "rollback_seq",
    "seed_rule_seq", "producer_seq", "high_seq", "start", "end", "from", "to", "cut",
    "bound", "snap_start", "snap_end", "high_seqno", "persisted_seqno",
    "complete_snapshot_seqno", "manifest_uid",
})  # fmt: skip
#: fields holding a count, a byte count or a partition number: an integer
INTEGERS = frozenset({
    "items", "partition", "segments", "backups", "bytes", "bytes_read", "bytes_written",
    "created", "updates", "deletes", "overwritten", "documents", "deletions", "written",
    "conflicts", "absent_deletes", "items_per_s", "retries", "commits", "resets",
    "reused_segments", "merged", "flags", "expiry", "schema", "target_has_same_or_newer",
    "must_roll_back_count", "impossible", "collection_count", "backup_count", "rollback_count",
    "lost_writes", "manifest_changes", "with_xattrs", "xattrs_left_out", "errors",
    "applied", "backups_copied", "backups_skipped", "files", "files_reused",
    "partition_count", "dropped_records", "backups_removed", "lost_seq_count",
})  # fmt: skip
#: names an item count had before the convention (docs/output.md "Names")
OLD_COUNT_NAMES = frozenset({"ops", "ops_per_s", "sets", "rows", "records", "changes", "new"})


def problems(doc: Any, path: str = "$") -> list[str]:
    """Every place `doc` breaks the convention, as "path: what"."""
    out: list[str] = []
    if isinstance(doc, list):
        for i, item in enumerate(doc):
            out += problems(item, f"{path}[{i}]")
    elif isinstance(doc, dict):
        for key, value in doc.items():
            where = f"{path}.{key}"
            if (
                key in OLD_COUNT_NAMES
                and isinstance(value, int | float)
                and not isinstance(value, bool)
            ):
                out.append(f"{where}: an item count is called items")
            if key in SIXTY_FOUR and not _decimal(value):
                out.append(f"{where}: a 64-bit value is a decimal string, not {value!r}")
            # a list under such a name holds the things themselves (info's backups)
            if (
                key in INTEGERS
                and value is not None
                and not isinstance(value, list)
                and not _integer(value)
            ):
                out.append(f"{where}: a count is an integer, not {value!r}")
            out += problems(value, where)
    return out


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _decimal(value: Any) -> bool:
    """A decimal string, null, or an object (a rollback's `from`/`to` pair)."""
    return value is None or isinstance(value, dict) or (isinstance(value, str) and value.isdigit())
