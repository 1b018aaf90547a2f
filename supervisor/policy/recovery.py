"""Recovery: where and from what the next attempt starts (when to stop trying: budget.py).

Placement keeps the previous attempt's healthy nodes in their places and fills up with
spares; a node that straggled goes last. Fewer nodes (``shrink_after_s``): when no spare
is left and no node came within that long of a failed attempt's end, the next attempt
runs on the most healthy nodes it can (a count the trainer can split its batch over);
while shrunk, the run keeps asking for nodes and grows back once it holds them and the
shrunk attempt has committed a checkpoint. The next attempt resumes from the newest save
of the in-memory tier when its nodes still hold all of it (memory.py), else from the
newest persistent checkpoint. Rollback: after a NaN or a persistent spike the
next attempt resumes from a checkpoint before it, skipping the spike's data window (in
samples for the reference trainer, in steps for a [command] told ``{skip_to_step}``); a
trainer that cannot skip is rolled back once, and trains through the spike when it
comes back (detection.spike_rolled_back).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from supervisor.domain import (
    AllocateNodes,
    Attempt,
    AttemptObs,
    AttemptOutcome,
    AttemptState,
    Effect,
    Emit,
    EndAttempt,
    FaultKind,
    FaultRecord,
    FinishRun,
    NodeState,
    ProbeNodes,
    RecordFault,
    ReportStraggler,
    Run,
    RunState,
    RunView,
    SetRunState,
    SkipData,
    StartAttempt,
    StepSample,
    StopAttempt,
)
from supervisor.domain.events import EventKind
from supervisor.policy.attribution import numbers_text
from supervisor.policy.budget import backoff, failed_streak, stop_reason
from supervisor.policy.data_steps import data_step
from supervisor.policy.detection import find_stragglers
from supervisor.policy.memory import unrecoverable
from supervisor.policy.trainer_inputs import told
from supervisor.policy.transitions import check_run

_ROLLBACK_KINDS = frozenset({FaultKind.NONFINITE, FaultKind.SPIKE})


def set_state(state: RunState, new: RunState, reason: str, out: list[Effect]) -> RunState:
    """Move the run to ``new`` (nothing when it is there already), as the table allows."""
    if new is not state:
        check_run(state, new)
        out.append(SetRunState(state=new, reason=reason))
    return new


def launch(view: RunView, state: RunState, drained_now: set[str], out: list[Effect], now: float) -> RunState:
    """The next attempt, unless a stop rule ends the run, a backoff is due, or nodes are short."""
    run = view.run
    ended_now = {e.number: e for e in out if isinstance(e, EndAttempt)}  # this very tick
    view = replace(view, attempts=tuple(
        replace(a, state=AttemptState.ENDED, outcome=ended_now[a.number].outcome, ended_at=now,
                final_step=ended_now[a.number].final_step) if a.number in ended_now else a
        for a in view.attempts))
    faults = [*view.faults, *_recorded_now(view, out, now)]
    streak = failed_streak(view, faults)
    stop = stop_reason(view, faults, streak, now)
    if stop is not None:
        check_run(state, RunState.FAILED)
        out.append(FinishRun(state=RunState.FAILED, reason=stop))
        return RunState.FAILED
    wait_s, stuck = backoff(view, streak)
    if wait_s > 0:
        last = streak[-1]
        if last.number in ended_now:  # said once, when the attempt ends
            out.append(Emit(kind=EventKind.ATTEMPT_BACKOFF,
                            message=f"{stuck} failed attempts in a row resumed from step {last.resume_step}: "
                                    f"waiting {wait_s:.0f} s before the next",
                            data={"wait_s": wait_s, "failures_in_a_row": stuck}))
        if now < (last.ended_at if last.ended_at is not None else now) + wait_s:
            return state

    healthy = [n.name for n in view.allocation
               if n.state is NodeState.ALLOCATED and n.name not in drained_now]
    count = run.nodes
    if len(healthy) < run.nodes:
        # Level 2 of recovery: not enough healthy nodes in hand, ask for more; or, once
        # they are long in coming, go on with fewer.
        out.append(AllocateNodes(count=run.nodes + run.spares - len(healthy), keep=_smallest(run)))
        fewer = fewer_nodes(view, len(healthy), now)
        if fewer is None:
            return state
        count = fewer
        out.append(Emit(kind=EventKind.RUN_SHRUNK,
                        message=f"continuing on {fewer} of {run.nodes} nodes: no spare left and no node "
                                f"came from the cluster; the run grows back when nodes return",
                        data={"nodes": fewer, "of": run.nodes}))

    nodes = _place(view, healthy, out, count)
    number = len(view.attempts) + 1
    precompile = view.precompile_due
    if precompile is not None:  # the job's precompile pass first: no checkpoint, no resume
        start, said = told(view, StartAttempt(number=number, nodes=nodes, resume_from=None, resume_step=0,
                                              precompile=precompile), _skip_windows(view, out))
        out.append(start)
        out.append(Emit(kind=EventKind.ATTEMPT_LAUNCHING,
                        message=f"attempt {number} on {', '.join(nodes)}: the job's precompile pass "
                                f"(its inputs {precompile[:12]} were not compiled yet)",
                        data={"attempt": number, "nodes": list(nodes), "resume_step": 0,
                              "precompile": precompile}))
    else:
        resume_from, resume_step, origin = _resume_point(view, nodes, out)
        start, said = told(view, StartAttempt(number=number, nodes=nodes, resume_from=resume_from,
                                              resume_step=resume_step), _skip_windows(view, out))
        out.append(start)
        out.append(Emit(kind=EventKind.ATTEMPT_LAUNCHING,
                        message=f"attempt {number} on {', '.join(nodes)} from {origin}",
                        data={"attempt": number, "nodes": list(nodes), "resume_step": resume_step}))
    out.extend(said)
    if state in (RunState.STARTING, RunState.RECOVERING):
        return state
    return set_state(state, RunState.STARTING, f"attempt {number} launching", out)


def _skip_windows(view: RunView, out: list[Effect]) -> tuple[tuple[int, int], ...]:
    """The run's data skip windows, with those this tick decided."""
    return (*view.data_skips, *((e.start, e.end) for e in out if isinstance(e, SkipData)))


def _resume_point(view: RunView, nodes: tuple[str, ...], out: list[Effect]) -> tuple[str | None, int, str]:
    """Where the next attempt on ``nodes`` starts: (``--resume`` value, step, in words).
    The memory tier's newest save when ``nodes`` still hold all of it, else the newest
    persistent checkpoint, else scratch."""
    ck, save = view.newest_checkpoint, view.newest_memory
    if save is not None:
        lost = unrecoverable(save, nodes)
        if not lost:
            return save.resume_from, save.step, f"memory (attempt {save.attempt}'s save of step {save.step})"
        fallback = f"the checkpoint at step {ck.step}" if ck else "scratch"
        why = (f"the state of the ranks of {', '.join(lost)} left the run with that node and the next one of "
               f"attempt {save.attempt}" if len(save.nodes) == len(nodes) else
               f"it was saved on {len(save.nodes)} nodes and restores only on as many; this attempt has "
               f"{len(nodes)}")
        out.append(Emit(kind=EventKind.MEMORY_LOST,
                        message=f"the memory save of step {save.step} cannot be resumed from: {why}; "
                                f"resuming from {fallback}",
                        data={"step": save.step, "attempt": save.attempt, "nodes": lost}))
    if ck is None:
        return None, 0, "scratch"
    return ck.path, ck.step, f"checkpoint at step {ck.step}"


def _place(view: RunView, healthy: list[str], out: list[Effect], count: int) -> tuple[str, ...]:
    """``count`` nodes: keep the previous attempt's healthy nodes in their places, fill up
    with spares; a node that straggled in it goes last (a spare again), unless it is needed."""
    previous = view.current.nodes if view.current else ()
    slow = straggled_last(view)
    healthy_set, previous_set = set(healthy), set(previous)  # thousands of nodes: no quadratic scans
    order = [n for n in previous if n in healthy_set] + [n for n in healthy if n not in previous_set]
    order = [n for n in order if n not in slow] + [n for n in order if n in slow]
    nodes = tuple(order[:count])
    if slow & healthy_set:
        chosen, prev = set(nodes), view.current.number if view.current else 0
        left_out = sorted(n for n in slow & healthy_set if n not in chosen)
        kept = sorted(n for n in slow if n in chosen)
        if left_out:
            out.append(Emit(kind=EventKind.STRAGGLER_LEFT_OUT,
                            message=f"leaving out {', '.join(left_out)}: it straggled in attempt {prev}",
                            data={"attempt": prev, "nodes": left_out}))
        if kept:
            out.append(Emit(kind=EventKind.STRAGGLER_KEPT,
                            message=f"keeping {', '.join(kept)} though it straggled in attempt {prev}: "
                                    "no other node is free", data={"attempt": prev, "nodes": kept}))
    return nodes


def shrink_counts(run: Run) -> list[int]:
    """The node counts below the run's size that an attempt may shrink to, ascending."""
    policy = run.policy
    allowed = range(policy.shrink_min_nodes, run.nodes)
    return [k for k in allowed if policy.shrink_node_counts is None or k in policy.shrink_node_counts]


def _smallest(run: Run) -> int | None:
    """The fewest healthy nodes worth keeping an allocation for (AllocateNodes.keep)."""
    counts = shrink_counts(run) if run.policy.shrink_after_s > 0 else []
    return counts[0] if counts else None


def fewer_nodes(view: RunView, healthy: int, now: float) -> int | None:
    """The node count the next attempt shrinks to when the run holds only ``healthy``
    healthy nodes, or None to wait for nodes. A run shrinks after a failed attempt whose
    nodes did not come back within ``shrink_after_s`` (at once if that attempt had shrunk
    already), to the largest count it may run on."""
    run, last = view.run, view.current
    if run.policy.shrink_after_s <= 0 or last is None or last.ended_at is None:
        return None  # never shrinks, or nothing ran yet: the first attempt waits for all its nodes
    shrunk_already = len(last.nodes) < run.nodes
    if not shrunk_already and now - last.ended_at < run.policy.shrink_after_s:
        return None
    return max((k for k in shrink_counts(run) if k <= healthy), default=None)


def grow_back(view: RunView, live: Attempt, state: RunState, out: list[Effect]) -> tuple[RunState, Attempt]:
    """An attempt on fewer nodes than the run's: ask for the missing nodes, and once the
    run holds them and the attempt has committed a checkpoint of its own, stop it so that
    the next attempt runs on all of them. Its work since that checkpoint is redone (at
    most one interval, as after any fault); the stop is an interruption, not a failure."""
    run = view.run
    if len(live.nodes) >= run.nodes or live.first_step_at is None:
        return state, live
    busy = set(live.nodes)
    free = [n.name for n in view.allocation if n.state is NodeState.ALLOCATED and n.name not in busy]
    missing = run.nodes - len(live.nodes) - len(free)
    if missing > 0:
        out.append(AllocateNodes(count=missing + run.spares, keep=len(live.nodes)))
        return state, live
    ck = view.newest_checkpoint
    if ck is None or ck.step <= live.resume_step:
        return state, live  # not before the shrunk attempt's work is on storage
    reason = (f"growing back to {run.nodes} nodes: {', '.join(free[: run.nodes - len(live.nodes)])} "
              f"joined the {len(live.nodes)} of attempt {live.number}")
    out.append(Emit(kind=EventKind.RUN_GROW, message=reason,
                    data={"attempt": live.number, "nodes": run.nodes}))
    out.append(StopAttempt(number=live.number, outcome=AttemptOutcome.INTERRUPTED, reason=reason, force=True))
    state = set_state(state, RunState.RECOVERING, reason, out)
    return state, replace(live, state=AttemptState.STOPPING)


def _recorded_now(view: RunView, out: list[Effect], now: float) -> list[FaultRecord]:
    """This tick's new faults, as the store will hold them."""
    return [FaultRecord(id=-1, run_number=view.run.number, attempt=e.attempt, kind=e.kind, ranks=e.ranks,
                        nodes=e.nodes, step=e.step, summary=e.summary, detected_at=now, recovered_at=None)
            for e in out if isinstance(e, RecordFault)]


# --- rollback and data skips --------------------------------------------------------


def unreadable_checkpoints(faults: Iterable[FaultRecord], attempts: Iterable[Attempt] = (), *,
                           memory: bool = False, saved_by: Mapping[int, int] | None = None) -> frozenset[int]:
    """Steps of the run's checkpoints that a trainer could not read (exit code 3), or that
    did not hold what was saved: never resumed from again, though their markers say
    complete. Each tier's own: a failed restore of an attempt that resumed from the memory
    tier rules out memory saves of that step (``memory``), never the persistent
    checkpoint of the same step, and the other way round.

    A later attempt that trains past the step again saves it again: a new checkpoint,
    which a resume may use. ``saved_by`` (step: the attempt that last committed it, from
    the store) says which were; a step committed by an attempt after the one that failed
    to read it is ruled out no longer."""
    from_memory = {a.number for a in attempts if is_memory_resume(a.resume_from)}
    saved_by = saved_by or {}
    return frozenset(f.step for f in faults
                     if f.kind is FaultKind.CHECKPOINT and (f.attempt in from_memory) == memory
                     and (memory or saved_by.get(f.step, 0) <= f.attempt))


def is_memory_resume(resume_from: str | None) -> bool:
    """Whether an attempt resumed from the memory tier (``memory:ATTEMPT:STEP``)."""
    return resume_from is not None and resume_from.startswith("memory:")


def resume_before(attempts: Iterable[Attempt], faults: Iterable[FaultRecord]) -> int | None:
    """The next attempt must resume from a checkpoint older than this step (None: the
    newest will do): after an attempt whose loss went NaN or infinite at step S, any
    checkpoint from step S on may hold the poisoned model; likewise after a loss spike that
    began at step S."""
    done = [a for a in attempts
            if a.state in (AttemptState.ENDED, AttemptState.STOPPING) and a.precompile is None]
    if not done or done[-1].outcome is not AttemptOutcome.FAILED:  # a stopping one may end this tick
        return None
    bad = [f.step for f in faults if f.attempt == done[-1].number and f.kind in _ROLLBACK_KINDS]
    return min(bad) if bad else None


def data_to_skip(view: RunView, live: Attempt, obs: AttemptObs, record: RecordFault) -> SkipData | None:
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
    reason = f"{why} (attempt {live.number})"
    if view.data_skip_unit is None:  # it cannot be told
        return None
    if view.data_skip_unit == "steps":  # a [command] told {skip_to_step}: its steps, as data steps
        start = data_step(record.step, view.data_skips)
        return SkipData(start=start, end=start + steps, reason=reason, unit="steps")
    window = skip_window(obs.recent, record.step, steps)
    if window is None:
        return None
    return SkipData(start=window[0], end=window[1], reason=reason)


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


# --- diagnosis and stragglers -------------------------------------------------------


def probes_wanted(view: RunView, drained_now: set[str], out: list[Effect]) -> bool:
    """Nodes to probe before anything launches on them: with ``[health] preflight``, those
    the run just got; with ``[health] diagnose``, a failed attempt's that the run still
    holds (and has not just drained). True when a probe was asked for."""
    asked = False
    if view.preflight and view.newly_allocated:
        out.append(ProbeNodes(nodes=tuple(view.newly_allocated), kind="preflight"))
        asked = True
    if not view.diagnose:
        return asked
    failed = {e.number for e in out if isinstance(e, EndAttempt) and e.outcome is AttemptOutcome.FAILED}
    held = {n.name for n in view.allocation if n.state is NodeState.ALLOCATED}
    suspects = sorted({node for a in view.attempts if a.number in failed for node in a.nodes
                       if node in held and node not in drained_now})
    if suspects:
        out.append(ProbeNodes(nodes=tuple(suspects), kind="diagnosis"))
    return asked or bool(suspects)


def probe_idle_spares(view: RunView, now: float, out: list[Effect]) -> None:
    """With ``[health] preflight``, while an attempt trains: the run's spares whose newest
    probe is older than ``spare_probe_every_s`` (or that were never probed) are probed
    now, while idle, so that one that joins after a fault joins proven, at no cost then.
    One round at a time (none while the run's nodes are being probed). Without the link
    test: the others' links are busy training. Its cost: a fault that lands while a spare
    is probed waits for that probe's end (seconds) before the next attempt launches."""
    every = view.spare_probe_every_s
    if not view.preflight or every <= 0 or view.probing:
        return
    stale = tuple(n for n, at in view.spares_probed_at if at is None or now - at >= every)
    if stale:
        out.append(ProbeNodes(nodes=stale, kind="spare"))


def judge_stragglers(view: RunView, live: Attempt, obs: AttemptObs, state: RunState,
                     out: list[Effect]) -> tuple[RunState, Attempt | None]:
    """Report each new straggler once per attempt; with ``straggler_restart`` and a free
    spare, stop the attempt so that the next one runs without the straggling node."""
    policy = view.run.policy
    said = {(s.attempt, s.rank) for s in view.stragglers}
    found = [s for s in find_stragglers(obs.ranks, policy) if (live.number, s.rank) not in said]
    for s in found:
        out.append(ReportStraggler(attempt=live.number, rank=s.rank, node=s.node, busy_s=round(s.busy_s, 6),
                                   typical_s=round(s.typical_s, 6), window=policy.straggler_window))
    if not found or not policy.straggler_restart:
        return state, live
    slow_nodes = sorted({s.node for s in found})
    if not _spares_for(view, live.nodes, set(slow_nodes)):
        out.append(Emit(kind=EventKind.STRAGGLER_KEPT,
                        message=f"not restarting without {', '.join(slow_nodes)}: no free spare",
                        data={"attempt": live.number, "nodes": slow_nodes}))
        return state, live
    step = max((r.last_step for r in obs.ranks), default=live.resume_step)
    summary = (f"{', '.join(slow_nodes)} straggling (ranks {numbers_text(s.rank for s in found)}): "
               "restarting without it (straggler_restart)")
    fault = RecordFault(kind=FaultKind.STRAGGLER, attempt=live.number, ranks=tuple(s.rank for s in found),
                        nodes=tuple(slow_nodes), summary=summary, step=step)
    return stop_for(fault, {"nodes": slow_nodes}, live, state, out)


def stop_for(fault: RecordFault, data: dict[str, object], live: Attempt, state: RunState,
             out: list[Effect]) -> tuple[RunState, Attempt]:
    """Record ``fault``, a slow attempt's rather than a death's, and stop the attempt so
    that the next one recovers from it (``data``: the event's, beside attempt and step)."""
    said = f"{fault.kind}: {fault.summary}"
    out.append(fault)
    out.append(Emit(kind=EventKind.FAULT_DETECTED, message=said,
                    data={"attempt": live.number, "step": fault.step, **data}))
    out.append(StopAttempt(number=live.number, outcome=AttemptOutcome.FAILED, reason=said, force=True))
    return set_state(state, RunState.RECOVERING, said, out), replace(live, state=AttemptState.STOPPING)


def _spares_for(view: RunView, in_use: Iterable[str], leaving: set[str]) -> bool:
    """Whether the run holds enough healthy idle nodes to replace ``leaving``."""
    busy = set(in_use)
    free = [n for n in view.allocation if n.state is NodeState.ALLOCATED and n.name not in busy]
    return len(free) >= len(leaving)


def straggled_last(view: RunView) -> set[str]:
    """Nodes reported straggling in the run's latest attempt: left out of the next one."""
    last = view.current.number if view.current else None
    return {s.node for s in view.stragglers if s.attempt == last}
