"""A trainer the daemon does not hear, and a resumed attempt's first loss: the rules observe
used to hold (supervisor/policy/quiet.py, supervisor/policy/resumes.py)."""

from __future__ import annotations

import math

import pytest

from supervisor.domain import ProcState, TrainerResult
from supervisor.policy.quiet import command_result, progress_at
from supervisor.policy.resumes import expected_first
from tests.unit.policy_world import attempt, rank


def test_until_its_lines_are_understood_any_output_is_a_sign_of_life_then_only_progress_lines() -> None:
    # warnings printed at 90 while the last step line was at 40: a hang once lines are understood
    assert progress_at(30.0, output_understood=True, progress_line_at=40.0, output_at=90.0) == 40.0
    assert progress_at(30.0, output_understood=False, progress_line_at=None, output_at=90.0) == 90.0
    # a new checkpoint is progress either way
    assert progress_at(95.0, output_understood=True, progress_line_at=40.0, output_at=None) == 95.0
    assert progress_at(None, output_understood=False, progress_line_at=None, output_at=None) is None


def test_a_command_trainer_succeeds_when_every_rank_exited_0() -> None:
    done = [rank(i, ProcState.EXITED, exit_code=0, last_step=s) for i, s in enumerate((97, 100))]
    assert command_result(done, resume_step=60, steps=100) == TrainerResult(final_step=100, model_digest=None)
    # its spec's steps said less than it ran: the furthest step seen
    assert command_result(done, resume_step=60, steps=80) == TrainerResult(final_step=100, model_digest=None)
    assert command_result([*done[:1], rank(1, ProcState.EXITED, exit_code=1)], resume_step=0, steps=100) is None
    assert command_result([*done[:1], rank(1, ProcState.RUNNING)], resume_step=0, steps=100) is None
    assert command_result([*done[:1], rank(1, ProcState.VANISHED)], resume_step=0, steps=100) is None


RESUMED = attempt(2, resume_from="/ck/step_00000040", resume_step=40, nodes=("n1", "n2"))


def test_a_resumed_reference_trainer_must_repeat_the_loss_reported_for_its_first_step() -> None:
    assert expected_first(RESUMED, reference_trainer=True, data_skipped=False, reported=(1, 2.5),
                          nodes_of={1: 2, 2: 2}) == (41, 2.5)


@pytest.mark.parametrize(("live", "reference", "skipped", "reported", "nodes_of"), [
    (RESUMED, False, False, (1, 2.5), {1: 2}),  # another trainer: its steps may not be deterministic
    (attempt(2, resume_from=None), True, False, (1, 2.5), {1: 2}),  # a fresh start
    (RESUMED, True, True, (1, 2.5), {1: 2}),  # data was skipped: the step's batch changed
    (RESUMED, True, False, None, {1: 2}),  # no attempt reached the step
    (RESUMED, True, False, (1, None), {1: 2}),
    (RESUMED, True, False, (1, math.nan), {1: 2}),
    (RESUMED, True, False, (1, 2.5), {1: 3}),  # on another number of nodes: equal only up to rounding
])
def test_the_first_loss_is_not_checked_where_it_need_not_repeat(live: object, reference: bool, skipped: bool,
                                                                 reported: tuple[int, float | None] | None,
                                                                 nodes_of: dict[int, int]) -> None:
    assert expected_first(live, reference_trainer=reference, data_skipped=skipped,  # type: ignore[arg-type]
                          reported=reported, nodes_of=nodes_of) is None
