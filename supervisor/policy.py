"""Every rule that decides what happens to a run lives in this file.

``decide(view, obs, now)`` takes one run's recorded state (``RunView``), what the
reconciler observed of its live attempt this tick (``AttemptObs``), and the time, and
returns the effects to persist and carry out. It does no I/O and reads no clock, so
every rule is unit-tested with plain values (tests/unit/test_policy.py).

Run transitions (state, condition -> next state: effects):

    any active      cancel command           -> CANCELLED:   StopAttempt
    any active      pause command            -> PAUSED:      StopAttempt
    PAUSED, FAILED  resume command           -> PENDING     (restart budget starts afresh)
    STARTING, RUNNING, RECOVERING with a live attempt
                    restart command          -> RECOVERING:  StopAttempt (not a failure: no budget)
    PENDING, STARTING, RECOVERING with no live attempt:
                    nodes being probed       -> (same): nothing until their results are in
                    restart budget exhausted -> FAILED
                    fewer healthy nodes than needed -> (same):  AllocateNodes
                    otherwise                -> STARTING:    StartAttempt (newest complete checkpoint)
    STARTING, RECOVERING  first step seen    -> RUNNING:     MarkAttemptRunning, MarkFaultsRecovered
    STARTING, RUNNING
                    result written, ranks gone -> SUCCEEDED: EndAttempt, FinishRun
                    a fault                  -> RECOVERING:  RecordFault, StopAttempt, DrainNode*
                    a fault, exit code 2 or 5 -> FAILED:     RecordFault, StopAttempt (do not retry)

Attempts: LAUNCHING -> RUNNING (the reconciler, once processes exist) -> STOPPING
(StopAttempt) -> ENDED (EndAttempt, once no process of it is left, or abandoned with its
nodes drained when processes outlive SIGKILL by ``abandon_after_s``). With ``[health]
diagnose``, a FAILED attempt's nodes that the run still holds are probed (ProbeNodes)
before the next launch. A terminal run with no live attempt gives its nodes back
(ReleaseNodes).

Attribution rules (what a fault blames):
- a fault is attributed once every rank is gone, or ``fault_settle_s`` after the
  first death was seen, whichever comes first: processes of one node killed together
  are not reaped together, and judging the first one alone would blame a rank;
- a node is blamed, and drained, only when EVERY rank on it vanished abruptly in the
  same observation: killed by SIGKILL, or gone with no exit report of its own. One
  rank's crash never drains a node;
- a node the run no longer holds (the cluster ended or shrank the allocation) is
  never blamed: its ranks died because the allocation did;
- a node is also blamed and drained when EVERY rank on it has been silent (no message,
  heartbeats included) for ``silence_timeout_s`` while ranks on other nodes are heard
  and the supervisor's broker link has been up that long: a node that froze or lost
  its network, found in seconds rather than after Slurm's SlurmdTimeout;
- a rank the launcher cannot see (UNKNOWN: a Slurm step's rank) is dead when its last
  will arrived or it reported a failed exit, and gone when it reported any exit;
- a rank that exited with code 4 (its device failed) gets its node drained with the
  trainer's words; code 3 (the checkpoint it resumed from is unreadable) blames the
  checkpoint, never resumed from again, and no node;
- otherwise the fault blames the ranks that died first: those killed by a signal or
  gone without a report; failing that, the earliest self-reported exit;
- a node blamed in ``lemon_faults`` distinct faults (of any run) within
  ``lemon_window_s`` is a lemon, and drained;
- a straggler (a rank whose own compute per step stays above the typical rank's) is
  reported, not acted on: its node is left out of the next attempt when another held
  node can take its place, and only ``straggler_restart`` makes it a fault.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from statistics import median, median_low

import tenacity

from supervisor.domain import (
    TERMINAL_RUN_STATES,
    AllocateNodes,
    Attempt,
    AttemptObs,
    AttemptOutcome,
    AttemptState,
    Command,
    CommandHandled,
    CommandKind,
    DrainNode,
    Effect,
    Emit,
    EndAttempt,
    EnsureStopped,
    FaultKind,
    FaultRecord,
    FinishRun,
    MarkAttemptRunning,
    MarkFaultsRecovered,
    NodeState,
    Policy,
    ProbeNodes,
    ProcState,
    RankObs,
    RecordFault,
    ReleaseNodes,
    ResumeRun,
    RunState,
    RunView,
    SetRunState,
    SkipData,
    StartAttempt,
    StepSample,
    StopAttempt,
    run_id_of,
)

# Trainer exit codes with a meaning (trainer/README.md, trainer/errors.py). Any other
# failure is retried from the newest checkpoint.
EXIT_DO_NOT_RETRY = frozenset({2})  # configuration or usage error: a restart cannot fix it -> FAILED
EXIT_CHECKPOINT_UNREADABLE = 3  # resume from the checkpoint before the one that failed to load
EXIT_DEVICE_FAULT = 4  # the rank's accelerator failed: drain its node, restart on a spare
EXIT_STORAGE_FULL = 5  # no checkpoint can be written (disk full): FAILED until an operator frees space

_ACTIVE = frozenset({RunState.PENDING, RunState.STARTING, RunState.RUNNING, RunState.RECOVERING})
_LAUNCHABLE = frozenset({RunState.PENDING, RunState.STARTING, RunState.RECOVERING})


def decide(view: RunView, obs: AttemptObs | None, now: float) -> list[Effect]:
    out: list[Effect] = []
    state = view.run.state
    live = view.current if view.current and view.current.state is not AttemptState.ENDED else None

    for cmd in view.commands:
        state, live = _apply_command(view, cmd, state, live, out)

    stopped_now = any(isinstance(e, StopAttempt) for e in out)
    if stopped_now:
        pass  # an operator's command stopped it this tick: nothing more to judge
    elif live is not None and live.state is AttemptState.STOPPING:
        live = _finish_stopping(view, live, obs, now, out)
    elif live is not None and live.state is not AttemptState.STOPPING:
        state, live = _judge_live_attempt(view, live, obs, state, now, out)

    drained_now = {e.node for e in out if isinstance(e, DrainNode)}
    diagnosing = _diagnose(view, drained_now, out)
    if live is None and state in _LAUNCHABLE and not diagnosing and not view.probing:
        state = _launch(view, state, drained_now, out, now)

    holds_nodes = (any(n.state is NodeState.ALLOCATED for n in view.allocation)
                   or view.run.allocation_info is not None)  # a queued allocation holds no node yet
    if live is None and state in TERMINAL_RUN_STATES and holds_nodes:
        out.append(ReleaseNodes())
    return out


def _finish_stopping(
    view: RunView, live: Attempt, obs: AttemptObs | None, now: float, out: list[Effect]
) -> Attempt | None:
    """End a stopping attempt once its processes are gone; escalate, then abandon."""
    if _all_gone(obs):
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
        out.append(Emit(kind="attempt.abandoned", message=f"attempt {live.number}: {why}; abandoning it",
                        data={"attempt": live.number, "nodes": stuck}))
        for node in stuck:
            out.append(DrainNode(node=node, reason=f"training-supervisor: {why} ({view.run.run_id})"))
        out.append(_end(live, live.outcome or AttemptOutcome.FAILED, f"{live.reason}; abandoned: {why}", obs))
        return None
    # A fault's stop is SIGKILL from the start; an operator's is SIGTERM, then SIGKILL
    # after the grace. Re-sent while processes live, so a stop lost in a crash recurs.
    if live.outcome is AttemptOutcome.FAILED or waited_s >= policy.stop_grace_s:
        out.append(EnsureStopped(number=live.number, force=True))
    return live


def _diagnose(view: RunView, drained_now: set[str], out: list[Effect]) -> bool:
    """After a failed attempt ends, probe its nodes that the run still holds (and has not
    just drained) before anything launches on them. True when a probe was asked for."""
    if not view.diagnose:
        return False
    failed = {e.number for e in out if isinstance(e, EndAttempt) and e.outcome is AttemptOutcome.FAILED}
    held = {n.name for n in view.allocation if n.state is NodeState.ALLOCATED}
    suspects = sorted({node for a in view.attempts if a.number in failed for node in a.nodes
                       if node in held and node not in drained_now})
    if suspects:
        out.append(ProbeNodes(nodes=tuple(suspects), kind="diagnosis"))
    return bool(suspects)


# --- operator commands --------------------------------------------------------------


def _apply_command(
    view: RunView, cmd: Command, state: RunState, live: Attempt | None, out: list[Effect]
) -> tuple[RunState, Attempt | None]:
    def reject(why: str) -> tuple[RunState, Attempt | None]:
        out.append(CommandHandled(command_id=cmd.id, result=f"rejected: {why}"))
        out.append(Emit(kind="command.rejected", message=f"{cmd.kind} rejected: {why}"))
        return state, live

    def accept() -> None:
        out.append(CommandHandled(command_id=cmd.id, result="accepted"))
        out.append(Emit(kind="command.accepted", message=f"{cmd.kind} accepted"))

    if cmd.kind in (CommandKind.CANCEL, CommandKind.PAUSE):
        if state not in _ACTIVE and not (cmd.kind is CommandKind.CANCEL and state is RunState.PAUSED):
            return reject(f"run is {state}")
        accept()
        if cmd.kind is CommandKind.CANCEL:
            new_state, verb = RunState.CANCELLED, "cancelled"
            out.append(FinishRun(state=new_state, reason="cancelled by operator"))
        else:
            new_state, verb = RunState.PAUSED, "paused"
            out.append(SetRunState(state=new_state, reason="paused by operator"))
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
        out.append(SetRunState(state=RunState.RECOVERING, reason="restarted by operator"))
        out.append(_stop(live, AttemptOutcome.STOPPED, "restarted by operator", force=False))
        return RunState.RECOVERING, _stopping(live)

    # RESUME
    if state not in (RunState.PAUSED, RunState.FAILED):
        if state in TERMINAL_RUN_STATES:
            return reject(f"run is {state}; submit it again as a new run")
        return reject(f"run is already {state}")
    accept()
    out.append(ResumeRun(reason="resumed by operator"))
    return RunState.PENDING, live


# --- the live attempt ---------------------------------------------------------------


def _judge_live_attempt(
    view: RunView,
    live: Attempt,
    obs: AttemptObs | None,
    state: RunState,
    now: float,
    out: list[Effect],
) -> tuple[RunState, Attempt | None]:
    if obs is None:  # launched this very tick, or not observable yet
        return state, live
    if obs.never_started:
        if obs.launch_error is None:
            reason = "launch interrupted: no process of this attempt exists (supervisor restarted)"
            out.append(_end(live, AttemptOutcome.ABORTED, reason, obs))
            out.append(Emit(kind="attempt.aborted", message=f"attempt {live.number}: {reason}"))
            return state, None
        record = RecordFault(
            kind=FaultKind.LAUNCH, attempt=live.number, ranks=(), nodes=(),
            summary=obs.launch_error, step=live.resume_step,
        )
        out.append(record)
        out.append(Emit(kind="fault.detected", message=f"launch: {obs.launch_error}",
                        data={"attempt": live.number}))
        out.append(_end(live, AttemptOutcome.FAILED, f"launch failed: {obs.launch_error}", obs))
        if state is not RunState.RECOVERING:
            out.append(SetRunState(state=RunState.RECOVERING, reason=f"launch failed: {obs.launch_error}"))
        return RunState.RECOVERING, None

    if obs.result is not None and _all_gone(obs):
        res = obs.result
        out.append(_end(live, AttemptOutcome.SUCCEEDED, "trainer finished", obs))
        out.append(
            FinishRun(
                state=RunState.SUCCEEDED,
                reason=f"trainer finished at step {res.final_step}",
                final_step=res.final_step,
                model_digest=res.model_digest,
            )
        )
        return RunState.SUCCEEDED, None

    fault = _find_fault(view, live, obs, now)
    if fault is not None:
        record, drains, do_not_retry = fault
        out.append(record)
        out.append(
            Emit(
                kind="fault.detected",
                message=f"{record.kind}: {record.summary}",
                data={"attempt": live.number, "step": record.step, "ranks": list(record.ranks),
                      "nodes": list(record.nodes)},
            )
        )
        for node, reason in [*drains, *_lemons(view, record, {n for n, _ in drains}, now)]:
            out.append(DrainNode(node=node, reason=reason))
        skip = _data_to_skip(view, live, obs, record)
        if skip is not None:
            out.append(skip)
        out.append(_stop(live, AttemptOutcome.FAILED, f"{record.kind}: {record.summary}", force=True))
        if do_not_retry:
            reason = f"not retrying: {record.summary}"
            out.append(FinishRun(state=RunState.FAILED, reason=reason, final_step=record.step))
            return RunState.FAILED, _stopping(live)
        if state is not RunState.RECOVERING and state in _ACTIVE:
            out.append(SetRunState(state=RunState.RECOVERING, reason=f"{record.kind}: {record.summary}"))
            state = RunState.RECOVERING
        return state, _stopping(live)

    if live.first_step_at is None and any(r.last_step > live.resume_step for r in obs.ranks):
        out.append(MarkAttemptRunning(number=live.number))
        if view.open_faults:
            out.append(MarkFaultsRecovered())
        if state in (RunState.STARTING, RunState.RECOVERING):
            step = max(r.last_step for r in obs.ranks)
            out.append(SetRunState(state=RunState.RUNNING, reason=f"training at step {step}"))
            state = RunState.RUNNING
    return _judge_stragglers(view, live, obs, state, out)


FaultFinding = tuple[RecordFault, list[tuple[str, str]], bool]


def _find_fault(view: RunView, live: Attempt, obs: AttemptObs, now: float) -> FaultFinding | None:
    step = max((r.last_step for r in obs.ranks), default=live.resume_step)
    dead = [r for r in obs.ranks if _is_dead(r)]
    if dead:
        first_seen = min(r.dead_since if r.dead_since is not None else now for r in dead)
        if now - first_seen < view.run.policy.fault_settle_s and not _all_gone(obs):
            return None  # let ranks that die together (a node) show themselves first
        return _attribute(view, live, obs.ranks, dead, step)
    poisoned = [r for r in obs.ranks if r.nonfinite_step is not None]
    if poisoned:
        at = min(r.nonfinite_step for r in poisoned if r.nonfinite_step is not None)
        again = any(f.kind is FaultKind.NONFINITE and f.step == at and f.attempt < live.number
                    for f in view.faults)
        record = RecordFault(
            kind=FaultKind.NONFINITE, attempt=live.number, ranks=(), nodes=(), step=at,
            summary=f"loss or grad norm not finite at step {at} (ranks {_ranks(poisoned)}): rolling back to "
                    f"the newest checkpoint before step {at}" + ("; again at this step: skipping its data"
                                                                 if again else ""),
        )
        return record, [], False
    spike = find_spike(obs.recent, view.run.policy)
    if spike is not None:
        record = RecordFault(kind=FaultKind.SPIKE, attempt=live.number, ranks=(), nodes=(), step=spike.step,
                             summary=spike.summary)
        return record, [], False
    silent = _find_silent_node(view, live, obs, now, step)
    if silent is not None:
        return silent
    if obs.ranks and all(r.proc in (ProcState.EXITED, ProcState.VANISHED) for r in obs.ranks):
        record = RecordFault(
            kind=FaultKind.NO_RESULT, attempt=live.number, ranks=(), nodes=(), step=step,
            summary="every rank exited 0 but the trainer wrote no result",
        )
        return record, [], False
    return _find_hang(view, live, obs, now, step)


def _find_silent_node(
    view: RunView, live: Attempt, obs: AttemptObs, now: float, step: int
) -> FaultFinding | None:
    """Every rank of a node silent past the limit while other nodes' ranks are heard.

    Judged only while the supervisor's own broker link has been up for longer than the
    limit (after a reconnect, heartbeats need time to arrive again), and never when
    every node is silent: that is the broker or the link, not the nodes.
    """
    limit_s = view.run.policy.silence_timeout_s
    if obs.telemetry_up_since is None or now - obs.telemetry_up_since <= limit_s:
        return None

    def silent(r: RankObs) -> bool:
        return (r.last_seen_at is not None and now - r.last_seen_at > limit_s
                and r.reported_exit_code is None and r.proc not in (ProcState.EXITED, ProcState.VANISHED))

    by_node = _by_node(obs.ranks)
    held = {n.name for n in view.allocation if n.state is NodeState.ALLOCATED}
    quiet = sorted(n for n, rs in by_node.items() if n in held and all(silent(r) for r in rs))
    if not quiet or len(quiet) == len(by_node):
        return None
    blamed = [r for r in obs.ranks if r.node in quiet]
    heard_s = now - max(r.last_seen_at or now for r in blamed)
    where = f"{view.run.run_id}, attempt {live.number}, step {step}"
    summary = (f"every rank of node {', '.join(quiet)} silent for {heard_s:.0f} s while the others are heard "
               f"(ranks {_ranks(blamed)}): node lost")
    record = RecordFault(kind=FaultKind.NODE_LOST, attempt=live.number, ranks=tuple(r.rank for r in blamed),
                         nodes=tuple(quiet), summary=summary, step=step)
    why = f"training-supervisor: node silent, no heartbeat from any rank for {heard_s:.0f} s ({where})"
    drains = [(n, why) for n in quiet]
    return record, drains, False


def hang_limit(policy: Policy, obs: AttemptObs, first_step_seen: bool) -> tuple[float, str]:
    """How long without step progress is a hang, and why that long.

    - a rank in a slow phase it announced gets that phase's allowance: init, compile and
      restore ``startup_timeout_s`` (also before the first step); checkpoint save
      max(``hang_floor_s``, ``hang_k`` x the slowest recent save) once a save was timed,
      ``checkpoint_timeout_s`` before (and at most); evaluation ``eval_timeout_s``;
    - while training, once ``hang_min_samples`` step times are known: max(``hang_floor_s``,
      ``hang_k`` x the p99 step time), at most ``hang_timeout_s``;
    - before that, ``hang_timeout_s``.
    """
    phases = {r.phase for r in obs.ranks}
    if not first_step_seen or phases & {"init", "compile", "restore"}:
        return policy.startup_timeout_s, "startup allowance"
    if "checkpoint" in phases:
        saved = obs.checkpoint_p99_s
        if saved is None:
            return policy.checkpoint_timeout_s, "checkpoint allowance"
        limit = min(policy.checkpoint_timeout_s, max(policy.hang_floor_s, policy.hang_k * saved))
        k, floor = policy.hang_k, policy.hang_floor_s
        return limit, f"checkpoint allowance: max({floor:g} s, {k:g} x slowest save {saved:.2f} s)"
    if "eval" in phases:
        return policy.eval_timeout_s, "evaluation allowance"
    p99 = obs.step_time_p99_s
    if p99 is not None and obs.step_time_samples >= policy.hang_min_samples:
        limit = min(policy.hang_timeout_s, max(policy.hang_floor_s, policy.hang_k * p99))
        return limit, f"adaptive hang timeout: max({policy.hang_floor_s:g} s, {policy.hang_k:g} x p99 step " \
                      f"time {p99:.3f} s)"
    return policy.hang_timeout_s, "hang timeout"


def _find_hang(
    view: RunView, live: Attempt, obs: AttemptObs, now: float, step: int
) -> FaultFinding | None:
    """No progress for too long (``hang_limit``), judged only while telemetry flows.

    While the broker link is down no verdict is given, and after it comes back the
    clock starts again from the moment it did: a broker outage is never a hang. The
    fault names the ranks that stalled first (``stalled_first``) and their nodes, and
    drains nothing: a stalled rank is no evidence against its node.
    """
    if obs.telemetry_up_since is None or live.started_at is None:
        return None
    limit_s, what = hang_limit(view.run.policy, obs, live.first_step_at is not None)
    progress = [r.progress_at for r in obs.ranks if r.progress_at is not None]
    since = max([live.started_at, obs.telemetry_up_since, *progress])
    if live.first_step_at is not None:
        since = max(since, live.first_step_at)
    idle_s = now - since
    if idle_s <= limit_s or _node_going_silent(view, obs, now):
        return None
    first = stalled_first(obs.ranks)
    nodes = tuple(sorted({r.node for r in first}))
    who = f"; stalled first: ranks {_ranks(first)} on {', '.join(nodes)}" if first else ""
    record = RecordFault(
        kind=FaultKind.HANG, attempt=live.number, ranks=tuple(r.rank for r in first), nodes=nodes, step=step,
        summary=f"no step progress for {idle_s:.0f} s ({what} {limit_s:.0f} s), last step {step}{who}",
    )
    return record, [], False


STALL_GAP_S = 5.0  # a rank unheard this much longer than the most recently heard one stalled first


def _node_going_silent(view: RunView, obs: AttemptObs, now: float) -> bool:
    """Every rank of some node unheard for STALL_GAP_S while other nodes are heard, for
    less than the silence limit (and a grace): the silence rule will judge it a lost node
    and drain it; a hang verdict now would blame no one."""
    by_node = _by_node(obs.ranks)
    if len(by_node) < 2:
        return False
    quiet_for = {n: now - max(r.last_seen_at or 0.0 for r in rs) for n, rs in by_node.items()}
    heard = [n for n, q in quiet_for.items() if q <= STALL_GAP_S]
    limit = view.run.policy.silence_timeout_s + STALL_GAP_S
    return bool(heard) and any(STALL_GAP_S < q <= limit for q in quiet_for.values())


def stalled_first(ranks: Iterable[RankObs]) -> list[RankObs]:
    """The ranks a hang began with: those behind the others in steps; failing that, those
    that fell silent (no heartbeat) well before the rest. Empty when all stalled together."""
    rs = list(ranks)
    if not rs:
        return []
    behind = min(r.last_step for r in rs)
    laggards = [r for r in rs if r.last_step == behind]
    if len(laggards) < len(rs):
        return laggards
    heard = [r.last_seen_at for r in rs if r.last_seen_at is not None]
    if not heard:
        return []
    newest = max(heard)
    silent = [r for r in rs if r.last_seen_at is None or newest - r.last_seen_at > STALL_GAP_S]
    return silent if len(silent) < len(rs) else []


def _attribute(
    view: RunView, live: Attempt, ranks: Iterable[RankObs], dead: list[RankObs], step: int
) -> FaultFinding:
    by_node = _by_node(ranks)
    # A node the run no longer holds (Slurm ended or shrank the allocation: preemption,
    # a time limit, scancel) is not to blame: its ranks died because the allocation did.
    held = {n.name for n in view.allocation if n.state is NodeState.ALLOCATED}
    lost_nodes = sorted(n for n, rs in by_node.items()
                        if n in held and all(_vanished_abruptly(r) for r in rs))
    released = sorted(n for n in by_node if n not in held)
    do_not_retry = any(_exit_code(r) in EXIT_DO_NOT_RETRY for r in dead)
    where = f"{view.run.run_id}, attempt {live.number}, step {step}"

    if lost_nodes:
        blamed = [r for r in dead if r.node in lost_nodes]
        summary = (
            f"every rank of node {', '.join(lost_nodes)} vanished at once "
            f"(ranks {_ranks(blamed)}): node lost"
        )
        drains = [(n, f"training-supervisor: node lost, all its ranks vanished at once ({where})")
                  for n in lost_nodes]
        record = RecordFault(
            kind=FaultKind.NODE_LOST, attempt=live.number, ranks=tuple(r.rank for r in blamed),
            nodes=tuple(lost_nodes), summary=summary, step=step,
        )
        return record, drains, do_not_retry

    broken = [r for r in dead if _exit_code(r) == EXIT_DEVICE_FAULT]
    if broken:  # the trainer's own word that a device failed: evidence enough to drain
        nodes = sorted({r.node for r in broken if r.node in held})
        drains = []
        for n in nodes:
            words = "; ".join(r.reported_reason for r in broken if r.node == n) or "exit code 4"
            reason = f"training-supervisor: device fault reported by the trainer: {words} ({where})"
            drains.append((n, reason[:500]))
        summary = "device fault (exit code 4): " + "; ".join(_describe_exit(r) for r in broken)
        record = RecordFault(kind=FaultKind.DEVICE, attempt=live.number, ranks=tuple(r.rank for r in broken),
                             nodes=tuple(nodes), summary=summary, step=step)
        return record, drains, False
    full = [r for r in dead if _exit_code(r) == EXIT_STORAGE_FULL]
    if full:  # every later save would fail the same way: stop, keep what is saved, say why
        summary = (f"checkpoint storage full (exit code 5): {_describe_exit(full[0])}; "
                   f"free space, then resume the run")
        record = RecordFault(kind=FaultKind.STORAGE, attempt=live.number, ranks=tuple(r.rank for r in full),
                             nodes=(), summary=summary, step=step)
        return record, [], True
    unreadable = [r for r in dead if _exit_code(r) == EXIT_CHECKPOINT_UNREADABLE]
    if unreadable and live.resume_from is not None:
        summary = (f"the checkpoint at step {live.resume_step} cannot be read "
                   f"({_describe_exit(unreadable[0])}): resuming from an older one")
        record = RecordFault(kind=FaultKind.CHECKPOINT, attempt=live.number, nodes=(), summary=summary,
                             ranks=tuple(r.rank for r in unreadable), step=live.resume_step)
        return record, [], False

    first = [r for r in dead if _vanished_abruptly(r) or (_exit_code(r) or 0) < 0]
    if first:  # of those killed, the ones seen dead first
        def seen(r: RankObs) -> float:
            return r.dead_since if r.dead_since is not None else math.inf

        t0 = min(seen(r) for r in first)
        first = [r for r in first if seen(r) == t0]
    else:
        reported = [r for r in dead if r.reported_exit_at is not None]
        if reported:
            t0 = min(r.reported_exit_at for r in reported if r.reported_exit_at is not None)
            first = [r for r in reported if r.reported_exit_at == t0]
        else:
            first = dead
    summary = "; ".join(_describe_exit(r) for r in first)
    if len(dead) > len(first):
        summary += f" (then {len(dead) - len(first)} more rank(s) exited)"
    if do_not_retry:
        summary = f"trainer reported a configuration error (exit code 2): {summary}"
    elif released and len(released) == len(by_node):
        summary = f"the allocation ended under the attempt (nodes {', '.join(released)} released): {summary}"
    record = RecordFault(
        kind=FaultKind.RANK_EXIT, attempt=live.number, ranks=tuple(r.rank for r in first),
        nodes=tuple(sorted({r.node for r in first})), summary=summary, step=step,
    )
    return record, [], do_not_retry


def _by_node(ranks: Iterable[RankObs]) -> dict[str, list[RankObs]]:
    by_node: dict[str, list[RankObs]] = {}
    for r in ranks:
        by_node.setdefault(r.node, []).append(r)
    return by_node


def _exit_code(r: RankObs) -> int | None:
    return r.exit_code if r.exit_code is not None else r.reported_exit_code


def _is_dead(r: RankObs) -> bool:
    """Died unsuccessfully. A clean exit 0 is not a death; UNKNOWN is never a death
    unless the rank's last will says its connection broke or it reported a failed exit."""
    if r.proc is ProcState.EXITED:
        return r.exit_code != 0
    if r.proc is ProcState.VANISHED:
        return r.reported_exit_code != 0
    if r.proc is ProcState.UNKNOWN:
        # The launcher cannot see the process (a Slurm step's ranks): the rank's own
        # exit report, or its last will, is the evidence.
        return r.lost or (r.reported_exit_code is not None and r.reported_exit_code != 0)
    return False


def _vanished_abruptly(r: RankObs) -> bool:
    """Killed outright: SIGKILL seen, or its connection died with no exit report.

    A VANISHED rank (adopted after a daemon restart, so no exit code) counts only with
    its last will as evidence: ranks that ended while the daemon was down left no
    trace of how, and that is no reason to drain their nodes.
    """
    if r.proc is ProcState.EXITED:
        return r.exit_code == -signal.SIGKILL
    if r.proc in (ProcState.VANISHED, ProcState.UNKNOWN):
        return r.lost and r.reported_exit_code is None
    return False


def _describe_exit(r: RankObs) -> str:
    who = f"rank {r.rank} (node {r.node})"
    code = _exit_code(r)
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"{who} killed by {name}"
    if code is not None:
        text = f"{who} exited with code {code}"
        return f"{text}: {r.reported_reason}" if r.reported_reason else text
    return f"{who} vanished without an exit report"


def _ranks_of(numbers: Iterable[int]) -> str:
    return ", ".join(str(n) for n in sorted(numbers))


def _ranks(rs: Iterable[RankObs]) -> str:
    return _ranks_of(r.rank for r in rs)


# --- launching ----------------------------------------------------------------------


def _launch(view: RunView, state: RunState, drained_now: set[str], out: list[Effect], now: float) -> RunState:
    run = view.run
    ended_now = {e.number: e.outcome for e in out if isinstance(e, EndAttempt)}  # this very tick
    failures = sum(
        1 for a in view.attempts
        if ended_now.get(a.number, a.outcome) is AttemptOutcome.FAILED and a.number > run.budget_from_attempt
    )
    streak = _failed_streak(view, ended_now)
    stop = _crash_loop(view, streak, out) or _no_progress(view, streak)
    if stop is None and failures > run.policy.max_restarts:
        limit = run.policy.max_restarts
        stop = f"restart budget exhausted: {failures} failed attempts (max_restarts={limit})"
    if stop is not None:
        out.append(FinishRun(state=RunState.FAILED, reason=stop))
        return RunState.FAILED
    wait_s, stuck = backoff(view, streak)
    if wait_s > 0:
        last = streak[-1]
        ready_at = (last.ended_at if last.ended_at is not None else now) + wait_s
        if last.number in ended_now:  # said once, when the attempt ends
            out.append(Emit(kind="attempt.backoff",
                            message=f"{stuck} failed attempts in a row resumed from step {last.resume_step}: "
                                    f"waiting {wait_s:.0f} s before the next",
                            data={"wait_s": wait_s, "failures_in_a_row": stuck}))
        if now < ready_at:
            return state

    healthy = [n.name for n in view.allocation
               if n.state is NodeState.ALLOCATED and n.name not in drained_now]
    if len(healthy) < run.nodes:
        # Level 2 of recovery: not enough healthy nodes in hand, ask for more.
        out.append(AllocateNodes(count=run.nodes + run.spares - len(healthy)))
        return state

    # Keep the previous attempt's healthy nodes in their places, fill up with spares; a
    # node that straggled in it goes last (a spare again), unless it is needed.
    previous = view.current.nodes if view.current else ()
    slow = straggled_last(view)
    healthy_set, previous_set = set(healthy), set(previous)  # thousands of nodes: no quadratic scans
    order = [n for n in previous if n in healthy_set] + [n for n in healthy if n not in previous_set]
    order = [n for n in order if n not in slow] + [n for n in order if n in slow]
    nodes = tuple(order[: run.nodes])
    if slow & healthy_set:
        chosen, prev = set(nodes), view.current.number if view.current else 0
        left_out = sorted(n for n in slow & healthy_set if n not in chosen)
        kept = sorted(n for n in slow if n in chosen)
        if left_out:
            out.append(Emit(kind="straggler.left-out",
                            message=f"leaving out {', '.join(left_out)}: it straggled in attempt {prev}",
                            data={"attempt": prev, "nodes": left_out}))
        if kept:
            out.append(Emit(kind="straggler.kept",
                            message=f"keeping {', '.join(kept)} though it straggled in attempt {prev}: "
                                    "no other node is free", data={"attempt": prev, "nodes": kept}))
    ck = view.newest_checkpoint
    number = len(view.attempts) + 1
    out.append(
        StartAttempt(
            number=number, nodes=nodes,
            resume_from=ck.path if ck else None, resume_step=ck.step if ck else 0,
        )
    )
    origin = f"checkpoint at step {ck.step}" if ck else "scratch"
    out.append(Emit(kind="attempt.launching",
                    message=f"attempt {number} on {', '.join(nodes)} from {origin}",
                    data={"attempt": number, "nodes": list(nodes),
                          "resume_step": ck.step if ck else 0}))
    if state is not RunState.STARTING and state is not RunState.RECOVERING:
        out.append(SetRunState(state=RunState.STARTING, reason=f"attempt {number} launching"))
        return RunState.STARTING
    return state


# --- lemons -------------------------------------------------------------------------


def _lemons(view: RunView, record: RecordFault, draining: set[str], now: float) -> list[tuple[str, str]]:
    """Nodes that the new fault blames and that were blamed in enough other faults lately.

    One attempt's fault proves little about a node (a rank crash may be the code's), but a
    node that keeps turning up in faults of different steps and runs is a lemon. A fault
    repeating at the same step of the same run (a crash loop) counts once: it follows the
    step, not the node."""
    policy = view.run.policy
    since = now - policy.lemon_window_s
    out = []
    for node in record.nodes:
        if node in draining:
            continue
        blamed = [f for f in view.cluster_faults if node in f.nodes and f.detected_at >= since]
        distinct = {(f.run_number, f.kind, f.step): f for f in blamed}
        distinct.pop((view.run.number, record.kind, record.step), None)
        if len(distinct) + 1 < policy.lemon_faults:
            continue
        earlier = "; ".join(f"{run_id_of(f.run_number)} {f.kind} at step {f.step}"
                            for f in sorted(distinct.values(), key=lambda f: f.detected_at))
        hours = policy.lemon_window_s / 3600
        out.append((node, f"training-supervisor: lemon: blamed in {len(distinct) + 1} faults in {hours:g} h "
                          f"({earlier}; now {record.kind} at step {record.step}) ({view.run.run_id})"))
    return out


# --- stragglers ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    node: str
    busy_s: float  # its median busy time per step over the window
    typical_s: float  # the typical rank's: the lower median of every judged rank's median

    @property
    def slower(self) -> float:
        """How much slower than typical: 0.5 is 50 % slower."""
        return self.busy_s / self.typical_s - 1.0 if self.typical_s > 0 else math.inf


def find_stragglers(ranks: Iterable[RankObs], policy: Policy) -> list[Straggler]:
    """Ranks whose own compute per step stays above the typical rank's by the margin.

    In a synchronous job every rank's wall-clock step time is the same (the fast ones
    wait for the slow one in the collectives), so the judgement is on busy time, which
    leaves the waits out. Each rank with a full window is summarised by its median over
    the window (one slow step is not a straggler); "typical" is the lower median of those
    medians, so that with two ranks the slower is compared with the faster, and a
    majority of slow ranks is the new normal rather than a crowd of stragglers.
    """
    window = policy.straggler_window
    judged = [(r, median(r.busy_recent_s[-window:])) for r in ranks if len(r.busy_recent_s) >= window]
    if len(judged) < 2:
        return []
    typical = median_low(m for _, m in judged)
    return [Straggler(rank=r.rank, node=r.node, busy_s=m, typical_s=typical)
            for r, m in judged
            if m > typical * (1.0 + policy.straggler_margin) and m - typical >= policy.straggler_min_s]


def _judge_stragglers(
    view: RunView, live: Attempt, obs: AttemptObs, state: RunState, out: list[Effect]
) -> tuple[RunState, Attempt | None]:
    """Report each new straggler once per attempt; with ``straggler_restart`` and a free
    spare, stop the attempt so that the next one runs without the straggling node."""
    policy = view.run.policy
    said = {(s.attempt, s.rank) for s in view.stragglers}
    found = [s for s in find_stragglers(obs.ranks, policy) if (live.number, s.rank) not in said]
    for s in found:
        out.append(Emit(
            kind="straggler",
            message=f"rank {s.rank} on {s.node} straggles: {s.busy_s:.3f} s of compute per step against "
                    f"{s.typical_s:.3f} s typical ({s.slower:+.0%}) over {policy.straggler_window} steps",
            data={"attempt": live.number, "rank": s.rank, "node": s.node, "busy_s": round(s.busy_s, 6),
                  "typical_s": round(s.typical_s, 6), "window": policy.straggler_window}))
    if not found or not policy.straggler_restart:
        return state, live
    slow_nodes = sorted({s.node for s in found})
    if not _spares_for(view, live.nodes, set(slow_nodes)):
        out.append(Emit(kind="straggler.kept",
                        message=f"not restarting without {', '.join(slow_nodes)}: no free spare",
                        data={"attempt": live.number, "nodes": slow_nodes}))
        return state, live
    step = max((r.last_step for r in obs.ranks), default=live.resume_step)
    summary = (f"{', '.join(slow_nodes)} straggling (ranks {_ranks_of(s.rank for s in found)}): "
               "restarting without it (straggler_restart)")
    out.append(RecordFault(kind=FaultKind.STRAGGLER, attempt=live.number, ranks=tuple(s.rank for s in found),
                           nodes=tuple(slow_nodes), summary=summary, step=step))
    out.append(Emit(kind="fault.detected", message=f"{FaultKind.STRAGGLER}: {summary}",
                    data={"attempt": live.number, "step": step, "nodes": slow_nodes}))
    out.append(_stop(live, AttemptOutcome.FAILED, f"{FaultKind.STRAGGLER}: {summary}", force=True))
    if state is not RunState.RECOVERING:
        out.append(SetRunState(state=RunState.RECOVERING, reason=f"{FaultKind.STRAGGLER}: {summary}"))
    return RunState.RECOVERING, _stopping(live)


def _spares_for(view: RunView, in_use: Iterable[str], leaving: set[str]) -> bool:
    """Whether the run holds enough healthy idle nodes to replace ``leaving``."""
    busy = set(in_use)
    free = [n for n in view.allocation if n.state is NodeState.ALLOCATED and n.name not in busy]
    return len(free) >= len(leaving)


def straggled_last(view: RunView) -> set[str]:
    """Nodes reported straggling in the run's latest attempt: left out of the next one."""
    last = view.current.number if view.current else None
    return {s.node for s in view.stragglers if s.attempt == last}


# --- spikes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spike:
    step: int  # the first step of it
    steps: int  # how many steps in a row, from it, are above the threshold
    summary: str


def _spikes(recent: tuple[StepSample, ...], policy: Policy) -> list[Spike]:
    """Every run of spiking steps in ``recent`` (consecutive steps, oldest first), each
    judged against the median of the ``spike_window`` steps before its first step."""
    w = policy.spike_window
    found: list[Spike] = []
    i = w
    while i < len(recent):
        before = recent[i - w:i]
        if any(b.step != recent[i].step - w + k for k, b in enumerate(before)):
            i += 1
            continue  # a gap in what was received: no judgement on a broken window
        loss_m = median([b.loss for b in before if math.isfinite(b.loss)] or [math.inf])
        grad_m = median([b.grad_norm for b in before if math.isfinite(b.grad_norm)] or [math.inf])
        limits = (loss_m * (1 + policy.spike_loss_rel), grad_m * policy.spike_grad_factor)
        if not _above(recent[i], limits):
            i += 1
            continue
        j = i
        while (j + 1 < len(recent) and recent[j + 1].step == recent[j].step + 1
               and _above(recent[j + 1], limits)):
            j += 1
        x = recent[i]
        found.append(Spike(step=x.step, steps=j - i + 1, summary=(
            f"loss spike from step {x.step}: loss {x.loss:.4g} (median of the {w} steps before: "
            f"{loss_m:.4g}), grad norm {x.grad_norm:.4g} (median {grad_m:.4g}), for {j - i + 1} steps")))
        i = j + 1
    return found


def _data_to_skip(view: RunView, live: Attempt, obs: AttemptObs, record: RecordFault) -> SkipData | None:
    """A persistent spike skips ``spike_skip_steps`` steps of data from its first step; a
    NaN that recurs at the step it hit before skips that one step's data."""
    policy = view.run.policy
    if record.kind is FaultKind.SPIKE:
        steps, why = policy.spike_skip_steps, f"loss spike from step {record.step}"
    elif record.kind is FaultKind.NONFINITE and any(
            f.kind is FaultKind.NONFINITE and f.step == record.step and f.attempt < live.number
            for f in view.faults):
        steps, why = 1, f"loss not finite at step {record.step} again"
    else:
        return None
    window = skip_window(obs.recent, record.step, steps)
    if window is None:
        return None
    return SkipData(start=window[0], end=window[1], reason=f"{why} (attempt {live.number})")


def _above(x: StepSample, limits: tuple[float, float]) -> bool:
    return x.loss > limits[0] or x.grad_norm > limits[1]


def find_spike(recent: tuple[StepSample, ...], policy: Policy) -> Spike | None:
    """The first spike that has lasted ``spike_persist_steps`` steps: act on it."""
    for s in _spikes(recent, policy):
        if s.steps >= policy.spike_persist_steps:
            return Spike(step=s.step, steps=s.steps, summary=(
                f"{s.summary}: rolling back to the newest checkpoint before step {s.step} and skipping "
                f"{policy.spike_skip_steps} steps of data from it"))
    return None


def transient_spikes(recent: tuple[StepSample, ...], policy: Policy) -> list[Spike]:
    """Spikes that ended before ``spike_persist_steps``: counted and reported, never acted on."""
    last = recent[-1].step if recent else 0
    return [s for s in _spikes(recent, policy)
            if s.steps < policy.spike_persist_steps and s.step + s.steps <= last]


def skip_window(recent: tuple[StepSample, ...], from_step: int, steps: int) -> tuple[int, int] | None:
    """The samples of ``steps`` steps of data from ``from_step`` on: [start, end), from the
    stream positions rank 0 reported (None when that step was not seen)."""
    at = {x.step: x.first_sample for x in recent}
    if from_step not in at:
        return None
    per_step = [at[k + 1] - at[k] for k in at if k + 1 in at and at[k + 1] > at[k]]
    if not per_step:
        return None
    return at[from_step], at[from_step] + steps * min(per_step)


# --- rollback -----------------------------------------------------------------------


_ROLLBACK_KINDS = frozenset({FaultKind.NONFINITE, FaultKind.SPIKE})


def unreadable_checkpoints(faults: Iterable[FaultRecord]) -> frozenset[int]:
    """Steps of the run's checkpoints that a trainer could not read (exit code 3): never
    resumed from again, though their markers say complete."""
    return frozenset(f.step for f in faults if f.kind is FaultKind.CHECKPOINT)


def resume_before(attempts: Iterable[Attempt], faults: Iterable[FaultRecord]) -> int | None:
    """The next attempt must resume from a checkpoint older than this step (None: the
    newest will do): after an attempt whose loss went NaN or infinite at step S, any
    checkpoint from step S on may hold the poisoned model; likewise after a loss spike that
    began at step S."""
    done = [a for a in attempts if a.state in (AttemptState.ENDED, AttemptState.STOPPING)]
    if not done or done[-1].outcome is not AttemptOutcome.FAILED:  # a stopping one may end this tick
        return None
    bad = [f.step for f in faults if f.attempt == done[-1].number and f.kind in _ROLLBACK_KINDS]
    return min(bad) if bad else None


# --- stop rules ---------------------------------------------------------------------


def _failed_streak(view: RunView, ended_now: Mapping[int, AttemptOutcome | None]) -> list[Attempt]:
    """The FAILED attempts at the end of the run's history since its restart budget began,
    oldest first; an attempt that ended any other way (or never started) ends the streak."""
    streak: list[Attempt] = []
    for a in reversed(view.attempts):
        if a.number <= view.run.budget_from_attempt:
            break
        outcome = ended_now.get(a.number, a.outcome)
        if outcome is AttemptOutcome.ABORTED:
            continue  # never ran: no evidence either way
        if outcome is not AttemptOutcome.FAILED:
            break
        streak.append(a)
    return streak[::-1]


def _crash_loop(view: RunView, streak: list[Attempt], out: list[Effect]) -> str | None:
    """The same fault (kind and step) ended the last ``crash_loop_attempts`` attempts."""
    k = view.run.policy.crash_loop_attempts
    if len(streak) < k:
        return None
    first: dict[int, tuple[FaultKind, int, tuple[str, ...]]] = {}
    for f in view.faults:
        first.setdefault(f.attempt, (f.kind, f.step, f.nodes))
    for e in out:
        if isinstance(e, RecordFault):
            first.setdefault(e.attempt, (e.kind, e.step, e.nodes))
    seen = [first.get(a.number) for a in streak[-k:]]
    if any(x is None for x in seen) or len({(x[0], x[1]) for x in seen if x}) != 1:
        return None
    kind, step, _ = seen[0]  # type: ignore[misc]
    nodes = sorted({n for a in streak[-k:] for n in a.nodes})
    return (f"crash loop: {kind} at step {step} in {k} attempts in a row (on nodes {', '.join(nodes)}); "
            f"a restart will not fix it")


def _no_progress(view: RunView, streak: list[Attempt]) -> str | None:
    """``no_progress_attempts`` failed attempts in a row resumed from one checkpoint."""
    _, stuck = backoff(view, streak)
    k = view.run.policy.no_progress_attempts
    if stuck < k:
        return None
    return (f"no checkpoint progress: {stuck} attempts in a row resumed from step {streak[-1].resume_step} "
            f"and failed")


def backoff(view: RunView, streak: list[Attempt]) -> tuple[float, int]:
    """(seconds to wait before the next attempt, failed attempts in a row that resumed from
    the same checkpoint). The first restart after progress is immediate; the n-th in a row
    (n >= 2) waits backoff_base_s x 2^(n-2), at most backoff_max_s (tenacity's
    exponential wait). Attempts ended by a lost node (drained, replaced by a spare) do not
    count: at the scale of thousands of nodes several in a row are bad luck, not a loop
    (bench/simulate.py shows the run failing for it otherwise)."""
    if not streak:
        return 0.0, 0
    lost = {f.attempt for f in view.faults if f.kind is FaultKind.NODE_LOST}
    same = 0
    for a in reversed(streak):
        if a.resume_step != streak[-1].resume_step:
            break
        if a.number not in lost:  # a lost node was drained and replaced: no reason to wait
            same += 1
    policy = view.run.policy
    if same < 2 or policy.backoff_base_s <= 0:
        return 0.0, same
    wait = tenacity.wait_exponential(multiplier=policy.backoff_base_s, min=policy.backoff_base_s,
                                     max=policy.backoff_max_s)
    state = tenacity.RetryCallState(retry_object=tenacity.Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = same - 1
    return float(wait(state)), same


# --- helpers ------------------------------------------------------------------------


def _all_gone(obs: AttemptObs | None) -> bool:
    if obs is None:
        return False
    return obs.never_started or all(_gone(r) for r in obs.ranks)


def _gone(r: RankObs) -> bool:
    """The rank's process has ended. When the launcher cannot see it (UNKNOWN: a Slurm
    step's rank, whose step may linger in Slurm until a dead node is declared down,
    SlurmdTimeout later), its own exit report or its last will says so."""
    if r.proc in (ProcState.EXITED, ProcState.VANISHED):
        return True
    return r.proc is ProcState.UNKNOWN and (r.lost or r.reported_exit_code is not None)


def _stop(live: Attempt, outcome: AttemptOutcome, reason: str, *, force: bool) -> StopAttempt:
    return StopAttempt(number=live.number, outcome=outcome, reason=reason, force=force)


def _stopping(live: Attempt) -> Attempt:
    return replace(live, state=AttemptState.STOPPING)


def _end(live: Attempt, outcome: AttemptOutcome, reason: str, obs: AttemptObs | None) -> EndAttempt:
    steps = [r.last_step for r in obs.ranks] if obs else []
    final = max(steps) if steps else live.final_step
    return EndAttempt(number=live.number, outcome=outcome, reason=reason, final_step=final)
