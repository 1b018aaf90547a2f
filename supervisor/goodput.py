"""Goodput accounting: where a run's wall-clock time went. Pure, and O(attempts + faults).

ETTR (effective training time ratio) = kept training time / wall time, where

- wall time runs from the first attempt's start to the run's end (or now);
- kept training time is the step time of the steps that survive into the trajectory:
  an attempt's steps up to the point the next attempts rewound to (the oldest step a
  later attempt resumed from). What a rollback or a restart threw away is lost work.

It is computed from per-attempt sums kept as the steps arrive (``AttemptStats``; the
cut inside an attempt comes from the checkpoint it resumed from, which records its
attempt's summed step time), never from the raw steps: its cost does not grow with the
length of the run. The rest of the wall time is broken down as

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from supervisor.domain import Attempt, AttemptStats, CheckpointRecord, FaultRecord, MetricRecord, Run


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


def with_step(s: AttemptStats, m: MetricRecord) -> AttemptStats:
    """``s`` with one more of rank 0's steps (received in order)."""
    first = s.steps == 0
    return replace(
        s, steps=s.steps + 1, step_time_s=s.step_time_s + m.step_time_s,
        first_step=m.step if first or s.first_step is None else min(s.first_step, m.step),
        last_step=m.step if s.last_step is None else max(s.last_step, m.step),
        first_at=m.received_at if first else s.first_at,
        first_step_time_s=m.step_time_s if first else s.first_step_time_s,
        last_at=m.received_at, last_loss=m.loss, last_grad_norm=m.grad_norm)


def checkpoint_times(checkpoints: Sequence[CheckpointRecord]) -> dict[tuple[int, int], float]:
    """(attempt, step) -> that attempt's summed step time when it committed the checkpoint."""
    return {(c.attempt, c.step): c.attempt_time_s for c in checkpoints
            if c.attempt is not None and c.attempt_time_s is not None}


def account(run: Run, attempts: Sequence[Attempt], stats: Mapping[int, AttemptStats],
            faults: Sequence[FaultRecord], checkpoint_times: Mapping[tuple[int, int], float],
            now: float) -> Goodput:
    """``checkpoint_times``: (attempt, step) -> the attempt's summed step time when it
    committed the checkpoint of that step."""
    started = [a.started_at for a in attempts if a.started_at is not None]
    if not started:
        return Goodput(wall_s=0.0, productive_s=0.0, lost_s=0.0, checkpoint_s=0.0, startup_s=0.0,
                       detection_s=0.0, recovery_s=0.0, other_s=0.0, ettr=None, kept_steps=0, lost_steps=0)
    wall_s = max(0.0, (run.ended_at or now) - min(started))

    productive_s = lost_s = 0.0
    kept_steps = lost_steps = 0
    ordered = sorted(attempts, key=lambda a: a.number)
    rewound_to = _rewound_to(ordered)
    for i, a in enumerate(ordered):
        s = stats.get(a.number)
        if s is None or s.steps == 0 or s.last_step is None:
            continue
        later = rewound_to[i]
        cut = s.last_step if later is None else later
        if cut >= s.last_step:
            kept_s, kept = s.step_time_s, s.steps
        elif cut <= a.resume_step:
            kept_s, kept = 0.0, 0
        else:  # rewound to a step inside this attempt: its checkpoint says how much came before
            span = max(1, s.last_step - a.resume_step)
            kept = min(s.steps, cut - a.resume_step)
            kept_s = checkpoint_times.get((a.number, cut), s.step_time_s * (cut - a.resume_step) / span)
        productive_s += kept_s
        lost_s += s.step_time_s - kept_s
        kept_steps += kept
        lost_steps += s.steps - kept

    checkpoint_s = sum(s.checkpoint_s for s in stats.values())
    detected = {f.attempt: f.detected_at for f in reversed(faults)}  # first fault per attempt
    startup_s = 0.0
    for a in attempts:
        if a.started_at is None:
            continue
        s = stats.get(a.number)
        if s is not None and s.first_at is not None:
            startup_s += max(0.0, s.first_at - (s.first_step_time_s or 0.0) - a.started_at)
        else:  # never reached a step: starting until it failed, ended, or now
            until = detected.get(a.number, a.ended_at if a.ended_at is not None else now)
            startup_s += max(0.0, until - a.started_at)

    detection_s = recovery_s = 0.0
    started_after = _started_after(ordered)
    for f in faults:
        if f.last_step_at is not None:  # (a fault before the first step is startup time, counted above)
            detection_s += max(0.0, f.detected_at - f.last_step_at)
        resumed_at = started_after.get(f.attempt)
        recovery_s += max(0.0, (resumed_at or run.ended_at or now) - f.detected_at)

    accounted = productive_s + lost_s + checkpoint_s + startup_s + detection_s + recovery_s
    return Goodput(
        wall_s=wall_s, productive_s=productive_s, lost_s=lost_s, checkpoint_s=checkpoint_s,
        startup_s=startup_s, detection_s=detection_s, recovery_s=recovery_s,
        other_s=max(0.0, wall_s - accounted), ettr=productive_s / wall_s if wall_s > 0 else None,
        kept_steps=kept_steps, lost_steps=lost_steps,
    )


def _rewound_to(ordered: Sequence[Attempt]) -> list[int | None]:
    """For each attempt, the oldest step a later attempt resumed from (None: no later one)."""
    out: list[int | None] = [None] * len(ordered)
    low: int | None = None
    for i in range(len(ordered) - 1, -1, -1):
        out[i] = low
        low = ordered[i].resume_step if low is None else min(low, ordered[i].resume_step)
    return out


def _started_after(ordered: Sequence[Attempt]) -> dict[int, float]:
    """Attempt number -> when the next attempt that started did so."""
    out: dict[int, float] = {}
    nxt: float | None = None
    for a in reversed(ordered):
        if nxt is not None:
            out[a.number] = nxt
        if a.started_at is not None:
            nxt = a.started_at
    return out
