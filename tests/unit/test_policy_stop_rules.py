"""When a run stops: crash loops, failures without progress, the fault rate, the backoff (supervisor/policy/budget.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.domain import (
    Attempt,
    AttemptOutcome,
    AttemptState,
    CheckpointRef,
    Emit,
    FaultKind,
    FaultRecord,
    FinishRun,
    Policy,
    ProcState,
    RunState,
    StartAttempt,
)
from supervisor.policy import decide
from tests.unit.policy_world import NOW, attempt, ended, fault_of, obs, of, rank, run, view


def test_the_same_fault_at_the_same_step_three_times_is_a_crash_loop() -> None:
    attempts = (ended(1, 0), ended(2, nodes=("n2", "n3")), ended(3, nodes=("n1", "n3")))
    v = replace(view(run(RunState.RECOVERING), attempts), faults=tuple(fault_of(a) for a in (1, 2, 3)))
    effects = decide(v, None, NOW)
    [finish] = of(effects, FinishRun)
    assert finish.state is RunState.FAILED and finish.reason.startswith("crash loop: rank-exit at step 25 in 3")
    assert "n1, n2, n3" in finish.reason and not of(effects, StartAttempt)


def test_different_faults_or_steps_are_no_crash_loop() -> None:
    attempts = (ended(1, 0), ended(2), ended(3))
    for faults in ((fault_of(1), fault_of(2, step=26), fault_of(3)),
                   (fault_of(1), fault_of(2, FaultKind.HANG), fault_of(3))):
        v = replace(view(run(RunState.RECOVERING), attempts), faults=faults)
        assert not of(decide(v, None, NOW), FinishRun)


def test_failed_attempts_that_make_no_progress_stop_the_run() -> None:
    attempts = tuple(replace(ended(i, 40), final_step=40 + i) for i in range(1, 4))
    faults = tuple(fault_of(a, step=40 + a) for a in range(1, 4))  # no crash loop: other steps
    v = replace(view(run(RunState.RECOVERING), attempts, ck=CheckpointRef(step=40, path="c40")), faults=faults)
    [finish] = of(decide(v, None, NOW), FinishRun)
    assert finish.reason == ("no progress: 3 failed attempts in a row (attempts 1, 2, 3, resumed from step 40) "
                             "made no newer checkpoint and fewer than 100 steps each "
                             "(failures_without_progress = 3)")
    assert not of(decide(replace(v, attempts=attempts[1:], faults=faults[1:]), None, NOW), FinishRun)


@pytest.mark.parametrize(("trained", "newer_checkpoint", "stops"), [
    (99, False, True),  # one step short of progress_steps, and no newer checkpoint
    (100, False, False),  # progress_steps beyond its resume point: progress
    (5, True, False),  # the run checkpointed beyond where it resumed from: progress
])
def test_progress_is_a_newer_checkpoint_or_progress_steps_trained(trained: int, newer_checkpoint: bool,
                                                                   stops: bool) -> None:
    attempts = (ended(1, 40), ended(2, 40), replace(ended(3, 40), final_step=40 + trained))
    faults = tuple(fault_of(a, step=41 + a) for a in (1, 2, 3))
    ck = CheckpointRef(step=60 if newer_checkpoint else 40, path="c")
    v = replace(view(run(RunState.RECOVERING), attempts, ck=ck), faults=faults)
    assert bool(of(decide(v, None, NOW), FinishRun)) is stops


def test_hardware_faults_whose_nodes_were_replaced_cost_nothing() -> None:
    """A node lost, or a device failed, drained and replaced by a spare: not the run's failure,
    however many in a row (thousands of nodes make that bad luck, not a loop)."""
    attempts = tuple(ended(i, 40, nodes=("n1", f"n{i + 1}")) for i in range(1, 7))
    faults = tuple(fault_of(a, FaultKind.NODE_LOST if a % 2 else FaultKind.DEVICE, step=41 + a)
                   for a in range(1, 7))
    v = replace(view(run(RunState.RECOVERING), attempts, ck=CheckpointRef(step=40, path="c")), faults=faults)
    effects = decide(v, None, NOW)
    assert of(effects, StartAttempt) and not of(effects, FinishRun)


def test_a_lost_node_is_no_part_of_a_crash_loop() -> None:
    attempts = tuple(ended(i, 20 if i > 1 else 0) for i in range(1, 5))
    lost_thrice = tuple(fault_of(a, FaultKind.NODE_LOST) for a in (1, 2, 3))
    v = replace(view(run(RunState.RECOVERING), attempts[:3]), faults=lost_thrice)
    assert not of(decide(v, None, NOW), FinishRun), "the same node loss three times is bad luck, not a loop"
    # Crashes at step 25 around a lost node are still one crash loop.
    faults = (fault_of(1), fault_of(2), fault_of(3, FaultKind.NODE_LOST), fault_of(4))
    v = replace(view(run(RunState.RECOVERING), attempts), faults=faults)
    [finish] = of(decide(v, None, NOW), FinishRun)
    assert finish.reason.startswith("crash loop: rank-exit at step 25 in 3 attempts in a row")


def test_faults_arriving_faster_than_the_limit_stop_the_run_whatever_the_progress() -> None:
    policy = replace(run().policy, fault_rate_max=5, fault_rate_window_s=600.0)
    attempts = tuple(ended(i, 20 * i) for i in range(1, 7))  # each resumed further: progress every time
    faults = tuple(replace(fault_of(a, step=20 * a + 5), detected_at=NOW - 60 * (6 - a)) for a in range(1, 7))
    v = replace(view(run(RunState.RECOVERING, policy=policy), attempts, ck=CheckpointRef(step=140, path="c")),
                faults=faults)
    [finish] = of(decide(v, None, NOW), FinishRun)
    assert finish.reason.startswith("faults too frequent: 6 in the last 0.166667 h (fault_rate_max = 5)")
    old = tuple(replace(f, detected_at=f.detected_at - 601) if f.attempt == 1 else f for f in faults)
    assert not of(decide(replace(v, faults=old), None, NOW), FinishRun), "5 within the window: the limit"


def test_a_dozen_faults_each_followed_by_a_new_checkpoint_never_stop_a_run_under_the_default_policy() -> None:
    """A run of 400 steps, checkpointing every 20, meets a crash 15 steps after every
    resume: twelve faults, each followed by a newer checkpoint. It finishes."""
    r = run(RunState.PENDING, total_steps=400, policy=Policy())
    attempts: list[Attempt] = []
    faults: list[FaultRecord] = []
    ck: CheckpointRef | None = None
    t, state = NOW, RunState.PENDING
    for _ in range(40):
        t += 100.0
        v = replace(view(replace(r, state=state), tuple(attempts), ck=ck), faults=tuple(faults))
        effects = decide(v, None, t)
        assert not of(effects, FinishRun), of(effects, FinishRun)
        [start] = of(effects, StartAttempt)
        state = RunState.STARTING
        a = attempt(start.number, AttemptState.ENDED, resume_step=start.resume_step, started_at=t,
                    ended_at=t + 50, nodes=start.nodes)
        if len(faults) == 12:  # the last attempt runs to the end
            attempts.append(replace(a, outcome=AttemptOutcome.SUCCEEDED, final_step=400))
            break
        crash_at = start.resume_step + 15
        attempts.append(replace(a, outcome=AttemptOutcome.FAILED, final_step=crash_at))
        faults.append(replace(fault_of(start.number, step=crash_at), detected_at=t + 50))
        # Its checkpoint at the next multiple of 20 landed before the crash, from the second on
        if len(faults) > 1:
            ck = CheckpointRef(step=start.resume_step + 20, path=f"c{start.resume_step + 20}")
    assert len(faults) == 12 and attempts[-1].outcome is AttemptOutcome.SUCCEEDED


def test_restarts_without_progress_back_off_exponentially() -> None:
    def wait_before(n_stuck: int) -> float:
        attempts = (ended(1, 0), *(ended(i + 2, 40) for i in range(n_stuck)))
        lo, hi = 0.0, 10_000.0
        for _ in range(40):  # the smallest delay after the last end at which it launches
            mid = (lo + hi) / 2
            last = replace(attempts[-1], ended_at=NOW - mid)
            p = replace(run().policy, failures_without_progress=99)
            v = view(run(RunState.RECOVERING, policy=p),
                     (*attempts[:-1], last))
            lo, hi = (mid, hi) if not of(decide(v, None, NOW), StartAttempt) else (lo, mid)
        return round(hi, 1)

    assert wait_before(1) == 0.0  # the first restart after progress is at once
    assert [wait_before(n) for n in (2, 3, 4)] == [5.0, 10.0, 20.0]
    assert wait_before(9) == 300.0  # at most backoff_max_s


def test_the_backoff_is_announced_when_the_attempt_ends() -> None:
    live = replace(ended(3, 40), state=AttemptState.STOPPING, outcome=AttemptOutcome.FAILED,
                   stop_requested_at=NOW - 1, ended_at=None)
    o = obs(*(rank(i, ProcState.EXITED, exit_code=-9) for i in range(4)))
    effects = decide(view(run(RunState.RECOVERING), (ended(1, 0), ended(2, 40), live)), o, NOW)
    [note] = [e for e in effects if isinstance(e, Emit) and e.kind == "attempt.backoff"]
    assert "2 failed attempts in a row resumed from step 40: waiting 5 s" in note.message
    assert not of(effects, StartAttempt)
