"""What the next attempt's trainer is told beside its resume point: where its data starts
(a [command] that names ``{skip_to_step}``, data_steps.py) and the checkpoint intervals a
spec left "auto" (Young/Daly from what the run measured, supervisor/planning.py).

``told(view, start, spikes)`` fills them into the ``StartAttempt`` recovery.py decided
and says each one (``Emit``), so that the effects carry numbers and decide nothing.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor import planning
from supervisor.domain import Effect, Emit, RunView, StartAttempt
from supervisor.domain.events import EventKind
from supervisor.policy.data_steps import skip_to

Windows = tuple[tuple[int, int], ...]


def told(view: RunView, start: StartAttempt, windows: Windows) -> tuple[StartAttempt, list[Effect]]:
    """``start`` with its data step and intervals, and the events that say them.
    ``windows``: the run's data skip windows, those this tick adds included."""
    said: list[Effect] = []
    if start.precompile is None and view.data_skip_unit == "steps":
        start = _data_start(start, windows, said)
    tiers = {tier: _interval(view, tier, said) for tier in view.auto_tiers}
    return replace(start, every_steps=tiers.get(planning.TIER_PERSISTENT),
                   memory_every_steps=tiers.get(planning.TIER_MEMORY)), said


def _data_start(start: StartAttempt, windows: Windows, said: list[Effect]) -> StartAttempt:
    """The data step it reads first, past the skip windows; a window its checkpoint comes
    before is widened back to where it starts reading (data_steps.py), and said."""
    at, widen = skip_to(start.resume_step, windows)
    if widen is not None:
        said.append(Emit(kind=EventKind.DATA_SKIP,
                         message=f"attempt {start.number} resumes from step {start.resume_step} and reads "
                                 f"the data of step {at} next: the data of steps {widen[1]} to {at - 1} is "
                                 f"stepped over",
                         data={"attempt": start.number, "skip_to_step": at, "start": widen[1], "end": at,
                               "unit": "steps"}))
    return replace(start, skip_to_step=at, widen_skip=widen)


def _interval(view: RunView, tier: str, said: list[Effect]) -> int:
    """A tier's ``auto`` interval: Young/Daly from what the run measured so far, the
    tier's own blocking cost (planning.py)."""
    measured = view.measured
    stats = measured.stats if measured is not None else ()
    memory_saves = measured.memory_saves_s if measured is not None else ()
    cost, step_s = planning.measured_costs(stats, memory_saves, tier)
    run = view.run
    auto = planning.auto_every_steps(cost, step_s, run.nodes, run.policy.failures_per_node_day,
                                     run.total_steps, tier)
    what = "memory checkpoint" if tier == planning.TIER_MEMORY else "checkpoint"
    said.append(Emit(kind=EventKind.CHECKPOINT_INTERVAL, message=f"{what} {auto.why}",
                     data={"every_steps": auto.every_steps, "tier": tier}))
    return auto.every_steps
