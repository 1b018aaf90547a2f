"""Invariants of supervisor.policy.decide over generated runs and observations (hypothesis).

- it never drains a node without evidence against it: every rank of a drained node died
  abruptly (killed, vanished or lost) or fell silent, and the run still held the node;
- it never resumes from anything but the newest complete checkpoint it was shown;
- it never restarts a run the user cancelled or paused;
- it never starts an attempt once the budget of failures without progress is spent.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.domain import (
    AllocateNodes,
    Attempt,
    AttemptObs,
    AttemptOutcome,
    AttemptState,
    CheckpointRef,
    DrainNode,
    EndAttempt,
    FaultKind,
    FaultRecord,
    Node,
    NodeState,
    Policy,
    ProcState,
    RankObs,
    Run,
    RunState,
    RunView,
    StartAttempt,
    StepSample,
)
from supervisor.policy import decide

NOW = 10_000.0
NODES = ("n1", "n2", "n3", "n4")

procs = st.sampled_from([ProcState.RUNNING, ProcState.EXITED, ProcState.VANISHED, ProcState.UNKNOWN])
codes = st.one_of(st.none(), st.sampled_from([0, 1, 2, -9, -15, -6, 137]))
times = st.one_of(st.none(), st.floats(min_value=NOW - 100, max_value=NOW))


@st.composite
def rank_obs(draw: st.DrawFn, rank: int, node: str, fate: str) -> RankObs:
    """A rank whose node met ``fate``, with noise: any field may still be anything."""
    if fate == "killed":  # the node's processes SIGKILLed together
        proc, code, lost, seen = ProcState.EXITED, -9, False, NOW - 5
    elif fate == "silent":  # the node froze: alive, unheard
        proc, code, lost, seen = ProcState.RUNNING, None, False, NOW - 60
    elif fate == "lost":  # wills arrived for ranks the launcher cannot see
        proc, code, lost, seen = ProcState.UNKNOWN, None, True, NOW - 30
    elif fate == "noise":
        proc, code, lost, seen = draw(procs), draw(codes), draw(st.booleans()), draw(times)
    else:
        proc, code, lost, seen = ProcState.RUNNING, None, False, NOW - 0.5
    return RankObs(
        rank=rank, node=node, proc=proc, exit_code=code if proc is ProcState.EXITED else None,
        reported_exit_code=draw(st.one_of(st.none(), codes)) if fate == "noise" else None, lost=lost,
        dead_since=draw(st.floats(NOW - 100, NOW)) if proc in (ProcState.EXITED, ProcState.VANISHED) else None,
        last_step=draw(st.integers(0, 100)), progress_at=draw(times), last_seen_at=seen,
        phase=draw(st.sampled_from([None, "train", "checkpoint", "init"])),
        nonfinite_step=draw(st.one_of(st.none(), st.integers(1, 100))) if fate == "noise" else None,
    )


@st.composite
def worlds(draw: st.DrawFn) -> tuple[RunView, AttemptObs | None]:
    state = draw(st.sampled_from(list(RunState)))
    policy = Policy(failures_without_progress=draw(st.integers(1, 4)), progress_steps=30, hang_timeout_s=60, startup_timeout_s=120, stop_grace_s=5,
                    backoff_base_s=draw(st.sampled_from([0.0, 5.0])))
    run = Run(number=1, name="p", state=state, reason="", nodes=2, ranks_per_node=2, spares=draw(st.integers(0, 2)),
              total_steps=100, policy=policy, created_at=0.0)
    n_done = draw(st.integers(0, 6))
    attempts = []
    for i in range(1, n_done + 1):
        attempts.append(Attempt(
            run_number=1, number=i, state=AttemptState.ENDED, nodes=("n1", "n2"), resume_from=None,
            resume_step=draw(st.sampled_from([0, 20, 40])), created_at=float(i), started_at=float(i),
            final_step=draw(st.one_of(st.none(), st.integers(0, 80))),
            ended_at=draw(st.floats(0, NOW)),
            outcome=draw(st.sampled_from([AttemptOutcome.FAILED, AttemptOutcome.STOPPED, AttemptOutcome.ABORTED]))))
    live_state = draw(st.sampled_from([None, None, AttemptState.RUNNING, AttemptState.STOPPING]))
    obs = None
    if live_state is not None:
        nodes = tuple(draw(st.permutations(NODES))[:2])
        attempts.append(Attempt(
            run_number=1, number=n_done + 1, state=live_state, nodes=nodes, resume_from=None, resume_step=0,
            created_at=NOW - 50, started_at=NOW - 50, first_step_at=draw(st.one_of(st.none(), st.just(NOW - 40))),
            stop_requested_at=NOW - 10 if live_state is AttemptState.STOPPING else None,
            outcome=AttemptOutcome.FAILED if live_state is AttemptState.STOPPING else None, launch_info="{}"))
        fates = [draw(st.sampled_from(["healthy", "killed", "silent", "lost", "noise"])) for _ in nodes]
        ranks = tuple(draw(rank_obs(r, nodes[r // 2], fates[r // 2])) for r in range(4))
        recent = tuple(StepSample(step=i + 1, loss=draw(st.sampled_from([2.0, 2.0, 9.0])), grad_norm=1.0,
                                  first_sample=16 * i) for i in range(draw(st.integers(0, 30))))
        obs = AttemptObs(ranks=ranks, telemetry_up_since=draw(st.sampled_from([None, 0.0, 0.0])),
                         step_time_p99_s=draw(st.one_of(st.none(), st.floats(0.01, 10))), step_time_samples=50,
                         recent=recent)
    held = st.sampled_from([NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.DRAINED])
    allocation = tuple(Node(name=n, state=draw(held), run_number=1) for n in NODES[: draw(st.sampled_from([0, 2, 3, 4, 4]))])
    ck = draw(st.one_of(st.none(), st.builds(lambda s: CheckpointRef(step=s, path=f"/ck/{s}"), st.integers(1, 99))))
    faults = tuple(FaultRecord(id=a.number, run_number=1, attempt=a.number, kind=draw(st.sampled_from(list(FaultKind))),
                               ranks=(), nodes=(), step=draw(st.integers(0, 50)), summary="", detected_at=1.0,
                               recovered_at=None) for a in attempts if a.outcome is AttemptOutcome.FAILED)
    view = RunView(run=run, attempts=tuple(attempts), allocation=allocation, newest_checkpoint=ck, faults=faults,
                   probing=draw(st.sampled_from([False, False, True])), diagnose=draw(st.booleans()))
    return view, obs


def _evidence(r: RankObs) -> bool:
    """Anything that could speak against a rank's node."""
    return (r.proc in (ProcState.EXITED, ProcState.VANISHED, ProcState.UNKNOWN) or r.lost
            or r.last_seen_at is None or r.last_seen_at < NOW - 1)


@settings(max_examples=400, deadline=None)
@given(worlds())
def test_a_drained_node_always_has_evidence_against_it_and_was_held(world: tuple[RunView, AttemptObs | None]) -> None:
    view, obs = world
    drained = {e.node for e in decide(view, obs, NOW) if isinstance(e, DrainNode)}
    if not drained:
        return
    assert obs is not None
    held = {n.name for n in view.allocation if n.state is NodeState.ALLOCATED}
    live = view.attempts[-1] if view.attempts else None
    if live is not None and held:
        # a node of the attempt that left the allocation (Slurm stopped answering for it)
        # while the allocation keeps other nodes is still the run's to blame
        held |= set(live.nodes)
    for node in drained:
        ranks = [r for r in obs.ranks if r.node == node]
        assert node in held, f"{node} was not held by the run"
        assert ranks and all(_evidence(r) for r in ranks), f"{node} drained with a healthy rank: {ranks}"


@settings(max_examples=400, deadline=None)
@given(worlds())
def test_a_launch_resumes_only_from_the_newest_complete_checkpoint(world: tuple[RunView, AttemptObs | None]) -> None:
    view, obs = world
    for e in decide(view, obs, NOW):
        if isinstance(e, StartAttempt):
            ck = view.newest_checkpoint
            assert (e.resume_from, e.resume_step) == ((ck.path, ck.step) if ck else (None, 0))


@settings(max_examples=400, deadline=None)
@given(worlds(), st.sampled_from([RunState.CANCELLED, RunState.PAUSED, RunState.FAILED, RunState.SUCCEEDED]))
def test_a_cancelled_paused_or_finished_run_is_never_restarted(world: tuple[RunView, AttemptObs | None],
                                                               state: RunState) -> None:
    view, obs = world
    view = replace(view, run=replace(view.run, state=state))
    effects = decide(view, obs, NOW)
    assert not [e for e in effects if isinstance(e, StartAttempt | AllocateNodes)]


@settings(max_examples=400, deadline=None)
@given(worlds())
def test_no_attempt_starts_after_the_budget_of_failures_without_progress(
        world: tuple[RunView, AttemptObs | None]) -> None:
    """Counted here from the definition (README, "Stop rules"), not from the policy's code:
    the failed attempts at the end of the history, an operator's stop or a success ending
    the count, those that never ran passed over, each failure counted only when the run
    got no newer checkpoint than it resumed from and it trained fewer than progress_steps."""
    view, obs = world
    effects = decide(view, obs, NOW)
    if not [e for e in effects if isinstance(e, StartAttempt)]:
        return
    ended_now = {e.number: e for e in effects if isinstance(e, EndAttempt)}
    policy = view.run.policy
    hardware = {f.attempt for f in view.faults if f.kind in (FaultKind.NODE_LOST, FaultKind.DEVICE)}
    newest = view.newest_checkpoint.step if view.newest_checkpoint else 0
    charged = 0
    for a in reversed(view.attempts):
        outcome = ended_now[a.number].outcome if a.number in ended_now else a.outcome
        final = ended_now[a.number].final_step if a.number in ended_now else a.final_step
        if a.number <= view.run.budget_from_attempt:
            break
        if outcome in (AttemptOutcome.ABORTED, AttemptOutcome.INTERRUPTED) or a.number in hardware:
            continue
        later = [b.resume_step for b in view.attempts if b.number > a.number]
        progressed = max([newest, *later]) > a.resume_step or (final or 0) - a.resume_step >= policy.progress_steps
        if outcome is not AttemptOutcome.FAILED or progressed:
            break
        charged += 1
    assert charged < policy.failures_without_progress
