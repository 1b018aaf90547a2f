"""Operators' commands: cancel, pause, resume, restart (supervisor/policy/commands.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.domain import (
    AllocateNodes,
    AttemptOutcome,
    AttemptState,
    CheckpointRef,
    CommandHandled,
    CommandKind,
    EndAttempt,
    FinishRun,
    NodeState,
    ProcState,
    RecordFault,
    ReleaseNodes,
    ResumeRun,
    RunState,
    SetRunState,
    StartAttempt,
    StopAttempt,
)
from supervisor.policy import decide
from tests.unit.policy_world import NOW, attempt, cmd, nodes, obs, of, rank, run, view


def test_cancel_stops_the_attempt_gracefully_and_ends_the_run() -> None:
    effects = decide(view(run(), (attempt(),), commands=(cmd(CommandKind.CANCEL),)), obs(), NOW)
    assert CommandHandled(command_id=3, result="accepted") in effects
    assert of(effects, FinishRun)[0].state is RunState.CANCELLED
    [stop] = of(effects, StopAttempt)
    assert not stop.force and stop.outcome is AttemptOutcome.STOPPED
    assert not of(effects, RecordFault), "a cancelled attempt is not judged"


def test_cancelled_run_is_never_restarted() -> None:
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.STOPPED)
    effects = decide(view(run(RunState.CANCELLED), (prev,)), None, NOW)
    assert not of(effects, StartAttempt)


def test_resume_of_a_running_run_is_rejected() -> None:
    effects = decide(view(run(), (attempt(),), commands=(cmd(CommandKind.RESUME),)), obs(), NOW)
    [handled] = of(effects, CommandHandled)
    assert handled.result.startswith("rejected: run is already RUNNING")


@pytest.mark.parametrize("state", [RunState.PAUSED, RunState.FAILED])
def test_resume_of_a_paused_or_failed_run_relaunches_from_the_checkpoint(state: RunState) -> None:
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.STOPPED)
    effects = decide(view(run(state), (prev,), ck=CheckpointRef(step=60, path="/c60"),
                          commands=(cmd(CommandKind.RESUME),)), None, NOW)
    assert ResumeRun(reason="resumed by operator") in effects
    assert of(effects, StartAttempt)[0].resume_step == 60


def test_resume_of_a_cancelled_run_is_rejected() -> None:
    effects = decide(view(run(RunState.CANCELLED), commands=(cmd(CommandKind.RESUME),)), None, NOW)
    assert of(effects, CommandHandled)[0].result.startswith("rejected: run is CANCELLED")
    assert not of(effects, StartAttempt)


def test_pause_stops_the_attempt_and_does_not_relaunch() -> None:
    effects = decide(view(run(), (attempt(),), commands=(cmd(CommandKind.PAUSE),)), obs(), NOW)
    assert of(effects, SetRunState)[0].state is RunState.PAUSED
    assert of(effects, StopAttempt)
    assert not of(effects, StartAttempt)


def test_a_paused_run_gives_its_nodes_back_after_pause_release_s_and_keeps_its_job() -> None:
    """Idle since its last attempt ended: held until the grace is up, then its nodes given
    back with its job parked (Slurm: requeued and held, its id kept); a resume then asks
    for nodes, which the parked job gets."""
    r = run(RunState.PAUSED, policy=replace(run().policy, pause_release_s=300), allocation_info='{"job": "12"}')
    ended = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.STOPPED, ended_at=NOW)
    assert not of(decide(view(r, (ended,)), None, NOW + 299), ReleaseNodes)
    effects = decide(view(r, (ended,)), None, NOW + 300)
    assert of(effects, ReleaseNodes) == [ReleaseNodes(park=True)] and not of(effects, StartAttempt | AllocateNodes)
    stopping = attempt(state=AttemptState.STOPPING, outcome=AttemptOutcome.STOPPED, stop_requested_at=NOW)
    assert not of(decide(view(r, (stopping,)), obs(), NOW + 1000), ReleaseNodes), "not while it stops"
    parked = replace(r, allocation_info=None, parked_allocation='{"job": "12"}')
    assert decide(view(parked, (ended,), alloc=()), None, NOW + 400) == [], "parked once, not every tick"
    resumed = decide(view(parked, (ended,), alloc=(), commands=(cmd(CommandKind.RESUME),)), None, NOW + 400)
    assert of(resumed, ResumeRun) and of(resumed, AllocateNodes)


def test_a_failed_run_parks_its_job_and_a_cancelled_or_finished_one_gives_a_parked_job_up() -> None:
    """A failed run may be resumed once its cause is fixed: it goes on in the same job."""
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED)
    assert decide(view(run(RunState.FAILED), (prev,)), None, NOW) == [ReleaseNodes(park=True)]
    parked = '{"job": "12"}'
    assert decide(view(run(RunState.FAILED, parked_allocation=parked), (prev,), alloc=()), None, NOW) == []
    for over in (RunState.CANCELLED, RunState.SUCCEEDED):
        assert decide(view(run(over, parked_allocation=parked), (prev,), alloc=()), None, NOW) == [ReleaseNodes()]


def test_restart_stops_the_live_attempt_gracefully_and_the_next_starts_from_the_newest_checkpoint() -> None:
    ck = CheckpointRef(step=60, path="/c60")
    effects = decide(view(run(), (attempt(),), ck=ck, commands=(cmd(CommandKind.RESTART),)), obs(), NOW)
    assert CommandHandled(command_id=3, result="accepted") in effects
    assert SetRunState(state=RunState.RECOVERING, reason="restarted by operator") in effects
    [stop] = of(effects, StopAttempt)
    assert (stop.force, stop.outcome, stop.reason) == (False, AttemptOutcome.STOPPED, "restarted by operator")
    assert not of(effects, StartAttempt), "not before the attempt is gone"
    # once its processes are gone: ended as STOPPED, and the next attempt starts at once
    stopping = attempt(state=AttemptState.STOPPING, outcome=AttemptOutcome.STOPPED, reason="restarted by operator",
                       stop_requested_at=NOW)
    gone = obs(*(rank(i, ProcState.EXITED, exit_code=0) for i in range(4)))
    effects = decide(view(run(RunState.RECOVERING), (stopping,), ck=ck), gone, NOW + 2)
    assert of(effects, EndAttempt)[0].outcome is AttemptOutcome.STOPPED
    [start] = of(effects, StartAttempt)
    assert (start.number, start.resume_step) == (2, 60)


def test_an_operator_restart_costs_no_budget() -> None:
    """Two failures without progress and any number of operator restarts still launch."""
    failed = tuple(attempt(n, AttemptState.ENDED, outcome=AttemptOutcome.FAILED, ended_at=NOW - 1000)
                   for n in (1, 2))
    restarted = tuple(attempt(n, AttemptState.ENDED, outcome=AttemptOutcome.STOPPED) for n in (4, 5, 6, 7))
    effects = decide(view(run(RunState.RECOVERING), failed + restarted), None, NOW)
    assert of(effects, StartAttempt) and not of(effects, FinishRun)


@pytest.mark.parametrize(("state", "live", "why"), [
    (RunState.PAUSED, False, "rejected: run is PAUSED; resume it instead"),
    (RunState.FAILED, False, "rejected: run is FAILED; resume it instead"),
    (RunState.SUCCEEDED, False, "rejected: run is SUCCEEDED; submit it again as a new run"),
    (RunState.CANCELLED, False, "rejected: run is CANCELLED; submit it again as a new run"),
    (RunState.PENDING, False, "rejected: no attempt is running (run is PENDING)"),
])
def test_restart_without_a_live_attempt_is_rejected(state: RunState, live: bool, why: str) -> None:
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.STOPPED)
    effects = decide(view(run(state), (prev,), commands=(cmd(CommandKind.RESTART),)), None, NOW)
    assert of(effects, CommandHandled)[0].result.startswith(why)
    assert not of(effects, StopAttempt)


def test_terminal_run_gives_its_healthy_nodes_back() -> None:
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.SUCCEEDED)
    assert decide(view(run(RunState.SUCCEEDED), (prev,)), None, NOW) == [ReleaseNodes()]
    released = nodes(NodeState.IDLE, NodeState.DRAINED)
    assert decide(view(run(RunState.SUCCEEDED), (prev,), released), None, NOW) == []
