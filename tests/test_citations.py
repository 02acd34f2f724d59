"""Every citation resolves for someone who has only the repository.

A comment or document may cite the project's own documents (`docs/protocol.md §4.2`,
`formats/repository.md §8.8`, `docs/design.md "Rollback"`) or a public source by name
(the UPR design specification's section titles, kv_engine's `docs/dcp/…`, an RFC). It
may not cite a file the repository does not have: the team's private notes, a fact
sheet outside the tree, or a section number that is not a heading of the document
named. The checker is a plain function over (path, text), tested on small examples
below, and then run over every tracked text file.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".1", ".toml", ".sh", ".txt", ".json"}
NAMES = {"Makefile"}

# Documents that are not part of the project, whatever the wording around them.
FORBIDDEN = [
    (re.compile(r"dcp-wire", re.I), "the dcp-wire fact sheet is not in the repository"),
    (re.compile(r"\bseeds?\s+0\d\d\b|\bseeds/", re.I), "a seed document is not in the repository"),
    (re.compile(r"\bDESIGN(?:\.md)?\b"), "DESIGN is not in the repository: docs/design.md"),
    (re.compile(r"\bSTYLE(?:\.md)?\b"), "STYLE is not in the repository"),
    (re.compile(r"(?<![\w/])reference/"), "reference/… is not in the repository"),
    (re.compile(r"\.\./shared|\bshared/(?:reference|seeds|DESIGN|STYLE)"),
     "../shared is not in the repository"),
    (re.compile(r"user-expectations"), "user-expectations is not in the repository"),
    (re.compile(r"reliability-scenarios|\breliability §"),
     "reliability-scenarios is not in the repository"),
    (re.compile(r"spark-datasource\.md"), "spark-datasource.md is not in the repository"),
]  # fmt: skip

# Public documents of other projects, cited by name (kv_engine's docs, the UPR protocol
# draft's spec.md, Wireshark's dissector). A reference to one of these is not a file of
# ours even when its path looks like one.
EXTERNAL_DOCS = {
    "BinaryProtocol.md", "ErrorMap.md", "sasl.md", "Document.md", "Collections.md",
    "SubDocument.md", "rollback.md", "flow-control.md", "dead-connections.md",
    "building-a-simple-client.md", "open-connection.md", "stream-request.md",
    "stream-request-value.md", "control.md", "snapshot-marker.md", "mutation.md",
    "deletion.md", "expiration.md", "system_event.md", "buffer-ack.md",
    "failure-scenarios.md", "set_with_meta.md", "del_with_meta.md", "mutate-with-meta.md",
    "collections.md", "spec.md", "*.md",
}  # fmt: skip
# A line naming one of these cites another project; its paths are that project's.
EXTERNAL_MARKERS = re.compile(
    r"kv_engine|couchbaselabs|couchbase-cxx|wireshark|github\.com|https?://", re.I
)
EXTERNAL_PREFIXES = ("docs/dcp/", "engines/", "include/", "daemon/", "epan/", "programs/")

SECTION = r"§\s?\d+(?:\.\d+)*"
# A document, then the sections that follow it directly: "formats/x.md §5.5, §5.6",
# "`docs/protocol.md` §4.1 step 5, §4.4", "§1.1/§1.3".
SEP = r"(?:\s*(?:,|/|\+|-|\u2013|and)\s*|\s+step\s+\d+\s*,\s*)"
MD_REF = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.md)\b")
DOC_CHAIN = re.compile(
    rf"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.md)`?\s*,?\s*\(?((?:{SECTION})(?:{SEP}§?\s?\d+(?:\.\d+)*)*)"
)
ANY_SECTION = re.compile(SECTION)
OTHER_NAMED = re.compile(r"\b(?:RFC|PEP)\s?\d+", re.I)
PATH_REF = re.compile(
    r"(?<![\w./:~$-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|json|sh|toml|txt|1|seg|properties))\b"
)
# A line that names these documents without citing them (a test listing names that must
# not appear in help text) says so with this marker, as `noqa` does for ruff.
IGNORE = "citations: ignore"
# Lines without any of these cite nothing (most lines: keeps the whole run well under 2 s).
HINT = re.compile(
    r"§|/|\.md|DESIGN|STYLE|seed|dcp-wire|reliability|user-exp|spark-datasource", re.I
)
HEADING = re.compile(r"^#+\s+(\d+(?:\.\d+)*)\.?\s", re.M)


@dataclass(frozen=True)
class Problem:
    """One citation that does not resolve."""

    path: str
    line: int
    why: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}: {self.text.strip()[:100]}"


@dataclass
class Repo:
    """The files of the repository and, lazily, the section numbers of its documents."""

    files: set[str]
    read: Mapping[str, str] | None = None
    _sections: dict[str, set[str]] = field(default_factory=dict)
    roots: set[str] = field(init=False)
    _by_name: dict[str, list[str]] = field(init=False)

    def __post_init__(self) -> None:
        # first path components that mean "a file of ours": top-level and package dirs
        self.roots = {f.split("/")[0] for f in self.files if "/" in f}
        self._by_name = {}
        for f in self.files:
            parts = f.split("/")
            if len(parts) > 2 and parts[0] in ("upr_cli", "tests"):
                self.roots.add(parts[1])
            self._by_name.setdefault(parts[-1], []).append(f)

    def sections(self, doc: str) -> set[str]:
        """The section numbers that head the document's sections ("4", "4.2")."""
        if doc not in self._sections:
            text = self.read[doc] if self.read is not None else (ROOT / doc).read_text()
            self._sections[doc] = set(HEADING.findall(text))
        return self._sections[doc]

    def resolve(self, ref: str, citing: str) -> str | None:
        """The repository file a reference names, trying the places code cites from."""
        here = PurePosixPath(citing).parent
        candidates = [ref, str(here / ref), f"upr_cli/{ref}", f"tests/{ref}"]
        for c in candidates:
            norm = _normalise(c)
            if norm in self.files:
                return norm
        same = self._by_name.get(ref, []) if "/" not in ref else []
        return same[0] if len(same) == 1 else None


def _normalise(path: str) -> str:
    parts: list[str] = []
    for p in path.split("/"):
        if p == "..":
            if parts:
                parts.pop()
        elif p not in ("", "."):
            parts.append(p)
    return "/".join(parts)


def _external(ref: str, line: str) -> bool:
    name = ref.rsplit("/", 1)[-1]
    return (
        name in EXTERNAL_DOCS
        or ref.startswith(EXTERNAL_PREFIXES)
        or bool(EXTERNAL_MARKERS.search(line))
    )


def check_text(path: str, text: str, repo: Repo) -> list[Problem]:
    """Every citation in `text` (the file at `path`) that does not resolve."""
    problems: list[Problem] = []
    is_doc = path.endswith(".md")
    for n, line in enumerate(text.splitlines(), 1):
        if not HINT.search(line) or IGNORE in line:
            continue
        forbidden = [Problem(path, n, why, line) for rx, why in FORBIDDEN if rx.search(line)]
        problems += forbidden
        if not forbidden:
            problems += _check_paths(path, n, line, repo)
        # "dcp-wire §4.2" is one problem, not two
        problems += [p for p in _check_sections(path, n, line, repo, is_doc)
                     if not (forbidden and p.why.startswith("bare"))]  # fmt: skip
    return problems


def _check_paths(path: str, n: int, line: str, repo: Repo) -> Iterable[Problem]:
    seen = set()
    for m in PATH_REF.finditer(line):
        ref = m.group(1)
        seen.add(m.start(1))
        if any(ch in ref for ch in "*…<>{}") or ref.split("/")[0] not in repo.roots:
            continue
        if repo.resolve(ref, path) is None and not _external(ref, line):
            yield Problem(path, n, f"{ref} is not in the repository", line)
    for m in MD_REF.finditer(line):
        ref = m.group(1)
        if m.start(1) in seen or "/" in ref:
            continue  # paths were checked above
        if repo.resolve(ref, path) is None and not _external(ref, line):
            yield Problem(path, n, f"{ref} is not in the repository", line)


def _check_sections(path: str, n: int, line: str, repo: Repo, is_doc: bool) -> Iterable[Problem]:
    attached: set[int] = set()
    for m in DOC_CHAIN.finditer(line):
        ref, chain = m.group(1), m.group(2)
        for s in ANY_SECTION.finditer(line, m.start(2), m.end(2)):
            attached.add(s.start())
        doc = repo.resolve(ref, path)
        if doc is None:
            continue  # an external document (or a missing one, reported above)
        have = repo.sections(doc)
        for num in _numbers(chain):
            if num not in have:
                yield Problem(path, n, f"{doc} has no section {num}", line)
    for s in ANY_SECTION.finditer(line):
        if s.start() in attached:
            continue
        before = line[: s.start()]
        num = s.group(0).lstrip("§").strip()
        if OTHER_NAMED.search(before):
            continue  # RFC 5802 §7 and the like
        named = [r for r in MD_REF.findall(before)]
        if named:
            doc = repo.resolve(named[-1], path)
            if doc is not None and num not in repo.sections(doc):
                yield Problem(path, n, f"{doc} has no section {num}", line)
            continue
        if is_doc and path in repo.files:
            if num not in repo.sections(path):
                yield Problem(path, n, f"{path} has no section {num} (bare §)", line)
            continue
        yield Problem(path, n, f"bare §{num}: name the document it is in", line)


def _numbers(chain: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)*", re.sub(r"step\s+\d+", "", chain))


@cache
def tracked() -> tuple[str, ...]:
    """Files under version control, and new ones not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    return tuple(sorted(f for f in set(out) if (ROOT / f).is_file()))


def is_text(path: str) -> bool:
    """The files whose citations are checked."""
    return Path(path).suffix in SUFFIXES or Path(path).name in NAMES


# --------------------------------------------------------------- the checker, on examples

FAKE = Repo(
    files={
        "formats/repository.md", "docs/protocol.md", "docs/design.md", "README.md",
        "upr_cli/dcp/consumer.py", "upr_cli/repo/chain.py", "tests/e2e/test_x.py",
    },
    read={
        "formats/repository.md": "## 4. Backups\n### 4.5 Resuming\n## 8. Chains\n### 8.8 Checks\n",
        "docs/protocol.md": "## 4. Stream requests\n### 4.1 Checks\n### 4.2 Rule\n### 4.4 Resume\n",
        "docs/design.md": "# D\n## Rollback\n",
        "README.md": "# upr\n## Commands\n",
    },
)  # fmt: skip

BAD = [
    ("upr_cli/a.py", "# the producer rule (dcp-wire §4.2)", "dcp-wire"),
    ("upr_cli/a.py", '# seed 000 "Snapshot Markers"', "seed"),
    ("upr_cli/a.py", "# see ../shared/seeds/000_x.txt", "shared"),
    ("upr_cli/a.py", '"""Backups (DESIGN data flow 3)."""', "DESIGN"),
    ("upr_cli/a.py", "# Design: DESIGN.md", "DESIGN"),
    ("upr_cli/a.py", "# STYLE 9: format/parse pairs", "STYLE"),
    ("upr_cli/a.py", "# STYLE.md practice 7", "STYLE"),
    ("README.md", "kv_engine's rule, `reference/dcp-wire.md` §4.2", "reference/"),
    ("upr_cli/a.py", "# raised after SASL (reliability §4.1)", "reliability"),
    ("upr_cli/a.py", "# reliability-scenarios.md", "reliability"),
    ("upr_cli/a.py", "# as user-expectations says", "user-expectations"),
    ("upr_cli/a.py", "# spark-datasource.md", "spark-datasource"),
    ("upr_cli/a.py", "# formats/missing.md says so", "not in the repository"),
    ("upr_cli/a.py", "# see dcp/nothing.py", "not in the repository"),
    ("upr_cli/a.py", "# see upr_cli/dcp/gone.py", "not in the repository"),
    ("upr_cli/a.py", "# (formats/repository.md §8.6)", "no section 8.6"),
    ("upr_cli/a.py", "# (docs/protocol.md §4.1 step 5, §4.3)", "no section 4.3"),
    ("upr_cli/a.py", "# `formats/repository.md` §9", "no section 9"),
    ("upr_cli/a.py", "# (repository.md §5.6)", "no section 5.6"),
    ("upr_cli/a.py", "# ack a fifth of the window (§7.1)", "bare §7.1"),
    ("man/upr-x.1", "whole (§8.8) before", "bare §8.8"),
    ("formats/repository.md", "as §9.9 says", "no section 9.9 (bare"),
    ("README.md", "the rule (§4.2)", "no section 4.2 (bare"),
]

GOOD = [
    ("upr_cli/a.py", "# the producer rule (docs/protocol.md §4.2)"),
    ("upr_cli/a.py", "# docs/protocol.md §4.1 step 5, §4.4"),
    ("upr_cli/a.py", '# (`formats/repository.md` §8.8; docs/design.md "Rollback")'),
    ("upr_cli/a.py", "# formats/repository.md §4.5 and §8"),
    ("upr_cli/a.py", '# the UPR design specification, "Snapshot Markers and Deduplication"'),
    ("upr_cli/a.py", "# RFC 5802 §5.1: the server keeps our nonce as a prefix"),
    ("upr_cli/a.py", "# kv_engine `docs/dcp/documentation/flow-control.md`"),
    ("docs/protocol.md", "(`docs/BinaryProtocol.md`, `rollback.md`)"),
    ("upr_cli/a.py", "# see dcp/consumer.py and repo/chain.py"),
    ("tests/e2e/test_y.py", "# like test_x.py does"),
    ("upr_cli/a.py", "# written to /tmp/node/x.json and DIR/cluster.json"),
    ("formats/repository.md", "as §8.8 says, and §4.5"),
    ("upr_cli/a.py", "# a seed rule, seeded with --seed 3, the design's stylesheet"),
]


@pytest.mark.parametrize(("path", "line", "expect"), BAD)
def test_checker_catches(path: str, line: str, expect: str) -> None:
    problems = check_text(path, line, FAKE)
    assert problems, f"not caught: {line!r}"
    assert any(expect in p.why or expect in p.text for p in problems), problems


@pytest.mark.parametrize(("path", "line"), GOOD)
def test_checker_accepts(path: str, line: str) -> None:
    assert check_text(path, line, FAKE) == []


def test_checker_skips_marked_lines() -> None:
    line = 'NOT_OURS = ("seed 000", "dcp-wire", "DESIGN")  # citations: ignore'
    assert check_text("tests/cli/test_x.py", line, FAKE) == []


def test_checker_reports_file_and_line() -> None:
    (p,) = check_text("upr_cli/a.py", "x = 1\n# (§2.12)\n", FAKE)
    assert str(p).startswith("upr_cli/a.py:2: bare §2.12")


# ------------------------------------------------------------------- the repository itself


def test_every_citation_resolves() -> None:
    files = tracked()
    repo = Repo(set(files))
    me = str(Path(__file__).resolve().relative_to(ROOT))
    problems = [
        p for f in files if is_text(f) and f != me
        for p in check_text(f, (ROOT / f).read_text(errors="replace"), repo)
    ]  # fmt: skip
    if problems:
        by_file: dict[str, int] = {}
        for p in problems:
            by_file[p.path] = by_file.get(p.path, 0) + 1
        summary = ", ".join(f"{f} {k}" for f, k in sorted(by_file.items(), key=lambda kv: -kv[1]))
        listing = "\n".join(str(p) for p in problems)
        pytest.fail(
            f"{len(problems)} citations do not resolve in the repository "
            f"({len(by_file)} files: {summary})\n{listing}",
            pytrace=False,
        )
