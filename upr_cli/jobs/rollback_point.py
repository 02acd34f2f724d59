"""`upr rollback-point`: where must a client roll back to, by the seed or the producer rule."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from upr_cli.errors import UprError, UsageError
from upr_cli.failover import (
    MAX_ENTRIES,
    FailoverLog,
    InvalidFailoverLog,
    RollbackDecision,
    needs_rollback,
    parse_seq,
    parse_uuid,
    rollback_point,
)
from upr_cli.net.tls import ClientTls
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition


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
        # the rule reads no partition number: the logs given are one partition's
        request = StreamPosition(0, uuid, start, snap_start, snap_end)
        return needs_rollback(
            server_log,
            request,
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
    it stands (the last complete snapshot and the highest seq seen; `position` when the
    source records a stream position, as a repository or a store does)."""

    log: FailoverLog
    snapshot_seq: int = 0
    seen_seq: int = 0
    position: StreamPosition | None = None
    known_seq: bool = True  # False: a JSON file gave only the log


async def node_states(
    uri: SourceUri, partitions: list[int] | None
) -> tuple[dict[int, SourceState], int]:
    """Each partition's failover log and high seq from its active node (`dcp.states`),
    and the partition count; a partition the node gives no failover log is left out."""
    from upr_cli.dcp.states import partition_states

    states, n = await partition_states(uri, partitions, failover_logs=True,
                                       name="upr-failover-logs")  # fmt: skip
    return {
        p: SourceState(st.failover_log, st.high_seq, st.high_seq)
        for p, st in states.items()
        if st.failover_log is not None
    }, n


async def _node_logs(
    spec: str, partitions: list[int] | None, tls: ClientTls | None
) -> dict[int, SourceState]:
    uri = SourceUri.parse(spec)
    return (await node_states(uri if tls is None else uri.with_tls(tls), partitions))[0]


def _repo_states(path: str, at: str | None, partitions: list[int] | None,
                 command: str) -> dict[int, SourceState]:  # fmt: skip
    from upr_cli.repo import resume_point
    from upr_cli.repo.readers import read_lock
    from upr_cli.source import open_repo

    repo = open_repo(Path(path))
    names = repo.buckets()
    if len(names) != 1:
        raise UsageError(f"{path}: holds buckets {', '.join(names) or 'none'}; one expected")
    with read_lock(repo, names[0], command):
        manifests = repo.manifests(names[0])
    if at:
        manifests = [m for m in manifests if str(m.backup_id) <= at]
        if not manifests or str(manifests[-1].backup_id) != at:
            raise UsageError(f"repo:{path}@{at}: no committed backup {at!r}")
    held = sorted({e.partition for m in manifests for e in m.partitions})
    out = {}
    for p in held if partitions is None else [p for p in held if p in set(partitions)]:
        rp = resume_point(manifests, p)
        if rp is not None:
            pos = rp.position
            snap = pos.snap_end if pos.seq == pos.snap_end else pos.snap_start
            out[p] = SourceState(rp.failover_log, min(snap, pos.seq), pos.seq, pos)
    return out


def _store_states(path: str, partitions: list[int] | None) -> dict[int, SourceState]:
    from upr_cli.store import Store

    with Store(path, create=False) as store:
        out = {}
        for p, pos in store.positions().items():
            if partitions is not None and p not in partitions:
                continue
            log = store.failover_log(p) or FailoverLog()
            snap = pos.snap_end if pos.seq == pos.snap_end else pos.snap_start
            out[p] = SourceState(log, min(snap, pos.seq), pos.seq, pos)
        return out


def _json_states(path: str, partitions: list[int] | None) -> dict[int, SourceState]:
    """A JSON file: {"<partition>": LOG} or {"<partition>": {"failover_log": LOG,
    "seq": N, "snapshot_seq": N}}, optionally under a top-level "partitions" key."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: not a JSON file of failover logs: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("partitions"), dict):
        data = data["partitions"]
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected an object of partition -> failover log")
    out = {}
    for key, value in data.items():
        try:
            p = int(key)
            if not 0 <= p <= 0xFFFF:
                raise ValueError
        except ValueError:
            raise UsageError(f"{path}: {key!r} is not a partition id") from None
        if partitions is not None and p not in partitions:
            continue
        obj = value if isinstance(value, dict) else {"failover_log": value}
        try:
            log = FailoverLog.from_json(obj.get("failover_log"))
        except UsageError as exc:
            raise UsageError(f"{path}: partition {p}: {exc}") from None
        known = "seq" in obj
        seen = parse_seq(obj.get("seq", log.latest.seq if log.entries else 0), where="seq")
        snap = parse_seq(obj.get("snapshot_seq", seen), where="snapshot_seq")
        out[p] = SourceState(log, min(snap, seen), seen, None, known)
    return out


def load_source(
    spec: str, partitions: list[int] | None, tls: ClientTls | None = None,
    command: str = "rollback-point",
) -> dict[int, SourceState]:  # fmt: skip
    """Per-partition states from `upr://…` (a live node; `tls`: how a uprs:// one is
    checked, else from the environment), `repo:URL[@BACKUP]`, `sqlite:PATH` (a replay
    store) or a JSON file of failover logs (`json:PATH` or a path ending in .json). A
    repository is read under its bucket's shared lock, taken for `command`."""
    from upr_cli.source import parse_source

    source = parse_source(spec, ("node", "repo", "sqlite", "json"))
    if source.kind == "node":
        import asyncio

        return asyncio.run(_node_logs(spec, partitions, tls))
    assert source.path is not None  # parse_source: every local form has a path
    if source.kind == "repo":
        return _repo_states(str(source.path), source.at, partitions, command)
    if source.kind == "sqlite":
        return _store_states(str(source.path), partitions)
    return _json_states(str(source.path), partitions)


@dataclass(frozen=True, slots=True)
class PartitionDecision:
    """The seed rule's answer for one partition (or why there is none)."""

    partition: int
    decision: RollbackDecision | None
    error: str | None = None


def compare_sources(
    server: str, client: str, partitions: list[int] | None, tls: ClientTls | None = None
) -> list[PartitionDecision]:
    """The seed rule per partition: the server's log against the client's log and position."""
    srv = load_source(server, partitions, tls)
    cli = load_source(client, partitions, tls)
    out = []
    for p in sorted(set(srv) & set(cli)):
        c = cli[p]
        try:
            d = rollback_point(srv[p].log, c.log, c.snapshot_seq, c.seen_seq)
            out.append(PartitionDecision(p, d))
        except UprError as exc:
            out.append(PartitionDecision(p, None, str(exc)))
    return out
