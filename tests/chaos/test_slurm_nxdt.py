"""The seeds' NxD Training jobs on the Slurm box, run by their example specs.

examples/nxdt-llama3-70b-trn1.toml (seed 000) and examples/nxdt-llama3-8b-hyperpod.toml
(seed 003) run ``srun ./train.sh`` in NxD Training's examples directory with
``CONF_FILE`` and ``COMPILE``; here that directory is the stand-in of
tests/standins/nxdt/ (train.sh and train_setup.sh as NxD Training ships them, bar what
the box cannot do; a training_orchestrator.py that prints Lightning's progress bar,
compiles, and saves NxD Training's checkpoint tree). The specs are the examples' own,
at the box's size: 2 ranks a node, the 70B job on 2 nodes, the 8B job on 1, each with a
hot spare (the tutorial's cluster has no spare node: see the example's header).

Each run precompiles once (COMPILE=1, the run's first attempt; its trial save set
aside), then trains, and recovers from a SIGKILLed rank, the loss of its first node and
a hung rank, read from the progress bar alone; it ends with the weights of a run that
never failed, and no training attempt compiled a graph: the pass had.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from slurmbox.box import Box
from tests.chaos.test_slurm import what_happened
from tests.conftest import REPO, free_port
from tests.e2e.conftest import assert_same_weights, command_spec, db_rows, summary_of, tsup

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

STANDIN = REPO / "tests" / "standins" / "nxdt"
JOBS = {  # example -> (its CONF_FILE, nodes on the box)
    "nxdt-llama3-70b-trn1.toml": ("hf_llama3_70B_config", 2),
    "nxdt-llama3-8b-hyperpod.toml": ("hf_llama3_8B_config", 1),
}
RANKS_PER_NODE = 2  # the stand-in configs' trainer.devices


def examples_dir(where: Path) -> Path:
    """A copy of the stand-in examples directory (train.sh writes its logs/ and
    nemo_experiments/ into it)."""
    examples = where / "examples"
    shutil.copytree(STANDIN, examples)
    return examples


def never_failed(config: str, world: int, work: Path) -> dict[str, Any]:
    """The stand-in's final weights from one torchrun of ``world`` ranks, no supervisor,
    no fault: each step's data depends on the step and the global rank only."""
    import torch

    examples = examples_dir(work)
    out = work / "final.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NEMO_EXPM_VERSION": "0", "STANDIN_FINAL_WEIGHTS": str(out),
           "NEURON_COMPILE_CACHE_URL": str(work / "cache")}
    done = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(world),
                           "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           "training_orchestrator.py", "--config-path=conf", f"--config-name={config}"],
                          cwd=examples, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    weights: dict[str, Any] = torch.load(out)
    return weights


def nxdt_spec(example: str, tmp_path: Path, nodes: int) -> tuple[Path, Path]:
    """The example spec at the box's size, its cwd the stand-in's examples directory;
    (the spec, that directory)."""
    examples = examples_dir(tmp_path)
    data = tomllib.loads((REPO / "examples" / example).read_text())
    command = dict(data["command"])
    argv = command.pop("argv")
    env = {**command.pop("env"),
           # the stand-ins' neuron_parallel_compile and torchrun, as a Neuron host has them on PATH
           "PATH": f"{examples / 'bin'}:{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": str(tmp_path / "home"),  # train_setup.sh's compile cache: $HOME/neuron_cache
           "GLOO_SOCKET_IFNAME": "eth0", "TSUP_STANDIN_COMPILE_S": "1",
           "STANDIN_FINAL_WEIGHTS": str(tmp_path / "final.pt")}
    command |= {"cwd": str(examples), "checkpoint_dir": str(examples / "nemo_experiments" / "hf_llama"),
                "env": env}
    resources = {**data["resources"], "nodes": nodes, "ranks_per_node": RANKS_PER_NODE, "spares": 1}
    spec = command_spec(tmp_path / "spec.toml", data["name"], argv, resources=resources,
                        policy={"hang_floor_s": 10, "hang_timeout_s": 120}, **command)
    return spec, examples


@pytest.mark.parametrize("example", sorted(JOBS))
def test_an_nxd_training_job_precompiles_once_then_recovers_from_a_killed_rank_a_lost_node_and_a_hang(
        example: str, slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, nodes = JOBS[example]
    expected = never_failed(config, nodes * RANKS_PER_NODE, tmp_path / "never-failed")
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    spec, examples = nxdt_spec(example, tmp_path / "run", nodes)
    state = tmp_path / "state"
    last_rank = nodes * RANKS_PER_NODE - 1
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", f"kill-rank@12:{last_rank}",
                "--chaos", "kill-node@25:0", "--chaos", "hang-rank@45:0", timeout_s=480)
    s = summary_of(proc)
    run_dir = state / "runs" / "run-1"
    assert s["state"] == "SUCCEEDED", (s, what_happened(s, run_dir))
    assert [f["kind"] for f in s["faults"]] == ["rank-exit", "node-lost", "hang"], what_happened(s, run_dir)
    killed, lost, _ = s["faults"]
    assert last_rank in killed["ranks"], killed
    assert lost["nodes"] == ["node1"] and s["drained_nodes"] == ["node1"], lost

    history = s["attempt_history"]
    assert [a["precompile"] for a in history] == [True, False, False, False, False], "the pass ran once, first"
    assert "node1" not in history[3]["nodes"] and "node1" not in history[4]["nodes"]
    # Each attempt after a fault resumed from a save of every 10 steps, no older than the one
    # before the fault's step (a save cut short by the kill may leave the one before it).
    resumed = [a["resume_step"] for a in history[1:]]
    assert resumed[0] == 0 and resumed == sorted(resumed), resumed
    for fault, step in zip(s["faults"], resumed[1:], strict=True):
        assert step % 10 == 0 and fault["step"] - 20 < step <= fault["step"], (fault, step)
    firsts = dict(db_rows(state, "SELECT attempt, first_step FROM attempt_stats WHERE steps > 0"))
    assert firsts == {n: step + 1 for n, step in enumerate(resumed, start=2)}, \
        "each training attempt went on after its checkpoint; the pass's steps are not the run's"

    def said(attempt: int) -> str:
        return "".join(p.read_text(errors="replace") for p in (run_dir / "attempts" / str(attempt)).glob("node-*.log"))

    assert "compiling only run" in said(1) and "||NEURON_CC_WRAPPER||: Extracting graphs" in said(1)
    assert "Total failed compilations: 0" in said(1)
    for attempt in range(2, 6):
        assert "Call compiler" not in said(attempt), f"attempt {attempt} compiled: the pass had not"
    # The pass's trial save (step 10, zeros) was set aside; the run never resumed from it.
    aside = list((examples / "nemo_experiments" / "hf_llama" / ".set-aside" / "precompile-1").glob("*/checkpoints/*"))
    assert [p.name.split("--")[1] for p in aside] == ["step=10-consumed_samples=80.0.ckpt" if nodes == 2
                                                      else "step=10-consumed_samples=40.0.ckpt"], aside
    assert_same_weights(tmp_path / "run" / "final.pt", expected)
