"""The Slurm launcher: a run's allocation (supervisor/slurm/allocation.py), the trainer as
job steps inside it.

How a run maps onto Slurm (builders in supervisor/slurm/requests.py):

- ``allocate``/``held``/``release``: the run's batch job of whole nodes, and the growth
  jobs a run that went on with fewer nodes grows back through (supervisor/slurm/
  allocation.py).
- ``start``: ``srun --jobid=<allocation>`` on the attempt's nodes, as a step named
  ``<prefix>.<run>.a<attempt>``; srun runs on this host in a session of its own. Where
  the attempt has telemetry, the node agents (node/agent.py) go first, as a step
  of their own (``<prefix>.<run>.a<attempt>.agent``, one task a node, overlapping); they
  are stopped when the attempt is forgotten. With warm standby the ranks are instead the
  tasks of the run's waiting generation of standbys, a step started after the previous
  attempt (supervisor/slurm/standby.py), handed their assignments in one line. An
  attempt whose nodes are in two jobs (a run grown back) is a step in each, its
  ``parts``: a step cannot span jobs. Each part's tasks are placed in the attempt's
  world by the rank wrapper (``SplitPart``), and write their logs under their rank.
- ``observe``: srun's exit status and its per-task lines (``srun: error: node1: task 1:
  Exited with exit code 3``) when srun is ours; Slurm's step list when it is not
  (after a daemon restart). A rank whose step still runs is UNKNOWN to Slurm: its
  liveness comes from telemetry (heartbeats, last will).
- Steps are the run's only inside its own allocation and of its owner: the step list,
  the ``srun`` processes of this host and every ``scancel`` (``--user=``) are matched by
  job id, step name and uid, never by name alone.

What Slurm says of jobs, steps and nodes comes from ``SlurmState`` (supervisor/slurm/
state.py): polled off the reconciler's path, shared with node administration
(supervisor/slurm/nodes.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from supervisor import user_files, users
from supervisor.domain import ProcState
from supervisor.domain.step import Step, rdzv_id
from supervisor.errors import CannotExecute, LaunchError
from supervisor.launchers.base import AllocationRequest, Grant, LaunchSpec, Parked, RankProc
from supervisor.ports import free_port
from supervisor.slurm import parse
from supervisor.slurm.allocation import (
    Alloc,
    SlurmAllocations,
    SlurmOptions,
    check_partition,
    only_of,
    uid_of,
)
from supervisor.slurm.commands import SlurmCommands
from supervisor.slurm.requests import StepRequest, agent_srun_argv, split_env, srun_argv, step_env
from supervisor.slurm.srun import find_srun, rank_state, start_time_of, steps_of, task_exits
from supervisor.slurm.standby import Generation, SlurmStandbys
from supervisor.slurm.state import SlurmState
from wire import NODE_AGENT_ENV

log = logging.getLogger(__name__)

AGENT_SUFFIX = ".agent"  # the node agents' step: the trainer's step name and this


def prefix_for(state_dir: Path) -> str:
    """Job names carry the state directory's fingerprint: two daemons on one cluster never
    adopt each other's jobs."""
    return "tsup-" + hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:8]


class SlurmLauncher:
    kind = "slurm"

    def __init__(self, commands: SlurmCommands, state: SlurmState, *, state_dir: Path,
                 options: SlurmOptions | None = None, node_python: str = sys.executable) -> None:
        self.commands = commands
        self.node_python = node_python  # the node agents' interpreter on the nodes
        self.state = state
        self.options = options or SlurmOptions()
        self.state_dir = state_dir
        self.prefix = prefix_for(state_dir)
        self._children: dict[int, Any] = {}
        self.standbys = SlurmStandbys(commands, self.prefix)
        self.allocations = SlurmAllocations(commands, state, prefix=self.prefix, state_dir=state_dir,
                                            options=self.options, before_requeue=self._kill_sruns_of)

    def job_of(self, info: str | None) -> str | None:
        return Alloc.load(info).job

    def answered_since(self, t: float) -> bool:
        return self.state.answered_since(t)

    # --- submit-time checks ---------------------------------------------------------

    def check_resources(self, nodes: int, spares: int, partition: str | None) -> None:
        check_partition(self.state.partitions(), nodes, spares, partition or self.options.partition)

    # --- allocations (supervisor/slurm/allocation.py) ------------------------------

    def allocate(self, req: AllocationRequest) -> Grant:
        return self.allocations.allocate(req)

    def held(self, run_id: str, info: str | None) -> Grant | None:
        return self.allocations.held(run_id, info)

    def release(self, run_id: str, info: str | None) -> bool:
        self.standbys.release(run_id)
        return self.allocations.release(info)

    def park(self, run_id: str, info: str | None, user: str | None) -> Parked:
        self.standbys.release(run_id)
        return self.allocations.park(info, user)

    # --- steps ------------------------------------------------------------------------

    def step_name(self, run_id: str, attempt: int) -> str:
        return f"{self.prefix}.{run_id}.a{attempt}"

    def start(self, spec: LaunchSpec) -> str:
        alloc = Alloc.load(spec.allocation_info)
        if alloc.job is None:
            raise LaunchError("the run holds no Slurm allocation")
        where = dict(self.allocations.node_jobs(spec.allocation_info))
        job_of = {n: where.get(n, alloc.job) for n in (*spec.nodes, *spec.standby_nodes)}
        nodes_info = self.state.nodes() or {}
        order, jobs = list(nodes_info), list(alloc.jobs)
        # Slurm's block distribution in its own node order, job by job (the first job's first).
        nodes = sorted(spec.nodes, key=lambda n: (jobs.index(job_of[n]) if job_of[n] in jobs else 0,
                                                  order.index(n) if n in order else len(order)))
        first = nodes_info.get(nodes[0])
        master_addr = first.addr if first else nodes[0]
        local = master_addr in ("127.0.0.1", "localhost")
        port = free_port() if local else _port_for(spec.run_id, spec.attempt)
        name = self.step_name(spec.run_id, spec.attempt)
        step = Step(nnodes=len(nodes), nproc_per_node=spec.ranks_per_node, master_addr=master_addr,
                    master_port=port, rdzv_id=rdzv_id(spec.run_id, spec.attempt))
        env = step_env(spec.env, step, ranks_per_node=spec.ranks_per_node, launch=spec.launch,
                       marker=spec.marker)
        if spec.trusted_dir is None:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
        with user_files.directory(spec.log_base, spec.log_dir, create=True):
            pass  # made, or found, without following a link below the daemon's own directory
        run_as = users.for_launch(spec.user)
        restarts = self._restarts(alloc.job)
        env |= users.login_env(run_as) | ({} if restarts is None else {"SLURM_RESTART_COUNT": str(restarts)})
        parts = _parts(nodes, job_of, StepRequest(
            job_id=alloc.job, step_name=name, nodes=tuple(nodes), ranks_per_node=spec.ranks_per_node,
            argv=spec.argv, log_dir=spec.log_dir, cwd=spec.cwd, extra=spec.srun_args, launch=spec.launch,
            step=step), _ranks_per_task(spec))
        agents = self._start_agents(parts, env, spec, run_as) if env.get("TSUP_MQTT_URL") else []
        if agents:
            env[NODE_AGENT_ENV] = "1"  # the agents report the nodes' slots (trainer/telemetry.py)
        agent_info = {"agent_step": name + AGENT_SUFFIX, "agents": agents} if agents else {}
        warm = self.standbys.take(spec, job_of, nodes)
        self.standbys.plan(spec, job_of)
        if warm is not None:
            return self._start_warm(spec, alloc.job, warm, nodes, step, env, agent_info)
        uid = uid_of(run_as)
        common = {"job": parts[0].req.job_id, "step": name, "uid": uid, "restarts": restarts,
                  "ranks": _rank_map(nodes, spec.ranks_per_node),
                  "ranks_per_task": _ranks_per_task(spec), **agent_info}
        started: list[dict[str, Any]] = []
        try:
            for part in parts:
                log_path = spec.log_dir / _srun_log(part.req.job_id, alloc.job)
                p = self._start_srun(srun_argv(part.req), env | part.env, log_path, spec, run_as)
                started.append({"job": part.req.job_id, "step": name, "srun_pid": p.pid,
                                "srun_ct": start_time_of(p.pid), "log": str(log_path), "tasks": part.tasks})
        except (CannotExecute, LaunchError):
            for info in started:  # half an attempt trains nothing: what started goes
                self._signal_srun(int(info["srun_pid"]), signal.SIGTERM)
            raise
        self.state.refresh()
        if len(started) == 1:
            [only] = started
            return json.dumps({**common, **{k: only[k] for k in ("srun_pid", "srun_ct", "log")}})
        return json.dumps({**common, "parts": started})

    def _restarts(self, job_id: str) -> int | None:
        """How often the job was requeued (None: not known): the steps' SLURM_RESTART_COUNT
        (set by Slurm in a batch script only; NxD Training keys its logs on it), and the
        attempt's record's (``_requeued_under``)."""
        job = (self.state.jobs() or {}).get(job_id)
        return None if job is None else job.restarts

    def _start_srun(self, argv: list[str], env: dict[str, str], log_path: Path, spec: LaunchSpec,
                    run_as: users.RunAs | None) -> subprocess.Popen[bytes]:
        try:
            p = self.commands.start_step(argv, env=env, log_path=log_path, user=run_as,
                                         log_base=spec.log_base)
        except ValueError as e:
            # Popen cannot pass it (a NUL byte in an argument or a variable): no retry will.
            raise CannotExecute(f"cannot start srun for {spec.argv[0]!r}: {e}") from e
        except OSError as e:
            raise LaunchError(f"cannot start srun: {e}") from e
        self._children[p.pid] = p
        return p

    def _kill_sruns_of(self, job: str) -> None:
        """``job`` is about to be requeued: its sruns here go now, by SIGKILL (see _requeued_under)."""
        for child in [c for c in self._children.values() if c.poll() is None and f"--jobid={job}" in c.args]:
            child.kill()

    def _signal_srun(self, pid: int, sig: int) -> None:
        child = self._children.get(pid)
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)

    def _start_warm(self, spec: LaunchSpec, job: str, gens: list[Generation], nodes: list[str], step: Step,
                    env: dict[str, str], agent_info: dict[str, Any]) -> str:
        """The attempt as the standbys of its nodes (``gens``, one step a node, in the order
        of ``nodes``), recorded in the daemon's own directory before they hear of it."""
        record = self._warm_record(spec.run_id, spec.attempt)
        info: dict[str, Any] = {"job": job, "uid": gens[0].uid, "warm": True, "record": record.name,
                                "ranks": _rank_map(nodes, spec.ranks_per_node), **agent_info}

        def write(parts: list[dict[str, Any]]) -> None:
            info.update(step=parts[0]["step"], parts=parts)
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_suffix(".tmp")
            tmp.write_text(json.dumps(info))
            os.replace(tmp, record)

        self.standbys.hand_over(spec, gens, nodes, list(step.fill_all(spec.argv)), env, write)
        for g in gens:
            self._children[g.proc.pid] = g.proc
        log.info("%s: attempt %d on the standbys of %s", spec.run_id, spec.attempt, ", ".join(nodes))
        return json.dumps(info)

    def _warm_record(self, run_id: str, attempt: int) -> Path:
        """Where an attempt made of standbys is written down before they hear of it: its
        steps are the standbys' (``<prefix>.<run>.s<N>``), not the attempt's name, so a
        daemon that died before the store recorded it could not find them by name."""
        return self.state_dir / "slurm" / f"{run_id}.a{attempt}.warm.json"

    def _start_agents(self, parts: list[_Part], env: dict[str, str], spec: LaunchSpec,
                      run_as: users.RunAs | None) -> list[dict[str, Any]]:
        """The attempt's node agents, a step in each job of the attempt ([], logged, when
        srun cannot be started: the trainer runs without them, as before there were any)."""
        out: list[dict[str, Any]] = []
        for part in parts:
            req = replace(part.req, step_name=part.req.step_name + AGENT_SUFFIX)
            log_path = spec.log_dir / ("srun-agent.log" if len(parts) == 1
                                       else f"srun-agent-{req.job_id}.log")
            try:
                p = self.commands.start_step(agent_srun_argv(req, self.node_python), env=env | part.env,
                                             log_path=log_path, user=run_as, log_base=spec.log_base)
            except (OSError, ValueError) as e:
                log.warning("%s: cannot start the node agents: %s", req.step_name, e)
                for agent in out:
                    self._signal_srun(int(agent["pid"]), signal.SIGTERM)
                return []
            self._children[p.pid] = p
            out.append({"job": req.job_id, "pid": p.pid})
        return out

    def find(self, spec: LaunchSpec) -> str | None:
        """A step of this attempt that exists but was never recorded (the daemon died
        between starting srun and writing it down), in any of the run's jobs."""
        name = self.step_name(spec.run_id, spec.attempt)
        alloc = Alloc.load(spec.allocation_info)
        if alloc.job is None:
            return None  # no allocation: no step of this attempt can have started
        with contextlib.suppress(OSError, ValueError):
            warm = json.loads(self._warm_record(spec.run_id, spec.attempt).read_text())
            if isinstance(warm, dict) and warm.get("job") in alloc.jobs:
                return json.dumps(warm)
        try:
            uid = uid_of(users.for_launch(spec.user))
        except LaunchError:
            return None  # the run's user is gone from this host: starting again says so
        steps = self.state.steps() or []
        where = dict(self.allocations.node_jobs(spec.allocation_info))
        per_task = _ranks_per_task(spec)
        found: list[dict[str, Any]] = []
        nodes: list[str] = []
        for job in alloc.jobs:
            srun = find_srun(name, job, uid)
            step = _own_step(steps, job, name, uid)
            if srun is None and step is None:
                continue
            mine = list(step.nodes) if step else [n for n in spec.nodes if where.get(n, alloc.job) == job]
            first = len(nodes) * spec.ranks_per_node
            found.append({"job": job, "step": name, "srun_pid": srun.pid if srun else 0,
                          "srun_ct": start_time_of(srun.pid) if srun else 0.0,
                          "log": str(spec.log_dir / _srun_log(job, alloc.job)),
                          "tasks": {str(first + i): i // per_task
                                    for i in range(len(mine) * spec.ranks_per_node)}})
            nodes += mine
        if not found:
            return None
        common = {"job": found[0]["job"], "step": name, "uid": uid,
                  "ranks": _rank_map(nodes, spec.ranks_per_node), "ranks_per_task": per_task,
                  "base": str(spec.log_base)}  # srun's logs are read from here, no link below it followed
        if len(found) == 1:
            return json.dumps({**common, **{k: found[0][k] for k in ("srun_pid", "srun_ct", "log")}})
        return json.dumps({**common, "parts": found})

    def observe(self, launch_info: str) -> list[RankProc]:
        info = json.loads(launch_info)
        self.standbys.refill()
        ranks: list[tuple[int, str]] = [(int(r), str(n)) for r, n in info["ranks"]]
        per_task = int(info.get("ranks_per_task", 1))
        states: dict[int, tuple[ProcState, int | None]] = {}
        for part in steps_of(info):
            log_path, base = Path(part["log"]), Path(info["base"]) if info.get("base") else None
            trusted = base if base is not None and log_path.is_relative_to(base) else None
            by_task = task_exits(log_path, trusted)
            mine: dict[int, int] | None = None  # rank -> its task; None: task r is rank r
            if part.get("tasks") is not None:  # ranks made of standbys: the tasks that were them
                mine = {int(rank): int(task) for rank, task in part["tasks"].items()}
                exits = {rank: by_task[task] for rank, task in mine.items() if task in by_task}
            else:  # srun names tasks: with launch "node" a task is a node and stands for its ranks
                exits = {task * per_task + i: code for task, code in by_task.items() for i in range(per_task)}
            srun_code, srun_alive = self._srun_state(part)
            step_listed: bool | None = None
            if not srun_alive and srun_code is None:
                steps = self.state.steps()
                step_listed = None if steps is None else _own_step(steps, part.get("job", info["job"]),
                                                                    part["step"], info.get("uid")) is not None
            for rank, _ in ranks:
                if mine is None or rank in mine:
                    states[rank] = rank_state(exits.get(rank), srun_code, srun_alive, step_listed,
                                               failed_named=bool(exits))
        down = self._down({node for _, node in ranks})
        return [RankProc(rank=rank, node=node, proc=states[rank][0], exit_code=states[rank][1],
                         node_up=False if node in down else None, node_down=down.get(node, ""))
                for rank, node in ranks]

    def _down(self, nodes: set[str]) -> dict[str, str]:
        """Those of ``nodes`` Slurm declared DOWN (slurmd unheard past SlurmdTimeout: power
        lost, say), in Slurm's words; NOT_RESPONDING alone (a missed ping) is not down."""
        known = self.state.nodes() or {}
        return {n: f"Slurm set it {known[n].state}" + (f" ({known[n].reason})" if known[n].reason else "")
                for n in nodes if n in known and "DOWN" in known[n].flags}

    def _srun_state(self, info: dict[str, Any]) -> tuple[int | None, bool]:
        """(srun's exit code if it was ours and ended, whether it still runs)."""
        pid = int(info["srun_pid"])
        child = self._children.get(pid)
        if child is not None:
            code = child.poll()
            return code, code is None
        if pid <= 0:
            return None, False
        try:
            p = psutil.Process(pid)
            same = abs(p.create_time() - float(info["srun_ct"])) < 0.05  # not a reused pid
            return None, same and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return None, False
        except psutil.Error:
            return None, True  # cannot tell: assume it lives, never that it died

    def stop(self, launch_info: str, *, force: bool) -> None:
        info = json.loads(launch_info)
        for part in steps_of(info):
            step = self._step_id(info, part)
            if step is not None:
                signal_name = "KILL" if force else "TERM"
                self.commands.fire(["scancel", *only_of(info.get("uid")), f"--signal={signal_name}", step])
            _, alive = self._srun_state(part)
            if alive:
                # srun forwards SIGTERM to every task; two SIGINTs within a second make it
                # kill the step (when its id was not known yet); in a requeued job, quietly.
                with contextlib.suppress(ProcessLookupError):
                    if self._requeued_under(info, part):
                        os.kill(int(part["srun_pid"]), signal.SIGKILL)
                    elif force and step is None:
                        os.kill(int(part["srun_pid"]), signal.SIGINT)
                        os.kill(int(part["srun_pid"]), signal.SIGINT)
                    elif not force:
                        os.kill(int(part["srun_pid"]), signal.SIGTERM)

    def _requeued_under(self, info: dict[str, Any], part: dict[str, Any]) -> bool:
        """``part``'s job is no longer the incarnation its srun started in (a requeued job
        numbers its steps from 0 again, and an srun that outlives its step ends it by number
        after KillWait: the restarted job's step): pending again, at another restart count,
        or gone. False while Slurm does not answer."""
        jobs = self.state.jobs()
        if jobs is None:
            return False
        job = jobs.get(part.get("job", info["job"]))
        if job is None or job.state != "RUNNING":
            return True
        started_in = info.get("restarts")
        return started_in is not None and job.restarts is not None and job.restarts != started_in

    def _step_id(self, info: dict[str, Any], part: dict[str, Any]) -> str | None:
        s = _own_step(self.state.steps() or [], part.get("job", info["job"]), part["step"], info.get("uid"))
        return f"{s.job_id}.{s.step_id}" if s else None

    def forget(self, launch_info: str) -> None:
        info = json.loads(launch_info)
        self._stop_agents(info)
        if info.get("record"):
            (self.state_dir / "slurm" / Path(info["record"]).name).unlink(missing_ok=True)
        for part in steps_of(info):
            if self._requeued_under(info, part):  # it would signal the next incarnation's step
                self._signal_srun(int(part["srun_pid"]), signal.SIGKILL)
        # An srun is dropped only once it has exited: one still waiting out its step (a
        # SIGTERM'd agents' srun waits KillWait + 2 s, then ends its step by number) must
        # stay where a requeue meanwhile finds it (_kill_sruns_of), or it ends the
        # restarted job's step of that number.
        for pid in [pid for pid, child in self._children.items() if child.poll() is not None]:
            del self._children[pid]

    def _stop_agents(self, info: dict[str, Any]) -> None:
        """The attempt is over: its node agents go (SIGTERM through our srun, which passes it
        to every agent, or SIGKILL to an srun whose job was requeued under it; and scancel
        of their step, for one a restarted daemon adopted)."""
        name = info.get("agent_step")
        if not name:
            return
        steps = self.state.steps() or []
        for agents in info.get("agents") or [{"job": info["job"], "pid": info.get("agent_pid", 0)}]:
            quietly = self._requeued_under(info, agents)
            self._signal_srun(int(agents["pid"]), signal.SIGKILL if quietly else signal.SIGTERM)
            step = _own_step(steps, agents["job"], name, info.get("uid"))
            if step is not None:
                self.commands.fire(["scancel", *only_of(info.get("uid")), f"{step.job_id}.{step.step_id}"])


# --- helpers ---------------------------------------------------------------------------


def _ranks_per_task(spec: LaunchSpec) -> int:
    return spec.ranks_per_node if spec.launch == "node" else 1


def _rank_map(nodes: list[str], ranks_per_node: int) -> list[list[int | str]]:
    """[rank, node] pairs: Slurm's block distribution over the nodes in its own order."""
    return [[k * ranks_per_node + i, n] for k, n in enumerate(nodes) for i in range(ranks_per_node)]


@dataclass(frozen=True, slots=True)
class _Part:
    """The attempt's step in one job, on that job's nodes of the attempt."""

    req: StepRequest
    env: dict[str, str]  # what places its tasks in the attempt ({}: the attempt is this one step)
    tasks: dict[str, int]  # rank -> the task of this step that is it (or, launch "node", runs it)


def _parts(nodes: list[str], job_of: dict[str, str], req: StepRequest, per_task: int) -> list[_Part]:
    """The attempt's steps: one, or (its nodes in two jobs, a run grown back) one a job."""
    groups: list[tuple[str, list[str]]] = []
    for n in nodes:
        if groups and groups[-1][0] == job_of[n]:
            groups[-1][1].append(n)
        else:
            groups.append((job_of[n], [n]))
    out, first = [], 0
    for job, mine in groups:
        ranks = range(first * req.ranks_per_node, (first + len(mine)) * req.ranks_per_node)
        tasks = {str(r): (r - ranks.start) // per_task for r in ranks}
        if len(groups) == 1:
            out.append(_Part(replace(req, job_id=job), {}, tasks))
        else:
            env = split_env(nodes, first, req.ranks_per_node // per_task, req.log_dir)
            out.append(_Part(replace(req, job_id=job, nodes=tuple(mine), part=True), env, tasks))
        first += len(mine)
    return out


def _srun_log(job: str, first_job: str | None) -> str:
    """The srun log of the attempt's step in ``job``: srun.log in the run's first job."""
    return "srun.log" if job == first_job else f"srun-{job}.log"


def _own_step(steps: list[parse.StepInfo], job: str | None, name: str,
              uid: int | None) -> parse.StepInfo | None:
    """The attempt's step: named ``name``, in the allocation ``job``, and ``uid``'s
    (where squeue names an owner); another user's step of that name is not."""
    return next((s for s in steps if s.job_id == job and s.name == name
                 and (s.user_id is None or s.owned_by(uid))), None)


RENDEZVOUS_PORTS = range(20000, 30000)  # on a run's first node: what a cluster's daemons leave free


def _port_for(run_id: str, attempt: int) -> int:
    """A rendezvous port on the first node, spread over RENDEZVOUS_PORTS by run and attempt."""
    digest = int(hashlib.sha256(f"{run_id}.{attempt}".encode()).hexdigest(), 16)
    return RENDEZVOUS_PORTS[digest % len(RENDEZVOUS_PORTS)]
