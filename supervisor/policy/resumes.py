"""A resumed attempt checked against what it was told (pure): a trainer whose first step is
not after its checkpoint's did not load it (``wrong_resume``: the run stops, a retry would
do the same); the reference trainer, whose steps are deterministic, must repeat the loss an
earlier attempt reported for its first step (``expected_first``, then ``resume_diverged``:
the checkpoint does not hold what was saved).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from supervisor.domain import Attempt, AttemptObs, FaultKind, RecordFault
from supervisor.policy.attribution import Finding


def expected_first(live: Attempt, *, reference_trainer: bool, data_skipped: bool,
                   reported: tuple[int, float | None] | None,
                   nodes_of: Mapping[int, int]) -> tuple[int, float] | None:
    """The first step of a resumed attempt and the loss it must have: the loss an earlier
    attempt reported for that step (``reported``: that attempt and its loss). None where the
    check does not hold: another trainer (whose steps may not be deterministic), a fresh
    start, a run that skipped data (that step's batch changed), a step no attempt reached
    or whose loss was not finite, an earlier attempt on another number of nodes
    (``nodes_of``: each attempt's; the same batch, its sums taken in another order: equal
    only up to rounding)."""
    if not reference_trainer or live.resume_from is None or data_skipped or reported is None:
        return None
    attempt, loss = reported
    if loss is None or not math.isfinite(loss) or nodes_of.get(attempt) != len(live.nodes):
        return None
    return live.resume_step + 1, loss


def wrong_resume(live: Attempt, obs: AttemptObs, advice: str) -> Finding | None:
    """A trainer told to resume after step N whose first step is N or lower restarted
    elsewhere: most often from zero, its own search having found nothing where the spec's
    resume arguments pointed, or where the trainer looks (``advice``: what to change). A
    restart would do the same: the run stops and says why."""
    if live.resume_from is None or live.resume_step <= 0:
        return None
    early = [r for r in obs.ranks if r.first_step is not None and r.first_step <= live.resume_step]
    if not early:
        return None
    first = min(r.first_step for r in early if r.first_step is not None)
    summary = (f"the trainer resumed at step {first}, not after step {live.resume_step} of the checkpoint it "
               f"was given ({live.resume_from}): it did not load it; {advice}")
    return Finding(RecordFault(kind=FaultKind.WRONG_RESUME, attempt=live.number,
                               ranks=tuple(r.rank for r in early), nodes=(), step=first, summary=summary),
                   do_not_retry=True)


def resume_diverged(live: Attempt, obs: AttemptObs) -> Finding | None:
    """The reference trainer's steps are deterministic: the first step after a resume must
    have the loss an earlier attempt reported for it. Another loss means the checkpoint
    does not hold what was saved (a weight changed in storage, yet it loads): it is never
    resumed from again, and the run goes back to an older one."""
    if obs.expected_first is None:
        return None
    step, loss = obs.expected_first
    got = next((x for x in obs.recent if x.step == step), None)
    if got is None or got.loss == loss:
        return None
    at = live.resume_step
    summary = (f"resume diverged: step {step} after resuming from step {at} has loss {got.loss!r}, where the "
               f"run had {loss!r} before: the checkpoint of step {at} does not hold what was saved; resuming "
               f"from an older one")
    return Finding(RecordFault(kind=FaultKind.CHECKPOINT, attempt=live.number, ranks=(), nodes=(),
                               step=live.resume_step, summary=summary))
