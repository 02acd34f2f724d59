"""`upr rollback-point`: where must a client roll back to, by the seed or the producer rule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from upr_cli.errors import UsageError
from upr_cli.failover import (
    MAX_ENTRIES,
    FailoverLog,
    InvalidFailoverLog,
    RollbackDecision,
    needs_rollback,
    parse_uuid,
    rollback_point,
)


def load_log(spec: str, what: str, max_entries: int = MAX_ENTRIES) -> FailoverLog:
    """A failover log from inline JSON or `@path` to a file holding it."""
    text = spec
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise UsageError(f"{what}: {path} is not UTF-8 text") from None
    try:
        return FailoverLog.loads(text, max_entries)
    except InvalidFailoverLog as exc:
        raise InvalidFailoverLog(f"{what}: {exc}") from None


@dataclass(frozen=True, slots=True)
class DcpArgs:
    """The STREAM_REQ fields and server state the producer rule needs."""

    start: int | None = None
    high: int | None = None
    uuid: str | None = None
    snap_start: int | None = None
    snap_end: int | None = None
    purge_seq: int = 0
    client_purge_seq: int = 0
    strict: bool = False


def compute(
    *,
    rule: str,
    server_log: FailoverLog,
    client_log: FailoverLog | None,
    snapshot_seq: int | None,
    seen_seq: int | None,
    dcp: DcpArgs | None = None,
) -> RollbackDecision:
    """Run the chosen rule; missing or inconsistent arguments raise UsageError."""
    if rule == "seed":
        missing = [
            n
            for n, v in (
                ("--client-log", client_log),
                ("--snapshot-seq", snapshot_seq),
                ("--seen-seq", seen_seq),
            )
            if v is None
        ]
        if missing:
            raise UsageError(f"the seed rule needs {', '.join(missing)}")
        assert client_log is not None and snapshot_seq is not None and seen_seq is not None
        return rollback_point(server_log, client_log, snapshot_seq, seen_seq)
    if rule == "dcp":
        start = dcp.start if dcp is not None and dcp.start is not None else seen_seq
        if dcp is None or start is None or dcp.high is None:
            raise UsageError("the dcp rule needs --start (or --seen-seq) and --high-seq")
        if dcp.uuid is not None:
            uuid = parse_uuid(dcp.uuid, hex_strings=True, where="--uuid")
        elif client_log is not None and client_log.entries:
            uuid = client_log.latest.uuid
        else:
            raise UsageError("the dcp rule needs --uuid (or --client-log to take its newest uuid)")
        snap_start = start if dcp.snap_start is None else dcp.snap_start
        snap_end = start if dcp.snap_end is None else dcp.snap_end
        return needs_rollback(
            server_log,
            start=start,
            uuid=uuid,
            snap_start=snap_start,
            snap_end=snap_end,
            high=dcp.high,
            purge_seq=dcp.purge_seq,
            client_purge_seq=dcp.client_purge_seq,
            strict=dcp.strict,
        )
    raise UsageError(f"unknown rule {rule!r}: use 'seed' or 'dcp'")
