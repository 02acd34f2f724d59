"""`upr repo unlock`: remove a bucket's writer lock that no live process holds.

Theory of operation. A lock in object storage is a lease (`upr_cli.repo.lease`): it is
stale once its holder has not renewed it for its lease, judged by the server's clock,
and then removed with `DELETE If-Match: <its ETag>`, so a holder that renews it at that
moment keeps it. A local lock file is stale when no process holds its flock and its
holder's pid is dead on this host (`upr_cli.repo.lock`); it is removed while this
command holds the flock. A live lock is refused with one line that names its holder
(and when its lease runs out) unless `--force`, which says what it risks. A backup
takes a stale lock over by itself: this command is for a lock a user wants gone now.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from typing import Annotated, Any

import typer

from upr_cli.cli.options import Bucket, JsonOutput, Repo
from upr_cli.cli.output import hint, print_json, stdout
from upr_cli.repo.errors import RepositoryLocked
from upr_cli.storage import display_location

HELP = """Remove a bucket's writer lock that no live process holds.

A backup killed with SIGKILL leaves its lock behind. In a directory the next backup
takes it over by itself once its process is gone; in object storage (s3://) the lock
is a lease, renewed every 20 s by its holder, and taken over once it is 60 s old by the
server's clock. `upr repo unlock` removes such a lock now, and refuses a live one (it
names the holder and when its lease runs out) unless --force.

--force removes a live lock too: if its holder still runs, two writers may then both
write into the bucket. Use it only when you know the holder is gone (a machine that
was switched off, a host name that changed).

Exit status: 0 removed or not locked; 1 a live lock (without --force); 2 bad options.

Example (the lock a killed backup left in object storage):

  upr repo unlock --repo s3://backups/cb --bucket default

Example (every bucket of a local repository, as JSON):

  upr repo unlock --repo /backups/cb --json
"""


def register(app: typer.Typer) -> None:
    """Add `repo unlock` to the `repo` group."""
    app.command("unlock", help=HELP, no_args_is_help=True)(unlock_cmd)


def unlock_cmd(
    repo: Repo,
    bucket: Bucket = None,
    force: Annotated[
        bool, typer.Option("--force", help="Remove a live lock too (two writers may result).")
    ] = False,
    json_out: JsonOutput = False,
) -> None:
    """Remove stale writer locks."""
    from upr_cli.source import open_repo

    r = open_repo(repo)
    names = [bucket] if bucket else r.buckets()
    results = [unlock(r, b, force=force) for b in names]
    if json_out:
        print_json({"repository": display_location(r.path), "buckets": results})
        return
    for res in results:
        stdout.print(describe(res), markup=False)
    if any(res["state"] == "removed" and res["forced"] for res in results):
        hint("a live lock was removed: if its holder still runs, stop it before the next backup")


def describe(res: dict[str, Any]) -> str:
    """One line per bucket."""
    b = res["bucket"]
    if res["state"] == "not locked":
        return f"{b}: not locked"
    h = res["holder"]
    who = f"pid {h['pid']} on host {h['hostname']} since {h['started']}" if h else "unknown"
    how = "removed the live lock (--force)" if res["forced"] else "removed the stale lock"
    return f"{b}: {how} of {who}"


def _holder_json(holder: Any) -> dict[str, Any] | None:
    if holder is None:
        return None
    return {"pid": holder.pid, "hostname": holder.hostname, "started": holder.started}


def unlock(repo: Any, bucket: str, *, force: bool) -> dict[str, Any]:
    """Remove `bucket`'s lock when stale (or with `force`); `RepositoryLocked` when live."""
    from upr_cli.repo.lease import object_storage, read_lease

    path = repo.lock_path(bucket)
    where = display_location(path)
    out: dict[str, Any] = {"bucket": bucket, "state": "not locked", "holder": None,
                           "lease_expires": None, "forced": False}  # fmt: skip
    s3 = object_storage(repo)
    if s3 is not None:
        key = s3.key(path)
        state = read_lease(s3, key)
        if state is None:
            return out
        out.update(holder=_holder_json(state.holder), lease_expires=state.expires)
        if state.live and not force:
            raise RepositoryLocked(
                f"{where}: held by {state.describe()}, whose lease runs until {state.expires} "
                "(it is alive); --force removes it, and if that process still runs two "
                "writers may then both commit",
                pid=state.holder.pid if state.holder else None,
                hostname=state.holder.hostname if state.holder else None)  # fmt: skip
        from upr_cli.s3 import PreconditionFailed

        try:
            s3.delete_if(key, state.etag)
        except PreconditionFailed:
            raise RepositoryLocked(f"{where}: renewed or taken over meanwhile; not removed",
                                   pid=None, hostname=None) from None  # fmt: skip
        out.update(state="removed", forced=state.live)
        return out
    return _unlock_local(repo, path, where, out, force=force)


def _unlock_local(repo: Any, path: Any, where: str, out: dict[str, Any], *,
                  force: bool) -> dict[str, Any]:  # fmt: skip
    from upr_cli.repo.lock import _holder, pid_alive

    storage = repo.storage
    try:
        fd = storage.open_lock(path, create=False)
    except FileNotFoundError:
        return out
    try:
        holder = _holder(fd)
        out["holder"] = _holder_json(holder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except OSError:
            flocked = False
        live = not flocked
        why = "holds its flock"
        if not live and holder is not None:
            if holder.hostname != socket.gethostname():
                live, why = True, "runs on another host, where it cannot be checked"
            elif pid_alive(holder.pid):
                live, why = True, "is alive"
        if live and not force:
            who = holder.describe() if holder else "a process that is still writing it"
            raise RepositoryLocked(
                f"{where}: held by {who}, which {why}; --force removes it, and if that "
                "process still runs two writers may then both commit",
                pid=holder.pid if holder else None,
                hostname=holder.hostname if holder else None)  # fmt: skip
        st = storage.stat(path)
        mine = os.fstat(fd)
        if st is not None and st.ident == (mine.st_dev, mine.st_ino):
            storage.delete(path)
            with contextlib.suppress(OSError):
                storage.sync_dir(path.parent)
        out.update(state="removed", forced=live)
        return out
    finally:
        os.close(fd)
