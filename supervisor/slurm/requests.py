"""Pure builders: the sbatch request that holds a run's nodes, and the srun of a step.

A run of N nodes with S spares holds one allocation of N+S whole nodes (``--exclusive``)
whose batch script only sleeps; the trainer runs as a job step (``srun --jobid``) on N
of them. A failed step is followed by a new step in the same allocation, on the healthy
nodes plus spares: no queue wait. ``supervisorctl submit --dry-run`` prints both.

Choices, and why:

- ``--nodes=N-(N+S)``: the job starts as soon as N nodes are free and takes up to N+S;
  after drains on a small cluster, a run can go on without its spares.
- ``--no-kill``: when a node of the allocation fails, Slurm shrinks the job instead of
  ending it, so the steps that follow can use the nodes that are left.
- ``--requeue``: a run goes on in the same job when it needs new nodes (its nodes lost
  beyond its spares, a pause past ``pause_release_s``, a resume after it failed, a time
  limit): the supervisor requeues it, so that ``$SLURM_JOB_ID`` stays what the users'
  trainers key their checkpoints and logs on (NxD Training's version directory) and
  ``$SLURM_RESTART_COUNT`` counts (supervisor/slurm/allocation.py). Slurm itself requeues
  such a job whose only node failed; the supervisor takes it from there the same way.
- ``--signal=USR1@S`` (with a time limit, and only for a trainer that handles SIGUSR1:
  the reference trainer, or a ``[command]`` with ``handles_usr1 = true``): S seconds
  before the limit every step gets SIGUSR1, and the reference trainer saves a checkpoint
  at its next step. SIGUSR1's default action ends a process: a user's torchrun or bash
  script would die of it, so it gets no signal.
- ``--overlap`` on steps: a step stopped because one of its nodes died stays "running"
  in Slurm until the node is declared down (up to SlurmdTimeout); the next step must not
  wait for its CPUs. The supervisor itself keeps one trainer step per allocation.
- Ranks get the torchrun environment from Slurm's by a fixed ``sh -c`` wrapper on the
  node; the trainer's argv is passed as arguments, never pasted into shell text. The
  wrapper also makes the job-wide Slurm variables describe the step: inside a step,
  ``SLURM_JOB_NODELIST`` is the whole allocation (spares and drained nodes included), so
  a script taking its master from it would point outside the step.
- ``launch = "node"`` (a ``[command]`` whose torchrun or ``train.sh`` spawns the ranks):
  one task per node, with GROUP_RANK and NODE_RANK set and the same view of the step;
  the step placeholders (``{master_addr}``, ``{nnodes}``, ...) are filled in here, by
  ``srun_argv``, for the real step and the dry run alike.
- A Neuron job's node wrapper first brings the node's compile cache level with the run's
  shared copy (node/compile_cache.py): a spare, a replacement or a requeued job's
  node compiles no graph the run already has.
- A ``[command]``'s ``cwd`` is the step's ``--chdir``; its ``srun_args`` (``-l``,
  ``--container-image=...``) go before the wrapper, after the supervisor's own options.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.domain.step import LaunchMode, Step

# Inside a step the job-wide variables describe the whole allocation; these make them
# describe the step's own nodes (or, for a part of an attempt split over two jobs, the
# attempt's: ``SplitPart``).
_STEP_VIEW = (
    'SLURM_JOB_NODELIST="${TSUP_STEP_NODES:-${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}}" '
    'SLURM_NODELIST="${TSUP_STEP_NODES:-${SLURM_STEP_NODELIST:-$SLURM_NODELIST}}" '
    'SLURM_JOB_NUM_NODES="${TSUP_STEP_NNODES:-${SLURM_STEP_NUM_NODES:-$SLURM_JOB_NUM_NODES}}" '
    'SLURM_NNODES="${TSUP_STEP_NNODES:-${SLURM_STEP_NUM_NODES:-$SLURM_NNODES}}"'
)
# A part's tasks write their own log, named by their place in the attempt (srun's
# --output can only name the part's task).
_PART_LOG = '[ -z "$TSUP_TASK_LOGS" ] || exec >>"$TSUP_TASK_LOGS/{name}.log" 2>&1; '
# Sets the torchrun variables from Slurm's, then runs the trainer's argv unchanged.
RANK_WRAPPER = (
    'export RANK="$((SLURM_PROCID + ${TSUP_RANK_BASE:-0}))" LOCAL_RANK="$SLURM_LOCALID" '
    'WORLD_SIZE="${TSUP_STEP_NTASKS:-$SLURM_NTASKS}" GROUP_RANK="$((SLURM_NODEID + ${TSUP_NODE_BASE:-0}))" '
    f'TSUP_NODE="$SLURMD_NODENAME" {_STEP_VIEW}; ' + _PART_LOG.format(name="rank-$RANK") + 'exec "$@"'
)
# A Neuron job's compile cache: the node's own, first filled from the run's shared copy
# (and the copy from it), before the trainer starts (node/compile_cache.py).
# A node cache that is not the run's user's own (another user made it first) ends the
# task before the trainer starts (the sync's exit status 3, UNSAFE).
_COMPILE_CACHE = ('[ -z "$TSUP_COMPILE_CACHE_SHARED" ] || { "$TSUP_PYTHON" -m node.compile_cache '
                  '"$TSUP_COMPILE_CACHE_SHARED" "$NEURON_COMPILE_CACHE_URL"; [ $? -ne 3 ] || exit 3; }; ')
# launch = "node": one task per node, whose torchrun (or train.sh) spawns the ranks.
# torchrun takes --node_rank from PET_NODE_RANK when its command line gives none: a
# static rendezvous (--master_addr/--master_port, the NxD scripts' form) needs it, and
# the same argv then runs on every node. Other rendezvous ignore it.
NODE_WRAPPER = (
    'export GROUP_RANK="$((SLURM_NODEID + ${TSUP_NODE_BASE:-0}))"; '
    f'export NODE_RANK="$GROUP_RANK" PET_NODE_RANK="$GROUP_RANK" TSUP_NODE="$SLURMD_NODENAME" {_STEP_VIEW}; '
    + _PART_LOG.format(name="node-$GROUP_RANK") + _COMPILE_CACHE + 'exec "$@"'
)
# srun options a [command] may not give: the supervisor sets them for every step.
SUPERVISOR_SRUN_OPTIONS = (
    "--jobid", "--job-name", "-J", "--nodes", "-N", "--nodelist", "-w", "--ntasks", "-n", "--ntasks-per-node",
    "--distribution", "-m", "--overlap", "--kill-on-bad-exit", "-K", "--output", "-o", "--chdir", "-D",
    "--exclude", "-x",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SbatchRequest:
    job_name: str  # unique per run and allocation: how a restarted daemon finds the job
    nodes: int  # attempt nodes plus spares
    min_nodes: int  # an attempt's nodes: the job may start with only these
    partition: str | None = None
    time_limit_min: int | None = None
    signal_before_s: int | None = 120  # None: no --signal (the trainer does not handle SIGUSR1)
    exclude: tuple[str, ...] = ()
    output: Path = Path("/dev/null")
    workdir: Path | None = None
    extra: tuple[str, ...] = field(default=())  # site flags from the spec (--account=..., --qos=...)


def sbatch_argv(req: SbatchRequest) -> list[str]:
    nodes = f"{req.min_nodes}-{req.nodes}" if req.min_nodes < req.nodes else str(req.nodes)
    argv = ["sbatch", "--parsable", f"--job-name={req.job_name}", f"--nodes={nodes}",
            "--exclusive",
            "--no-kill", "--requeue", f"--output={req.output}"]
    if req.partition:
        argv.append(f"--partition={req.partition}")
    if req.time_limit_min is not None:
        argv.append(f"--time={req.time_limit_min}")
        if req.signal_before_s is not None:
            argv.append(f"--signal=USR1@{req.signal_before_s}")
    if req.exclude:
        argv.append(f"--exclude={','.join(sorted(req.exclude))}")
    if req.workdir is not None:
        argv.append(f"--chdir={req.workdir}")
    argv.extend(req.extra)
    return argv


def allocation_script(req: SbatchRequest) -> str:
    """The batch script: it only holds the nodes; the trainer runs as steps."""
    return (
        "#!/bin/sh\n"
        f"# training-supervisor allocation {req.job_name}: {req.nodes} node(s) held for job steps\n"
        "# (srun --jobid=$SLURM_JOB_ID); requeued for new nodes, cancelled when the run ends.\n"
        "exec sleep infinity\n"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRequest:
    job_id: str
    step_name: str  # unique per attempt: how a restarted daemon finds the step
    nodes: tuple[str, ...]
    ranks_per_node: int
    argv: tuple[str, ...]
    log_dir: Path
    cwd: Path | None = None  # the tasks' working directory (None: srun's own)
    extra: tuple[str, ...] = ()  # the spec's srun_args
    launch: LaunchMode = "rank"  # "node": one task per node
    step: Step | None = None  # fills the step placeholders of argv (supervisor/domain/step.py)
    part: bool = False  # one job's part of an attempt split over two: its tasks write their own logs


def split_env(attempt_nodes: Sequence[str], first_node: int, tasks_per_node: int,
              log_dir: Path) -> dict[str, str]:
    """The variables that place one job's part of an attempt split over two jobs (a run
    grown back through a second allocation, supervisor/slurm/allocation.py) in the
    attempt, for the wrappers: a step cannot span jobs, so each job runs a step on its
    own nodes, whose tasks Slurm numbers from 0. ``first_node``: the part's first node's
    index among ``attempt_nodes``; the tasks' logs go to ``log_dir`` under their rank
    (or node) in the attempt."""
    return {"TSUP_RANK_BASE": str(first_node * tasks_per_node), "TSUP_NODE_BASE": str(first_node),
            "TSUP_STEP_NODES": ",".join(attempt_nodes), "TSUP_STEP_NNODES": str(len(attempt_nodes)),
            "TSUP_STEP_NTASKS": str(len(attempt_nodes) * tasks_per_node), "TSUP_TASK_LOGS": str(log_dir)}


def srun_argv(req: StepRequest) -> list[str]:
    per_node = 1 if req.launch == "node" else req.ranks_per_node
    argv = req.step.fill_all(req.argv) if req.step is not None else req.argv
    wrapper, output = (NODE_WRAPPER, "node-%t.log") if req.launch == "node" else (RANK_WRAPPER, "rank-%t.log")
    output = "/dev/null" if req.part else f"{req.log_dir}/{output}"
    return [
        "srun", f"--jobid={req.job_id}", f"--job-name={req.step_name}", f"--nodes={len(req.nodes)}",
        f"--nodelist={','.join(req.nodes)}", f"--ntasks={len(req.nodes) * per_node}",
        f"--ntasks-per-node={per_node}", "--distribution=block", "--overlap",
        "--kill-on-bad-exit=0", f"--output={output}",
        *([f"--chdir={req.cwd}"] if req.cwd is not None else []), *req.extra,
        "/bin/sh", "-c", wrapper, "tsup-rank", *argv,
    ]


AGENT_MODULE = "node.agent"


def agent_srun_argv(req: StepRequest, python: str) -> list[str]:
    """The attempt's node agents (node/agent.py) as a step of their own: one task on
    each of the attempt's nodes, overlapping the trainer's step, run by ``python`` (the
    config's node_python, else the daemon's interpreter at the same path on every node),
    output in ``agent-<task>.log``."""
    return [
        "srun", f"--jobid={req.job_id}", f"--job-name={req.step_name}", f"--nodes={len(req.nodes)}",
        f"--nodelist={','.join(req.nodes)}", f"--ntasks={len(req.nodes)}", "--ntasks-per-node=1",
        "--distribution=block", "--overlap", "--kill-on-bad-exit=0",
        f"--output={req.log_dir}/agent-{'%j-' if req.part else ''}%t.log",
        "--chdir=/", python, "-m", AGENT_MODULE,
    ]


def standby_srun_argv(req: StepRequest, python: str, label: str) -> list[str]:
    """Warm standbys (supervisor/slurm/standby.py) as a step of their own: one ``python -m
    trainer --standby`` task per rank slot of ``req.nodes`` (one node, as the launcher asks
    for them), overlapping the attempt's steps. ``--input=all``: the line written to
    srun's input reaches every task. Their output, until an assignment sends it to a
    rank's log, goes to ``s<N>-<task>.log``."""
    per_node = req.ranks_per_node
    return [
        "srun", f"--jobid={req.job_id}", f"--job-name={req.step_name}", f"--nodes={len(req.nodes)}",
        f"--nodelist={','.join(req.nodes)}", f"--ntasks={len(req.nodes) * per_node}",
        f"--ntasks-per-node={per_node}", "--distribution=block", "--overlap", "--kill-on-bad-exit=0",
        "--input=all", f"--output={req.log_dir}/{req.step_name.rsplit('.', 1)[-1]}-%t.log",
        *([f"--chdir={req.cwd}"] if req.cwd is not None else []), *req.extra,
        python, "-m", "trainer", "--standby", label,
    ]


def step_env(env: Mapping[str, str], step: Step, *, ranks_per_node: int, launch: LaunchMode,
             marker: str) -> dict[str, str]:
    """srun's environment for a step beyond its own: the attempt's ``env`` (its step
    placeholders filled) and the rendezvous. srun hands its environment to every task
    (``--export=ALL``, Slurm's default), so this is what the ranks see."""
    # Defaults a spec's env may change (one CPU thread a rank; output unbuffered, so that
    # the logs show a step when it happens), then the attempt's, then the rendezvous.
    out = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **{k: step.fill(v) for k, v in env.items()},
           "MASTER_ADDR": step.master_addr, "MASTER_PORT": str(step.master_port),
           "LOCAL_WORLD_SIZE": str(ranks_per_node), "TSUP_MARKER": marker}
    if launch == "node":  # the ranks' world, for the node's torchrun (the task count is the nodes')
        out["WORLD_SIZE"] = str(step.world_size)
    return out


def describe(argv: Sequence[str], env: Mapping[str, str] | None = None, *, one_per_line: bool = False) -> str:
    """A copy-pasteable command line (for --dry-run and logs only, never executed);
    ``one_per_line``: each variable on a line of its own, continued with a backslash."""
    words = [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
    words.append(" ".join(shlex.quote(a) for a in argv))
    return (" \\\n" if one_per_line else " ").join(words)


def dry_run(*, job_name: str, nodes: int, spares: int, ranks_per_node: int, argv: Sequence[str],
            partition: str | None, time_limit_min: int | None, log_dir: Path,
            handles_usr1: bool, cwd: Path | None = None, srun_args: Sequence[str] = (),
            launch: LaunchMode = "rank", rdzv_id: str = "<rdzv id>",
            env: Mapping[str, str] | None = None) -> dict[str, object]:
    """What a run would ask of Slurm, before any node is known: the allocation request,
    its batch script, and the srun of the first step with the environment srun passes on
    (``<...>`` marks what Slurm decides)."""
    rendezvous = Step(nnodes=nodes, nproc_per_node=ranks_per_node, master_addr="<address of the first node>",
                      master_port="<port>", rdzv_id=rdzv_id)
    sreq = SbatchRequest(job_name=job_name, nodes=nodes + spares, min_nodes=nodes, partition=partition,
                         time_limit_min=time_limit_min, output=log_dir / "alloc.out",
                         signal_before_s=120 if handles_usr1 else None)
    step = StepRequest(job_id="<allocation job id>", step_name=job_name.rsplit(".", 1)[0] + ".a1",
                       nodes=tuple(f"<node {k + 1} of the allocation>" for k in range(nodes)),
                       ranks_per_node=ranks_per_node, argv=tuple(argv), log_dir=log_dir / "attempts" / "1",
                       cwd=cwd, extra=tuple(srun_args), launch=launch, step=rendezvous)
    srun_env = step_env(env or {}, rendezvous, ranks_per_node=ranks_per_node, launch=launch,
                        marker=str(log_dir / "attempts" / "1" / "trainer.json"))
    return {"sbatch": sbatch_argv(sreq), "batch_script": allocation_script(sreq), "srun": srun_argv(step),
            "srun_env": srun_env}
