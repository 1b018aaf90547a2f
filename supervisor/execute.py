"""Execute: record a run's decision and carry it out.

``DecisionExecutor.apply`` writes everything a run's decision says (its state changes, its
records, its events and their outbox rows) and what was observed with it (``Facts``: the
allocation granted, the checkpoints found) in one SQLite transaction, and then acts:
starts and stops attempts, kills orphans, asks for nodes, gives them back, submits
probes, forgets an attempt that ended. Every run and attempt state change an effect
makes is checked against the transition table (supervisor/policy/transitions.py) before
it is written; an illegal one raises, the whole transaction rolls back, and nothing of
the decision is acted on.

Starting an attempt (``_start``) first prepares what its trainer reads: the data windows
the run skips, the checkpoint intervals set to "auto" (Young/Daly, per tier, from what
the run measured, supervisor/planning.py), newer checkpoints set aside from a [command]
trainer's way (supervisor/checkpoint_moves.py, which also moves them for a precompile
pass and an operator's resume from a chosen step), the attempt's config (its files
handed over to the run's user), and the fence that keeps an earlier attempt's rank 0 off
the checkpoints. Once the launcher has started it, the attempt is recorded RUNNING (the
one state write that is not an effect's, checked against the table like the others). A
launch that fails is recorded on the attempt (``launch_error``; ``launch_fatal`` when no
restart can help: a command that cannot be executed, an unsafe path) and judged by the
core at the next tick.

Decisions about nodes (probe results, operators' drains) and the drains and returns of a
run's decision go through ``NodeEffects`` (supervisor/execute_nodes.py): a run's drains
are recorded in the run's own transaction, then sent as intents until the cluster shows
them.

Every kind of effect is named in both steps, recording and acting (``_record``, ``_act``,
and NodeEffects' ``record`` and ``act`` for the node effects), each ending in
``assert_never``: an effect added to the core and forgotten here fails ``make typecheck``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, assert_never

from supervisor import node_health, planning, precompile, trainer_cmd, user_tree, users
from supervisor.checkpoint_moves import CheckpointMoves
from supervisor.domain import (
    AdoptAttempt,
    AllocateNodes,
    Attempt,
    AttemptState,
    BringBackCheckpoints,
    CommandHandled,
    DrainBudget,
    DrainNode,
    Effect,
    Emit,
    EndAttempt,
    EnsureStopped,
    FinishRun,
    KillOrphans,
    MarkAttemptRunning,
    MarkFaultsRecovered,
    Node,
    NodeState,
    ProbeAgain,
    ProbeNodes,
    RecordFault,
    RecordProbe,
    ReleaseNodes,
    ReportStraggler,
    ResumeRun,
    ReturnNode,
    Run,
    RunState,
    SetRunState,
    SkipData,
    StartAttempt,
    StopAttempt,
    StragglerRecord,
)
from supervisor.domain.events import EventKind
from supervisor.errors import CannotExecute, LaunchError
from supervisor.execute_nodes import NodeEffects
from supervisor.launchers.base import AllocationRequest, Launcher, NodeAdmin
from supervisor.policy import data_step, skip_to
from supervisor.policy.transitions import check_attempt, check_run
from supervisor.spec import RunSpec
from supervisor.store import SqlStore, Tx
from supervisor.telemetry import TelemetryView
from supervisor.tick_state import (
    GrantChanges,
    LaunchSpecs,
    Observed,
    ProbeSubmitter,
    RunMemory,
    grant_changes,
)
from supervisor.user_tree import UnsafePath

log = logging.getLogger(__name__)


class DecisionExecutor:
    def __init__(self, store: SqlStore, launcher: Launcher, nodes: NodeAdmin, telemetry: TelemetryView,
                 probes: ProbeSubmitter, memory: RunMemory, launch_specs: LaunchSpecs,
                 clock: Callable[[], float], drain_budget: DrainBudget | None = None) -> None:
        self.store = store
        self.launcher = launcher
        self.nodes = nodes
        self.telemetry = telemetry
        self.probes = probes
        self.memory = memory  # the run's memory between ticks: the reconciler's (tick_state.py)
        self.launch_specs = launch_specs
        self.clock = clock
        self._short: dict[int, tuple[int, int] | None] = {}  # run -> last (asked, got) shortage said
        self.node_effects = NodeEffects(store, nodes, probes, memory, drain_budget)
        self.moves = CheckpointMoves(self.post_event, store)

    # --- a run's decision -----------------------------------------------------------

    def apply(self, seen: Observed, effects: list[Effect], now: float) -> None:
        run = seen.run
        attempts = {a.number: a for a in seen.view.attempts}
        with self.store.tx() as tx:
            self._record_facts(tx, seen, now)
            state = run.state
            for e in effects:
                state = self._record(tx, run, state, attempts, e, now)
        for e in effects:
            self._act(seen, attempts, e, now)

    def _record_facts(self, tx: Tx, seen: Observed, now: float) -> None:
        n = seen.run.number
        if seen.facts.grant is not None:
            self._record_grant(tx, n, seen.facts.grant, now)
        for v in seen.facts.checkpoints:
            changed = tx.record_checkpoint(n, step=v.step, path=str(v.path), complete=v.ok, duration_s=None,
                                           attempt=None, now=now)
            if changed and not v.ok:
                tx.add_event(n, EventKind.CHECKPOINT_REJECTED,
                             f"checkpoint at step {v.step} fails verification: {v.why}",
                             {"step": v.step, "path": str(v.path)}, now)
        if seen.facts.output_offsets is not None:
            number, offsets = seen.facts.output_offsets
            tx.update_attempt(n, number, output_offsets=offsets)
        for path in seen.facts.out_of_range:
            if self.memory.note_out_of_range(n, path):
                tx.add_event(n, EventKind.CHECKPOINT_SKIPPED,
                             f"{path}: its step is beyond what a run can reach; "
                             "not a checkpoint of this run, passed over", {"path": str(path)}, now)

    def _record_grant(self, tx: Tx, n: int, changes: GrantChanges, now: float) -> None:
        if changes.info != tx.get_run(n).allocation_info:
            tx.update_run(n, allocation_info=changes.info)
        for node in changes.puts:
            tx.put_node(node, now)
        if changes.added:
            tx.add_event(n, EventKind.NODES_ALLOCATED, f"allocated {', '.join(changes.added)}",
                         {"nodes": list(changes.added)},
                         now)
        if changes.released:
            tx.add_event(n, EventKind.NODES_RELEASED, f"no longer held: {', '.join(changes.released)}",
                         {"nodes": list(changes.released)}, now)

    def _record(self, tx: Tx, run: Run, state: RunState, attempts: dict[int, Attempt], e: Effect,
                now: float) -> RunState:
        """Persist one effect; returns the run's state after it."""
        n = run.number
        match e:
            case Emit():
                tx.add_event(e.run_number if e.run_number is not None else n, e.kind, e.message, e.data, now)
            case SetRunState() | FinishRun() | ResumeRun():
                return self._record_state(tx, run, state, e, now)
            case StartAttempt():
                attempts[e.number] = Attempt(run_number=n, number=e.number, state=AttemptState.LAUNCHING,
                                             nodes=e.nodes,
                                             resume_from=e.resume_from, resume_step=e.resume_step,
                                             created_at=now, precompile=e.precompile)
                tx.add_attempt(attempts[e.number])
            case AdoptAttempt():
                self._attempt_to(tx, attempts, e.number, AttemptState.RUNNING, launch_info=e.launch_info,
                                 started_at=attempts[e.number].started_at or now)
            case MarkAttemptRunning():
                tx.update_attempt(n, e.number, first_step_at=now)
            case StopAttempt():
                self._attempt_to(tx, attempts, e.number, AttemptState.STOPPING, stop_requested_at=now,
                                 outcome=e.outcome, reason=e.reason)
                tx.add_event(n, EventKind.ATTEMPT_STOPPING, f"attempt {e.number}: stopping ({e.reason})",
                             {"attempt": e.number}, now)
            case EndAttempt():
                self._attempt_to(tx, attempts, e.number, AttemptState.ENDED, ended_at=now, outcome=e.outcome,
                                 reason=e.reason, final_step=e.final_step)
                tx.add_event(n, EventKind.ATTEMPT_ENDED,
                             f"attempt {e.number} ended {e.outcome} at step {e.final_step}: "
                             f"{e.reason}", {"attempt": e.number, "outcome": e.outcome.value,
                                             "final_step": e.final_step}, now)
            case RecordFault():
                stats = tx.stats_of_attempt(n, e.attempt)
                tx.add_fault(n, attempt=e.attempt, kind=e.kind, ranks=e.ranks, nodes=e.nodes, step=e.step,
                             summary=e.summary, now=now, last_step_at=stats.last_at if stats else None,
                             injected_at=tx.injected_at(n, e.attempt, now))
            case MarkFaultsRecovered():
                if tx.mark_faults_recovered(n, now):
                    tx.add_event(n, EventKind.RUN_RECOVERED, "training again after the fault", {}, now)
            case ReleaseNodes():
                for node in tx.allocation(n):  # a drained node keeps the run that drained it
                    if node.state is NodeState.ALLOCATED:
                        tx.put_node(Node(name=node.name, state=NodeState.IDLE), now)
            case SkipData(unit="steps"):  # the live attempt's steps, as data steps (policy/recovery.py)
                start = data_step(e.start, tx.list_data_skips(n))
                end = start + e.end - e.start
                tx.add_data_skip(n, start, end, e.reason, now)
                tx.add_event(n, EventKind.DATA_SKIP,
                             f"skipping the data of steps {start} to {end - 1} (of the data stream) from "
                             f"the next attempt on, through {{skip_to_step}}: {e.reason}",
                             {"start": start, "end": end, "unit": "steps"}, now)
            case SkipData():
                tx.add_data_skip(n, e.start, e.end, e.reason, now)
                tx.add_event(n, EventKind.DATA_SKIP,
                             f"skipping samples {e.start} to {e.end} from the next attempt on: "
                             f"{e.reason}", {"start": e.start, "end": e.end}, now)
            case ReportStraggler():
                tx.add_straggler(n, StragglerRecord(attempt=e.attempt, rank=e.rank, node=e.node,
                                                    busy_s=e.busy_s,
                                                    typical_s=e.typical_s, window=e.window, at=now))
                slower = e.busy_s / e.typical_s - 1.0 if e.typical_s > 0 else float("inf")
                tx.add_event(n, EventKind.STRAGGLER,
                             f"rank {e.rank} on {e.node} straggles: {e.busy_s:.3f} s of compute per step "
                             f"against {e.typical_s:.3f} s typical ({slower:+.0%}) over {e.window} steps",
                             {"attempt": e.attempt, "rank": e.rank, "node": e.node, "busy_s": e.busy_s,
                              "typical_s": e.typical_s, "window": e.window}, now)
            case AllocateNodes() | EnsureStopped() | ProbeNodes() | KillOrphans() | BringBackCheckpoints():
                pass  # nothing to record before acting
            case DrainNode() | ReturnNode() | RecordProbe() | ProbeAgain() | CommandHandled():
                self.node_effects.record(tx, e, now)
            case _:
                assert_never(e)
        return state

    def _record_state(self, tx: Tx, run: Run, state: RunState, e: SetRunState | FinishRun | ResumeRun,
                      now: float) -> RunState:
        n = run.number
        new = RunState.PENDING if isinstance(e, ResumeRun) else e.state
        check_run(state, new)  # an illegal transition raises: the whole transaction rolls back
        data: dict[str, object] = {"from": state.value, "to": new.value}
        if isinstance(e, ResumeRun):
            tx.update_run(n, state=new, reason=e.reason, ended_at=None,
                          budget_from_attempt=len(tx.list_attempts(n)))
            if e.from_step is not None:  # a newer memory save is past the step the operator chose
                tx.forget_memory_checkpoints_after(n, e.from_step)
        elif isinstance(e, FinishRun):
            tx.update_run(n, state=new, reason=e.reason, ended_at=now, final_step=e.final_step,
                          model_digest=e.model_digest)
            data |= {"final_step": e.final_step, "model_digest": e.model_digest}
        else:
            tx.update_run(n, state=new, reason=e.reason)
        tx.add_event(n, EventKind.RUN_STATE, f"{state} -> {new}: {e.reason}", data, now)
        return new

    @staticmethod
    def _attempt_to(tx: Tx, attempts: dict[int, Attempt], number: int, new: AttemptState,
                    **values: Any) -> None:
        """Move an attempt to ``new``, as the table allows (it raises otherwise)."""
        a = attempts[number]
        check_attempt(a.state, new)
        tx.update_attempt(a.run_number, number, state=new, **values)
        attempts[number] = replace(a, state=new, **values)

    def _act(self, seen: Observed, attempts: dict[int, Attempt], e: Effect, now: float) -> None:
        run, spec = seen.run, seen.spec
        match e:
            case AllocateNodes() if spec is not None:
                self._allocate(run, spec, e.count, e.keep, now)
            case ReleaseNodes(park=True):
                kept = self.launcher.park(run.run_id, run.allocation_info, spec.user if spec else None)
                if kept.done:
                    with self.store.tx() as tx:
                        tx.update_run(run.number, allocation_info=None, parked_allocation=kept.info)
            case ReleaseNodes():
                if self.launcher.release(run.run_id, run.allocation_info or run.parked_allocation):
                    with self.store.tx() as tx:
                        tx.update_run(run.number, allocation_info=None, parked_allocation=None)
                # else the record stays, and the next tick asks to release again
            case StartAttempt() if spec is not None:
                self._start(run, spec, seen.run_dir, e, now)
            case BringBackCheckpoints() if spec is not None:
                aside = attempts[e.number].set_aside if e.number in attempts else None
                if aside is not None:
                    self.moves.bring_back(run, spec, seen.run_dir, e.number, aside)
            case ResumeRun(from_step=int(step)) if spec is not None:
                self.moves.go_back_to(run, spec, seen.run_dir, step, now)
            case StopAttempt() | EnsureStopped():
                info = attempts[e.number].launch_info
                if info:
                    self.launcher.stop(info, force=e.force)
            case KillOrphans():
                self.launcher.stop(e.launch_info, force=True)
            case ProbeNodes() if spec is not None:
                with self.store.tx() as tx:
                    info = tx.get_run(run.number).allocation_info
                needs = trainer_cmd.node_requirements(spec, seen.run_dir)
                self.probes.submit(run_number=run.number, kind=e.kind, nodes=list(e.nodes),
                                   argv=node_health.probe_argv(spec.health.probe_args(), needs),
                                   timeout_s=spec.health.timeout_s,
                                   allocation_info=info)
                probed = ", ".join(e.nodes)
                self.post_event(run.number, EventKind.PROBE_STARTED, f"{e.kind} probe of {probed}",
                                {"nodes": list(e.nodes), "kind": e.kind})
            case EndAttempt():
                info = attempts[e.number].launch_info
                if info:
                    self.launcher.forget(info)
                self.telemetry.forget(run.run_id, e.number)
                self.memory.forget_attempt(run.number, e.number)
            case Emit(kind=EventKind.SPIKE_TRANSIENT | EventKind.SPIKE_PERSISTS):
                said = self.memory.attempt(run.number, int(str(e.data["attempt"]))).spikes_said
                said.add(int(str(e.data["step"])))
            case DrainNode() | ReturnNode() | RecordProbe() | ProbeAgain() | CommandHandled():
                self.node_effects.act(e)
            case (Emit() | SetRunState() | FinishRun() | ResumeRun() | AdoptAttempt() | MarkAttemptRunning()
                  | RecordFault() | MarkFaultsRecovered() | SkipData() | ReportStraggler()
                  | AllocateNodes() | StartAttempt() | ProbeNodes() | BringBackCheckpoints()):
                pass  # recorded, nothing to do outside (or, without a spec, nothing it can do)
            case _:
                assert_never(e)

    # --- acting ---------------------------------------------------------------------

    def post_event(self, run_number: int | None, kind: EventKind, message: str,
                   data: dict[str, object]) -> None:
        with self.store.tx() as tx:
            tx.add_event(run_number, kind, message, dict(data), self.clock())

    def _allocate(self, run: Run, spec: RunSpec, missing: int, keep: int | None, now: float) -> None:
        with self.store.tx() as tx:
            nodes = tx.list_nodes()
            current = tx.get_run(run.number)
        held = tuple(x.name for x in nodes if x.run_number == run.number and x.state is NodeState.ALLOCATED)
        count = len(held) + missing
        req = AllocationRequest(
            run_id=run.run_id, count=count, minimum=run.nodes, keep=keep, held=held,
            drained=frozenset(x.name for x in nodes if x.state is NodeState.DRAINED),
            idle=tuple(x.name for x in nodes if x.state is NodeState.IDLE),
            known=frozenset(x.name for x in nodes), info=current.allocation_info or current.parked_allocation,
            partition=spec.resources.partition, time_limit_min=spec.resources.time_limit_min,
            handles_usr1=spec.handles_usr1, user=spec.user,
        )
        grant = self.launcher.allocate(req)
        with self.store.tx() as tx:
            if current.parked_allocation is not None:  # the run goes on in the job it kept
                tx.update_run(run.number, parked_allocation=None)
            changes = grant_changes(tx.list_nodes(), run.number, grant)
            self._record_grant(tx, run.number, changes, now)
            got = len([x for x in tx.allocation(run.number) if x.state is NodeState.ALLOCATED])
            short = (count, got) if got < count else None
            if short is not None and self._short.get(run.number) != short:  # say it once, not every tick
                why = f" ({grant.note})" if grant.note else ""
                tx.add_event(run.number, EventKind.NODES_SHORT,
                             f"asked for {count} nodes, holding {got}; waiting{why}",
                             {"asked": count, "got": got, "note": grant.note}, now)
            self._short[run.number] = short
        self.memory.note_allocated(run.number, changes.added)

    def _checkpoint_interval(self, run: Run, spec: RunSpec, now: float, tier: str) -> int:
        """``every_steps = "auto"`` (or ``memory_every_steps``, ``tier`` memory): Young/Daly
        from what this run measured so far, the tier's own blocking cost."""
        with self.store.tx() as tx:
            stats = list(tx.attempt_stats(run.number).values())
            if tier == planning.TIER_MEMORY:
                saved = tx.list_memory_checkpoints(run.number)
                timed = [m.duration_s for m in saved if m.duration_s is not None]
                cost = sum(timed) / len(timed) if timed else None
            else:
                saves = sum(s.checkpoints for s in stats)
                cost = sum(s.checkpoint_s for s in stats) / saves if saves else None
            # Each attempt's first step is left out: it carries the warm-up (compile, caches).
            steps = sum(s.steps - 1 for s in stats if s.steps > 1)
            step_s = sum(s.step_time_s - (s.first_step_time_s or 0.0) for s in stats if s.steps > 1)
            auto = planning.auto_every_steps(cost, step_s / steps if steps else None, run.nodes,
                                             run.policy.failures_per_node_day, spec.total_steps, tier)
            what = "memory checkpoint" if tier == planning.TIER_MEMORY else "checkpoint"
            tx.add_event(run.number, EventKind.CHECKPOINT_INTERVAL, f"{what} {auto.why}",
                         {"every_steps": auto.every_steps, "tier": tier}, now)
        return auto.every_steps

    def _data_steps(self, run: Run, spec: RunSpec, e: StartAttempt, skips: list[tuple[int, int]],
                    now: float) -> int | None:
        """A [command] told {skip_to_step}: the data step its first step reads, past the
        run's skip windows; a window its checkpoint comes before is widened back to where
        it starts reading, and said (supervisor/policy/recovery.py). None for the others."""
        if spec.data_skip_unit != "steps":
            return None
        at, widen = skip_to(e.resume_step, skips)
        if widen is not None:
            with self.store.tx() as tx:
                tx.widen_data_skip(run.number, widen[0], widen[1])
                tx.add_event(run.number, EventKind.DATA_SKIP,
                             f"attempt {e.number} resumes from step {e.resume_step} and reads the data of "
                             f"step {at} next: the data of steps {widen[1]} to {at - 1} is stepped over",
                             {"attempt": e.number, "skip_to_step": at, "start": widen[1], "end": at,
                              "unit": "steps"}, now)
        return at

    def _start(self, run: Run, spec: RunSpec, run_dir: Path, e: StartAttempt, now: float) -> None:
        attempt = Attempt(run_number=run.number, number=e.number, state=AttemptState.LAUNCHING, nodes=e.nodes,
                          resume_from=e.resume_from, resume_step=e.resume_step, created_at=now,
                          precompile=e.precompile)
        try:
            with self.store.tx() as tx:  # this tick may have changed it (an allocation granted)
                run = tx.get_run(run.number)
                skips = tx.list_data_skips(run.number)  # the data windows spikes made the run skip
            skip_to_step = self._data_steps(run, spec, e, skips, now) if e.precompile is None else None
            launch = self.launch_specs.of(run, spec, run_dir, attempt, skip_to_step)
            if spec.resources.standby:  # kept on every healthy node the run holds, spares too
                with self.store.tx() as tx:
                    held = tuple(x.name for x in tx.allocation(run.number) if x.state is NodeState.ALLOCATED)
                launch = replace(launch, standby_nodes=held)
            if e.precompile is None:
                self.moves.clear_the_way(run, spec, run_dir, e)
            else:  # the pass's saves are not the run's: its own go out of the way (precompile.py)
                self.moves.keep_aside_for_pass(run, spec, run_dir, e.number)
            every = (self._checkpoint_interval(run, spec, now, planning.TIER_PERSISTENT)
                     if spec.auto_checkpoints else None)
            memory_every = (self._checkpoint_interval(run, spec, now, planning.TIER_MEMORY)
                            if spec.auto_memory_checkpoints else None)
            config = trainer_cmd.write_attempt_config(spec, run_dir, e.number, launch.argv, skips, every,
                                                      memory_every)
            run_as = users.for_launch(spec.user)
            if run_as is not None:  # its trainers write logs, checkpoints and results there
                ck = trainer_cmd.checkpoint_dir(spec, run_dir)
                users.hand_over(run_as, run_dir.parent, run_dir, config.parent.parent, config.parent, config,
                                *([ck] if ck.is_relative_to(run_dir) else []))
            tree = user_tree.of(spec.user)  # the run's checkpoints and scripts, as its user
            trainer_cmd.write_fence(spec, run_dir, e.number, tree)
            inputs = (precompile.fingerprint(spec, trainer_cmd.attempt_cwd(spec, run_dir), tree)
                      if spec.command is not None else None)  # what a resume after its failure compares
            info = self.launcher.start(launch)
        except (LaunchError, OSError) as err:  # a launch fault, judged next tick
            # No restart can run what cannot be executed, nor get past a link or special file
            # planted where the daemon writes.
            fatal = isinstance(err, (CannotExecute, UnsafePath))
            with self.store.tx() as tx:
                tx.update_attempt(run.number, e.number, launch_error=str(err)[:2000] or type(err).__name__,
                                  launch_fatal=fatal)
            return
        started = self.clock()
        with self.store.tx() as tx:
            recorded = {a.number: a for a in tx.list_attempts(run.number)}
            self._attempt_to(tx, recorded, e.number, AttemptState.RUNNING, launch_info=info,
                             started_at=started, inputs=inputs)
            if run.started_at is None:
                tx.update_run(run.number, started_at=started)
            tx.add_event(run.number, EventKind.ATTEMPT_STARTED,
                         f"attempt {e.number} started: {len(e.nodes) * run.ranks_per_node} ranks on "
                         f"{', '.join(e.nodes)}", {"attempt": e.number, "nodes": list(e.nodes)}, started)
