"""The evidence thresholds at their edges: just under a limit is no fault, just over it is.

silence_timeout_s (a node whose every rank is unheard), the spike rules (loss over the
window's median by spike_loss_rel, grad norm by spike_grad_factor, for
spike_persist_steps steps), abandon_after_s (processes that outlive SIGKILL).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.domain import (
    AttemptOutcome,
    AttemptState,
    DrainNode,
    EndAttempt,
    FaultKind,
    Policy,
    ProcState,
    RecordFault,
    RunState,
    StepSample,
)
from supervisor.policy import decide
from tests.unit.policy_world import NOW, attempt, obs, of, rank, run, view

SILENCE = Policy().silence_timeout_s


@pytest.mark.parametrize(("silent_s", "lost"), [(SILENCE - 0.01, False), (SILENCE, False), (SILENCE + 0.01, True)])
def test_a_node_is_lost_only_once_silent_for_longer_than_the_limit(silent_s: float, lost: bool) -> None:
    p = replace(run().policy, silence_timeout_s=SILENCE)
    ranks = [rank(0, last_seen_at=NOW - 0.5), rank(1, last_seen_at=NOW - 0.5),
             rank(2, last_seen_at=NOW - silent_s), rank(3, last_seen_at=NOW - silent_s)]
    faults = of(decide(view(run(policy=p), (attempt(),)), obs(*ranks), NOW), RecordFault)
    assert [f.kind for f in faults] == ([FaultKind.NODE_LOST] if lost else [])


def steps(losses: list[float], grads: list[float] | None = None) -> tuple[StepSample, ...]:
    grads = grads or [1.0] * len(losses)
    return tuple(StepSample(step=i + 1, loss=x, grad_norm=g, first_sample=16 * i)
                 for i, (x, g) in enumerate(zip(losses, grads, strict=True)))


def judged(recent: tuple[StepSample, ...]) -> list[RecordFault]:
    live = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    return of(decide(view(run(), (live,)), replace(obs(), recent=recent), NOW), RecordFault)


W, PERSIST = Policy().spike_window, Policy().spike_persist_steps


@pytest.mark.parametrize(("factor", "spike"), [(1.49, False), (1.5, False), (1.51, True)])
def test_a_loss_spike_is_a_loss_above_the_window_median_by_more_than_spike_loss_rel(factor: float,
                                                                                    spike: bool) -> None:
    losses = [2.0] * W + [2.0 * factor] * PERSIST
    assert bool(judged(steps(losses))) is spike


@pytest.mark.parametrize(("factor", "spike"), [(4.99, False), (5.0, False), (5.01, True)])
def test_a_grad_norm_spike_is_a_grad_norm_above_the_window_median_by_more_than_the_factor(factor: float,
                                                                                          spike: bool) -> None:
    losses = [2.0] * (W + PERSIST)
    grads = [1.0] * W + [factor] * PERSIST
    assert bool(judged(steps(losses, grads))) is spike


@pytest.mark.parametrize(("length", "acted_on"), [(PERSIST - 1, False), (PERSIST, True)])
def test_a_spike_is_acted_on_once_it_lasted_spike_persist_steps(length: int, acted_on: bool) -> None:
    losses = [2.0] * W + [10.0] * length
    faults = judged(steps(losses))
    assert [f.kind for f in faults] == ([FaultKind.SPIKE] if acted_on else [])


ABANDON = Policy().abandon_after_s
GRACE = 10.0  # stop_grace_s in test_policy.run()


@pytest.mark.parametrize(("waited_s", "abandoned"), [(GRACE + ABANDON - 0.01, False), (GRACE + ABANDON, True)])
def test_processes_are_abandoned_once_they_outlived_the_stop_by_grace_and_abandon_after_s(
        waited_s: float, abandoned: bool) -> None:
    live = attempt(state=AttemptState.STOPPING, stop_requested_at=NOW - waited_s, outcome=AttemptOutcome.FAILED)
    stuck = obs(*(rank(r, ProcState.EXITED, exit_code=-9) for r in range(3)), rank(3, ProcState.UNKNOWN))
    effects = decide(view(run(RunState.RECOVERING), (live,)), stuck, NOW)
    assert bool(of(effects, EndAttempt)) is abandoned
    assert [d.node for d in of(effects, DrainNode)] == (["n2"] if abandoned else [])
