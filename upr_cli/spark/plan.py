"""Planning a repository read for Spark (formats/spark.md §2-3): options, units, groups.

Pure functions of the options and the manifests (no segment is opened, no pyspark
import), so the driver plans cheaply and the plan is tested without a JVM. A `Group`
is what one Spark task reads; it is small and picklable (paths, ids, seq cuts, the
names of the collections it may meet, and the `Access` the task opens the repository
with).

Keys (formats/spark.md §7). An encrypted (or s3://) repository is opened with the
options `keyFile`, `keyCommand`, `s3Endpoint` and `transfers` (a path, a command, an
endpoint: none of them is a secret, and options show in Spark's UI and plans), else with
`UPR_KEY_FILE` / `UPR_PASSPHRASE` from the environment, which the Python worker that
plans inherits from the driver. The planner unlocks the repository once and puts its
data key in every `Group` (`Access.data_keys`): the key reaches the executors inside
the pickled tasks only, never in an option, SparkConf or the executors' environment,
so an executor never needs the user's key and never runs the key command.

Collections (formats/spark.md §4). Records carry a collection id; the names come from
the backups' manifests: each backup records the source's collections at its start and
the changes its streams saw, so replaying those changes over the chain names every id
the chain met, a dropped one too (`collection_history`), and gives the collections that
exist at `at` (`chain_manifest`). The state drops the documents of a collection dropped
by then, as the source did; the `collections` option keeps only the ids its paths name.
A backup written before collections holds `_default._default` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from upr_cli.collections import DEFAULT, DEFAULT_ID, parse_paths
from upr_cli.collections import Path as CollectionPath
from upr_cli.errors import UprError, UsageError
from upr_cli.repo import NO_CUT, BackupId, Manifest, Repository, lost_cut, plan_state
from upr_cli.repo import access as _access
from upr_cli.repo.access import Access
from upr_cli.repo.keys import MissingKey
from upr_cli.repo.manifest import chain_manifest, collection_history
from upr_cli.storage import parse_location

VIEWS = ("state", "history")
DEFAULT_PARTITIONS = 16


class SparkOptionError(UsageError):
    """A data-source option is wrong; the message names the option."""


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """The parsed options of a batch read."""

    repo: Path
    bucket: str
    at: str  # the resolved backup id
    view: str
    partitions: tuple[int, ...]  # vbuckets to read
    num_partitions: int
    collections: tuple[CollectionPath, ...] = ()  # only these (none: every collection)
    # the key and object-store settings, with the data key of an encrypted repository
    access: Access = field(default_factory=Access)


@dataclass(frozen=True, slots=True)
class Piece:
    """Records of one segment file with seq ≤ `max_seq` (state) or all of them, those
    above `cut` flagged lost (history)."""

    partition: int
    backup_id: str
    path: str
    max_seq: int
    cut: int
    bytes: int


@dataclass(frozen=True, slots=True)
class Group:
    """One Spark task: pieces, and in `state` the vbuckets they make up (whole ones)."""

    view: str
    pieces: tuple[Piece, ...]
    # (collection id, scope, collection) of every id the chain met; an id not here
    # has no name (NULL)
    names: tuple[tuple[int, str, str], ...] = ((DEFAULT_ID, DEFAULT, DEFAULT),)
    keep: frozenset[int] | None = None  # the collection ids to read (None: all)
    # the repository and bucket read: a task holds the bucket's shared lock while it
    # reads (formats/repository.md §7.2); "" (a group built by hand): no lock
    repo: str = ""
    bucket: str = ""
    # how the task opens the repository: the planner's settings with the repository's
    # data key (shipped inside the pickled task; its repr never shows the key)
    access: Access | None = None

    @property
    def bytes(self) -> int:
        """Compressed bytes this task reads."""
        return sum(p.bytes for p in self.pieces)


def get_option(options: Mapping[str, str], name: str) -> str | None:
    for k, v in options.items():  # Spark's options are case-insensitive
        if k.lower() == name.lower():
            return v
    return None


def read_access(options: Mapping[str, str]) -> Access:
    """The settings the options give (`keyFile`, `keyCommand`, `s3Endpoint`,
    `transfers`) over this process's (`access.current`: the CLI's, or none in a Python
    worker); the key file and passphrase of the environment apply when no option names
    a key."""
    changes: dict[str, object] = {}
    key_file, key_command = get_option(options, "keyFile"), get_option(options, "keyCommand")
    if key_file:
        changes["key_file"] = Path(key_file)
    if key_command:
        changes["key_command"] = key_command
    endpoint = get_option(options, "s3Endpoint")
    if endpoint:
        changes["s3_endpoint"] = endpoint
    transfers = get_option(options, "transfers")
    if transfers is not None:
        if not transfers.isdigit() or int(transfers) < 1:
            raise SparkOptionError(f"option transfers: {transfers!r} is not a positive integer")
        changes["transfers"] = int(transfers)
    return replace(_access.current(), **changes)  # type: ignore[arg-type]


def parse_options(options: Mapping[str, str]) -> tuple[ReadOptions, list[Manifest]]:
    """Check the options against the repository; returns them and the bucket's manifests.

    Every problem is a `SparkOptionError` naming the option (one line).
    """
    from upr_cli.jobs.state import select
    from upr_cli.source import open_bucket, parse_partitions

    path = get_option(options, "path") or get_option(options, "repo")
    if not path:
        raise SparkOptionError("option path: give the repository, as load(DIR) or repo")
    view = (get_option(options, "view") or "state").lower()
    if view not in VIEWS:
        raise SparkOptionError(f"option view: {view!r} is not one of {', '.join(VIEWS)}")
    at = get_option(options, "at") or "latest"
    settings = read_access(options)
    try:  # the chain the state at `at` reads is checked whole (formats/repository.md §8.8)
        with _access.using(settings):
            repo, bucket, manifests = open_bucket(parse_location(path),
                                                  get_option(options, "bucket"), at)  # fmt: skip
    except MissingKey:
        raise SparkOptionError(
            f"option keyFile: {path}: the repository is encrypted: give its key with the "
            "option keyFile or keyCommand, or UPR_KEY_FILE or UPR_PASSPHRASE in the driver's "
            "environment"
        ) from None
    except (UprError, ValueError) as exc:  # ValueError: a location no backend serves
        raise SparkOptionError(f"option path: {exc}") from None
    want = None
    spec = get_option(options, "partitions")
    if spec:
        try:
            want = parse_partitions(spec)
        except UprError as exc:
            raise SparkOptionError(f"option partitions: {exc}") from None
    try:
        sel = select(manifests, at, want)
    except UprError as exc:
        msg = str(exc).replace("--at: ", "")
        raise SparkOptionError(f"option at: {msg}") from None
    n = get_option(options, "numPartitions") or str(DEFAULT_PARTITIONS)
    if not n.isdigit() or int(n) < 1:
        raise SparkOptionError(f"option numPartitions: {n!r} is not a positive integer")
    paths = _paths(get_option(options, "collections"))
    opts = ReadOptions(repo.path, bucket, str(sel.backup_id), view, sel.partitions, int(n),
                       paths, repo.keyed_access())  # unlocked once, here  # fmt: skip
    if paths:  # a path no backup up to `at` ever met is a typo, not an empty collection
        names = collection_names([m for m in manifests if str(m.backup_id) <= opts.at])
        missing = [str(p) for p in paths if not any(p.covers(*n) for n in names.values())]
        if missing:
            raise SparkOptionError(
                f"option collections: {', '.join(missing)}: no such collection in the "
                f"backups up to {opts.at}"
            )
    return opts, list(manifests)


def _paths(spec: str | None) -> tuple[CollectionPath, ...]:
    try:
        return tuple(parse_paths(spec))
    except UprError as exc:
        raise SparkOptionError(f"option collections: {exc}") from None


def collection_names(manifests: Sequence[Manifest]) -> dict[int, tuple[str, str]]:
    """(scope, collection) of every collection id a chain of backups met."""
    return {cid: (p.scope, p.collection or DEFAULT)
            for cid, (p, _dropped) in collection_history(manifests).items()}  # fmt: skip


def plan(opts: ReadOptions, manifests: list[Manifest]) -> list[Group]:
    """The groups (tasks) of a read, balanced by bytes (formats/spark.md §3), each with
    the repository's data key when it is encrypted (unlocked here, once)."""
    ms = [m for m in manifests if str(m.backup_id) <= opts.at]
    at = next(m.backup_id for m in ms if str(m.backup_id) == opts.at)
    repo = Repository(opts.repo, access=opts.access)
    shipped = repo.keyed_access()

    def path(backup_id: BackupId, file: str) -> str:
        return str(repo.segment_path(opts.bucket, backup_id, file))

    units: list[tuple[Piece, ...]] = []
    for p in opts.partitions:
        if opts.view == "state":
            pieces = tuple(
                Piece(p, str(s.backup_id), path(s.backup_id, s.segment.file), s.max_seq, NO_CUT,
                      s.segment.bytes)
                for s in plan_state(ms, at=at, partition=p)
            )  # fmt: skip
            if pieces:
                units.append(pieces)
            continue
        for m in ms:
            entry = m.partition(p)
            if entry is None:
                continue
            c = lost_cut(ms, p, m.backup_id, at)
            units += [(Piece(p, str(m.backup_id), path(m.backup_id, seg.file), NO_CUT, c,
                             seg.bytes),) for seg in entry.segments]  # fmt: skip
    names = collection_names(ms)
    keep = None
    if opts.collections:  # by name: in history, a dropped collection's records too
        keep = {cid for cid, n in names.items() if any(w.covers(*n) for w in opts.collections)}
    if opts.view == "state":  # a dropped collection's documents are gone from the state
        alive = {coll.id for _scope, coll in chain_manifest(ms).collections()}
        keep = alive if keep is None else keep & alive
    groups = balance(units, opts.num_partitions, opts.view)
    named = tuple((cid, *n) for cid, n in sorted(names.items()))
    frozen = frozenset(keep) if keep is not None else None
    return [replace(g, names=named, keep=frozen, repo=str(opts.repo), bucket=opts.bucket,
                    access=shipped) for g in groups]  # fmt: skip


def balance(units: list[tuple[Piece, ...]], n: int, view: str) -> list[Group]:
    """Largest unit first, each into the group with the fewest bytes (LPT), deterministic."""
    k = max(1, min(n, len(units)))
    bins: list[list[Piece]] = [[] for _ in range(k)]
    load = [0] * k
    for unit in sorted(units, key=lambda u: (-sum(p.bytes for p in u), u[0].partition, u[0].path)):
        i = min(range(k), key=lambda j: (load[j], j))
        bins[i].extend(unit)
        load[i] += sum(p.bytes for p in unit)
    return [Group(view, tuple(b)) for b in bins if b]
