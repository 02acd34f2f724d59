"""The DCP flag words and stream-end statuses, defined once for the consumer and the node.

DCP_OPEN flags follow docs/protocol.md §2.1, stream-request flags (ADD_STREAM and
STREAM_REQ) docs/protocol.md §2.2, STREAM_END statuses docs/protocol.md §2.6 and
SNAPSHOT_MARKER flags docs/protocol.md §2.7. They are plain ints, not enum members:
they are tested against a message's flags on every frame, and `int & IntFlag` builds
a new enum member each time.
"""

from __future__ import annotations

from typing import Final

# DCP_OPEN flags (docs/protocol.md §2.1); 0x02 (Notifier) is removed and must be clear
OPEN_PRODUCER: Final = 0x01
OPEN_NOTIFIER: Final = 0x02
OPEN_XATTRS: Final = 0x04  # IncludeXattrs
OPEN_NO_VALUE: Final = 0x08
OPEN_DELETE_TIMES: Final = 0x20  # IncludeDeleteTimes
OPEN_NO_VALUE_DT: Final = 0x40  # NoValueWithUnderlyingDatatype
OPEN_DELETED_USER_XATTRS: Final = 0x100  # IncludeDeletedUserXattrs, needs OPEN_XATTRS
OPEN_SKIP_DELETES: Final = 0x200  # SkipDeletesInInitialBackfill

# Stream-request flags (docs/protocol.md §2.2); 0x08 is removed and refused with EINVAL
S_TAKEOVER: Final = 0x01
S_DISK_ONLY: Final = 0x02
S_TO_LATEST: Final = 0x04
S_ACTIVE_ONLY: Final = 0x10  # ActiveVbOnly
S_STRICT_UUID: Final = 0x20  # StrictVbUuid
S_FROM_LATEST: Final = 0x40
S_IGNORE_PURGED: Final = 0x80  # IgnorePurgedTombstones
S_CACHE_TRANSFER: Final = 0x100
#: every defined stream-request bit (any other is EINVAL)
S_KNOWN: Final = (
    S_TAKEOVER
    | S_DISK_ONLY
    | S_TO_LATEST
    | S_ACTIVE_ONLY
    | S_STRICT_UUID
    | S_FROM_LATEST
    | S_IGNORE_PURGED
    | S_CACHE_TRANSFER
)

# SNAPSHOT_MARKER flags (docs/protocol.md §2.7)
MARKER_MEMORY: Final = 0x01
MARKER_DISK: Final = 0x02
MARKER_CHECKPOINT: Final = 0x04
MARKER_ACK: Final = 0x08  # the client answers with a SNAPSHOT_MARKER response
MARKER_HISTORY: Final = 0x10
MARKER_MAY_CONTAIN_DUPLICATES: Final = 0x20
#: how a backfill's snapshot goes out (Disk|Checkpoint)
MARKER_DISK_CHECKPOINT: Final = MARKER_DISK | MARKER_CHECKPOINT

# STREAM_END statuses (docs/protocol.md §2.6); without collections 7 and 8 arrive as 0
END_OK: Final = 0
END_CLOSED: Final = 1
END_STATE_CHANGED: Final = 2
END_DISCONNECTED: Final = 3
END_SLOW: Final = 4
END_BACKFILL_FAIL: Final = 5
END_ROLLBACK: Final = 6  # defined, but producers send END_STATE_CHANGED instead
END_FILTER_EMPTY: Final = 7  # collections connections only
END_LOST_PRIVILEGES: Final = 8
