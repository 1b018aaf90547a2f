"""A run that slowed as a whole: every rank slow together, the signature of a slow link or
a slow node in a collective (every rank waits for it at every step). A straggler is one
rank slower than the others (detection.py, recovery.py); this is the run against itself.

The rule (``slowed``): rank 0's step times (every rank waits at the same collectives, so
rank 0's time is the run's), the median of the attempt's newest ``slowdown_window`` steps
against the median of its first ones (after ``WARMUP_STEPS``, whose compile and first
collectives are slow on every run). Over ``slowdown_factor`` times (2 by default), with
no step in both windows, the run has slowed since the first step of the newest window
that ran over that.

What is done (``judge_slowdown``), only where a probe can find the cause
(``[health] diagnose``, whose diagnosis runs the link test; otherwise nothing is done):
once the attempt says it committed a checkpoint at or after that step (telemetry), it is
stopped. The diagnosis probes its nodes (recovery.py: ``probes_wanted``), a node the
probe names is drained, and the next attempt resumes from that checkpoint on the others
and a spare.

The cost of the decision: one restart (the resume, as long as the run's own restarts
measured: seconds onto warm spares, minutes for a cold start) and the probe (a few
seconds a pair of nodes), against the rest of the run at ``slowdown_factor`` times its
step time or worse. Little is lost: the stop comes at the tick after a checkpoint
committed, so only the steps of that tick are trained again.
A probe that names no one leaves the same nodes, and the next attempt measures its own
first steps (slow too): a slowdown the nodes do not explain (the data, a shared
filesystem, another tenant's traffic) costs one restart, never a loop of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from supervisor.domain import (
    Attempt,
    AttemptObs,
    Effect,
    FaultKind,
    RecordFault,
    RunState,
    RunView,
)
from supervisor.policy.recovery import stop_for

WARMUP_STEPS = 3  # an attempt's first steps: compiling, first collectives; never its baseline


@dataclass(frozen=True, slots=True)
class Slowdown:
    baseline_s: float  # the median of the attempt's first steps
    recent_s: float  # the median of its newest
    since_step: int  # the first slow step of the newest window

    def summary(self, window: int) -> str:
        return (f"rank 0's step time {self.recent_s:.3g} s over its last {window} steps, "
                f"{self.recent_s / self.baseline_s:.2g} x its first steps' {self.baseline_s:.3g} s "
                f"(since step {self.since_step})")


def slowed(first: Sequence[tuple[int, float]], newest: Sequence[tuple[int, float]], *,
           factor: float, window: int) -> Slowdown | None:
    """Whether the newest ``window`` steps run over ``factor`` times the first ones."""
    base = list(first[WARMUP_STEPS:WARMUP_STEPS + window])
    recent = list(newest[-window:])
    if len(base) < window or len(recent) < window or recent[0][0] <= base[-1][0]:
        return None
    baseline, now = median(s for _, s in base), median(s for _, s in recent)
    if baseline > 0 and now > factor * baseline:
        since = next(step for step, s in recent if s > factor * baseline)
        return Slowdown(baseline_s=baseline, recent_s=now, since_step=since)
    return None


def judge_slowdown(view: RunView, live: Attempt, obs: AttemptObs, state: RunState,
                   out: list[Effect]) -> tuple[RunState, Attempt]:
    """Stop a slowed attempt once a checkpoint since the slowdown committed, with
    ``[health] diagnose``; nothing otherwise."""
    policy = view.run.policy
    if not view.diagnose:
        return state, live
    found = slowed(obs.first_step_times, obs.newest_step_times, factor=policy.slowdown_factor,
                   window=policy.slowdown_window)
    committed = obs.committed_step
    if found is None or committed is None or committed < found.since_step:
        return state, live
    summary = (f"the whole run slowed: {found.summary(policy.slowdown_window)}; stopped after the checkpoint "
               f"of step {committed} to probe its nodes")
    fault = RecordFault(kind=FaultKind.SLOWDOWN, attempt=live.number, ranks=(), nodes=(), summary=summary,
                        step=committed)
    return stop_for(fault, {"baseline_s": found.baseline_s, "recent_s": found.recent_s}, live, state, out)
