"""The seeds' NxD Training jobs on the Slurm box, run by their example specs.

examples/nxdt-llama3-70b-trn1.toml (seed 000) and examples/nxdt-llama3-8b-hyperpod.toml
(seed 003) run ``srun ./train.sh`` in NxD Training's examples directory with
``CONF_FILE`` and ``COMPILE``; here that directory is the stand-in of
tests/standins/nxdt/ (train.sh and train_setup.sh as NxD Training ships them, bar what
the box cannot do; a training_orchestrator.py that prints Lightning's progress bar,
compiles into its node's own cache, and saves and resumes as NxD Training does: every
rank its shard, the newest save of its own Slurm job's version directory by mtime). The
specs are the examples' own at the box's size (2 ranks a node, the 70B job on 2 nodes
and its spare, the 8B job on 1 and none, as they ship), and each box node has a /var/tmp
of its own, so that a node that joins a run starts with an empty compile cache.

Each run precompiles once (COMPILE=1, the run's first attempt; its trial save set
aside), then trains, and recovers from what each scenario injects, losses beyond the
spares included, in the same Slurm job; it ends with the weights of a run that never
failed, and no training attempt compiled a graph: the pass had, and the nodes that
joined took its graphs from the run's shared copy.
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
JOBS = {  # example -> (its CONF_FILE, nodes an attempt trains on, on the box)
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
    """The example spec at the box's size (its spares as it ships them), its cwd the
    stand-in's examples directory; (the spec, that directory)."""
    examples = examples_dir(tmp_path)
    data = tomllib.loads((REPO / "examples" / example).read_text())
    command = dict(data["command"])
    argv = command.pop("argv")
    env = {**command.pop("env"),
           # the stand-ins' neuron_parallel_compile and torchrun, as a Neuron host has them on PATH
           "PATH": f"{examples / 'bin'}:{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
           "GLOO_SOCKET_IFNAME": "eth0", "TSUP_STANDIN_COMPILE_S": "1",
           "STANDIN_FINAL_WEIGHTS": str(tmp_path / "final.pt")}
    command |= {"cwd": str(examples), "checkpoint_dir": str(examples / "nemo_experiments" / "hf_llama"),
                "env": env}
    resources = {**data["resources"], "nodes": nodes, "ranks_per_node": RANKS_PER_NODE}
    spec = command_spec(tmp_path / "spec.toml", data["name"], argv, resources=resources,
                        policy={"hang_floor_s": 10, "hang_timeout_s": 120}, **command)
    return spec, examples


def compiles(run_dir: Path, attempt: int) -> dict[str, int]:
    """The graphs each node of an attempt compiled, by node log: the stand-in's compiler
    lines (one per graph a node compiles itself)."""
    return {p.name: p.read_text(errors="replace").count("||NEURON_CC_WRAPPER||: Call compiler")
            for p in sorted((run_dir / "attempts" / str(attempt)).glob("node-*.log"))}


def said(run_dir: Path, attempt: int) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "attempts" / str(attempt)).glob("node-*.log"))


def caches_empty(box: Box) -> None:
    """No node has a compiled graph on its own disk before the run."""
    for node in box.nodes:
        assert not list(box.var_tmp(node).rglob("*.neff")), f"{node}'s compile cache is not empty"


def assert_recovered(s: dict[str, Any], run_dir: Path, examples: Path, expected: dict[str, Any],
                     final: Path) -> list[int]:
    """SUCCEEDED, the pass first and once; each training attempt after a fault resumed from
    a save no older than the one before the fault's step (a save cut short by the kill may
    leave the one before it), its first step the one after, and compiled nothing; the
    weights of the run that never failed. The attempts' resume steps."""
    assert s["state"] == "SUCCEEDED", (s, what_happened(s, run_dir))
    history = s["attempt_history"]
    assert [a["precompile"] for a in history] == [True] + [False] * (len(history) - 1), "the pass ran once, first"
    resumed = [a["resume_step"] for a in history[1:]]
    assert resumed[0] == 0 and resumed == sorted(resumed), resumed
    for fault, step in zip(s["faults"], resumed[1:], strict=True):
        assert step % 10 == 0 and fault["step"] - 20 < step <= fault["step"], (fault, step)
    state = run_dir.parent.parent
    firsts = dict(db_rows(state, "SELECT attempt, first_step FROM attempt_stats WHERE steps > 0"))
    assert firsts == {n: step + 1 for n, step in enumerate(resumed, start=2)}, \
        "each training attempt went on after its checkpoint; the pass's steps are not the run's"
    assert "compiling only run" in said(run_dir, 1) and "Total failed compilations: 0" in said(run_dir, 1)
    for attempt in range(2, len(history) + 1):
        assert not any(compiles(run_dir, attempt).values()), f"attempt {attempt} compiled: {compiles(run_dir, attempt)}"
    # The pass's trial save (step 10, zeros) was set aside; the run never resumed from it.
    aside = list((examples / "nemo_experiments" / "hf_llama" / ".set-aside" / "precompile-1").glob("*/checkpoints/*"))
    assert [p.name.split("--")[1].split("-")[0] for p in aside] == ["step=10"], aside
    assert_same_weights(final, expected)
    return resumed


def test_the_70b_job_recovers_onto_its_spare_and_past_it_in_the_same_job_compiling_nothing_again(
        slurm_box4: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/nxdt-llama3-70b-trn1.toml at the box's size: 2 nodes and its spare of a
    4-node box. A killed rank; node1 lost (onto the spare, node3); a hung rank (once 20
    steps timed the adaptive limit); node2 lost, a loss beyond the spares: the job is
    requeued, its id kept, and goes on on node3 and node4. node3 and node4 started with
    empty compile caches and compiled nothing."""
    config, nodes = JOBS["nxdt-llama3-70b-trn1.toml"]
    expected = never_failed(config, nodes * RANKS_PER_NODE, tmp_path / "never-failed")
    monkeypatch.setenv("SLURM_CONF", str(slurm_box4.conf))
    spec, examples = nxdt_spec("nxdt-llama3-70b-trn1.toml", tmp_path / "run", nodes)
    caches_empty(slurm_box4)
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-rank@12:3", "--chaos", "kill-node@25:0",
                "--chaos", "hang-rank@45:0", "--chaos", "kill-node@55:0", timeout_s=540)
    s = summary_of(proc)
    run_dir = state / "runs" / "run-1"
    assert [f["kind"] for f in s["faults"]] == ["rank-exit", "node-lost", "hang", "node-lost"], \
        what_happened(s, run_dir)
    assert [f["nodes"] for f in s["faults"] if f["kind"] == "node-lost"] == [["node1"], ["node2"]]
    assert sorted(s["drained_nodes"]) == ["node1", "node2"]
    history = s["attempt_history"]
    assert [a["nodes"] for a in history[3:]] == [["node2", "node3"], ["node2", "node3"], ["node3", "node4"]]
    assert_recovered(s, run_dir, examples, expected, tmp_path / "run" / "final.pt")
    # One Slurm job throughout: train_setup.sh's logs/<job id>/<restart count>/ say which.
    logs = examples / "logs"
    [job] = [p.name for p in logs.iterdir()]
    assert sorted(p.name for p in (logs / job).iterdir()) == ["0", "1"], "requeued once, its id kept"
    assert [p.name for p in (examples / "nemo_experiments" / "hf_llama").iterdir() if p.name != ".set-aside"] \
        == [job], "one version directory: every attempt found the checkpoints of the one before"
    assert "taken from" in said(run_dir, 4) and "taken from" in said(run_dir, 6)


def test_the_8b_job_as_shipped_loses_its_only_node_and_goes_on_in_the_same_job_on_another(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/nxdt-llama3-8b-hyperpod.toml as it ships: one node, no spare. Its node
    killed at step 25 is a lost node (blamed and drained, not a hang); the job is requeued,
    its id kept, onto another node whose compile cache was empty; NxD Training finds the
    checkpoint of step 20 in the job's version directory, and the run ends with the
    weights of a run that never failed."""
    config, nodes = JOBS["nxdt-llama3-8b-hyperpod.toml"]
    expected = never_failed(config, nodes * RANKS_PER_NODE, tmp_path / "never-failed")
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    spec, examples = nxdt_spec("nxdt-llama3-8b-hyperpod.toml", tmp_path / "run", nodes)
    caches_empty(slurm_box)
    state = tmp_path / "state"
    s = summary_of(tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-node@25", timeout_s=480))
    run_dir = state / "runs" / "run-1"
    [lost] = s["faults"]
    assert lost["kind"] == "node-lost" and lost["nodes"] == ["node1"], what_happened(s, run_dir)
    assert s["drained_nodes"] == ["node1"]
    history = s["attempt_history"]
    assert [a["nodes"] for a in history] == [["node1"], ["node1"], ["node2"]]
    assert assert_recovered(s, run_dir, examples, expected, tmp_path / "run" / "final.pt") == [0, 20]
    logs = examples / "logs"
    [job] = [p.name for p in logs.iterdir()]
    assert sorted(p.name for p in (logs / job).iterdir()) == ["0", "1"], "requeued once, its id kept"
    assert "taken from" in said(run_dir, 3)
