"""A bucket's partition-state control (formats/cluster.md §1-§3; the UPR design
specification, "How ns_server and ep-engine guarantee ordering of partition state
transitions").

One CAS for the bucket, new at every start and after every accepted state command, and
the cluster map an orchestrator set, with its revision. A state command must carry the
CAS and a map revision not older than the node's: a stale CAS is KEY_EEXISTS (the
response carries the right one; retry), an older revision is refused (a newer
orchestrator has taken over: fencing). A partition's new state is persisted before the
answer, and the bucket's listeners (replication) are told of every change.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from upr_cli.failover import new_uuid
from upr_cli.node import undo
from upr_cli.node.partition import ACTIVE
from upr_cli.protocol.status import InvalidArguments, NotMyVbucket, Status, StatusError

if TYPE_CHECKING:
    from upr_cli.node.bucket import Bucket


class StaleCas(StatusError):
    """KEY_EEXISTS for a state command whose bucket CAS is stale (formats/cluster.md)."""

    status = int(Status.KEY_EEXISTS)
    retriable = True


def _new_cas() -> int:
    """A fresh, non-zero bucket CAS."""
    return random.getrandbits(63) or 1


class StateControl:
    """The bucket CAS, the cluster map, and the state commands that change them."""

    def __init__(self, bucket: Bucket, map_path: Path) -> None:
        self._bucket = bucket
        self.cas = _new_cas()
        self._map_path = map_path
        self.cluster_map: dict[str, object] | None = None

    def load_map(self) -> bool:
        """Read the persisted cluster map, if any; True if there was one (the node is a
        member of a cluster)."""
        if not self._map_path.exists():
            return False
        self.cluster_map = json.loads(self._map_path.read_text(encoding="utf-8"))
        return True

    @property
    def map_rev(self) -> int:
        """The revision of the cluster map held (0: none set)."""
        rev = (self.cluster_map or {}).get("rev", 0)
        return rev if isinstance(rev, int) else 0

    def check(self, cas: int, rev: int) -> None:
        """A state command must carry the bucket CAS and a map revision not older than the
        node's: a stale CAS is KEY_EEXISTS (the response carries the right CAS; retry), an
        older revision is refused (a newer orchestrator has taken over: fencing)."""
        if cas != self.cas:
            raise StaleCas(f"bucket CAS {cas} is stale; the current one is in this response")
        if rev < self.map_rev:
            raise InvalidArguments(f"map revision {rev} is older than this node's {self.map_rev}")

    def set_cluster_map(self, cas: int, config: dict[str, object]) -> int:
        """Store a newer cluster map (persisted atomically); returns the new bucket CAS."""
        rev = config.get("rev")
        if not isinstance(rev, int) or isinstance(rev, bool) or rev < 1:
            raise InvalidArguments("a cluster map needs an integer rev ≥ 1")
        self.check(cas, rev)
        if rev == self.map_rev:
            raise InvalidArguments(f"map revision {rev} is not newer than this node's")
        tmp = self._map_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config), encoding="utf-8")
        tmp.replace(self._map_path)
        self.cluster_map = config
        self.cas = _new_cas()
        self._changed()
        return self.cas

    def _changed(self) -> None:
        for fn in self._bucket.listeners:
            fn()

    async def set_partition_state(self, vb: int, state: str, *, cas: int, rev: int,
                                  failover: bool) -> int:  # fmt: skip
        """Change a partition's state (persisted before the answer); returns the new CAS.

        `failover` on a promotion to active adds a failover entry at the partition's last
        persisted complete snapshot (the UPR design specification, "How ns_server
        performs failover").
        """
        bucket = self._bucket
        if not 0 <= vb < bucket.num_partitions:
            raise NotMyVbucket(f"partition {vb} does not exist")
        self.check(cas, rev)
        # one piece of work: a cancelled caller (a dropped connection) cannot leave the
        # new state persisted with the CAS not rotated or its streams not told
        return await bucket.flusher.unbroken(self._set_state(vb, state, failover))

    async def _set_state(self, vb: int, state: str, failover: bool) -> int:
        bucket = self._bucket
        part = bucket.partitions[vb]
        await bucket.flush()
        if failover and state == ACTIVE:
            part.failover = part.failover.add_entry(new_uuid(), part.complete_seq)
        await undo.follow_state(bucket, part, state)
        if state != part.state and state == ACTIVE:
            part.markers.clear()
            # an active partition's persisted data is one complete snapshot
            part.snap_start = part.snap_end = part.persisted_seq
        part.state = state
        await bucket.persist_state([part])
        self.cas = _new_cas()
        part.notify()  # streams of this partition check their state
        self._changed()
        return self.cas
