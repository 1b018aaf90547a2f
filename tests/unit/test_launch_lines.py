"""The launch lines ``supervisorctl submit --dry-run`` prints for the two example specs:
16 x trn1.32xlarge running the reference trainer's Neuron backend (one torchrun per
node, 32 ranks each, the seeds' NxD environment) and 4 x p5.48xlarge running the FSDP
test case's train.py under torchrun (the FSDP test case's EFA and NCCL environment);
and that the Slurm launcher hands a real step that same environment. No Slurm."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from cli.ctl import main
from supervisor.launchers.base import LaunchSpec
from supervisor.runfiles import trainer_cmd
from supervisor.slurm.launcher import SlurmLauncher
from supervisor.slurm.requests import NODE_WRAPPER
from supervisor.spec import load_spec
from tests.conftest import REPO

TRN1 = REPO / "examples" / "trn1-16-nxd.toml"
P5 = REPO / "examples" / "p5-4-torchrun.toml"
NEURON_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
              "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS": "3", "NEURON_FUSE_SOFTMAX": "1",
              "MALLOC_ARENA_MAX": "128",
              "NEURON_CC_FLAGS": "--model-type=transformer --distribution-strategy=llm-training"}
NVIDIA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_HUGE_PAGE": "0", "FI_EFA_SET_CUDA_SYNC_MEMOPS": "0",
              "NCCL_SOCKET_IFNAME": "^docker,lo,veth", "NCCL_DEBUG": "INFO",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def dry_run(spec: Path, *extra: str, tmp_path: Path) -> str:
    """``supervisorctl submit SPEC --dry-run`` with no daemon anywhere."""
    out = io.StringIO()
    env = {"HOME": str(tmp_path), "TSUP_URL": "http://127.0.0.1:9"}  # nothing listens there
    with redirect_stdout(out):
        assert main(["submit", str(spec), "--dry-run", *extra], environ=env) == 0
    return out.getvalue()


def plan_of(spec: Path, tmp_path: Path) -> dict[str, Any]:
    plan: dict[str, Any] = json.loads(dry_run(spec, "--json", tmp_path=tmp_path))
    return plan


def trainer_part(srun: list[str]) -> list[str]:
    """What the per-node wrapper execs: the argv after ``sh -c WRAPPER tsup-rank``."""
    return srun[srun.index("tsup-rank") + 1:]


def test_trn1_allocation_holds_16_whole_nodes_and_a_spare(tmp_path: Path) -> None:
    sbatch = plan_of(TRN1, tmp_path)["sbatch"]
    assert {"--nodes=16-17", "--exclusive", "--no-kill", "--requeue", "--time=10080"} <= set(sbatch)
    # torchrun dies of SIGUSR1: the Neuron backend gets no time-limit signal
    assert not any(a.startswith("--signal") for a in sbatch)


def test_trn1_step_is_one_torchrun_of_32_ranks_per_node(tmp_path: Path) -> None:
    plan = plan_of(TRN1, tmp_path)
    srun = plan["srun"]
    assert {"--nodes=16", "--ntasks=16", "--ntasks-per-node=1", "--overlap"} <= set(srun)
    assert srun[srun.index("-c") + 1] == NODE_WRAPPER and 'PET_NODE_RANK="$GROUP_RANK"' in NODE_WRAPPER
    argv = trainer_part(srun)
    assert Path(argv[0]).name == "torchrun"
    assert argv[1:5] == ["--nproc_per_node=32", "--nnodes=16", "--master_addr=<address of the first node>",
                         "--master_port=<port>"]
    assert argv[5:] == ["-m", "trainer", "--config", "<state-dir>/runs/run-N/attempts/1/trainer.json",
                        "--resume", "none"]


def test_trn1_step_environment_is_the_seeds_nxd_one(tmp_path: Path) -> None:
    env = plan_of(TRN1, tmp_path)["srun_env"]
    assert NEURON_ENV.items() <= env.items()
    assert env["WORLD_SIZE"] == "512" and env["LOCAL_WORLD_SIZE"] == "32"
    assert env["MASTER_ADDR"] == "<address of the first node>"
    assert env["NEURON_COMPILE_CACHE_URL"] == f"/var/tmp/neuron-compile-cache-{os.geteuid()}"


def test_p5_step_is_the_users_torchrun_of_8_ranks_per_node(tmp_path: Path) -> None:
    plan = plan_of(P5, tmp_path)
    assert {"--nodes=4-5", "--exclusive"} <= set(plan["sbatch"])
    srun = plan["srun"]
    assert {"--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "-l"} <= set(srun)
    argv = trainer_part(srun)
    torchrun = "/fsx/awsome-distributed-training/3.test_cases/pytorch/FSDP/env/bin/torchrun"
    assert argv[:6] == [torchrun, "--nproc_per_node=8", "--nnodes=4", "--rdzv_id=run-N.a1",
                        "--rdzv_backend=c10d", "--rdzv_endpoint=<address of the first node>:<port>"]
    assert argv[6].endswith("3.test_cases/pytorch/FSDP/src/train.py")
    env = plan["srun_env"]
    assert NVIDIA_ENV.items() <= env.items()
    assert env["WORLD_SIZE"] == "32" and env["HF_HUB_ETAG_TIMEOUT"] == "60"  # the spec's own env too
    assert not {"FI_EFA_USE_DEVICE_RDMA", "NEURON_CC_FLAGS"} & env.keys()


@pytest.mark.parametrize("spec", [TRN1, P5])
def test_the_printed_srun_line_pastes_back_into_the_same_env_and_argv(spec: Path, tmp_path: Path) -> None:
    plan = plan_of(spec, tmp_path)
    text = dry_run(spec, tmp_path=tmp_path)
    step = text[text.index("--export=ALL, Slurm's default)\n") + len("--export=ALL, Slurm's default)\n"):]
    words = shlex.split(step.replace("\\\n", ""))  # the shell drops a backslash-newline
    assignments = dict(w.split("=", 1) for w in words[:words.index("srun")])
    assert assignments == plan["srun_env"]
    assert words[words.index("srun"):] == plan["srun"]


def test_a_spec_without_an_accelerator_gets_no_interconnect_environment(tmp_path: Path) -> None:
    spec = load_spec(REPO / "examples" / "tiny-llama.toml")
    env = trainer_cmd.attempt_env(spec, tmp_path)
    assert not {"FI_PROVIDER", "NCCL_DEBUG", "NEURON_CC_FLAGS"} & env.keys()


# --- the real launch path -------------------------------------------------------------------


class _Commands:
    """SlurmCommands' step start, recorded instead of run."""

    def __init__(self) -> None:
        self.started: list[tuple[list[str], dict[str, str]]] = []

    def start_step(self, argv: list[str], *, env: dict[str, str], log_path: Path, user: object,
                   log_base: Path | None = None) -> Any:
        self.started.append((list(argv), dict(env)))
        return subprocess.Popen([sys.executable, "-c", "pass"])


class _State:
    def nodes(self) -> dict[str, Any]:
        return {}

    def jobs(self) -> dict[str, Any]:
        return {}

    def refresh(self) -> None:
        pass


def test_the_slurm_launcher_hands_a_step_the_accelerator_environment(tmp_path: Path) -> None:
    spec = load_spec(TRN1)
    commands = _Commands()
    launcher = SlurmLauncher(commands, _State(), state_dir=tmp_path)  # type: ignore[arg-type]
    nodes = tuple(f"trn{k}" for k in range(1, 17))
    launcher.start(LaunchSpec(
        run_id="run-3", attempt=2, nodes=nodes, ranks_per_node=32,
        argv=trainer_cmd.attempt_argv(spec, tmp_path, 2, None, 0), env=trainer_cmd.attempt_env(spec, tmp_path),
        log_dir=tmp_path / "logs", marker="m", allocation_info=json.dumps({"job": "77", "seq": 1}),
        launch=trainer_cmd.launch_mode(spec)))
    [(argv, env)] = commands.started
    assert NEURON_ENV.items() <= env.items()
    assert env["WORLD_SIZE"] == "512" and env["MASTER_ADDR"] == "trn1"
    assert {"--jobid=77", "--nodes=16", "--ntasks=16", "--ntasks-per-node=1"} <= set(argv)
    torchrun = trainer_part(argv)
    assert torchrun[1:4] == ["--nproc_per_node=32", "--nnodes=16", "--master_addr=trn1"]
    assert torchrun[4] == f"--master_port={env['MASTER_PORT']}"


def test_the_node_wrapper_gives_torchrun_its_node_rank(tmp_path: Path) -> None:
    probe = "import os; print(os.environ['PET_NODE_RANK'], os.environ['NODE_RANK'])"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_NODEID": "5", "SLURMD_NODENAME": "trn6"}
    done = subprocess.run(["/bin/sh", "-c", NODE_WRAPPER, "tsup-rank", sys.executable, "-c", probe], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["5", "5"]


# The seeds' NxD Training jobs, as their documents give them (the lines quoted as they are).
# Seed 003 (SageMaker HyperPod, Llama 3 8B with NxD Training), submit-llama8b.sh:
SEED_003_8B = """#!/bin/bash
#SBATCH -N 1
#SBATCH --exclusive
#SBATCH -o llama.out

export OMP_NUM_THREADS=1
export COMPILE=0
export CONF_FILE=hf_llama3_8B_config

srun ./train.sh"""
# Seed 000 (awsome-distributed-training, "Scale up"), the 16-node training job:
SEED_000_70B = """#!/bin/bash
#SBATCH -N 16
#SBATCH --exclusive
#SBATCH -o llama_train.out

export OMP_NUM_THREADS=1

export COMPILE=0
export CONF_FILE=hf_llama3_70B_config

srun ./train.sh"""
# ... and the compile job it submits first, once:
SEED_000_70B_COMPILE = """#!/bin/bash
#SBATCH -N 16
#SBATCH --exclusive
#SBATCH -o llama_compile.out

export OMP_NUM_THREADS=1

export COMPILE=1
export CONF_FILE=hf_llama3_70B_config

srun ./train.sh"""
TRAIN_SH_DIR = "/fsx/ubuntu/training_artifacts/neuronx-distributed-training/examples"


@pytest.mark.parametrize(("example", "seed", "spares", "stage"), [
    ("nxdt-llama3-8b-hyperpod.toml", SEED_003_8B, 0, "train"),
    ("nxdt-llama3-70b-trn1.toml", SEED_000_70B, 1, "train"),
    ("nxdt-llama3-70b-trn1.toml", SEED_000_70B_COMPILE, 1, "precompile"),
])
def test_an_nxd_training_example_is_the_seeds_job_line_for_line(example: str, seed: str, spares: int, stage: str,
                                                                tmp_path: Path) -> None:
    """The training job's lines are every attempt's step; the compile job's, the precompile
    pass's step (the run's first attempt)."""
    plan = plan_of(REPO / "examples" / example, tmp_path)
    sbatch = plan["sbatch"]
    srun, env = (plan["srun"], plan["srun_env"]) if stage == "train" else \
        (plan["precompile"]["srun"], plan["precompile"]["srun_env"])
    for line in seed.splitlines():
        if line in ("", "#!/bin/bash"):
            continue
        if line.startswith("#SBATCH -N "):  # the nodes it trains on, and the supervisor's hot spares
            n = int(line.split()[-1])
            assert (f"--nodes={n}" if spares == 0 else f"--nodes={n}-{n + spares}") in sbatch, sbatch
        elif line == "#SBATCH --exclusive":
            assert "--exclusive" in sbatch
        elif line.startswith("#SBATCH -o "):  # the output: each node's file, read by `supervisorctl logs`
            assert any(a.startswith("--output=") and a.endswith("/node-%t.log") for a in srun), srun
        elif line.startswith("export "):
            name, value = line.removeprefix("export ").split("=", 1)
            assert env[name] == value, (name, env.get(name))
        elif line.startswith("srun "):  # one task per node, the user's script as it is, in its directory
            assert trainer_part(srun) == line.split()[1:]
            assert {"--ntasks-per-node=1", f"--chdir={TRAIN_SH_DIR}"} <= set(srun)
        else:
            raise AssertionError(f"a line of the seed this test does not check: {line!r}")


def test_the_p5_examples_torchrun_is_the_test_cases_venvs_and_the_preflight_checks_it(tmp_path: Path) -> None:
    """Under the unit's PATH no venv is activated: a bare `torchrun` was not found and the
    first launch failed "cannot execute", with nothing said earlier."""
    from supervisor.runfiles import trainer_cmd
    from supervisor.spec import load_spec

    spec = load_spec(P5)
    assert spec.health.preflight
    assert trainer_cmd.node_requirements(spec, tmp_path) == [
        "/fsx/awsome-distributed-training/3.test_cases/pytorch/FSDP/env/bin/torchrun"]
