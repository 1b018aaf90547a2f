"""Observe: what the reconciler sees of each run this tick.

It reads the store, asks the launcher about the live attempt's processes and the run's
allocation, reads the telemetry view and scans the checkpoint directory (as the run's
user), and hands the decision core one ``RunView`` and one ``AttemptObs`` per run. It
changes nothing outside the daemon: what must be kept (the allocation granted, the
checkpoints found, how far a trainer's logs were read) goes to the effects as ``Facts``.
It evaluates no rule: what its findings mean is policy/'s (``resumes.expected_first``,
``quiet.progress_at`` and ``command_result``, ``memory.newest_resumable``,
``grants.grant_changes``, ``detection.heard_again_at``, ``recovery.unreadable_checkpoints``).

It writes nothing to the telemetry view (what the view must know first, the feed tells it
before observe runs: feed.py), only to the run's memory (run_memory.py): what it saw
between ticks (a rank's first death, the allocation last seen, the spikes said, ...),
rebuilt after a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from supervisor.domain import (
    TERMINAL_RUN_STATES,
    Attempt,
    AttemptObs,
    AttemptState,
    CheckpointRef,
    Command,
    FaultKind,
    Measured,
    NodeState,
    ProcState,
    RankObs,
    Run,
    RunState,
    RunView,
    StragglerReport,
    TrainerResult,
)
from supervisor.domain.events import EventKind
from supervisor.gathering.feed import Fed
from supervisor.gathering.launch_specs import LaunchSpecs
from supervisor.gathering.observed import Facts, Observed, of_spec
from supervisor.gathering.output_progress import AttemptOutput
from supervisor.gathering.run_memory import RunMemory
from supervisor.gathering.settled import History, SettledHistory, is_over
from supervisor.launchers.base import Launcher
from supervisor.policy import resume_before, unreadable_checkpoints
from supervisor.policy.detection import heard_again_at
from supervisor.policy.grants import allocation_after, grant_changes
from supervisor.policy.memory import newest_resumable
from supervisor.policy.quiet import command_result, progress_at
from supervisor.policy.resumes import expected_first
from supervisor.runfiles import precompile, trainer_cmd, user_tree
from supervisor.spec import RunSpec
from supervisor.store import SqlStore
from supervisor.telemetry.records import NOTHING_HEARD, RankSeen
from supervisor.telemetry.view import TelemetryView

log = logging.getLogger(__name__)

_QUIET_SCAN_S = 2.0  # how often a [command] trainer's checkpoint directory is scanned for progress
_LAUNCHABLE = (RunState.PENDING, RunState.STARTING, RunState.RECOVERING)


class Observer:
    def __init__(self, store: SqlStore, launcher: Launcher, telemetry: TelemetryView, memory: RunMemory,
                 launch_specs: LaunchSpecs, *, probing: Callable[[int], bool],
                 clock: Callable[[], float]) -> None:
        self.store = store
        self.launcher = launcher
        self.telemetry = telemetry
        self.memory = memory  # the run's memory between ticks: the reconciler's (run_memory.py)
        self.launch_specs = launch_specs
        self.probing = probing  # whether some of a run's nodes are being probed
        self.clock = clock
        self.history = SettledHistory()  # each run's ended attempts and recovered faults, decoded once
        # A cluster whose newest answer is older than this is not answering (its controller
        # is down or hung): a poll every 0.5 s, a command's timeout 10 s.
        self.stale_after_s = 10.0

    def runs(self) -> list[tuple[Run, list[Command]]]:
        """Every run to reconcile this tick, with its queued commands: the active ones, and
        finished ones that still hold something (or were sent a command)."""
        with self.store.tx() as tx:
            commands = tx.pending_commands()
            runs = [r for r in tx.list_runs() if r.state not in TERMINAL_RUN_STATES]
            busy = {r.number for r in runs}
            for number in {c.run_number for c in commands} | tx.finished_runs_holding_resources():
                if number not in busy:
                    runs.append(tx.get_run(number))
        self.memory.keep_runs({r.number for r in runs})
        return [(r, [c for c in commands if c.run_number == r.number]) for r in runs]

    def history_of(self, run: Run, now: float) -> History:
        """The run's attempts and faults (the settled part decoded once, not every tick)."""
        with self.store.tx() as tx:
            return self.history.read(tx, run.number, over=is_over(run, now))

    def observe(self, run: Run, commands: list[Command], now: float, history: History, fed: Fed) -> Observed:
        """The run as seen now: ``history`` is ``history_of``'s this tick, ``fed`` what
        feeding the telemetry view found (feed.py)."""
        spec, run_dir = self.memory.spec(run.number)
        run_spec = spec if isinstance(spec, RunSpec) else None  # None: it no longer validates
        attempts, faults, live = tuple(history.attempts), tuple(history.faults), history.live
        probes_spares = run_spec is not None and run_spec.health.probes_idle_spares()  # spares: last probes
        with self.store.tx() as tx:
            # The nodes it drained matter only where the cluster still grants them (read
            # below, by name); each tick reading all of them would grow with the run.
            known = tx.allocation(run.number, drained=False)
            open_faults = tx.count_open_faults(run.number)
            stragglers = tuple(StragglerReport(attempt=s.attempt, rank=s.rank, node=s.node)
                               for s in tx.list_stragglers(run.number))
            data_skips = tuple(tx.list_data_skips(run.number))
            spares = tx.spares_probed_at(run.number, live.nodes) if live and probes_spares else ()
            # Only a live attempt can have a fault that blames a node.
            cluster_faults = tuple(tx.faults_since(now - run.policy.lemon_window_s)) if live else ()
        self.memory.keep_live(run.number, live.number if live else None)
        facts = Facts(output_offsets=fed.offsets_to_keep)
        obs = self._observe_attempt(run, run_spec, run_dir, live, now, fed.output) if live else None
        # The allocation as the cluster has it; after a death, only an answer given since
        # then may say whether the cluster took the nodes away (then no node is to blame).
        first_death = min((r.dead_since for r in obs.ranks if r.dead_since is not None), default=None) \
            if obs else None
        since = now - self.stale_after_s if first_death is None else first_death
        answering = self.launcher.answered_since(since)
        grant = self.launcher.held(run.run_id, run.allocation_info) if run.allocation_info else None
        if grant is not None:
            others = set(grant.nodes).difference(x.name for x in known)
            if others:  # granted nodes the store has under another run, or not at all
                with self.store.tx() as tx:
                    known += tx.nodes_named(others)
            facts.grant = grant_changes(known, run.number, grant.nodes, grant.info)
        allocation = allocation_after(known, run.number, facts.grant)
        newest, newest_memory, measured = None, None, None
        # The checkpoint matters only when this tick may launch: no attempt training, and a
        # run that wants one (or a command that may make it want one); or when an attempt
        # on fewer nodes than the run's may grow back (after a checkpoint of its own).
        training = live is not None and live.state is AttemptState.RUNNING
        may_launch = (commands or run.state in _LAUNCHABLE) and not training
        shrunk = training and live is not None and len(live.nodes) < run.nodes
        precompiles = isinstance(spec, RunSpec) and spec.command is not None and spec.command.precompiles
        # After a precompile pass, until the run's checkpoints are back, the directory holds
        # only what the pass saved: no checkpoint of the run's (supervisor/runfiles/precompile.py).
        aside = precompile.aside(attempts) if precompiles and live is None else None
        if isinstance(spec, RunSpec) and (may_launch or shrunk) and aside is None:
            with self.store.tx() as tx:
                memory_saves = tx.list_memory_checkpoints(run.number)
                measured = Measured(stats=tuple(tx.attempt_stats(run.number).values()), memory_saves_s=tuple(
                    m.duration_s for m in memory_saves if m.duration_s is not None))
                unreadable = {f.step for f in faults if f.kind is FaultKind.CHECKPOINT}
                saved_by = tx.committed_by(run.number, unreadable)  # saved again since?
            before = resume_before(attempts, faults)
            newest = self._newest_checkpoint(spec, run_dir, facts, before,
                                             unreadable_checkpoints(faults, attempts, saved_by=saved_by))
            # Each said once (an event of the effects'), not at every tick that finds it again.
            facts.out_of_range = [p for p in facts.out_of_range
                                  if self.memory.note_out_of_range(run.number, p)]
            newest_memory = newest_resumable(memory_saves, attempts, newest, before,
                                             unreadable_checkpoints(faults, attempts, memory=True))
        precompile_due = None
        if isinstance(spec, RunSpec) and precompiles and may_launch:
            cwd, tree = trainer_cmd.attempt_cwd(spec, run_dir), user_tree.of_present(spec.user)
            if tree is not None:  # (a user gone: the launch fails the run)
                precompile_due = precompile.due(precompile.fingerprint(spec, cwd, tree), attempts)
        view = RunView(
            run=run, attempts=attempts, allocation=allocation, newest_checkpoint=newest,
            newest_memory=newest_memory, commands=tuple(commands),
            open_faults=open_faults, faults=faults, probing=self.probing(run.number), stragglers=stragglers,
            cluster_faults=cluster_faults, newly_allocated=self.memory.newly_allocated(
                run.number, tuple(x.name for x in allocation if x.state is NodeState.ALLOCATED)),
            spikes_said=self._spikes_said(run, live) if live else frozenset(), spares_probed_at=spares,
            cluster_answering=answering, spec_error=spec if isinstance(spec, str) else None,
            precompile_due=precompile_due, precompile_aside=aside, data_skips=data_skips, measured=measured,
            **(of_spec(spec) if isinstance(spec, RunSpec) else {}))
        return Observed(run=run, spec=run_spec, run_dir=run_dir, view=view, obs=obs, facts=facts)

    def _newest_checkpoint(self, spec: RunSpec, run_dir: Path, facts: Facts, before_step: int | None,
                           exclude: frozenset[int]) -> CheckpointRef | None:
        tree = user_tree.of_present(spec.user)  # the checkpoints are read as the run's user
        if tree is None:
            return None  # a user gone from this host: the launch fails the run
        newest, rejected = tree.pick(trainer_cmd.checkpoint_dir(spec, run_dir),
                                     trainer_cmd.checkpoint_layout(spec), before_step, exclude,
                                     out_of_range=facts.out_of_range)
        facts.checkpoints = [*rejected, *([newest] if newest else [])]
        return None if newest is None else CheckpointRef(step=newest.step, path=str(newest.path))

    def _spikes_said(self, run: Run, live: Attempt) -> frozenset[int]:
        """The live attempt's short spikes reported (first steps): their events, read on."""
        m = self.memory.attempt(run.number, live.number)
        with self.store.tx() as tx:
            for kind in (EventKind.SPIKE_TRANSIENT, EventKind.SPIKE_PERSISTS):
                for e in tx.list_events(run.number, after_id=m.spikes_read_to, kind=kind):
                    if e.data.get("attempt") == live.number:
                        m.spikes_said.add(int(str(e.data["step"])))
                    m.spikes_read_to = max(m.spikes_read_to, e.id)
        return frozenset(m.spikes_said)

    # --- the live attempt -----------------------------------------------------------

    def _observe_attempt(self, run: Run, spec: RunSpec | None, run_dir: Path, live: Attempt,
                         now: float, output: AttemptOutput | None = None) -> AttemptObs | None:
        launch_info = live.launch_info
        found = None
        if launch_info is None:
            if live.launch_error is not None:
                return AttemptObs(ranks=(), never_started=True, launch_error=live.launch_error,
                                  launch_fatal=live.launch_fatal)
            found = self.launcher.find(self.launch_specs.of(run, spec, run_dir, live)) if spec else None
            if found is None:
                return AttemptObs(ranks=(), never_started=True)
            if len(self.launcher.observe(found)) < len(live.nodes) * run.ranks_per_node:
                return AttemptObs(ranks=(), never_started=True, orphans=found)
            launch_info = found
        procs = self.launcher.observe(launch_info)
        memory = self.memory.attempt(run.number, live.number)
        tele = self.telemetry.ranks(run.run_id, live.number, run.policy.straggler_window)
        agents = self.telemetry.agents(run.run_id, live.number)
        # A [command] trainer sends no telemetry, and ranks that cannot reach the broker
        # send none that arrives: then progress is the checkpoints and the output.
        unheard = not any(t.last_seen_at is not None for t in tele.values())
        quiet = (self._quiet_progress(spec, run_dir, live, now, output)
                 if spec and (spec.command is not None or unheard) else None)
        if quiet is not None and output is not None:
            # A [command] trainer's progress lines are the job's (its rank 0 alone prints
            # them, as a rule): every rank is as far as the newest one says.
            quiet = (max([quiet[0], *(t.last_step for t in tele.values())]), quiet[1])
        # One RankObs per rank, every tick (32,768 at scale: bench/scale.py), so the loop
        # below keeps to plain lookups.
        floor_step = max(quiet[0] if quiet else 0, live.resume_step)
        quiet_at = quiet[1] if quiet else None
        fatal = output.fatal if output is not None else {}
        ranks = []
        for proc in procs:
            t = tele.get(proc.rank) or NOTHING_HEARD
            agent = agents.get(proc.node)
            # A rank that says nothing itself (a [command] trainer's) goes with its node: the
            # agent's last will is its own.
            lost = t.lost or (agent is not None and agent.lost and t.last_seen_at is None)
            node_up = proc.node_up
            if node_up is None and agent is not None:
                node_up = not agent.lost
            dead_since = None
            if proc.proc in _ENDED or (proc.proc is ProcState.UNKNOWN and (lost or proc.node_down)):
                dead_since = memory.dead_since.setdefault(proc.rank, now)
            progress_at = t.progress_at
            if quiet_at is not None and (progress_at is None or quiet_at > progress_at):
                progress_at = quiet_at
            said = fatal.get(proc.rank)
            ranks.append(RankObs(
                rank=proc.rank, node=proc.node, proc=proc.proc, exit_code=proc.exit_code,
                process=proc.process, node_up=node_up, node_down=proc.node_down, lost=lost,
                reported_exit_code=t.exit_code, reported_reason=t.exit_reason, reported_exit_at=t.exit_at,
                node_seen_at=agent.last_seen_at if agent else None, dead_since=dead_since,
                last_step=t.last_step if t.last_step > floor_step else floor_step, progress_at=progress_at,
                phase=t.phase, phase_at=t.phase_at, phase_bytes=t.phase_bytes, last_seen_at=t.last_seen_at,
                nonfinite_step=t.nonfinite_step, busy_recent_s=t.busy_recent, first_step=t.first_step,
                fatal_line=said.line if said else "", fatal_kind=said.kind if said else "",
            ))
        result = self._result(run, spec, run_dir, live, ranks) if spec else None
        p99, samples = self.telemetry.step_time_p99(run.run_id, live.number)
        up_since = self._up_since(run, live, tele, now)
        io = self.telemetry.checkpoint_io(run.run_id)
        first_times, newest_times = self.telemetry.step_trend(run.run_id, live.number)
        return AttemptObs(ranks=tuple(ranks), result=result, telemetry_up_since=up_since, unheard=unheard,
                          output_read=output is not None,
                          expected_first=self._expected_first(run, spec, live) if spec else None,
                          step_time_p99_s=p99, step_time_samples=samples,
                          first_step_times=first_times, newest_step_times=newest_times,
                          committed_step=self.telemetry.committed_step(run.run_id, live.number),
                          save_s=io.save_s, save_gb_s=io.save_gb_s, restore_gb_s=io.restore_gb_s,
                          recent=self.telemetry.recent_steps(run.run_id, live.number), found=found)

    def _up_since(self, run: Run, live: Attempt, tele: dict[int, RankSeen], now: float) -> float | None:
        """Since when telemetry flows for this attempt: the broker link's up time, or the
        moment its ranks were heard again after all of them fell silent together (a cut
        between the nodes and the broker): for the policy, the link was down meanwhile. A
        stall of the daemon's own receiving loop counts the same (``flowing_since``)."""
        up = self.telemetry.flowing_since(now)
        heard = max((t.last_seen_at for t in tele.values() if t.last_seen_at is not None), default=None)
        memory = self.memory.attempt(run.number, live.number)
        if heard is not None:
            memory.back_at = heard_again_at(memory.heard, heard, memory.back_at)
            memory.heard = heard
        back = memory.back_at
        return up if up is None or back is None else max(up, back)

    @staticmethod
    def _result(run: Run, spec: RunSpec, run_dir: Path, live: Attempt,
                ranks: list[RankObs]) -> TrainerResult | None:
        if not all(r.proc in _ENDED for r in ranks):
            return None
        if spec.command is not None:
            return command_result(ranks, live.resume_step, spec.command.steps)
        tree = user_tree.of_present(spec.user)
        return None if tree is None else trainer_cmd.read_result(trainer_cmd.result_path(spec, run_dir),
                                                                 run.run_id, live.number, tree)

    def _expected_first(self, run: Run, spec: RunSpec, live: Attempt) -> tuple[int, float] | None:
        """For a resumed reference trainer: its first step and the loss it must have
        (policy/resumes.py), looked up once an attempt."""
        memory = self.memory.attempt(run.number, live.number)
        if not memory.expected_known:
            expected = None
            if live.resume_from is not None:
                with self.store.tx() as tx:
                    skipped = bool(tx.list_data_skips(run.number))
                    reported = tx.loss_before(run.number, live.resume_step + 1, live.number)
                    nodes_of = {a.number: len(a.nodes) for a in tx.list_attempts(run.number)}
                expected = expected_first(live, reference_trainer=spec.trainer is not None,
                                          data_skipped=skipped, reported=reported, nodes_of=nodes_of)
            memory.expected, memory.expected_known = expected, True
        return memory.expected

    def _quiet_progress(self, spec: RunSpec, run_dir: Path, live: Attempt, now: float,
                        output: AttemptOutput | None) -> tuple[int, float | None]:
        """(newest complete checkpoint step, when progress was last seen) for a trainer
        without telemetry: a new checkpoint is a step; new output is a sign of life, until
        its lines are understood (steps, a compile phase): then only its progress lines
        are, so that a hung job printing warnings is still a hang."""
        memory = self.memory.attempt(live.run_number, live.number)
        step, step_seen_at, scanned_at = memory.quiet or (live.resume_step, None, 0.0)
        tree = user_tree.of_present(spec.user)
        if now - scanned_at >= _QUIET_SCAN_S and tree is not None:
            newest, _ = tree.pick(trainer_cmd.checkpoint_dir(spec, run_dir),
                                  trainer_cmd.checkpoint_layout(spec))
            if newest is not None and newest.step > step:
                step, step_seen_at = newest.step, now
            memory.quiet = (step, step_seen_at, now)
        understood = output is not None and output.understood
        output_at = None
        if tree is not None and not understood:  # the logs' times count until their lines are understood
            try:
                logs = trainer_cmd.attempt_dir(run_dir, live.number)
                output_at = tree.newest_mtime(run_dir.parent, logs, ".log")
            except user_tree.TreeStalled:
                raise  # no answer: asked again next tick
            except OSError:
                pass  # no logs (yet), or a link in their place: no sign of life from them
        return step, progress_at(step_seen_at, output_understood=understood,
                                 progress_line_at=output.line_at if output is not None else None,
                                 output_at=output_at)


_ENDED = (ProcState.EXITED, ProcState.VANISHED)

