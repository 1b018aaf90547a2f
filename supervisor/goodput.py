"""Goodput accounting: where a run's wall-clock time went. Pure; O(attempts + faults), or
with a ``Ledger`` of the settled history, O(what is not settled).

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
                the whole of a precompile attempt (supervisor/runfiles/precompile.py), whose
                steps train nothing;
- detection_s:  from an attempt's last step before a fault to the fault's detection
                (an upper bound on how long the fault went unnoticed; for a hang it
                is the whole timeout);
- recovery_s:   from a fault's detection to the next attempt's start (teardown,
                choosing nodes, scheduling);
- other_s:      what is left: per-step overheads outside the measured step time, and
                time the supervisor was not running.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
            now: float, ledger: Ledger | None = None) -> Goodput:
    """``checkpoint_times``: (attempt, step) -> the attempt's summed step time when it
    committed the checkpoint of that step. ``ledger``: what the first attempts and faults
    (in the order given here, which never change) add, summed once; the rest is summed
    afresh, so that the cost grows with what is not settled, not with the run's history."""
    k, m = (ledger.attempts, ledger.faults) if ledger is not None else (0, 0)
    # The ledger's attempts are the first k, in order: only the rest is sorted, each time.
    rest, open_faults = sorted(attempts[k:], key=lambda a: a.number), faults[m:]
    end = run.ended_at if run.ended_at is not None else now
    # The rest on its own: its own rewinds, first faults and next starts all lie within it
    # (or, for first faults, among the settled faults when a settled fault names it).
    detected = _first_faults(open_faults)
    if ledger is not None:
        detected = {**detected, **ledger.first_faults}
    started_after, first_start_rest = _started_after(rest), _first_start(rest)

    def next_start(attempt: int) -> float | None:
        """When the first attempt after ``attempt`` that started did so (None: none did)."""
        if attempt in started_after:
            return started_after[attempt]
        if ledger is not None and attempt <= ledger.last:  # a settled one: the next start is
            return ledger.started_after.get(attempt, first_start_rest)  # settled too, or the rest's first
        return None

    total = _sum_attempts(rest, _rewound_to(rest), stats, checkpoint_times, detected, now)
    total = total.plus(_sum_faults(open_faults, next_start, end))
    if ledger is not None:
        settled = ledger.sums(_lowest_resume(rest), next_start, detected, checkpoint_times, end, now)
        total = total.plus(settled)
    if total.first_start is None:
        return Goodput(wall_s=0.0, productive_s=0.0, lost_s=0.0, checkpoint_s=0.0, startup_s=0.0,
                       detection_s=0.0, recovery_s=0.0, other_s=0.0, ettr=None, kept_steps=0, lost_steps=0)
    wall_s = max(0.0, end - total.first_start)
    accounted = (total.productive_s + total.lost_s + total.checkpoint_s + total.startup_s + total.detection_s
                 + total.recovery_s)
    return Goodput(
        wall_s=wall_s, productive_s=total.productive_s, lost_s=total.lost_s, checkpoint_s=total.checkpoint_s,
        startup_s=total.startup_s, detection_s=total.detection_s, recovery_s=total.recovery_s,
        other_s=max(0.0, wall_s - accounted), ettr=total.productive_s / wall_s if wall_s > 0 else None,
        kept_steps=total.kept_steps, lost_steps=total.lost_steps,
    )


@dataclass(frozen=True, slots=True)
class _Sums:
    productive_s: float = 0.0
    lost_s: float = 0.0
    kept_steps: int = 0
    lost_steps: int = 0
    checkpoint_s: float = 0.0
    startup_s: float = 0.0
    detection_s: float = 0.0
    recovery_s: float = 0.0
    first_start: float | None = None  # the earliest attempt's start

    def plus(self, o: _Sums) -> _Sums:
        starts = [x for x in (self.first_start, o.first_start) if x is not None]
        return _Sums(self.productive_s + o.productive_s, self.lost_s + o.lost_s,
                     self.kept_steps + o.kept_steps, self.lost_steps + o.lost_steps,
                     self.checkpoint_s + o.checkpoint_s, self.startup_s + o.startup_s,
                     self.detection_s + o.detection_s, self.recovery_s + o.recovery_s,
                     min(starts) if starts else None)


def _sum_attempts(ordered: Sequence[Attempt], rewound_to: Sequence[int | None],
                  stats: Mapping[int, AttemptStats], checkpoint_times: Mapping[tuple[int, int], float],
                  detected: Mapping[int, float], now: float) -> _Sums:
    """What ``ordered`` (consecutive attempts, in order) add: their kept and lost training
    (each cut at ``rewound_to``, the oldest step a later attempt resumed from), their
    blocking saves, their startup."""
    productive_s = lost_s = checkpoint_s = startup_s = 0.0
    kept_steps = lost_steps = 0
    first_start: float | None = None
    for a, later in zip(ordered, rewound_to, strict=True):
        s = _stats_of(a, stats)
        if a.started_at is not None:
            first_start = a.started_at if first_start is None else min(first_start, a.started_at)
            startup_s += _startup_s(a, s, detected, now)
        if s is None:
            continue
        checkpoint_s += s.checkpoint_s
        if s.steps == 0 or s.last_step is None:
            continue
        kept_s, kept = _kept(a, s, later, checkpoint_times)
        productive_s += kept_s
        lost_s += s.step_time_s - kept_s
        kept_steps += kept
        lost_steps += s.steps - kept
    return _Sums(productive_s, lost_s, kept_steps, lost_steps, checkpoint_s, startup_s, 0.0, 0.0, first_start)


def _stats_of(a: Attempt, stats: Mapping[int, AttemptStats]) -> AttemptStats | None:
    """``a``'s step sums; none for a precompile attempt (its whole span is startup)."""
    return stats.get(a.number) if a.precompile is None else None


def _startup_s(a: Attempt, s: AttemptStats | None, detected: Mapping[int, float], now: float) -> float:
    """From ``a``'s start to its first step; for one that never reached a step, until its
    first fault (``detected``), its end, or now."""
    if a.started_at is None:
        return 0.0
    if s is not None and s.first_at is not None:
        return max(0.0, s.first_at - (s.first_step_time_s or 0.0) - a.started_at)
    until = detected.get(a.number, a.ended_at if a.ended_at is not None else now)
    return max(0.0, until - a.started_at)


def _kept(a: Attempt, s: AttemptStats, later: int | None,
          checkpoint_times: Mapping[tuple[int, int], float]) -> tuple[float, int]:
    """The step time and steps of ``a`` that survive a rewind to ``later`` (None: none)."""
    assert s.last_step is not None
    cut = s.last_step if later is None else later
    if cut >= s.last_step:
        return s.step_time_s, s.steps
    if cut <= a.resume_step:
        return 0.0, 0
    # rewound to a step inside this attempt: its checkpoint says how much came before
    span = max(1, s.last_step - a.resume_step)
    kept = min(s.steps, cut - a.resume_step)
    return checkpoint_times.get((a.number, cut), s.step_time_s * (cut - a.resume_step) / span), kept


def _sum_faults(faults: Sequence[FaultRecord], next_start: Callable[[int], float | None],
                end: float) -> _Sums:
    """What ``faults`` add: detection (from the last step before each) and recovery (to the
    next attempt's start, ``next_start`` of the fault's attempt; else the run's end, or now)."""
    detection_s = recovery_s = 0.0
    for f in faults:
        if f.last_step_at is not None:  # (a fault before the first step is startup time, counted above)
            detection_s += max(0.0, f.detected_at - f.last_step_at)
        resumed_at = next_start(f.attempt)
        recovery_s += max(0.0, (resumed_at if resumed_at is not None else end) - f.detected_at)
    return _Sums(detection_s=detection_s, recovery_s=recovery_s)


@dataclass(slots=True)
class Ledger:
    """What a run's settled history adds to its account, summed once: its first
    ``attempts`` attempts and first ``faults`` faults, which never change again. What the
    later history can still change about them is small and taken into account at each
    call: the oldest step a later attempt resumed from (which may cut their kept steps; a
    memo per value), the start of the first later attempt (their last faults' recovery),
    and the first faults of settled attempts that never reached a step."""

    attempts: int
    faults: int
    last: int  # the number of the last settled attempt (0: none)
    first_faults: dict[int, float]  # attempt -> its first settled fault's detection
    started_after: dict[int, float]  # attempt -> the next settled attempt's start
    _ordered: list[Attempt]
    _rewound: list[int | None]  # within the settled attempts
    _fixed: _Sums  # what no later history changes: saves, detection, most startups and recoveries
    _unresolved: list[FaultRecord]  # settled faults whose next start lies beyond the settled attempts
    _no_step: list[Attempt]  # settled attempts without a step and without a settled fault
    _stats: dict[int, AttemptStats]
    _kept: dict[int | None, _Sums]  # the oldest later resume step -> the kept and lost training

    @classmethod
    def of(cls, attempts: Sequence[Attempt], stats: Mapping[int, AttemptStats],
           faults: Sequence[FaultRecord]) -> Ledger:
        """The ledger of ``attempts`` and ``faults`` (a run's first ones, settled), with
        ``stats`` as account gets them."""
        ordered = sorted(attempts, key=lambda a: a.number)
        first_faults = _first_faults(faults)
        started_after = _started_after(ordered)
        checkpoint_s = startup_s = 0.0
        no_step: list[Attempt] = []
        for a in ordered:
            st = _stats_of(a, stats)
            checkpoint_s += st.checkpoint_s if st is not None else 0.0
            stepped = st is not None and st.first_at is not None
            if a.started_at is not None and not stepped and a.number not in first_faults:
                no_step.append(a)  # its first fault, if it ever has one, is not settled: judged at each call
            else:
                startup_s += _startup_s(a, st, first_faults, 0.0)
        resolved = [f for f in faults if f.attempt in started_after]
        starts = [a.started_at for a in ordered if a.started_at is not None]
        fixed = _Sums(checkpoint_s=checkpoint_s, startup_s=startup_s, first_start=min(starts, default=None))
        detection = _sum_faults(faults, lambda _: None, 0.0).detection_s  # every settled fault's
        recovery = _sum_faults(resolved, started_after.get, 0.0).recovery_s  # those resolved here
        fixed = fixed.plus(_Sums(detection_s=detection, recovery_s=recovery))
        return cls(attempts=len(ordered), faults=len(faults), last=ordered[-1].number if ordered else 0,
                   first_faults=first_faults, started_after=started_after, _ordered=ordered,
                   _rewound=_rewound_to(ordered), _fixed=fixed,
                   _unresolved=[f for f in faults if f.attempt not in started_after], _no_step=no_step,
                   _stats={a.number: st for a in ordered if (st := _stats_of(a, stats)) is not None},
                   _kept={})

    def sums(self, lowest_later: int | None, next_start: Callable[[int], float | None],
             detected: Mapping[int, float], checkpoint_times: Mapping[tuple[int, int], float], end: float,
             now: float) -> _Sums:
        """What the settled history adds, given the oldest step a later attempt resumed
        from, the next start after each attempt, every attempt's first fault, the run's end
        (or now) and now."""
        kept = self._kept.get(lowest_later)
        if kept is None:
            rewound = [x if lowest_later is None else (lowest_later if x is None else min(x, lowest_later))
                       for x in self._rewound]
            full = _sum_attempts(self._ordered, rewound, self._stats, checkpoint_times, {}, 0.0)
            kept = _Sums(full.productive_s, full.lost_s, full.kept_steps, full.lost_steps)
            if len(self._kept) > 8:
                self._kept.clear()
            self._kept[lowest_later] = kept
        startups = sum(_startup_s(a, None, detected, now) for a in self._no_step)
        recovery_s = _sum_faults(self._unresolved, next_start, end).recovery_s  # (their detection: fixed)
        return self._fixed.plus(kept).plus(_Sums(startup_s=startups, recovery_s=recovery_s))


def _first_faults(faults: Sequence[FaultRecord]) -> dict[int, float]:
    """Attempt number -> the detection of its first fault (in the order given)."""
    return {f.attempt: f.detected_at for f in reversed(faults)}


def _lowest_resume(ordered: Sequence[Attempt]) -> int | None:
    return min((a.resume_step for a in ordered if a.precompile is None), default=None)


def _first_start(ordered: Sequence[Attempt]) -> float | None:
    return next((a.started_at for a in ordered if a.started_at is not None), None)


def _rewound_to(ordered: Sequence[Attempt]) -> list[int | None]:
    """For each attempt, the oldest step a later attempt resumed from (None: no later one).
    A precompile attempt resumes from nothing: it rewinds nothing."""
    out: list[int | None] = [None] * len(ordered)
    low: int | None = None
    for i in range(len(ordered) - 1, -1, -1):
        out[i] = low
        if ordered[i].precompile is None:
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
