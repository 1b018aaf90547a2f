"""The run's lifecycle: ``decide`` and the operator's commands.

``decide(view, obs, now)`` is the one entry point of the core for a run. It applies the
operator's commands, follows a stopping attempt until its processes are gone, judges the
live attempt (detection.py, attribution.py), and launches the next one when the run
wants one (recovery.py). Every state change goes through the table in transitions.py.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.domain import (
    TERMINAL_RUN_STATES,
    AdoptAttempt,
    Attempt,
    AttemptObs,
    AttemptOutcome,
    AttemptState,
    BringBackCheckpoints,
    Command,
    CommandHandled,
    CommandKind,
    DrainNode,
    Effect,
    Emit,
    EndAttempt,
    EnsureStopped,
    FaultKind,
    FinishRun,
    KillOrphans,
    MarkAttemptRunning,
    MarkFaultsRecovered,
    NodeState,
    ProbeNodes,
    ProcState,
    RecordFault,
    ReleaseNodes,
    ResumeRun,
    RunState,
    RunView,
    StopAttempt,
)
from supervisor.domain.events import EventKind
from supervisor.policy.attribution import all_gone, lemons, with_failed_nodes, within_budget
from supervisor.policy.detection import (
    find_fault,
    persistent_spikes,
    spike_rolled_back,
    transient_spikes,
)
from supervisor.policy.recovery import (
    data_to_skip,
    grow_back,
    judge_stragglers,
    launch,
    probe_idle_spares,
    probes_wanted,
    set_state,
)
from supervisor.policy.slowdown import judge_slowdown
from supervisor.policy.transitions import check_run

_ACTIVE = frozenset({RunState.PENDING, RunState.STARTING, RunState.RUNNING, RunState.RECOVERING})
_LAUNCHABLE = frozenset({RunState.PENDING, RunState.STARTING, RunState.RECOVERING})
_OVER_FOR_GOOD = frozenset({RunState.SUCCEEDED, RunState.CANCELLED})  # FAILED may be resumed


def decide(view: RunView, obs: AttemptObs | None, now: float) -> list[Effect]:
    if not view.cluster_answering:
        return []  # every decision may need the cluster (a stop, a drain, a launch): wait for it
    out: list[Effect] = []
    state = view.run.state
    live = view.current if view.current and view.current.state is not AttemptState.ENDED else None
    if live is not None and obs is not None:
        obs = with_failed_nodes(view, live, obs, now)

    if view.spec_error is not None and state not in TERMINAL_RUN_STATES:
        reason = f"the run's stored spec no longer validates: {view.spec_error}"
        check_run(state, RunState.FAILED)
        out.append(FinishRun(state=RunState.FAILED, reason=reason[:2000]))
        state = RunState.FAILED
    for cmd in view.commands:
        state, live = _apply_command(view, cmd, state, live, out)

    if any(isinstance(e, StopAttempt) for e in out):
        pass  # an operator's command stopped it this tick: nothing more to judge
    elif live is not None and live.state is not AttemptState.STOPPING and state not in _ACTIVE:
        # A run that is over (or paused) keeps no attempt training: stop what is left.
        out.append(_stop(live, AttemptOutcome.STOPPED, f"run is {state}", force=False))
        live = _stopping(live)
    elif live is not None and live.state is AttemptState.STOPPING:
        live = _finish_stopping(view, live, obs, now, out)
    elif live is not None:
        state, live = _judge_live_attempt(view, live, obs, state, now, out)

    drained_now = {e.node for e in out if isinstance(e, DrainNode)}
    probing = probes_wanted(view, drained_now, out)
    if live is None and view.precompile_aside is not None:
        out.append(BringBackCheckpoints(number=view.precompile_aside))
    if live is None and state in _LAUNCHABLE and not probing and not _launch_waits(view, out):
        state = launch(view, state, drained_now, out, now)

    holds_nodes = (any(n.state is NodeState.ALLOCATED for n in view.allocation)
                   or view.run.allocation_info is not None)  # a queued allocation holds no node yet
    if live is None and holds_nodes and state in TERMINAL_RUN_STATES:
        # A failed run may be resumed: it keeps its job's identity (the users' trainers key
        # their checkpoints on it), as a paused one does.
        out.append(ReleaseNodes(park=state is RunState.FAILED))
    elif live is None and view.run.parked_allocation is not None and state in _OVER_FOR_GOOD:
        out.append(ReleaseNodes())  # no resume will take the job kept for one
    elif live is None and holds_nodes and _paused_long(view, state, now):
        out.append(ReleaseNodes(park=True))
        grace = view.run.policy.pause_release_s
        out.append(Emit(kind=EventKind.ALLOCATION_RELEASED,
                        message=f"paused for {grace:g} s or more: its nodes go back to the cluster; "
                                "its job waits in the queue, held, and a resume goes on in it"))
    return out


def _launch_waits(view: RunView, out: list[Effect]) -> bool:
    """Whether the run launches nothing this tick though it wants an attempt, because this
    tick's view may not hold the checkpoint the next attempt needs:
    - its nodes are being probed;
    - an operator's resume from a chosen step: newer checkpoints are set aside first, and
      this tick's newest may be one of them;
    - the job's precompile pass ended this tick, or the run's checkpoints it kept aside are
      not back yet (supervisor/runfiles/precompile.py)."""
    going_back = any(isinstance(e, ResumeRun) and e.from_step is not None for e in out)
    current = view.current
    precompiled_now = current is not None and current.precompile is not None and any(
        isinstance(e, EndAttempt) and e.number == current.number for e in out)
    return view.probing or going_back or precompiled_now or view.precompile_aside is not None


def _paused_long(view: RunView, state: RunState, now: float) -> bool:
    """Paused, with its nodes idle for ``pause_release_s`` since the last attempt ended:
    on a shared cluster they go back to the queue, and `resume` asks for new ones."""
    stopping = view.current is not None and view.current.state is not AttemptState.ENDED
    if state is not RunState.PAUSED or stopping:
        return False  # (an attempt that ends this tick leaves its nodes idle from now)
    idle_since = max([view.run.created_at, *(a.ended_at for a in view.attempts if a.ended_at is not None)])
    return now - idle_since >= view.run.policy.pause_release_s


def _finish_stopping(
    view: RunView, live: Attempt, obs: AttemptObs | None, now: float, out: list[Effect]
) -> Attempt | None:
    """End a stopping attempt once its processes are gone; escalate, then abandon."""
    if all_gone(obs):
        out.append(_end(live, live.outcome or AttemptOutcome.FAILED, live.reason, obs))
        return None
    policy = view.run.policy
    waited_s = now - (live.stop_requested_at or now)
    if waited_s >= policy.stop_grace_s + policy.abandon_after_s:
        # Processes that outlive SIGKILL this long are stuck in the kernel (a hung
        # filesystem or driver): their nodes cannot train, and the run must go on.
        alive = (ProcState.RUNNING, ProcState.UNKNOWN)
        stuck = sorted({r.node for r in obs.ranks if r.proc in alive}) if obs else []
        why = f"processes survived SIGKILL for {waited_s:.0f} s on {', '.join(stuck) or 'unknown nodes'}"
        out.append(Emit(kind=EventKind.ATTEMPT_ABANDONED,
                        message=f"attempt {live.number}: {why}; abandoning it",
                        data={"attempt": live.number, "nodes": stuck}))
        for node in stuck:
            out.append(DrainNode(node=node, reason=f"training-supervisor: {why} ({view.run.run_id})",
                                 run_number=view.run.number))
        out.append(_end(live, live.outcome or AttemptOutcome.FAILED, f"{live.reason}; abandoned: {why}", obs))
        return None
    # A fault's stop is SIGKILL from the start; an operator's is SIGTERM, then SIGKILL
    # after the grace. Re-sent while processes live, so a stop lost in a crash recurs.
    if live.outcome is not AttemptOutcome.STOPPED or waited_s >= policy.stop_grace_s:
        out.append(EnsureStopped(number=live.number, force=True))
    return live


# --- operator commands --------------------------------------------------------------


def _apply_command(
    view: RunView, cmd: Command, state: RunState, live: Attempt | None, out: list[Effect]
) -> tuple[RunState, Attempt | None]:
    def reject(why: str) -> tuple[RunState, Attempt | None]:
        out.append(CommandHandled(command_id=cmd.id, result=f"rejected: {why}"))
        out.append(Emit(kind=EventKind.COMMAND_REJECTED, message=f"{cmd.kind} rejected: {why}"))
        return state, live

    def accept() -> None:
        out.append(CommandHandled(command_id=cmd.id, result="accepted"))
        out.append(Emit(kind=EventKind.COMMAND_ACCEPTED, message=f"{cmd.kind} accepted"))

    if cmd.kind in (CommandKind.CANCEL, CommandKind.PAUSE):
        if state not in _ACTIVE and not (cmd.kind is CommandKind.CANCEL and state is RunState.PAUSED):
            return reject(f"run is {state}")
        accept()
        if cmd.kind is CommandKind.CANCEL:
            new_state, verb = RunState.CANCELLED, "cancelled"
            check_run(state, new_state)
            out.append(FinishRun(state=new_state, reason="cancelled by operator"))
        else:
            verb = "paused"
            new_state = set_state(state, RunState.PAUSED, "paused by operator", out)
        if live is not None and live.state is not AttemptState.STOPPING:
            out.append(_stop(live, AttemptOutcome.STOPPED, f"run {verb} by operator", force=False))
            live = _stopping(live)
        return new_state, live

    if cmd.kind is CommandKind.RESTART:
        if state in (RunState.PAUSED, RunState.FAILED):
            return reject(f"run is {state}; resume it instead")
        if state in TERMINAL_RUN_STATES:
            return reject(f"run is {state}; submit it again as a new run")
        if live is None or live.state is AttemptState.STOPPING:
            return reject(f"no attempt is running (run is {state}); the next one starts by itself")
        accept()
        state = set_state(state, RunState.RECOVERING, "restarted by operator", out)
        out.append(_stop(live, AttemptOutcome.STOPPED, "restarted by operator", force=False))
        return state, _stopping(live)

    # RESUME
    if state not in (RunState.PAUSED, RunState.FAILED):
        if state in TERMINAL_RUN_STATES:
            return reject(f"run is {state}; submit it again as a new run")
        return reject(f"run is already {state}")
    accept()
    check_run(state, RunState.PENDING)
    at = "" if cmd.step is None else f" from the checkpoint of step {cmd.step}"
    out.append(ResumeRun(reason=f"resumed by operator{at}", from_step=cmd.step))
    return RunState.PENDING, live


# --- the live attempt ---------------------------------------------------------------


def _judge_live_attempt(
    view: RunView, live: Attempt, obs: AttemptObs | None, state: RunState, now: float, out: list[Effect],
) -> tuple[RunState, Attempt | None]:
    if obs is None:  # launched this very tick, or not observable yet
        return state, live
    if obs.orphans is not None:
        out.append(KillOrphans(number=live.number, launch_info=obs.orphans))
    if obs.found is not None:
        out.append(AdoptAttempt(number=live.number, launch_info=obs.found))
        out.append(Emit(kind=EventKind.ATTEMPT_ADOPTED, data={"attempt": live.number},
                        message=f"attempt {live.number}: found its processes running, adopted them"))
    if obs.never_started:
        if obs.launch_error is None:
            reason = "launch interrupted: no process of this attempt exists (supervisor restarted)"
            out.append(_end(live, AttemptOutcome.ABORTED, reason, obs))
            out.append(Emit(kind=EventKind.ATTEMPT_ABORTED, message=f"attempt {live.number}: {reason}"))
            return state, None
        out.append(RecordFault(kind=FaultKind.LAUNCH, attempt=live.number, ranks=(), nodes=(),
                               summary=obs.launch_error, step=live.resume_step))
        out.append(Emit(kind=EventKind.FAULT_DETECTED, message=f"launch: {obs.launch_error}",
                        data={"attempt": live.number}))
        out.append(_end(live, AttemptOutcome.FAILED, f"launch failed: {obs.launch_error}", obs))
        if obs.launch_fatal:  # what cannot be executed will not be by a restart
            check_run(state, RunState.FAILED)
            out.append(FinishRun(state=RunState.FAILED,
                                 reason=f"not retrying: the command cannot be executed: "
                                                               f"{obs.launch_error}"))
            return RunState.FAILED, None
        return set_state(state, RunState.RECOVERING, f"launch failed: {obs.launch_error}", out), None

    if obs.result is not None and all_gone(obs) and live.precompile is not None:
        out.append(_end(live, AttemptOutcome.SUCCEEDED, "precompile pass finished", obs))
        out.append(Emit(kind=EventKind.PRECOMPILED,
                        data={"attempt": live.number, "precompile": live.precompile},
                        message=f"attempt {live.number}: the precompile pass finished; training starts next"))
        return state, None  # the next attempt once the run's checkpoints are back (decide)
    # A loss that went NaN before the trainer finished is judged as at any other tick (a
    # rollback), however fast the trainer ran on to its end.
    if obs.result is not None and all_gone(obs) and not any(r.nonfinite_step is not None for r in obs.ranks):
        res = obs.result
        if view.open_faults:  # it finished before a tick saw a step of it (a short last stretch)
            out.append(MarkFaultsRecovered())
        out.append(_end(live, AttemptOutcome.SUCCEEDED, "trainer finished", obs))
        check_run(state, RunState.SUCCEEDED)
        out.append(FinishRun(state=RunState.SUCCEEDED, reason=f"trainer finished at step {res.final_step}",
                             final_step=res.final_step, model_digest=res.model_digest))
        return RunState.SUCCEEDED, None

    found = find_fault(view, live, obs, now)
    if found is not None:
        record = found.record
        out.append(record)
        out.append(Emit(kind=EventKind.FAULT_DETECTED, message=f"{record.kind}: {record.summary}",
                        data={"attempt": live.number, "step": record.step, "ranks": list(record.ranks),
                              "nodes": list(record.nodes)}))
        wanted = [*found.drains, *lemons(view, record, {n for n, _ in found.drains}, now)]
        drains, held_back = within_budget(view, live, wanted, now)
        for node, reason in drains:
            out.append(DrainNode(node=node, reason=reason, run_number=view.run.number))
        if held_back:
            policy = view.run.policy
            out.append(Emit(kind=EventKind.DRAIN_HELD, message=(
                f"not draining {', '.join(held_back)}: over the drain budget ({policy.drains_per_fault} a "
                f"fault, {policy.drains_per_window} in {policy.drain_window_s:g} s); probing them instead"),
                data={"attempt": live.number, "nodes": held_back}))
            out.append(ProbeNodes(nodes=tuple(held_back), kind="diagnosis"))
        skip = data_to_skip(view, live, obs, record)
        if skip is not None:
            out.append(skip)
        outcome = AttemptOutcome.INTERRUPTED if found.interrupted else AttemptOutcome.FAILED
        out.append(_stop(live, outcome, f"{record.kind}: {record.summary}", force=True))
        if found.do_not_retry:
            check_run(state, RunState.FAILED)
            out.append(FinishRun(state=RunState.FAILED, reason=f"not retrying: {record.summary}",
                                 final_step=record.step))
            return RunState.FAILED, _stopping(live)
        if state in _ACTIVE:
            state = set_state(state, RunState.RECOVERING, f"{record.kind}: {record.summary}", out)
        return state, _stopping(live)

    if live.precompile is not None:
        return state, live  # its steps train nothing: no recovery, straggler or growth is judged on them
    if live.first_step_at is None and any(r.last_step > live.resume_step for r in obs.ranks):
        out.append(MarkAttemptRunning(number=live.number))
        if view.open_faults:
            out.append(MarkFaultsRecovered())
        if state in (RunState.STARTING, RunState.RECOVERING):
            step = max(r.last_step for r in obs.ranks)
            state = set_state(state, RunState.RUNNING, f"training at step {step}", out)
    _report_transient_spikes(view, live, obs, out)
    state, live_now = judge_stragglers(view, live, obs, state, out)
    if live_now is not None and live_now.state is not AttemptState.STOPPING:
        state, live_now = judge_slowdown(view, live_now, obs, state, out)
    if live_now is not None and live_now.state is not AttemptState.STOPPING:
        if live_now.state is AttemptState.RUNNING:
            probe_idle_spares(view, now, out)
        return grow_back(view, live_now, state, out)
    return state, live_now


def _report_transient_spikes(view: RunView, live: Attempt, obs: AttemptObs, out: list[Effect]) -> None:
    """Spikes too short to act on are counted and reported: an event each, once; so is a
    spike back after its rollback in a trainer that cannot skip its data."""
    persist = view.run.policy.spike_persist_steps
    for spike in transient_spikes(obs.recent, view.run.policy):
        if spike.step not in view.spikes_said:
            out.append(Emit(kind=EventKind.SPIKE_TRANSIENT,
                            message=f"{spike.summary}: not acted on (shorter than {persist} steps)",
                            data={"attempt": live.number, "step": spike.step, "steps": spike.steps}))
    if not spike_rolled_back(view, live):
        return
    for spike in persistent_spikes(obs.recent, view.run.policy):
        if spike.step not in view.spikes_said:
            out.append(Emit(kind=EventKind.SPIKE_PERSISTS, message=(
                f"{spike.summary}: back after its rollback, and the trainer cannot skip data (its command "
                "names no {skip_to_step}): training on, not rolling back again"),
                data={"attempt": live.number, "step": spike.step, "steps": spike.steps}))


def _stop(live: Attempt, outcome: AttemptOutcome, reason: str, *, force: bool) -> StopAttempt:
    return StopAttempt(number=live.number, outcome=outcome, reason=reason, force=force)


def _stopping(live: Attempt) -> Attempt:
    return replace(live, state=AttemptState.STOPPING)


def _end(live: Attempt, outcome: AttemptOutcome, reason: str, obs: AttemptObs | None) -> EndAttempt:
    steps = [r.last_step for r in obs.ranks] if obs else []
    final = max(steps) if steps else live.final_step
    return EndAttempt(number=live.number, outcome=outcome, reason=reason, final_step=final)
