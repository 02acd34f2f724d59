"""`upr tail`: print a bucket's changes as they stream (kcat-like).

Collections (docs/protocol.md "Collections"): each change is shown with its scope and
collection names, taken from the source's manifest at open (and, on a resume, the names
the state file kept of the collections it followed) and kept current with the
collections and scopes the streams create. Names are never forgotten: ids are never
reused, and a partition behind the others still sends changes of a collection another
one already saw dropped. Collections and scopes created and dropped are printed always:
a reader mirroring the bucket must see documents go with a dropped collection.

A `--state` file keeps, with a filter, the collection ids each partition followed, so
that a resume still hands over the drop of a collection dropped (and perhaps created
again under its name) meanwhile (docs/protocol.md §12.4).

Xattrs (formats/wire.md "Xattrs"): the consumer asks for them and hands each record's
blob apart from its body. A change that has some (a tombstone's system xattrs too)
shows them: in JSON as an `xattrs` object, each value as JSON, the field left out when
there are none (as `value` and `key_b64` are); in text as their names.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import NamedTuple, TextIO

from upr_cli.collections import DEFAULT, CollectionsError, CollectionsManifest, ManifestChange
from upr_cli.collections import Path as CollectionPath
from upr_cli.dcp.consumer import DcpConsumer, WireCompression
from upr_cli.dcp.events import Event, Rollback, Snapshot, StreamEnded, StreamOpened
from upr_cli.dcp.sink import SinkBase, drive
from upr_cli.errors import UprError, UsageError, check_file_path
from upr_cli.failover import FailoverLog
from upr_cli.memory import MemoryLimit
from upr_cli.net.uri import SourceUri
from upr_cli.position import StreamPosition
from upr_cli.protocol import xattrs
from upr_cli.protocol.decoder import OP_DELETION, OP_EXPIRATION, OP_MUTATION, DcpRecord
from upr_cli.protocol.header import DATATYPE_JSON
from upr_cli.protocol.snappy import SNAPPY

OPS = {OP_MUTATION: "mutation", OP_DELETION: "deletion", OP_EXPIRATION: "expiration"}
#: `op` of a -v line in JSON: the DCP message it reports (a collection or scope change
#: is "system_event", DCP's name for them); every JSON line of `tail` carries an `op`,
#: change lines one of OPS' names, so `jq 'select(.op=="mutation")'` works on all of them
EVENT_OPS = {"snapshot": "snapshot_marker", "rollback": "rollback", "stream_end": "stream_end",
             "stream_open": "stream_open"}  # fmt: skip
_key, _value = attrgetter("key"), attrgetter("value")


def window(memory: MemoryLimit) -> int:
    """The flow-control window of a tail with `memory` (`--memory-limit`): 4 MB with the
    default 192 MB. The window bounds what the consumer has queued and so each batch's
    lines too (docs/design.md "Performance")."""
    return memory.share(1 / 48)


@dataclass
class TailOptions:
    """What `upr tail` was asked for."""

    start: str = "beginning"  # beginning | now | SEQ
    until_end: bool = False
    count: int | None = None
    partitions: list[int] | None = None
    keys: re.Pattern[bytes] | None = None
    fmt: str = "text"
    verbose: bool = False
    state: Path | None = None
    buffer_size: int = 4 * 1024 * 1024  # the flow-control window: `window(--memory-limit)`
    wait: float = 120.0  # how long a lost node or a partition without an active is waited for
    collections: list[CollectionPath] | None = None  # filtered on the source's side
    compression: WireCompression = "auto"  # --wire-compression (formats/wire.md "Snappy")


@dataclass
class TailSummary:
    """Counts for the closing line."""

    items: int = 0
    rollbacks: int = 0
    bytes: int = 0  # the changes' keys and values (tail's metrics)


class CollectionNames:
    """Collection id → (scope, collection) names, as far as the tail has seen them."""

    def __init__(
        self,
        manifest: CollectionsManifest | None = None,
        known: dict[int, tuple[str, str]] | None = None,
    ) -> None:
        self.scopes: dict[int, str] = {0: DEFAULT}
        # `known`: names kept from an earlier run (collections dropped since)
        self.names: dict[int, tuple[str, str]] = {0: (DEFAULT, DEFAULT), **(known or {})}
        self._json: dict[int, str] = {}  # id → its JSON fields (the hot path)
        for scope in manifest.scopes if manifest is not None else ():
            self.scopes[scope.id] = scope.name
            for c in scope.collections:
                self.names[c.id] = (scope.name, c.name)

    def follow(self, change: ManifestChange) -> None:
        """Learn the name a created scope or collection has."""
        if change.kind == "scope-created" and change.name:
            self.scopes[change.scope_id] = change.name
        elif change.kind == "collection-created" and change.name and change.collection_id:
            scope = self.scopes.get(change.scope_id, f"{change.scope_id:#x}")
            self.names[change.collection_id] = (scope, change.name)
            self._json.pop(change.collection_id, None)

    def path(self, cid: int) -> str:
        """`scope.collection`, or the id in hex when its name never reached the tail."""
        found = self.names.get(cid)
        return f"{found[0]}.{found[1]}" if found else f"{cid:#x}"

    def json_fields(self, cid: int) -> str:
        """`,"scope":…,"collection":…` for a change's JSON line (null when unknown)."""
        out = self._json.get(cid)
        if out is None:
            scope, coll = self.names.get(cid, (None, None))
            out = f',"scope":{json.dumps(scope)},"collection":{json.dumps(coll)}'
            self._json[cid] = out
        return out


_DEFAULT_NAMES = CollectionNames()
_JSON_OR_SNAPPY = DATATYPE_JSON | SNAPPY


def _json_key(kb: memoryview | bytes) -> str:
    """The key as a JSON string (plain ASCII keys skip json.dumps), plus key_b64 if not UTF-8."""
    try:
        key = str(kb, "utf-8")
    except UnicodeDecodeError:
        raw = bytes(kb)
        return (
            json.dumps(raw.decode(errors="replace"))
            + ',"key_b64":"'
            + base64.b64encode(raw).decode()
            + '"'
        )
    if key.isascii() and key.isprintable() and '"' not in key and "\\" not in key:
        return '"' + key + '"'
    return json.dumps(key)


def json_line(rec: DcpRecord, names: CollectionNames = _DEFAULT_NAMES) -> str:
    """One change as a JSON object: the value spliced raw when its datatype says JSON.

    Formatted by hand, not json.dumps: this is tail's hot path. Seqs and the cas are
    decimal strings (docs/output.md §4); scope and collection are names; `xattrs` only
    when the change has some."""
    # unpacked at once: a field read by name costs a call each
    op, vb, seq, rev, cas, flags, exp, _dtime, datatype, key, value, _opq, coll, blob = rec
    jkey = _json_key(key)
    if op != OP_MUTATION:
        body = ""
    elif datatype & _JSON_OR_SNAPPY == DATATYPE_JSON:  # JSON, not Snappy
        body = ',"value":' + str(value, "utf-8")  # checked on write
    else:
        body = ',"value_b64":"' + base64.b64encode(value).decode() + '"'
    if blob:
        body += ',"xattrs":' + json.dumps(xattrs.to_json(blob), separators=(",", ":"))
    return (f'{{"partition":{vb},"seq":"{seq}","op":"{OPS[op]}"'
            f'{names._json.get(coll) or names.json_fields(coll)},'
            f'"key":{jkey}{body},"cas":"{cas}","rev_seq":"{rev}",'
            f'"flags":{flags},"expiry":{exp}}}')  # fmt: skip


def text_line(rec: DcpRecord, names: CollectionNames = _DEFAULT_NAMES) -> str:
    """One change as a human-readable line; a key outside the default collection shows
    as `scope.collection:key`, and xattrs by their names (`xattrs=_sync,meta`)."""
    k = bytes(rec.key).decode(errors="replace")
    if rec.collection:
        k = f"{names.path(rec.collection)}:{k}"
    v = bytes(rec.value)
    shown = v.decode(errors="replace") if rec.datatype & DATATYPE_JSON else repr(v)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    tail = f" value={shown}" if rec.opcode == OP_MUTATION else ""
    if rec.xattrs:  # the names only: the values are in --format json
        tail = f" xattrs={','.join(name for name, _ in xattrs.pairs(rec.xattrs))}{tail}"
    return (f"p={rec.vbucket} seq={rec.by_seqno} {OPS[rec.opcode]} key={k} cas={rec.cas} "
            f"rev={rec.rev_seqno}{tail}")  # fmt: skip


def event_line(ev: object, fmt: str, names: CollectionNames = _DEFAULT_NAMES) -> str | None:
    """Snapshot markers, rollbacks, stream ends and collection changes (shown with -v);
    seqs and manifest uids as decimal strings."""
    d: dict[str, object]
    if isinstance(ev, ManifestChange):
        d = _change_fields(ev, names)
        if fmt != "json":  # ids in hex for people; JSON keeps them numbers (u32)
            d = {k: f"{v:#x}" if k.endswith("_id") and isinstance(v, int) else v
                 for k, v in d.items()}  # fmt: skip
    elif isinstance(ev, Snapshot):
        d = {
            "event": "snapshot",
            "partition": ev.partition,
            "start": str(ev.start),
            "end": str(ev.end),
            "flags": ev.flags,
        }
    elif isinstance(ev, Rollback):
        d = {
            "event": "rollback",
            "partition": ev.partition,
            "from_seq": str(ev.previous.seq),
            "to_seq": str(ev.to_seq),
            "asked_seq": str(ev.asked),
            "uuid": str(ev.uuid),
        }
    elif isinstance(ev, StreamEnded):
        d = {
            "event": "stream_end",
            "partition": ev.partition,
            "status": ev.status,
            "seq": str(ev.position.seq),
        }
    elif isinstance(ev, StreamOpened):
        d = {"event": "stream_open", "partition": ev.partition, "seq": str(ev.position.seq),
             "failover_log": [[str(u), str(s)] for u, s in ev.failover_log]}  # fmt: skip
    else:
        return None
    if fmt == "json":  # `op` first: every JSON line has one (docs/output.md §4)
        return json.dumps({"op": EVENT_OPS.get(str(d["event"]), "system_event"), **d},
                          separators=(",", ":"))  # fmt: skip
    return "# " + " ".join(f"{k}={v}" for k, v in d.items() if k != "event") + f"  [{d['event']}]"


def _change_fields(ev: ManifestChange, names: CollectionNames) -> dict[str, object]:
    """A change's fields; a name never learned (a drop whose creation the stream
    replaced, of a collection the manifest at open no longer had) is left out, and the
    id alone says which."""
    known = names.names.get(ev.collection_id) if ev.collection_id is not None else None
    scope = known[0] if known else names.scopes.get(ev.scope_id)
    d: dict[str, object] = {"event": ev.kind, "partition": ev.partition, "seq": str(ev.seq)}
    if scope is not None:
        d["scope"] = scope
    if ev.collection_id is None:
        d["scope_id"] = ev.scope_id
    else:
        if known:
            d["collection"] = known[1]
        d["collection_id"] = ev.collection_id
    d["manifest_uid"] = str(ev.manifest_uid)
    if ev.max_ttl:
        d["max_ttl"] = ev.max_ttl
    return d


#: the newest snapshot boundaries a state file keeps per partition (where a resumed
#: tail's rollback may land: docs/design.md, "Snapshot boundaries")
STATE_BOUNDARIES = 16


class Followed(NamedTuple):
    """What a filtered tail followed (state file version 3): its `--collections` (as
    `filter_text` gives it), the collection ids per partition at the saved positions,
    and their names."""

    filter: str
    ids: dict[int, set[int]]
    names: dict[int, tuple[str, str]]


class TailState(NamedTuple):
    """What a `--state` file holds."""

    positions: dict[int, StreamPosition]
    logs: dict[int, FailoverLog]
    boundaries: dict[int, list[int]]
    followed: Followed | None = None


def filter_text(paths: list[CollectionPath] | None) -> str:
    """A `--collections` list as a state file keeps it ("" for none)."""
    return ",".join(sorted(map(str, paths or [])))


def load_state(path: Path) -> TailState:
    """Positions, failover logs, snapshot boundaries and followed collections saved by
    an earlier `--state` run (empty if no file). Version 1 files have no boundaries,
    versions 1 and 2 no collections."""
    if not path.exists():
        return TailState({}, {}, {})
    try:
        data = json.loads(path.read_text())
        if data.get("version", 1) not in (1, 2, 3):
            raise ValueError(f"unknown version {data.get('version')!r}")
        positions = {int(p["partition"]): StreamPosition.from_json(p) for p in data["positions"]}
        logs = {int(p): FailoverLog.from_json(v) for p, v in data.get("failover_logs", {}).items()}
        bounds = {int(p): [int(b) for b in v] for p, v in data.get("boundaries", {}).items()}
        coll = data.get("collections")
        followed = None
        if coll is not None:
            ids = {int(p): {int(c) for c in v} for p, v in coll["followed"].items()}
            names = {int(c): (str(n[0]), str(n[1])) for c, n in coll.get("names", {}).items()}
            followed = Followed(str(coll["filter"]), ids, names)
        return TailState(positions, logs, bounds, followed)
    except (OSError, ValueError, KeyError, TypeError, IndexError, UprError) as exc:
        raise UsageError(f"--state: {path} is not a tail state file: {exc}") from None


def save_state(
    path: Path,
    positions: dict[int, StreamPosition],
    logs: dict[int, FailoverLog],
    boundaries: dict[int, list[int]] | None = None,
    followed: Followed | None = None,
) -> None:
    """Write positions, failover logs, boundaries and the followed collections
    atomically (temp, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    state: dict[str, object] = {
        "version": 3,
        "positions": [p.to_json() for _, p in sorted(positions.items())],
        "failover_logs": {str(p): log.to_json() for p, log in sorted(logs.items())},
        "boundaries": {
            str(p): [str(b) for b in bs[-STATE_BOUNDARIES:]]
            for p, bs in sorted((boundaries or {}).items())
        },
    }
    if followed is not None:
        state["collections"] = {
            "filter": followed.filter,
            "followed": {str(p): sorted(ids) for p, ids in sorted(followed.ids.items())},
            "names": {str(c): list(n) for c, n in sorted(followed.names.items())},
        }
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _TailSink(SinkBase):
    """Prints each batch's changes (and events with -v), commits after writing them, and
    stops once --count changes were printed (the rest of that batch is not shown)."""

    def __init__(
        self, consumer: DcpConsumer, opts: TailOptions, out: TextIO, summary: TailSummary,
        on_progress: Callable[[TailSummary], None] | None,
    ) -> None:  # fmt: skip
        self.consumer = consumer
        self.opts = opts
        self.out = out
        self.summary = summary
        self.on_progress = on_progress
        self.fmt_row = json_line if opts.fmt == "json" else text_line
        self.names = CollectionNames()  # the source's, once the consumer is open
        self.lines: list[str] = []
        self.full = False  # --count reached

    async def records(self, records: list[DcpRecord]) -> None:
        if self.full:
            return
        keys, count, summary, lines = self.opts.keys, self.opts.count, self.summary, self.lines
        fmt_row, names = self.fmt_row, self.names
        if keys is None and (count is None or summary.items + len(records) < count):
            lines += [fmt_row(rec, names) for rec in records]
            summary.items += len(records)
            summary.bytes += sum(map(len, map(_key, records)))
            summary.bytes += sum(map(len, map(_value, records)))
            return
        for rec in records:
            if keys is not None and not keys.search(bytes(rec.key)):
                continue
            lines.append(fmt_row(rec, names))
            summary.items += 1
            summary.bytes += len(rec.key) + len(rec.value)
            if count is not None and summary.items >= count:
                self.full = True
                return

    async def event(self, event: Event) -> None:
        if self.full:
            return
        if isinstance(event, Rollback):
            self.summary.rollbacks += 1
        elif isinstance(event, ManifestChange):
            self.names.follow(event)
            # always shown: documents come and go with collections (upr-tail(1))
            self.lines.append(event_line(event, self.opts.fmt, self.names) or "")
            return
        if self.opts.verbose:
            line = event_line(event, self.opts.fmt, self.names)
            if line:
                self.lines.append(line)

    async def batch_done(self) -> bool:
        if self.lines:
            self.out.write("\n".join(self.lines) + "\n")
            self.lines = []
        self.consumer.commit()
        if self.on_progress is not None:
            self.on_progress(self.summary)
        return self.full


async def tail(
    uri: SourceUri, opts: TailOptions, out: TextIO = sys.stdout,
    on_progress: Callable[[TailSummary], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    on_open: Callable[[Callable[[], dict[int, int]]], None] | None = None,
) -> TailSummary:  # fmt: skip
    """Stream changes and print them; returns counts. Stops at the end (finite) or --count.

    Partitions with no reachable active node (a cluster node down and not failed over)
    do not hold the others back: `on_warning` hears of them at once, they are waited
    for up to `opts.wait` seconds, and then the tail fails naming them. A lost node is
    reconnected for as long (`on_notice` hears when the link is lost and when it is
    back; `math.inf` waits for ever). `on_open` is handed, once the streams are open, a
    function that tells each partition's seq received (the metrics' lag)."""
    if opts.state is not None:  # where the positions go at the end: checked before streaming
        check_file_path(opts.state, f"--state {opts.state}")
    positions, logs, bounds, saved = load_state(opts.state) if opts.state else TailState({}, {}, {})
    wanted = filter_text(opts.collections)
    # the ids followed under another --collections (or none) say nothing of this one
    followed = saved if saved is not None and wanted and saved.filter == wanted else None
    start_seq = None
    if opts.start not in ("beginning", "now"):
        if not opts.start.isdigit():
            raise UsageError("--from takes beginning, now or a seq number")
        start_seq = int(opts.start)
    consumer = DcpConsumer(
        uri, partitions=opts.partitions, positions=positions, failover_logs=logs,
        boundaries=bounds, until_end=opts.until_end,
        from_latest=opts.start == "now", start_seq=start_seq, buffer_size=opts.buffer_size,
        follow_for=opts.wait, on_notice=on_notice, name="upr-tail", collections=opts.collections,
        followed_ids=followed.ids if followed is not None else None, compression=opts.compression,
    )  # fmt: skip
    summary = TailSummary()
    sink = _TailSink(consumer, opts, out, summary, on_progress)
    try:
        await consumer.open()
        sink.names = CollectionNames(consumer.manifest, followed.names if followed else None)
        if on_open is not None:
            on_open(lambda: {p: pos.seq for p, pos in consumer.positions.items()})
        if consumer.waiting and on_warning is not None:
            on_warning(_waiting_note(sorted(consumer.waiting), len(consumer.parts), opts.wait))
        await drive(consumer, sink)
        out.flush()
        if consumer.filter_emptied:
            _filter_emptied(opts, on_warning)
    finally:
        if opts.state is not None and consumer.parts:
            _save(opts.state, consumer, wanted, sink.names)
        await consumer.aclose()
    return summary


def _filter_emptied(opts: TailOptions, on_warning: Callable[[str], None] | None) -> None:
    """Every collection the filter named was dropped: a follow failed (exit 1), while
    --until-end got all there was (a warning)."""
    what = "every collection --collections names was dropped: the streams ended"
    if not opts.until_end:
        raise CollectionsError(what)
    if on_warning is not None:
        on_warning(what)


def _save(path: Path, consumer: DcpConsumer, wanted: str, names: CollectionNames) -> None:
    """The state at the committed positions, with the followed collections."""
    committed = consumer.committed
    bounds = {p: [b for b in consumer.boundaries(p) if b <= pos.seq]
              for p, pos in committed.items()}  # fmt: skip
    followed = None
    if consumer.filter is not None:
        ids = {p: consumer.followed(p) for p in committed}
        every = set().union(*ids.values())
        followed = Followed(wanted, ids, {c: names.names[c] for c in every if c in names.names})
    save_state(path, committed, consumer.failover_logs, bounds, followed)


def _waiting_note(waiting: list[int], total: int, wait: float) -> str:
    """What a tail over a degraded cluster says at once."""
    shown = ",".join(map(str, waiting[:8])) + (
        f",… {len(waiting) - 8} more" if len(waiting) > 8 else ""
    )
    return (f"{len(waiting)} of {total} partitions have no reachable active node ({shown}): "
            f"streaming the other {total - len(waiting)} now, waiting up to {wait:g}s for "
            f"these (--wait); `upr cluster status` shows which node is down")  # fmt: skip
