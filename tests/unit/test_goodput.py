"""Goodput accounting over a run with one fault and a rollback."""

from __future__ import annotations

import pytest

from supervisor.domain import (
    Attempt,
    AttemptOutcome,
    AttemptState,
    CheckpointRecord,
    FaultKind,
    FaultRecord,
    MetricRecord,
    Policy,
    Run,
    RunState,
)
from supervisor.goodput import account


def metric(attempt: int, step: int, at: float) -> MetricRecord:
    return MetricRecord(attempt=attempt, step=step, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=1.0,
                        tokens_per_s=1.0, received_at=at)


def test_breakdown_of_a_run_with_one_rollback() -> None:
    # attempt 1: starts at 0, first step done at 5, steps 1..12 end at 16; fault detected at 17
    # attempt 2: starts at 19 from step 10, first step (11) done at 24, steps 11..20 end at 33
    run = Run(number=1, name="t", state=RunState.SUCCEEDED, reason="", nodes=1, ranks_per_node=1, spares=0,
              total_steps=20, policy=Policy(), created_at=0.0, ended_at=34.0)
    attempts = [
        Attempt(run_number=1, number=1, state=AttemptState.ENDED, nodes=("a",), resume_from=None,
                resume_step=0, created_at=0.0, started_at=0.0, ended_at=18.0, outcome=AttemptOutcome.FAILED),
        Attempt(run_number=1, number=2, state=AttemptState.ENDED, nodes=("a",), resume_from="/c",
                resume_step=10, created_at=19.0, started_at=19.0, ended_at=34.0,
                outcome=AttemptOutcome.SUCCEEDED),
    ]
    metrics = [metric(1, s, 4.0 + s) for s in range(1, 13)] + [metric(2, s, 13.0 + s) for s in range(11, 21)]
    faults = [FaultRecord(id=1, run_number=1, attempt=1, kind=FaultKind.RANK_EXIT, ranks=(0,), nodes=("a",),
                          step=12, summary="", detected_at=17.0, recovered_at=24.0)]
    checkpoints = [CheckpointRecord(step=10, path="/c", complete=True, duration_s=0.5, attempt=1,
                                    created_at=14.0)]
    g = account(run, attempts, metrics, faults, checkpoints, now=100.0)
    assert g.wall_s == 34.0
    assert (g.kept_steps, g.lost_steps) == (20, 2)  # steps 11 and 12 of attempt 1 were recomputed
    assert g.productive_s == 20.0 and g.lost_s == 2.0
    assert g.checkpoint_s == 0.5
    assert g.startup_s == pytest.approx(4.0 + 4.0)  # 0 -> 4 and 19 -> 23 (first step's own second excluded)
    assert g.detection_s == pytest.approx(1.0)  # last step at 16, detected at 17
    assert g.recovery_s == pytest.approx(2.0)  # detected at 17, next attempt started at 19
    assert g.ettr == pytest.approx(20 / 34)
    total = g.productive_s + g.lost_s + g.checkpoint_s + g.startup_s + g.detection_s + g.recovery_s + g.other_s
    assert total == pytest.approx(g.wall_s)


def test_no_attempt_started_has_no_ettr() -> None:
    run = Run(number=1, name="t", state=RunState.PENDING, reason="", nodes=1, ranks_per_node=1, spares=0,
              total_steps=20, policy=Policy(), created_at=0.0)
    assert account(run, [], [], [], [], now=5.0).ettr is None
