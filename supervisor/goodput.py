"""Goodput accounting: where a run's wall-clock time went. Pure.

ETTR (effective training time ratio) = kept training time / wall time, where

- wall time runs from the first attempt's start to the run's end (or now);
- kept training time is the step time of the steps that survive into the final
  trajectory: for each step number, the copy run by the latest attempt that ran it.
  Copies run by earlier attempts were thrown away by a rollback: lost work.

The rest of the wall time is broken down as

- checkpoint_s: blocking checkpoint saves (the trainer's reported durations);
- startup_s:    from an attempt's start to its first step (process start, setup, restore);
- detection_s:  from an attempt's last step before a fault to the fault's detection
                (an upper bound on how long the fault went unnoticed; for a hang it
                is the whole timeout);
- recovery_s:   from a fault's detection to the next attempt's start (teardown,
                choosing nodes, scheduling);
- other_s:      what is left: per-step overheads outside the measured step time, and
                time the supervisor was not running.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from supervisor.domain import Attempt, CheckpointRecord, FaultRecord, MetricRecord, Run


def injected_at(attempt: int, detected_at: float, injections: Iterable[tuple[int, float]]) -> float | None:
    """When chaos was injected into ``attempt`` before its fault was detected at
    ``detected_at`` (the latest such time), from ``(attempt, time)`` pairs; None for a
    fault nobody injected."""
    times = [ts for a, ts in injections if a == attempt and ts <= detected_at]
    return max(times) if times else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodput:
    wall_s: float
    productive_s: float
    lost_s: float
    checkpoint_s: float
    startup_s: float
    detection_s: float
    recovery_s: float
    other_s: float
    ettr: float | None  # None before the first attempt started
    kept_steps: int
    lost_steps: int


def account(
    run: Run,
    attempts: Sequence[Attempt],
    metrics: Sequence[MetricRecord],
    faults: Sequence[FaultRecord],
    checkpoints: Sequence[CheckpointRecord],
    now: float,
) -> Goodput:
    started = [a.started_at for a in attempts if a.started_at is not None]
    if not started:
        return Goodput(wall_s=0.0, productive_s=0.0, lost_s=0.0, checkpoint_s=0.0, startup_s=0.0,
                       detection_s=0.0, recovery_s=0.0, other_s=0.0, ettr=None, kept_steps=0,
                       lost_steps=0)
    t0 = min(started)
    wall_s = max(0.0, (run.ended_at or now) - t0)

    latest: dict[int, MetricRecord] = {}
    for m in metrics:
        if m.step not in latest or m.attempt > latest[m.step].attempt:
            latest[m.step] = m
    productive_s = sum(m.step_time_s for m in latest.values())
    total_step_s = sum(m.step_time_s for m in metrics)
    lost_s = total_step_s - productive_s

    checkpoint_s = sum(c.duration_s or 0.0 for c in checkpoints)

    by_attempt: dict[int, list[MetricRecord]] = {}
    for m in metrics:
        by_attempt.setdefault(m.attempt, []).append(m)
    detected = {f.attempt: f.detected_at for f in reversed(faults)}  # first fault per attempt
    startup_s = 0.0
    for a in attempts:
        if a.started_at is None:
            continue
        mine = by_attempt.get(a.number)
        if mine:
            first = min(mine, key=lambda m: m.received_at)
            startup_s += max(0.0, first.received_at - first.step_time_s - a.started_at)
        else:  # never reached a step: starting until it failed, ended, or now
            until = detected.get(a.number, a.ended_at if a.ended_at is not None else now)
            startup_s += max(0.0, until - a.started_at)

    detection_s = recovery_s = 0.0
    for f in faults:
        before = [m.received_at for m in by_attempt.get(f.attempt, []) if m.received_at <= f.detected_at]
        if before:  # (a fault before the first step is startup time, counted above)
            detection_s += f.detected_at - max(before)
        nxt = next((a for a in attempts if a.number > f.attempt and a.started_at is not None), None)
        resumed_at = nxt.started_at if nxt is not None and nxt.started_at is not None else None
        recovery_s += max(0.0, (resumed_at or run.ended_at or now) - f.detected_at)

    accounted = productive_s + lost_s + checkpoint_s + startup_s + detection_s + recovery_s
    return Goodput(
        wall_s=wall_s, productive_s=productive_s, lost_s=lost_s, checkpoint_s=checkpoint_s,
        startup_s=startup_s, detection_s=detection_s, recovery_s=recovery_s,
        other_s=max(0.0, wall_s - accounted), ettr=productive_s / wall_s if wall_s > 0 else None,
        kept_steps=len(latest), lost_steps=len(metrics) - len(latest),
    )
