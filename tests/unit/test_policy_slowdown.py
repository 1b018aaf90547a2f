"""A run that slowed as a whole (supervisor/policy/slowdown.py)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from supervisor.domain import (
    AttemptOutcome,
    DrainNode,
    Emit,
    FaultKind,
    RecordFault,
    RunState,
    StopAttempt,
)
from supervisor.policy import decide
from supervisor.policy.slowdown import WARMUP_STEPS, slowed
from tests.unit.policy_world import NOW, attempt, obs, of, rank, run, view


def times(seconds: list[float], first_step: int = 1) -> tuple[tuple[int, float], ...]:
    return tuple((first_step + i, s) for i, s in enumerate(seconds))


# Rank 0 at 0.1 s a step (its first three steps slow: compiling), then at 1.2 s from step 41 on.
FIRST = times([3.0, 1.0, 0.5] + [0.1] * 61)
SLOW = times([0.1] * 20 + [1.2] * 10, first_step=21)


def slowed_view(diagnose: bool = True, checkpoint: int | None = 45) -> tuple[object, object]:
    v = replace(view(run(), (attempt(),)), diagnose=diagnose)
    o = obs(*(rank(i, last_step=50) for i in range(4)), first_step_times=FIRST, newest_step_times=SLOW,
            committed_step=checkpoint)
    return v, o


def test_the_newest_steps_against_the_first_ones_after_the_warmup() -> None:
    found = slowed(FIRST, SLOW, factor=2.0, window=10)
    assert found is not None and (found.baseline_s, found.recent_s, found.since_step) == (0.1, 1.2, 41)
    assert "1.2 s over its last 10 steps, 12 x its first steps' 0.1 s (since step 41)" in found.summary(10)
    assert slowed(FIRST, SLOW, factor=15.0, window=10) is None, "under the factor"
    assert slowed(FIRST, times([0.1] * 26 + [1.2] * 4, first_step=21), factor=2.0, window=10) is None, \
        "a median of ten steps: four slow ones are not yet sustained"
    most = slowed(FIRST, times([0.1] * 24 + [1.2] * 6, first_step=21), factor=2.0, window=10)
    assert most is not None and most.since_step == 45, "since its first slow step"
    assert slowed(FIRST[:WARMUP_STEPS + 9], SLOW, factor=2.0, window=10) is None, "no baseline yet"
    assert slowed(FIRST, FIRST[-5:], factor=2.0, window=10) is None, "too few newest steps"


def test_the_slow_first_steps_of_an_attempt_are_no_baseline() -> None:
    warmup_only_slow = times([30.0, 20.0, 10.0] + [0.1] * 30)
    assert slowed(warmup_only_slow, warmup_only_slow[-10:], factor=2.0, window=10) is None


def test_windows_that_overlap_say_nothing() -> None:
    early = times([3.0, 1.0, 0.5] + [0.1] * 10)
    assert slowed(early, early, factor=2.0, window=10) is None


@given(st.lists(st.floats(min_value=0.05, max_value=0.2), min_size=30, max_size=64))
def test_a_run_at_its_own_pace_never_slowed(steady: list[float]) -> None:
    pace = times([3.0, 1.0, 0.5, *steady])
    assert slowed(pace, pace[-10:], factor=5.0, window=10) is None


def test_with_diagnose_a_slowed_run_is_stopped_after_a_checkpoint_since_it_slowed() -> None:
    v, o = slowed_view()
    effects = decide(v, o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.SLOWDOWN and fault.nodes == () and fault.step == 45
    assert "the whole run slowed" in fault.summary and "stopped after the checkpoint of step 45" in fault.summary
    [stop] = of(effects, StopAttempt)
    assert stop.outcome is AttemptOutcome.FAILED and not of(effects, DrainNode), "the probe names the node"
    assert any(e.kind == "fault.detected" for e in of(effects, Emit))


def test_before_a_checkpoint_since_it_slowed_the_run_goes_on() -> None:
    v, o = slowed_view(checkpoint=40)  # the slowdown began at step 41
    assert not of(decide(v, o, NOW), StopAttempt)
    v, o = slowed_view(checkpoint=None)
    assert not of(decide(v, o, NOW), StopAttempt)


def test_without_diagnose_nothing_is_done() -> None:
    v, o = slowed_view(diagnose=False)
    effects = decide(v, o, NOW)
    assert not of(effects, StopAttempt) and not of(effects, RecordFault)
    assert run().state is RunState.RUNNING
