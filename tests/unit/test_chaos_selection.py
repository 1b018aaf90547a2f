"""Which chaos scenarios `make test` runs (tests/conftest.py): a subset that rotates with
the commit, always with the daemon SIGKILL and exactly one scenario on the Slurm box."""

from __future__ import annotations

from tests.conftest import CHAOS_ALWAYS, CHAOS_SUBSET, choose_chaos, missing_always

LOCAL = [f"tests/chaos/test_local.py::test_local_{k}" for k in range(16)]
SLURM = ([f"tests/chaos/test_slurm.py::test_slurm_{k}" for k in range(6)]
         + [f"tests/chaos/test_slurm_nxdt.py::test_nxdt_{k}" for k in range(2)])
ALWAYS = [f"tests/chaos/test_local.py::{name}" for name in CHAOS_ALWAYS]
ALL = sorted(LOCAL + SLURM + ALWAYS)


def test_every_subset_has_the_daemon_sigkill_and_a_slurm_scenario() -> None:
    for seed in range(200):
        chosen = choose_chaos(ALL, seed)
        assert len(chosen) == len(set(chosen)) == CHAOS_SUBSET
        assert set(ALWAYS) <= set(chosen)
        assert sum(c in SLURM for c in chosen) == 1, "one box a run: each takes minutes"


def test_the_subset_rotates_with_the_seed_and_repeats_with_it() -> None:
    subsets = {frozenset(choose_chaos(ALL, seed)) for seed in range(50)}
    assert len(subsets) > 40, "nearly every commit runs another subset"
    assert choose_chaos(ALL, 1234) == choose_chaos(ALL, 1234)
    seen = set().union(*subsets)
    assert seen == set(ALL), "over a few commits every scenario runs"


def test_an_always_run_scenario_that_is_not_collected_is_named() -> None:
    assert missing_always(ALL) == []
    assert missing_always([c + "[seed-3]" for c in ALL]) == [], "a parametrized one counts"
    assert missing_always(LOCAL + SLURM) == list(CHAOS_ALWAYS)  # renamed or removed


def test_the_always_run_scenarios_exist_in_the_chaos_suite() -> None:
    from pathlib import Path

    sources = "".join(p.read_text() for p in (Path(__file__).parents[1] / "chaos").glob("test_*.py"))
    for name in CHAOS_ALWAYS:
        assert f"def {name}(" in sources, name



def test_a_parametrized_always_run_scenario_is_drawn_in_each_of_its_forms() -> None:
    forms = [c + f"[{k}]" for c in ALL if c.endswith(CHAOS_ALWAYS) for k in ("a", "b")]
    rest = [c for c in ALL if not c.endswith(CHAOS_ALWAYS)]
    for seed in range(20):
        chosen = choose_chaos(sorted(rest + forms), seed)
        assert set(forms) <= set(chosen), (seed, chosen)
