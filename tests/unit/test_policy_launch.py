"""Launching a run's attempts, judging progress and success, and stopping an attempt (supervisor/policy/lifecycle.py, recovery.py)."""

from __future__ import annotations

from dataclasses import replace

from supervisor.domain import (
    AllocateNodes,
    Attempt,
    AttemptOutcome,
    AttemptState,
    CheckpointRef,
    DrainNode,
    EndAttempt,
    EnsureStopped,
    FaultKind,
    FinishRun,
    MarkAttemptRunning,
    MarkFaultsRecovered,
    Node,
    NodeState,
    ProbeNodes,
    ProcState,
    RecordFault,
    ReleaseNodes,
    RunState,
    RunView,
    SetRunState,
    StartAttempt,
    TrainerResult,
)
from supervisor.policy import decide
from tests.unit.policy_world import NOW, attempt, nodes, obs, of, rank, run, view


def test_pending_run_without_nodes_asks_for_nodes_and_spares() -> None:
    effects = decide(view(run(RunState.PENDING), alloc=()), None, NOW)
    assert of(effects, AllocateNodes) == [AllocateNodes(count=3)]
    assert not of(effects, StartAttempt)


def test_pending_run_with_nodes_starts_first_attempt_from_scratch() -> None:
    effects = decide(view(run(RunState.PENDING)), None, NOW)
    [start] = of(effects, StartAttempt)
    assert start == StartAttempt(number=1, nodes=("n1", "n2"), resume_from=None, resume_step=0)
    assert of(effects, SetRunState)[0].state is RunState.STARTING


def test_relaunch_resumes_from_newest_checkpoint_keeping_healthy_nodes_in_place() -> None:
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED, nodes=("n2", "n3"))
    alloc = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.DRAINED)
    ck = CheckpointRef(step=40, path="/ck/step_00000040")
    [start] = of(decide(view(run(RunState.RECOVERING), (prev,), alloc, ck), None, NOW), StartAttempt)
    assert start.nodes == ("n2", "n1")  # n2 keeps its place, the spare n1 replaces drained n3
    assert (start.number, start.resume_from, start.resume_step) == (2, "/ck/step_00000040", 40)


def test_too_few_healthy_nodes_asks_for_more_instead_of_launching() -> None:
    alloc = nodes(NodeState.ALLOCATED, NodeState.DRAINED, NodeState.DRAINED)
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED)
    effects = decide(view(run(RunState.RECOVERING), (prev,), alloc), None, NOW)
    assert of(effects, AllocateNodes) == [AllocateNodes(count=2)]
    assert not of(effects, StartAttempt)


def test_aborted_and_interrupted_attempts_cost_nothing() -> None:
    """Three failures without progress would stop the run; those that never ran or whose
    allocation the cluster ended are passed over, neither counted nor breaking the run."""
    history = tuple(attempt(i, AttemptState.ENDED, outcome=outcome, ended_at=NOW - 1000)
                    for i, outcome in enumerate((AttemptOutcome.FAILED, AttemptOutcome.ABORTED,
                                                 AttemptOutcome.INTERRUPTED, AttemptOutcome.FAILED), 1))
    assert of(decide(view(run(RunState.RECOVERING), history), None, NOW), StartAttempt)
    third = attempt(5, AttemptState.ENDED, outcome=AttemptOutcome.FAILED, ended_at=NOW - 1000)
    [finish] = of(decide(view(run(RunState.RECOVERING), (*history, third)), None, NOW), FinishRun)
    assert finish.reason.startswith("no progress: 3 failed attempts in a row (attempts 1, 4, 5")


def test_an_operator_stop_ends_a_run_of_failures() -> None:
    history = tuple(attempt(i, AttemptState.ENDED, ended_at=NOW - 1000,
                            outcome=AttemptOutcome.STOPPED if i == 3 else AttemptOutcome.FAILED)
                    for i in range(1, 6))
    assert of(decide(view(run(RunState.RECOVERING), history), None, NOW), StartAttempt)


def test_budget_counts_only_failures_after_the_last_resume() -> None:
    failed = tuple(attempt(i, AttemptState.ENDED, outcome=AttemptOutcome.FAILED, ended_at=NOW - 1000)
                   for i in range(1, 5))
    assert of(decide(view(run(RunState.RECOVERING), failed), None, NOW), FinishRun)
    r = run(RunState.PENDING, budget_from_attempt=4)
    assert of(decide(view(r, failed), None, NOW), StartAttempt)


def test_first_step_after_launch_marks_running_and_recovers_faults() -> None:
    live = attempt(first_step_at=None, resume_step=40)
    effects = decide(view(run(RunState.RECOVERING), (live,), open_faults=1),
                     obs(*(rank(i, last_step=41) for i in range(4))), NOW)
    assert MarkAttemptRunning(number=1) in effects
    assert MarkFaultsRecovered() in effects
    assert of(effects, SetRunState)[0].state is RunState.RUNNING


def test_no_step_beyond_the_resume_point_is_not_progress() -> None:
    live = attempt(first_step_at=None, resume_step=40)
    effects = decide(view(run(RunState.STARTING), (live,)),
                     obs(*(rank(i, last_step=40) for i in range(4))), NOW)
    assert effects == []


def test_result_and_all_ranks_exited_is_success() -> None:
    o = obs(*(rank(i, ProcState.EXITED, exit_code=0) for i in range(4)),
            result=TrainerResult(final_step=100, model_digest="sha256:ab"))
    effects = decide(view(run(), (attempt(),)), o, NOW)
    [finish] = of(effects, FinishRun)
    assert (finish.state, finish.final_step, finish.model_digest) == (RunState.SUCCEEDED, 100, "sha256:ab")
    assert of(effects, EndAttempt)[0].outcome is AttemptOutcome.SUCCEEDED
    assert ReleaseNodes() in effects


def test_a_trainer_that_finished_after_its_loss_went_nan_is_rolled_back_not_succeeded() -> None:
    """One tick may see the NaN and the trainer's end together (a fast trainer on a busy
    host): the NaN is judged as at any other tick."""
    o = obs(*(rank(i, ProcState.EXITED, exit_code=0, nonfinite_step=30 if i == 0 else None) for i in range(4)),
            result=TrainerResult(final_step=100, model_digest="sha256:ab"))
    effects = decide(view(run(), (attempt(),)), o, NOW)
    assert not of(effects, FinishRun)
    [fault] = of(effects, RecordFault)
    assert (fault.kind, fault.step) == (FaultKind.NONFINITE, 30)
    assert of(effects, SetRunState)[0].state is RunState.RECOVERING


def test_an_attempt_that_finished_before_a_step_of_it_was_seen_recovers_the_open_faults() -> None:
    """A resumed attempt with a short stretch left may finish within a tick or two, on a
    busy host before any step of it is seen: its success is its recovery."""
    o = obs(*(rank(i, ProcState.EXITED, exit_code=0) for i in range(4)),
            result=TrainerResult(final_step=80, model_digest="sha256:ab"))
    live = attempt(first_step_at=None, resume_step=70)
    effects = decide(view(run(RunState.RECOVERING), (live,), open_faults=1), o, NOW)
    assert MarkFaultsRecovered() in effects and of(effects, FinishRun)[0].state is RunState.SUCCEEDED
    assert MarkFaultsRecovered() not in decide(view(run(RunState.RECOVERING), (live,)), o, NOW)


def test_result_while_a_rank_still_runs_waits() -> None:
    ranks = [rank(i, ProcState.EXITED, exit_code=0) for i in range(3)] + [rank(3)]
    o = obs(*ranks, result=TrainerResult(final_step=100, model_digest="x"))
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_all_ranks_exit_zero_without_result_is_a_fault() -> None:
    o = obs(*(rank(i, ProcState.EXITED, exit_code=0) for i in range(4)))
    [fault] = of(decide(view(run(), (attempt(),)), o, NOW), RecordFault)
    assert fault.kind is FaultKind.NO_RESULT


def test_stopping_attempt_is_ended_once_every_process_is_gone_then_relaunched() -> None:
    live = attempt(state=AttemptState.STOPPING, stop_requested_at=NOW - 1, outcome=AttemptOutcome.FAILED)
    o = obs(*(rank(i, ProcState.EXITED, exit_code=-9) for i in range(4)))
    effects = decide(view(run(RunState.RECOVERING), (live,), ck=CheckpointRef(step=40, path="/c")), o, NOW)
    [end] = of(effects, EndAttempt)
    assert end.outcome is AttemptOutcome.FAILED
    assert of(effects, StartAttempt)[0].resume_step == 40


def test_with_diagnose_a_failed_attempts_held_nodes_are_probed_before_any_relaunch() -> None:
    live = attempt(state=AttemptState.STOPPING, stop_requested_at=NOW - 1, outcome=AttemptOutcome.FAILED)
    o = obs(*(rank(i, ProcState.EXITED, exit_code=-9) for i in range(4)))
    v = replace(view(run(RunState.RECOVERING), (live,), ck=CheckpointRef(step=40, path="/c")), diagnose=True)
    effects = decide(v, o, NOW)
    assert of(effects, EndAttempt)
    assert of(effects, ProbeNodes) == [ProbeNodes(nodes=("n1", "n2"), kind="diagnosis")]
    assert not of(effects, StartAttempt)


def test_a_spare_not_probed_for_a_while_is_probed_while_the_run_trains_without_the_link_test() -> None:
    """With preflight, a spare whose newest probe is older than spare_probe_every_s (or
    that was never probed) is probed while idle: it joins proven after a fault."""
    every = 1800.0
    base = replace(view(run(), (attempt(),)), preflight=True, spare_probe_every_s=every)

    def asked(v: RunView, live: Attempt | None = None) -> list[ProbeNodes]:
        return of(decide(replace(v, attempts=(live or attempt(),)), obs(), NOW), ProbeNodes)

    assert asked(replace(base, spares_probed_at=(("n3", None), ("n4", NOW - every), ("n5", NOW - 60)))) == [
        ProbeNodes(nodes=("n3", "n4"), kind="spare")]
    fresh = replace(base, spares_probed_at=(("n3", NOW - 60),))
    assert asked(fresh) == []
    never = replace(base, spares_probed_at=(("n3", None),))
    assert asked(replace(never, probing=True)) == [], "one round at a time"
    assert asked(replace(never, preflight=False)) == []
    assert asked(replace(never, spare_probe_every_s=0.0)) == []
    assert asked(never, attempt(state=AttemptState.LAUNCHING, first_step_at=None)) == [], "only while it trains"


def test_a_node_drained_in_the_same_tick_or_no_longer_held_is_not_diagnosed() -> None:
    live = attempt(state=AttemptState.STOPPING, stop_requested_at=NOW - 1, outcome=AttemptOutcome.FAILED,
                   nodes=("n1", "n2"))
    alloc = (Node(name="n1", state=NodeState.IDLE), *nodes(NodeState.ALLOCATED, NodeState.ALLOCATED)[1:])
    o = obs(*(rank(i, ProcState.EXITED, exit_code=-9) for i in range(4)))
    v = replace(view(run(RunState.RECOVERING), (live,), alloc), diagnose=True)
    assert of(decide(v, o, NOW), ProbeNodes) == [ProbeNodes(nodes=("n2",), kind="diagnosis")]


def test_a_run_whose_nodes_are_being_probed_launches_nothing_until_they_answer() -> None:
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED)
    v = view(run(RunState.RECOVERING), (prev,))
    assert of(decide(v, None, NOW), StartAttempt)
    assert decide(replace(v, probing=True), None, NOW) == []
    assert decide(replace(view(run(RunState.PENDING), alloc=()), probing=True), None, NOW) == []


def test_an_operator_stop_escalates_from_sigterm_to_sigkill_after_the_grace() -> None:
    live = attempt(state=AttemptState.STOPPING, stop_requested_at=NOW - 5, outcome=AttemptOutcome.STOPPED)
    assert decide(view(run(RunState.PAUSED), (live,)), obs(), NOW) == []  # SIGTERM was sent; wait
    live = replace(live, stop_requested_at=NOW - 11)
    assert decide(view(run(RunState.PAUSED), (live,)), obs(), NOW) == [EnsureStopped(number=1, force=True)]


def test_a_fault_stop_keeps_sending_sigkill_while_processes_live() -> None:
    live = attempt(state=AttemptState.STOPPING, stop_requested_at=NOW - 1, outcome=AttemptOutcome.FAILED)
    assert decide(view(run(RunState.RECOVERING), (live,)), obs(), NOW) == [EnsureStopped(number=1, force=True)]


def test_processes_that_outlive_sigkill_are_abandoned_and_their_node_drained() -> None:
    live = attempt(state=AttemptState.STOPPING, stop_requested_at=NOW - 131, outcome=AttemptOutcome.FAILED)
    stuck = obs(rank(0, ProcState.EXITED, exit_code=-9), rank(1, ProcState.EXITED, exit_code=-9),
                rank(2, ProcState.EXITED, exit_code=-9), rank(3, ProcState.UNKNOWN))
    effects = decide(view(run(RunState.RECOVERING), (live,)), stuck, NOW)
    assert [d.node for d in of(effects, DrainNode)] == ["n2"]
    assert "survived SIGKILL" in of(effects, DrainNode)[0].reason
    assert of(effects, EndAttempt)[0].outcome is AttemptOutcome.FAILED
    assert of(effects, StartAttempt)[0].nodes == ("n1", "n3"), "the run goes on without the stuck node"


def test_the_next_attempt_carries_the_auto_intervals_the_core_set_from_what_the_run_measured() -> None:
    """Young/Daly is the core's (policy/trainer_inputs.py): the effects write the numbers."""
    from supervisor.domain import AttemptStats, Emit, Measured
    from supervisor.domain.events import EventKind

    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED)
    r = run(RunState.RECOVERING, total_steps=10_000, policy=replace(run().policy, failures_per_node_day=50))
    before = replace(view(r, (prev,)), auto_tiers=("persistent", "memory"))
    [start] = of(decide(before, None, NOW), StartAttempt)
    assert (start.every_steps, start.memory_every_steps) == (50, 10), "nothing measured: the first intervals"
    # 30 steps of 0.1 s (the first one left out), a persistent save of 0.5 s, memory saves of 0.02 s.
    stats = AttemptStats(attempt=1, steps=30, step_time_s=3.0, first_step_time_s=0.1, checkpoints=1,
                         checkpoint_s=0.5)
    measured = replace(before, measured=Measured(stats=(stats,), memory_saves_s=(0.02, 0.02)))
    effects = decide(measured, None, NOW)
    [start] = of(effects, StartAttempt)
    # 2 nodes at 50 failures a node-day: MTBF 864 s; sqrt(2 x 0.5 s x 864 s) = 29.4 s = 294 steps of 0.1 s
    assert start.every_steps == 294 and start.memory_every_steps is not None and start.memory_every_steps < 294
    said = [e.message for e in of(effects, Emit) if e.kind is EventKind.CHECKPOINT_INTERVAL]
    assert said[0].startswith("checkpoint every 294 steps: Young/Daly") and said[1].startswith("memory checkpoint")
    assert start.skip_to_step is None, "a trainer that reads by samples is told its windows, not a step"
    [start] = of(decide(view(r, (prev,)), None, NOW), StartAttempt)
    assert (start.every_steps, start.memory_every_steps) == (None, None), "a spec's own intervals stand"


def test_a_command_resumed_before_a_skip_window_is_told_its_data_step_and_the_window_widens() -> None:
    from supervisor.domain import Emit
    from supervisor.domain.events import EventKind

    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED)
    ck = CheckpointRef(step=20, path="/ck/step_00000020")
    v = replace(view(run(RunState.RECOVERING), (prev,), ck=ck), data_skip_unit="steps", data_skips=((30, 80),))
    effects = decide(v, None, NOW)
    [start] = of(effects, StartAttempt)
    assert (start.resume_step, start.skip_to_step, start.widen_skip) == (20, 80, (30, 21))
    [said] = [e for e in of(effects, Emit) if e.kind is EventKind.DATA_SKIP]
    assert said.data == {"attempt": 2, "skip_to_step": 80, "start": 21, "end": 80, "unit": "steps"}
    # A trainer that reads its data by samples is told the windows instead (its config).
    [start] = of(decide(replace(v, data_skip_unit="samples"), None, NOW), StartAttempt)
    assert (start.skip_to_step, start.widen_skip) == (None, None)
