"""The JSON convention across every command (docs/output.md §4): every `--json` document
leads with its `schema` version, follows `json_convention.problems()`, and a member name
has one JSON type wherever it appears, in every command.

Every command with `--json` (found from `upr`'s own command tree, so a new one cannot
be left out) runs for real, in this process (`cluster init` and `start`, which leave
daemons running, in a child): against one `upr serve` on loopback (four partitions),
a small repository its backups write, stores, copies, an encrypted repository, and a
two-node `upr cluster`. The Spark commands are the one exception: a JVM starts slower
than this whole module runs, so their summaries go through the same `_report` that
their `--json` prints (tests/e2e/test_spark_e2e.py runs them on Spark). Every document
is walked; each member name gets the set of JSON types it had, and a name with more
than one fails: there are no exceptions (null aside, a value of every type).
One module-scoped run feeds every test: about 17 s, most of it the cluster's start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.cli.json_convention import problems
from tests.cli.test_conventions_repo_env import commands
from tests.e2e.conftest import Node
from tests.repo.repo_helpers import run_upr
from upr_cli.cli import output

ROOT = Path(__file__).resolve().parents[2]

#: objects keyed by data (a status, a node, a link, a partition), not by member names:
#: their keys are not names of the convention, their values are walked
MAPS = frozenset({
    "counts", "errors_by_status", "error_statuses", "states", "links", "link_errors",
    "paused_after", "promoted", "moved", "failover_entries",
})  # fmt: skip
#: a document's own data (its value, its xattrs): typed by the document, not by upr
DOCUMENT_DATA = frozenset({"value", "xattrs"})


def json_type(value: Any) -> str:
    """The JSON type of a value: null, boolean, integer, number, string, array, object."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def walk(doc: Any, where: str, seen: dict[str, dict[str, set[str]]]) -> None:
    """Record every member's type: seen[name][type] = the places it had it."""
    if isinstance(doc, list):
        for item in doc:
            walk(item, where + "[]", seen)
    elif isinstance(doc, dict):
        for key, value in doc.items():
            if key.isdigit():  # an object keyed by partition number: its values count
                walk(value, f"{where}.N", seen)
                continue
            seen[key].setdefault(json_type(value), set()).add(f"{where}.{key}")
            if key in DOCUMENT_DATA:
                continue
            if key in MAPS and isinstance(value, dict):
                for item in value.values():
                    walk(item, f"{where}.{key}.*", seen)
                continue
            walk(value, f"{where}.{key}", seen)


def json_commands() -> set[str]:
    """Every command (subcommands as "repo keys") that takes --json."""
    return {n for n, cmd in commands() if any("--json" in p.opts for p in cmd.params)}


class Run:
    """The commands run so far: their documents, by command."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.docs: dict[str, list[Any]] = defaultdict(list)

    def __call__(self, *args: str, ok: tuple[int, ...] = (0,), child: bool = False) -> Any:
        """`upr ARGS --json`, in this process or (`child`: a command that starts
        daemons, whose handles must not die with this process's objects) in a child."""
        if child:
            env = {k: v for k, v in os.environ.items() if k != "UPR_PASSWORD"}
            proc = subprocess.run(
                [sys.executable, "-m", "upr_cli", *args, "--json"], capture_output=True,
                text=True, timeout=120, env=env | {"PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        else:
            code, out, err = run_upr(self.capsys, *args, "--json")
        assert code in ok, f"upr {' '.join(args)}: exit {code}: {err}"
        doc = json.loads(out)
        name = " ".join(a for a in args[:2] if not a.startswith(("-", "upr:", "/")))
        name = name if name in json_commands() else args[0]
        self.docs[name].append(doc)
        return doc


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("conv") / "node", "--flush-interval", "0.02",
             partitions=4).start()  # fmt: skip
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def documents(node: Node, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every command's --json document(s), by command."""
    tmp = tmp_path_factory.mktemp("docs")
    mp = pytest.MonkeyPatch()
    mp.delenv("UPR_REPO", raising=False)
    mp.delenv("UPR_PASSWORD", raising=False)
    capsys = _Capture()
    run = Run(capsys)  # type: ignore[arg-type]
    repo, uri = str(tmp / "repo"), node.uri
    try:
        with capsys:
            _node_and_repo(run, tmp, repo, uri)
            _repo_admin(run, tmp, repo)
            _cluster(run, tmp / "cl")
            _spark(run)
    finally:
        mp.undo()
    return dict(run.docs)


def _node_and_repo(run: Run, tmp: Path, repo: str, uri: str) -> None:
    run("load", uri, "--docs", "40")
    run("collections", "create", uri, "app")
    run("collections", "create", uri, "app.orders")
    run("collections", "list", uri)
    run("backup", uri, "--repo", repo, "--dry-run")
    first = run("backup", uri, "--repo", repo)
    run("load", uri, "--docs", "20", "--update-ratio", "0.5")
    run("collections", "drop", uri, "app.orders")
    run("collections", "repair", uri)
    run("backup", uri, "--repo", repo)
    run("info", "--repo", repo)
    run("info", "--repo", repo, "--partitions", "0")
    run("verify", "--repo", repo)
    keys = run("ls", "--repo", repo)["keys"]
    key = next(k["key"] for k in keys if k["collection"] == "_default")
    run("examine", "--repo", repo, key)
    run("cat", "--repo", repo, key)
    run("diff", uri, f"repo:{repo}", ok=(0, 1, 5))
    run("rollback-point", "--server", uri, "--client", f"repo:{repo}")
    run("rollback-point", "--server-log", '[["deadbeef",8],["cafebabe",0]]',
        "--client-log", '[["deadbeef",10],["cafebabe",0]]', "--snapshot-seq", "6",
        "--seen-seq", "9")  # fmt: skip
    run("restore", "--repo", repo, f"sqlite:{tmp / 'restored.db'}")
    run("restore", "--repo", repo, uri)  # every document: the target has it already
    run("replay", uri, "--into", str(tmp / "replica.db"))
    run("replay", f"repo:{repo}", "--into", str(tmp / "from-repo.db"))
    run("salvage", "--repo", repo, "--into", uri)
    run("repo", "copy", "--from", repo, "--to", str(tmp / "copy"))
    run("repo", "unlock", "--repo", repo)
    run("merge", "--repo", repo)
    run("prune", "--repo", repo, "--keep-last", "1")
    run("remove", "--repo", repo, first["backup_id"])


def _repo_admin(run: Run, tmp: Path, repo: str) -> None:
    k1, k2, k3 = (tmp / n for n in ("k1", "k2", "k3"))
    for k in (k1, k2, k3):
        k.write_bytes(os.urandom(32))
    enc = str(tmp / "enc")
    run("repo", "init", "--repo", enc, "--encrypt", "--key-file", str(k1))
    (slot,) = run("repo", "keys", "--repo", enc, "--key-file", str(k1))["key_slots"]
    run("repo", "add-key", "--repo", enc, "--key-file", str(k1), "--new-key-file", str(k2))
    run("repo", "rotate-key", "--repo", enc, "--key-file", str(k2), "--new-key-file", str(k3))
    run("repo", "remove-key", slot["slot_id"], "--repo", enc, "--key-file", str(k3))


def _cluster(run: Run, data: Path) -> None:
    """A two-node cluster through each of its commands; stopped whatever happens."""
    d = ("--data", str(data))
    run("cluster", "init", "--nodes", "2", "--replicas", "1", "--num-partitions", "4", *d,
        child=True)  # fmt: skip
    try:
        run("cluster", "status", *d)
        run("cluster", "pause", "n1", *d)
        run("cluster", "resume", "n1", *d)
        run("cluster", "failover", "n1", "--graceful", *d)
        run("cluster", "rebalance", *d)
        run("cluster", "stop", *d)
        run("cluster", "start", *d, child=True)
    finally:
        run_upr(run.capsys, "cluster", "stop", *d)


def _spark(run: Run) -> None:
    """The Spark commands' summaries, through the `_report` their --json prints."""
    from upr_cli.cli import spark as spark_cli
    from upr_cli.jobs.merge import MergeSummary
    from upr_cli.spark.jobs import ExportSummary

    bid = "20261121T061500.123456Z"
    merged = MergeSummary(bid, bid, 2, 4, 60, 4096, 0.5)
    for name, summary in (
        ("spark export", ExportSummary("/backups/cb", bid, "/tmp/out", "parquet", 40, 4, 1.5, 3)),
        ("spark merge", merged),
    ):  # fmt: skip
        run.capsys.readouterr()
        spark_cli._report(summary, 12.0, True, "")
        run.docs[name].append(json.loads(run.capsys.readouterr().out))


class Captured(NamedTuple):
    out: str
    err: str


class _Capture:
    """capsys for a module fixture: stdout and stderr swapped for buffers in a block."""

    def __enter__(self) -> _Capture:
        import io

        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = self._out, self._err = io.StringIO(), io.StringIO()
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout, sys.stderr = self._saved

    def readouterr(self) -> Any:
        out, err = self._out.getvalue(), self._err.getvalue()
        self._out.seek(0), self._out.truncate(), self._err.seek(0), self._err.truncate()
        return Captured(out, err)


def test_every_command_with_json_ran(documents: dict[str, list[Any]]) -> None:
    assert set(documents) == json_commands()


def test_every_document_leads_with_its_schema(documents: dict[str, list[Any]]) -> None:
    for name, docs in documents.items():
        for doc in docs:
            assert isinstance(doc, dict), f"{name}: one object, not {type(doc).__name__}"
            assert next(iter(doc)) == "schema", f"{name}: `schema` comes first"
            assert doc["schema"] == output.SCHEMA == 1, name


def test_every_document_follows_the_convention(documents: dict[str, list[Any]]) -> None:
    found = {n: p for n, docs in documents.items() for d in docs if (p := problems(d))}
    assert not found, json.dumps(found, indent=1)


def test_a_name_has_one_type_in_every_command(documents: dict[str, list[Any]]) -> None:
    seen: dict[str, dict[str, set[str]]] = defaultdict(dict)
    for name, docs in documents.items():
        for doc in docs:
            walk(doc, name, seen)
    mixed = {
        key: {t: sorted(w)[:3] for t, w in types.items()}
        for key, types in seen.items()
        if len(set(types) - {"null"}) > 1
    }
    assert not mixed, json.dumps(mixed, indent=1)


def test_the_checker_catches_a_name_with_two_types() -> None:
    seen: dict[str, dict[str, set[str]]] = defaultdict(dict)
    walk({"buckets": {"default": {"collections": 3}}}, "info", seen)
    walk({"buckets": [{"collections": [{"id": 8}]}]}, "verify", seen)
    assert set(seen["buckets"]) == {"object", "array"}
    assert set(seen["collections"]) == {"integer", "array"}
    walk({"partitions": {"12": {"seq": "1"}}}, "x", seen)  # keyed by partition
    assert "12" not in seen and set(seen["seq"]) == {"string"}


def test_the_guide_allows_no_name_two_types() -> None:
    """The rule has no exceptions: docs/output.md lists none (it once had a table)."""
    guide = (ROOT / "docs" / "output.md").read_text()
    section = guide.split("**One name, one type.**")[1].split("### Schema versions")[0]
    assert "| name |" not in section and "no exception" in section


def test_the_changelog_says_what_changed_in_the_json() -> None:
    log = (ROOT / "CHANGELOG.md").read_text()
    section = log.split("### JSON output")[1].split("\n## ")[0]
    for said in ("`schema`", "`buckets`", "`collection_count`", "`backup_count`",
                 "rollback-point", "`items_per_s`", "`op`", "`target_has_same_or_newer`",
                 "exits 5", "`writes`", "`with_xattrs`", "`created_at`", "`output`",
                 "`deletions`", "`paused_after`", "`link_errors`", "`partition_count`",
                 "`slot_id`", "`repo_id`", "`dropped_records`", "`dropped_collections`",
                 "`nodes_added`", "`nodes_removed`", "`backups_removed`", "`lost_version`",
                 "`lost_partitions`", "`lost_ranges`", "`must_roll_back_count`",
                 "`rollback_seqs`"):  # fmt: skip
        assert said in section, said
