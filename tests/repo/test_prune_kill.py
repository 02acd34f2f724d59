"""SIGKILL of `upr prune`, `upr remove` and `upr merge` at seeded points: after each
kill the repository verifies (`upr verify` exits 0) and every backup still committed
restores exactly as before (the kept ones always; one the killed run was removing is
either there with its state or gone); then the same command, run again, succeeds,
every kept backup restores exactly, and nothing is left over (no revision but the
current ones, no temp entry, no absorbed or uncommitted directory).

A generated chain (tests/repo/chain_gen.py: updates, deletes, rollbacks, cut-backs,
full backups in the middle, a dropped collection; 8 backups of 3 partitions) is
written once; each seed copies it, picks a command and a kill point (a kind of file
system change, then one of its occurrences: tests/repo/kill_helpers.py), and runs the
command as a real process that is SIGKILLed right before that change. 10 seeds in
`make test`, 50 more in `make test-slow`.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.repo.chain_gen import Step, build, restored
from tests.repo.kill_helpers import KILLED, Change, pick, run_upr
from tests.repo.repo_helpers import BUCKET
from upr_cli.jobs.inspect import verify
from upr_cli.jobs.prune import run
from upr_cli.jobs.retention import KeepRules
from upr_cli.repo import BackupId, Repository

STEPS = [
    Step("full", (5, 5, 5), (0, 0, 0), (False, False, False), 1),
    Step("inc", (4, 3, 0), (0, 0, 0), (True, False, False), 2),
    Step("inc", (3, 4, 5), (0, 3, 0), (False, False, False), 3),
    Step("full", (2, 2, 2), (0, 0, 0), (False, False, False), 4),
    Step("drop", (3, 0, 4), (0, 0, 0), (False, False, False), 5),
    Step("inc", (4, 4, 4), (0, 0, 6), (False, False, False), 6),
    Step("inc", (2, 5, 1), (0, 0, 0), (False, True, False), 7),
    Step("inc", (3, 3, 3), (1, 0, 0), (False, False, False), 8),
]


def _commands(ids: list[str]) -> dict[str, tuple[list[str], list[str], str | None]]:
    """name -> (arguments, the backups kept, the backup a merge goes through)."""
    return {
        # a run of five merged forward into the oldest kept backup
        "prune": (["prune", "--keep-last", "3", "--apply"], ids[5:], None),
        # two runs merged forward into two kept backups, the newest dropped
        "remove": (
            ["remove", ids[1], ids[2][:13], ids[5], ids[7], "--apply"],
            [ids[0], ids[3], ids[4], ids[6]],
            None,
        ),
        # the newest three dropped outright, newest first: nothing kept after them
        "remove-newest": (["remove", f"{ids[5]}..", "--apply"], ids[:5], None),
        # a range from the oldest, a full backup among them
        "remove-range": (["remove", f"..{ids[3]}", "--apply"], ids[4:], None),
        # through an older backup that a later rollback cuts inside
        "merge-older": (["merge", "--through", ids[4]], ids, ids[4]),
        "merge": (["merge"], ids, ids[-1]),
    }


class Chain:
    """The generated chain, every backup's restored state, and each command's changes
    in a run that is not killed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = root / "base"
        ms = build(Repository(self.base), STEPS)
        self.ids = [str(m.backup_id) for m in ms]
        self.states = {
            b: restored(self.base, m.backup_id, root / f"s{i}.db")
            for i, (b, m) in enumerate(zip(self.ids, ms, strict=True))
        }
        self.commands = _commands(self.ids)
        self._changes: dict[str, list[Change]] = {}

    def copy(self, to: Path) -> Path:
        shutil.copytree(self.base, to)
        return to

    def changes(self, name: str) -> list[Change]:
        """The changes the command makes when it runs to its end (on a copy)."""
        if name not in self._changes:
            repo = self.copy(self.root / f"calibrate-{name}")
            ran = run_upr(repo, self.args(name, repo), self.root / f"{name}.log")
            assert ran.rc == 0, ran.err
            self._changes[name] = ran.changes
        return self._changes[name]

    def args(self, name: str, repo: Path) -> list[str]:
        return [*self.commands[name][0], "--repo", str(repo)]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    return Chain(tmp_path_factory.mktemp("chain"))


def problems(repo: Path, log: Path) -> list[tuple[str, str, str]]:
    """`upr verify --repo --json`: (kind, where, detail) of each problem it names; it
    exits 0 when there is none."""
    ran = run_upr(repo, ["verify", "--repo", str(repo), "--json"], log)
    out = json.loads(ran.out)
    found = [(p["kind"], p["where"], p["detail"]) for b in out["buckets"] for p in b["problems"]]
    assert ran.rc == (1 if found else 0), ran.err
    return found


def leftovers(repo: Path) -> list[str]:
    """What a finished run must not leave: temp entries anywhere, directories of
    backups no longer committed, revisions that are not current, uncommitted runs."""
    r = Repository(repo)
    bdir = r.bucket_dir(BUCKET)
    out = [str(p.relative_to(bdir)) for p in bdir.rglob("*") if ".tmp-" in p.name]
    current = {s.path for s in r.scan(BUCKET)}
    committed = set(r.committed(BUCKET))
    out += [s.path.name for s in r.scan_all(BUCKET)
            if s.path not in current or s.backup_id not in committed]  # fmt: skip
    return out


def kill_run(chain: Chain, seed: int, tmp: Path) -> None:
    """One seed: a command, a kill point, the checks after the kill and after a rerun."""
    rng = random.Random(seed)
    names = sorted(chain.commands)
    name = names[seed % len(names)]
    _args, kept, through = chain.commands[name]
    n, where = pick(chain.changes(name), rng)
    repo = chain.copy(tmp / "repo")
    ran = run_upr(repo, chain.args(name, repo), tmp / "killed.log", kill_at=n)
    what = f"seed {seed}: {name} killed {where}"
    assert ran.rc == KILLED and len(ran.changes) == n, f"{what}: exit {ran.rc}: {ran.err}"

    def check_states(when: str) -> list[str]:
        """Every committed backup restores as before; a merged one as its `through`."""
        now = [str(b) for b in Repository(repo).committed(BUCKET)]
        assert set(kept) <= set(now), f"{what}: {when}: a kept backup is gone"
        new = [b for b in now if b not in chain.states]
        assert len(new) <= (2 if through else 0), f"{what}: {when}: {new}"
        for i, b in enumerate(now):
            want = chain.states[through if b in new and through else b]
            got = restored(repo, BackupId.parse(b), tmp / f"{when}-{i}.db")
            assert got == want, f"{what}: {when}: backup {b} restores differently"
        return now

    # verify: nothing wrong, but for a kill between the commit point (the copy) and
    # manifest.json, which leaves the copy alone until the next run rewrites the other
    # (formats/repository.md §4.3, §6: verify names the redundancy lost)
    found = problems(repo, tmp / "verify.log")
    if ran.changes[-1].kind == "manifest":
        where = "/".join(Path(ran.changes[-1].path).parts[-3:-1])
        missing = (
            "missing (its twin manifest.json.copy is valid; `upr verify --repair` rewrites it)"
        )
        assert found == [("manifest", f"{where}/manifest.json", missing)], what
    else:
        assert found == [], what
    check_states("after the kill")
    # the same command again (a remove names the backups still there: a revision that
    # committed before the kill removed the others; none left: a prune that keeps all)
    args = chain.args(name, repo)
    if name.startswith("remove"):
        there = {str(b) for b in Repository(repo).committed(BUCKET)}
        named = [a for a in args[1:-3] if any(_names(a, b) for b in there)]
        args = ["remove", *named] if named else ["prune", "--keep-last", "99"]
        args += ["--apply", "--repo", str(repo)]
    elif name == "merge-older" and len(Repository(repo).committed(BUCKET)) > len(chain.ids):
        # the killed merge committed: the same merge again is refused (it is there)
        again = run_upr(repo, args, tmp / "refused.log")
        assert again.rc == 1 and "already is the merge through it" in again.err, what
        args = ["prune", "--keep-last", "99", "--apply", "--repo", str(repo)]
    again = run_upr(repo, args, tmp / "again.log")
    assert again.rc == 0, f"{what}; run again: exit {again.rc}: {again.err}"
    found = [(p.kind, p.detail) for r in verify(repo) for p in r.unrepaired]
    assert found == [], what
    now = check_states("run again")
    if through is None:
        assert now == kept, what
    else:  # one merge, or two when the killed one had committed
        assert set(chain.ids) < set(now) and len(now) - len(chain.ids) in (1, 2), what
    assert leftovers(repo) == [], what


def _names(spec: str, backup: str) -> bool:
    """`upr remove`'s BACKUP `spec` (an id, a prefix or a range A..B) names `backup`."""
    if ".." not in spec:
        return backup.startswith(spec)
    lo, hi = spec.split("..", 1)
    return (not lo or lo <= backup) and (not hi or backup <= hi)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(10))
def test_a_killed_prune_remove_or_merge_leaves_every_state(
    chain: Chain, seed: int, tmp_path: Path
) -> None:
    kill_run(chain, seed, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", range(10, 60))
def test_a_killed_prune_remove_or_merge_leaves_every_state_slow(
    chain: Chain, seed: int, tmp_path: Path
) -> None:
    kill_run(chain, seed, tmp_path)


def test_the_commands_make_every_kind_of_change(chain: Chain) -> None:
    """The kill points cover every step: segments written and published, links, the
    commit point, the manifest, the renames before a removal and the removals."""
    kinds = {c.kind for name in chain.commands for c in chain.changes(name)}
    assert {"mkdir", "write", "publish", "link", "commit", "manifest", "discard",
            "delete"} <= kinds  # fmt: skip


def test_a_pruned_dropped_collection_verifies(tmp_path: Path) -> None:
    """A prune whose removed backups held a collection dropped before the kept ones:
    the revision leaves that collection's documents out of its merged range, so every
    collection id its segments hold is one a kept manifest names (`verify` clean)."""
    build(Repository(tmp_path / "repo"), STEPS)
    run(tmp_path / "repo", bucket=None, rules=KeepRules(last=3), apply_=True,
        drop_lost=False)  # fmt: skip
    assert [str(p) for r in verify(tmp_path / "repo") for p in r.unrepaired] == []
