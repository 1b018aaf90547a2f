"""The decision rules (supervisor/policy/), one behaviour per test, with plain values."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from supervisor.domain import (
    AllocateNodes,
    Attempt,
    AttemptObs,
    AttemptOutcome,
    AttemptState,
    CheckpointRef,
    Command,
    CommandHandled,
    CommandKind,
    DrainNode,
    Emit,
    EndAttempt,
    EnsureStopped,
    EventKind,
    FaultKind,
    FaultRecord,
    FinishRun,
    MarkAttemptRunning,
    MarkFaultsRecovered,
    Node,
    NodeState,
    Policy,
    ProbeNodes,
    ProcState,
    RankObs,
    RecordFault,
    ReleaseNodes,
    ResumeRun,
    Run,
    RunState,
    RunView,
    SetRunState,
    SkipData,
    StartAttempt,
    StepSample,
    StopAttempt,
    TrainerResult,
)
from supervisor.policy import decide

NOW = 1_000.0
SIGKILL = -int(signal.SIGKILL)


def run(state: RunState = RunState.RUNNING, **kw: object) -> Run:
    base = Run(number=7, name="t", state=state, reason="", nodes=2, ranks_per_node=2, spares=1,
               total_steps=100, policy=Policy(failures_without_progress=3, hang_timeout_s=60, startup_timeout_s=300,
                                              stop_grace_s=10),
               created_at=0.0)
    return replace(base, **kw)  # type: ignore[arg-type]


def attempt(number: int = 1, state: AttemptState = AttemptState.RUNNING, **kw: object) -> Attempt:
    base = Attempt(run_number=7, number=number, state=state, nodes=("n1", "n2"), resume_from=None,
                   resume_step=0, created_at=10.0, started_at=10.0, first_step_at=20.0,
                   launch_info="{}")
    return replace(base, **kw)  # type: ignore[arg-type]


def nodes(*states: NodeState) -> tuple[Node, ...]:
    return tuple(Node(name=f"n{i + 1}", state=s, run_number=7) for i, s in enumerate(states))


HEALTHY3 = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.ALLOCATED)


def view(r: Run, attempts: tuple[Attempt, ...] = (), alloc: tuple[Node, ...] = HEALTHY3,
         ck: CheckpointRef | None = None, commands: tuple[Command, ...] = (), open_faults: int = 0) -> RunView:
    return RunView(run=r, attempts=attempts, allocation=alloc, newest_checkpoint=ck, commands=commands,
                   open_faults=open_faults)


def rank(r: int, proc: ProcState = ProcState.RUNNING, **kw: object) -> RankObs:
    base = RankObs(rank=r, node="n1" if r < 2 else "n2", proc=proc, last_step=50, progress_at=NOW - 1)
    if proc in (ProcState.EXITED, ProcState.VANISHED) or kw.get("lost"):
        base = replace(base, dead_since=NOW - 5)  # seen dead long enough to be judged
    return replace(base, **kw)  # type: ignore[arg-type]


def obs(*ranks: RankObs, **kw: object) -> AttemptObs:
    kw.setdefault("telemetry_up_since", 0.0)
    return AttemptObs(ranks=ranks or tuple(rank(i) for i in range(4)), **kw)  # type: ignore[arg-type]


def of(effects: list[object], cls: type) -> list:  # type: ignore[type-arg]
    return [e for e in effects if isinstance(e, cls)]


# --- launching ----------------------------------------------------------------------


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


# --- progress and success -----------------------------------------------------------


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


def test_result_while_a_rank_still_runs_waits() -> None:
    ranks = [rank(i, ProcState.EXITED, exit_code=0) for i in range(3)] + [rank(3)]
    o = obs(*ranks, result=TrainerResult(final_step=100, model_digest="x"))
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_all_ranks_exit_zero_without_result_is_a_fault() -> None:
    o = obs(*(rank(i, ProcState.EXITED, exit_code=0) for i in range(4)))
    [fault] = of(decide(view(run(), (attempt(),)), o, NOW), RecordFault)
    assert fault.kind is FaultKind.NO_RESULT


# --- faults and attribution ---------------------------------------------------------


def test_sigkilled_rank_is_blamed_not_the_ranks_that_died_after_it() -> None:
    ranks = [rank(0), rank(1, ProcState.EXITED, exit_code=1, reported_exit_code=1, reported_exit_at=NOW),
             rank(2, ProcState.EXITED, exit_code=1), rank(3, ProcState.EXITED, exit_code=SIGKILL)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT
    assert fault.ranks == (3,) and fault.nodes == ("n2",)
    assert "rank 3 (node n2) killed by SIGKILL" in fault.summary
    assert not of(effects, DrainNode), "one rank's death never drains its node"
    [stop] = of(effects, StopAttempt)
    assert stop.force and stop.outcome is AttemptOutcome.FAILED
    assert of(effects, SetRunState)[0].state is RunState.RECOVERING
    assert not of(effects, StartAttempt), "no relaunch until the old attempt is gone"


def test_every_rank_of_a_node_sigkilled_is_node_lost_and_drains_only_that_node() -> None:
    ranks = [rank(0, ProcState.EXITED, exit_code=1), rank(1),
             rank(2, ProcState.EXITED, exit_code=SIGKILL), rank(3, ProcState.EXITED, exit_code=SIGKILL)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",) and fault.ranks == (2, 3)
    assert fault.summary.endswith("(ranks 2, 3), and 2 of its processes vanished together: node lost")
    [drain] = of(effects, DrainNode)
    assert drain.node == "n2"
    assert drain.reason.startswith("training-supervisor: node lost") and "run-7" in drain.reason


def test_a_fresh_death_waits_for_the_settle_window_so_a_dying_node_is_seen_whole() -> None:
    # rank 3 was reaped first; rank 2 of the same node is still being torn down
    ranks = [rank(0), rank(1), rank(2), rank(3, ProcState.EXITED, exit_code=SIGKILL, dead_since=NOW - 0.5)]
    assert decide(view(run(), (attempt(),)), obs(*ranks), NOW) == []
    later = [rank(0), rank(1), rank(2, ProcState.EXITED, exit_code=SIGKILL, dead_since=NOW + 0.2),
             rank(3, ProcState.EXITED, exit_code=SIGKILL, dead_since=NOW - 0.5)]
    [fault] = of(decide(view(run(), (attempt(),)), obs(*later), NOW + 0.6), RecordFault)
    assert fault.kind is FaultKind.NODE_LOST


def test_when_every_rank_is_gone_the_fault_is_judged_at_once() -> None:
    ranks = [rank(0, ProcState.EXITED, exit_code=1, dead_since=NOW), rank(1, ProcState.EXITED, exit_code=1,
             dead_since=NOW), rank(2, ProcState.EXITED, exit_code=1, dead_since=NOW),
             rank(3, ProcState.EXITED, exit_code=SIGKILL, dead_since=NOW)]
    [fault] = of(decide(view(run(), (attempt(),)), obs(*ranks), NOW), RecordFault)
    assert fault.ranks == (3,)


def test_sigabrt_of_a_whole_node_is_not_node_loss() -> None:
    ranks = [rank(0), rank(1), rank(2, ProcState.EXITED, exit_code=-6), rank(3, ProcState.EXITED, exit_code=-6)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    assert of(effects, RecordFault)[0].kind is FaultKind.RANK_EXIT
    assert not of(effects, DrainNode)


def test_adopted_ranks_whose_last_wills_arrived_together_are_node_lost() -> None:
    ranks = [rank(0), rank(1), rank(2, ProcState.VANISHED, lost=True), rank(3, ProcState.VANISHED, lost=True)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    assert of(effects, RecordFault)[0].kind is FaultKind.NODE_LOST


def one_rank_nodes(*ranks: RankObs) -> AttemptObs:
    """Nodes of one rank each: rank r on node n{r + 1}."""
    return obs(*(replace(r, node=f"n{r.rank + 1}", process=100 + r.rank) for r in ranks))


def test_the_only_rank_of_a_node_sigkilled_alone_is_its_own_fault_not_the_nodes() -> None:
    """One process killed is one process's fault: nothing says its node went with it."""
    effects = decide(view(run(ranks_per_node=1), (attempt(),)),
                     one_rank_nodes(rank(0), rank(1, ProcState.EXITED, exit_code=SIGKILL)), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT and fault.ranks == (1,) and fault.nodes == ("n2",)
    assert "killed by SIGKILL" in fault.summary
    assert not of(effects, DrainNode), "blamed (a lemon if it repeats), not drained"


def test_a_node_whose_own_process_lives_on_is_not_lost_whatever_its_ranks_did() -> None:
    ranks = [rank(0), rank(1), rank(2, ProcState.EXITED, exit_code=SIGKILL, node_up=True),
             rank(3, ProcState.EXITED, exit_code=SIGKILL, node_up=True)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    assert of(effects, RecordFault)[0].kind is FaultKind.RANK_EXIT and not of(effects, DrainNode)


def test_a_one_rank_node_whose_own_process_died_with_its_rank_is_lost_and_drained() -> None:
    effects = decide(view(run(ranks_per_node=1), (attempt(),)),
                     one_rank_nodes(rank(0, node_up=True), rank(1, ProcState.EXITED, exit_code=SIGKILL, node_up=False)),
                     NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",)
    assert "and the node's own process died with them: node lost" in fault.summary
    assert [d.node for d in of(effects, DrainNode)] == ["n2"]


def test_a_one_rank_node_the_cluster_took_out_of_the_allocation_is_lost() -> None:
    """Slurm dropped n2 from the allocation (its node failed) and keeps n1: its word."""
    alloc = (Node(name="n1", state=NodeState.ALLOCATED, run_number=7), Node(name="n2", state=NodeState.IDLE),
             Node(name="n3", state=NodeState.ALLOCATED, run_number=7))
    o = one_rank_nodes(rank(0), rank(1, ProcState.UNKNOWN, lost=True))
    effects = decide(view(run(ranks_per_node=1), (attempt(),), alloc), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",)
    assert "and the cluster took it out of the allocation: node lost" in fault.summary


def test_a_nodes_one_torchrun_killed_is_one_process_however_many_ranks_it_ran() -> None:
    """launch = "node": ranks 2 and 3 are one torchrun's; its SIGKILL is no node loss
    unless the node's own process went too."""
    ranks = [rank(0, process=1), rank(1, process=1), rank(2, ProcState.EXITED, exit_code=SIGKILL, process=2),
             rank(3, ProcState.EXITED, exit_code=SIGKILL, process=2)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    assert of(effects, RecordFault)[0].kind is FaultKind.RANK_EXIT and not of(effects, DrainNode)
    gone = [replace(r, node_up=False) if r.node == "n2" else r for r in ranks]
    assert of(decide(view(run(), (attempt(),)), obs(*gone), NOW), RecordFault)[0].kind is FaultKind.NODE_LOST


def heard(r: int, ago_s: float, proc: ProcState = ProcState.RUNNING) -> RankObs:
    return rank(r, proc, last_seen_at=NOW - ago_s)


def test_a_node_whose_every_rank_fell_silent_is_lost_and_drained() -> None:
    ranks = [heard(0, 0.5), heard(1, 0.5), heard(2, 12), heard(3, 11)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",) and fault.ranks == (2, 3)
    assert "silent for 11 s" in fault.summary
    [drain] = of(effects, DrainNode)
    assert drain.node == "n2" and drain.reason.startswith("training-supervisor: node silent")
    assert of(effects, StopAttempt)[0].force


def test_silence_below_the_limit_or_on_part_of_a_node_is_no_fault() -> None:
    assert decide(view(run(), (attempt(),)), obs(heard(0, 1), heard(1, 1), heard(2, 9), heard(3, 9)), NOW) == []
    # one silent rank of two on a node is a hang matter, not a lost node
    assert decide(view(run(), (attempt(),)), obs(heard(0, 1), heard(1, 1), heard(2, 1), heard(3, 30)), NOW) == []


def test_every_node_silent_is_the_broker_not_the_nodes() -> None:
    assert decide(view(run(), (attempt(),)), obs(*(heard(r, 30) for r in range(4))), NOW) == []


def test_silence_is_not_judged_until_the_link_has_been_up_for_the_limit() -> None:
    ranks = [heard(0, 0.5), heard(1, 0.5), heard(2, 30), heard(3, 30)]
    assert decide(view(run(), (attempt(),)), obs(*ranks, telemetry_up_since=NOW - 5), NOW) == []
    assert decide(view(run(), (attempt(),)), AttemptObs(ranks=tuple(ranks), telemetry_up_since=None), NOW) == []


def test_a_rank_slurm_cannot_see_is_dead_only_on_its_own_evidence() -> None:
    unknown = ProcState.UNKNOWN
    assert decide(view(run(), (attempt(),)), obs(*(rank(r, unknown) for r in range(4))), NOW) == []
    crashed = [rank(0, unknown), rank(1, unknown), rank(2, unknown),
               rank(3, unknown, reported_exit_code=1, reported_reason="CUDA error", dead_since=NOW - 5)]
    [fault] = of(decide(view(run(), (attempt(),)), obs(*crashed), NOW), RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT and fault.ranks == (3,) and "CUDA error" in fault.summary
    node = [rank(0, unknown), rank(1, unknown), rank(2, unknown, lost=True), rank(3, unknown, lost=True)]
    [lost] = of(decide(view(run(), (attempt(),)), obs(*node), NOW), RecordFault)
    assert lost.kind is FaultKind.NODE_LOST and lost.nodes == ("n2",)


def test_a_stopping_attempt_ends_when_ranks_slurm_cannot_see_have_reported_their_exits() -> None:
    stopping = attempt(state=AttemptState.STOPPING, stop_requested_at=NOW - 1, outcome=AttemptOutcome.FAILED,
                       reason="node lost")
    unknown = ProcState.UNKNOWN
    still = [rank(0, unknown), rank(1, unknown, reported_exit_code=1), rank(2, unknown, lost=True),
             rank(3, unknown, lost=True)]
    assert not of(decide(view(run(RunState.RECOVERING), (stopping,)), obs(*still), NOW), EndAttempt)
    done = [rank(0, unknown, reported_exit_code=1), *still[1:]]
    assert of(decide(view(run(RunState.RECOVERING), (stopping,)), obs(*done), NOW), EndAttempt)


def test_nodes_the_allocation_no_longer_holds_are_never_drained() -> None:
    """Slurm ended the allocation (preemption, time limit, scancel): every rank died,
    but no node is to blame."""
    ranks = [rank(r, ProcState.EXITED, exit_code=SIGKILL) for r in range(4)]
    released = nodes(NodeState.IDLE, NodeState.IDLE, NodeState.IDLE)
    effects = decide(view(run(), (attempt(),), alloc=released), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.ALLOCATION_ENDED
    assert "the cluster ended the allocation under the attempt" in fault.summary
    assert not of(effects, DrainNode)
    assert of(effects, SetRunState)[0].state is RunState.RECOVERING
    [stop] = of(effects, StopAttempt)
    assert stop.outcome is AttemptOutcome.INTERRUPTED, "the cluster's doing: no failure of the run"


def test_ranks_that_ended_unobserved_while_the_daemon_was_down_drain_nothing() -> None:
    ranks = [rank(i, ProcState.VANISHED) for i in range(4)]  # no exit report, no last will
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    assert of(effects, RecordFault)[0].kind is FaultKind.RANK_EXIT
    assert not of(effects, DrainNode)
    assert of(effects, SetRunState)[0].state is RunState.RECOVERING


def test_adopted_rank_that_reported_a_clean_exit_is_not_dead() -> None:
    ranks = [rank(0, ProcState.VANISHED, reported_exit_code=0), rank(1), rank(2), rank(3)]
    assert decide(view(run(), (attempt(),)), obs(*ranks), NOW) == []


def test_earliest_self_reported_exit_is_blamed_when_nothing_was_killed() -> None:
    ranks = [rank(0, ProcState.EXITED, exit_code=1, reported_exit_code=1, reported_exit_at=NOW - 1,
                  reported_reason="RuntimeError: Connection closed by peer"),
             rank(1, ProcState.EXITED, exit_code=1, reported_exit_code=1, reported_exit_at=NOW - 3,
                  reported_reason="ValueError: bad batch"),
             rank(2), rank(3)]
    [fault] = of(decide(view(run(), (attempt(),)), obs(*ranks), NOW), RecordFault)
    assert fault.ranks == (1,) and "ValueError: bad batch" in fault.summary


def test_unknown_process_state_is_never_a_death() -> None:
    ranks = [rank(0, ProcState.UNKNOWN), rank(1), rank(2), rank(3)]
    assert decide(view(run(), (attempt(),)), obs(*ranks), NOW) == []


def test_exit_code_2_fails_the_run_without_retry() -> None:
    ranks = [rank(0, ProcState.EXITED, exit_code=2, reported_reason="ConfigError: bad"), rank(1), rank(2), rank(3)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [finish] = of(effects, FinishRun)
    assert finish.state is RunState.FAILED and "configuration error" in finish.reason
    assert of(effects, StopAttempt)
    assert not of(effects, SetRunState)


def test_launch_error_is_a_fault_and_relaunches_in_the_same_tick() -> None:
    live = attempt(state=AttemptState.LAUNCHING, launch_info=None, launch_error="no such file: python")
    effects = decide(view(run(RunState.STARTING), (live,)), AttemptObs(ranks=(), never_started=True,
                                                                       launch_error="no such file: python"), NOW)
    assert of(effects, RecordFault)[0].kind is FaultKind.LAUNCH
    assert of(effects, EndAttempt)[0].outcome is AttemptOutcome.FAILED
    assert of(effects, StartAttempt)[0].number == 2


def test_attempt_that_never_started_is_aborted_not_failed() -> None:
    live = attempt(state=AttemptState.LAUNCHING, launch_info=None)
    effects = decide(view(run(RunState.STARTING), (live,)), AttemptObs(ranks=(), never_started=True), NOW)
    assert of(effects, EndAttempt)[0].outcome is AttemptOutcome.ABORTED
    assert not of(effects, RecordFault)
    assert of(effects, StartAttempt)[0].number == 2


# --- hangs --------------------------------------------------------------------------


def test_no_progress_beyond_the_hang_timeout_is_a_hang() -> None:
    o = obs(*(rank(i, progress_at=NOW - 61, phase="train") for i in range(4)))
    [fault] = of(decide(view(run(), (attempt(),)), o, NOW), RecordFault)
    assert fault.kind is FaultKind.HANG and "61 s" in fault.summary


def test_progress_within_the_timeout_is_not_a_hang() -> None:
    o = obs(*(rank(i, progress_at=NOW - 59, phase="train") for i in range(4)))
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_broker_outage_is_never_a_hang() -> None:
    o = replace(obs(*(rank(i, progress_at=NOW - 600) for i in range(4))), telemetry_up_since=None)
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_hang_clock_restarts_when_the_telemetry_link_comes_back() -> None:
    o = replace(obs(*(rank(i, progress_at=NOW - 600) for i in range(4))), telemetry_up_since=NOW - 30)
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_checkpoint_phase_gets_the_longer_allowance() -> None:
    o = obs(*(rank(i, progress_at=NOW - 120, phase="checkpoint") for i in range(4)))
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_startup_without_a_first_step_uses_the_startup_timeout() -> None:
    live = attempt(first_step_at=None, started_at=NOW - 301)
    o = obs(*(rank(i, last_step=0, progress_at=None, phase="init") for i in range(4)))
    [fault] = of(decide(view(run(RunState.STARTING), (live,)), o, NOW), RecordFault)
    assert fault.kind is FaultKind.HANG and "startup" in fault.summary


# --- stopping -----------------------------------------------------------------------


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


# --- operator commands --------------------------------------------------------------


def cmd(kind: CommandKind) -> Command:
    return Command(id=3, run_number=7, kind=kind, created_at=NOW)


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


# --- adaptive hang timeout ------------------------------------------------------------


def timed(p99: float, samples: int = 50, **kw: object) -> AttemptObs:
    """Every rank stuck at step 50 since NOW - 100, heard until just now."""
    ranks = tuple(rank(i, progress_at=NOW - 100, last_seen_at=NOW - 0.5) for i in range(4))
    return obs(*ranks, step_time_p99_s=p99, step_time_samples=samples, **kw)


def hang_after(p99: float, samples: int = 50, **policy: object) -> float:
    """The smallest idle time, in seconds, judged a hang (to 0.5 s)."""
    r = run(policy=replace(run().policy, hang_timeout_s=60.0, **policy))  # type: ignore[arg-type]
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    for idle in [x / 2 for x in range(1, 400)]:
        o = timed(p99, samples)
        o = replace(o, ranks=tuple(replace(x, progress_at=NOW - idle) for x in o.ranks))
        if of(decide(view(run(RunState.RUNNING, policy=r.policy), (live,)), o, NOW), RecordFault):
            return idle
    return float("inf")


def test_the_hang_limit_adapts_to_the_step_time_with_a_floor() -> None:
    assert hang_after(0.2) == 8.5  # max(8 s floor, 3 x 0.2 s)
    assert hang_after(5.0) == 15.5  # 3 x p99
    assert hang_after(40.0) == 120.5  # 3 x p99, however far above hang_timeout_s (60 s)
    assert hang_after(0.2, samples=5) == 60.5  # too few steps timed: the static limit
    assert hang_after(30.0, samples=5) == 90.5  # ... unless 3 x the slowest so far is longer
    assert hang_after(0.2, hang_floor_s=4.0, hang_k=2.0) == 4.5


def test_announced_phases_get_their_own_allowances() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    r = run(policy=replace(run().policy, checkpoint_timeout_s=120.0, eval_timeout_s=200.0, compile_timeout_s=500.0))
    for phase, limit in (("checkpoint", 120.0), ("eval", 200.0), ("compile", 500.0), ("restore", 300.0)):
        o = timed(0.2)
        stuck = tuple(replace(x, phase=phase if x.rank == 0 else "train", progress_at=NOW - limit + 1)
                      for x in o.ranks)
        assert not of(decide(view(r, (live,)), replace(o, ranks=stuck), NOW), RecordFault), phase
        over = tuple(replace(x, progress_at=NOW - limit - 1) for x in stuck)
        assert of(decide(view(r, (live,)), replace(o, ranks=over), NOW), RecordFault), phase


def test_a_hang_names_the_rank_that_fell_silent_first_and_drains_nothing() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    o = timed(0.2)
    stopped = tuple(replace(x, last_seen_at=NOW - 30) if x.rank == 3 else x for x in o.ranks)
    effects = decide(view(run(), (live,)), replace(o, ranks=stopped), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.HANG and fault.ranks == (3,) and fault.nodes == ("n2",)
    assert "stalled first: ranks 3 on n2" in fault.summary
    assert not of(effects, DrainNode) and of(effects, StopAttempt)


def test_a_rank_behind_the_others_is_the_one_that_stalled_first() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    o = timed(0.2)
    behind = tuple(replace(x, last_step=49) if x.rank == 1 else x for x in o.ranks)
    [fault] = of(decide(view(run(), (live,)), replace(o, ranks=behind), NOW), RecordFault)
    assert fault.ranks == (1,) and fault.nodes == ("n1",)


def test_ranks_that_stalled_together_name_no_one() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    [fault] = of(decide(view(run(), (live,)), timed(0.2), NOW), RecordFault)
    assert fault.ranks == () and fault.nodes == ()


def test_a_whole_node_falling_silent_is_left_to_the_silence_rule_not_called_a_hang() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    o = timed(0.2)
    frozen = tuple(replace(x, last_seen_at=NOW - 9, progress_at=NOW - 9.5) if x.node == "n2"
                   else replace(x, progress_at=NOW - 9.5) for x in o.ranks)
    assert not of(decide(view(run(), (live,)), replace(o, ranks=frozen), NOW), RecordFault)
    later = tuple(replace(x, last_seen_at=NOW - 11) if x.node == "n2" else x for x in frozen)
    [fault] = of(decide(view(run(), (live,)), replace(o, ranks=later), NOW), RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",)


def test_once_a_save_was_timed_the_checkpoint_allowance_adapts_to_it() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    r = run(policy=replace(run().policy, checkpoint_timeout_s=600.0))
    o = replace(timed(0.2), save_s=0.15)
    saving = tuple(replace(x, phase="checkpoint", progress_at=NOW - 7.5) for x in o.ranks)
    assert not of(decide(view(r, (live,)), replace(o, ranks=saving), NOW), RecordFault)
    stuck = tuple(replace(x, progress_at=NOW - 8.5) for x in saving)
    [fault] = of(decide(view(r, (live,)), replace(o, ranks=stuck), NOW), RecordFault)
    assert "checkpoint allowance: max(8 s, 3 x slowest save 0.15 s)" in fault.summary
    slow = replace(o, ranks=stuck, save_s=100.0)
    assert not of(decide(view(r, (live,)), slow, NOW), RecordFault)


# --- stop rules -----------------------------------------------------------------------


def fault_of(a: int, kind: FaultKind = FaultKind.RANK_EXIT, step: int = 25) -> FaultRecord:
    return FaultRecord(id=a, run_number=7, attempt=a, kind=kind, ranks=(1,), nodes=("n1",), step=step,
                       summary="x", detected_at=NOW - 100 + a, recovered_at=None)


def ended(i: int, resume: int = 20, nodes: tuple[str, ...] = ("n1", "n2")) -> Attempt:
    return attempt(i, AttemptState.ENDED, outcome=AttemptOutcome.FAILED, resume_step=resume, nodes=nodes,
                   ended_at=NOW - 1000)


def test_the_same_fault_at_the_same_step_three_times_is_a_crash_loop() -> None:
    attempts = (ended(1, 0), ended(2, nodes=("n2", "n3")), ended(3, nodes=("n1", "n3")))
    v = replace(view(run(RunState.RECOVERING), attempts), faults=tuple(fault_of(a) for a in (1, 2, 3)))
    effects = decide(v, None, NOW)
    [finish] = of(effects, FinishRun)
    assert finish.state is RunState.FAILED and finish.reason.startswith("crash loop: rank-exit at step 25 in 3")
    assert "n1, n2, n3" in finish.reason and not of(effects, StartAttempt)


def test_different_faults_or_steps_are_no_crash_loop() -> None:
    attempts = (ended(1, 0), ended(2), ended(3))
    for faults in ((fault_of(1), fault_of(2, step=26), fault_of(3)),
                   (fault_of(1), fault_of(2, FaultKind.HANG), fault_of(3))):
        v = replace(view(run(RunState.RECOVERING), attempts), faults=faults)
        assert not of(decide(v, None, NOW), FinishRun)


def test_failed_attempts_that_make_no_progress_stop_the_run() -> None:
    attempts = tuple(replace(ended(i, 40), final_step=40 + i) for i in range(1, 4))
    faults = tuple(fault_of(a, step=40 + a) for a in range(1, 4))  # no crash loop: other steps
    v = replace(view(run(RunState.RECOVERING), attempts, ck=CheckpointRef(step=40, path="c40")), faults=faults)
    [finish] = of(decide(v, None, NOW), FinishRun)
    assert finish.reason == ("no progress: 3 failed attempts in a row (attempts 1, 2, 3, resumed from step 40) "
                             "made no newer checkpoint and fewer than 100 steps each "
                             "(failures_without_progress = 3)")
    assert not of(decide(replace(v, attempts=attempts[1:], faults=faults[1:]), None, NOW), FinishRun)


@pytest.mark.parametrize(("trained", "newer_checkpoint", "stops"), [
    (99, False, True),  # one step short of progress_steps, and no newer checkpoint
    (100, False, False),  # progress_steps beyond its resume point: progress
    (5, True, False),  # the run checkpointed beyond where it resumed from: progress
])
def test_progress_is_a_newer_checkpoint_or_progress_steps_trained(trained: int, newer_checkpoint: bool,
                                                                   stops: bool) -> None:
    attempts = (ended(1, 40), ended(2, 40), replace(ended(3, 40), final_step=40 + trained))
    faults = tuple(fault_of(a, step=41 + a) for a in (1, 2, 3))
    ck = CheckpointRef(step=60 if newer_checkpoint else 40, path="c")
    v = replace(view(run(RunState.RECOVERING), attempts, ck=ck), faults=faults)
    assert bool(of(decide(v, None, NOW), FinishRun)) is stops


def test_hardware_faults_whose_nodes_were_replaced_cost_nothing() -> None:
    """A node lost, or a device failed, drained and replaced by a spare: not the run's failure,
    however many in a row (thousands of nodes make that bad luck, not a loop)."""
    attempts = tuple(ended(i, 40, nodes=("n1", f"n{i + 1}")) for i in range(1, 7))
    faults = tuple(fault_of(a, FaultKind.NODE_LOST if a % 2 else FaultKind.DEVICE, step=41 + a)
                   for a in range(1, 7))
    v = replace(view(run(RunState.RECOVERING), attempts, ck=CheckpointRef(step=40, path="c")), faults=faults)
    effects = decide(v, None, NOW)
    assert of(effects, StartAttempt) and not of(effects, FinishRun)


def test_a_lost_node_is_no_part_of_a_crash_loop() -> None:
    attempts = tuple(ended(i, 20 if i > 1 else 0) for i in range(1, 5))
    lost_thrice = tuple(fault_of(a, FaultKind.NODE_LOST) for a in (1, 2, 3))
    v = replace(view(run(RunState.RECOVERING), attempts[:3]), faults=lost_thrice)
    assert not of(decide(v, None, NOW), FinishRun), "the same node loss three times is bad luck, not a loop"
    # Crashes at step 25 around a lost node are still one crash loop.
    faults = (fault_of(1), fault_of(2), fault_of(3, FaultKind.NODE_LOST), fault_of(4))
    v = replace(view(run(RunState.RECOVERING), attempts), faults=faults)
    [finish] = of(decide(v, None, NOW), FinishRun)
    assert finish.reason.startswith("crash loop: rank-exit at step 25 in 3 attempts in a row")


def test_faults_arriving_faster_than_the_limit_stop_the_run_whatever_the_progress() -> None:
    policy = replace(run().policy, fault_rate_max=5, fault_rate_window_s=600.0)
    attempts = tuple(ended(i, 20 * i) for i in range(1, 7))  # each resumed further: progress every time
    faults = tuple(replace(fault_of(a, step=20 * a + 5), detected_at=NOW - 60 * (6 - a)) for a in range(1, 7))
    v = replace(view(run(RunState.RECOVERING, policy=policy), attempts, ck=CheckpointRef(step=140, path="c")),
                faults=faults)
    [finish] = of(decide(v, None, NOW), FinishRun)
    assert finish.reason.startswith("faults too frequent: 6 in the last 0.166667 h (fault_rate_max = 5)")
    old = tuple(replace(f, detected_at=f.detected_at - 601) if f.attempt == 1 else f for f in faults)
    assert not of(decide(replace(v, faults=old), None, NOW), FinishRun), "5 within the window: the limit"


def test_a_dozen_faults_each_followed_by_a_new_checkpoint_never_stop_a_run_under_the_default_policy() -> None:
    """A run of 400 steps, checkpointing every 20, meets a crash 15 steps after every
    resume: twelve faults, each followed by a newer checkpoint. It finishes."""
    r = run(RunState.PENDING, total_steps=400, policy=Policy())
    attempts: list[Attempt] = []
    faults: list[FaultRecord] = []
    ck: CheckpointRef | None = None
    t, state = NOW, RunState.PENDING
    for _ in range(40):
        t += 100.0
        v = replace(view(replace(r, state=state), tuple(attempts), ck=ck), faults=tuple(faults))
        effects = decide(v, None, t)
        assert not of(effects, FinishRun), of(effects, FinishRun)
        [start] = of(effects, StartAttempt)
        state = RunState.STARTING
        a = attempt(start.number, AttemptState.ENDED, resume_step=start.resume_step, started_at=t,
                    ended_at=t + 50, nodes=start.nodes)
        if len(faults) == 12:  # the last attempt runs to the end
            attempts.append(replace(a, outcome=AttemptOutcome.SUCCEEDED, final_step=400))
            break
        crash_at = start.resume_step + 15
        attempts.append(replace(a, outcome=AttemptOutcome.FAILED, final_step=crash_at))
        faults.append(replace(fault_of(start.number, step=crash_at), detected_at=t + 50))
        # Its checkpoint at the next multiple of 20 landed before the crash, from the second on
        if len(faults) > 1:
            ck = CheckpointRef(step=start.resume_step + 20, path=f"c{start.resume_step + 20}")
    assert len(faults) == 12 and attempts[-1].outcome is AttemptOutcome.SUCCEEDED


def test_restarts_without_progress_back_off_exponentially() -> None:
    def wait_before(n_stuck: int) -> float:
        attempts = (ended(1, 0), *(ended(i + 2, 40) for i in range(n_stuck)))
        lo, hi = 0.0, 10_000.0
        for _ in range(40):  # the smallest delay after the last end at which it launches
            mid = (lo + hi) / 2
            last = replace(attempts[-1], ended_at=NOW - mid)
            p = replace(run().policy, failures_without_progress=99)
            v = view(run(RunState.RECOVERING, policy=p),
                     (*attempts[:-1], last))
            lo, hi = (mid, hi) if not of(decide(v, None, NOW), StartAttempt) else (lo, mid)
        return round(hi, 1)

    assert wait_before(1) == 0.0  # the first restart after progress is at once
    assert [wait_before(n) for n in (2, 3, 4)] == [5.0, 10.0, 20.0]
    assert wait_before(9) == 300.0  # at most backoff_max_s


def test_the_backoff_is_announced_when_the_attempt_ends() -> None:
    live = replace(ended(3, 40), state=AttemptState.STOPPING, outcome=AttemptOutcome.FAILED,
                   stop_requested_at=NOW - 1, ended_at=None)
    o = obs(*(rank(i, ProcState.EXITED, exit_code=-9) for i in range(4)))
    effects = decide(view(run(RunState.RECOVERING), (ended(1, 0), ended(2, 40), live)), o, NOW)
    [note] = [e for e in effects if isinstance(e, Emit) and e.kind == "attempt.backoff"]
    assert "2 failed attempts in a row resumed from step 40: waiting 5 s" in note.message
    assert not of(effects, StartAttempt)


# --- numeric faults ---------------------------------------------------------------------


def test_a_nan_loss_stops_the_attempt_and_drains_nothing() -> None:
    o = obs(*(rank(i, nonfinite_step=60 if i < 2 else 61) for i in range(4)))
    effects = decide(view(run(), (attempt(),)), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NONFINITE and fault.step == 60 and fault.nodes == ()
    assert of(effects, StopAttempt) and not of(effects, DrainNode)


def test_after_a_nan_the_next_attempt_resumes_from_before_it_and_later_ones_from_the_newest() -> None:
    from supervisor.policy import resume_before

    nan = replace(fault_of(1, FaultKind.NONFINITE, step=60))
    a1 = ended(1, 0)
    assert resume_before((a1,), (nan,)) == 60
    assert resume_before((a1,), (fault_of(1, step=60),)) is None  # a crash poisons nothing
    a2 = replace(ended(2, 40), outcome=AttemptOutcome.FAILED)
    assert resume_before((a1, a2), (nan, fault_of(2, step=90))) is None
    assert resume_before((a1, attempt(2)), (nan,)) == 60  # the live one has not ended yet


# --- spikes ---------------------------------------------------------------------------


def samples(losses: list[float], grads: list[float] | None = None, batch: int = 16) -> tuple[StepSample, ...]:
    grads = grads or [1.0] * len(losses)
    return tuple(StepSample(step=i + 1, loss=x, grad_norm=g, first_sample=i * batch)
                 for i, (x, g) in enumerate(zip(losses, grads, strict=True)))


def spiky(at: int, length: int, total: int = 60) -> list[float]:
    return [10.0 if at <= i + 1 < at + length else 2.0 - 0.001 * i for i in range(total)]


def test_a_spike_that_persists_rolls_back_and_skips_its_data_window() -> None:
    live = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    o = replace(obs(), recent=samples(spiky(40, 5, 44)))
    effects = decide(view(run(), (live,)), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.SPIKE and fault.step == 40 and "for 5 steps" in fault.summary
    [skip] = of(effects, SkipData)
    assert (skip.start, skip.end) == (39 * 16, 39 * 16 + 50 * 16)
    assert of(effects, StopAttempt) and not of(effects, DrainNode)


def test_a_spike_shorter_than_the_limit_is_reported_not_acted_on() -> None:
    from supervisor.policy import transient_spikes

    live = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    recent = samples(spiky(40, 1, 50))
    assert not of(decide(view(run(), (live,)), replace(obs(), recent=recent), NOW), RecordFault)
    [spike] = transient_spikes(recent, run().policy)
    assert (spike.step, spike.steps) == (40, 1)
    ongoing = samples(spiky(48, 3, 50))  # still going: not yet known to be short
    assert not transient_spikes(ongoing, run().policy)


def test_a_grad_norm_spike_counts_and_a_falling_loss_never_does() -> None:
    live = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    grads = [1.0] * 30 + [9.0] * 6
    o = replace(obs(), recent=samples([2.0] * 36, grads))
    [fault] = of(decide(view(run(), (live,)), o, NOW), RecordFault)
    assert fault.kind is FaultKind.SPIKE and fault.step == 31
    falling = samples([10.0 / (i + 1) for i in range(60)])
    assert not of(decide(view(run(), (live,)), replace(obs(), recent=falling), NOW), RecordFault)


def test_a_nan_again_at_the_same_step_skips_that_steps_data() -> None:
    live = attempt(2, started_at=NOW - 100, first_step_at=NOW - 90)
    recent = samples([2.0] * 60)
    o = replace(obs(*(rank(i, nonfinite_step=60) for i in range(4))), recent=recent)
    first = decide(view(run(), (live,)), o, NOW)
    assert not of(first, SkipData)
    again = replace(view(run(), (ended(1, 0), live)), faults=(fault_of(1, FaultKind.NONFINITE, step=60),))
    [skip] = of(decide(again, o, NOW), SkipData)
    assert (skip.start, skip.end) == (59 * 16, 60 * 16)


def test_a_command_told_skip_to_step_skips_the_spikes_steps() -> None:
    """A [command] trainer's lines carry no sample position: the window is its own steps,
    turned into data steps when recorded (supervisor/execute.py)."""
    live = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    o = replace(obs(), recent=tuple(replace(x, first_sample=-1) for x in samples(spiky(40, 5, 44))))
    effects = decide(replace(view(run(), (live,)), data_skip_unit="steps"), o, NOW)
    [skip] = of(effects, SkipData)
    assert (skip.start, skip.end, skip.unit) == (40, 90, "steps")


def test_a_spike_a_trainer_cannot_skip_is_rolled_back_once_then_trained_through() -> None:
    """Without {skip_to_step}, the rollback replays the same batches into the same spike:
    the second time it is reported, once, and the attempt trains on (no crash loop)."""
    recent = samples(spiky(40, 5, 44))
    first = attempt(started_at=NOW - 100, first_step_at=NOW - 90)
    cannot = replace(view(run(), (first,)), data_skip_unit=None)
    effects = decide(cannot, replace(obs(), recent=recent), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.SPIKE and "the trainer cannot skip data" in fault.summary
    assert not of(effects, SkipData)
    replay = attempt(2, resume_step=30, started_at=NOW - 100, first_step_at=NOW - 90)
    again = replace(view(run(), (ended(1, 0), replay)), data_skip_unit=None,
                    faults=(fault_of(1, FaultKind.SPIKE, step=40),))
    effects = decide(again, replace(obs(), recent=recent), NOW)
    assert not of(effects, RecordFault) and not of(effects, StopAttempt)
    [said] = [e for e in of(effects, Emit) if e.kind is EventKind.SPIKE_PERSISTS]
    assert said.data["step"] == 40 and "not rolling back again" in said.message
    assert not [e for e in of(decide(replace(again, spikes_said=frozenset({40})), replace(obs(), recent=recent),
                                     NOW), Emit) if e.kind is EventKind.SPIKE_PERSISTS], "said once"
    # A spike after the checkpoint this attempt resumed from, not before it: a new one.
    later = replace(again, attempts=(ended(1, 0), replace(replay, resume_step=45)))
    assert of(decide(later, replace(obs(), recent=recent), NOW), RecordFault)


def test_data_steps_leave_out_the_skip_windows_and_a_window_ahead_is_jumped_to() -> None:
    from supervisor.policy import data_step, skip_to

    assert [data_step(t, []) for t in (1, 21, 100)] == [1, 21, 100]
    assert [data_step(t, [(30, 80)]) for t in (29, 30, 31)] == [29, 80, 81]
    assert [data_step(t, [(30, 80), (60, 90), (95, 100)]) for t in (30, 35)] == [90, 100], "windows merge"
    # The spike's window lies ahead of the checkpoint at step 20: read from its end at once,
    # the window widened back to step 21, so that every later resume agrees.
    assert skip_to(20, [(30, 80)]) == (80, (30, 21))
    assert [data_step(t, [(21, 80)]) for t in (20, 21, 40)] == [20, 80, 99]
    assert skip_to(40, [(21, 80)]) == (100, None), "a checkpoint after the jump: 41 + 59"
    assert skip_to(10, [(21, 80)]) == (80, (21, 11)), "a rollback before an old jump jumps there"
    assert skip_to(0, []) == (1, None)


# --- the network is not the nodes ---------------------------------------------------


def test_last_wills_from_every_node_at_once_are_the_network_not_the_nodes() -> None:
    unknown = ProcState.UNKNOWN
    every = [rank(r, unknown, lost=True, dead_since=NOW - 5) for r in range(4)]
    assert decide(view(run(), (attempt(),)), obs(*every), NOW) == [], "no fault, no drain"
    one_rank_each = [rank(0, unknown, lost=True), rank(1, unknown), rank(2, unknown), rank(3, unknown, lost=True)]
    assert decide(view(run(), (attempt(),)), obs(*one_rank_each), NOW) == []
    # one node's wills while the other is heard: that node is lost, as before
    one_node = [rank(0, unknown), rank(1, unknown), rank(2, unknown, lost=True, dead_since=NOW - 5),
                rank(3, unknown, lost=True, dead_since=NOW - 5)]
    [fault] = of(decide(view(run(), (attempt(),)), obs(*one_node), NOW), RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",)
    # a process seen to end, or a rank's own exit report, is evidence again
    exited = [*every[:3], rank(3, unknown, lost=True, reported_exit_code=1, dead_since=NOW - 5)]
    assert of(decide(view(run(), (attempt(),)), obs(*exited), NOW), RecordFault)


def one_node_attempt(*ranks: RankObs, held: bool = True) -> tuple[RunView, AttemptObs]:
    """A run of one node (n1, 2 ranks) and no spare; ``held``: the allocation still holds
    n1 (False: the cluster ended the allocation, as Slurm does once it sees n1 down)."""
    r = run(nodes=1, spares=0)
    alloc = (Node(name="n1", state=NodeState.ALLOCATED if held else NodeState.IDLE,
                  run_number=7 if held else None),)
    return view(r, (attempt(nodes=("n1",)),), alloc), obs(*ranks)


def test_a_runs_only_node_gone_with_its_agents_last_will_is_lost_not_a_cut() -> None:
    """Slurm still shows the node (SlurmdTimeout has not passed), its step's ranks are
    unknown to it; the node's agent's last will says the node went with them."""
    unknown = ProcState.UNKNOWN
    gone = [rank(r, unknown, lost=True, node_up=False, node_seen_at=NOW - 6) for r in (0, 1)]
    for held in (True, False):  # before and after Slurm took the node out of the allocation
        effects = decide(*one_node_attempt(*gone, held=held), NOW)
        [fault] = of(effects, RecordFault)
        assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",), (held, fault)
        assert "its node agent went with them: node lost" in fault.summary
        assert [d.node for d in of(effects, DrainNode)] == ["n1"]


def test_a_runs_only_node_whose_processes_were_killed_while_its_agent_lives_is_no_node_loss() -> None:
    """The other side: the node's own word is that it lives (its agent still reports)."""
    killed = [rank(r, ProcState.UNKNOWN, lost=True, node_up=True, node_seen_at=NOW - 0.5) for r in (0, 1)]
    [fault] = of(decide(*one_node_attempt(*killed), NOW), RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT and not of(decide(*one_node_attempt(*killed), NOW), DrainNode)


def test_a_one_node_allocation_the_cluster_ended_with_its_node_up_is_an_interruption() -> None:
    """A time limit, a preemption, scancel: the node did not fail, nobody is to blame."""
    ended = [rank(r, ProcState.VANISHED) for r in (0, 1)]
    [fault] = of(decide(*one_node_attempt(*ended, held=False), NOW), RecordFault)
    assert fault.kind is FaultKind.ALLOCATION_ENDED and fault.nodes == ()


def test_while_no_rank_of_a_slurm_step_is_heard_no_hang_is_judged_for_up_to_the_hang_timeout() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    o = timed(0.2)
    cut = tuple(replace(x, proc=ProcState.UNKNOWN, last_seen_at=NOW - 30, progress_at=NOW - 30) for x in o.ranks)
    assert decide(view(run(), (live,)), replace(o, ranks=cut), NOW) == [], "cut off together: no verdict"
    longer = tuple(replace(x, last_seen_at=NOW - 301, progress_at=NOW - 301) for x in cut)
    [fault] = of(decide(view(run(), (live,)), replace(o, ranks=longer), NOW), RecordFault)
    assert fault.kind is FaultKind.HANG, "past hang_timeout_s the hang rule judges it"
    # heard again but still no progress: the usual rule
    back = tuple(replace(x, last_seen_at=NOW - 0.5) for x in cut)
    [hang] = of(decide(view(run(), (live,)), replace(o, ranks=back), NOW), RecordFault)
    assert hang.kind is FaultKind.HANG
    # processes the launcher sees (the local launcher): silence of all is a hang as before
    local = tuple(replace(x, proc=ProcState.RUNNING) for x in cut)
    assert of(decide(view(run(), (live,)), replace(o, ranks=local), NOW), RecordFault)


def test_a_silent_node_slurm_stopped_answering_for_is_still_lost_and_drained() -> None:
    """Cut off, the node leaves the allocation (Slurm: not responding) before the silence
    limit: it is still this node's fault while the attempt's other nodes are held."""
    ranks = [heard(0, 0.5), heard(1, 0.5), heard(2, 12), heard(3, 11)]
    v = view(run(), (attempt(),))
    v = replace(v, allocation=tuple(replace(n, state=NodeState.IDLE) if n.name == "n2" else n
                                    for n in v.allocation))
    effects = decide(v, obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",)
    assert [d.node for d in of(effects, DrainNode)] == ["n2"]


# --- what a [command] trainer's output says -------------------------------------------


def test_a_device_error_in_a_ranks_output_drains_the_node_that_printed_it() -> None:
    ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    ranks = [rank(0, ProcState.EXITED, exit_code=1), rank(1, ProcState.EXITED, exit_code=1),
             rank(2, ProcState.EXITED, exit_code=1, fatal_kind="device", fatal_line=ecc),
             rank(3, ProcState.EXITED, exit_code=1)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.DEVICE and fault.nodes == ("n2",) and ecc in fault.summary
    [drain] = of(effects, DrainNode)
    assert drain.node == "n2" and ecc in drain.reason


def test_an_nccl_error_in_a_ranks_output_names_its_node_without_draining_it() -> None:
    nccl = "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."
    ranks = [rank(0, ProcState.EXITED, exit_code=SIGKILL), rank(1, ProcState.EXITED, exit_code=1),
             rank(2, ProcState.EXITED, exit_code=1, fatal_kind="peer", fatal_line=nccl),
             rank(3, ProcState.EXITED, exit_code=1)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT and fault.nodes == ("n1", "n2") and fault.ranks == (0,)
    assert f"rank 2 on n2 printed: {nccl}" in fault.summary
    assert not of(effects, DrainNode)


def test_a_configuration_error_in_a_ranks_output_fails_the_run_at_once_with_its_words() -> None:
    """Seed 003's DP 2 x TP 16 layout: every attempt would fail the same way, so the first
    ends the run, naming the line, draining nothing, starting nothing."""
    layout = ("2026-Jan-14 11:23:49.987594 95431:108485 ERROR   ENC:enc_init_comm   [rank 0] failed (2) to "
              "init a collective algorithm for provided replica group.")
    ranks = [rank(0, ProcState.EXITED, exit_code=1, fatal_kind="config", fatal_line=layout),
             rank(1, ProcState.EXITED, exit_code=SIGKILL), rank(2, ProcState.EXITED, exit_code=1),
             rank(3, ProcState.EXITED, exit_code=1)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.CONFIG and fault.ranks == (0,) and layout in fault.summary
    [finish] = of(effects, FinishRun)
    assert finish.state is RunState.FAILED and layout in finish.reason
    assert not of(effects, DrainNode) and not of(effects, StartAttempt)


def test_a_trainer_that_resumes_at_the_wrong_step_fails_the_run_with_the_reason() -> None:
    resumed = attempt(2, resume_from="/ck/llama_v3-20steps", resume_step=20, first_step_at=None)
    ranks = [rank(0, first_step=1, last_step=1), rank(1), rank(2), rank(3)]
    effects = decide(view(run(), (attempt(1, AttemptState.ENDED), resumed)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.WRONG_RESUME and fault.step == 1
    assert "resumed at step 1, not after step 20" in fault.summary and "command.resume" in fault.summary
    assert not of(effects, StartAttempt)
    right = [rank(0, first_step=21, last_step=21), rank(1), rank(2), rank(3)]
    effects = decide(view(run(), (attempt(1, AttemptState.ENDED), resumed)), obs(*right), NOW)
    assert not of(effects, RecordFault)


def test_unseen_ranks_on_a_node_the_allocation_lost_are_that_nodes_loss() -> None:
    """A [command] trainer on Slurm: no telemetry, and its step's ranks are UNKNOWN to the
    launcher. node n1 dies; Slurm shrinks the allocation by it (--no-kill) while n2's
    ranks exit 1 (their peer is gone): n1 is lost, not n2 to blame."""
    unseen = [rank(0, ProcState.UNKNOWN), rank(1, ProcState.UNKNOWN)]
    crashed = [rank(2, ProcState.EXITED, exit_code=1), rank(3, ProcState.EXITED, exit_code=1)]
    without_n1 = tuple(n for n in HEALTHY3 if n.name != "n1")
    effects = decide(view(run(), (attempt(),), alloc=without_n1), obs(*unseen, *crashed, unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",) and fault.ranks == (0, 1)
    assert [d.node for d in of(effects, DrainNode)] == ["n1"]
    # While the allocation still holds n1 nothing says it died: n2's crash waits for the
    # cluster's word, up to silence_timeout_s (10 s) after it.
    effects = decide(view(run(), (attempt(),)), obs(*unseen, *crashed, unheard=True), NOW)
    assert not of(effects, RecordFault)
    effects = decide(view(run(), (attempt(),)),
                     obs(*unseen, *(replace(r, dead_since=NOW - 11) for r in crashed), unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT and not of(effects, DrainNode)
    # A one-node attempt's node gone, its spare still held: that node's loss (every rank
    # silent at once is no network cut when the cluster itself took the node out).
    one = attempt(nodes=("n1",))
    alone = [rank(0, ProcState.UNKNOWN, lost=True), rank(1, ProcState.UNKNOWN, lost=True)]
    effects = decide(view(run(nodes=1), (one,), alloc=without_n1), obs(*alone, unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",)
    assert not of(decide(view(run(nodes=1), (one,)), obs(*alone, unheard=True), NOW), RecordFault), \
        "while the allocation holds it, every rank silent at once is the network's"
    # The cluster taking every node is an interruption, not two lost nodes.
    effects = decide(view(run(), (attempt(),), alloc=nodes(NodeState.ALLOCATED)[:0]),
                     obs(*unseen, rank(2, ProcState.UNKNOWN), rank(3, ProcState.UNKNOWN), unheard=True), NOW)
    assert not of(effects, DrainNode)


def test_a_resumed_step_whose_loss_differs_from_before_quarantines_its_checkpoint() -> None:
    """The reference trainer's steps are deterministic: after resuming from step 40, step
    41 must have the loss attempt 1 reported for it. A checkpoint that loads but differs
    (a weight changed in storage) is never resumed from again."""
    resumed = attempt(2, resume_from="/ck/step_00000040", resume_step=40)
    history = (attempt(1, AttemptState.ENDED), resumed)
    sample = StepSample(step=41, loss=2.5000001, grad_norm=1.0, first_sample=640)
    effects = decide(view(run(), history), obs(recent=(sample,), expected_first=(41, 2.5)), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.CHECKPOINT and fault.step == 40
    assert "resume diverged: step 41 after resuming from step 40 has loss 2.5000001" in fault.summary
    assert not of(decide(view(run(), history), obs(recent=(replace(sample, loss=2.5),), expected_first=(41, 2.5)),
                         NOW), RecordFault), "the same loss: the checkpoint held what was saved"
    assert not of(decide(view(run(), history), obs(recent=(sample,)), NOW), RecordFault), "nothing to compare"


def test_a_node_agents_last_will_is_its_nodes_loss_at_once_for_ranks_that_say_nothing() -> None:
    """The train.sh case on Slurm: a [command] trainer's ranks are UNKNOWN to the launcher
    and send nothing. n1 dies; its agent's last will arrives (the observer makes it the
    will of n1's silent ranks, and n1's node_up False) while n2's torchrun exits 1 on the
    loss of its peer. Slurm still holds n1 (SlurmdTimeout is minutes away): the agent's
    word is enough, with no wait for the cluster's."""
    gone = [rank(r, ProcState.UNKNOWN, lost=True, node_up=False, node_seen_at=NOW - 6, dead_since=NOW - 5)
            for r in (0, 1)]
    peers = [rank(r, ProcState.EXITED, exit_code=1, node_up=True, node_seen_at=NOW - 0.5, dead_since=NOW - 4)
             for r in (2, 3)]
    effects = decide(view(run(), (attempt(),)), obs(*gone, *peers, unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",) and fault.ranks == (0, 1)
    assert fault.summary.endswith("(ranks 0, 1), and its node agent went with them: node lost"), fault.summary
    [drain] = of(effects, DrainNode)
    assert drain.node == "n1" and "its node agent went with them (run-7" in drain.reason, drain.reason
    # Without an agent's word the same deaths wait for the cluster (the test above).
    silent = [replace(r, lost=False, node_up=None, node_seen_at=None, dead_since=None) for r in gone]
    bare = [replace(r, node_up=None, node_seen_at=None) for r in peers]
    assert not of(decide(view(run(), (attempt(),)), obs(*silent, *bare, unheard=True), NOW), RecordFault)


def test_a_node_whose_agent_falls_silent_is_lost_for_a_trainer_that_says_nothing() -> None:
    """A [command] trainer's ranks are never heard; only the agents are. n1's agent silent
    past silence_timeout_s (10 s) while n2's is heard: n1 is lost (cut off, frozen), and the
    reason names the agent. Under the limit, nothing yet."""
    ranks = [rank(r, ProcState.UNKNOWN, node_seen_at=NOW - (12 if r < 2 else 0.5)) for r in range(4)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks, unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",)
    assert "its agent and every rank" in fault.summary
    [drain] = of(effects, DrainNode)
    assert drain.node == "n1" and "no heartbeat from its agent or any rank for 12 s" in drain.reason
    early = [replace(r, node_seen_at=NOW - 8) if r.rank < 2 else r for r in ranks]
    assert not of(decide(view(run(), (attempt(),)), obs(*early, unheard=True), NOW), RecordFault)
    # Every agent silent at once is the broker or the link, not the nodes.
    all_quiet = [replace(r, node_seen_at=NOW - 12) for r in ranks]
    assert not of(decide(view(run(), (attempt(),)), obs(*all_quiet, unheard=True), NOW), DrainNode)


def test_peers_dying_after_a_node_fell_silent_wait_for_its_silence_to_be_judged() -> None:
    """n1 is cut off (its agent unheard for 6 s); then n2's ranks exit 1 (their peer is
    gone). Blaming n2 now would drain nothing and keep n1: the deaths wait, up to
    silence_timeout_s, and n1's silence, once past the limit, is the fault."""
    quiet = [rank(r, ProcState.UNKNOWN, node_seen_at=NOW - 6) for r in (0, 1)]
    peers = [rank(r, ProcState.EXITED, exit_code=1, node_seen_at=NOW - 0.5, dead_since=NOW - 3) for r in (2, 3)]
    assert not of(decide(view(run(), (attempt(),)), obs(*quiet, *peers, unheard=True), NOW), RecordFault)
    later = NOW + 5
    quiet = [replace(r, node_seen_at=NOW - 6) for r in quiet]
    peers = [replace(r, node_seen_at=later - 0.5) for r in peers]
    effects = decide(view(run(), (attempt(),)), obs(*quiet, *peers, unheard=True), later)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",)
    assert [d.node for d in of(effects, DrainNode)] == ["n1"]
    # A node whose own ranks died is silent because they did: no wait for it.
    crashed = [rank(r, ProcState.EXITED, exit_code=1, last_seen_at=NOW - 6, dead_since=NOW - 3) for r in (0, 1)]
    heard = [rank(r, last_seen_at=NOW - 0.5) for r in (2, 3)]
    [fault] = of(decide(view(run(), (attempt(),)), obs(*crashed, *heard), NOW), RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT
