"""The reconciler: observe, decide, persist, act; once per tick, for every run.

1. Observe: the launcher's view of the live attempt's processes, the telemetry view,
   the checkpoint directory, the trainer's result file, queued operator commands.
2. Decide: ``policy.decide`` (pure).
3. Persist: all of the decision's records and events in one SQLite transaction.
4. Act: start, stop and drain through the launcher (recording what came of it, such
   as a launched attempt's pids, in a transaction of its own).

A run whose reconciliation raises is logged and retried next tick; it never stops the
other runs.

Level-triggered and idempotent: everything it needs is in SQLite or observable, so a
restarted daemon carries on where a killed one stopped. An attempt is recorded before
it is launched (LAUNCHING); if the daemon dies between the two, the next tick finds
the attempt's processes by their marker, or learns that none exist, and never starts
a second copy.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path

from supervisor import checkpoint_scan, node_health, planning, trainer_cmd
from supervisor.domain import (
    LIVE_ATTEMPT_STATES,
    TERMINAL_RUN_STATES,
    AllocateNodes,
    Attempt,
    AttemptObs,
    AttemptState,
    CheckpointRef,
    Command,
    CommandHandled,
    DrainNode,
    Effect,
    Emit,
    EndAttempt,
    EnsureStopped,
    FaultRecord,
    FinishRun,
    MarkAttemptRunning,
    MarkFaultsRecovered,
    Node,
    NodeCommand,
    NodeCommandKind,
    NodeState,
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
    StopAttempt,
    StragglerReport,
    TrainerResult,
)
from supervisor.errors import LaunchError, NotFound
from supervisor.launchers.base import AllocationRequest, Grant, Launcher, LaunchSpec
from supervisor.policy import decide, resume_before, transient_spikes, unreadable_checkpoints
from supervisor.spec import RunSpec, spec_from_json
from supervisor.store import SqlStore, Tx
from supervisor.telemetry import Received, TelemetryView
from trainer import protocol as p

log = logging.getLogger(__name__)

DRAINED_BY_US = "training-supervisor:"  # how every drain Reason this supervisor writes begins

_QUIET_SCAN_S = 2.0  # how often a [command] trainer's checkpoint directory is scanned for progress


def _last(values: deque[float], n: int) -> tuple[float, ...]:
    return tuple(islice(values, max(0, len(values) - n), None))


def _latest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return max(known) if known else None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconcilerConfig:
    mqtt_url: str | None  # what the trainers publish to; None: no telemetry
    # The periodic sweep of idle nodes and of nodes this supervisor drained (None: off):
    sweep_every_s: float | None = None
    sweep_args: tuple[str, ...] = ()  # extra arguments to python -m health
    sweep_timeout_s: float = 60.0
    # A node this supervisor drained returns to service after this many clean sweep
    # probes in a row (0: never; an operator returns it by hand).
    return_after: int = 0


@dataclass(slots=True, kw_only=True)
class _ProbeJob:
    """One round of probes in flight on a worker thread, for some nodes of a run or for
    the sweep. Its answers are judged on the reconciler's thread, at a later tick."""

    run: Run | None  # None: the sweep
    kind: str  # preflight, diagnosis, sweep
    nodes: list[str]
    argv: tuple[str, ...]
    timeout_s: float
    round: int
    future: Future[dict[str, str]] = field(repr=False)


class Reconciler:
    def __init__(
        self, store: SqlStore, launcher: Launcher, telemetry: TelemetryView,
        config: ReconcilerConfig, clock: Callable[[], float] = time.time,
        probe_pool: Executor | None = None,
    ) -> None:
        self.store = store
        self.launcher = launcher
        self.telemetry = telemetry
        self.config = config
        self.clock = clock
        self._specs: dict[int, tuple[RunSpec, Path]] = {}
        # (run, attempt, rank) -> when this daemon first saw the rank dead
        self._dead_since: dict[tuple[int, int, int], float] = {}
        self._short: dict[int, tuple[int, int] | None] = {}  # run -> last (asked, got) shortage said
        # (run, attempt) -> (checkpoint step, when first seen, when scanned): [command] trainers
        self._quiet: dict[tuple[int, int], tuple[int, float | None, float]] = {}
        self._spikes_said: set[tuple[int, int, int]] = set()  # (run, attempt, step) reported
        # Probes run on worker threads (a probe may take a minute; the loop must not wait).
        self._probe_pool = probe_pool or ThreadPoolExecutor(max_workers=4, thread_name_prefix="probe")
        self._probes: list[_ProbeJob] = []
        self._swept_at = clock()  # the first sweep comes one interval after start

    def close(self) -> None:
        """Stop taking probe results; probes in flight end by their own timeouts."""
        self._probe_pool.shutdown(wait=False, cancel_futures=True)

    def tick(self) -> None:
        now = self.clock()
        self._persist_telemetry(now)
        self._collect_probes(now)
        self._maybe_sweep(now)
        self._node_commands(now)
        with self.store.tx() as tx:
            commands = tx.pending_commands()
            runs = [r for r in tx.list_runs() if r.state not in TERMINAL_RUN_STATES]
            busy = {r.number for r in runs}
            for number in {c.run_number for c in commands} | tx.finished_runs_holding_resources():
                if number not in busy:
                    runs.append(tx.get_run(number))
        for run in runs:
            try:
                self._reconcile(run, [c for c in commands if c.run_number == run.number], now)
            except Exception:
                # One run's trouble (a vanished directory, a full disk) must not stall
                # the others; the next tick tries again from what is recorded.
                log.exception("%s: reconciliation failed; retrying next tick", run.run_id)
        active = {r.number for r in runs}
        for number in [n for n in self._specs if n not in active]:
            del self._specs[number]

    def post_event(self, run_number: int | None, kind: str, message: str, data: dict[str, object]) -> None:
        """Record an event from outside the loop (chaos injection, operator notes)."""
        with self.store.tx() as tx:
            tx.add_event(run_number, kind, message, dict(data), self.clock())

    # --- observe --------------------------------------------------------------------

    def _spec(self, tx: Tx, number: int) -> tuple[RunSpec, Path]:
        if number not in self._specs:
            text, run_dir = tx.run_spec_and_dir(number)
            self._specs[number] = (spec_from_json(text), run_dir)
        return self._specs[number]

    def _reconcile(self, run: Run, commands: list[Command], now: float) -> None:
        if run.allocation_info is not None:
            # Before a launch, ask the cluster afresh: a step must not be started in an
            # allocation that ended a moment ago (preempted, cancelled, out of time).
            recovering = run.state in (RunState.PENDING, RunState.STARTING, RunState.RECOVERING)
            self._sync_allocation(run, now, fresh=recovering)
        with self.store.tx() as tx:
            attempts = tuple(tx.list_attempts(run.number))
            spec, run_dir = self._spec(tx, run.number)
            allocation = tuple(tx.allocation(run.number))
            open_faults = tx.count_open_faults(run.number)
            faults = tuple(tx.list_faults(run.number))
            stragglers = tuple(StragglerReport(attempt=int(e.data["attempt"]), rank=int(e.data["rank"]),
                                               node=str(e.data["node"]))
                               for e in tx.list_events(run.number, kind="straggler", limit=100_000))
        live = attempts[-1] if attempts and attempts[-1].state in LIVE_ATTEMPT_STATES else None
        cluster_faults: tuple[FaultRecord, ...] = ()
        if live is not None:  # only a live attempt can have a fault that blames a node
            with self.store.tx() as tx:
                cluster_faults = tuple(tx.faults_since(now - run.policy.lemon_window_s))
        newest = None
        # The checkpoint matters only when this tick may launch: no attempt training,
        # and a run that wants one (or a command that may make it want one).
        may_launch = bool(commands) or run.state in (RunState.PENDING, RunState.STARTING, RunState.RECOVERING)
        if may_launch and (live is None or live.state is not AttemptState.RUNNING):
            newest = self._newest_checkpoint(run, spec, run_dir, now, resume_before(attempts, faults),
                                             unreadable_checkpoints(faults))
        view = RunView(run=run, attempts=attempts, allocation=allocation, newest_checkpoint=newest,
                       commands=tuple(commands), open_faults=open_faults, faults=faults,
                       probing=self._probing(run.number),
                       diagnose=spec.health.diagnose, stragglers=stragglers, cluster_faults=cluster_faults)
        obs = self._observe(run, spec, run_dir, live, now) if live else None
        if obs is not None and run.allocation_info is not None and any(
                r.proc in (ProcState.EXITED, ProcState.VANISHED) or r.lost for r in obs.ranks):
            # Ranks died: before anyone is blamed, learn afresh whether the cluster took
            # the allocation away (then no node is at fault).
            self._sync_allocation(run, now, fresh=True)
            with self.store.tx() as tx:
                view = replace(view, allocation=tuple(tx.allocation(run.number)),
                               probing=self._probing(run.number))
        effects = decide(view, obs, now)
        if effects:
            self._apply(run, spec, run_dir, view, effects, now)
        if obs is not None and live is not None:
            self._report_transient_spikes(run, live.number, obs, now)

    def _report_transient_spikes(self, run: Run, attempt: int, obs: AttemptObs, now: float) -> None:
        """Spikes too short to act on are counted and reported: an event each, once."""
        for spike in transient_spikes(obs.recent, run.policy):
            key = (run.number, attempt, spike.step)
            if key in self._spikes_said:
                continue
            self._spikes_said.add(key)
            self.post_event(run.number, "spike.transient", f"{spike.summary}: not acted on (shorter than "
                            f"{run.policy.spike_persist_steps} steps)",
                            {"attempt": attempt, "step": spike.step, "steps": spike.steps})

    def _newest_checkpoint(self, run: Run, spec: RunSpec, run_dir: Path, now: float,
                           before_step: int | None = None, exclude: frozenset[int] = frozenset(),
                           ) -> CheckpointRef | None:
        newest, rejected = checkpoint_scan.pick(trainer_cmd.checkpoint_dir(spec, run_dir),
                                                trainer_cmd.checkpoint_layout(spec), before_step, exclude)
        with self.store.tx() as tx:
            for v in rejected:
                if tx.record_checkpoint(run.number, step=v.step, path=str(v.path), complete=False,
                                        duration_s=None, attempt=None, now=now):
                    tx.add_event(run.number, "checkpoint.rejected",
                                 f"checkpoint at step {v.step} fails verification: {v.why}",
                                 {"step": v.step, "path": str(v.path)}, now)
            if newest is not None:
                tx.record_checkpoint(run.number, step=newest.step, path=str(newest.path), complete=True,
                                     duration_s=None, attempt=None, now=now)
        return None if newest is None else CheckpointRef(step=newest.step, path=str(newest.path))

    def _observe(
        self, run: Run, spec: RunSpec, run_dir: Path, live: Attempt, now: float
    ) -> AttemptObs | None:
        launch_info = live.launch_info
        if launch_info is None:
            if live.launch_error is not None:
                return AttemptObs(ranks=(), never_started=True, launch_error=live.launch_error)
            found = self.launcher.find(self._launch_spec(run, spec, run_dir, live))
            if found is None:
                return AttemptObs(ranks=(), never_started=True)
            world = len(live.nodes) * run.ranks_per_node
            if len(self.launcher.observe(found)) < world:
                # The daemon died part-way through starting the ranks: the ones that
                # exist wait for peers that never come. Kill them and start afresh.
                self.launcher.stop(found, force=True)
                return AttemptObs(ranks=(), never_started=True)
            with self.store.tx() as tx:  # re-adopt what a killed daemon launched
                adopted = AttemptState.RUNNING if live.state is AttemptState.LAUNCHING else live.state
                tx.update_attempt(run.number, live.number, launch_info=found, state=adopted,
                                  started_at=live.started_at or now)
                tx.add_event(run.number, "attempt.adopted",
                             f"attempt {live.number}: found its processes running, adopted them",
                             {"attempt": live.number}, now)
            launch_info = found
        procs = self.launcher.observe(launch_info)
        tele = self.telemetry.ranks(run.run_id, live.number)
        # A [command] trainer sends no telemetry: its progress is its checkpoints and output.
        quiet = self._quiet_progress(spec, run_dir, live, now) if spec.command is not None else None
        ranks = []
        for proc in procs:
            t = tele.get(proc.rank)
            dead_since = None
            lost_unseen = proc.proc is ProcState.UNKNOWN and t is not None and t.lost
            if proc.proc in (ProcState.EXITED, ProcState.VANISHED) or lost_unseen:
                dead_since = self._dead_since.setdefault((run.number, live.number, proc.rank), now)
            ranks.append(RankObs(
                rank=proc.rank, node=proc.node, proc=proc.proc, exit_code=proc.exit_code,
                reported_exit_code=t.exit_code if t else None,
                reported_reason=t.exit_reason if t else "",
                reported_exit_at=t.exit_at if t else None,
                lost=t.lost if t else False,
                dead_since=dead_since,
                last_step=max(t.last_step if t else 0, quiet[0] if quiet else 0, live.resume_step),
                progress_at=_latest(t.progress_at if t else None, quiet[1] if quiet else None),
                phase=t.phase if t else None,
                last_seen_at=t.last_seen_at if t else None,
                nonfinite_step=t.nonfinite_step if t else None,
                busy_recent_s=_last(t.busy_times, run.policy.straggler_window) if t else (),
            ))
        gone = all(r.proc in (ProcState.EXITED, ProcState.VANISHED) for r in ranks)
        result = None
        if gone and spec.command is not None:
            # A plain command has no result file: every rank exiting 0 is its success.
            if all(r.proc is ProcState.EXITED and r.exit_code == 0 for r in ranks):
                final = max([live.resume_step, *(r.last_step for r in ranks)])
                result = TrainerResult(final_step=max(final, spec.command.steps), model_digest=None)
        elif gone:
            result = trainer_cmd.read_result(trainer_cmd.result_path(spec, run_dir), run.run_id, live.number)
        p99, samples = self.telemetry.step_time_p99(run.run_id, live.number)
        return AttemptObs(ranks=tuple(ranks), result=result, telemetry_up_since=self.telemetry.up_since,
                          step_time_p99_s=p99, step_time_samples=samples,
                          checkpoint_p99_s=self.telemetry.checkpoint_p99(run.run_id),
                          recent=self.telemetry.recent_steps(run.run_id, live.number))

    def _quiet_progress(
        self, spec: RunSpec, run_dir: Path, live: Attempt, now: float
    ) -> tuple[int, float | None]:
        """(newest complete checkpoint step, when progress was last seen) for a trainer
        without telemetry: a new checkpoint is a step; new output is a sign of life."""
        key = (live.run_number, live.number)
        step, step_seen_at, scanned_at = self._quiet.get(key, (live.resume_step, None, 0.0))
        if now - scanned_at >= _QUIET_SCAN_S:
            newest, _ = checkpoint_scan.pick(trainer_cmd.checkpoint_dir(spec, run_dir),
                                             trainer_cmd.checkpoint_layout(spec))
            if newest is not None and newest.step > step:
                step, step_seen_at = newest.step, now
            self._quiet[key] = (step, step_seen_at, now)
        logs = trainer_cmd.attempt_dir(run_dir, live.number).glob("*.log")
        output_at = max((p.stat().st_mtime for p in logs if p.exists()), default=None)
        return step, _latest(step_seen_at, output_at)

    def _persist_telemetry(self, now: float) -> None:
        items = self.telemetry.peek_durable()
        if not items:
            return
        with self.store.tx() as tx:
            numbers = {r.run_id: r.number for r in tx.list_runs()}
        try:
            with self.store.tx() as tx:
                for item in items:
                    self._persist_one(tx, numbers, item)
        except Exception:
            # One bad item must not block the rest forever: store them one by one and
            # drop (and count) only those that fail on their own.
            log.exception("persisting telemetry failed; retrying item by item")
            failed = 0
            for item in items:
                try:
                    with self.store.tx() as tx:
                        self._persist_one(tx, numbers, item)
                except Exception:
                    failed += 1
            if failed == len(items):
                raise  # the database, not the items: keep them all for the next tick
            self.telemetry.counts["durable_dropped"] += failed
        self.telemetry.drop_durable(len(items))  # only once they are committed (or hopeless)

    def _persist_one(self, tx: Tx, numbers: dict[str, int], item: Received) -> None:
        msg = item.msg
        number = numbers.get(msg.run)
        if number is None:
            return  # telemetry of a run this daemon does not know
        if isinstance(msg, p.StepMetrics):
            tx.add_metric(number, attempt=msg.attempt, step=msg.step, loss=msg.loss,
                          grad_norm=msg.grad_norm, lr=msg.lr, step_time_s=msg.step_time_s,
                          tokens_per_s=msg.tokens_per_s, now=item.at)
        elif isinstance(msg, p.FaultInjected):  # a drill's fault, injected by the trainer itself
            tx.add_event(number, "chaos.injected",
                         f"chaos {msg.action} fired in the trainer at step {msg.step}: {msg.detail} "
                         f"(rank {msg.rank})",
                         {"action": msg.action, "step": msg.step, "attempt": msg.attempt, "rank": msg.rank},
                         item.at)
        elif tx.record_checkpoint(number, step=msg.step, path=msg.path, complete=True,
                                  duration_s=msg.duration_s, attempt=msg.attempt, now=item.at):
            tx.add_event(number, "checkpoint.committed",
                         f"checkpoint at step {msg.step} committed in {msg.duration_s:.2f} s",
                         {"step": msg.step, "path": msg.path, "attempt": msg.attempt}, item.at)

    # --- persist and act ------------------------------------------------------------

    def _apply(self, run: Run, spec: RunSpec, run_dir: Path, view: RunView,
               effects: list[Effect], now: float) -> None:
        with self.store.tx() as tx:
            state = run.state
            for e in effects:
                state = self._record(tx, run.number, state, view, e, now)
        for e in effects:
            self._act(run, spec, run_dir, view, e, now)

    def _record(self, tx: Tx, n: int, state: RunState, view: RunView, e: Effect, now: float) -> RunState:
        """Persist one effect; returns the run's state after it."""
        match e:
            case Emit():
                tx.add_event(n, e.kind, e.message, e.data, now)
            case SetRunState():
                tx.update_run(n, state=e.state, reason=e.reason)
                tx.add_event(n, "run.state", f"{state} -> {e.state}: {e.reason}",
                             {"from": state.value, "to": e.state.value}, now)
                return e.state
            case ResumeRun():
                tx.update_run(n, state=RunState.PENDING, reason=e.reason, ended_at=None,
                              budget_from_attempt=len(view.attempts))
                tx.add_event(n, "run.state", f"{state} -> PENDING: {e.reason}",
                             {"from": state.value, "to": "PENDING"}, now)
                return RunState.PENDING
            case FinishRun():
                tx.update_run(n, state=e.state, reason=e.reason, ended_at=now,
                              final_step=e.final_step, model_digest=e.model_digest)
                tx.add_event(n, "run.state", f"{state} -> {e.state}: {e.reason}",
                             {"from": state.value, "to": e.state.value, "final_step": e.final_step,
                              "model_digest": e.model_digest}, now)
                return e.state
            case StartAttempt():
                tx.add_attempt(Attempt(
                    run_number=n, number=e.number, state=AttemptState.LAUNCHING, nodes=e.nodes,
                    resume_from=e.resume_from, resume_step=e.resume_step, created_at=now))
            case MarkAttemptRunning():
                tx.update_attempt(n, e.number, first_step_at=now)
            case StopAttempt():
                tx.update_attempt(n, e.number, state=AttemptState.STOPPING, stop_requested_at=now,
                                  outcome=e.outcome, reason=e.reason)
                tx.add_event(n, "attempt.stopping", f"attempt {e.number}: stopping ({e.reason})",
                             {"attempt": e.number}, now)
            case EndAttempt():
                tx.update_attempt(n, e.number, state=AttemptState.ENDED, ended_at=now,
                                  outcome=e.outcome, reason=e.reason, final_step=e.final_step)
                tx.add_event(n, "attempt.ended",
                             f"attempt {e.number} ended {e.outcome} at step {e.final_step}: {e.reason}",
                             {"attempt": e.number, "outcome": e.outcome.value, "final_step": e.final_step},
                             now)
            case RecordFault():
                tx.add_fault(n, attempt=e.attempt, kind=e.kind, ranks=e.ranks, nodes=e.nodes,
                             step=e.step, summary=e.summary, now=now)
            case MarkFaultsRecovered():
                if tx.mark_faults_recovered(n, now):
                    tx.add_event(n, "run.recovered", "training again after the fault", {}, now)
            case DrainNode():
                tx.put_node(Node(name=e.node, state=NodeState.DRAINED, reason=e.reason, run_number=n), now)
                tx.add_event(n, "node.drained", f"node {e.node} drained: {e.reason}", {"node": e.node}, now)
            case ReleaseNodes():
                for node in view.allocation:  # a drained node keeps the run that drained it
                    if node.state is NodeState.ALLOCATED:
                        tx.put_node(Node(name=node.name, state=NodeState.IDLE), now)
            case CommandHandled():
                tx.finish_command(e.command_id, e.result, now)
            case SkipData():
                tx.add_event(n, "data.skip", f"skipping samples {e.start} to {e.end} from the next attempt "
                             f"on: {e.reason}", {"start": e.start, "end": e.end}, now)
            case AllocateNodes() | EnsureStopped() | ProbeNodes():
                pass  # nothing to record before acting
        return state

    def _act(self, run: Run, spec: RunSpec, run_dir: Path, view: RunView, e: Effect, now: float) -> None:
        match e:
            case AllocateNodes():
                self._allocate(run, spec, e.count, now)
            case ReleaseNodes():
                if self.launcher.release(run.run_id, run.allocation_info):
                    with self.store.tx() as tx:
                        tx.update_run(run.number, allocation_info=None)
                # else the record stays, and the next tick asks to release again
            case StartAttempt():
                self._start(run, spec, run_dir, e, now)
            case StopAttempt() | EnsureStopped():
                attempt = next((a for a in view.attempts if a.number == e.number), None)
                if attempt is not None and attempt.launch_info:
                    self.launcher.stop(attempt.launch_info, force=e.force)
            case ProbeNodes():
                self._start_probes(run, spec, list(e.nodes), e.kind)
            case DrainNode():
                try:
                    self.launcher.drain(e.node, e.reason)
                except LaunchError as err:
                    log.error("%s: %s", run.run_id, err)
                    self.post_event(run.number, "node.drain_failed", str(err), {"node": e.node})
            case EndAttempt():
                attempt = next((a for a in view.attempts if a.number == e.number), None)
                if attempt is not None and attempt.launch_info:
                    self.launcher.forget(attempt.launch_info)
                self.telemetry.forget(run.run_id, e.number)
                for key in [k for k in self._dead_since if k[:2] == (run.number, e.number)]:
                    del self._dead_since[key]
                self._spikes_said = {k for k in self._spikes_said if k[:2] != (run.number, e.number)}
            case _:
                pass

    def _allocate(self, run: Run, spec: RunSpec, missing: int, now: float) -> None:
        with self.store.tx() as tx:
            nodes = tx.list_nodes()
            current = tx.get_run(run.number)
        held = tuple(x.name for x in nodes if x.run_number == run.number and x.state is NodeState.ALLOCATED)
        count = len(held) + missing
        req = AllocationRequest(
            run_id=run.run_id, count=count, minimum=run.nodes, held=held,
            drained=frozenset(x.name for x in nodes if x.state is NodeState.DRAINED),
            idle=tuple(x.name for x in nodes if x.state is NodeState.IDLE),
            known=frozenset(x.name for x in nodes), info=current.allocation_info,
            partition=spec.resources.partition, time_limit_min=spec.resources.time_limit_min,
        )
        grant = self.launcher.allocate(req)
        with self.store.tx() as tx:
            added = self._take_grant(tx, run.number, grant, now)
            got = len([x for x in tx.allocation(run.number) if x.state is NodeState.ALLOCATED])
            short = (count, got) if got < count else None
            if short is not None and self._short.get(run.number) != short:  # say it once, not every tick
                why = f" ({grant.note})" if grant.note else ""
                tx.add_event(run.number, "nodes.short",
                             f"asked for {count} nodes, holding {got}; waiting{why}",
                             {"asked": count, "got": got, "note": grant.note}, now)
            self._short[run.number] = short
        if added and spec.health.preflight:
            self._start_probes(run, spec, added, "preflight")

    def _sync_allocation(self, run: Run, now: float, *, fresh: bool) -> None:
        """Follow what the cluster says the run holds: an allocation can shrink or end."""
        grant = self.launcher.held(run.run_id, run.allocation_info, fresh=fresh)
        if grant is None:
            return
        with self.store.tx() as tx:
            added = self._take_grant(tx, run.number, grant, now)
            spec = spec_from_json(tx.run_spec_and_dir(run.number)[0])
        if added and spec.health.preflight:  # a queued allocation has just started
            self._start_probes(run, spec, added, "preflight")

    # --- operators' node commands -------------------------------------------------------

    def _node_commands(self, now: float) -> None:
        """Drain and undrain, as an operator asked. The cluster is told first and the
        store after, so a daemon killed in between does it again (both are idempotent),
        and a command the cluster refused says why."""
        with self.store.tx() as tx:
            commands = tx.pending_node_commands()
        for cmd in commands:
            node: Node | None = None
            with self.store.tx() as tx, contextlib.suppress(NotFound):
                node = tx.get_node(cmd.node)  # as the command before it left it
            if node is None:  # a node the store forgot: nothing to do
                result = "rejected: no such node"
            elif cmd.kind is NodeCommandKind.DRAIN:
                result = self._operator_drain(node, cmd, now)
            elif node.state is not NodeState.DRAINED:
                result = f"rejected: {node.name} is {node.state}, not drained"
            else:
                result = self._operator_undrain(node, cmd, now)
            with self.store.tx() as tx:
                tx.finish_command(cmd.id, result, now)
                if result.startswith("rejected"):
                    tx.add_event(node.run_number if node else None, "command.rejected",
                                 f"{cmd.kind} {cmd.node} {result}", {"node": cmd.node}, now)

    def _operator_drain(self, node: Node, cmd: NodeCommand, now: float) -> str:
        reason = f"operator: {cmd.reason}"
        try:
            self.launcher.drain(node.name, reason)
        except LaunchError as err:
            return f"rejected: {err}"
        with self.store.tx() as tx:
            tx.put_node(Node(name=node.name, state=NodeState.DRAINED, reason=reason,
                             run_number=node.run_number), now)
            held = node.state is NodeState.ALLOCATED and node.run_number is not None
            after = f"; run-{node.run_number} trains on, its next attempt leaves it out" if held else ""
            tx.add_event(node.run_number, "node.drained", f"node {node.name} drained: {reason}{after}",
                         {"node": node.name, "operator": True}, now)
        return "accepted"

    def _operator_undrain(self, node: Node, cmd: NodeCommand, now: float) -> str:
        try:
            self.launcher.undrain(node.name)
        except LaunchError as err:
            return f"rejected: {err}"
        with self.store.tx() as tx:
            # Idle again; a run whose allocation still has it takes it back at its next
            # look at what it holds (launchers.base.Launcher.held).
            tx.put_node(Node(name=node.name, state=NodeState.IDLE), now)
            why = f": {cmd.reason}" if cmd.reason else ""
            tx.add_event(node.run_number, "node.returned",
                         f"node {node.name} returned to service by an operator{why} "
                         f"(drained for: {node.reason})",
                         {"node": node.name, "operator": True}, now)
        return "accepted"

    # --- node probes ------------------------------------------------------------------

    def _probing(self, run_number: int) -> bool:
        return any(j.run is not None and j.run.number == run_number for j in self._probes)

    def _start_probes(self, run: Run, spec: RunSpec, nodes: Sequence[str], kind: str) -> None:
        """Probe ``nodes`` of ``run`` (python -m health on each) on a worker thread; the
        run launches nothing until the answers are judged (``RunView.probing``)."""
        argv = node_health.probe_argv(spec.health.args)
        self._submit(run, kind, list(nodes), argv, spec.health.timeout_s, 1)
        self.post_event(run.number, "probe.started", f"{kind} probe of {', '.join(nodes)}",
                        {"nodes": list(nodes), "kind": kind})

    def _submit(self, run: Run | None, kind: str, nodes: list[str], argv: tuple[str, ...],
                timeout_s: float, round_: int) -> None:
        with self.store.tx() as tx:
            if run is None:
                drained = {x.name: x.reason for x in tx.list_nodes()
                           if x.name in nodes and x.state is NodeState.DRAINED}
                idle = [n for n in nodes if n not in drained]
                future = self._probe_pool.submit(self._sweep_probe, idle, drained, argv, timeout_s)
            else:
                info = tx.get_run(run.number).allocation_info
                future = self._probe_pool.submit(self.launcher.probe, nodes, argv, allocation_info=info,
                                                 timeout_s=timeout_s)
        self._probes.append(_ProbeJob(run=run, kind=kind, nodes=nodes, argv=argv, timeout_s=timeout_s,
                                      round=round_, future=future))

    def _collect_probes(self, now: float) -> None:
        """Judge every finished round of probes: record each node's result, drain the
        nodes whose bad result is confirmed, probe the unconfirmed ones again at once
        (supervisor/node_health.py), and return clean drained nodes to service."""
        for job in [j for j in self._probes if j.future.done()]:
            self._probes.remove(job)
            try:
                answers = job.future.result()
            except Exception as e:  # a launcher that raised: every node of the round gave no answer
                log.error("%s probe of %s failed: %s", job.kind, ", ".join(job.nodes), e)
                answers = {}
            again = self._judge_probes(job, answers, now)
            if again and job.round < node_health.CONFIRMATIONS:
                self._submit(job.run, job.kind, again, job.argv, job.timeout_s, job.round + 1)

    def _judge_probes(self, job: _ProbeJob, answers: dict[str, str], now: float) -> list[str]:
        run_number = job.run.number if job.run is not None else None
        again: list[str] = []
        drains: list[tuple[str, str]] = []
        returns: list[str] = []
        with self.store.tx() as tx:
            known = {x.name: x for x in tx.list_nodes()}
            for node in job.nodes:
                record = node_health.record(node, answers.get(node), job.kind, run_number, self.clock())
                tx.add_probe(record)
                recent = tx.recent_probes(node, max(node_health.CONFIRMATIONS, self.config.return_after))
                statuses, reasons = [p.status for p in recent], [p.reason for p in recent]
                j = node_health.judge(statuses, reasons)
                tx.add_event(run_number, f"probe.{record.status}",
                             f"{job.kind} probe of {node}: {record.status}"
                             + (f" ({record.reason})" if record.reason else ""),
                             {"node": node, "status": record.status, "action": record.action}, now)
                current = known.get(node)
                if job.run is None and (current is None or current.state is NodeState.ALLOCATED):
                    continue  # taken by a run while the sweep probed it: that run's probes judge it
                if current is not None and current.state is NodeState.DRAINED:
                    # Only the sweep returns a node, and only one this supervisor drained.
                    if job.run is None and current.reason.startswith(DRAINED_BY_US) \
                            and node_health.may_return(statuses, self.config.return_after):
                        tx.put_node(Node(name=node, state=NodeState.IDLE), now)
                        tx.add_event(None, "node.returned",
                                     f"node {node} returned to service: {self.config.return_after} clean "
                                     f"probes in a row (drained for: {current.reason})", {"node": node}, now)
                        returns.append(node)
                    continue
                if j.drain:
                    where = f"{job.run.run_id}, {job.kind}" if job.run is not None else job.kind
                    why = f"training-supervisor: probe: {j.reason[:200]} ({where})"
                    tx.put_node(Node(name=node, state=NodeState.DRAINED, reason=why, run_number=run_number),
                                now)
                    tx.add_event(run_number, "node.drained", f"node {node} drained: {why}", {"node": node},
                                 now)
                    drains.append((node, why))
                elif j.confirm:
                    again.append(node)
        for node, why in drains:  # recorded first: a failed scontrol is retried by no one else
            try:
                self.launcher.drain(node, why)
            except LaunchError as err:
                log.error("%s", err)
                self.post_event(run_number, "node.drain_failed", str(err), {"node": node})
        for node in returns:
            try:
                self.launcher.undrain(node)
            except LaunchError as err:
                log.error("%s", err)
                self.post_event(None, "node.return_failed", str(err), {"node": node})
        return again

    # --- the sweep ----------------------------------------------------------------------

    def _maybe_sweep(self, now: float) -> None:
        """Every ``sweep_every_s``: probe the idle nodes and the nodes this supervisor
        drained (not those an operator drained by hand), one round at a time."""
        every = self.config.sweep_every_s
        if every is None or now - self._swept_at < every or any(j.run is None for j in self._probes):
            return
        self._swept_at = now
        with self.store.tx() as tx:
            nodes = [x.name for x in tx.list_nodes() if x.state is NodeState.IDLE
                     or (x.state is NodeState.DRAINED and x.reason.startswith(DRAINED_BY_US))]
        if nodes:
            self._submit(None, "sweep", nodes, node_health.probe_argv(self.config.sweep_args),
                         self.config.sweep_timeout_s, 1)

    def _sweep_probe(self, idle: list[str], drained: dict[str, str], argv: tuple[str, ...],
                     timeout_s: float) -> dict[str, str]:
        """On a worker thread: the sweep's probes; drained nodes (with their Reasons) go
        through the launcher's out-of-service path (on Slurm no job runs on a drained node)."""
        out: dict[str, str] = {}
        if idle:
            out.update(self.launcher.probe(idle, argv, allocation_info=None, timeout_s=timeout_s))
        if drained:
            out.update(self.launcher.probe_drained(drained, argv, timeout_s=timeout_s))
        return out

    def _take_grant(self, tx: Tx, n: int, grant: Grant, now: float) -> list[str]:
        """Make the store's node records say what ``grant`` says the run holds; returns
        the nodes newly held."""
        if grant.info != tx.get_run(n).allocation_info:
            tx.update_run(n, allocation_info=grant.info)
        known = {x.name: x for x in tx.list_nodes()}
        added = []
        for name in grant.nodes:
            node = known.get(name)
            if node is not None and node.state is NodeState.DRAINED:
                continue  # ours, but out of service: it stays drained
            if node is None or node.run_number != n or node.state is not NodeState.ALLOCATED:
                tx.put_node(Node(name=name, state=NodeState.ALLOCATED, run_number=n), now)
                added.append(name)
        if added:
            tx.add_event(n, "nodes.allocated", f"allocated {', '.join(added)}", {"nodes": added}, now)
        # Held no more (a drained node keeps the run that drained it, as a record).
        gone = [x for x in known.values() if x.run_number == n and x.name not in grant.nodes
                and x.state is NodeState.ALLOCATED]
        for node in gone:
            tx.put_node(Node(name=node.name, state=NodeState.IDLE), now)
        lost = [x.name for x in gone]
        if lost:
            tx.add_event(n, "nodes.released", f"no longer held: {', '.join(lost)}", {"nodes": lost}, now)
        return added

    def _launch_spec(self, run: Run, spec: RunSpec, run_dir: Path, a: Attempt) -> LaunchSpec:
        with self.store.tx() as tx:  # this tick may have changed it (an allocation granted)
            allocation_info = tx.get_run(run.number).allocation_info
        config_path = trainer_cmd.config_path(run_dir, a.number)
        env = {**trainer_cmd.attempt_env(spec, run_dir), "TSUP_RUN_ID": run.run_id,
               "TSUP_ATTEMPT": str(a.number)}
        if self.config.mqtt_url:
            env["TSUP_MQTT_URL"] = self.config.mqtt_url
        return LaunchSpec(
            run_id=run.run_id, attempt=a.number, nodes=a.nodes, ranks_per_node=run.ranks_per_node,
            argv=trainer_cmd.attempt_argv(spec, run_dir, a.number, a.resume_from, a.resume_step), env=env,
            log_dir=trainer_cmd.attempt_dir(run_dir, a.number), marker=str(config_path),
            allocation_info=allocation_info,
        )

    def _checkpoint_interval(self, run: Run, spec: RunSpec, now: float) -> int:
        """``every_steps = "auto"``: Young/Daly from what this run measured so far."""
        with self.store.tx() as tx:
            costs = [c.duration_s for c in tx.list_checkpoints(run.number) if c.duration_s]
            steps = [m.step_time_s for m in tx.list_metrics(run.number)[-1000:]]
            auto = planning.auto_every_steps(costs, steps, run.nodes, run.policy.failures_per_node_day,
                                             spec.total_steps)
            tx.add_event(run.number, "checkpoint.interval", f"checkpoint {auto.why}",
                         {"every_steps": auto.every_steps}, now)
        return auto.every_steps

    def _start(self, run: Run, spec: RunSpec, run_dir: Path, e: StartAttempt, now: float) -> None:
        attempt = Attempt(run_number=run.number, number=e.number, state=AttemptState.LAUNCHING,
                          nodes=e.nodes, resume_from=e.resume_from, resume_step=e.resume_step,
                          created_at=now)
        try:
            launch = self._launch_spec(run, spec, run_dir, attempt)
            with self.store.tx() as tx:  # the data windows spikes made the run skip
                skips = [(int(x.data["start"]), int(x.data["end"]))
                         for x in tx.list_events(run.number, limit=100_000, kind="data.skip")]
            every = self._checkpoint_interval(run, spec, now) if spec.auto_checkpoints else None
            trainer_cmd.write_attempt_config(spec, run_dir, e.number, launch.argv, skips, every)
            info = self.launcher.start(launch)
        except (LaunchError, OSError) as err:  # a launch error counts against the budget
            with self.store.tx() as tx:
                tx.update_attempt(run.number, e.number, launch_error=str(err))
            return
        started = self.clock()
        with self.store.tx() as tx:
            tx.update_attempt(run.number, e.number, state=AttemptState.RUNNING, launch_info=info,
                              started_at=started)
            if run.started_at is None:
                tx.update_run(run.number, started_at=started)
            tx.add_event(run.number, "attempt.started",
                         f"attempt {e.number} started: {len(e.nodes) * run.ranks_per_node} ranks on "
                         f"{', '.join(e.nodes)}", {"attempt": e.number, "nodes": list(e.nodes)}, started)
