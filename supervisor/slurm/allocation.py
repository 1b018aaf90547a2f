"""A run's nodes on Slurm: the allocation that holds them, and the ones it grows by.

- A run holds one batch job of N+S whole nodes (``--nodes=N-(N+S)``: it starts as soon
  as N are free) whose script only sleeps, submitted as the run's user. Its id and owner
  are recorded (``allocation_info``), and from then on the job is known by that id
  alone. Its name, ``<prefix>.<run>.<k>``, is derived from what the store already holds,
  so a daemon killed between ``sbatch`` and recording the id finds the job by name and
  never submits a second one; but squeue lists every user's jobs and anyone can name a
  job so, so only a job of the expected owner is ever adopted by name.
- **A run keeps its job.** The users' trainers key their checkpoints and logs on
  ``$SLURM_JOB_ID`` (NxD Training's ``train_setup.sh`` names exp_manager's version
  directory after it and resumes only from there), so a run that needs new nodes goes on
  in the same job rather than in a new one: when the job holds fewer healthy nodes than
  the run needs (losses beyond its spares), or ended while Slurm still knows it (a time
  limit, a preemption; ``MinJobAge``), it is requeued; a paused or failed run ``park``s
  it, requeued and held (no node, its place kept), and a resume releases it.
  ``$SLURM_RESTART_COUNT`` counts the requeues (supervisor/slurm/launcher.py hands it to
  the steps). All of it runs as the job's owner: a user may do each of these to a job of
  their own. Only a job Slurm will not requeue (one submitted with ``--no-requeue``) or
  no longer knows (purged after ``MinJobAge``, cancelled by hand) is replaced by a new
  one, in which such a trainer starts from scratch (the run then stops with a
  wrong-resume fault that says what to change).
- What keeping the job costs, measured on the box (22.05): a requeued job starts again
  only once its steps have ended on every node it held, a dead node's once Slurm
  declares it down (``SlurmdTimeout``); then Slurm holds it back for the launch
  credential's lifetime (121 s), which the supervisor asks it to skip, and which stays
  where Slurm refuses updates of the job (below 24.11 without accounting storage, once a
  node failure resized it: ``_start_soon``).
- Slurm cannot add nodes to a running job. A run that may go on with fewer nodes
  (``keep``, supervisor/policy/recovery.py) and holds fewer than it asks for submits a
  **growth** job for the missing count (``<prefix>.<run>.<k>g<m>``, ``--nodes=1-M``),
  recorded beside the first; the nodes it gets are the run's like the first job's. An
  attempt on nodes of both runs a step in each (supervisor/slurm/launcher.py). A growth
  job that holds nothing usable any more is cancelled; a new first job cancels them all.
- ``held``: the jobs as squeue sees them, minus nodes Slurm calls unusable. A failed
  poll means "unknown", never "ended"; a recorded id that squeue shows owned by someone
  else (ids start again after slurmctld loses its state) means "gone"; an ended job
  squeue still lists is kept, to be requeued.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from supervisor import users
from supervisor.errors import LaunchError, SpecError
from supervisor.launchers.base import AllocationRequest, Grant, Parked
from supervisor.slurm import parse
from supervisor.slurm.commands import Reply, SlurmCommands
from supervisor.slurm.requests import SbatchRequest, allocation_script, sbatch_argv
from supervisor.slurm.state import SlurmState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Alloc:
    """A run's allocation_info: the first job's id (None: none submitted), its sequence
    number, the uid that owns the run's jobs (None: recorded before owners were), and the
    growth jobs with how many were ever submitted beside this first job."""

    job: str | None = None
    seq: int = 0
    uid: int | None = None
    grow: tuple[str, ...] = ()
    grown: int = 0
    requeued: bool = False  # the first job was requeued (or parked) and has not held nodes since
    hurried: int | None = None  # the first job's restart count whose begin time was asked to be now

    @classmethod
    def load(cls, info: str | None) -> Alloc:
        if not info:
            return cls()
        d = json.loads(info)
        uid, hurried = d.get("uid"), d.get("hurried")
        return cls(job=d.get("job"), seq=int(d.get("seq", 0)), uid=int(uid) if uid is not None else None,
                   grow=tuple(str(j) for j in d.get("grow", ())), grown=int(d.get("grown", 0)),
                   requeued=bool(d.get("requeued", False)),
                   hurried=int(hurried) if hurried is not None else None)

    def dump(self) -> str:
        d: dict[str, object] = {"job": self.job, "seq": self.seq, "uid": self.uid}
        if self.grown:
            d |= {"grow": list(self.grow), "grown": self.grown}
        if self.requeued:
            d["requeued"] = True
        if self.hurried is not None:
            d["hurried"] = self.hurried
        return json.dumps(d)

    @property
    def jobs(self) -> tuple[str, ...]:
        """Every job of the run, the first one first."""
        return (self.job, *self.grow) if self.job else self.grow


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmOptions:
    partition: str | None = None
    time_limit_min: int | None = None
    signal_before_s: int = 120
    sbatch_extra: tuple[str, ...] = ()


class SlurmAllocations:
    def __init__(self, commands: SlurmCommands, state: SlurmState, *, prefix: str, state_dir: Path,
                 options: SlurmOptions, before_requeue: Callable[[str], None] = lambda job: None) -> None:
        self.commands = commands
        self.before_requeue = before_requeue  # told the job's id just before it is requeued
        self.state = state
        self.prefix = prefix
        self.state_dir = state_dir
        self.options = options
        # When each job was requeued (the state's clock): until Slurm has answered every
        # poll since, what the supervisor knows of it is from before the requeue.
        self._requeued_at: dict[str, float] = {}

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
        alloc = Alloc.load(req.info)
        if alloc.job in self._requeued_at:
            # An answer asked before the requeue still shows the job running on the nodes it
            # had: requeued again on that word, the job would restart twice, the second
            # time under the attempt that the first restart began.
            if not self.state.answered_since(self._requeued_at[alloc.job]):
                return Grant(nodes=(), info=req.info,
                             note=f"job {alloc.job} requeued: waiting for squeue to say so")
            del self._requeued_at[alloc.job]
        jobs = self.state.jobs()
        if jobs is None:
            return Grant(nodes=req.held, info=req.info, note="squeue failed; trying again")
        job = recorded(jobs, alloc.job, alloc.uid)
        if job is not None and job.phase is parse.JobPhase.HOLDING:
            alloc = replace(alloc, requeued=False)  # started again (if it had been requeued)
            have = self._usable(job.nodes, req.drained)
            if len(have) >= (req.keep or req.minimum):
                return self._grow(req, alloc, jobs, have)
            log.info("allocation %s holds %d healthy nodes, %d needed: requeueing it",
                     job.job_id, len(have), req.keep or req.minimum)
        try:
            owner = users.for_launch(req.user)
        except LaunchError as e:  # the run's user is gone from this host: say why, and wait
            return Grant(nodes=(), info=req.info, note=str(e))
        if job is not None and (job.phase is parse.JobPhase.WAITING or (alloc.requeued and job.finishing)):
            alloc, note = self._start_soon(alloc, job, owner)
            return Grant(nodes=(), info=alloc.dump(), note=note)
        if job is not None:  # too few healthy nodes left in it, or ended while Slurm still knows it
            requeued = self._requeue(alloc, job, owner)
            if requeued is not None:
                return Grant(nodes=(), info=requeued.dump(),
                             note=f"job {job.job_id} requeued (its id kept) for {req.count} node(s)")
            if job.phase is parse.JobPhase.HOLDING:  # Slurm will not requeue it: a new job replaces it
                self.commands.fire(["scancel", *only_of(alloc.uid), job.job_id])
        if alloc.grow:  # a new first job asks for every node: the growth jobs go
            self.commands.fire(["scancel", *only_of(alloc.uid), *alloc.grow])
        seq = alloc.seq + 1 if alloc.job else max(alloc.seq, 1)
        uid = uid_of(owner)
        job_id, done = self._submit(self.sbatch_request(req, seq), jobs, owner, uid)
        info = Alloc(job_id, seq, uid).dump()
        if job_id is None:
            return Grant(nodes=(), info=info, note=done)
        if done == "adopted":
            return self.held(req.run_id, info) or Grant(nodes=(), info=info)
        return Grant(nodes=(), info=info, note=f"job {job_id} submitted")

    def _requeue(self, alloc: Alloc, job: parse.JobInfo, owner: users.RunAs | None, *,
                 hold: bool = False) -> Alloc | None:
        """Put the run's job back in the queue, its id kept (``hold``: held, until
        ``_start_soon`` releases it); the allocation_info to record, or None when Slurm
        refuses (a job submitted with --no-requeue). A requeue needs no update of the
        job, which Slurm refuses for good once it resized a job (below 24.11, without
        accounting storage: its db_index is never set again), as it does to a --no-kill
        job when a node of it fails."""
        self.before_requeue(job.job_id)
        reply = self._owners(owner, ["scontrol", "requeuehold" if hold else "requeue", job.job_id])
        if not reply.ok and "pending" not in reply.why:  # Slurm requeued it already (a node failed)
            log.warning("cannot requeue allocation %s: %s", job.job_id, reply.why)
            return None
        self._requeued_at[job.job_id] = self.state.clock()
        if alloc.grow:  # the first job will ask for every node again: the growth jobs go
            self.commands.fire(["scancel", *only_of(alloc.uid), *alloc.grow])
        self.state.refresh()
        log.info("requeued allocation %s%s, its id kept", job.job_id, " (held)" if hold else "")
        return replace(alloc, grow=(), requeued=True)

    def _start_soon(self, alloc: Alloc, job: parse.JobInfo, owner: users.RunAs | None) -> tuple[Alloc, str]:
        """A queued job of the run's, which the run wants to train in: (what to record,
        what it waits for).

        - Still ending its steps on the nodes it held (a dead node's end comes once Slurm
          declares it down, SlurmdTimeout): waited for.
        - Held by its owner (parked, or requeued held): released. Where Slurm refuses (a
          job it resized, above), it is cancelled and requeued instead, which needs no
          update.
        - Requeued, pending: Slurm may delay a requeued job by the launch credential's
          lifetime (22.05: 121 s) so that its new credential is newer than the old one's
          revocation, which it is a tick later, and its scheduler may first look at it
          only at its next pass (up to ``sched_interval``, or backfill's 30 s: 23 s on the
          box); it is asked once a requeue to start now, an update that also wakes the
          scheduler (fired, not awaited: a resized job's update blocks slurmctld's reply
          for 5 s and is refused), and otherwise starts when Slurm gets to it."""
        if job.finishing:
            return alloc, (f"job {job.job_id} requeued: Slurm is ending its steps on the nodes it held "
                           "(a dead node's once Slurm declares it down)")
        if job.held_by_owner:
            if self._owners(owner, ["scontrol", "release", job.job_id]).ok:
                self.state.refresh()
                return alloc, f"job {job.job_id} released"
            self._owners(owner, ["scancel", job.job_id])
            requeued = self._requeue(alloc, job, owner)
            if requeued is None:
                return alloc, f"job {job.job_id} held, and Slurm would neither release nor requeue it"
            return requeued, f"job {job.job_id} cancelled and requeued (Slurm would not release it)"
        restarts = job.restarts or 0
        if (restarts > 0 or alloc.requeued) and alloc.hurried != restarts:
            self.commands.fire(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], user=owner)
            return replace(alloc, hurried=restarts), f"job {job.job_id} requeued: asked to start now"
        return alloc, f"job {job.job_id} pending: {job.reason}"

    def _owners(self, owner: users.RunAs | None, argv: list[str]) -> Reply:
        """A command about the run's own job, as its owner: what a user may do with a job
        of their own needs no operator's rights."""
        return self.commands.run(argv, user=owner)

    def _grow(self, req: AllocationRequest, alloc: Alloc, jobs: dict[str, parse.JobInfo],
              have: tuple[str, ...]) -> Grant:
        """The first job holds enough to keep: add what the growth jobs hold, and when the
        run may go on with fewer nodes (``req.keep``) and still has fewer than it asks for,
        ask for the rest in a growth job (one at a time)."""
        kept: list[str] = []
        nodes = list(have)
        waiting: parse.JobInfo | None = None
        for job_id in alloc.grow:
            job = recorded(jobs, job_id, alloc.uid)
            if job is None or job.phase is parse.JobPhase.ENDED:
                continue
            if job.phase is parse.JobPhase.WAITING:
                waiting = job
            else:
                usable = self._usable(job.nodes, req.drained)
                if not usable:  # holds nothing the run can use: give it back
                    self.commands.fire(["scancel", *only_of(alloc.uid), job_id])
                    log.info("growth allocation %s holds no usable node: cancelled", job_id)
                    continue
                nodes += usable
            kept.append(job_id)
        alloc = replace(alloc, grow=tuple(kept))
        missing = req.count - len(nodes)
        if waiting is not None and missing <= 0:  # no longer needed
            self.commands.fire(["scancel", *only_of(alloc.uid), waiting.job_id])
            alloc = replace(alloc, grow=tuple(j for j in kept if j != waiting.job_id))
        if req.keep is None or missing <= 0:
            return Grant(nodes=tuple(nodes), info=alloc.dump())
        if waiting is not None:
            return Grant(nodes=tuple(nodes), info=alloc.dump(),
                         note=f"growth job {waiting.job_id} pending: {waiting.reason}")
        try:
            owner = users.for_launch(req.user)
        except LaunchError as e:
            return Grant(nodes=tuple(nodes), info=alloc.dump(), note=str(e))
        number = alloc.grown + 1
        name = f"{req.run_id}.{alloc.seq}g{number}"
        sreq = replace(self.sbatch_request(req, alloc.seq), job_name=f"{self.prefix}.{name}", nodes=missing,
                       min_nodes=1, output=self.state_dir / "slurm" / f"{name}.out")
        growth, done = self._submit(sreq, jobs, owner, uid_of(owner))
        if growth is None:
            return Grant(nodes=tuple(nodes), info=alloc.dump(), note=done)
        grown = replace(alloc, grow=(*alloc.grow, growth), grown=number)
        return Grant(nodes=tuple(nodes), info=grown.dump(),
                     note=f"growth job {growth} {done} for {missing} more node(s)")

    def _submit(self, sreq: SbatchRequest, jobs: dict[str, parse.JobInfo], owner: users.RunAs | None,
                uid: int) -> tuple[str | None, str]:
        """sbatch ``sreq`` as ``owner``: (the job id, "submitted" or "adopted"), or (None,
        why not). A job of its name may exist already, submitted by a daemon that died
        before recording its id: it is adopted rather than a second one submitted, if it
        is the owner's (anyone can name a job so)."""
        found = [j for j in jobs.values() if j.name == sreq.job_name and j.phase is not parse.JobPhase.ENDED
                 and j.owned_by(uid)]
        if found:
            log.info("adopted allocation %s (%s)", found[0].job_id, sreq.job_name)
            return found[0].job_id, "adopted"
        if owner is not None and not owner.is_me:
            # The batch script only sleeps, and the daemon's private state directory is
            # no place the run's user may write: its output goes nowhere.
            sreq = replace(sreq, output=Path("/dev/null"))
        sreq.output.parent.mkdir(parents=True, exist_ok=True)
        reply = self.commands.run(sbatch_argv(sreq), stdin=allocation_script(sreq), user=owner)
        if not reply.ok:
            return None, f"sbatch failed: {reply.why}"
        try:
            job_id = parse.parse_sbatch_job_id(reply.stdout)
        except parse.SlurmParseError as e:
            return None, str(e)
        self.state.refresh()
        log.info("submitted allocation %s (%s) for %d nodes", job_id, sreq.job_name, sreq.nodes)
        return job_id, "submitted"

    def held(self, run_id: str, info: str | None) -> Grant | None:
        if info is None:
            return None
        alloc = Alloc.load(info)
        if alloc.job is None:
            return None  # nothing submitted yet: allocate() deals with it
        jobs = self.state.jobs()
        if jobs is None:
            return None
        job = recorded(jobs, alloc.job, alloc.uid)
        if job is None:
            why = "no longer in squeue" if alloc.job not in jobs else "now someone else's"
            return Grant(nodes=(), info=replace(alloc, job=None).dump(), note=f"job {alloc.job} {why}")
        if job.phase is parse.JobPhase.ENDED:  # Slurm still knows it: allocate() requeues it, its id kept
            return Grant(nodes=(), info=info, note=f"job {alloc.job} {job.state} ({job.reason})")
        if job.phase is parse.JobPhase.WAITING:
            return Grant(nodes=(), info=info, note=f"job {job.job_id} pending: {job.reason}")
        return Grant(nodes=tuple(node for node, _ in self.node_jobs(info, jobs)), info=info)

    def node_jobs(self, info: str | None,
                  jobs: dict[str, parse.JobInfo] | None = None) -> list[tuple[str, str]]:
        """(node, its job) for each usable node the run's jobs hold, the first job's first."""
        alloc = Alloc.load(info)
        jobs = self.state.jobs() if jobs is None else jobs
        out: list[tuple[str, str]] = []
        for job_id in alloc.jobs:
            job = recorded(jobs or {}, job_id, alloc.uid)
            if job is not None and job.phase is parse.JobPhase.HOLDING:
                out += [(node, job_id) for node in self._usable(job.nodes, frozenset())]
        return out

    def _usable(self, names: tuple[str, ...], drained: frozenset[str]) -> tuple[str, ...]:
        nodes = self.state.nodes() or {}
        return tuple(n for n in names if n not in drained and (n not in nodes or nodes[n].usable))

    def park(self, info: str | None, user: str | None) -> Parked:
        """Give the run's nodes back but keep its job, held in the queue with no node, for
        the run to go on in (``allocate`` releases it): its id, which the users' trainers
        key their checkpoints and logs on, is kept. A job Slurm will not requeue is given
        back (``release``)."""
        alloc = Alloc.load(info)
        if alloc.grow:
            self.commands.fire(["scancel", *only_of(alloc.uid), *alloc.grow])
        if alloc.job is None:
            return Parked(done=True)
        jobs = self.state.jobs()
        if jobs is None:
            return Parked(done=False)
        job = recorded(jobs, alloc.job, alloc.uid)
        if job is None:
            return Parked(done=True)  # gone, or the id is someone else's now: nothing to keep
        kept = replace(alloc, grow=(), requeued=True)  # holding no node until it starts again
        try:
            owner = users.for_launch(user)
        except LaunchError:
            return Parked(done=self.release(info))
        if job.phase is not parse.JobPhase.WAITING:
            if self._requeue(alloc, job, owner, hold=True) is not None:
                return Parked(done=True, info=kept.dump())
        elif job.held_by_owner or self._owners(owner, ["scontrol", "hold", job.job_id]).ok:
            self.state.refresh()
            return Parked(done=True, info=kept.dump())
        return Parked(done=self.release(info))

    def release(self, info: str | None) -> bool:
        alloc = Alloc.load(info)
        if alloc.grow:
            self.commands.fire(["scancel", *only_of(alloc.uid), *alloc.grow])
        job = alloc.job
        if job is None:
            return True
        jobs = self.state.jobs()
        if jobs is not None and job in jobs and recorded(jobs, job, alloc.uid) is None:
            return True  # the id is someone else's job now: ours is long gone
        # Over already (its record kept a while for a requeue), unless it is being requeued:
        # that one would start again.
        if jobs is not None and (ours := recorded(jobs, job, alloc.uid)) is not None \
                and ours.phase is parse.JobPhase.ENDED and not alloc.requeued:
            return True
        # Waited for, not fired: with slurmctld down scancel fails, and an allocation
        # forgotten then would hold its nodes until its time limit.
        reply = self.commands.run(["scancel", *only_of(alloc.uid), job])
        self.state.refresh()
        if reply.ok or "Invalid job id" in reply.why:  # already gone is given back too
            return True
        log.warning("cannot give back allocation %s yet: %s", job, reply.why)
        return False


def job_owner(info: str | None) -> users.RunAs | None:
    """Who the run's job belongs to, to start a step in it as (Slurm lets nobody else, root
    included); None: the daemon itself (its own job, none recorded, an owner gone)."""
    uid = Alloc.load(info).uid
    if uid is None or uid == os.geteuid():
        return None
    try:
        return users.lookup(pwd.getpwuid(uid).pw_name)
    except (KeyError, SpecError):
        return None


def uid_of(owner: users.RunAs | None) -> int:
    """The uid whose jobs, steps and srun processes a launch makes: the run's user, or
    the daemon's own."""
    return owner.uid if owner is not None else os.geteuid()


def check_partition(parts: dict[str, parse.PartitionInfo] | None, nodes: int, spares: int,
                    name: str | None) -> None:
    """A run of ``nodes`` and ``spares`` fits partition ``name`` (None: the cluster's
    default) of ``parts`` (None: Slurm did not list them); SpecError, naming the key, if not."""
    if parts is None:
        raise SpecError("resources: cannot list Slurm's partitions (is SLURM_CONF right?)")
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


def only_of(uid: int | None) -> list[str]:
    """scancel's filter: given job or step ids, it signals only those of this owner."""
    return [f"--user={uid}"] if uid is not None else []


def recorded(jobs: dict[str, parse.JobInfo], job_id: str | None, uid: int | None) -> parse.JobInfo | None:
    """A recorded job as squeue lists it; None when it is not listed, or when squeue
    names another owner for its id."""
    job = jobs.get(job_id) if job_id else None
    if job is None or job.user_id is None:
        return job
    return job if job.owned_by(uid) else None
