"""`upr rollback-point`: where must a client roll back to, by the seed or the producer rule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from upr_cli.errors import UprError, UsageError
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


# -- sources: a live node or a repository, per partition --------------------------------


@dataclass(frozen=True, slots=True)
class SourceState:
    """One partition as a source describes it: its failover log and, for a client, where
    it stands (the last complete snapshot and the highest seq seen)."""

    log: FailoverLog
    snapshot_seq: int = 0
    seen_seq: int = 0


async def _node_logs(spec: str, partitions: list[int] | None) -> dict[int, SourceState]:
    from upr_cli.net.bootstrap import connect
    from upr_cli.net.uri import SourceUri
    from upr_cli.protocol.header import Opcode
    from upr_cli.protocol.messages import FailoverLogResponse, GetFailoverLog

    s = await connect(SourceUri.parse(spec), name="upr-rollback-point")
    try:
        conn = s.conn
        wanted = partitions if partitions is not None else list(range(s.num_partitions))
        futs = [
            (
                p,
                conn.start_request(
                    GetFailoverLog(
                        opcode=Opcode.GET_FAILOVER_LOG, vbucket=p, opaque=conn.next_opaque()
                    )
                ),
            )
            for p in wanted
        ]
        stats = await conn.stats("vbucket-seqno")
        out = {}
        for p, fut in futs:
            resp = (await fut)[0]
            if isinstance(resp, FailoverLogResponse):
                high = int(stats.get(f"vb_{p}:high_seqno", 0))
                out[p] = SourceState(FailoverLog.sanitised(resp.failover_log), high, high)
        return out
    finally:
        await s.conn.aclose()


def _repo_states(spec: str, partitions: list[int] | None) -> dict[int, SourceState]:
    from upr_cli.jobs.inspect import open_repo
    from upr_cli.repo import resume_point

    path, _, at = spec.partition("@")
    repo = open_repo(Path(path))
    names = repo.buckets()
    if len(names) != 1:
        raise UsageError(f"{path}: holds buckets {', '.join(names) or 'none'}; one expected")
    manifests = repo.manifests(names[0])
    if at:
        manifests = [m for m in manifests if str(m.backup_id) <= at]
        if not manifests or str(manifests[-1].backup_id) != at:
            raise UsageError(f"repo:{spec}: no committed backup {at!r}")
    held = sorted({e.partition for m in manifests for e in m.partitions})
    out = {}
    for p in held if partitions is None else [p for p in held if p in set(partitions)]:
        rp = resume_point(manifests, p)
        if rp is not None:
            snap = rp.snap_end if rp.seq == rp.snap_end else rp.snap_start
            out[p] = SourceState(rp.failover_log, min(snap, rp.seq), rp.seq)
    return out


def load_source(spec: str, partitions: list[int] | None) -> dict[int, SourceState]:
    """Per-partition states from `upr://…` (a live node) or `repo:DIR[@BACKUP]`."""
    if spec.startswith(("upr://", "couchbase://")):
        import asyncio

        return asyncio.run(_node_logs(spec, partitions))
    if spec.startswith("repo:"):
        return _repo_states(spec[5:], partitions)
    raise UsageError(f"{spec!r}: a source is upr://… or repo:DIR[@BACKUP]")


@dataclass(frozen=True, slots=True)
class PartitionDecision:
    """The seed rule's answer for one partition (or why there is none)."""

    partition: int
    decision: RollbackDecision | None
    error: str | None = None


def compare_sources(
    server: str, client: str, partitions: list[int] | None
) -> list[PartitionDecision]:
    """The seed rule per partition: the server's log against the client's log and position."""
    srv = load_source(server, partitions)
    cli = load_source(client, partitions)
    out = []
    for p in sorted(set(srv) & set(cli)):
        c = cli[p]
        try:
            d = rollback_point(srv[p].log, c.log, c.snapshot_seq, c.seen_seq)
            out.append(PartitionDecision(p, d))
        except UprError as exc:
            out.append(PartitionDecision(p, None, str(exc)))
    return out
