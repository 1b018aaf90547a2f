"""Stragglers, lemon nodes and the trainer exit codes with a meaning (supervisor/policy/)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.domain import (
    AttemptOutcome,
    AttemptState,
    CheckpointRef,
    DrainNode,
    Emit,
    ExitMeaning,
    FaultKind,
    FaultRecord,
    FinishRun,
    NodeState,
    Policy,
    ProcState,
    RankObs,
    RecordFault,
    ReportStraggler,
    RunState,
    StartAttempt,
    StopAttempt,
    StragglerReport,
)
from supervisor.policy import decide, find_stragglers, unreadable_checkpoints
from tests.unit.policy_world import HEALTHY3, NOW, attempt, nodes, obs, of, rank, run, view

W = Policy().straggler_window


def busy(r: int, *, seconds: float, steps: int = W, node: str | None = None) -> RankObs:
    base = rank(r, busy_recent_s=(seconds,) * steps)
    return replace(base, node=node) if node else base


def straggler_events(effects: list[object]) -> list[ReportStraggler]:
    return of(effects, ReportStraggler)


# --- finding them -------------------------------------------------------------------


def test_a_rank_computing_twice_as_long_as_the_others_is_a_straggler() -> None:
    ranks = [busy(0, seconds=0.10), busy(1, seconds=0.11), busy(2, seconds=0.10), busy(3, seconds=0.20)]
    [s] = find_stragglers(ranks, Policy())
    assert (s.rank, s.node, s.busy_s, s.typical_s) == (3, "n2", 0.20, 0.10)
    assert s.slower == pytest.approx(1.0)


def test_ranks_within_the_margin_are_not_stragglers() -> None:
    ranks = [busy(0, seconds=0.10), busy(1, seconds=0.12), busy(2, seconds=0.124)]
    assert find_stragglers(ranks, Policy()) == []  # 24 % slower: under the 25 % margin


def test_the_absolute_floor_keeps_tiny_steps_from_being_judged_on_noise() -> None:
    ranks = [busy(0, seconds=0.001), busy(1, seconds=0.003)]
    assert find_stragglers(ranks, Policy()) == []  # 3 x slower, but only 2 ms
    assert find_stragglers(ranks, Policy(straggler_min_s=0.001)) != []


def test_one_slow_step_is_not_a_straggler_the_window_median_is() -> None:
    spiky = (0.10,) * (W - 1) + (5.0,)
    ranks = [busy(0, seconds=0.10), rank(1, busy_recent_s=spiky)]
    assert find_stragglers(ranks, Policy()) == []
    persistent = (0.10,) * (W // 2 - 1) + (0.30,) * (W // 2 + 1)
    assert [s.rank for s in find_stragglers([busy(0, seconds=0.10), rank(1, busy_recent_s=persistent)],
                                            Policy())] == [1]


def test_ranks_without_a_full_window_are_not_judged() -> None:
    ranks = [busy(0, seconds=0.10), busy(1, seconds=0.50, steps=W - 1)]
    assert find_stragglers(ranks, Policy()) == []


def test_with_two_ranks_the_slower_is_compared_with_the_faster() -> None:
    [s] = find_stragglers([busy(0, seconds=0.10), busy(1, seconds=0.20)], Policy())
    assert s.rank == 1


def test_a_majority_of_slow_ranks_is_the_new_normal_not_a_crowd_of_stragglers() -> None:
    ranks = [busy(0, seconds=0.10), busy(1, seconds=0.30), busy(2, seconds=0.30), busy(3, seconds=0.30)]
    assert find_stragglers(ranks, Policy()) == []


# --- acting on them -----------------------------------------------------------------


def test_a_straggler_is_reported_once_with_its_node_and_the_run_goes_on() -> None:
    o = obs(busy(0, seconds=0.1), busy(1, seconds=0.1), busy(2, seconds=0.1), busy(3, seconds=0.3))
    effects = decide(view(run(), (attempt(),)), o, NOW)
    [report] = straggler_events(effects)
    assert (report.rank, report.node, report.attempt) == (3, "n2", 1)
    assert (report.busy_s, report.typical_s) == pytest.approx((0.3, 0.1)), "+200 %"
    assert not of(effects, StopAttempt) and not of(effects, RecordFault) and not of(effects, DrainNode)

    said = replace(view(run(), (attempt(),)), stragglers=(StragglerReport(attempt=1, rank=3, node="n2"),))
    assert straggler_events(decide(said, o, NOW)) == []


def test_with_straggler_restart_and_a_free_spare_the_attempt_is_stopped() -> None:
    r = run(policy=replace(run().policy, straggler_restart=True))
    o = obs(busy(0, seconds=0.1), busy(1, seconds=0.1), busy(2, seconds=0.1), busy(3, seconds=0.3))
    effects = decide(view(r, (attempt(),)), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.STRAGGLER and fault.nodes == ("n2",) and fault.ranks == (3,)
    [stop] = of(effects, StopAttempt)
    assert stop.outcome is AttemptOutcome.FAILED and not of(effects, DrainNode)


def test_with_straggler_restart_but_no_free_spare_the_attempt_goes_on() -> None:
    r = run(policy=replace(run().policy, straggler_restart=True))
    o = obs(busy(0, seconds=0.1), busy(1, seconds=0.1), busy(2, seconds=0.1), busy(3, seconds=0.3))
    two = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED)
    effects = decide(view(r, (attempt(),), alloc=two), o, NOW)
    assert not of(effects, StopAttempt) and not of(effects, RecordFault)
    assert len(straggler_events(effects)) == 1 and [e.kind for e in of(effects, Emit)] == ["straggler.kept"]


def test_the_next_attempt_leaves_a_node_that_straggled_in_the_last_one_out() -> None:
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED, nodes=("n1", "n2"))
    v = replace(view(run(RunState.RECOVERING), (prev,), HEALTHY3, CheckpointRef(step=40, path="/ck/40")),
                stragglers=(StragglerReport(attempt=1, rank=3, node="n2"),))
    effects = decide(v, None, NOW)
    [start] = of(effects, StartAttempt)
    assert start.nodes == ("n1", "n3")
    assert [e.message for e in of(effects, Emit) if e.kind.startswith("straggler")] == [
        "leaving out n2: it straggled in attempt 1"]


def test_a_straggling_node_is_still_used_when_no_other_node_is_free() -> None:
    prev = attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED, nodes=("n1", "n2"))
    two = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED)
    v = replace(view(run(RunState.RECOVERING), (prev,), two),
                stragglers=(StragglerReport(attempt=1, rank=3, node="n2"),))
    effects = decide(v, None, NOW)
    assert of(effects, StartAttempt)[0].nodes == ("n1", "n2")
    assert [e.kind for e in of(effects, Emit) if e.kind.startswith("straggler")] == ["straggler.kept"]


def test_a_straggler_of_an_older_attempt_is_not_held_against_its_node() -> None:
    older = attempt(1, state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED, nodes=("n1", "n2"))
    prev = attempt(2, state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED, nodes=("n1", "n2"),
                   resume_step=20)  # progress since attempt 1: no backoff
    v = replace(view(run(RunState.RECOVERING), (older, prev)),
                stragglers=(StragglerReport(attempt=1, rank=3, node="n2"),))
    assert of(decide(v, None, NOW), StartAttempt)[0].nodes == ("n1", "n2")


# --- lemons -------------------------------------------------------------------------


def past(run_number: int, step: int, node: str = "n2", *, hours_ago: float = 1.0,
         kind: FaultKind = FaultKind.RANK_EXIT) -> FaultRecord:
    return FaultRecord(id=0, run_number=run_number, attempt=1, kind=kind, ranks=(3,), nodes=(node,), step=step,
                       summary="", detected_at=NOW - hours_ago * 3600, recovered_at=None)


def crash_of_rank_3(history: tuple[FaultRecord, ...]) -> list[object]:
    """Rank 3 (on n2) killed by SIGKILL at step 50 of run 7, with this fault history."""
    o = obs(rank(0), rank(1), rank(2), rank(3, ProcState.EXITED, exit_code=-9))
    return decide(replace(view(run(), (attempt(),)), cluster_faults=history), o, NOW)


def test_a_node_blamed_in_a_third_fault_within_the_window_is_drained_as_a_lemon() -> None:
    effects = crash_of_rank_3((past(3, 25), past(5, 700, kind=FaultKind.HANG)))
    [drain] = of(effects, DrainNode)
    assert drain.node == "n2"
    assert drain.reason == ("training-supervisor: lemon: blamed in 3 faults in 24 h (run-3 rank-exit at step 25; "
                            "run-5 hang at step 700; now rank-exit at step 50) (run-7)")


def test_two_faults_do_not_make_a_lemon_and_old_ones_are_forgotten() -> None:
    assert of(crash_of_rank_3((past(3, 25),)), DrainNode) == []
    assert of(crash_of_rank_3((past(3, 25), past(5, 700, hours_ago=25))), DrainNode) == []


def test_a_fault_repeating_at_one_step_of_one_run_counts_once() -> None:
    """A crash loop follows the step, not the node: it makes no lemon."""
    assert of(crash_of_rank_3((past(7, 50), past(7, 50))), DrainNode) == []
    assert of(crash_of_rank_3((past(7, 50), past(7, 30), past(7, 40))), DrainNode) != []


def test_faults_of_other_nodes_do_not_count() -> None:
    assert of(crash_of_rank_3((past(3, 25, node="n1"), past(5, 700, node="n3"))), DrainNode) == []


# --- exit codes with a meaning ------------------------------------------------------


def test_exit_code_4_is_a_device_fault_that_drains_the_ranks_node() -> None:
    o = obs(rank(0), rank(1), rank(2, ProcState.EXITED, exit_code=1),
            rank(3, ProcState.EXITED, exit_code=4, reported_exit_code=4,
                 reported_reason="DeviceFault: CUDA error: uncorrectable ECC error encountered"))
    effects = decide(view(run(), (attempt(),)), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.DEVICE and fault.ranks == (3,) and fault.nodes == ("n2",)
    [drain] = of(effects, DrainNode)
    assert drain.node == "n2" and drain.reason == (
        "training-supervisor: device fault reported by the trainer: DeviceFault: CUDA error: uncorrectable "
        "ECC error encountered (run-7, attempt 1, step 50)")
    assert of(effects, StopAttempt)[0].outcome is AttemptOutcome.FAILED


@pytest.mark.parametrize("code", [2, 3, 4, 5])
def test_a_trainer_that_declares_no_exit_codes_means_only_failed_by_any(code: int) -> None:
    """A [command] trainer's codes mean nothing unless its spec says so (torchrun exits 1
    for any child's failure; a script's 2 or 4 may be anything): a plain fault, retried,
    no node drained."""
    o = obs(rank(0), rank(1), rank(2), rank(3, ProcState.EXITED, exit_code=code))
    live = attempt(resume_from="/ck/step_00000040", resume_step=40)
    effects = decide(replace(view(run(), (live,)), exit_codes={}), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT and fault.ranks == (3,), fault
    assert of(effects, DrainNode) == [] and of(effects, FinishRun) == []


def test_a_declared_table_of_its_own_gives_a_code_its_meaning() -> None:
    o = obs(rank(0), rank(1), rank(2), rank(3, ProcState.EXITED, exit_code=7))
    effects = decide(replace(view(run(), (attempt(),)), exit_codes={7: ExitMeaning.DEVICE}), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.DEVICE and "exit code 7" in fault.summary
    assert [d.node for d in of(effects, DrainNode)] == ["n2"]
    refused = decide(replace(view(run(), (attempt(),)), exit_codes={7: ExitMeaning.DO_NOT_RETRY}), o, NOW)
    [finish] = of(refused, FinishRun)
    assert finish.state is RunState.FAILED and "configuration error (exit code 7)" in finish.reason


def test_exit_code_3_blames_the_checkpoint_not_a_node_and_it_is_not_used_again_until_saved_again() -> None:
    live = attempt(resume_from="/ck/step_00000060", resume_step=60)
    o = obs(*(rank(i, ProcState.EXITED, exit_code=3, reported_exit_code=3,
                   reported_reason="CheckpointUnreadable: ...") for i in range(4)))
    effects = decide(view(run(), (live,)), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.CHECKPOINT and fault.step == 60 and fault.nodes == ()
    assert "the checkpoint at step 60 cannot be read" in fault.summary
    assert not of(effects, DrainNode)
    recorded = FaultRecord(id=1, run_number=7, attempt=1, kind=fault.kind, ranks=fault.ranks, nodes=(),
                           step=60, summary="", detected_at=NOW, recovered_at=None)
    assert unreadable_checkpoints([recorded]) == {60}
    # A later attempt that trains past step 60 again commits a new checkpoint there: a
    # resume may use it. The unreadable one's own writer, or no commit on record, may not.
    assert unreadable_checkpoints([recorded], saved_by={60: 2}) == frozenset()
    assert unreadable_checkpoints([recorded], saved_by={60: 1}) == {60}
    assert unreadable_checkpoints([recorded], saved_by={40: 3}) == {60}


def test_exit_code_5_stops_the_run_for_want_of_checkpoint_storage_and_blames_no_node() -> None:
    o = obs(*(rank(i, ProcState.EXITED, exit_code=5, reported_exit_code=5,
                   reported_reason="CheckpointStorageFull: cannot write the checkpoint of step 60 to /ck: "
                                   "[Errno 28] No space left on device") for i in range(4)))
    effects = decide(view(run(), (attempt(),)), o, NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.STORAGE and fault.nodes == ()
    assert not of(effects, DrainNode)
    [finish] = of(effects, FinishRun)
    assert finish.state is RunState.FAILED
    assert finish.reason.startswith("not retrying: checkpoint storage full (exit code 5): rank 0 (node n1) exited "
                                    "with code 5: CheckpointStorageFull: ")
    assert finish.reason.endswith("No space left on device; free space, then resume the run")


def test_exit_code_3_of_a_fresh_start_is_an_ordinary_rank_exit() -> None:
    o = obs(rank(0), rank(1), rank(2), rank(3, ProcState.EXITED, exit_code=3))
    [fault] = of(decide(view(run(), (attempt(),)), o, NOW), RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT
