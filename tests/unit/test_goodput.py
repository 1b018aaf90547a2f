"""Goodput accounting over a run with one fault and a rollback."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.domain import (
    Attempt,
    AttemptOutcome,
    AttemptState,
    AttemptStats,
    FaultKind,
    FaultRecord,
    MetricRecord,
    Policy,
    Run,
    RunState,
)
from supervisor.goodput import Goodput, Ledger, account, with_step


def metric(attempt: int, step: int, at: float) -> MetricRecord:
    return MetricRecord(attempt=attempt, step=step, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=1.0,
                        tokens_per_s=1.0, received_at=at)


def stats_from(metrics: list[MetricRecord]) -> dict[int, AttemptStats]:
    """Per-attempt stats recounted from every raw step at once (not with with_step's fold)."""
    out: dict[int, AttemptStats] = {}
    for attempt in sorted({m.attempt for m in metrics}):
        ms = sorted((m for m in metrics if m.attempt == attempt), key=lambda m: (m.received_at, m.step))
        out[attempt] = AttemptStats(
            attempt=attempt, steps=len(ms), first_step=min(m.step for m in ms), last_step=max(m.step for m in ms),
            first_at=ms[0].received_at, first_step_time_s=ms[0].step_time_s, last_at=ms[-1].received_at,
            step_time_s=sum(m.step_time_s for m in ms), last_loss=ms[-1].loss, last_grad_norm=ms[-1].grad_norm)
    return out


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
                          step=12, summary="", detected_at=17.0, recovered_at=24.0, last_step_at=16.0)]
    stats = stats_from(metrics)
    stats[1] = replace(stats[1], checkpoints=1, checkpoint_s=0.5)  # step 10's save, 10 steps in
    g = account(run, attempts, stats, faults, {(1, 10): 10.0}, now=100.0)
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
    assert account(run, [], {}, [], {}, now=5.0).ettr is None


def test_without_the_checkpoint_s_record_the_kept_part_is_pro_rata() -> None:
    run = Run(number=1, name="t", state=RunState.RUNNING, reason="", nodes=1, ranks_per_node=1, spares=0,
              total_steps=100, policy=Policy(), created_at=0.0)
    attempts = [Attempt(run_number=1, number=n, state=AttemptState.ENDED, nodes=("a",), resume_from=None,
                        resume_step=r, created_at=0.0, started_at=0.0) for n, r in ((1, 0), (2, 30))]
    stats = {1: AttemptStats(attempt=1, steps=40, first_step=1, last_step=40, step_time_s=80.0, first_at=2.0,
                             last_at=82.0, first_step_time_s=2.0)}
    g = account(run, attempts, stats, [], {}, now=100.0)
    assert (g.productive_s, g.lost_s, g.kept_steps, g.lost_steps) == (60.0, 20.0, 30, 10)


def test_stats_kept_as_steps_arrive_equal_stats_of_every_step() -> None:
    """The recorder's running sums (with_step, one step at a time) and a whole recount agree."""
    metrics = [metric(1, s, 4.0 + s) for s in range(1, 13)]
    running = AttemptStats(attempt=1)
    for m in metrics:
        running = with_step(running, m)
    assert stats_from(metrics) == {1: running}
    assert (running.steps, running.first_step, running.last_step, running.step_time_s) == (12, 1, 12, 12.0)
    assert (running.first_at, running.last_at, running.first_step_time_s) == (5.0, 16.0, 1.0)


# --- the ledger of a settled history ---------------------------------------------------------

_RUN = Run(number=1, name="t", state=RunState.RUNNING, reason="", nodes=1, ranks_per_node=1, spares=0,
           total_steps=100, policy=Policy(), created_at=0.0)


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[Attempt], dict[int, AttemptStats], list[FaultRecord],
                                         dict[tuple[int, int], float]]:
    """Attempts in order (some never started, some without a step), their stats, faults of
    any attempt (in id order), and checkpoint times at some resume points."""
    n = draw(st.integers(0, 9))
    attempts, stats, t = [], {}, 0.0
    for number in range(1, n + 1):
        t += draw(st.floats(0, 50))
        started = None if draw(st.integers(0, 9)) == 0 else t
        resume = draw(st.integers(0, 60))
        ended = t + draw(st.floats(0, 40)) if number < n or draw(st.booleans()) else None
        attempts.append(Attempt(run_number=1, number=number, state=AttemptState.ENDED, nodes=("a",),
                                resume_from=None, resume_step=resume, created_at=t, started_at=started,
                                ended_at=ended))
        if started is not None and draw(st.integers(0, 4)) > 0:
            steps = draw(st.integers(0, 30))
            stats[number] = AttemptStats(
                attempt=number, steps=steps, first_step=resume + 1 if steps else None,
                last_step=resume + steps if steps else None,
                first_at=started + draw(st.floats(0, 5)) if steps else None, first_step_time_s=1.0,
                step_time_s=float(steps), checkpoint_s=draw(st.floats(0, 3)))
    faults = [FaultRecord(id=i + 1, run_number=1, attempt=draw(st.integers(1, max(1, n))), kind=FaultKind.RANK_EXIT,
                          ranks=(0,), nodes=("a",), step=0, summary="", detected_at=draw(st.floats(0, 500)),
                          recovered_at=None, last_step_at=draw(st.one_of(st.none(), st.floats(0, 500))))
              for i in range(draw(st.integers(0, 8)))]
    times = {(a.number, a.resume_step + draw(st.integers(1, 10))): draw(st.floats(0, 30))
             for a in attempts if draw(st.booleans())}
    return attempts, stats, faults, times


@given(history=histories(), data=st.data())
def test_the_ledger_of_any_settled_prefix_gives_the_account_of_the_whole_history(
        history: tuple[list[Attempt], dict[int, AttemptStats], list[FaultRecord], dict[tuple[int, int], float]],
        data: st.DataObject) -> None:
    """Summed once for its first attempts and faults, then asked at two later times (and
    with a run that ended), the ledger's account equals the one summed whole."""
    attempts, stats, faults, times = history
    k = data.draw(st.integers(0, len(attempts)))
    m = data.draw(st.integers(0, len(faults)))
    ledger = Ledger.of(attempts[:k], stats, faults[:m])
    for run, now in ((_RUN, 600.0), (_RUN, 900.0), (replace(_RUN, ended_at=700.0), 1000.0)):
        whole = account(run, attempts, stats, faults, times, now)
        summed = account(run, attempts, stats, faults, times, now, ledger=ledger)
        for name in Goodput.__dataclass_fields__:
            a, b = getattr(whole, name), getattr(summed, name)
            assert (a is None and b is None) or a == pytest.approx(b, rel=1e-9, abs=1e-9), (name, whole, summed)
