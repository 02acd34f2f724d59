"""Who holds a lock file: the record both of upr's locks write into theirs.

A repository bucket's lock (`upr_cli/repo/lock.py`, formats/repository.md §7) and a
node's data directory lock (`upr_cli/node/lock.py`) each write, once they hold the
flock, one line of UTF-8 JSON naming the holder: `pid` (> 0), `hostname` (non-empty)
and `started` (RFC 3339 UTC). The repository's lock writes `started` with six
fractional digits (formats/repository.md §2.5), the node's to the second; the record
keeps the text as written, so a refusal names the time exactly as the holder wrote it.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from datetime import datetime

# RFC 3339 UTC as upr writes it: to the second, or with six fractional digits.
_STARTED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{6})?Z")


@dataclass(frozen=True, slots=True)
class LockHolder:
    """Who holds (or held) a lock: pid, host name and when it started."""

    pid: int
    hostname: str
    started: str  # RFC 3339 UTC, as written

    @classmethod
    def me(cls, started: str) -> LockHolder:
        """This process on this host, holding since `started`."""
        return cls(os.getpid(), socket.gethostname(), started)

    def to_bytes(self) -> bytes:
        """The lock file's content: one line of JSON."""
        obj = {"pid": self.pid, "hostname": self.hostname, "started": self.started}
        return (json.dumps(obj) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LockHolder | None:
        """Parse a lock file's content; None when it is empty or malformed."""
        try:
            obj = json.loads(data.decode("utf-8"))
            pid, host, started = obj["pid"], obj["hostname"], obj["started"]
            if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
                return None
            if not isinstance(host, str) or not host:
                return None
            if not isinstance(started, str) or not _STARTED.fullmatch(started):
                return None
            datetime.fromisoformat(started)  # a real date and time
        except (ValueError, KeyError, TypeError):
            return None
        return cls(pid, host, started)

    def describe(self) -> str:
        """`pid N on host H since T`."""
        return f"pid {self.pid} on host {self.hostname} since {self.started}"
