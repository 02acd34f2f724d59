"""Opening the DCP consumer's streams: STREAM_REQ out, the answers acted on.

Theory of operation. Each partition's stream is requested on its node's link, every
request of a batch pipelined (docs/protocol.md §4.4); the request itself is the state
machine's (`Streams.request`, dcp/streams.py), and so are the answers' effects on a
partition's state: an accepted stream (`Streams.accepted`), ROLLBACK(r)
(`Streams.rollback`, sent again from the rollback point), a filter that a drop
emptied. What is left here is I/O and time: the high seqs pinned from the node
(GET_ALL_VB_SEQNOS) and each partition's start and end settled on them, a
NOT_MY_VBUCKET or ETMPFAIL turned into a move to the partition's active node (`move`,
formats/cluster.md §4, with the map the consumer keeps: `locate`), an unknown collection
judged by the node's manifest now. A stream's data may be queued before its answer is
seen: it is held (`hold`) so that `StreamOpened` always reaches the caller first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from upr_cli.collections import CollectionsError, CollectionsManifest
from upr_cli.dcp.events import Item
from upr_cli.dcp.links import Addr, Link, Links
from upr_cli.dcp.streams import Part, Streams
from upr_cli.errors import RemoteProtocolError, UprError
from upr_cli.failover import FailoverLog
from upr_cli.net.connection import ConnectionError_
from upr_cli.net.retry import RetryPolicy
from upr_cli.net.uri import SourceUri
from upr_cli.protocol import Message
from upr_cli.protocol.decoder import DcpRecord
from upr_cli.protocol.header import Opcode
from upr_cli.protocol.messages import (
    CollectionsGetManifest,
    FailoverLogResponse,
    GetAllVbSeqnos,
    GetAllVbSeqnosResponse,
    GetFailoverLog,
    Response,
    StreamRequest,
    StreamRequestOk,
    StreamRequestRollback,
)
from upr_cli.protocol.status import Status, status_error

log = logging.getLogger(__name__)


class ConsumerError(UprError):
    """The stream cannot continue (a partition refused, retries exhausted)."""


def parse_manifest(uri: SourceUri, resp: Message) -> CollectionsManifest:
    """The manifest a GET_COLLECTIONS_MANIFEST answer carries (a bad one: the source's
    fault, named by `uri`)."""
    try:
        return CollectionsManifest.from_json(getattr(resp, "value", b""))
    except CollectionsError as exc:
        raise RemoteProtocolError(f"{uri.redacted()}: {exc}") from None


class Opener:
    """Requests the consumer's streams on its links and acts on the answers."""

    def __init__(
        self,
        uri: SourceUri,
        links: Links,
        streams: Streams,
        *,
        follow_for: float,
        start_seq: int | None,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        locate: Callable[[int, bytes], Awaitable[Addr | None]],
    ) -> None:
        self.uri = uri  # the source (rebased by the consumer's open)
        self.links, self.streams = links, streams
        self.follow_for = follow_for
        self.start_seq = start_seq
        self.spawn = spawn  # run a background step (the consumer's, failing `batches()`)
        # the address of a partition's active node in the newest map (a NOT_MY_VBUCKET
        # body's, or one asked for), None when the map names none
        self.locate = locate
        self.follow = False  # the map lists several nodes: follow it
        self.waiting: set[int] = set()  # partitions with no reachable active node yet
        self.moving: set[int] = set()
        self.tmpfail: dict[int, float] = {}  # partition → first ETMPFAIL of a stream request
        # A stream being opened: its data may be queued before the task that asked sees
        # the answer; it waits here so that StreamOpened always comes first (`hold`).
        self.opening: dict[int, Addr] = {}
        self.held: dict[int, list[Item]] = {}

    @property
    def busy(self) -> bool:
        """A stream is being opened or moved, or data held for it is not handed over yet."""
        return bool(self.moving or self.opening or self.held)

    def hold(self, out: list[Item], addr: Addr | None) -> list[Item]:
        """The items of a batch from `addr` minus those of streams being opened there,
        which are held until their StreamOpened is handed over."""
        opening = {p for p, a in self.opening.items() if a == addr}
        if not opening:
            return out
        keep: list[Item] = []
        for it in out:
            p = it.vbucket if type(it) is DcpRecord else getattr(it, "partition", None)
            if p in opening:
                self.held.setdefault(p, []).append(it)
            else:
                keep.append(it)
        return keep

    async def pin_highs(self, parts: list[Part]) -> list[Part]:
        """Each partition's high seq, from the node streaming it (GET_ALL_VB_SEQNOS; in a
        cluster only active copies count). Returns the partitions not active there."""
        missing = []
        for addr in sorted({part.addr for part in parts}):
            link = self.links.by_addr.get(addr)
            mine = [part for part in parts if part.addr == addr]
            if link is None:
                missing += mine
                continue
            try:
                got = await self._seqnos(link)
            except ConnectionError_:
                if not self.follow:
                    raise
                missing += mine  # the node went away: wait for the map to move them
                continue
            for part in mine:
                if part.partition in got or not self.follow:
                    self.streams.highs[part.partition] = got.get(part.partition, 0)
                else:
                    missing.append(part)
        return missing

    async def _seqnos(self, link: Link) -> dict[int, int]:
        """A node's high seq per partition (in a cluster, of its active copies)."""
        conn = link.session.conn
        req = (GetAllVbSeqnos(opaque=conn.next_opaque(), state=1) if self.follow
               else GetAllVbSeqnos(opaque=conn.next_opaque()))  # fmt: skip
        resp = await conn.request(req)
        assert isinstance(resp, GetAllVbSeqnosResponse)
        return dict(resp.seqnos)

    async def cap_ends(self, parts: list[Part]) -> list[Part]:
        """Finite streams after a reconnect or a move: each end becomes the lower of the
        end pinned at the start and the high seq the node holds now (`Streams.cap_end`).
        Returns the partitions not active there."""
        before = {part.partition: self.streams.highs.get(part.partition) for part in parts}
        missing = await self.pin_highs(parts)
        for part in parts:
            if not any(part is m for m in missing):
                self.streams.cap_end(part, before[part.partition])
        return missing

    async def open(self, parts: list[Part]) -> None:
        """Send every STREAM_REQ pipelined; follow ROLLBACKs (docs/protocol.md §4.4) until accepted.
        A NOT_MY_VBUCKET while following a map moves the partition (`move`)."""
        pending = [p for p in parts if not p.done]
        while pending:
            await self._pin_catchups(pending)
            pending = [part for part in pending if not self.streams.filter_ended(part)]
            if not pending:
                return
            sent = self._request(pending)
            try:
                pending = [part for part, fut, req in sent if await self._answered(part, fut, req)]
            except BaseException:
                for part, _fut, _req in sent:
                    self.opening.pop(part.partition, None)
                raise

    async def _pin_catchups(self, parts: list[Part]) -> None:
        """The seq up to which each partition with vanished ids streams unfiltered: its
        high seq now, read after the manifest that lacks them (docs/protocol.md §12.4)."""
        need = self.streams.need_catchup(parts)
        for addr in sorted({part.addr for part in need}):
            got = await self._seqnos(self.links.open_conn(addr))
            for part in need:
                if part.addr == addr:
                    # None (not active there): unfiltered to the end, until a move to
                    # its active node pins it (safe, if costly)
                    part.catchup = got.get(part.partition)

    def _request(
        self, pending: list[Part]
    ) -> list[tuple[Part, asyncio.Future[list[Message]], StreamRequest]]:
        """Send a STREAM_REQ for each partition from where it stands, on its node's link."""
        sent = []
        for part in pending:
            session = self.links.open_conn(part.addr).session
            if part.filter is not None and not session.collections:
                # a filter there is EINVAL (docs/protocol.md §2.4)
                raise ConsumerError(
                    f"{session.uri.redacted()}: does not support collections, cannot filter "
                    f"on {', '.join(map(str, self.streams.paths or []))}"
                )
            req = self.streams.request(part)
            self.opening[part.partition] = part.addr
            part.begin()
            sent.append((part, session.conn.start_request(req), req))
        return sent

    async def _answered(
        self, part: Part, fut: asyncio.Future[list[Message]], sent: StreamRequest
    ) -> bool:
        """Act on one stream request's answer; True when it must be sent again (after a
        ROLLBACK, from the rollback point)."""
        try:
            resp = (await fut)[0]
        except ConnectionError_:
            self.opening.pop(part.partition, None)
            if self.follow:
                return False  # its link's loss is queued: batches() reopens it there
            raise
        if isinstance(resp, StreamRequestOk):
            self.streams.accepted(part, resp.failover_log, sent)
            self.tmpfail.pop(part.partition, None)
            self.streams.events.extend(self.held.pop(part.partition, []))
            self.opening.pop(part.partition, None)
            log.debug("partition %d: stream open from %d on %s:%d",
                      part.partition, sent.start_seqno, *part.addr)  # fmt: skip
            return False
        if isinstance(resp, StreamRequestRollback):
            self.rollback(part, resp.rollback_seqno)
            return True
        self.opening.pop(part.partition, None)
        assert isinstance(resp, Response)
        if resp.status == Status.NOT_MY_VBUCKET and self.follow:
            self.spawn(self.move(part, resp.value))
            return False
        unknown = resp.status in (Status.UNKNOWN_COLLECTION, Status.UNKNOWN_SCOPE)
        verdict = await self._refilter(part) if unknown and part.filter is not None else ""
        if verdict == "changed":
            return not part.done  # a collection dropped meanwhile: ask without it
        if resp.status == Status.ETMPFAIL or verdict == "behind":
            # a cluster node that restarted serves nothing until its orchestrator turns
            # traffic on (formats/cluster.md §3), and one the newest manifest has not
            # reached yet does not know its collections: ask again shortly
            since = self.tmpfail.setdefault(part.partition, time.monotonic())
            if time.monotonic() - since > self.follow_for:
                why = "ETMPFAIL" if verdict != "behind" else "an older collections manifest"
                raise ConsumerError(
                    f"partition {part.partition}: {part.addr[0]}:{part.addr[1]} "
                    f"refused streams ({why}) for {self.follow_for:g}s"
                )
            self.spawn(self.move(part, delay=0.25))
            return False
        err = status_error(resp.status, body=resp.value, opcode=Opcode.DCP_STREAM_REQ)
        paths = ",".join(map(str, self.streams.paths or []))
        what = f" (collections {paths})" if unknown else ""
        raise ConsumerError(f"partition {part.partition}: stream request refused{what}: {err}")

    async def _refilter(self, part: Part) -> str:
        """A stream refused for an unknown collection or scope, judged by the node's
        manifest now (`Streams.refilter`); "stands" without a link to ask."""
        link = self.links.by_addr.get(part.addr)
        if link is None or link.session.conn.closed:
            return "stands"
        conn = link.session.conn
        now = parse_manifest(
            self.uri, await conn.request(CollectionsGetManifest(opaque=conn.next_opaque()))
        )
        return self.streams.refilter(part, now)

    def rollback(self, part: Part, r: int) -> None:
        """ROLLBACK(r), as the state machine applies it (`Streams.rollback`)."""
        ev = self.streams.rollback(part, r)
        if ev.to_seq < r:
            log.info("partition %d: rollback from %d to %d (asked %d, inside a snapshot)",
                     part.partition, ev.previous.seq, ev.to_seq, r)  # fmt: skip
        else:
            log.info("partition %d: rollback from %d to %d", part.partition, ev.previous.seq, r)

    async def failover_log(self, partition: int) -> FailoverLog:
        """The server's failover log for a partition (GET_FAILOVER_LOG), from its node."""
        part = self.streams.parts.get(partition)
        link = self.links.by_addr.get(part.addr) if part is not None else None
        session = link.session if link is not None else self.links.session
        assert session is not None
        conn = session.conn
        resp = await conn.request(GetFailoverLog(vbucket=partition, opaque=conn.next_opaque()))
        assert isinstance(resp, FailoverLogResponse)
        return FailoverLog.sanitised(resp.failover_log)

    async def settle_start(self, part: Part) -> None:
        """A partition whose high seq is pinned: its start (`start_seq`) and end
        (`until_end`, capped at what the source holds now)."""
        p = part.partition
        if self.start_seq is not None and p not in self.streams.start:
            seq = min(self.start_seq, self.streams.highs.get(p, 0))
            entry = (await self.failover_log(p)).entry_at(seq)
            self.streams.start_at(part, entry.uuid if entry else 0, seq)
        if self.streams.until_end:
            self.streams.pin_end(part)

    async def reopen(self, part: Part) -> None:
        """Request a partition's stream again (the state machine ended it)."""
        try:
            await self.open([part])
            self.links.queue.put_nowait((part.addr, -1, [], 0))  # wake batches(): held data
        except ConnectionError_:
            if self.follow:
                await self.move(part)  # its node went away meanwhile: follow the map
            # else the lost link is reconnected by batches(), which reopens the stream
        except ConsumerError as exc:
            self.links.queue.put_nowait(exc)

    async def move(self, part: Part, body: bytes = b"", delay: float = 0.05) -> None:
        """Reopen a partition on the node the newest map names its active (a rebalance
        or failover moved it). It waits for such a map for up to `follow_for` seconds,
        asking first after `delay` seconds, then at most every half second."""
        p = part.partition
        if p in self.moving:
            return
        self.moving.add(p)
        retry = RetryPolicy(within=self.follow_for, first=delay, cap=max(delay, 0.5)).start()
        try:
            await retry.wait()  # a map being changed: give it a moment
            while True:
                addr = await self.locate(p, body)
                body = b""
                if addr is not None and await self._moved(part, addr):
                    return
                if retry.spent:
                    stuck = sorted(self.waiting) if p in self.waiting else [p]
                    more = f",… {len(stuck) - 8} more" if len(stuck) > 8 else ""
                    shown = ",".join(map(str, stuck[:8])) + more
                    raise ConsumerError(
                        f"partition{'s' if len(stuck) > 1 else ''} {shown}: no reachable "
                        f"active node for {self.follow_for:g}s"
                    )
                await retry.wait()
        except (ConsumerError, ConnectionError_) as exc:
            self.links.queue.put_nowait(exc)
        finally:
            self.moving.discard(p)

    async def _moved(self, part: Part, addr: Addr) -> bool:
        """Open a partition's stream on `addr`, its active in the newest map; False when
        that node cannot serve it yet."""
        p = part.partition
        try:
            await self.links.link(self.uri, addr)
            part.addr = addr
            if p in self.waiting:  # never pinned: no high, no start yet
                if await self.pin_highs([part]):
                    raise ConsumerError(f"{addr[0]}:{addr[1]} is not active yet")
                await self.settle_start(part)
                self.waiting.discard(p)
            elif self.streams.until_end and await self.cap_ends([part]):
                # the new active may hold less than the end pinned
                raise ConsumerError(f"{addr[0]}:{addr[1]} is not active yet")
            # Opened even when nothing is left to send: only the new active's producer
            # rule says whether what was streamed is still its history (a hard
            # failover: ROLLBACK, docs/protocol.md §4.2).
            log.info("partition %d: streaming from %s:%d", p, *addr)
            self.moving.discard(p)
            await self.open([part])
            self.links.queue.put_nowait((addr, -1, [], 0))  # wake batches()
            return True
        except (ConnectionError_, OSError, UprError) as exc:
            log.info("partition %d: %s:%d unusable: %s", p, *addr, exc)
            return False


__all__ = ["ConsumerError", "Opener", "parse_manifest"]
