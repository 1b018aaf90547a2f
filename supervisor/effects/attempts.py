"""An attempt's life: recorded LAUNCHING, started, marked training, stopped, ended, and
the processes of an attempt no record owns killed, and an ended one let go of.

Starting one (``_start``) first prepares what its trainer reads: the data windows the
run skips, the data step and checkpoint intervals the core decided (policy/trainer_inputs.py),
newer checkpoints set aside from a [command]
trainer's way (checkpoint_moves.py, which also moves them for a precompile pass and an
operator's resume from a chosen step), the attempt's config (its files handed over to
the run's user), and the fence that keeps an earlier attempt's rank 0 off the
checkpoints. Once the launcher has started it, the attempt is recorded RUNNING (the one
state write that is not an effect's, checked against the table like the others). A
launch that fails is recorded on the attempt (``launch_error``; ``launch_fatal`` when no
restart can help: a command that cannot be executed, an unsafe path) and judged by the
core at the next tick. Every attempt state change is checked against the transition
table (supervisor/policy/transitions.py) before it is written."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, assert_never, get_args

from supervisor import users
from supervisor.domain import (
    AdoptAttempt,
    Attempt,
    AttemptState,
    BringBackCheckpoints,
    EndAttempt,
    EnsureStopped,
    KillOrphans,
    MarkAttemptRunning,
    NodeState,
    Run,
    StartAttempt,
    StopAttempt,
)
from supervisor.domain.events import EventKind
from supervisor.effects.base import Acting, Family, Recording
from supervisor.errors import CannotExecute, LaunchError
from supervisor.policy.transitions import check_attempt
from supervisor.runfiles import precompile, trainer_cmd, user_tree
from supervisor.runfiles.user_tree import UnsafePath
from supervisor.spec import RunSpec
from supervisor.store import Tx

log = logging.getLogger(__name__)

AttemptEffect = (StartAttempt | AdoptAttempt | MarkAttemptRunning | StopAttempt | EnsureStopped | EndAttempt
                 | KillOrphans | BringBackCheckpoints)


def attempt_to(tx: Tx, attempts: dict[int, Attempt], number: int, new: AttemptState, **values: Any) -> None:
    """Move an attempt to ``new``, as the table allows (it raises otherwise)."""
    a = attempts[number]
    check_attempt(a.state, new)
    tx.update_attempt(a.run_number, number, state=new, **values)
    attempts[number] = replace(a, state=new, **values)


class AttemptEffects(Family):
    handles = get_args(AttemptEffect)

    def record(self, r: Recording, e: AttemptEffect) -> None:
        tx, now, n, attempts = r.tx, r.now, r.of_run().number, r.attempts
        match e:
            case StartAttempt():
                attempts[e.number] = Attempt(run_number=n, number=e.number, state=AttemptState.LAUNCHING,
                                             nodes=e.nodes, resume_from=e.resume_from,
                                             resume_step=e.resume_step, created_at=now,
                                             precompile=e.precompile)
                tx.add_attempt(attempts[e.number])
                if e.widen_skip is not None:  # said by the core (policy/trainer_inputs.py)
                    tx.widen_data_skip(n, *e.widen_skip)
            case AdoptAttempt():
                attempt_to(tx, attempts, e.number, AttemptState.RUNNING, launch_info=e.launch_info,
                           started_at=attempts[e.number].started_at or now)
            case MarkAttemptRunning():
                tx.update_attempt(n, e.number, first_step_at=now)
            case StopAttempt():
                attempt_to(tx, attempts, e.number, AttemptState.STOPPING, stop_requested_at=now,
                           outcome=e.outcome, reason=e.reason)
                tx.add_event(n, EventKind.ATTEMPT_STOPPING, f"attempt {e.number}: stopping ({e.reason})",
                             {"attempt": e.number}, now)
            case EndAttempt():
                attempt_to(tx, attempts, e.number, AttemptState.ENDED, ended_at=now, outcome=e.outcome,
                           reason=e.reason, final_step=e.final_step)
                tx.add_event(n, EventKind.ATTEMPT_ENDED,
                             f"attempt {e.number} ended {e.outcome} at step {e.final_step}: {e.reason}",
                             {"attempt": e.number, "outcome": e.outcome.value, "final_step": e.final_step},
                             now)
            case EnsureStopped() | KillOrphans() | BringBackCheckpoints():
                pass  # nothing to record before acting
            case _:
                assert_never(e)

    def act(self, a: Acting, e: AttemptEffect) -> None:
        seen = a.of_run()
        run, spec, d = seen.run, seen.spec, self.d
        match e:
            case StartAttempt():
                if spec is not None:
                    self._start(run, spec, seen.run_dir, e, a.now)
            case StopAttempt() | EnsureStopped():
                info = a.attempts[e.number].launch_info
                if info:
                    d.launcher.stop(info, force=e.force)
            case KillOrphans():
                d.launcher.stop(e.launch_info, force=True)
            case EndAttempt():
                self.let_go(run, a.attempts[e.number], a.now)
            case BringBackCheckpoints():
                aside = a.attempts[e.number].set_aside if e.number in a.attempts else None
                if spec is not None and aside is not None:
                    d.moves.bring_back(run, spec, seen.run_dir, e.number, aside)
            case AdoptAttempt() | MarkAttemptRunning():
                pass  # recorded; nothing to do outside
            case _:
                assert_never(e)

    def let_go(self, run: Run, attempt: Attempt, now: float) -> None:
        """What an ended attempt leaves the daemon: the launcher ``forget``s it (its nodes'
        own processes end, its records go), its broker login goes; and then it is
        recorded released. A daemon that dies before that last write leaves the
        attempt to ``release_ended``, its own next tick's or the next daemon's."""
        d = self.d
        if attempt.launch_info:
            d.launcher.forget(attempt.launch_info)
        d.telemetry.forget(run.run_id, attempt.number)
        with d.store.tx() as tx:
            tx.released(run.number, attempt.number, now)

    def release_ended(self, now: float) -> None:
        """Let go of every ended attempt not released yet (``let_go``): one whose end was
        recorded by a daemon that died before acting on it, or whose letting go failed.
        Without this, its node agents would live on with no attempt to end them."""
        with self.d.store.tx() as tx:
            ended = tx.unreleased_attempts()
        for run, attempt in ended:
            try:
                self.let_go(run, attempt, now)
            except (LaunchError, OSError):  # the next tick tries again; the others go on
                log.exception("%s: attempt %d: cannot let go of it yet", run.run_id, attempt.number)

    def _start(self, run: Run, spec: RunSpec, run_dir: Path, e: StartAttempt, now: float) -> None:
        d = self.d
        attempt = Attempt(run_number=run.number, number=e.number, state=AttemptState.LAUNCHING, nodes=e.nodes,
                          resume_from=e.resume_from, resume_step=e.resume_step, created_at=now,
                          precompile=e.precompile)
        try:
            with d.store.tx() as tx:  # this tick may have changed it (an allocation granted)
                run = tx.get_run(run.number)
                skips = tx.list_data_skips(run.number)  # the data windows spikes made the run skip
            launch = d.launch_specs.of(run, spec, run_dir, attempt, e.skip_to_step)
            if spec.resources.standby:  # kept on every healthy node the run holds, spares too
                with d.store.tx() as tx:
                    held = tuple(x.name for x in tx.allocation(run.number) if x.state is NodeState.ALLOCATED)
                launch = replace(launch, standby_nodes=held)
            if e.precompile is None:
                d.moves.clear_the_way(run, spec, run_dir, e)
            else:  # the pass's saves are not the run's: its own go out of the way (precompile.py)
                d.moves.keep_aside_for_pass(run, spec, run_dir, e.number)
            config = trainer_cmd.write_attempt_config(spec, run_dir, e.number, launch.argv, skips,
                                                      e.every_steps, e.memory_every_steps)
            run_as = users.for_launch(spec.user)
            if run_as is not None:  # its trainers write logs, checkpoints and results there
                ck = trainer_cmd.checkpoint_dir(spec, run_dir)
                users.hand_over(run_as, run_dir.parent, run_dir, config.parent.parent, config.parent, config,
                                *([ck] if ck.is_relative_to(run_dir) else []))
            tree = user_tree.of(spec.user)  # the run's checkpoints and scripts, as its user
            trainer_cmd.write_fence(spec, run_dir, e.number, tree)
            inputs = (precompile.fingerprint(spec, trainer_cmd.attempt_cwd(spec, run_dir), tree)
                      if spec.command is not None else None)  # what a resume after its failure compares
            info = d.launcher.start(launch)
        except (LaunchError, OSError) as err:  # a launch fault, judged next tick
            # No restart can run what cannot be executed, nor get past a link or special file
            # planted where the daemon writes.
            fatal = isinstance(err, (CannotExecute, UnsafePath))
            with d.store.tx() as tx:
                tx.update_attempt(run.number, e.number, launch_error=str(err)[:2000] or type(err).__name__,
                                  launch_fatal=fatal)
            return
        started = d.clock()
        with d.store.tx() as tx:
            recorded = {a.number: a for a in tx.list_attempts(run.number)}
            attempt_to(tx, recorded, e.number, AttemptState.RUNNING, launch_info=info, started_at=started,
                       inputs=inputs)
            if run.started_at is None:
                tx.update_run(run.number, started_at=started)
            tx.add_event(run.number, EventKind.ATTEMPT_STARTED,
                         f"attempt {e.number} started: {len(e.nodes) * run.ranks_per_node} ranks on "
                         f"{', '.join(e.nodes)}", {"attempt": e.number, "nodes": list(e.nodes)}, started)
