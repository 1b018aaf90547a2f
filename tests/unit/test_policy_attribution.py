"""Whom a fault blames: a rank, its node, or the network (supervisor/policy/attribution.py, detection.py)."""

from __future__ import annotations

from dataclasses import replace

from supervisor.domain import (
    AttemptObs,
    AttemptOutcome,
    AttemptState,
    DrainNode,
    EndAttempt,
    FaultKind,
    FinishRun,
    Node,
    NodeState,
    ProcState,
    RecordFault,
    RunState,
    SetRunState,
    StartAttempt,
    StopAttempt,
)
from supervisor.policy import decide
from tests.unit.policy_world import (
    NOW,
    SIGKILL,
    attempt,
    heard,
    nodes,
    obs,
    of,
    one_node_attempt,
    one_rank_nodes,
    rank,
    run,
    timed,
    view,
)


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


def test_a_node_lost_on_the_clusters_word_does_not_take_the_node_whose_steps_it_ended_with_it() -> None:
    """A [command] trainer on Slurm: n1 loses its power and Slurm takes it out of the
    allocation, which ends the trainer's step and the agents' step on n2 as well: n2's
    ranks vanish and its agent's last will arrives in the same observation. Only n1 is
    lost; n2, which the cluster keeps and does not call down, is not drained."""
    unknown = ProcState.UNKNOWN
    powerless = [rank(r, unknown, node_up=True, node_seen_at=NOW - 9) for r in (0, 1)]  # no will
    ended = [rank(r, unknown, lost=True, node_up=False, node_seen_at=NOW - 1, dead_since=NOW - 1) for r in (2, 3)]
    ranks = [*powerless, *ended]
    dropped_n1 = (Node(name="n1", state=NodeState.IDLE), *nodes(NodeState.ALLOCATED, NodeState.ALLOCATED)[1:])
    effects = decide(view(run(), (attempt(),), dropped_n1), obs(*ranks, unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",), fault
    assert fault.ranks == (0, 1)
    assert [d.node for d in of(effects, DrainNode)] == ["n1"]
    # the cluster's word that n2 is down too: both are lost
    down = [replace(r, node_down="Slurm set it DOWN") if r.node == "n2" else r for r in ranks]
    [both] = of(decide(view(run(), (attempt(),), dropped_n1), obs(*down, unheard=True), NOW), RecordFault)
    assert both.nodes == ("n1", "n2")


def test_a_nodes_one_torchrun_killed_is_one_process_however_many_ranks_it_ran() -> None:
    """launch = "node": ranks 2 and 3 are one torchrun's; its SIGKILL is no node loss
    unless the node's own process went too."""
    ranks = [rank(0, process=1), rank(1, process=1), rank(2, ProcState.EXITED, exit_code=SIGKILL, process=2),
             rank(3, ProcState.EXITED, exit_code=SIGKILL, process=2)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    assert of(effects, RecordFault)[0].kind is FaultKind.RANK_EXIT and not of(effects, DrainNode)
    gone = [replace(r, node_up=False) if r.node == "n2" else r for r in ranks]
    assert of(decide(view(run(), (attempt(),)), obs(*gone), NOW), RecordFault)[0].kind is FaultKind.NODE_LOST


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


def test_a_node_that_lost_its_power_is_lost_on_the_clusters_word_that_it_is_down() -> None:
    """A node without power sends no last will: its ranks are silent, unknown to Slurm's
    launcher, and nothing about them changes until Slurm declares the node DOWN
    (SlurmdTimeout) and requeues its job. That word is their last will: the node is
    lost and drained (and, on HyperPod, handed to its repair), not a hang a minute later."""
    said = "Slurm set it DOWN+NOT_RESPONDING (Not responding)"
    silent = [rank(r, ProcState.UNKNOWN, last_seen_at=NOW - 12, progress_at=NOW - 12) for r in (0, 1)]
    assert not of(decide(*one_node_attempt(*silent, held=False), NOW), RecordFault), \
        "silent alone, its allocation ended: the node's word or the cluster's is awaited"
    down = [replace(r, node_up=False, node_down=said) for r in silent]
    effects = decide(*one_node_attempt(*down, held=False), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",), fault
    assert f"the cluster says the node is down: {said}" in fault.summary
    assert [d.node for d in of(effects, DrainNode)] == ["n1"]
    # Two nodes: the one Slurm declared down (seen so since the last tick) is lost, its
    # heard peer is not blamed.
    peers = [heard(2, 0.5, ProcState.UNKNOWN), heard(3, 0.5, ProcState.UNKNOWN)]
    effects = decide(view(run(), (attempt(),)), obs(*(replace(r, dead_since=NOW - 1) for r in down), *peers), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",), fault
    assert [d.node for d in of(effects, DrainNode)] == ["n1"]


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


def test_a_trainer_whose_output_is_read_is_judged_at_the_tick_after_the_death_was_seen() -> None:
    """Its output is read at the start of a tick, before its processes are looked at: a
    death first seen this tick is judged at the next, with the lines printed as it died."""
    ranks = [rank(r, ProcState.EXITED, exit_code=1, dead_since=NOW) for r in range(4)]
    assert not of(decide(view(run(), (attempt(),)), obs(*ranks, output_read=True), NOW), RecordFault)
    [fault] = of(decide(view(run(), (attempt(),)), obs(*ranks, output_read=True), NOW + 0.25), RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT
    assert of(decide(view(run(), (attempt(),)), obs(*ranks), NOW), RecordFault), "the reference trainer's at once"
