"""The budget: when a run stops trying, and how long the next attempt waits.

The budget is for failures without progress, not for faults: a run that lasts weeks
at thousands of nodes meets a fault every few hours and must never be stopped by
their count (Llama 3: 419 interruptions in 54 days on 2,048 nodes). So:

- an attempt made progress when the run has a newer complete checkpoint than the one
  it resumed from, or it trained ``progress_steps`` steps beyond that point;
- ``failures_without_progress`` failed attempts in a row that made none: FAILED;
- a node lost and replaced (``node-lost``, ``device``: the hardware, drained), an
  attempt the cluster interrupted (its allocation ended) and one that never started
  cost nothing, and neither count nor break a run of failures;
- more than ``fault_rate_max`` faults within ``fault_rate_window_s``: FAILED (the
  cluster or the job is broken beyond what restarts fix), whatever the progress;
- a crash loop (the same fault kind at the same step ending ``crash_loop_attempts``
  failed attempts in a row; a lost node is no part of one): FAILED;
- the n-th failed attempt in a row resumed from one checkpoint waits
  ``backoff_base_s`` x 2^(n-2), at most ``backoff_max_s``;
- an operator's ``resume`` starts all of this afresh (``Run.budget_from_attempt``).
"""

from __future__ import annotations

from collections.abc import Iterable

from supervisor.domain import Attempt, AttemptOutcome, FaultKind, FaultRecord, RunView
from supervisor.policy.attribution import numbers_text

# Faults of the hardware, whose nodes were drained and replaced: they cost no budget.
HARDWARE_KINDS = frozenset({FaultKind.NODE_LOST, FaultKind.DEVICE})
_NOT_COUNTED = frozenset({AttemptOutcome.ABORTED, AttemptOutcome.INTERRUPTED})


def stop_reason(view: RunView, faults: list[FaultRecord], streak: list[Attempt], now: float) -> str | None:
    """Why the run must stop instead of launching again (``streak``: its failed_streak), or None."""
    return (_crash_loop(view, streak, faults)
            or _too_frequent(view, faults, now)
            or _no_progress(view, faults))


def _first_fault(faults: Iterable[FaultRecord]) -> dict[int, FaultRecord]:
    """Each attempt's first fault (the one that ended it)."""
    first: dict[int, FaultRecord] = {}
    for f in faults:
        first.setdefault(f.attempt, f)
    return first


def failed_streak(view: RunView, faults: Iterable[FaultRecord]) -> list[Attempt]:
    """The FAILED attempts at the end of the run's history (since the budget began), oldest
    first; an attempt that ended any other way ends it, except those that never ran or
    that the cluster interrupted (no evidence either way), and a lost node (bad luck at
    scale, not a loop), which are passed over."""
    kinds = {n: f.kind for n, f in _first_fault(faults).items()}
    streak: list[Attempt] = []
    for a in reversed(view.attempts):
        if a.number <= view.run.budget_from_attempt:
            break
        outcome = a.outcome
        if outcome in _NOT_COUNTED or kinds.get(a.number) is FaultKind.NODE_LOST:
            continue
        if outcome is not AttemptOutcome.FAILED:
            break
        streak.append(a)
    return streak[::-1]


def _crash_loop(view: RunView, streak: list[Attempt], faults: list[FaultRecord]) -> str | None:
    """The same fault (kind and step) ended the last ``crash_loop_attempts`` attempts."""
    k = view.run.policy.crash_loop_attempts
    if len(streak) < k:
        return None
    first = _first_fault(faults)
    seen = [first.get(a.number) for a in streak[-k:]]
    if any(f is None for f in seen) or len({(f.kind, f.step) for f in seen if f}) != 1:
        return None
    f0 = seen[0]
    assert f0 is not None
    nodes = sorted({n for a in streak[-k:] for n in a.nodes})
    return (f"crash loop: {f0.kind} at step {f0.step} in {k} attempts in a row "
            f"(on nodes {', '.join(nodes)}); a restart will not fix it")


def _too_frequent(view: RunView, faults: list[FaultRecord], now: float) -> str | None:
    """More faults in the window than the policy allows, progress or not."""
    policy = view.run.policy
    since = now - policy.fault_rate_window_s
    counted = [f for f in faults if f.detected_at >= since and f.attempt > view.run.budget_from_attempt
               and f.kind is not FaultKind.ALLOCATION_ENDED]
    if len(counted) <= policy.fault_rate_max:
        return None
    return (f"faults too frequent: {len(counted)} in the last {policy.fault_rate_window_s / 3600:g} h "
            f"(fault_rate_max = {policy.fault_rate_max}); the cluster or the job is broken beyond restarts")


def made_progress(view: RunView, attempt: Attempt) -> bool:
    """The run checkpointed beyond where ``attempt`` resumed from, or it trained
    ``progress_steps`` steps beyond it. A precompile pass never made any: its steps train nothing."""
    if attempt.precompile is not None:
        return False
    later = [a.resume_step for a in view.attempts if a.number > attempt.number and a.precompile is None]
    newest = view.newest_checkpoint.step if view.newest_checkpoint else 0
    checkpointed = max([newest, *later]) > attempt.resume_step
    trained = (attempt.final_step or 0) - attempt.resume_step >= view.run.policy.progress_steps
    return checkpointed or trained


def without_progress(view: RunView, faults: Iterable[FaultRecord]) -> list[Attempt]:
    """The failed attempts at the end of the history that made no progress, oldest first:
    what the budget charges. A hardware fault (the node was replaced) costs nothing."""
    kinds = {n: f.kind for n, f in _first_fault(faults).items()}
    charged: list[Attempt] = []
    for a in reversed(view.attempts):
        if a.number <= view.run.budget_from_attempt:
            break
        outcome = a.outcome
        if outcome in _NOT_COUNTED or kinds.get(a.number) in HARDWARE_KINDS:
            continue
        if outcome is not AttemptOutcome.FAILED or made_progress(view, a):
            break
        charged.append(a)
    return charged[::-1]


def _no_progress(view: RunView, faults: list[FaultRecord]) -> str | None:
    charged = without_progress(view, faults)
    k = view.run.policy.failures_without_progress
    if len(charged) < k:
        return None
    steps = sorted({a.resume_step for a in charged})
    return (f"no progress: {len(charged)} failed attempts in a row (attempts "
            f"{numbers_text(a.number for a in charged)}, resumed from step {', '.join(map(str, steps))}) "
            f"made no newer checkpoint and fewer than {view.run.policy.progress_steps} steps each "
            f"(failures_without_progress = {k})")


def backoff(view: RunView, streak: list[Attempt]) -> tuple[float, int]:
    """(seconds to wait before the next attempt, failed attempts in a row that resumed from
    the same checkpoint). The first restart after progress is immediate; the n-th in a row
    (n >= 2) waits backoff_base_s x 2^(n-2), at most backoff_max_s (never less than
    backoff_base_s)."""
    if not streak:
        return 0.0, 0
    same = 0
    for a in reversed(streak):
        if a.resume_step != streak[-1].resume_step:
            break
        same += 1
    policy = view.run.policy
    if same < 2 or policy.backoff_base_s <= 0:
        return 0.0, same
    doubled = policy.backoff_base_s * 2.0 ** min(same - 2, 64)  # 2^64 x any base is past any max
    return max(policy.backoff_base_s, min(doubled, policy.backoff_max_s)), same
