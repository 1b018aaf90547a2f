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
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import psutil
import pytest

from slurmbox.box import Box
from tests.chaos.test_slurm import what_happened
from tests.conftest import REPO, free_port, wait_for
from tests.e2e.conftest import (
    assert_same_weights,
    command_spec,
    db_rows,
    slurm,
    slurm_serve,
    summary_of,
    tsup,
)

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


def nxdt_spec(example: str, tmp_path: Path, nodes: int, **policy: Any) -> tuple[Path, Path]:
    """The example spec at the box's size (its spares as it ships them), its cwd the
    stand-in's examples directory, ``policy`` keys beside the box's; (the spec, that
    directory)."""
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
                        policy={"hang_floor_s": 10, "hang_timeout_s": 120, **policy}, **command)
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


def run_example(example: str, box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                *chaos: str) -> tuple[dict[str, Any], Path, Path, dict[str, Any]]:
    """``training-supervisor run`` of the example at the box's size with ``chaos``, the
    box's compile caches empty before it; (its summary, its run directory, its examples
    directory, the weights of a run that never failed)."""
    config, nodes = JOBS[example]
    expected = never_failed(config, nodes * RANKS_PER_NODE, tmp_path / "never-failed")
    monkeypatch.setenv("SLURM_CONF", str(box.conf))
    spec, examples = nxdt_spec(example, tmp_path / "run", nodes)
    caches_empty(box)
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", *(x for c in chaos for x in ("--chaos", c)),
                timeout_s=540)
    return summary_of(proc), state / "runs" / "run-1", examples, expected


def requeued_once(examples: Path) -> None:
    """One Slurm job throughout, requeued once (train_setup.sh's logs/<job id>/<restart
    count>/ say which), and one version directory: each attempt found the saves of the one
    before it."""
    logs = examples / "logs"
    [job] = [p.name for p in logs.iterdir()]
    assert sorted(p.name for p in (logs / job).iterdir()) == ["0", "1"], "requeued once, its id kept"
    assert [p.name for p in (examples / "nemo_experiments" / "hf_llama").iterdir() if p.name != ".set-aside"] \
        == [job], "one version directory"


def assert_recovered(s: dict[str, Any], run_dir: Path, examples: Path, expected: dict[str, Any]) -> list[int]:
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
    assert_same_weights(examples.parent / "final.pt", expected)  # nxdt_spec's STANDIN_FINAL_WEIGHTS
    return resumed


def test_the_70b_job_recovers_onto_its_spare_and_past_it_in_the_same_job_compiling_nothing_again(
        slurm_box4: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/nxdt-llama3-70b-trn1.toml at the box's size: 2 nodes and its spare of a
    4-node box. A killed rank; node1 lost (onto the spare, node3); a hung rank (once 20
    steps timed the adaptive limit); node2 lost, a loss beyond the spares: the job is
    requeued, its id kept, and goes on on node3 and node4. node3 and node4 started with
    empty compile caches and compiled nothing."""
    s, run_dir, examples, expected = run_example("nxdt-llama3-70b-trn1.toml", slurm_box4, tmp_path, monkeypatch,
                                       "kill-rank@12:3", "kill-node@25:0", "hang-rank@45:0", "kill-node@55:0")
    assert [f["kind"] for f in s["faults"]] == ["rank-exit", "node-lost", "hang", "node-lost"], \
        what_happened(s, run_dir)
    assert [f["nodes"] for f in s["faults"] if f["kind"] == "node-lost"] == [["node1"], ["node2"]]
    assert sorted(s["drained_nodes"]) == ["node1", "node2"]
    history = s["attempt_history"]
    assert [a["nodes"] for a in history[3:]] == [["node2", "node3"], ["node2", "node3"], ["node3", "node4"]]
    assert_recovered(s, run_dir, examples, expected)
    requeued_once(examples)
    assert "taken from" in said(run_dir, 4) and "taken from" in said(run_dir, 6)


def test_the_8b_job_as_shipped_loses_its_only_node_and_goes_on_in_the_same_job_on_another(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/nxdt-llama3-8b-hyperpod.toml as it ships: one node, no spare. Its node
    killed at step 25 is a lost node (blamed and drained, not a hang); the job is requeued,
    its id kept, onto another node whose compile cache was empty; NxD Training finds the
    checkpoint of step 20 in the job's version directory, and the run ends with the
    weights of a run that never failed."""
    s, run_dir, examples, expected = run_example("nxdt-llama3-8b-hyperpod.toml", slurm_box, tmp_path, monkeypatch,
                                       "kill-node@25")
    [lost] = s["faults"]
    assert lost["kind"] == "node-lost" and lost["nodes"] == ["node1"], what_happened(s, run_dir)
    assert s["drained_nodes"] == ["node1"]
    history = s["attempt_history"]
    assert [a["nodes"] for a in history] == [["node1"], ["node1"], ["node2"]]
    assert assert_recovered(s, run_dir, examples, expected) == [0, 20]
    requeued_once(examples)
    assert "taken from" in said(run_dir, 3)


def test_the_8b_job_paused_past_its_release_and_failed_then_fixed_goes_on_in_its_job_each_time(
        slurm_box: Box, tmp_path: Path) -> None:
    """The 8B job under the daemon, as its user drives it. Paused past `pause_release_s`:
    its node goes back, its job waits held in the queue, and `resume` goes on in that job
    from its newest checkpoint. Then its config file is moved away and a rank killed: the
    next attempt cannot find its config and the run FAILS; the file put back, `resume`
    goes on in the same job again, from its newest checkpoint. It ends with the weights of
    a run that never failed, every attempt in one Slurm job."""
    config, nodes = JOBS["nxdt-llama3-8b-hyperpod.toml"]
    expected = never_failed(config, nodes * RANKS_PER_NODE, tmp_path / "never-failed")
    spec, examples = nxdt_spec("nxdt-llama3-8b-hyperpod.toml", tmp_path / "run", nodes, pause_release_s=3)
    conf = examples / "conf" / f"{config}.yaml"
    conf.write_text(conf.read_text().replace("step_s: 0.15", "step_s: 0.4"))  # room to act between saves
    daemon = slurm_serve(tmp_path / "state", free_port(), slurm_box)
    try:
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]

        def saved() -> int:
            """The newest complete save in the job's version directories, as the trainer made
            it (the supervisor scans a [command] trainer's directory between attempts)."""
            found = [int(m.group(1)) for p in (examples / "nemo_experiments" / "hf_llama").glob("*/checkpoints/*")
                     if (p / "done").exists() and (m := re.search(r"step=(\d+)", p.name))]
            return max(found, default=0)

        def status() -> dict[str, Any]:
            result: dict[str, Any] = daemon.ctl_json("status", run_id)
            return result

        wait_for(lambda: saved() >= 20, 240, "a checkpoint of step 20")
        [job] = slurm(slurm_box, "squeue", "-h", "-o", "%i").split()
        assert daemon.ctl_json("pause", run_id)["result"] == "accepted"
        wait_for(lambda: slurm(slurm_box, "squeue", "-h", "-o", "%i|%T|%N|%r").strip()
                 == f"{job}|PENDING||job requeued in held state", 90, "its node given back, its job held")
        paused_at = saved()
        assert daemon.ctl_json("resume", run_id)["result"] == "accepted"
        wait_for(lambda: saved() > paused_at, 240, "a checkpoint after the resume")
        history = status()["attempt_history"]
        assert history[-1]["resume_step"] == paused_at, history

        conf.rename(conf.with_suffix(".moved"))  # the user's mistake
        ranks = [p for p in psutil.process_iter(["cmdline", "environ"])
                 if "training_orchestrator.py" in (p.info["cmdline"] or ()) and "torchrun" not in " ".join(
                     p.info["cmdline"] or ()) and (p.info["environ"] or {}).get("TSUP_RUN_ID") == run_id]
        assert ranks, "the job's ranks on the box"
        ranks[0].kill()
        before = saved()  # no save completes once a rank is gone (each waits for all the shards)
        failed = wait_for(lambda: (d := status())["state"] == "FAILED" and d, 180, "the run to fail")
        assert failed["faults"][-1]["kind"] == "config", failed["faults"]
        assert "Error: YAML file './conf/hf_llama3_8B_config.yaml' not found!" in failed["reason"], failed["reason"]
        wait_for(lambda: slurm(slurm_box, "squeue", "-h", "-o", "%i|%T|%N|%r").strip()
                 == f"{job}|PENDING||job requeued in held state", 90, "the failed run's job held for a resume")

        conf.with_suffix(".moved").rename(conf)  # fixed
        assert daemon.ctl_json("resume", run_id)["result"] == "accepted"
        done = wait_for(lambda: (d := status())["state"] in ("SUCCEEDED", "FAILED") and d, 300, "the run to end")
        assert done["state"] == "SUCCEEDED", done
        assert done["attempt_history"][-1]["resume_step"] == before, done["attempt_history"]
    finally:
        daemon.kill(15)
    logs = examples / "logs"
    assert [p.name for p in logs.iterdir()] == [job], "every attempt in the one job"
    assert len(list((logs / job).iterdir())) >= 3, "requeued at the pause and at the failure"
    assert_same_weights(tmp_path / "run" / "final.pt", expected)
