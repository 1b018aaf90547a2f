"""How the supervisor drives a run's trainer: the reference trainer (trainer/README.md is
the contract) or a plain command from the spec's [command] table.

Per run:     <run_dir>/checkpoints/           the trainer's checkpoint.dir (unless the spec sets one)
             <run_dir>/output/result.json     written by rank 0 after a successful finish
Per attempt: <run_dir>/attempts/<n>/trainer.json   the trainer config of that attempt
             <run_dir>/attempts/<n>/rank-*.log     each rank's output

The daemon never imports the trainer (it would import torch): configs are checked by
running ``python -m trainer --check-config``, which imports no torch.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pwd
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from supervisor import user_files
from supervisor.domain import TrainerResult
from supervisor.domain.step import DEFERRED, LaunchMode, readable
from supervisor.errors import SpecError
from supervisor.node_env import accelerator_env
from supervisor.planning import TIER_MEMORY, first_auto_every_steps
from supervisor.runfiles.user_tree import Tree, TreeStalled
from supervisor.spec import RunSpec
from wire import neuron_launch
from wire.files import FENCE_FILE, RESULT_FILE

CHECK_TIMEOUT_S = 60.0


def checkpoint_dir(spec: RunSpec, run_dir: Path) -> Path:
    if spec.command is not None:
        return Path(spec.command.checkpoint_dir.format(run_dir=run_dir))
    assert spec.trainer is not None
    ck = spec.trainer.get("checkpoint", {})
    return Path(ck["dir"]) if "dir" in ck else run_dir / "checkpoints"


def checkpoint_layout(spec: RunSpec) -> str | None:
    """The layout to look for (supervisor/runfiles/checkpoint_scan.py); None: any. The reference
    trainer's Neuron backend writes NxD's (trainer/neuron/checkpoints.py)."""
    if spec.command is not None:
        return spec.command.checkpoint_layout
    return "nxd" if spec.neuron_backend else "tsup"


def curves(spec: RunSpec, run_id: str, run_dir: Path, job_id: str | None) -> tuple[str | None, str | None]:
    """Where the run's own curves are: (a TensorBoard logdir, a link), from the spec's
    [curves]; absent, the reference trainer's TensorBoard directory, or NxD Training's
    per-job one (exp_manager's log directory, its version named after $SLURM_JOB_ID) for
    the "nemo" layout. A value that needs ``{job_id}`` is None until the run has a job."""
    tensorboard = spec.curves.tensorboard
    if tensorboard is None and spec.trainer is not None:
        output = spec.trainer.get("output_dir", str(run_dir / "output"))
        tensorboard = str(spec.trainer.get("tensorboard_dir") or Path(output) / "tensorboard")
    elif tensorboard is None and spec.command is not None and spec.command.checkpoint_layout == "nemo":
        tensorboard = "{checkpoint_dir}/{job_id}"
    names = {"run_id": run_id, "run_dir": str(run_dir), "checkpoint_dir": str(checkpoint_dir(spec, run_dir))}

    def filled(template: str | None) -> str | None:
        if template is None or (job_id is None and "{job_id}" in template):
            return None
        return template.format(**names, job_id=job_id or "")

    return filled(tensorboard), filled(spec.curves.url)


def result_path(spec: RunSpec, run_dir: Path) -> Path | None:
    """Where the reference trainer writes its result; None for a [command] trainer."""
    if spec.trainer is None:
        return None
    return Path(spec.trainer.get("output_dir", run_dir / "output")) / RESULT_FILE


def trainer_config(spec: RunSpec, run_dir: Path, every_steps: int | None = None,
                   memory_every_steps: int | None = None) -> dict[str, Any]:
    """The spec's [trainer] table with the run's own paths filled in, and the checkpoint
    intervals when the spec left them to the supervisor (``every_steps`` and
    ``memory_every_steps``; before one was decided, the first attempt's)."""
    assert spec.trainer is not None
    path = result_path(spec, run_dir)
    assert path is not None
    config = copy.deepcopy(spec.trainer)
    checkpoint = config.setdefault("checkpoint", {})
    checkpoint["dir"] = str(checkpoint_dir(spec, run_dir))
    if spec.auto_checkpoints:
        checkpoint["every_steps"] = every_steps or first_auto_every_steps(spec.total_steps)
    if spec.auto_memory_checkpoints:
        checkpoint["memory_every_steps"] = memory_every_steps or first_auto_every_steps(spec.total_steps,
                                                                                        TIER_MEMORY)
    config["output_dir"] = str(path.parent)
    return config


def attempt_dir(run_dir: Path, attempt: int) -> Path:
    return run_dir / "attempts" / str(attempt)


def config_path(run_dir: Path, attempt: int) -> Path:
    """The attempt's trainer config (for a [command] trainer: a record of its argv). Its
    path marks the attempt's processes (command line or TSUP_MARKER)."""
    return attempt_dir(run_dir, attempt) / "trainer.json"


def write_attempt_config(spec: RunSpec, run_dir: Path, attempt: int, argv: tuple[str, ...] = (),
                         skips: list[tuple[int, int]] | None = None, every_steps: int | None = None,
                         memory_every_steps: int | None = None) -> Path:
    """The attempt's trainer config; ``skips``: sample ranges the trainer steps over
    (data.skip, for the reference trainer; a [command] trainer is not told);
    ``every_steps``, ``memory_every_steps``: the tiers' intervals, for a spec that asked
    for ``auto``."""
    path = config_path(run_dir, attempt)
    content: dict[str, Any] = ({"command": [readable(a) for a in argv]} if spec.command is not None
                               else trainer_config(spec, run_dir, every_steps, memory_every_steps))
    if skips and spec.command is None:
        data = content.setdefault("data", {})
        data["skip"] = [list(r) for r in sorted({*map(tuple, data.get("skip", [])), *skips})]
    # The run directory's parent is the daemon's; below it, the run's user's (no link followed).
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    user_files.write_atomic(run_dir.parent, path, json.dumps(content, indent=2, sort_keys=True).encode())
    return path


def write_fence(spec: RunSpec, run_dir: Path, attempt: int, tree: Tree) -> None:
    """Tell the reference trainer's ranks which attempt is live (trainer/checkpoint_layout.py's
    FENCE_FILE), before its ranks start: a rank 0 of an earlier attempt that wakes up then
    leaves the checkpoints alone. Written by ``tree`` (supervisor/runfiles/user_tree.py: as the
    run's user, in the user's directory). Nothing for a [command] trainer, nor before the
    first save made the checkpoint directory."""
    if spec.command is not None:
        return
    ck = checkpoint_dir(spec, run_dir)
    inside = ck.is_relative_to(run_dir)
    if not inside and not tree.is_dir(ck):
        return
    tree.write_atomic(run_dir.parent if inside else ck, ck / FENCE_FILE, json.dumps({"attempt": attempt}))


def trainer_argv(config: Path, resume_from: str | None) -> tuple[str, ...]:
    return (sys.executable, "-m", "trainer", "--config", str(config), "--resume", resume_from or "none")


def neuron_trainer_argv(config: Path, resume_from: str | None) -> tuple[str, ...]:
    """The reference trainer's Neuron backend: one torchrun per node (the one beside this
    interpreter), its static rendezvous at the step's first node; the node's rank comes
    from the per-node wrapper (PET_NODE_RANK, supervisor/slurm/requests.py)."""
    program = neuron_launch.trainer_program(str(config), resume_from or "none")
    return tuple(neuron_launch.torchrun_argv(
        nnodes=DEFERRED["nnodes"], nproc_per_node=DEFERRED["nproc_per_node"],
        master_addr=DEFERRED["master_addr"], master_port=DEFERRED["master_port"], program=program,
        torchrun=str(Path(sys.executable).with_name("torchrun"))))


def _names(spec: RunSpec, run_dir: Path, skip_to_step: int = 1) -> dict[str, str]:
    """What a [command]'s placeholders stand for; the step's own are left for the launcher
    to fill in (supervisor/domain/step.py). ``skip_to_step``: the step of the data stream
    the attempt's first step reads."""
    return {"run_dir": str(run_dir), "checkpoint_dir": str(checkpoint_dir(spec, run_dir)),
            "skip_to_step": str(skip_to_step), **DEFERRED}


def attempt_argv(spec: RunSpec, run_dir: Path, attempt: int, resume_from: str | None,
                 resume_step: int, skip_to_step: int | None = None) -> tuple[str, ...]:
    """Every rank's (or with ``launch = "node"``, every node's) command line for one
    attempt, with the step's placeholders still to fill (``Step.fill``). ``skip_to_step``:
    the step of the data stream its next step reads (None: the one after ``resume_step``)."""
    if spec.command is None:
        reference = neuron_trainer_argv if spec.neuron_backend else trainer_argv
        return reference(config_path(run_dir, attempt), resume_from)
    names = _names(spec, run_dir, resume_step + 1 if skip_to_step is None else skip_to_step)
    argv = [a.format(**names) for a in spec.command.argv]
    if resume_from is not None:
        argv += [r.format(checkpoint=resume_from, step=resume_step, **names) for r in spec.command.resume]
    return tuple(argv)


def resume_advice(spec: RunSpec) -> str:
    """What to change when the trainer did not resume from the checkpoint it was given."""
    if spec.command is not None and spec.command.checkpoint_layout == "nemo":
        # NxD Training's check_resume looks only in <exp_dir>/<name>/<version>/checkpoints (or
        # exp_manager.checkpoint_callback_params.dirpath), and its train_setup.sh names the
        # version after $SLURM_JOB_ID: in a job other than the one that saved, it finds nothing.
        return ("NxD Training and NeMo resume only from their own version directory (NxD Training's "
                "train_setup.sh names it after $SLURM_JOB_ID), and this attempt's is not the one that saved "
                "(a new Slurm job, the run's own could not be kept); set "
                "exp_manager.checkpoint_callback_params.dirpath in the job's config to one directory for all "
                "of the run's jobs, move the newest checkpoint there, then resume the run")
    return "check the spec's resume arguments (command.resume), then resume the run"


def attempt_cwd(spec: RunSpec, run_dir: Path) -> Path | None:
    """A [command] trainer's working directory (None: the launcher's own)."""
    if spec.command is None or spec.command.cwd is None:
        return None
    return Path(spec.command.cwd.format(run_dir=run_dir, checkpoint_dir=checkpoint_dir(spec, run_dir)))


def node_requirements(spec: RunSpec, run_dir: Path) -> list[str]:
    """What a [command] needs on every node, for its preflight (``python -m health
    --require``): its working directory, and its program when argv names it by a path
    (``./train.sh``). A program found on PATH, and the reference trainer, need only the
    supervisor's interpreter, which every probe checks first (node_health.probe_argv)."""
    if spec.command is None:
        return []
    cwd = attempt_cwd(spec, run_dir)
    program = spec.command.argv[0]
    paths = [cwd] if cwd is not None else []
    if "/" in program and "{" not in program:
        paths.append(cwd / program if cwd is not None else Path(program))
    return [str(p) for p in paths]


def launch_mode(spec: RunSpec) -> LaunchMode:
    if spec.command is not None:
        return spec.command.launch
    return "node" if spec.neuron_backend else "rank"


def attempt_srun_args(spec: RunSpec) -> tuple[str, ...]:
    return tuple(spec.command.srun_args) if spec.command is not None else ()


# The Neuron compile cache, on each node's own disk (Neuron's default place): compiles of
# many nodes at once contend for a shared file system's locks. A spec's env may say otherwise.
# One per user: a compiled graph from another user's cache is code run on our devices. It
# follows the run onto the nodes that join it through a copy in the run's directory
# (node/compile_cache.py), which the node wrapper syncs with it before each attempt.
NEURON_COMPILE_CACHE = "/var/tmp/neuron-compile-cache-{uid}"  # noqa: S108 (a cache path handed to Neuron)


def run_uid(spec: RunSpec) -> int:
    """The uid the run's ranks execute as (its spec's user, resolved at submit)."""
    return pwd.getpwnam(spec.user).pw_uid if spec.user else os.geteuid()


def memory_dir(run_dir: Path, uid: int) -> Path:
    """The run's directory for the reference trainer's memory tier on every node
    (trainer/memory_tier.py adds the node's name): node-local memory, one per run, below a
    directory of the run's user's own (which the trainer makes 0700 and checks)."""
    key = hashlib.sha256(str(run_dir.absolute()).encode()).hexdigest()[:16]
    shm = Path("/dev/shm")  # noqa: S108 (a directory of the user's own, named by its uid)
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"tsup-memory-{uid}" / key


def attempt_ids(run_id: str, attempt: int) -> dict[str, str]:
    """The variables that tell a rank which run and attempt it belongs to."""
    return {"TSUP_RUN_ID": run_id, "TSUP_ATTEMPT": str(attempt)}


def attempt_env(spec: RunSpec, run_dir: Path, skip_to_step: int = 1, *,
                precompile: bool = False) -> dict[str, str]:
    """The variables every rank of an attempt gets beyond the launcher's and the run's ids:
    the accelerators' (supervisor/node_env.py), then the trainer's, then a [command]'s own
    (``skip_to_step``: the step of the data stream its next step reads), and for its
    precompile pass (``precompile``) its ``precompile_env`` over them."""
    uid = run_uid(spec)
    env = {"NEURON_COMPILE_CACHE_URL": NEURON_COMPILE_CACHE.format(uid=uid),
           **accelerator_env(spec.resources.accelerator)}
    if spec.command is None:
        env["TSUP_TELEMETRY_AGGREGATE"] = spec.telemetry.aggregate
        if not spec.neuron_backend:  # the memory tier is the torch backend's
            env["TSUP_MEMORY_DIR"] = str(memory_dir(run_dir, uid))
        if spec.chaos:
            env |= {"TSUP_FAULT": ",".join(spec.chaos), "TSUP_FAULT_STATE": str(run_dir / "chaos-fired")}
        return env | shared_compile_cache(spec, run_dir, env, uid)
    names = _names(spec, run_dir, skip_to_step)
    env["TSUP_SKIP_TO_STEP"] = names["skip_to_step"]
    env |= {k: v.format(**names) for k, v in spec.command.env.items()}
    if precompile:
        env |= {k: v.format(**names) for k, v in spec.command.precompile_env.items()}
    return env | shared_compile_cache(spec, run_dir, env, uid)


def shared_compile_cache(spec: RunSpec, run_dir: Path, env: dict[str, str], uid: int) -> dict[str, str]:
    """A Neuron job whose compile cache is the node-local one this module hands out (to
    ``uid``): the run's shared copy for the node wrapper to sync it with
    (node/compile_cache.py), and the interpreter that runs the sync. Nothing where the
    spec's env names its own cache (a shared directory, an S3 URL: it is already the same
    on every node)."""
    local = NEURON_COMPILE_CACHE.format(uid=uid)
    if spec.resources.accelerator != "neuron" or env.get("NEURON_COMPILE_CACHE_URL") != local:
        return {}
    shared = run_dir / neuron_launch.SHARED_COMPILE_CACHE_DIR
    return {"TSUP_COMPILE_CACHE_SHARED": str(shared), "TSUP_PYTHON": sys.executable}


def check_trainer_config(spec: RunSpec, run_dir: Path) -> None:
    """Raise SpecError naming every bad key of the spec's [trainer] table."""
    if spec.trainer is None:
        return  # a [command] trainer checks its own arguments
    with tempfile.TemporaryDirectory(prefix="tsup-check-") as tmp:
        path = Path(tmp) / "trainer.json"
        path.write_text(json.dumps(trainer_config(spec, run_dir)))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "trainer", "--check-config", str(path)],
                capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SpecError(f"cannot check the trainer config: {e}") from e
    if proc.returncode == 0:
        return
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    if proc.returncode == 2 and lines:
        raise SpecError("; ".join(f"[trainer] {ln}" for ln in lines))
    raise SpecError(f"trainer config check failed (exit {proc.returncode}): {' '.join(lines)[-500:]}")


RESULT_MAX_BYTES = 1 << 16


def read_result(path: Path | None, run_id: str, attempt: int, tree: Tree) -> TrainerResult | None:
    """The trainer's result.json for this very attempt (read by ``tree``: as the run's
    user), or None.

    A result written by another run or attempt (a shared output_dir, a stale file)
    is no proof that this attempt succeeded.
    """
    if path is None:
        return None
    try:
        data = json.loads(tree.read_text(path, RESULT_MAX_BYTES))
        if data.get("run_id") != run_id or data.get("attempt") != attempt:
            return None
        return TrainerResult(final_step=int(data["final_step"]), model_digest=str(data["model_digest"]))
    except TreeStalled:
        raise  # not an answer: asked again next tick
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
