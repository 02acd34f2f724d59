"""A repository in object storage: `S3Storage`, the `Storage` of an `s3://BUCKET/PREFIX`
location on any S3-compatible service (docs/design.md "Storage",
formats/repository.md §11).

Theory of operation. A path under the repository's root (`s3:/BUCKET/PREFIX/…`, see
`upr_cli.storage.parse_location`) is the key `PREFIX/…` of BUCKET. Directories are key
prefixes: `list` is ListObjectsV2 with the delimiter `/`, a directory exists while an
object is under it, and creating, syncing or removing an empty one has nothing to do
(`make_dir` still refuses a prefix that holds objects, as mkdir(2) refuses a directory
that exists: `Repository.new_backup_dir` reuses an interrupted run's directory so).

* **Nothing half-written is visible.** A file written in pieces (`create`: a segment)
  goes to a local spool file, never to the bucket; `replace(spool, final)` uploads it
  whole (one PUT, or a multipart upload whose parts are read from the spool, `transfers`
  of them at a time), so a temp name never reaches the bucket. A backup uploads its
  data objects first and its manifest last: the manifest is the commit point, as on
  disk. `write_if_absent` is a PUT with `If-None-Match: *` (412 → FileExistsError; a
  retried attempt that meets 412 compares the object with its own bytes: its own
  earlier attempt landed, and that counts as success).
* **Retries.** botocore's own retries are off (`total_max_attempts=1`: botocore's
  `max_attempts` counts *retries*, so `max_attempts=1` would mean two attempts); every
  request goes through `upr_cli.net.retry.RetryPolicy` (`ATTEMPTS` retries, backoff
  0.1 s doubling to 2 s). Retriable: 5xx, 429 and SlowDown, timeouts, refused or
  dropped connections, a body cut off mid-way (a ranged GET resumes where it stopped,
  `If-Match` on the ETag it started with). Not retriable: 403, 404, 412, a missing
  bucket: one-line errors (`S3Error`). Connect and read timeouts (10 s, 30 s) keep
  anything from hanging.
* **Memory is bounded.** At most `transfers` parts of `PART_SIZE` (8 MiB) in flight per
  upload, a whole-object PUT only below that size, one `WINDOW` (1 MiB) per open reader
  of a large object, DeleteObjects batches of 1000 keys. Objects up to `CACHE_OBJECT`
  (64 MiB) are streamed to the local spool on their first `open_read` and kept (at most
  `CACHE_BYTES`, 1 GiB, of disk): restore's checksum pass and write pass download a
  segment once, and the write pass restores the bytes that were checked.
* **Settings** come from `upr_cli.repo.access.current()` (`--s3-endpoint`,
  `--transfers`) and the standard AWS variables and files (`AWS_ENDPOINT_URL`,
  `AWS_PROFILE`, …); `UPR_S3_CONNECT_TIMEOUT`, `UPR_S3_READ_TIMEOUT` and
  `UPR_S3_CACHE_BYTES` tune the above (the tests shorten the timeouts).
* **Locks** live in `upr_cli.repo.lease` (leases renewed by conditional PUTs); while
  this storage carries a writer's lease (`guards`), every change it makes to the bucket
  first checks that the lease is still this process's, so a holder that lost its lease
  stops before its commit point.

Why boto3 and not obstore: boto3 is the reference client, maintained by AWS, already
locked, speaks to every S3-compatible service, and exposes the conditional requests the
locks need (`IfNoneMatch`/`IfMatch` on PutObject and `IfMatch` on DeleteObject) as
plain parameters. obstore (Rust, async) is faster per request, but a backup's time goes
into the node's stream and compression, and the requests are parallel here anyway; one
synchronous client keeps the `Storage` interface synchronous like the local one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeVar, cast

from upr_cli.net.retry import RetryPolicy
from upr_cli.repo.errors import RepositoryError
from upr_cli.storage import (
    Entry,
    SeekableReader,
    Stat,
    display_location,
    is_s3,
    s3_parts,
)

if TYPE_CHECKING:
    from upr_cli.repo.access import Access

__all__ = [
    "ATTEMPTS",
    "PART_SIZE",
    "WINDOW",
    "AccessDenied",
    "PreconditionFailed",
    "S3Bucket",
    "S3Error",
    "S3Storage",
]

_T = TypeVar("_T")
_log = logging.getLogger("upr.s3")

ATTEMPTS = 5
"""Retries of one request after its first attempt (so at most 6 attempts)."""
POLICY = RetryPolicy(attempts=ATTEMPTS, first=0.1, cap=2.0)
PART_SIZE = 8 << 20
"""Objects larger than this are uploaded in parts of this size (S3's minimum is 5 MiB)."""
WINDOW = 1 << 20
"""The read-ahead of one open reader: one ranged GET of at least this much."""
CACHE_OBJECT = 64 << 20
"""Objects up to this size are read whole into the local spool and kept (`open_read`)."""
CACHE_BYTES = 1 << 30
"""At most this much of the spool holds downloaded objects (`UPR_S3_CACHE_BYTES`)."""
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 30.0
_BATCH = 1000  # DeleteObjects takes at most 1000 keys
_REMOVED = "-removed"  # upr_cli.repo.sweep.REMOVED_SUFFIX: a directory on its way out
_RETRIABLE_CODES = frozenset({
    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
})  # fmt: skip


class S3Error(RepositoryError):
    """An object-store request that failed for good: one line naming the object."""


class AccessDenied(S3Error):
    """403: the credentials may not do this (a reader with read-only credentials)."""


class PreconditionFailed(Exception):
    """412: a conditional request (If-None-Match, If-Match) was refused."""


class Guard(Protocol):
    """A writer's lease this storage's changes depend on (`upr_cli.repo.lease`)."""

    def check(self) -> None:
        """Raise when the lease is no longer this process's."""


def _timeout(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _endpoint(explicit: str | None) -> str | None:
    return explicit or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


_clients: dict[tuple[object, ...], Any] = {}
_clients_lock = threading.Lock()
_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
        "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
        "UPR_S3_CONNECT_TIMEOUT", "UPR_S3_READ_TIMEOUT")  # fmt: skip


def make_client(endpoint: str | None, pool: int) -> Any:
    """A boto3 S3 client with botocore's retries off (one attempt per call), timeouts
    set, path-style addressing when an endpoint is given; one per process and settings
    (clients are thread-safe, and making one costs a tenth of a second)."""
    endpoint = _endpoint(endpoint)
    key = (endpoint, pool, *(os.environ.get(k) for k in _ENV))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = _new_client(endpoint, pool)
        return client


def _new_client(endpoint: str | None, pool: int) -> Any:
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=_timeout("UPR_S3_CONNECT_TIMEOUT", CONNECT_TIMEOUT),
        read_timeout=_timeout("UPR_S3_READ_TIMEOUT", READ_TIMEOUT),
        max_pool_connections=max(10, pool + 4),
        s3={"addressing_style": "path"} if endpoint else None,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return session.client("s3", endpoint_url=endpoint, config=config,
                          region_name=session.region_name or "us-east-1")  # fmt: skip


def _status(exc: BaseException) -> tuple[int, str]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return 0, ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    code = response.get("Error", {}).get("Code", "")
    return int(status or 0), str(code)


def retriable(exc: BaseException) -> bool:
    """5xx, 429/SlowDown, timeouts, connection errors, bodies cut off mid-way."""
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, ClientError):
        status, code = _status(exc)
        return status >= 500 or status == 429 or code in _RETRIABLE_CODES
    return isinstance(exc, HTTPClientError | BotoConnectionError | IncompleteReadError
                      | ConnectionError | TimeoutError)  # fmt: skip


class S3Bucket:
    """The requests to one bucket: each through the retry policy (`call`), the
    conditional ones the leases use, listings, ranged reads, uploads and batch deletes,
    at most `transfers` at a time."""

    def __init__(self, bucket: str, client: Any, transfers: int) -> None:
        self.bucket = bucket
        self.client = client
        self.transfers = max(1, transfers)
        self.requests = 0
        """Requests sent (attempts included), for the tests and the bench."""
        self._lock = threading.Lock()

    def where(self, key: str) -> str:
        """`s3://BUCKET/KEY`, for messages."""
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def call(self, what: str, key: str, step: Callable[[], _T]) -> _T:
        """Run one request through the retry policy; a failure for good is an `S3Error`
        (FileNotFoundError for 404, `PreconditionFailed` for 412)."""
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        retry = POLICY.start()
        while True:
            with self._lock:
                self.requests += 1
            try:
                return step()
            except (NoCredentialsError, PartialCredentialsError):
                raise S3Error(
                    f"{self.where(key)}: no credentials for the object store: set "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
                ) from None
            except Exception as exc:  # classified here
                if retriable(exc) and not retry.spent:
                    retry.tries += 1
                    delay = POLICY.delay(retry.tries)
                    _log.debug("%s %s: %s; attempt %d in %.2f s", what, self.where(key),
                               exc, retry.tries + 1, delay)  # fmt: skip
                    time.sleep(delay)
                    continue
                if isinstance(exc, ClientError):
                    raise self._client_error(what, key, exc) from None
                if retriable(exc):
                    raise S3Error(f"{self.where(key)}: {what} failed after {retry.tries + 1} "
                                  f"attempts: {exc}") from None  # fmt: skip
                raise

    def _client_error(self, what: str, key: str, exc: Exception) -> Exception:
        status, code = _status(exc)
        if code == "NoSuchBucket":
            return S3Error(f"s3://{self.bucket}: no such bucket")
        if status == 404 or code in ("NoSuchKey", "NotFound", "404"):
            return FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
        if status == 412 or code == "PreconditionFailed":
            return PreconditionFailed(f"{self.where(key)}: {what}: precondition failed")
        if status == 403:
            return AccessDenied(f"{self.where(key)}: {what}: access denied ({code or 403}): check "
                           "the credentials and the bucket's policy")  # fmt: skip
        if status >= 500 or status == 429:
            return S3Error(f"{self.where(key)}: {what} failed after {ATTEMPTS + 1} attempts: "
                           f"{status} {code}")  # fmt: skip
        return S3Error(f"{self.where(key)}: {what}: {status} {code}".rstrip())

    # -- the conditional requests the leases use (no guard: they are the guard) ---------

    def put(self, key: str, data: bytes, *, if_none_match: bool = False,
            if_match: str | None = None) -> str:  # fmt: skip
        """PUT an object, conditionally; its new ETag. `PreconditionFailed` on 412."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "Body": data}
        if if_none_match:
            args["IfNoneMatch"] = "*"
        if if_match is not None:
            args["IfMatch"] = if_match
        out = self.call("put", key, lambda: self.client.put_object(**args))
        return str(out.get("ETag", ""))

    def get(self, key: str) -> tuple[bytes, str, float, float]:
        """(body, ETag, LastModified, the server's Date) of an object, both times in
        seconds since the epoch by the server's clock."""

        def step() -> tuple[bytes, str, float, float]:
            out = self.client.get_object(Bucket=self.bucket, Key=key)
            body = out["Body"].read()
            return body, str(out.get("ETag", "")), out["LastModified"].timestamp(), _date(out)

        return self.call("get", key, step)

    def delete_if(self, key: str, etag: str | None) -> None:
        """DELETE an object (only if its ETag is `etag`, when given)."""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if etag is not None:
            args["IfMatch"] = etag
        self.call("delete", key, lambda: self.client.delete_object(**args))

    def list_objects(self, prefix: str) -> tuple[list[tuple[str, float, str]], float]:
        """Every object under `prefix` (key, LastModified, ETag) and the server's Date."""
        out: list[tuple[str, float, str]] = []
        date = time.time()
        for page in self._pages(prefix, delimiter=None):
            date = _date(page)
            out += [(o["Key"], o["LastModified"].timestamp(), str(o.get("ETag", "")))
                    for o in page.get("Contents", [])]  # fmt: skip
        return out, date

    def _pages(self, prefix: str, delimiter: str | None,
               limit: int | None = None) -> Iterator[dict[str, Any]]:  # fmt: skip
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                args["Delimiter"] = delimiter
            if token:
                args["ContinuationToken"] = token
            if limit:
                args["MaxKeys"] = limit
            page: dict[str, Any] = self.call("list", prefix, partial(self.client.list_objects_v2,
                                                                     **args))  # fmt: skip
            yield page
            token = page.get("NextContinuationToken")
            if limit or not page.get("IsTruncated") or not token:
                return

    def _get_range(self, key: str, start: int, end: int | None,
                   sink: IO[bytes] | None = None) -> bytes:  # fmt: skip
        """Bytes [start, end) of an object (to its end with None), or written to `sink`
        as they come (b"" returned then); a body cut off mid-way is asked for again from
        where it stopped, of the same object (If-Match)."""
        from botocore.exceptions import ClientError

        got = bytearray()
        n = 0
        etag: str | None = None

        def step() -> None:
            nonlocal etag, n
            at = start + n
            if end is not None and at >= end:
                return
            last = "" if end is None else str(end - 1)
            args: dict[str, Any] = {"Bucket": self.bucket, "Key": key,
                                    "Range": f"bytes={at}-{last}"}  # fmt: skip
            if etag is not None:
                args["IfMatch"] = etag
            try:
                out = self.client.get_object(**args)
            except ClientError as exc:
                if _status(exc)[0] == 416:  # from the end on: nothing
                    return
                raise
            etag = etag or out.get("ETag")
            body = out["Body"]
            try:
                while chunk := body.read(256 << 10):
                    if sink is None:
                        got.extend(chunk)
                    else:
                        sink.write(chunk)
                    n += len(chunk)
            finally:
                body.close()

        self.call("get", key, step)
        return bytes(got)

    def _delete_keys(self, keys: Sequence[str]) -> None:
        batches = [keys[i : i + _BATCH] for i in range(0, len(keys), _BATCH)]

        def one(batch: Sequence[str]) -> None:
            out = self.call("delete", batch[0], lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch],
                                            "Quiet": True}))  # fmt: skip
            for err in out.get("Errors", []):
                raise S3Error(f"{self.where(err.get('Key', ''))}: delete: {err.get('Code')}")

        self._parallel(one, batches)

    def _parallel(self, fn: Callable[[Any], object], items: Iterable[Any]) -> None:
        todo = list(items)
        if len(todo) <= 1 or self.transfers == 1:
            for item in todo:
                fn(item)
            return
        with ThreadPoolExecutor(min(self.transfers, len(todo)), "upr-s3") as pool:
            for f in [pool.submit(fn, item) for item in todo]:
                f.result()

    def _copy(self, skey: str, dkey: str) -> None:
        source = {"Bucket": self.bucket, "Key": skey}
        self.call("copy", skey, lambda: self.client.copy_object(
            Bucket=self.bucket, Key=dkey, CopySource=source))  # fmt: skip

    def _upload(self, spool: Path, key: str) -> None:
        size = spool.stat().st_size
        if size <= PART_SIZE:
            data = spool.read_bytes()
            self.call("put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=key,
                                                                 Body=data))  # fmt: skip
            return
        upload = self.call("upload", key, lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key))["UploadId"]  # fmt: skip
        parts: dict[int, str] = {}
        try:
            with open(spool, "rb") as f:
                fd = f.fileno()

                def part(n: int) -> None:
                    data = os.pread(fd, PART_SIZE, (n - 1) * PART_SIZE)
                    out = self.call("upload", key, lambda: self.client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=n,
                        Body=data))  # fmt: skip
                    parts[n] = out["ETag"]

                self._parallel(part, range(1, (size + PART_SIZE - 1) // PART_SIZE + 1))
            done = {"Parts": [{"PartNumber": n, "ETag": parts[n]} for n in sorted(parts)]}
            self.call("upload", key, lambda: self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload, MultipartUpload=done))  # fmt: skip
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            raise


class S3Storage(S3Bucket):
    """A repository under `s3://BUCKET/PREFIX` (see the module docstring)."""

    def __init__(self, root: Path, *, endpoint: str | None = None, transfers: int = 8,
                 client: Any = None) -> None:  # fmt: skip
        self.root = root
        bucket, self.prefix = s3_parts(root)
        transfers = max(1, transfers)
        super().__init__(bucket, client if client is not None else make_client(endpoint, transfers),
                         transfers)  # fmt: skip
        self.guards: list[Guard] = []
        """Writers' leases held through this storage: checked before each change."""
        self._pending: dict[Path, Path] = {}
        # uploads `replace` started, by destination, oldest first (`_publish`, `settle`)
        self._uploads: dict[Path, Future[None]] = {}
        self._uploads_lock = threading.Lock()
        self._uploader: ThreadPoolExecutor | None = None
        # the files `stat` found, for `open_read` (a segment is checked, then read: one
        # HEAD, not three): a published file is never rewritten in place, and any change
        # this process makes to one drops it here
        self._seen: dict[Path, Stat] = {}
        self._made: set[Path] = set()  # empty directories this process made
        self._cache: OrderedDict[tuple[str, object], Path] = OrderedDict()
        self._cached_bytes = 0
        self._spool = tempfile.TemporaryDirectory(prefix="upr-s3-")
        self._finalizer = weakref.finalize(self, self._spool.cleanup)

    @classmethod
    def for_root(cls, root: Path, settings: Access | None = None) -> S3Storage:
        """The storage of `root` with the endpoint and transfers of `settings` (a
        repository's own, as a Spark task or `upr repo copy`'s source has them), else of
        `upr_cli.repo.access.current`."""
        from upr_cli.repo import access

        settings = settings if settings is not None else access.current()
        return cls(root, endpoint=settings.s3_endpoint, transfers=settings.transfers)

    def __repr__(self) -> str:
        return f"S3Storage({display_location(self.root)!r})"

    # -- keys -------------------------------------------------------------------------------

    def key(self, path: Path) -> str:
        """The object key of `path` (under the root)."""
        parts = path.parts
        n = len(self.root.parts)
        if not is_s3(path) or parts[:n] != self.root.parts:
            raise S3Error(f"{path}: not under {display_location(self.root)}")
        return "/".join([p for p in (self.prefix,) if p] + list(parts[n:]))

    def _above_root(self, path: Path) -> bool:
        """The root's ancestors (`s3:/BUCKET`, `s3:`, `.`): directories that exist."""
        return path in self.root.parents

    def _guard(self) -> None:
        for g in list(self.guards):
            g.check()

    # -- Storage ------------------------------------------------------------------------

    def list(self, path: Path) -> list[Entry]:
        """The names directly under the prefix `path/`; [] when there is none."""
        if path in self._pending:
            return []
        self._wait_under(path)
        prefix = self._dir_prefix(path)
        out: list[Entry] = []
        for page in self._pages(prefix, "/"):
            for p in page.get("CommonPrefixes", []):
                out.append(Entry(p["Prefix"][len(prefix) :].rstrip("/"), True, False))
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix) :]
                if name:
                    out.append(Entry(name, False, True))
        return out

    def _dir_prefix(self, path: Path) -> str:
        if self._above_root(path):
            raise S3Error(f"{path}: not under {display_location(self.root)}")
        key = self.key(path)
        return f"{key}/" if key else ""

    def stat(self, path: Path, *, follow_links: bool = False) -> Stat | None:
        """A HEAD of the key (a file), else a probe of the prefix `key/` (a directory):
        a segment or manifest, what is stat'ed most, costs one HEAD, the cheapest
        request there is (a listing's price is a dozen HEADs', and a listing's time
        grows with the objects beside it on some servers). A directory this process
        made and left empty exists too (`make_dir`), as it would on disk."""
        if self._above_root(path):
            return _DIR
        spool = self._pending.get(path)
        if spool is None:
            self._wait_under(path)
        else:
            st = spool.stat()
            return Stat(False, True, st.st_size, (1, st.st_ino), (1, st.st_ino, st.st_size,
                                                                  st.st_mtime_ns))  # fmt: skip
        found = self._stat_slow(self.key(path), path)
        if found is not None and found.is_file:
            self._seen[path] = found
        return found or (_DIR if path in self._made else None)

    def _stat_slow(self, key: str, path: Path) -> Stat | None:
        if key:
            try:
                head = self.call("stat", key, lambda: self.client.head_object(
                    Bucket=self.bucket, Key=key))  # fmt: skip
            except FileNotFoundError:
                head = None  # no such object: a directory, or nothing
            if head is not None:
                return _file_stat(head.get("ContentLength", 0), head.get("ETag", ""),
                                  head["LastModified"])  # fmt: skip
        for page in self._pages(self._dir_prefix(path), None, limit=1):
            if page.get("KeyCount", len(page.get("Contents", []))):
                return _DIR
        return None

    def read(self, path: Path, offset: int = 0, length: int = -1) -> bytes:
        """A ranged GET, resumed where it stopped when the body is cut off."""
        spool = self._pending.get(path)
        if spool is not None:
            with open(spool, "rb") as f:
                f.seek(offset)
                return f.read(length)
        self._wait_under(path)
        if length == 0:
            return b""
        return self._get_range(self.key(path), offset, None if length < 0 else offset + length)

    def open_read(self, path: Path) -> IO[bytes]:
        """A seekable reader. An object up to `CACHE_OBJECT` bytes is downloaded whole
        into the spool and kept there (least recently used first out, `CACHE_BYTES` in
        all), so a second reader of it (restore's write pass after its checksum pass)
        reads the bytes already checked, not the bucket; a larger one is read in ranged
        GETs of `WINDOW` bytes."""
        spool = self._pending.get(path)
        if spool is not None:
            return open(spool, "rb")
        st = self._seen.get(path) or self.stat(path)  # after its upload, if under way
        if st is None or not st.is_file:
            raise FileNotFoundError(errno.ENOENT, "no such object", display_location(path))
        key = self.key(path)
        if st.size > CACHE_OBJECT or st.size > _cache_bytes():
            return cast(IO[bytes], _RangeReader(self, key, st.size))
        return open(self._cached(key, st), "rb")

    def _cached(self, key: str, st: Stat) -> Path:
        """The spool file of the object `key` as `st` describes it, downloaded once."""
        ident = (key, st.version)
        with self._lock:
            got = self._cache.pop(ident, None)
            if got is not None:
                self._cache[ident] = got  # most recently used
                return got
        fd, name = tempfile.mkstemp(dir=self._spool.name, suffix=".cache")
        path = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                self._get_range(key, 0, None, f)  # streamed to disk: no copy in memory
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        limit = _cache_bytes()
        with self._lock:
            self._cache[ident] = path
            self._cached_bytes += path.stat().st_size
            while self._cached_bytes > limit and len(self._cache) > 1:
                _old, victim = self._cache.popitem(last=False)
                self._cached_bytes -= victim.stat().st_size
                victim.unlink()  # an open reader keeps reading it (POSIX)
        return path

    def write(self, path: Path, data: bytes) -> None:
        """One PUT, replacing: the object appears whole or not at all (after every upload
        under way: a manifest is written after its segments)."""
        self.settle()
        self._guard()
        self._drop(path)
        self._seen.pop(path, None)
        key = self.key(path)
        self.call("put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=key,
                                                             Body=data))  # fmt: skip

    def write_if_absent(self, path: Path, data: bytes) -> None:
        """PUT with If-None-Match: *; FileExistsError when the object exists (not when
        it is what an earlier attempt of this call put)."""
        self.settle()
        self._guard()
        self._seen.pop(path, None)
        key = self.key(path)
        tries = 0

        def step() -> None:
            nonlocal tries
            tries += 1
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")

        try:
            self.call("put", key, step)
        except PreconditionFailed:
            if tries > 1 and self._get_range(key, 0, None) == data:
                return  # our own earlier attempt landed before its answer was lost
            raise FileExistsError(errno.EEXIST, "object exists", self.where(key)) from None

    def delete(self, path: Path) -> None:
        """DELETE (nothing when missing); a pending spool file is dropped."""
        self._seen.pop(path, None)
        if self._drop(path):
            return
        self.settle()
        self._guard()
        self.delete_if(self.key(path), None)

    def _drop(self, path: Path) -> bool:
        spool = self._pending.pop(path, None)
        if spool is None:
            return False
        spool.unlink(missing_ok=True)
        return True

    def delete_tree(self, path: Path) -> None:
        """Every object under the prefix, in DeleteObjects batches, `transfers` at once."""
        for p in [p for p in self._pending if path in p.parents]:
            self._drop(p)
        self._made = {p for p in self._made if p != path and path not in p.parents}
        self._seen = {p: st for p, st in self._seen.items() if path not in p.parents}
        self.settle()
        self._guard()
        keys = [k for k, _t, _e in self.list_objects(self._dir_prefix(path))[0]]
        self._delete_keys(keys)

    def make_dir(self, path: Path) -> None:
        """Nothing to create in the bucket (this process remembers the empty directory);
        FileExistsError when objects are under the prefix."""
        st = self.stat(path)
        if st is not None:
            raise FileExistsError(errno.EEXIST, "exists", display_location(path))
        self._made.add(path)

    def make_dirs(self, path: Path) -> None:
        """Nothing to do: a prefix exists once an object is under it."""

    def remove_dir(self, path: Path) -> None:
        """Nothing to remove; OSError(ENOTEMPTY) when objects are under the prefix."""
        if self._above_root(path):
            return
        self._made.discard(path)
        st = self.stat(path)
        if st is not None:
            raise OSError(errno.ENOTEMPTY, "not empty", display_location(path))

    def sync_dir(self, path: Path) -> None:
        """Wait for the uploads under way (a PUT is durable when it is answered)."""
        self.settle()

    def sync_all(self, paths: Iterable[Path]) -> None:
        """Wait for the uploads under way (a PUT is durable when it is answered)."""
        self.settle()

    def create(self, path: Path) -> IO[bytes]:
        """A local spool file, uploaded by `replace`; nothing reaches the bucket yet."""
        if path in self._pending:
            raise FileExistsError(errno.EEXIST, "exists", display_location(path))
        fd, name = tempfile.mkstemp(dir=self._spool.name, suffix=".spool")
        self._pending[path] = Path(name)
        return os.fdopen(fd, "w+b")

    def append(self, f: IO[bytes], data: bytes) -> None:
        """Write to the spool file."""
        f.write(data)

    def copy(self, src: IO[bytes], dst: IO[bytes]) -> None:
        """Copy the rest of `src` into the spool file."""
        shutil.copyfileobj(src, dst, 1 << 20)

    def sync(self, f: IO[bytes]) -> None:
        """Flush the spool file (the upload in `replace` makes it durable)."""
        f.flush()

    def replace(self, src: Path, dst: Path) -> None:
        """Publish a spool file at `dst` (upload, then drop the spool); move an object
        (CopyObject, Delete) or every object under a prefix (every copy first, then the
        deletes, `_remove`). A prefix moved to a removal name (`NAME.tmp-…-removed`,
        formats/repository.md §4.4: removed next) is only removed: nothing is copied."""
        self._guard()
        self._seen.pop(src, None)
        self._seen.pop(dst, None)
        dkey = self.key(dst)
        spool = self._pending.pop(src, None)
        if spool is not None:
            self._publish(spool, dst, dkey)
            return
        self.settle()
        skey = self.key(src)
        try:
            self._copy(skey, dkey)
            moved = True
        except FileNotFoundError:
            moved = False  # no such object: a directory's objects move below
        if moved:
            self.delete_if(skey, None)
            return
        found = self.list_objects(self._dir_prefix(src))[0]
        if not found:
            raise FileNotFoundError(errno.ENOENT, "no such object", display_location(src))
        keys = [k for k, _t, _e in found]
        if not dst.name.endswith(_REMOVED):
            self._parallel(lambda k: self._copy(k, dkey + k[len(skey) :]), keys)
        self._remove(keys)

    def _publish(self, spool: Path, dst: Path, key: str) -> None:
        """Upload a spool file to `key` in the background, `transfers` at once: the
        caller goes on writing the next segment meanwhile. At most 2 x `transfers`
        uploads are under way (their spool files on local disk, each read whole or a part
        at a time: memory stays within `transfers` x `PART_SIZE`); every other operation
        waits for them first (`settle`: a manifest is only written after its segments),
        and reads of `dst` wait for its own."""
        with self._uploads_lock:
            if self._uploader is None:
                self._uploader = ThreadPoolExecutor(self.transfers, "upr-s3-put")
            uploader = self._uploader
            full = len(self._uploads) >= 2 * self.transfers
        if full:
            self._settle_oldest()

        def run() -> None:
            try:
                self._upload(spool, key)
            finally:
                spool.unlink(missing_ok=True)

        future = uploader.submit(run)
        with self._uploads_lock:
            self._uploads[dst] = future

    def _settle_oldest(self) -> None:
        with self._uploads_lock:
            if not self._uploads:
                return
            dst = next(iter(self._uploads))
            future = self._uploads.pop(dst)
        future.result()

    def _wait_under(self, path: Path) -> None:
        """Wait for the uploads of `path` and of anything under it."""
        with self._uploads_lock:
            mine = [d for d in self._uploads if d == path or path in d.parents]
            futures = [self._uploads.pop(d) for d in mine]
        for f in futures:
            f.result()

    def settle(self) -> None:
        """Wait for every upload `replace` started; the first failure is raised, after
        the others have ended (their objects are there for a rerun to reuse)."""
        with self._uploads_lock:
            futures = list(self._uploads.values())
            self._uploads.clear()
        failure: BaseException | None = None
        for f in futures:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - the first is raised below
                failure = failure or exc
        if failure is not None:
            raise failure

    def _remove(self, keys: Sequence[str]) -> None:
        """Delete a directory's objects so that no reader sees part of a backup: its
        manifest files (the commit points) one by one first, then the rest in batches."""
        from upr_cli.repo.manifests import MANIFEST_COPY, MANIFEST_FILE

        first = [k for k in keys if k.rsplit("/", 1)[-1] in (MANIFEST_FILE, MANIFEST_COPY)]
        for k in sorted(first, key=lambda k: (k.count("/"), k)):
            self.delete_if(k, None)
        gone = set(first)
        self._delete_keys([k for k in keys if k not in gone])

    def link(self, src: Path, dst: Path) -> None:
        """CopyObject inside the bucket; FileExistsError when `dst` exists."""
        self.settle()
        self._guard()
        self._seen.pop(dst, None)
        if self.stat(dst) is not None:
            raise FileExistsError(errno.EEXIST, "exists", display_location(dst))
        self._copy(self.key(src), self.key(dst))

    def open_lock(self, path: Path, *, create: bool) -> int:
        """No descriptors in an object store: its locks are leases (`upr_cli.repo.lease`)."""
        raise OSError(errno.ENOTSUP, "an object store has no lock files (leases instead)",
                      display_location(path))  # fmt: skip


def _cache_bytes() -> int:
    try:
        return int(os.environ.get("UPR_S3_CACHE_BYTES", CACHE_BYTES))
    except ValueError:
        return CACHE_BYTES


def _date(response: dict[str, Any]) -> float:
    """The server's clock at its answer (the Date header), else ours."""
    from email.utils import parsedate_to_datetime

    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    with contextlib.suppress(TypeError, ValueError):
        return parsedate_to_datetime(headers["date"]).timestamp()
    return time.time()


_DIR = Stat(True, False, 0, (0, 0), (0, 0, 0, 0))


def _file_stat(size: object, etag: object, modified: Any) -> Stat:
    n = int(size)  # type: ignore[call-overload]
    ident = _ident(str(etag))
    return Stat(False, True, n, (0, ident), (0, ident, n, int(modified.timestamp() * 1e9)))


def _ident(etag: str) -> int:
    return int.from_bytes(hashlib.blake2b(etag.encode(), digest_size=7).digest(), "big")


class _RangeReader(SeekableReader):
    """`open_read`'s reader of a large object: a read inside the window it holds is
    served from memory, any other is one ranged GET (resumed when cut off) of at least
    `WINDOW` bytes, reaching back from the object's end when near it (so a segment's
    trailer and footer come in one request)."""

    def __init__(self, storage: S3Storage, key: str, size: int) -> None:
        super().__init__(size)
        self._s, self._key = storage, key
        self._start, self._data = 0, b""

    def read(self, size: int | None = -1) -> bytes:
        want = self._size - self._pos if size is None or size < 0 else size
        n = max(0, min(want, self._size - self._pos))
        if n == 0:
            return b""
        pos, start = self._pos, self._start
        if not (start <= pos and pos + n <= start + len(self._data)):
            end = min(self._size, pos + max(n, WINDOW))
            start = max(0, min(pos, end - WINDOW))
            self._start, self._data = start, self._s._get_range(self._key, start, end)
        out = self._data[pos - self._start : pos - self._start + n]
        self._pos += len(out)
        return out
