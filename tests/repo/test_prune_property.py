"""Property: prune and remove, with any keep rules, leave every kept backup's restore
identical (values, cas, rev, flags, expiry, xattrs, deletions, collections), and the
lost writes `salvage` finds the same while the newest backup is kept.

Chains are generated (tests/repo/chain_gen.py) with updates, deletes, rollbacks,
cut-backs, full backups in the middle and a collection dropped between backups; each
kept backup is restored into a SQLite store with the real restore before and after.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.repo.chain_gen import PARTITIONS, USERS, Step, build, restored
from upr_cli.jobs.prune import run
from upr_cli.jobs.retention import Duration, KeepRules
from upr_cli.jobs.salvage import _repo_items
from upr_cli.repo import Repository

N = len(PARTITIONS)

steps_st = st.builds(
    Step,
    st.sampled_from(["inc", "inc", "inc", "full", "drop"]),
    st.tuples(*[st.integers(0, 5)] * N),
    st.tuples(*[st.sampled_from([0, 0, 0, 1, 3, 6])] * N),
    st.tuples(*[st.sampled_from([False, False, False, False, True])] * N),
    st.integers(0, 1 << 30),
)

rules_st = st.one_of(
    st.builds(KeepRules, last=st.integers(1, 3)),
    st.builds(KeepRules, last=st.integers(0, 2), hourly=st.integers(1, 3)),
    st.builds(KeepRules, within=st.sampled_from(["2h", "4h"]).map(Duration.parse)),
    st.builds(KeepRules, daily=st.just(1), hourly=st.integers(0, 2)),
)


def _lost(repo_dir: Path) -> set[Any]:
    """Each key salvage finds lost, with the seq of its newest lost version (two branches
    can each have lost a version at that seq: salvage shows one of them). Keys of the
    collection the chain dropped are left out: salvage never writes them back, and a
    prune drops them from merged ranges (formats/repository.md §8.10)."""
    items, _held = _repo_items(repo_dir, None, None, {})
    return {
        (it.partition, it.collection, it.key, it.lost.seq) for it in items if it.collection != USERS
    }


def _check(
    chain_steps: list[Step], rules: KeepRules | None, names: list[int], drop_lost: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        repo = Repository(root / "repo")
        ms = build(repo, chain_steps)
        before = {
            m.backup_id: restored(root / "repo", m.backup_id, root / f"b{i}.db")
            for i, m in enumerate(ms)
        }
        lost_before = _lost(root / "repo")
        ids = [str(ms[i].backup_id) for i in sorted(set(names)) if i < len(ms)]
        if rules is None and not ids:
            return
        res = run(
            root / "repo", bucket=None, rules=rules, names=ids, apply_=True, drop_lost=drop_lost
        )
        kept = [m.backup_id for m in res.buckets[0].kept]
        assert [m.backup_id for m in Repository(root / "repo").manifests("default")] == kept
        for i, b in enumerate(kept):
            after = restored(root / "repo", b, root / f"a{i}.db")
            assert after == before[b], f"state at kept backup {b} changed"
        if ms[-1].backup_id in kept and not drop_lost:
            assert _lost(root / "repo") == lost_before


# no shrinking: a failing chain is printed as drawn (shrinking one takes minutes)
FAST = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow],
    "phases": [Phase.explicit, Phase.reuse, Phase.generate],
}


CHAINS = st.lists(steps_st, min_size=2, max_size=8)
NAMES = st.lists(st.integers(0, 7), max_size=6)


def _prune(chain_steps: list[Step], rules: KeepRules) -> None:
    """Prune by generated keep rules."""
    _check(chain_steps, rules, [], False)


def _remove(chain_steps: list[Step], names: list[int], drop_lost: bool) -> None:
    """Remove generated names, dropping lost writes or not."""
    _check(chain_steps, None, names, drop_lost)


# the same properties, few chains in `make test`, many in `make test-slow`
test_prune_keeps_every_kept_state = settings(max_examples=15, **FAST)(
    given(CHAINS, rules_st)(_prune)
)
test_remove_keeps_every_kept_state = settings(max_examples=12, **FAST)(
    given(CHAINS, NAMES, st.booleans())(_remove)
)
test_prune_keeps_every_kept_state_slow = pytest.mark.slow(
    settings(max_examples=150, **FAST)(given(CHAINS, rules_st)(_prune))
)
test_remove_keeps_every_kept_state_slow = pytest.mark.slow(
    settings(max_examples=150, **FAST)(given(CHAINS, NAMES, st.booleans())(_remove))
)
