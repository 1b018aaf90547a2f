"""Warm standbys on Slurm (``[resources] standby = true`` with ``launcher = "slurm"``).

A node's standbys are one srun step in the run's allocation, named
``<prefix>.<run>.s<N>``: a task per rank slot of the node, each ``python -m trainer
--standby`` (trainer/standby.py), interpreter up and torch imported, waiting on its
input. That input is srun's, with ``--input=all``: the line this daemon writes to srun's
pipe reaches every task. The next attempt's launch writes one line to each of its nodes'
steps, the broadcast of their assignments by slot (``NODE/LOCAL_RANK``); each standby
takes its slot's and becomes that rank. The attempt is then made of those steps, one a
node: its ranks are the tasks the broadcasts named (``parts`` of its launch_info),
observed, stopped and torn down step by step (supervisor/slurm/launcher.py). One step a
node, not one for all: a step ends only once every node of it has said its tasks ended,
and a node that died says nothing until Slurm gives it up (``SlurmdTimeout``, minutes);
the attempt's own steps must not wait for that.

As on the local launcher (supervisor/launchers/standby.py), standbys start
``REFILL_AFTER_S`` after an attempt starts, so that their imports do not compete with the
attempt's own start, on each node the attempt's spec names for standbys where none waits
with every task alive. An attempt is made of standbys only when every one of its nodes
has them, all alive (a node lost takes its standbys with it); else it starts cold, and
the next refill replaces what is missing. A node no longer the run's, or a run that ends,
has its standbys' input closed (they leave) and srun signalled; a daemon that dies closes
it too, so no standby outlives the daemon that started it, while the ranks it made
train on.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor import users
from supervisor.errors import CannotExecute, LaunchError
from supervisor.launchers.base import LaunchSpec
from supervisor.launchers.standby import REFILL_AFTER_S, assignment_for, reference_args
from supervisor.slurm.commands import SlurmCommands
from supervisor.slurm.requests import StepRequest, standby_srun_argv
from supervisor.slurm.srun import start_time_of, task_exits
from wire import KEY_ENV
from wire.standby import Assignment, broadcast

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Generation:
    """One node's standbys: a step of a task per rank slot (task k stands in for local rank k)."""

    run_id: str
    name: str  # its step's
    job: str
    node: str
    ranks_per_node: int
    proc: subprocess.Popen[bytes]  # its srun: our pipe is every standby's input
    log: Path  # srun's own lines, among them how each of its tasks ended
    uid: int | None

    def alive(self) -> int:
        """How many of its standbys live (0 once its srun ended)."""
        if self.proc.poll() is not None:
            return 0
        return self.ranks_per_node - len(task_exits(self.log))


@dataclass(slots=True)
class _Due:
    spec: LaunchSpec
    job_of: Mapping[str, str]  # node -> the run's job that holds it
    at: float  # monotonic


class SlurmStandbys:
    def __init__(self, commands: SlurmCommands, prefix: str, refill_after_s: float = REFILL_AFTER_S) -> None:
        self.commands = commands
        self.prefix = prefix
        self.refill_after_s = refill_after_s
        self._waiting: dict[str, dict[str, Generation]] = {}  # run -> node -> its standbys, waiting
        self._due: dict[str, _Due] = {}
        self._started: dict[str, int] = {}  # generations started per run: the next one's number
        self._ending: list[subprocess.Popen[bytes]] = []  # sruns of generations let go, reaped here

    def plan(self, spec: LaunchSpec, job_of: Mapping[str, str]) -> None:
        """The attempt ``spec`` started: standbys for the next one on its ``standby_nodes``
        (each a step of the job that holds it, ``job_of``) from ``refill_after_s`` on (none
        named: the run keeps none)."""
        if not spec.standby_nodes or spec.launch != "rank" or reference_args(spec.argv) is None:
            self.release(spec.run_id)
            return
        self._due[spec.run_id] = _Due(spec, dict(job_of), time.monotonic() + self.refill_after_s)

    def refill(self) -> int:
        """Start the standbys that are due on each node that has none whole; let go of those
        of nodes no longer the run's. How many steps were started."""
        now, started = time.monotonic(), 0
        self._ending = [p for p in self._ending if p.poll() is None]
        for run_id, due in list(self._due.items()):
            if now < due.at:
                continue
            del self._due[run_id]
            waiting = self._waiting.setdefault(run_id, {})
            for node in [n for n in waiting if waiting[n].job != due.job_of.get(n)]:
                self._stop(waiting.pop(node))
            for node in due.spec.standby_nodes:
                if node not in due.job_of:
                    continue
                g = waiting.get(node)
                if g is not None and g.alive() == g.ranks_per_node:
                    continue  # they wait there still, every one
                if g is not None:
                    self._stop(waiting.pop(node))
                g = self._start(due.spec, due.job_of[node], node)
                if g is not None:
                    waiting[node] = g
                    started += 1
        return started

    def take(self, spec: LaunchSpec, job_of: Mapping[str, str],
             nodes: Sequence[str]) -> list[Generation] | None:
        """The standbys of every node of ``nodes``, from now on the attempt's, when each
        node has them in the job that holds it (``job_of``), all alive; None: start cold."""
        waiting = self._waiting.get(spec.run_id, {})
        if not spec.standby_nodes or spec.launch != "rank" or reference_args(spec.argv) is None:
            return None
        gens = [waiting.get(n) for n in nodes]
        if any(g is None or g.job != job_of.get(n) or g.ranks_per_node != spec.ranks_per_node
               or g.alive() != g.ranks_per_node for n, g in zip(nodes, gens, strict=True)):
            return None
        for n in nodes:
            del waiting[n]
        return [g for g in gens if g is not None]

    def hand_over(self, spec: LaunchSpec, gens: Sequence[Generation], nodes: Sequence[str], argv: list[str],
                  env: Mapping[str, str],
                  record: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
        """Make the standbys ``gens`` (one a node, in the order of ``nodes``) the attempt
        ``spec``: each slot is handed its rank's environment (``env``, the step's, and what
        the rank wrapper would have exported) and the trainer's ``argv``; local rank k is
        task k of its node's step. The attempt's steps, for its launch_info, go to
        ``record`` before any standby hears of them: a daemon that dies in between finds
        them there (SlurmLauncher.find)."""
        world = len(nodes) * spec.ranks_per_node
        parts, handed = [], []
        for index, (node, g) in enumerate(zip(nodes, gens, strict=True)):
            slots, tasks = {}, {}
            for local in range(spec.ranks_per_node):
                rank = index * spec.ranks_per_node + local
                rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
                            "GROUP_RANK": str(index), "TSUP_NODE": node}
                log_file = spec.log_dir / f"rank-{rank}.log"
                try:
                    slots[f"{node}/{local}"] = assignment_for(spec, rank_env, log_file, argv)
                except OSError as e:
                    raise CannotExecute(str(e)) from e
                tasks[str(rank)] = local
            handed.append((g, slots))
            parts.append({"job": g.job, "step": g.name, "srun_pid": g.proc.pid,
                          "srun_ct": start_time_of(g.proc.pid), "log": str(g.log), "tasks": tasks})
        record(parts)
        for g, slots in handed:
            self.assign(g, slots)
        return parts

    @staticmethod
    def assign(g: Generation, slots: Mapping[str, Assignment]) -> None:
        """Every standby of ``g`` its slot's assignment, in one line; then the end of their
        input. LaunchError when srun takes none of it."""
        assert g.proc.stdin is not None
        try:
            g.proc.stdin.write(broadcast(slots))
            g.proc.stdin.flush()
        except OSError as e:
            raise LaunchError(f"standbys {g.name}: cannot hand them the attempt: {e}") from e
        finally:
            with contextlib.suppress(OSError):
                g.proc.stdin.close()

    def release(self, run_id: str) -> None:
        """The run needs no standbys any more (it ended, or keeps none)."""
        self._due.pop(run_id, None)
        for g in self._waiting.pop(run_id, {}).values():
            self._stop(g)

    def waiting(self) -> dict[str, dict[str, int]]:
        """Standbys waiting, per run and node (for /metrics; any thread may ask)."""
        out: dict[str, dict[str, int]] = {}
        for run_id, per_node in list(self._waiting.items()):
            for node, g in list(per_node.items()):
                if alive := g.alive():
                    out.setdefault(run_id, {})[node] = alive
        return out

    def _start(self, spec: LaunchSpec, job: str, node: str) -> Generation | None:
        number = self._started.get(spec.run_id, 0) + 1
        self._started[spec.run_id] = number
        name = f"{self.prefix}.{spec.run_id}.s{number}"
        try:
            run_as = users.for_launch(spec.user)
        except CannotExecute:  # the user is gone: no standbys; the cold start says why
            return None
        # The run's environment, none of an attempt's (its ids, its telemetry key): the
        # broadcast brings those.
        env = {**{k: v for k, v in spec.env.items() if not k.startswith("TSUP_") and k != KEY_ENV},
               **users.login_env(run_as), "TSUP_STANDBY": spec.run_id, "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        attempts = spec.log_dir.parent
        req = StepRequest(job_id=job, step_name=name, nodes=(node,), ranks_per_node=spec.ranks_per_node,
                          argv=(), log_dir=attempts, cwd=spec.cwd, extra=spec.srun_args)
        srun_log = attempts / f"srun-s{number}.log"
        argv = standby_srun_argv(req, spec.argv[0], str(attempts.parent))
        try:
            proc = self.commands.start_step(argv, env=env, log_path=srun_log, user=run_as,
                                            log_base=spec.log_base, input_pipe=True)
        except (OSError, ValueError) as e:
            log.warning("%s: cannot start standbys: %s", name, e)
            return None
        log.info("%s: standbys for %s's next attempt on %s", name, spec.run_id, node)
        return Generation(run_id=spec.run_id, name=name, job=job, node=node,
                          ranks_per_node=spec.ranks_per_node, proc=proc, log=srun_log,
                          uid=run_as.uid if run_as is not None else None)

    def _stop(self, g: Generation) -> None:
        if g.proc.stdin is not None:
            with contextlib.suppress(OSError):
                g.proc.stdin.close()  # the end of their input: waiting standbys leave
        if g.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                g.proc.send_signal(signal.SIGTERM)  # and srun passes SIGTERM to those importing still
            self._ending.append(g.proc)
