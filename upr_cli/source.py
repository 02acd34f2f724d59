"""Where the commands' data comes from: partition lists, repositories, source specifications.

Every command names its sources and targets the same way: `upr://…` or `couchbase://…`
(a live node or cluster; `uprs://…` and `couchbases://…` over TLS), `repo:URL[@BACKUP]`
(a backup repository: a directory or `s3://BUCKET/PREFIX`; after `@` a backup id, or
a time, `repo:DIR@2026-12-06T14:37:00Z`, resolved by `jobs.state.select` as
`--at-time` is), `sqlite:PATH` (a replay
store) and `json:PATH` (a JSON file of failover logs; a bare path ending in .json too).
`parse_source` is the one parser of those forms; each command says which kinds it
takes, and anything else is a usage error naming what it does take. The module imports
nothing heavy, so the CLI can use it before it knows which command runs.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from upr_cli.errors import UsageError

if TYPE_CHECKING:
    from upr_cli.repo import Manifest, Repository

#: a bucket has at most this many partitions (vbuckets), numbered from 0
MAX_PARTITIONS = 1024

SourceKind = Literal["node", "repo", "sqlite", "json"]

#: how each kind is written, for the messages that list what a command takes
FORMS: dict[SourceKind, str] = {
    "node": "upr://…",
    "repo": "repo:URL[@BACKUP]",
    "sqlite": "sqlite:PATH",
    "json": "a JSON file of failover logs",
}


def parse_partitions(spec: str) -> list[int]:
    """'0-15,40' → [0, …, 15, 40]; anything else, or a partition no bucket has, is a
    UsageError naming the part that is wrong."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise UsageError(f"--partitions: {part!r} is not N or N-M")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise UsageError(f"--partitions: {part!r} is an empty range")
        if hi >= MAX_PARTITIONS:
            raise UsageError(f"--partitions: {hi} is not a partition (a bucket has at most "
                             f"{MAX_PARTITIONS}: 0-{MAX_PARTITIONS - 1})")  # fmt: skip
        out.update(range(lo, hi + 1))
    return sorted(out)


def selected(spec: str | None) -> list[int] | None:
    """`--partitions` as the jobs take it: None (every partition) when not given."""
    return parse_partitions(spec) if spec else None


@dataclass(frozen=True, slots=True)
class Source:
    """A parsed source or target: its kind, the text as given, and its parts."""

    kind: SourceKind
    text: str
    path: Path | None = None  # repo, sqlite, json: the local path
    at: str | None = None  # repo: the backup or time after '@' (None: the latest)

    @property
    def uri(self) -> str:
        """A node's URI (the text as given, credentials and all)."""
        assert self.kind == "node", self
        return self.text


def parse_source(
    text: str, kinds: Collection[SourceKind] = FORMS, *, what: str = "SOURCE"
) -> Source:
    """Parse one source specification of the `kinds` a command takes.

    A form the command does not take, an unknown scheme or an empty path is a UsageError
    that says what the command takes (credentials in the text are never echoed)."""
    noun = "target" if "TARGET" in what else "source"
    takes = f"a {noun} is " + " or ".join(FORMS[k] for k in FORMS if k in kinds)
    source = _parse(text, json_paths="json" in kinds)
    if source is None:
        raise UsageError(_not_a_source(text, kinds, what, noun, takes))
    if source.kind not in kinds:
        raise UsageError(f"{what} {_shown(text)!r}: {FORMS[source.kind]} is not a {noun} "
                         f"here; {takes}")  # fmt: skip
    if source.kind != "node" and source.path is None:
        raise UsageError(f"{what} {text} needs a path, e.g. {source.kind}:/tmp/x")
    return source


def _parse(text: str, *, json_paths: bool) -> Source | None:
    """The source `text` names, by its prefix (or a bare PATH.json when `json_paths`)."""
    if text.startswith(("upr://", "couchbase://", "uprs://", "couchbases://")):
        return Source("node", text)
    if text.startswith("repo:"):
        # the last `@` starts the backup id: `repo:s3://bucket/prefix@ID` too
        rest = text[len("repo:") :]
        path, at = rest.rsplit("@", 1) if "@" in rest else (rest, "")
        return Source("repo", text, _repo_path(path) if path else None, at or None)
    if text.startswith("sqlite:"):
        path = text[len("sqlite:") :]
        return Source("sqlite", text, Path(path) if path else None)
    if text.startswith("json:"):
        path = text[len("json:") :]
        return Source("json", text, Path(path) if path else None)
    if json_paths and text.endswith(".json"):
        return Source("json", text, Path(text))
    return None


def _repo_path(location: str) -> Path:
    """A `repo:` location as `--repo` takes it: a directory or `s3://BUCKET/PREFIX`
    (`upr_cli.storage.parse_location`); any other scheme is a usage error."""
    from upr_cli.storage import UnknownScheme, parse_location

    try:
        return parse_location(location)
    except UnknownScheme as exc:
        raise UsageError(str(exc)) from None


def local_path(text: str) -> Path | None:
    """The local path a `repo:`, `sqlite:` or `json:` argument names, else None (an
    object-store repository, a location no backend serves)."""
    from upr_cli.storage import is_s3

    try:
        source = _parse(text, json_paths=False)
    except UsageError:
        return None
    if source is None or source.kind == "node" or source.path is None:
        return None
    return None if is_s3(source.path) else source.path


def _shown(text: str) -> str:
    """`text` as a message may show it: `scheme:…` when it may hold a password."""
    scheme, colon, _rest = text.partition(":")
    hidden = colon and scheme != "repo" and "@" in text and "://" in text
    return f"{scheme}:…" if hidden else text


def _not_a_source(
    text: str, kinds: Collection[SourceKind], what: str, noun: str, takes: str
) -> str:
    if not text.strip():
        return f"{what} is empty: {takes}"
    scheme, colon, _rest = text.partition(":")
    if colon and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]+", scheme):
        return f"{what} {_shown(text)!r}: unknown kind of {noun}; {takes}"
    hints = {"sqlite": "a SQLite store", "repo": "a repository"}
    there = next((f"{hints[k]} there is {k}:{text}; " for k in hints if k in kinds), "")
    return f"{what} {text!r} is a path: {there}{takes}"


def open_repo(path: Path) -> Repository:
    """An existing repository (its repo.json is checked, through its storage); a missing
    one is a usage error."""
    from upr_cli.repo import Repository
    from upr_cli.storage import display_location

    repo = Repository(path)
    if repo.storage.stat(repo.repo_file, follow_links=True) is None:
        raise UsageError(f"{display_location(path)}: not a upr repository (no repo.json)")
    repo.info()
    return repo


def open_bucket(
    path: Path, bucket: str | None, at: object = "latest", *,
    held: contextlib.ExitStack | None = None, command: str = "read",
    on_warning: Callable[[str], None] | None = None,
) -> tuple[Repository, str, list[Manifest]]:  # fmt: skip
    """The repository, the bucket (given, or the only one it holds) and the manifests of
    its committed backups up to `at` (a backup id or a unique prefix of one, latest or
    oldest: `backup_named`; a time, or any point in time `jobs.state.select`
    resolves: the latest), oldest first, once the chain the state at `at` reads is
    checked whole (`Repository.chain`: a damaged manifest, a missing parent or a seq
    gap is a `BrokenChain` naming it). An ambiguous or missing bucket is a usage error;
    an `at` that names no committed backup is left to `jobs.state.select` to report.

    With `held`, the bucket's shared lock (formats/repository.md §7.2: a `ReadLock` for
    `command`) is taken before the chain is read and entered into `held`: the caller
    reads the segments before it closes `held`, so no prune or sweep removes them
    meanwhile."""
    from upr_cli.storage import display_location

    repo = open_repo(path)
    names = repo.buckets()
    b = bucket or (names[0] if len(names) == 1 else None)
    if b is None:
        raise UsageError(
            f"{display_location(path)}: holds buckets {', '.join(names) or 'none'}; give --bucket"
        )
    if held is not None:
        from upr_cli.repo.readers import read_lock

        held.enter_context(read_lock(repo, b, command, on_warning))
    committed = repo.committed(b)
    if not committed:
        return repo, b, []
    k = backup_named(committed, at) if isinstance(at, str) and not _is_time(at) else committed[-1]
    if k is None:  # not a committed backup: select() says so
        return repo, b, repo.readable(b)[0]
    return repo, b, repo.chain(b, k)


def _is_time(at: str) -> bool:
    from upr_cli.repo.pitr import looks_like_time

    return looks_like_time(at)


B = TypeVar("B")


def backup_named(backups: Sequence[B], at: str, option: str = "--at") -> B | None:
    """The backup `at` names among `backups` (oldest first): latest, oldest, an id, or a
    prefix of exactly one id (`20261121T06` when no other backup starts so). None when
    none matches; a prefix of several is a UsageError listing them."""
    if not backups:
        return None
    if at == "latest":
        return backups[-1]
    if at == "oldest":
        return backups[0]
    matches = [b for b in backups if str(b).startswith(at)] if at else []
    exact = [b for b in matches if str(b) == at]
    if exact or len(matches) == 1:
        return (exact or matches)[0]
    if len(matches) > 1:
        shown = ", ".join(str(b) for b in matches[:5])
        more = f" and {len(matches) - 5} more" if len(matches) > 5 else ""
        raise UsageError(f"{option} {at!r} is the start of {len(matches)} backups: {shown}"
                         f"{more}; give more of the id")  # fmt: skip
    return None
