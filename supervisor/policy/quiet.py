"""A trainer the daemon does not hear (a [command] trainer, or ranks that cannot reach the
broker): what counts as its progress, and as its success (pure).

Progress is a new complete checkpoint (a step), and its output: once the output's lines
are understood (steps, a compile phase: supervisor/gathering/output_progress.py), only its progress
lines count, so that a hung job printing warnings is still a hang; until then any new
output is a sign of life. A [command] trainer writes no result file: every rank exiting 0
is its success.
"""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.domain import ProcState, RankObs, TrainerResult


def progress_at(checkpoint_seen_at: float | None, *, output_understood: bool, progress_line_at: float | None,
                output_at: float | None) -> float | None:
    """When progress was last seen: the newest checkpoint's arrival, and the output's
    progress lines (``output_understood``) or any of its output."""
    said = progress_line_at if output_understood else output_at
    known = [t for t in (checkpoint_seen_at, said) if t is not None]
    return max(known) if known else None


def command_result(ranks: Sequence[RankObs], resume_step: int, steps: int) -> TrainerResult | None:
    """A [command] trainer's result once every rank exited 0: the spec's steps, or the
    furthest step seen if further; None while any rank runs or after any failed."""
    if not all(r.proc is ProcState.EXITED and r.exit_code == 0 for r in ranks):
        return None
    final = max([resume_step, *(r.last_step for r in ranks)])
    return TrainerResult(final_step=max(final, steps), model_digest=None)
