"""The node's collections commands: COLLECTIONS_SET_MANIFEST (an authenticated
session), _GET_MANIFEST, _GET_ID and _GET_SCOPE_ID (kv_engine's docs/Collections.md;
formats/collections.md §4). Each handler takes the session and the decoded request, as
`node/dispatch.py` calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from upr_cli.collections import CollectionsError, CollectionsManifest
from upr_cli.protocol.header import DATATYPE_JSON, Opcode
from upr_cli.protocol.messages import (
    CollectionsGetId,
    CollectionsGetManifest,
    CollectionsGetScopeId,
    CollectionsIdResponse,
    CollectionsSetManifest,
    Response,
)
from upr_cli.protocol.status import InvalidArguments

if TYPE_CHECKING:
    from upr_cli.node.server import ClientSession


async def set_manifest(session: ClientSession, msg: CollectionsSetManifest) -> None:
    """COLLECTIONS_SET_MANIFEST: the bucket takes the manifest before the answer."""
    bucket = session.need_bucket()
    session.need_admin_bucket()
    try:
        manifest = CollectionsManifest.from_json(msg.value)
    except CollectionsError as exc:
        raise InvalidArguments(str(exc)) from None
    await bucket.set_manifest(manifest)
    session.send(Response(opcode=Opcode.COLLECTIONS_SET_MANIFEST, opaque=msg.opaque))


def get_manifest(session: ClientSession, msg: CollectionsGetManifest) -> None:
    """COLLECTIONS_GET_MANIFEST: the bucket's manifest as JSON."""
    bucket = session.need_bucket()
    session.send(Response(opcode=Opcode.COLLECTIONS_GET_MANIFEST, opaque=msg.opaque,
                          value=bucket.manifest.dumps(), datatype=DATATYPE_JSON))  # fmt: skip


def get_id(session: ClientSession, msg: CollectionsGetId | CollectionsGetScopeId) -> None:
    """COLLECTIONS_GET_ID and COLLECTIONS_GET_SCOPE_ID: the manifest uid and the id of
    the collection or scope a path names."""
    bucket = session.need_bucket()
    # the documented form has the path in the value; the SDK sends it as the key
    raw = msg.value or msg.key
    try:
        path = bytes(raw).decode()
        if isinstance(msg, CollectionsGetId):
            uid, ident = bucket.collections.collection_id(path)
        else:
            uid, ident = bucket.collections.scope_id(path)
    except (UnicodeDecodeError, CollectionsError) as exc:
        raise InvalidArguments(f"collection path: {exc}") from None
    session.send(CollectionsIdResponse(opcode=msg.SCHEMA.opcodes[0], opaque=msg.opaque,
                                       manifest_uid=uid, id=ident))  # fmt: skip
