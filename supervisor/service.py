"""Use cases behind the API and the CLIs: submit, inspect, queue operators' commands.

Reads go straight to the store (SQLite in WAL mode lets them run beside the
reconciler). A run's detail and goodput grow with its attempts and faults, never with
its steps: they read the per-attempt stats and the downsampled loss curve that are
kept as steps are recorded (supervisor/recorder.py).

``submit`` refuses a spec (SpecError) before anything is recorded when this daemon
cannot run it: another launcher or broker, resources the cluster cannot give, a
[trainer] table the reference trainer rejects, a user the run may not or cannot
execute as, a checkpoint directory that user cannot write; the run is recorded with
the user it executes as. Other writes only queue a command for a run (cancel, pause,
resume, restart) or a node (drain, undrain, probe): the reconciler alone acts on them,
from its next tick on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from supervisor import people, users
from supervisor.domain import (
    AttemptStats,
    CommandKind,
    FaultKind,
    NodeCommandKind,
    Person,
    RunState,
    parse_run_id,
    run_id_of,
)
from supervisor.domain.events import EventKind
from supervisor.errors import CannotExecute, Conflict, NotFound, SpecError
from supervisor.gathering.settled import SettledHistory, is_over
from supervisor.goodput import Goodput
from supervisor.launchers.base import Launcher, waiting_standbys
from supervisor.runfiles import attempt_logs, precompile, trainer_cmd, user_tree
from supervisor.spec import RunSpec, spec_from_json
from supervisor.store import SqlStore
from supervisor.views import (
    CHECKPOINTS_SHOWN,
    HISTORY_SHOWN,
    CheckpointView,
    CommandAccepted,
    DaemonHealth,
    EventView,
    LogView,
    MemoryCheckpointView,
    NodeView,
    RunDetail,
    RunSummary,
    StepMetricView,
    StragglerView,
    attempt_view,
    checkpoint_view,
    event_view,
    fault_view,
    node_view,
    run_summary,
)


class SupervisorService:
    def __init__(
        self, store: SqlStore, runs_dir: Path, *, mqtt_url: str | None, launcher: Launcher,
        check_trainer: bool = True, clock: Callable[[], float] = time.time,
        health: Callable[[], DaemonHealth] | None = None,
        run_as: str | None = None, allow_root_runs: bool = False, run_users: Sequence[str] | None = None,
        admin_rights: bool = False, history: SettledHistory | None = None,
    ) -> None:
        self.store = store
        self.history = history or SettledHistory()  # a run's settled attempts and faults, decoded once
        self.runs_dir = runs_dir
        self.run_as = run_as  # who a run executes as when its spec names no one (supervisor/users.py)
        self.allow_root_runs = allow_root_runs
        self.run_users = run_users  # who a spec may name as its user (None: users.may_run_as's rule)
        self.admin_rights = admin_rights  # runs must not execute as the daemon's user (users.resolve)
        self.mqtt_url = mqtt_url
        self.launcher = launcher  # for submit-time checks of what the cluster can give
        self.check_trainer = check_trainer
        self.clock = clock
        self._health = health
        self._standbys = waiting_standbys(launcher)

    def health(self) -> DaemonHealth:
        if self._health is None:
            return DaemonHealth(ok=True, last_tick_age_s=None, mqtt_connected=False)
        return self._health()

    def submit(self, spec: RunSpec) -> RunSummary:
        res = spec.resources
        if res.launcher != self.launcher.kind:
            raise SpecError(f"resources.launcher: this daemon launches on {self.launcher.kind!r}, "
                            f"not {res.launcher!r}")
        self.launcher.check_resources(res.nodes, res.spares, res.partition)
        if spec.telemetry.mqtt_url and spec.telemetry.mqtt_url != self.mqtt_url:
            raise SpecError(
                f"telemetry.mqtt_url: this daemon's trainers publish to {self.mqtt_url or 'nothing'}, "
                f"not {spec.telemetry.mqtt_url}; leave the key out to use the daemon's broker"
            )
        if self.check_trainer:
            trainer_cmd.check_trainer_config(spec, self.runs_dir / "run-check")
        spec = self._as_user(spec)
        now = self.clock()
        with self.store.tx() as tx:
            run = tx.create_run(
                name=spec.name, spec_json=spec.to_json(), run_dir_root=self.runs_dir,
                nodes=spec.resources.nodes, ranks_per_node=spec.resources.ranks_per_node,
                spares=spec.resources.spares, total_steps=spec.total_steps,
                policy=spec.policy.to_policy(spec.shrink_counts), now=now,
            )
            tx.add_event(run.number, EventKind.RUN_SUBMITTED,
                         f"{run.run_id} ({spec.name}) submitted: {spec.resources.nodes} nodes x "
                         f"{spec.resources.ranks_per_node} ranks + {spec.resources.spares} spare(s), "
                         f"{spec.total_steps} steps", {"name": spec.name}, now)
        return run_summary(run, [], None)

    def _as_user(self, spec: RunSpec) -> RunSpec:
        """The spec with the user its run executes as; SpecError when it must not (root)
        or cannot (this daemon cannot become that user; a checkpoint directory outside
        the run directory that the user cannot write)."""
        user = users.resolve(spec.user, self.run_as, allow_root=self.allow_root_runs,
                             run_users=self.run_users, admin_rights=self.admin_rights)
        run_dir = self.runs_dir / "run-check"
        ck = trainer_cmd.checkpoint_dir(spec, run_dir)
        key = "command.checkpoint_dir" if spec.command is not None else "trainer.checkpoint.dir"
        if not ck.is_relative_to(run_dir) and not users.writable_by(ck, user):
            raise SpecError(f"{key}: {ck} is not writable by {user.name}, the user this run executes as")
        if not ck.is_relative_to(run_dir) and not users.daemon_may_write(ck):
            raise SpecError(f"{key}: {ck} is not writable by the daemon, which moves checkpoints there (a "
                            "rollback's set-aside, a precompile pass, resume --from-step): under the systemd "
                            "unit, add its root to checkpoint_roots in the config and run "
                            "scripts/install-controller again (the unit's ReadWritePaths)")
        return spec.model_copy(update={"user": user.name})

    def list_runs(self, owner: str | None = None) -> list[RunSummary]:
        """Every run, or ``owner``'s only (the runs that execute as that account)."""
        with self.store.tx() as tx:
            runs = [r for r in tx.list_runs()
                    if owner is None or _spec_user(tx.run_spec_and_dir(r.number)[0]) == owner]
            return [run_summary(r, tx.list_attempts(r.number), tx.newest_stats(r.number)) for r in runs]

    def owner(self, run_id: str) -> str | None:
        """The account ``run_id`` executes as (None: the daemon's own); NotFound."""
        number = _number(run_id)
        with self.store.tx() as tx:
            return _spec_user(tx.run_spec_and_dir(number)[0])

    def command_owner(self, command_id: int) -> tuple[str | None, str | None]:
        """(the run a command is about, its owner); (None, None) for a node's command."""
        with self.store.tx() as tx:
            number = tx.command_run_number(command_id)
            if number is None:
                return None, None
            return run_id_of(number), _spec_user(tx.run_spec_and_dir(number)[0])

    def person(self, token: str) -> Person | None:
        """Whose token ``token`` is (supervisor/people.py), None: nobody's."""
        with self.store.tx() as tx:
            return tx.person_by_token_hash(people.token_hash(token))

    def summary(self, run_id: str) -> RunSummary:
        """A run's state and progress, without the goodput accounting: cheap to poll."""
        number = _number(run_id)
        with self.store.tx() as tx:
            return run_summary(tx.get_run(number), tx.list_attempts(number), tx.newest_stats(number))

    def get_run(self, run_id: str) -> RunDetail:
        """Everything about a run. Its settled history is decoded once (supervisor/gathering/settled.py)
        and its steps are never read (the stats: supervisor/recorder.py): what a read costs
        grows with neither."""
        number = _number(run_id)
        now = self.clock()
        with self.store.tx() as tx:
            run = tx.get_run(number)
            history = self.history.read(tx, number, over=is_over(run, now))
            attempts, stats, faults = history.attempts, history.stats, history.faults
            g = history.account(run, now)
            checkpoints = tx.list_checkpoints(number, newest=CHECKPOINTS_SHOWN)
            memory = tx.list_memory_checkpoints(number)[-1:]
            drained, drained_total = tx.drained_by(number, newest=HISTORY_SHOWN)
            stragglers = [StragglerView(attempt=x.attempt, rank=x.rank, node=x.node, busy_s=x.busy_s,
                                        typical_s=x.typical_s) for x in tx.list_stragglers(number)]
            transient_spikes = tx.count_events(number, EventKind.SPIKE_TRANSIENT)
            spec_text, run_dir = tx.run_spec_and_dir(number)
        summary = run_summary(run, attempts, _newest(stats))
        tensorboard, curves_url = self._curves(run.run_id, spec_text, run_dir,
                                               run.allocation_info or run.parked_allocation)
        return RunDetail(
            **summary.model_dump(), model_digest=run.model_digest, final_step=run.final_step,
            started_at=run.started_at, nodes=run.nodes, ranks_per_node=run.ranks_per_node,
            spares=run.spares, attempt_history=[attempt_view(a) for a in attempts[-HISTORY_SHOWN:]],
            faults=[fault_view(f) for f in faults[-HISTORY_SHOWN:]], faults_total=len(faults),
            checkpoints=[checkpoint_view(c) for c in checkpoints],
            goodput=g, drained_nodes=drained, drained_total=drained_total, ettr=g.ettr,
            stragglers=stragglers, transient_spikes=transient_spikes,
            memory_checkpoint=MemoryCheckpointView(**asdict(memory[0])) if memory else None,
            standbys=dict(self._standbys().get(run.run_id, {})),
            tensorboard=tensorboard, curves_url=curves_url,
        )

    def _curves(self, run_id: str, spec_text: str, run_dir: Path,
                allocation: str | None) -> tuple[str | None, str | None]:
        try:
            spec = spec_from_json(spec_text)
        except SpecError:
            return None, None  # a spec this daemon's version no longer reads: nothing to point at
        return trainer_cmd.curves(spec, run_id, run_dir, self.launcher.job_of(allocation))

    def events(self, run_id: str | None, after_id: int = 0, limit: int = 1000) -> list[EventView]:
        number = _number(run_id) if run_id is not None else None
        with self.store.tx() as tx:
            if number is not None:
                tx.get_run(number)
            return [event_view(e) for e in tx.list_events(number, after_id, limit)]

    def nodes(self) -> list[NodeView]:
        with self.store.tx() as tx:
            return [node_view(n, next(iter(tx.recent_probes(n.name, 1)), None), tx.link_figures(n.name))
                    for n in tx.list_nodes()]

    def checkpoints(self, run_id: str, newest: int = 100) -> list[CheckpointView]:
        """The run's ``newest`` checkpoints (by step), oldest of them first."""
        number = _number(run_id)
        with self.store.tx() as tx:
            tx.get_run(number)
            return [checkpoint_view(c) for c in tx.list_checkpoints(number, newest=newest)]

    def goodput(self, run_id: str) -> Goodput:
        number = _number(run_id)
        with self.store.tx() as tx:
            run = tx.get_run(number)
            h = self.history.read(tx, number, over=is_over(run, self.clock()))
        return h.account(run, self.clock())

    def step_metrics(self, run_id: str, max_points: int = 1000) -> list[StepMetricView]:
        """Rank 0's step metrics (the loss curve), every attempt's: the run's downsampled
        curve (at most schema.CURVE_POINTS points, whatever the run's length), thinned
        evenly to at most ``max_points`` (the first and the last point always kept)."""
        number = _number(run_id)
        with self.store.tx() as tx:
            tx.get_run(number)
            points = tx.curve(number)
        if len(points) > max_points:
            stride = (len(points) - 1) / (max_points - 1) if max_points > 1 else len(points)
            points = [points[round(i * stride)] for i in range(max_points)]
        return [StepMetricView(attempt=m.attempt, step=m.step, loss=m.loss, grad_norm=m.grad_norm,
                               step_time_s=m.step_time_s, at=m.at) for m in points]

    def logs(self, run_id: str, *, attempt: int | None = None, rank: int | None = None,
             node: str | None = None, offset: int = 0, max_bytes: int = 65536) -> LogView:
        """A piece of an attempt's log (supervisor/runfiles/attempt_logs.py): ``rank``'s, or ``node``'s
        (a node of the attempt), or rank 0's; the newest attempt unless told."""
        number = _number(run_id)
        with self.store.tx() as tx:
            run = tx.get_run(number)
            attempts = tx.list_attempts(number)
            text, run_dir = tx.run_spec_and_dir(number)
        if not attempts:
            raise NotFound(f"{run_id} has no attempt yet")
        chosen = attempts[-1] if attempt is None else next((a for a in attempts if a.number == attempt), None)
        if chosen is None:
            raise NotFound(f"{run_id} has no attempt {attempt} (its attempts: 1 to {len(attempts)})")
        node_index = None
        if node is not None:
            if node not in chosen.nodes:
                raise NotFound(f"{node} is not a node of {run_id}'s attempt {chosen.number} "
                               f"(its nodes: {', '.join(chosen.nodes)})")
            node_index = chosen.nodes.index(node)
        log_dir = trainer_cmd.attempt_dir(run_dir, chosen.number)
        trusted = Path(run_dir).parent  # the runs directory, the daemon's: nothing below it is followed
        try:  # read as the run's user (supervisor/runfiles/user_tree.py)
            tree = user_tree.of(_spec_user(text))
        except CannotExecute as e:
            raise Conflict(f"{run_id}'s logs cannot be read as its user: {e}") from None
        name = attempt_logs.pick(log_dir, rank=rank, node_index=node_index, ranks_per_node=run.ranks_per_node,
                                 base=trusted, reader=tree)
        piece = attempt_logs.read(log_dir, name, offset, max_bytes, base=trusted, reader=tree)
        return LogView(run_id=run_id, attempt=chosen.number, attempt_state=chosen.state.value,
                       run_state=run.state.value, file=piece.file, offset=offset,
                       next_offset=offset + len(piece.data), size=piece.size,
                       text=piece.data.decode(errors="replace"))

    def request(self, run_id: str, kind: CommandKind, from_step: int | None = None,
                force: bool = False) -> CommandAccepted:
        """Queue a command for a run. ``from_step`` (resume only): the step of a complete,
        verified checkpoint in the run's checkpoint directory to go on from; NotFound,
        naming those there are, when there is none of that step. A resume that would fail
        as the run did is refused (Conflict) unless ``force``."""
        number = _number(run_id)
        if from_step is not None:
            if kind is not CommandKind.RESUME:
                raise SpecError(f"from_step is for resume, not {kind.value}")
            self._check_resume_point(run_id, number, from_step)
        if kind is CommandKind.RESUME and not force:
            self._check_resume_lands(run_id, number)
        with self.store.tx() as tx:
            command_id = tx.add_command(number, kind, self.clock(), step=from_step)
        return CommandAccepted(command_id=command_id, run_id=run_id, kind=kind.value)

    def _check_resume_lands(self, run_id: str, number: int) -> None:
        """A run that failed because its trainer did not resume from the checkpoint it was
        given (its own search found another, or none: a job that keys its checkpoints on
        one Slurm job's id, now in another) fails the same way again while nothing the job
        reads has changed since (precompile.fingerprint: its command, its program and the
        files it names): Conflict, with what to change."""
        with self.store.tx() as tx:
            run = tx.get_run(number)
            faults = tx.list_faults(number)
            attempts = {a.number: a for a in tx.list_attempts(number)}
            text, run_dir = tx.run_spec_and_dir(number)
        last = faults[-1] if faults else None
        if run.state is not RunState.FAILED or last is None or last.kind is not FaultKind.WRONG_RESUME:
            return
        failed = attempts.get(last.attempt)
        try:
            spec = spec_from_json(text)
        except SpecError:
            return  # the run cannot launch at all: the reconciler says so
        if failed is None or failed.inputs is None or spec.command is None:
            return
        cwd = trainer_cmd.attempt_cwd(spec, run_dir)
        try:
            if precompile.fingerprint(spec, cwd, user_tree.of(spec.user)) != failed.inputs:
                return
        except (CannotExecute, OSError):
            return  # unknown: the resume is let through (its launch says what is wrong)
        files = ", ".join(str(p) for p in precompile.inputs(spec, cwd))
        raise Conflict(f"{run_id} would fail again as attempt {failed.number} did: {last.summary}. Nothing "
                       f"the job reads has changed since ({files}); change it first, or resume with force "
                       f"(supervisorctl resume {run_id} --force)")

    def _check_resume_point(self, run_id: str, number: int, step: int) -> None:
        with self.store.tx() as tx:
            text, run_dir = tx.run_spec_and_dir(number)
        try:
            spec = spec_from_json(text)
        except SpecError as e:
            raise SpecError(f"{run_id}'s spec no longer validates: {e}") from e
        directory = trainer_cmd.checkpoint_dir(spec, run_dir)
        try:
            verdicts = user_tree.of(spec.user).scan(directory, trainer_cmd.checkpoint_layout(spec))
        except (CannotExecute, OSError) as e:
            raise Conflict(f"{run_id}'s checkpoints cannot be read as its user now: {e}") from None
        if any(v.ok and v.step == step for v in verdicts):
            return
        there = sorted({v.step for v in verdicts if v.ok})
        shown = ", ".join(str(s) for s in there[-20:]) if there else "none"
        raise NotFound(f"{run_id} has no complete checkpoint of step {step}; complete checkpoints at steps: "
                       f"{shown}" + (f" (the newest 20 of {len(there)})" if len(there) > 20 else ""))

    def request_node(self, name: str, kind: NodeCommandKind, reason: str = "") -> CommandAccepted:
        """Queue a drain, an undrain or a probe of a node the supervisor knows (NotFound
        otherwise)."""
        with self.store.tx() as tx:
            command_id = tx.add_node_command(name, kind, reason, self.clock())
        return CommandAccepted(command_id=command_id, node=name, kind=kind.value)

    def command_result(self, command_id: int) -> str | None:
        with self.store.tx() as tx:
            return tx.get_command_result(command_id)


def _number(run_id: str) -> int:
    number = parse_run_id(run_id)
    if number is None:
        raise NotFound(f"no such run: {run_id!r} (run ids look like run-42)")
    return number


def _newest(stats: dict[int, AttemptStats]) -> AttemptStats | None:
    """The newest attempt's stats that has a step: the run's latest step and loss."""
    return next((stats[a] for a in sorted(stats, reverse=True) if stats[a].steps), None)


def _spec_user(text: str) -> str | None:
    """The stored spec's ``user`` (None: the daemon's), even where the spec no longer
    validates: whose files the run's are does not change with the daemon's version."""
    try:
        user = json.loads(text).get("user")
    except (ValueError, AttributeError):
        return None
    return user if isinstance(user, str) else None
