"""What one DCP stream asked for and what it shows of its partition (docs/protocol.md §4.1;
formats/wire.md "Collections on DCP").

`StreamSpec` is a STREAM_REQ after the producer's checks; `StreamView` is the collections
filter its value asked for (kv_engine's stream-request-value.md and DCP filter): which
collections the stream sends, with which keys, and which system events. The producer
(`upr_cli/node/producer.py`) builds both; the stream loop (`upr_cli/node/snapshots.py`)
and the encoder (`upr_cli/node/dcp_encoder.py`) read them.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from upr_cli.collections import DEFAULT_ID, CollectionsManifest, ManifestChange, decode_event
from upr_cli.node.bucket import Bucket
from upr_cli.node.collection_state import UnknownCollectionError, UnknownScopeError
from upr_cli.node.storage import DocRow
from upr_cli.node.sysevents import event_of, system_key
from upr_cli.protocol import leb128
from upr_cli.protocol.messages import SystemEvent
from upr_cli.protocol.status import DcpStreamIdInvalid, InvalidArguments

log = logging.getLogger(__name__)

# The system row of the default collection: a stream without collections ends when it
# is dropped, and looks at no other system row.
_DEFAULT_EVENT_KEY = system_key(ManifestChange(0, 0, "collection-dropped", 0, 0, DEFAULT_ID))
_HEX_ID = re.compile(r"[0-9a-fA-F]{1,8}")  # a u32 scope or collection id
_HEX_UID = re.compile(r"[0-9a-fA-F]{1,16}")  # a u64 manifest uid


class StreamView:
    """What one stream shows of its partition's rows: which collections, with which keys,
    and which system events (formats/wire.md "Collections on DCP", after kv_engine's
    DCP filter).

    `ids` None is the whole bucket (a collections connection without a filter); else the
    collection ids the stream sends, which system events update: a scope filter takes in
    the collections created in its scope, a drop takes one out. Rows of a collection the
    bucket's manifest no longer holds are never sent (their purge is lazy). A connection
    without collections sees the default collection only, keys without their 0x00
    prefix, and no system event; `ended` once nothing of the filter is left.
    """

    __slots__ = ("_bucket", "_live", "_manifest", "collections", "ended", "ids", "last_sent",
                 "scope", "scope_dropped")  # fmt: skip

    def __init__(self, bucket: Bucket, *, collections: bool, ids: set[int] | None = None,
                 scope: int | None = None) -> None:  # fmt: skip
        self._bucket = bucket
        self.collections = collections
        self.ids = ids
        self.scope = scope
        self.scope_dropped = False
        self.ended = False
        self.last_sent = 0  # the seq of the last item sent (SEQNO_ADVANCED when below an end)
        self._manifest: CollectionsManifest | None = None
        self._live: frozenset[int] = frozenset()

    def live(self) -> frozenset[int]:
        """The ids of the collections the bucket's manifest holds now."""
        manifest = self._bucket.manifest
        if manifest is not self._manifest:
            self._live = frozenset(c.id for _, c in manifest.collections())
            self._manifest = manifest
        return self._live

    def plain_ids(self) -> frozenset[int]:
        """The one-byte collection ids (the first key byte) whose rows this stream sends."""
        live = self.live()
        return frozenset(i for i in (live if self.ids is None else live & self.ids) if i < 0x80)

    def data_key(self, key: bytes) -> bytes | None:
        """The key a document row goes out with, or None if this stream does not send it."""
        cid, rest = leb128.split_key(key)
        if cid not in self.live() or (self.ids is not None and cid not in self.ids):
            return None
        return key if self.collections else bytes(rest)

    def hides_all(self, docs: list[DocRow]) -> bool:
        """True if a stream without collections has nothing in `docs` to look at."""
        return not self.collections and not any(
            d.key[0] == DEFAULT_ID or d.key == _DEFAULT_EVENT_KEY for d in docs
        )

    def event(self, vb: int, opaque: int, doc: DocRow) -> bytes | None:
        """The SYSTEM_EVENT of a system row, or None if this stream does not send it."""
        event, version, name, value = event_of(doc.flags, doc.expiry, doc.value)
        change = decode_event(vb, doc.seq, event, version, name, value)
        # an event upr does not model goes to unfiltered collections streams only
        send = self._admit(change) if change else self.collections and self.ids is None
        if self.ids is not None and (self.scope_dropped if self.scope is not None
                                     else not self.ids):  # fmt: skip
            self.ended = True
        if not send:
            return None
        return SystemEvent(vbucket=vb, opaque=opaque, by_seqno=doc.seq, event=event,
                           version=version, key=name, value=value).encode()  # fmt: skip

    def _admit(self, change: ManifestChange) -> bool:
        """Update the filter for a change; True if the stream sends its event."""
        cid, sid, ids = change.collection_id, change.scope_id, self.ids
        removed = cid is not None and change.dropped and ids is not None and cid in ids
        if removed:
            assert ids is not None and cid is not None
            ids.discard(cid)
        if cid is None and change.dropped and sid == self.scope:
            self.scope_dropped = True
        if not self.collections:
            return False
        if cid is None:  # a scope's own event: to its scope filter and unfiltered streams
            return ids is None or sid == self.scope
        if ids is None or removed:
            return True
        if sid == self.scope:  # a collection of the filtered scope: created ones join
            if not change.dropped:
                ids.add(cid)
            return True
        return cid in ids


def _hex(value: object, what: str, form: re.Pattern[str]) -> int:
    if not isinstance(value, str) or not form.fullmatch(value):
        raise InvalidArguments(f"stream-request value: {what} must be a hex string, got {value!r}")
    return int(value, 16)


def stream_view(bucket: Bucket, collections: bool, value: bytes) -> StreamView:
    """The view a STREAM_REQ value asks for (kv_engine's stream-request-value.md):
    EINVAL, UnknownCollection, UnknownScope or DCP_STREAMID_INVALID if it cannot be
    served."""
    manifest = bucket.manifest
    if not collections:
        if value:
            raise InvalidArguments("a stream-request value needs HELLO Collections")
        if manifest.by_id(DEFAULT_ID) is None:
            raise UnknownCollectionError("the _default collection was dropped", manifest.uid)
        return StreamView(bucket, collections=False, ids={DEFAULT_ID})
    if not value:
        return StreamView(bucket, collections=True)
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArguments("the stream-request value is not JSON") from None
    if not isinstance(doc, dict):
        raise InvalidArguments("the stream-request value must be a JSON object")
    if "sid" in doc:
        raise DcpStreamIdInvalid("stream-ids are not enabled on this connection")
    # Checked, then only logged: kv_engine's filter no longer uses the uid (neither to
    # leave out events at or below it nor to refuse one ahead of the node's), since a
    # resumed stream sends nothing at or below its start anyway (formats/wire.md
    # "Collections on DCP", point 4).
    uid = _hex(doc["uid"], "uid", _HEX_UID) if "uid" in doc else None
    if uid is not None:
        log.debug("stream request with manifest uid %x (the node's: %x)", uid, manifest.uid)
    purge = doc.get("purge_seqno")  # read and checked, not used: markers are v1
    if purge is not None and not (isinstance(purge, str) and purge.isdigit()):
        raise InvalidArguments("stream-request value: purge_seqno must be a decimal string")
    if "scope" in doc and "collections" in doc:
        raise InvalidArguments("stream-request value: give scope or collections, not both")
    if "scope" in doc:
        sid = _hex(doc["scope"], "scope", _HEX_ID)
        scope = manifest.scope_by_id(sid)
        if scope is None:
            raise UnknownScopeError(f"no scope with id {sid:x}", manifest.uid)
        ids = {c.id for c in scope.collections}
        return StreamView(bucket, collections=True, ids=ids, scope=sid)
    if "collections" in doc:
        wanted = doc["collections"]
        if not isinstance(wanted, list) or not wanted:
            raise InvalidArguments("stream-request value: collections must be a non-empty array")
        ids = {_hex(c, "a collection id", _HEX_ID) for c in wanted}
        for cid in sorted(ids):
            if manifest.by_id(cid) is None:
                raise UnknownCollectionError(f"no collection with id {cid:x}", manifest.uid)
        return StreamView(bucket, collections=True, ids=ids)
    if uid is None and purge is None:
        raise InvalidArguments("stream-request value: no uid, scope or collections")
    return StreamView(bucket, collections=True)


@dataclass(slots=True)
class StreamSpec:
    """What a STREAM_REQ asked for, after the docs/protocol.md §4.1 adjustments."""

    vbucket: int
    opaque: int
    flags: int
    start: int
    end: int
    uuid: int
    snap_start: int
    snap_end: int
    view: StreamView
    states: tuple[str, ...]  # the partition states it serves (active alone: ActiveVbOnly)
