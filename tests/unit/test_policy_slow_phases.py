"""The hang clock at real sizes, at its edges: slow steps, saves and restores that take
what this run measured, and a phase's end that restarts the clock.

Each case finds the smallest idle time judged a hang (to 0.1 s) and checks it against
the rule's number: just under is no fault, just over is.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.domain import AttemptObs, Policy, RecordFault, RunState
from supervisor.policy import decide, hang_limit
from tests.unit.policy_world import NOW, attempt, obs, of, rank, run, view

GB = 1_000_000_000
LIVE = attempt(started_at=NOW - 300_000, first_step_at=NOW - 290_000)


def observed(phase: str = "train", *, phase_bytes: int = 0, p99: float | None = 0.44, samples: int = 50,
             **io: float | None) -> AttemptObs:
    """Every rank in ``phase`` since NOW - 100_000, stuck at step 50, heard this tick."""
    ranks = tuple(rank(i, phase=phase, phase_at=NOW - 100_000, phase_bytes=phase_bytes, progress_at=NOW - 100_000,
                       last_seen_at=NOW) for i in range(4))
    return obs(*ranks, step_time_p99_s=p99, step_time_samples=samples if p99 is not None else 0,
               telemetry_up_since=NOW - 300_000, **io)


def hang_after(o: AttemptObs, policy: Policy | None = None, *, first_step_seen: bool = True,
               total_steps: int = 100) -> float:
    """The smallest idle time (since the newest step or phase change) judged a hang, by
    bisection to 0.1 s; the live attempt has seen its first step unless told otherwise."""
    r = run(RunState.RUNNING, policy=policy or Policy(), total_steps=total_steps)
    live = LIVE if first_step_seen else replace(LIVE, first_step_at=None)

    def hung(idle: float) -> bool:
        since = NOW - idle
        ranks = tuple(replace(x, progress_at=since, phase_at=since) for x in o.ranks)
        return bool(of(decide(view(r, (live,)), replace(o, ranks=ranks), NOW), RecordFault))

    low, high = 0.0, 200_000.0
    assert not hung(low) and hung(high)
    while high - low > 0.1:
        mid = (low + high) / 2
        low, high = (low, mid) if hung(mid) else (mid, high)
    return high


def near(x: float, want: float) -> bool:
    return abs(x - want) <= 0.2


# --- steps ---------------------------------------------------------------------------


def test_a_635_s_trainium_step_sets_a_limit_of_three_steps_not_hang_timeout_s() -> None:
    """The HyperPod tutorial's job: 635 s a step. 300 s (hang_timeout_s) would call every
    step a hang; the limit follows the measured step time instead."""
    assert near(hang_after(observed(p99=635.19)), 3 * 635.19)
    assert near(hang_after(observed(p99=635.19, samples=1)), 3 * 635.19), "from its first timed step"


def test_before_steps_are_timed_the_limit_is_hang_timeout_s() -> None:
    assert near(hang_after(observed(p99=None)), Policy().hang_timeout_s)
    assert near(hang_after(observed(p99=0.44, samples=3)), Policy().hang_timeout_s), "fast steps: the static limit"
    assert near(hang_after(observed(p99=0.44)), Policy().hang_floor_s), "enough steps: max(floor, 3 x p99)"


# --- checkpoint saves --------------------------------------------------------------------


def test_a_save_before_any_was_timed_gets_checkpoint_timeout_s_or_its_bytes_at_the_slowest_pace() -> None:
    p = Policy()
    assert near(hang_after(observed("checkpoint")), p.checkpoint_timeout_s)
    assert near(hang_after(observed("checkpoint", phase_bytes=18 * GB)), p.checkpoint_timeout_s), "180 s < 600 s"
    assert near(hang_after(observed("checkpoint", phase_bytes=100 * GB)), 100 / p.checkpoint_min_gb_s)


def test_a_save_gets_three_times_its_bytes_at_the_measured_pace() -> None:
    """18 GB at the 0.5 GB/s the run measured: 36 s expected, 108 s allowed."""
    o = observed("checkpoint", phase_bytes=18 * GB, save_gb_s=0.5, save_s=34.2)
    assert near(hang_after(o), 3 * 36.0)
    limit, why = hang_limit(Policy(), o, first_step_seen=True)
    assert near(limit, 108.0) and why == "checkpoint allowance: max(8 s, 3 x 18 GB at 0.5 GB/s)"


def test_a_save_of_unsaid_bytes_gets_three_times_the_slowest_save() -> None:
    """A trainer that says no bytes (a node-aggregated rank, a [command] trainer's client)."""
    assert near(hang_after(observed("checkpoint", save_s=30.3)), 3 * 30.3)
    assert near(hang_after(observed("checkpoint", save_s=0.1)), Policy().hang_floor_s), "at least the floor"
    # Bytes said but fewer than the whole save's (a part of it): the slowest save still holds.
    o = observed("checkpoint", phase_bytes=GB, save_gb_s=1.0, save_s=30.0)
    assert near(hang_after(o), 90.0)


def test_the_end_of_a_long_save_restarts_the_clock() -> None:
    """The first GPU run's false hang: a 30 s save, then training again with 0.44 s steps
    under an 8 s limit. The step before the save was 31 s ago; the save ended 1 s ago."""
    r = run(RunState.RUNNING, policy=Policy())
    o = observed(save_s=30.3, save_gb_s=0.5)

    def with_times(step_ago: float, phase_ago: float) -> AttemptObs:
        return replace(o, ranks=tuple(replace(x, progress_at=NOW - step_ago, phase_at=NOW - phase_ago)
                                      for x in o.ranks))

    assert not of(decide(view(r, (LIVE,)), with_times(31.0, 1.0), NOW), RecordFault)
    assert not of(decide(view(r, (LIVE,)), with_times(38.9, 7.9), NOW), RecordFault)
    [fault] = of(decide(view(r, (LIVE,)), with_times(39.1, 8.1), NOW), RecordFault)
    assert "no step progress for 8 s" in fault.summary


def test_one_rank_in_the_checkpoint_phase_gives_the_attempt_its_allowance() -> None:
    """Rank 0 waits for its previous save while the others wait for rank 0 in a collective."""
    o = observed(save_s=30.0)
    ranks = tuple(replace(x, phase="checkpoint") if x.rank == 0 else x for x in o.ranks)
    assert near(hang_after(replace(o, ranks=ranks)), 90.0)


# --- restores ------------------------------------------------------------------------


def test_a_restore_gets_the_startup_allowance_or_longer_at_the_measured_pace() -> None:
    p = Policy()
    assert near(hang_after(observed("restore", phase_bytes=18 * GB), first_step_seen=False), p.startup_timeout_s)
    fast = observed("restore", phase_bytes=18 * GB, restore_gb_s=7.0)
    assert near(hang_after(fast, first_step_seen=False), p.startup_timeout_s), "a fast restore never shortens it"
    slow = observed("restore", phase_bytes=900 * GB, restore_gb_s=0.65)
    assert near(hang_after(slow, first_step_seen=False), 3 * 900 / 0.65)
    by_save = observed("restore", phase_bytes=900 * GB, save_gb_s=0.5)
    assert near(hang_after(by_save, first_step_seen=False), 3 * 900 / 0.5), "the save pace until a restore is timed"


def test_a_trainer_past_its_last_step_winds_down_as_slowly_as_it_starts() -> None:
    """A foreign trainer on a busy host took over 8 s to exit after its last step and was
    called hung there (a fresh clone's suite). Past the run's last step the trainer winds
    down (a final save, its process group, its results): at least startup_timeout_s."""
    o = observed()  # every rank at step 50, p99 0.44 s: the floor while it trains
    assert near(hang_after(o), Policy().hang_floor_s)
    assert near(hang_after(o, total_steps=50), Policy().startup_timeout_s)
    limit, why = hang_limit(Policy(), o, first_step_seen=True, past_last_step=True)
    assert limit == Policy().startup_timeout_s and why == "finishing allowance (past the last step)"
    slow_save = observed("checkpoint", phase_bytes=1000 * GB, save_gb_s=0.5, save_s=2000.0)
    assert near(hang_after(slow_save, total_steps=50), 3 * 2000.0), "a longer allowance stands"
