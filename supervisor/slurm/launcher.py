"""The Slurm launcher: one allocation per run, the trainer as a job step inside it.

How a run maps onto Slurm (builders in supervisor/slurm/requests.py):

- ``allocate``: one batch job of N+S whole nodes (``--nodes=N-(N+S)``: it starts as
  soon as N are free) whose script only sleeps, submitted as the run's user. Its id and
  owner are recorded (``allocation_info``), and from then on the job is known by that id
  alone. Its name, ``<prefix>.<run>.<k>``, is derived from what the store already holds,
  so a daemon killed between ``sbatch`` and recording the id finds the job by name and
  never submits a second one; but squeue lists every user's jobs and anyone can name a
  job so, so only a job of the expected owner is ever adopted by name.
- ``start``: ``srun --jobid=<allocation>`` on the attempt's nodes, as a step named
  ``<prefix>.<run>.a<attempt>``; srun runs on this host in a session of its own. Where
  the attempt has telemetry, the node agents (supervisor/agent.py) go first, as a step
  of their own (``<prefix>.<run>.a<attempt>.agent``, one task a node, overlapping); they
  are stopped when the attempt is forgotten. With warm standby the ranks are instead the
  tasks of the run's waiting generation of standbys, a step started after the previous
  attempt (supervisor/slurm/standby.py), handed their assignments in one line.
- ``observe``: srun's exit status and its per-task lines (``srun: error: node1: task 1:
  Exited with exit code 3``) when srun is ours; Slurm's step list when it is not
  (after a daemon restart). A rank whose step still runs is UNKNOWN to Slurm: its
  liveness comes from telemetry (heartbeats, last will).
- ``held``: the allocation as squeue sees it, minus nodes Slurm calls unusable. A
  failed poll means "unknown", never "ended"; a recorded id that squeue shows owned by
  someone else (ids start again after slurmctld loses its state) means "ended".
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
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from supervisor import user_files, users
from supervisor.domain import ProcState
from supervisor.domain.step import Step, rdzv_id
from supervisor.errors import CannotExecute, LaunchError, SpecError
from supervisor.launchers.base import AllocationRequest, Grant, LaunchSpec, RankProc
from supervisor.slurm import parse
from supervisor.slurm.commands import SlurmCommands
from supervisor.slurm.requests import (
    SbatchRequest,
    StepRequest,
    agent_srun_argv,
    allocation_script,
    sbatch_argv,
    srun_argv,
    step_env,
)
from supervisor.slurm.srun import find_srun, rank_state, start_time_of, steps_of, task_exits
from supervisor.slurm.standby import Generation, SlurmStandbys
from supervisor.slurm.state import SlurmState
from trainer.protocol import NODE_AGENT_ENV

log = logging.getLogger(__name__)

AGENT_SUFFIX = ".agent"  # the node agents' step: the trainer's step name and this


def prefix_for(state_dir: Path) -> str:
    """Job names carry the state directory's fingerprint: two daemons on one cluster never
    adopt each other's jobs."""
    return "tsup-" + hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:8]


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmOptions:
    partition: str | None = None
    time_limit_min: int | None = None
    signal_before_s: int = 120
    sbatch_extra: tuple[str, ...] = ()


class SlurmLauncher:
    kind = "slurm"

    def __init__(self, commands: SlurmCommands, state: SlurmState, *, state_dir: Path,
                 options: SlurmOptions | None = None) -> None:
        self.commands = commands
        self.state = state
        self.options = options or SlurmOptions()
        self.state_dir = state_dir
        self.prefix = prefix_for(state_dir)
        self._children: dict[int, Any] = {}
        self.standbys = SlurmStandbys(commands, self.prefix)

    def answered_since(self, t: float) -> bool:
        return self.state.answered_since(t)

    # --- submit-time checks ---------------------------------------------------------

    def check_resources(self, nodes: int, spares: int, partition: str | None) -> None:
        parts = self.state.partitions()
        if parts is None:
            raise SpecError("resources: cannot list Slurm's partitions (is SLURM_CONF right?)")
        name = partition or self.options.partition
        if name is None:
            defaults = [p for p in parts.values() if p.default]
            if not defaults:
                raise SpecError("resources.partition: the cluster has no default partition; name one")
            part = defaults[0]
        elif name not in parts:
            raise SpecError(f"resources.partition: no partition {name!r} on this cluster "
                            f"(it has {', '.join(sorted(parts)) or 'none'})")
        else:
            part = parts[name]
        if nodes > part.total_nodes:
            raise SpecError(f"resources.nodes: {nodes} nodes asked, partition {part.name!r} has "
                            f"{part.total_nodes}")
        if part.max_nodes is not None and nodes > part.max_nodes:
            raise SpecError(f"resources.nodes: {nodes} nodes asked, partition {part.name!r} allows "
                            f"{part.max_nodes} per job")
        if nodes + spares > part.total_nodes:
            raise SpecError(f"resources.spares: {nodes} nodes + {spares} spare(s) exceed the "
                            f"{part.total_nodes} nodes of partition {part.name!r}")

    # --- allocations ------------------------------------------------------------------

    def sbatch_request(self, req: AllocationRequest, seq: int) -> SbatchRequest:
        run_id = req.run_id
        return SbatchRequest(
            job_name=f"{self.prefix}.{run_id}.{seq}", nodes=req.count, min_nodes=req.minimum,
            partition=req.partition or self.options.partition,
            time_limit_min=req.time_limit_min or self.options.time_limit_min,
            signal_before_s=self.options.signal_before_s if req.handles_usr1 else None,
            exclude=tuple(sorted(req.drained)),
            output=self.state_dir / "slurm" / f"{run_id}.alloc-{seq}.out", extra=self.options.sbatch_extra,
        )

    def allocate(self, req: AllocationRequest) -> Grant:
        info = load_alloc(req.info)
        jobs = self.state.jobs()
        if jobs is None:
            return Grant(nodes=req.held, info=req.info, note="squeue failed; trying again")
        job = _recorded(jobs, info)
        if job is not None and job.phase is parse.JobPhase.WAITING:
            return Grant(nodes=(), info=req.info, note=f"job {job.job_id} pending: {job.reason}")
        if job is not None and job.phase is parse.JobPhase.HOLDING:
            have = self._usable(job.nodes, req.drained)
            if len(have) >= (req.keep or req.minimum):
                return Grant(nodes=have, info=req.info)
            # Too few healthy nodes left in it: give it back and ask for a new one.
            self.commands.fire(["scancel", *_only_of(info["uid"]), job.job_id])
            log.info("allocation %s holds %d healthy nodes, %d needed: replacing it",
                     job.job_id, len(have), req.keep or req.minimum)
        seq = info["seq"] + 1 if info["job"] else max(info["seq"], 1)
        name = f"{self.prefix}.{req.run_id}.{seq}"
        try:
            owner = users.for_launch(req.user)
        except LaunchError as e:  # the run's user is gone from this host: say why, and wait
            return Grant(nodes=(), info=req.info, note=str(e))
        uid = _uid_of(owner)
        # A job of this name may exist already: submitted by a daemon that died before
        # recording its id. Adopt it rather than submit a second, if it is the owner's:
        # anyone can name a job so.
        found = [j for j in jobs.values() if j.name == name and j.phase is not parse.JobPhase.ENDED
                 and j.owned_by(uid)]
        if found:
            new_info = _dump_alloc(found[0].job_id, seq, uid)
            log.info("adopted allocation %s (%s)", found[0].job_id, name)
            return self.held(req.run_id, new_info) or Grant(nodes=(), info=new_info)
        sreq = self.sbatch_request(req, seq)
        if owner is not None and not owner.is_me:
            # The batch script only sleeps, and the daemon's private state directory is
            # no place the run's user may write: its output goes nowhere.
            sreq = replace(sreq, output=Path("/dev/null"))
        sreq.output.parent.mkdir(parents=True, exist_ok=True)
        reply = self.commands.run(sbatch_argv(sreq), stdin=allocation_script(sreq), user=owner)
        if not reply.ok:
            return Grant(nodes=(), info=_dump_alloc(None, seq, uid), note=f"sbatch failed: {reply.why}")
        try:
            job_id = parse.parse_sbatch_job_id(reply.stdout)
        except parse.SlurmParseError as e:
            return Grant(nodes=(), info=_dump_alloc(None, seq, uid), note=str(e))
        self.state.refresh()
        log.info("submitted allocation %s (%s) for %d nodes", job_id, name, req.count)
        return Grant(nodes=(), info=_dump_alloc(job_id, seq, uid), note=f"job {job_id} submitted")

    def held(self, run_id: str, info: str | None) -> Grant | None:
        if info is None:
            return None
        alloc = load_alloc(info)
        if alloc["job"] is None:
            return None  # nothing submitted yet: allocate() deals with it
        jobs = self.state.jobs()
        if jobs is None:
            return None
        job = _recorded(jobs, alloc)
        if job is None or job.phase is parse.JobPhase.ENDED:
            why = ("no longer in squeue" if alloc["job"] not in jobs else
                   "now someone else's" if job is None else f"{job.state} ({job.reason})")
            return Grant(nodes=(), info=_dump_alloc(None, alloc["seq"], alloc["uid"]),
                         note=f"job {alloc['job']} {why}")
        if job.phase is parse.JobPhase.WAITING:
            return Grant(nodes=(), info=info, note=f"job {job.job_id} pending: {job.reason}")
        return Grant(nodes=self._usable(job.nodes, frozenset()), info=info)

    def _usable(self, names: tuple[str, ...], drained: frozenset[str]) -> tuple[str, ...]:
        nodes = self.state.nodes() or {}
        return tuple(n for n in names if n not in drained and (n not in nodes or nodes[n].usable))

    def release(self, run_id: str, info: str | None) -> bool:
        self.standbys.release(run_id)
        alloc = load_alloc(info)
        job = alloc["job"]
        if job is None:
            return True
        jobs = self.state.jobs()
        if jobs is not None and job in jobs and _recorded(jobs, alloc) is None:
            return True  # the id is someone else's job now: ours is long gone
        # Waited for, not fired: with slurmctld down scancel fails, and an allocation
        # forgotten then would hold its nodes until its time limit.
        reply = self.commands.run(["scancel", *_only_of(alloc["uid"]), job])
        self.state.refresh()
        if reply.ok or "Invalid job id" in reply.why:  # already gone is given back too
            return True
        log.warning("cannot give back allocation %s yet: %s", job, reply.why)
        return False

    # --- steps ------------------------------------------------------------------------

    def step_name(self, run_id: str, attempt: int) -> str:
        return f"{self.prefix}.{run_id}.a{attempt}"

    def start(self, spec: LaunchSpec) -> str:
        job = load_alloc(spec.allocation_info)["job"] if spec.allocation_info else None
        if job is None:
            raise LaunchError("the run holds no Slurm allocation")
        nodes_info = self.state.nodes() or {}
        order = list(nodes_info)
        nodes = sorted(spec.nodes, key=lambda n: order.index(n) if n in order else len(order))
        first = nodes_info.get(nodes[0])
        master_addr = first.addr if first else nodes[0]
        local = master_addr in ("127.0.0.1", "localhost")
        port = _free_port() if local else _port_for(spec.run_id, spec.attempt)
        name = self.step_name(spec.run_id, spec.attempt)
        step = Step(nnodes=len(nodes), nproc_per_node=spec.ranks_per_node, master_addr=master_addr,
                    master_port=port, rdzv_id=rdzv_id(spec.run_id, spec.attempt))
        req = StepRequest(job_id=job, step_name=name, nodes=tuple(nodes), ranks_per_node=spec.ranks_per_node,
                          argv=spec.argv, log_dir=spec.log_dir, cwd=spec.cwd, extra=spec.srun_args,
                          launch=spec.launch, step=step)
        env = step_env(spec.env, step, ranks_per_node=spec.ranks_per_node, launch=spec.launch,
                       marker=spec.marker)
        if spec.trusted_dir is None:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
        with user_files.directory(spec.log_base, spec.log_dir, create=True):
            pass  # made, or found, without following a link below the daemon's own directory
        run_as = users.for_launch(spec.user)
        env |= users.login_env(run_as)
        agents = self._start_agents(req, env, spec, run_as) if env.get("TSUP_MQTT_URL") else None
        if agents is not None:
            env[NODE_AGENT_ENV] = "1"  # the agents report the nodes' slots (trainer/telemetry.py)
        agent_info = {"agent_step": req.step_name + AGENT_SUFFIX, "agent_pid": agents.pid} if agents else {}
        warm = self.standbys.take(spec, job, nodes)
        self.standbys.plan(spec, job)
        if warm is not None:
            return self._start_warm(spec, job, warm, nodes, step, env, agent_info)
        try:
            p = self.commands.start_step(srun_argv(req), env=env, log_path=spec.log_dir / "srun.log",
                                         user=run_as, log_base=spec.log_base)
        except ValueError as e:
            # Popen cannot pass it (a NUL byte in an argument or a variable): no retry will.
            raise CannotExecute(f"cannot start srun for {spec.argv[0]!r}: {e}") from e
        except OSError as e:
            raise LaunchError(f"cannot start srun: {e}") from e
        self._children[p.pid] = p
        ranks = _rank_map(nodes, spec.ranks_per_node)
        self.state.refresh()
        return json.dumps({"job": job, "step": name, "uid": _uid_of(run_as), "srun_pid": p.pid,
                           "srun_ct": start_time_of(p.pid), "ranks": ranks,
                           "log": str(spec.log_dir / "srun.log"), "ranks_per_task": _ranks_per_task(spec),
                           **agent_info})

    def _start_warm(self, spec: LaunchSpec, job: str, gens: list[Generation], nodes: list[str], step: Step,
                    env: dict[str, str], agent_info: dict[str, Any]) -> str:
        """The attempt as the standbys of its nodes (``gens``, one step a node, in the order
        of ``nodes``)."""
        parts = self.standbys.hand_over(spec, gens, nodes, list(step.fill_all(spec.argv)), env)
        for g in gens:
            self._children[g.proc.pid] = g.proc
        log.info("%s: attempt %d on the standbys of %s", spec.run_id, spec.attempt, ", ".join(nodes))
        return json.dumps({"job": job, "step": parts[0]["step"], "uid": gens[0].uid,
                           "ranks": _rank_map(nodes, spec.ranks_per_node), "parts": parts, "warm": True,
                           **agent_info})

    def _start_agents(self, req: StepRequest, env: dict[str, str], spec: LaunchSpec,
                      run_as: users.RunAs | None) -> subprocess.Popen[bytes] | None:
        """The attempt's node agents' step (None, logged, when srun cannot be started: the
        trainer runs without them, as before there were any)."""
        agent_req = replace(req, step_name=req.step_name + AGENT_SUFFIX)
        try:
            p = self.commands.start_step(agent_srun_argv(agent_req, sys.executable), env=env,
                                         log_path=spec.log_dir / "srun-agent.log", user=run_as,
                                         log_base=spec.log_base)
        except (OSError, ValueError) as e:
            log.warning("%s: cannot start the node agents: %s", req.step_name, e)
            return None
        self._children[p.pid] = p
        return p

    def find(self, spec: LaunchSpec) -> str | None:
        """A step of this attempt that exists but was never recorded (the daemon died
        between starting srun and writing it down)."""
        name = self.step_name(spec.run_id, spec.attempt)
        job = load_alloc(spec.allocation_info)["job"] if spec.allocation_info else None
        if job is None:
            return None  # no allocation: no step of this attempt can have started
        try:
            uid = _uid_of(users.for_launch(spec.user))
        except LaunchError:
            return None  # the run's user is gone from this host: starting again says so
        srun = find_srun(name, job, uid)
        step = _own_step(self.state.steps() or [], job, name, uid)
        if srun is None and step is None:
            return None
        nodes = list(step.nodes) if step else list(spec.nodes)
        ranks = _rank_map(nodes, spec.ranks_per_node)
        return json.dumps({"job": job, "step": name, "uid": uid, "srun_pid": srun.pid if srun else 0,
                           "srun_ct": start_time_of(srun.pid) if srun else 0.0, "ranks": ranks,
                           "log": str(spec.log_dir / "srun.log"), "ranks_per_task": _ranks_per_task(spec)})

    def observe(self, launch_info: str) -> list[RankProc]:
        info = json.loads(launch_info)
        self.standbys.refill()
        ranks: list[tuple[int, str]] = [(int(r), str(n)) for r, n in info["ranks"]]
        per_task = int(info.get("ranks_per_task", 1))
        states: dict[int, tuple[ProcState, int | None]] = {}
        for part in steps_of(info):
            by_task = task_exits(Path(part["log"]))
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
                step_listed = None if steps is None else _own_step(steps, info["job"], part["step"],
                                                                    info.get("uid")) is not None
            for rank, _ in ranks:
                if mine is None or rank in mine:
                    states[rank] = rank_state(exits.get(rank), srun_code, srun_alive, step_listed,
                                               failed_named=bool(exits))
        return [RankProc(rank=rank, node=node, proc=states[rank][0], exit_code=states[rank][1])
                for rank, node in ranks]

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
            step = self._step_id(info, part["step"])
            if step is not None:
                signal_name = "KILL" if force else "TERM"
                self.commands.fire(["scancel", *_only_of(info.get("uid")), f"--signal={signal_name}", step])
            _, alive = self._srun_state(part)
            if alive:
                # srun forwards SIGTERM to every task; two SIGINTs within a second make it
                # kill the step (when the step id was not known yet).
                with contextlib.suppress(ProcessLookupError):
                    if force and step is None:
                        os.kill(int(part["srun_pid"]), signal.SIGINT)
                        os.kill(int(part["srun_pid"]), signal.SIGINT)
                    elif not force:
                        os.kill(int(part["srun_pid"]), signal.SIGTERM)

    def _step_id(self, info: dict[str, Any], name: str) -> str | None:
        s = _own_step(self.state.steps() or [], info["job"], name, info.get("uid"))
        return f"{s.job_id}.{s.step_id}" if s else None

    def forget(self, launch_info: str) -> None:
        info = json.loads(launch_info)
        self._stop_agents(info)
        for part in steps_of(info):
            pid = int(part["srun_pid"])
            child = self._children.get(pid)
            if child is not None and child.poll() is not None:
                del self._children[pid]

    def _stop_agents(self, info: dict[str, Any]) -> None:
        """The attempt is over: its node agents go (SIGTERM through our srun, which passes it
        to every agent; and scancel of their step, for one a restarted daemon adopted)."""
        name = info.get("agent_step")
        if not name:
            return
        child = self._children.pop(int(info.get("agent_pid", 0)), None)
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        step = _own_step(self.state.steps() or [], info["job"], name, info.get("uid"))
        if step is not None:
            self.commands.fire(["scancel", *_only_of(info.get("uid")), f"{step.job_id}.{step.step_id}"])


# --- helpers ---------------------------------------------------------------------------


def _ranks_per_task(spec: LaunchSpec) -> int:
    return spec.ranks_per_node if spec.launch == "node" else 1


def _rank_map(nodes: list[str], ranks_per_node: int) -> list[list[int | str]]:
    """[rank, node] pairs: Slurm's block distribution over the nodes in its own order."""
    return [[k * ranks_per_node + i, n] for k, n in enumerate(nodes) for i in range(ranks_per_node)]


def load_alloc(info: str | None) -> dict[str, Any]:
    """A run's allocation_info: the job id (None: none submitted), the allocation's
    sequence number, and the uid that owns it (None: recorded before owners were)."""
    if not info:
        return {"job": None, "seq": 0, "uid": None}
    d = json.loads(info)
    uid = d.get("uid")
    return {"job": d.get("job"), "seq": int(d.get("seq", 0)), "uid": int(uid) if uid is not None else None}


def _dump_alloc(job: str | None, seq: int, uid: int | None) -> str:
    return json.dumps({"job": job, "seq": seq, "uid": uid})


def _uid_of(owner: users.RunAs | None) -> int:
    """The uid whose jobs, steps and srun processes a launch makes: the run's user, or
    the daemon's own."""
    return owner.uid if owner is not None else os.geteuid()


def _only_of(uid: int | None) -> list[str]:
    """scancel's filter: given job or step ids, it signals only those of this owner."""
    return [f"--user={uid}"] if uid is not None else []


def _recorded(jobs: dict[str, parse.JobInfo], alloc: dict[str, Any]) -> parse.JobInfo | None:
    """The allocation's job as squeue lists it; None when it is not listed, or when
    squeue names another owner for its id."""
    job = jobs.get(alloc["job"]) if alloc["job"] else None
    if job is None or job.user_id is None:
        return job
    return job if job.owned_by(alloc["uid"]) else None


def _own_step(steps: list[parse.StepInfo], job: str | None, name: str,
              uid: int | None) -> parse.StepInfo | None:
    """The attempt's step: named ``name``, in the allocation ``job``, and ``uid``'s
    (where squeue names an owner); another user's step of that name is not."""
    return next((s for s in steps if s.job_id == job and s.name == name
                 and (s.user_id is None or s.owned_by(uid))), None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_for(run_id: str, attempt: int) -> int:
    """A rendezvous port on the first node, spread over 20000-29999 by run and attempt."""
    return 20000 + int(hashlib.sha256(f"{run_id}.{attempt}".encode()).hexdigest(), 16) % 10000
