"""Chaos at real sizes: checkpoint phases that last many steps, and nodes of one rank.

A real model's save takes tens of seconds where the tiny model's takes 0.1 s, so every
timing rule must follow what the run measured. Here the reference trainer carries 151 MB
of state on one rank (13 M parameters, fp32 with AdamW's moments), its steps take about
0.3 s on a core, and the ``slow-save`` drill holds its saves to 25 MB/s (about 6 s a
save) while the adaptive hang limit is active (``hang_floor_s = 1`` after 5 steps): the
first failures of a 1.5 B model on a GPU, on this machine's CPU. A trainer the
supervisor did not write does the same through ``trainer.client``. Then a node of one
rank: that rank's SIGKILL is a rank's fault, not the node's, and the run resumes on the
same node from the node's memory.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import assert_records
from tests.e2e.conftest import command_spec, db_rows, summary_of, trainer_processes, tsup

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

# Saves from step 1 on at 25 MB/s: 151 MB take about 6 s, ten steps about 3.5 s.
SLOW_SAVES = "slow-save@1:25"
STRICT_HANGS = {"hang_floor_s": 1, "hang_min_samples": 5, "hang_timeout_s": 120}


def _sized_spec(path: Path, *, steps: int = 30, checkpoint: str = "every_steps = 10",
                resources: str = "nodes = 1\nranks_per_node = 1\nspares = 0",
                policy: dict[str, Any] | None = None) -> Path:
    """The reference trainer with 151 MB of state, strict hang limits unless ``policy``."""
    knobs = STRICT_HANGS if policy is None else policy
    policy_lines = "\n".join(f"{k} = {v}" for k, v in knobs.items())
    path.write_text(textwrap.dedent("""\
        name = "real-sizes"
        [resources]
        launcher = "local"
        {resources}
        [trainer]
        model = "tiny"
        model_overrides = {{ hidden_size = 512, intermediate_size = 1408, n_layers = 4, n_heads = 8, n_kv_heads = 8 }}
        seed = 7
        steps = {steps}
        global_batch_size = 4
        seq_len = 64
        [trainer.checkpoint]
        keep = 2
        {checkpoint}
        [policy]
        {policy}
        """).format(resources=resources, steps=steps, checkpoint=checkpoint, policy=policy_lines))
    return path


def _rank0_log(state: Path, attempt: int = 1) -> str:
    [log] = (state / "runs" / "run-1" / "attempts" / str(attempt)).glob("rank-0000.*.log")
    return log.read_text(errors="replace")


def test_slow_synchronous_saves_are_no_hang(tmp_path: Path, state: Path) -> None:
    """A 6 s save on the training thread, announced as the checkpoint phase, then 0.3 s
    steps under a 1 s adaptive limit: the clock starts again when the save ends."""
    spec = _sized_spec(tmp_path / "sync.toml")
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", SLOW_SAVES)
    s = summary_of(proc)
    assert proc.returncode == 0 and s["state"] == "SUCCEEDED", (s.get("reason"), s["faults"])
    assert s["faults"] == [] and s["attempts"] == 1, s["faults"]
    saves = [float(x) for x in re.findall(r"checkpoint step \d+ committed to \S+ in (\S+) s", _rank0_log(state))]
    assert len(saves) == 3 and min(saves) > 4.0, f"the drill made every save slow: {saves}"
    assert_records(state, s)


def test_slow_saves_beside_training_are_no_hang(tmp_path: Path, state: Path) -> None:
    """Asynchronous saves of 6 s every 3.5 s of steps: at step 20 the training thread waits
    for step 10's save, which is the checkpoint phase (not a silent stall), and its
    allowance comes from the bytes and the pace this run measured."""
    spec = _sized_spec(tmp_path / "async.toml", checkpoint="every_steps = 10\nasynchronous = true")
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", SLOW_SAVES)
    s = summary_of(proc)
    assert proc.returncode == 0 and s["state"] == "SUCCEEDED", (s.get("reason"), s["faults"])
    assert s["faults"] == [] and s["attempts"] == 1, s["faults"]
    whole = [float(x) for x in re.findall(r"checkpoint step \d+ committed to \S+ in (\S+) s \(beside training",
                                          _rank0_log(state))]
    assert len(whole) == 3 and min(whole) > 4.0, f"each save outlasted ten steps: {whole}"
    assert_records(state, s)


CLIENT_TRAINER = textwrap.dedent('''
    """A user's trainer with the client: 0.05 s steps, 6 s saves announced as the
    checkpoint phase, and a first step after each save that takes 0.6 s (cold caches)."""
    import argparse, json, os, time
    from trainer.client import Reporter

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--resume_from_checkpoint", default=None)
    args = ap.parse_args()
    tsup = Reporter()
    start = 0
    if args.resume_from_checkpoint:
        with open(os.path.join(args.resume_from_checkpoint, "state.json")) as f:
            start = json.load(f)["step"]
        tsup.resumed(start)
    tsup.phase("train")
    after_save = False
    for step in range(start + 1, args.steps + 1):
        time.sleep(0.6 if after_save else 0.05)
        after_save = False
        tsup.step(step, loss=2.0 / step, lr=0.1)
        if step % 10 == 0:
            tsup.phase("checkpoint")
            began = time.monotonic()
            time.sleep(6.0)
            d = os.path.join(args.save_dir, f"llama_v3-{step}steps")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "state.json"), "w") as f:
                json.dump({"step": step}, f)
            with open(os.path.join(d, ".metadata"), "w") as f:
                f.write("metadata")
            tsup.checkpoint(step, d, duration_s=time.monotonic() - began)
            tsup.phase("train")
            after_save = True
    tsup.close()
''')


def test_a_command_trainers_long_checkpoint_phases_are_no_hang(tmp_path: Path, state: Path) -> None:
    script = tmp_path / "user_train.py"
    script.write_text(CLIENT_TRAINER)
    argv = [sys.executable, str(script), "--steps", "30", "--save_dir", "{checkpoint_dir}"]
    spec = command_spec(tmp_path / "client.toml", "client-saves", argv, resources={"nodes": 1, "ranks_per_node": 1},
                        resume=["--resume_from_checkpoint={checkpoint}"], checkpoint_layout="dcp", steps=30,
                        policy=STRICT_HANGS)
    proc = tsup("run", spec, "--state-dir", state, "--json", timeout_s=240)
    s = summary_of(proc)
    assert proc.returncode == 0 and s["state"] == "SUCCEEDED", (s.get("reason"), s["faults"])
    assert s["faults"] == [] and s["attempts"] == 1, s["faults"]
    assert s["final_step"] == 30


def _one_rank_nodes(path: Path, nodes: int) -> Path:
    return _sized_spec(path, steps=40, checkpoint="every_steps = 20\nmemory_every_steps = 5",
                       resources=f"nodes = {nodes}\nranks_per_node = 1\nspares = 1", policy={})


@pytest.fixture(scope="module")
def one_rank_fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("one-rank-fault-free")
    proc = tsup("run", _one_rank_nodes(d / "spec.toml", 1), "--state-dir", d / "state", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return summary_of(proc)


def test_a_killed_rank_alone_on_its_node_is_no_lost_node_and_resumes_from_its_memory(
        one_rank_fault_free: dict[str, Any], tmp_path: Path, state: Path) -> None:
    """1 node x 1 rank + 1 spare, the memory tier every 5 steps: SIGKILL of the only rank
    after step 27. The node's own process lives on, so the node is not lost: nothing is
    drained, and the next attempt runs on the same node from its memory save of step 25,
    reading nothing from storage."""
    proc = tsup("run", _one_rank_nodes(tmp_path / "spec.toml", 1), "--state-dir", state, "--json",
                "--chaos", "kill-rank@27")
    s = summary_of(proc)
    assert proc.returncode == 0 and s["state"] == "SUCCEEDED", (s.get("reason"), s["faults"])
    [fault] = s["faults"]
    assert fault["kind"] == "rank-exit" and "SIGKILL" in fault["summary"], fault
    assert s["drained_nodes"] == [], "one process's death is no evidence against its node"
    first, second = s["attempt_history"]
    assert first["nodes"] == second["nodes"] == ["local-1"], "the node that holds the memory save"
    assert second["resume_from"] in ("memory:1:25", "memory:1:30"), second
    assert f"resumed from {second['resume_from']} at step {second['resume_step']} in " in _rank0_log(state, 2)
    assert s["model_digest"] == one_rank_fault_free["model_digest"]
    assert_records(state, s, injected=1)


def test_a_killed_node_of_one_rank_is_lost_and_drained(one_rank_fault_free: dict[str, Any], tmp_path: Path,
                                                     state: Path) -> None:
    """The other side of the rule: kill-node takes the rank and the node's own process
    together: the node is lost, drained, and the spare takes its place."""
    proc = tsup("run", _one_rank_nodes(tmp_path / "spec.toml", 1), "--state-dir", state, "--json",
                "--chaos", "kill-node@27")
    s = summary_of(proc)
    assert proc.returncode == 0 and s["state"] == "SUCCEEDED", (s.get("reason"), s["faults"])
    [fault] = s["faults"]
    assert fault["kind"] == "node-lost" and fault["nodes"] == ["local-1"], fault
    assert s["drained_nodes"] == ["local-1"]
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1"], ["local-2"]]
    assert s["attempt_history"][1]["resume_from"].endswith("step_00000020"), "its memory went with it"
    assert s["model_digest"] == one_rank_fault_free["model_digest"]
    assert trainer_processes(state) == []
    assert db_rows(state, "SELECT count(*) FROM memory_checkpoints")[0][0] > 0
    assert_records(state, s, injected=1)
