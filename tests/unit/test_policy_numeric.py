"""NaN losses and loss or grad-norm spikes: roll back, skip the data window (supervisor/policy/detection.py, recovery.py)."""

from __future__ import annotations

from dataclasses import replace

from supervisor.domain import (
    AttemptOutcome,
    DrainNode,
    Emit,
    EventKind,
    FaultKind,
    RecordFault,
    SkipData,
    StopAttempt,
)
from supervisor.policy import decide
from tests.unit.policy_world import NOW, attempt, ended, fault_of, obs, of, rank, run, samples, spiky, view


def test_a_nan_loss_stops_the_attempt_and_drains_nothing() -> None:
    o = obs(*(rank(i, nonfinite_step=60 if i < 2 else 61) for i in range(4)))
    effects = decide(view(run(), (attempt(),)), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NONFINITE and fault.step == 60 and fault.nodes == ()
    assert of(effects, StopAttempt) and not of(effects, DrainNode)


def test_after_a_nan_the_next_attempt_resumes_from_before_it_and_later_ones_from_the_newest() -> None:
    from supervisor.policy import resume_before

    nan = replace(fault_of(1, FaultKind.NONFINITE, step=60))
    a1 = ended(1, 0)
    assert resume_before((a1,), (nan,)) == 60
    assert resume_before((a1,), (fault_of(1, step=60),)) is None  # a crash poisons nothing
    a2 = replace(ended(2, 40), outcome=AttemptOutcome.FAILED)
    assert resume_before((a1, a2), (nan, fault_of(2, step=90))) is None
    assert resume_before((a1, attempt(2)), (nan,)) == 60  # the live one has not ended yet


def test_a_spike_that_persists_rolls_back_and_skips_its_data_window() -> None:
    live = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    o = replace(obs(), recent=samples(spiky(40, 5, 44)))
    effects = decide(view(run(), (live,)), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.SPIKE and fault.step == 40 and "for 5 steps" in fault.summary
    [skip] = of(effects, SkipData)
    assert (skip.start, skip.end) == (39 * 16, 39 * 16 + 50 * 16)
    assert of(effects, StopAttempt) and not of(effects, DrainNode)


def test_a_spike_shorter_than_the_limit_is_reported_not_acted_on() -> None:
    from supervisor.policy import transient_spikes

    live = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    recent = samples(spiky(40, 1, 50))
    assert not of(decide(view(run(), (live,)), replace(obs(), recent=recent), NOW), RecordFault)
    [spike] = transient_spikes(recent, run().policy)
    assert (spike.step, spike.steps) == (40, 1)
    ongoing = samples(spiky(48, 3, 50))  # still going: not yet known to be short
    assert not transient_spikes(ongoing, run().policy)


def test_a_grad_norm_spike_counts_and_a_falling_loss_never_does() -> None:
    live = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    grads = [1.0] * 30 + [9.0] * 6
    o = replace(obs(), recent=samples([2.0] * 36, grads))
    [fault] = of(decide(view(run(), (live,)), o, NOW), RecordFault)
    assert fault.kind is FaultKind.SPIKE and fault.step == 31
    falling = samples([10.0 / (i + 1) for i in range(60)])
    assert not of(decide(view(run(), (live,)), replace(obs(), recent=falling), NOW), RecordFault)


def test_a_nan_again_at_the_same_step_skips_that_steps_data() -> None:
    live = attempt(2, started_at=NOW - 100, first_step_at=NOW - 90)
    recent = samples([2.0] * 60)
    o = replace(obs(*(rank(i, nonfinite_step=60) for i in range(4))), recent=recent)
    first = decide(view(run(), (live,)), o, NOW)
    assert not of(first, SkipData)
    again = replace(view(run(), (ended(1, 0), live)), faults=(fault_of(1, FaultKind.NONFINITE, step=60),))
    [skip] = of(decide(again, o, NOW), SkipData)
    assert (skip.start, skip.end) == (59 * 16, 60 * 16)


def test_a_command_told_skip_to_step_skips_the_spikes_steps() -> None:
    """A [command] trainer's lines carry no sample position: the window is its own steps,
    turned into data steps when recorded (supervisor/effects/runs.py)."""
    live = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    o = replace(obs(), recent=tuple(replace(x, first_sample=-1) for x in samples(spiky(40, 5, 44))))
    effects = decide(replace(view(run(), (live,)), data_skip_unit="steps"), o, NOW)
    [skip] = of(effects, SkipData)
    assert (skip.start, skip.end, skip.unit) == (40, 90, "steps")


def test_a_spike_a_trainer_cannot_skip_is_rolled_back_once_then_trained_through() -> None:
    """Without {skip_to_step}, the rollback replays the same batches into the same spike:
    the second time it is reported, once, and the attempt trains on (no crash loop)."""
    recent = samples(spiky(40, 5, 44))
    first = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    cannot = replace(view(run(), (first,)), data_skip_unit=None)
    effects = decide(cannot, replace(obs(), recent=recent), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.SPIKE and "the trainer cannot skip data" in fault.summary
    assert not of(effects, SkipData)
    replay = attempt(2, resume_step=30, started_at=NOW - 100, first_step_at=NOW - 90)
    again = replace(view(run(), (ended(1, 0), replay)), data_skip_unit=None,
                    faults=(fault_of(1, FaultKind.SPIKE, step=40),))
    effects = decide(again, replace(obs(), recent=recent), NOW)
    assert not of(effects, RecordFault) and not of(effects, StopAttempt)
    [said] = [e for e in of(effects, Emit) if e.kind is EventKind.SPIKE_PERSISTS]
    assert said.data["step"] == 40 and "not rolling back again" in said.message
    assert not [e for e in of(decide(replace(again, spikes_said=frozenset({40})), replace(obs(), recent=recent),
                                     NOW), Emit) if e.kind is EventKind.SPIKE_PERSISTS], "said once"
    # A spike after the checkpoint this attempt resumed from, not before it: a new one.
    later = replace(again, attempts=(ended(1, 0), replace(replay, resume_step=45)))
    assert of(decide(later, replace(obs(), recent=recent), NOW), RecordFault)


def test_data_steps_leave_out_the_skip_windows_and_a_window_ahead_is_jumped_to() -> None:
    from supervisor.policy import data_step, skip_to

    assert [data_step(t, []) for t in (1, 21, 100)] == [1, 21, 100]
    assert [data_step(t, [(30, 80)]) for t in (29, 30, 31)] == [29, 80, 81]
    assert [data_step(t, [(30, 80), (60, 90), (95, 100)]) for t in (30, 35)] == [90, 100], "windows merge"
    # The spike's window lies ahead of the checkpoint at step 20: read from its end at once,
    # the window widened back to step 21, so that every later resume agrees.
    assert skip_to(20, [(30, 80)]) == (80, (30, 21))
    assert [data_step(t, [(21, 80)]) for t in (20, 21, 40)] == [20, 80, 99]
    assert skip_to(40, [(21, 80)]) == (100, None), "a checkpoint after the jump: 41 + 59"
    assert skip_to(10, [(21, 80)]) == (80, (21, 11)), "a rollback before an old jump jumps there"
    assert skip_to(0, []) == (1, None)
