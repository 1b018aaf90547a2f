"""A trainer the supervisor did not write: a plain torchrun-style script with PyTorch DCP
checkpoints in the FSDP test case's ``{model}-{N}steps`` layout and a
``--resume_from_checkpoint`` argument. It sends no telemetry; the supervisor learns of
its crash from the process and of its progress from its checkpoints.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import command_spec, summary_of, trainer_processes, tsup

SCRIPT = textwrap.dedent('''
    """A tiny data-parallel trainer, in the style of a user's torchrun script."""
    import argparse, json, os, time
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--crash_at", type=int, default=0)
    ap.add_argument("--resume_from_checkpoint", default=None)
    ap.add_argument("--sleep", type=float, default=0.05)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    if args.resume_from_checkpoint:
        state = {"model": model.state_dict(), "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.resume_from_checkpoint)
        model.load_state_dict(state["model"])
        start = int(state["step"])
        print(f"rank {rank}: resumed from {args.resume_from_checkpoint} at step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 8, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if step == args.crash_at and not args.resume_from_checkpoint and rank == world - 1:
            print(f"rank {rank}: crashing at step {step}", flush=True)
            os._exit(3)
        if step % args.every == 0:
            dcp.save({"model": model.state_dict(), "step": torch.tensor(step)},
                     checkpoint_id=os.path.join(args.save_dir, f"llama_v3-{step}steps"))
        if rank == 0:  # the FSDP test case's line, 0-based (supervisor/gathering/output_progress.py)
            print(f"Batch {step - 1} Loss: {loss.item():.5f}, Speed: 80.00 samples/sec, lr: 0.050000", flush=True)
        time.sleep(args.sleep)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"weight": model.weight.flatten().tolist(), "bias": model.bias.tolist()}, f)
    dist.destroy_process_group()
''')


def write_spec(tmp_path: Path, name: str, crash_at: int) -> Path:
    script = tmp_path / "user_train.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script), "--steps", "40", "--every", "10", "--save_dir", "{checkpoint_dir}",
            "--out", "{run_dir}/final.json", "--crash_at", str(crash_at)]
    return command_spec(tmp_path / f"{name}.toml", name, argv, resources={"nodes": 1, "ranks_per_node": 2},
                        policy={"failures_without_progress": 3}, checkpoint_layout="dcp", steps=40,
                        resume=["--resume_from_checkpoint={checkpoint}"])


def run(tmp_path: Path, name: str, crash_at: int) -> tuple[dict[str, Any], Path]:
    state = tmp_path / f"state-{name}"
    proc = tsup("run", write_spec(tmp_path, name, crash_at), "--state-dir", state, "--json", timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return summary_of(proc), state / "runs" / "run-1"


def test_a_foreign_trainer_resumes_from_its_newest_complete_checkpoint_after_a_crash(tmp_path: Path) -> None:
    clean, clean_dir = run(tmp_path, "clean", crash_at=0)
    assert clean["state"] == "SUCCEEDED" and clean["attempts"] == 1 and clean["final_step"] == 40
    assert clean["model_digest"] is None  # a plain command reports none

    # Rank 1 crashes at step 25: the newest complete checkpoint is step 20's.
    s, run_dir = run(tmp_path, "crashing", crash_at=25)
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 40
    # Without telemetry there is no "who failed first" beyond what the processes show:
    # both ranks ended within one tick; the crashed one is named with its exit code.
    [fault] = s["faults"]
    assert fault["kind"] == "rank-exit" and 1 in fault["ranks"] and fault["nodes"] == ["local-1"]
    assert "rank 1 (node local-1) exited with code 3" in fault["summary"]
    assert s["drained_nodes"] == [], "a crash is no reason to drain a node"
    history = s["attempt_history"]
    assert len(history) == 2 and history[1]["resume_step"] == 20
    assert history[1]["resume_from"].endswith("checkpoints/llama_v3-20steps")
    command = json.loads((run_dir / "attempts" / "2" / "trainer.json").read_text())["command"]
    assert command[-1] == f"--resume_from_checkpoint={run_dir}/checkpoints/llama_v3-20steps"
    logs = "".join(p.read_text() for p in (run_dir / "attempts" / "2").glob("rank-*.log"))
    assert "resumed from" in logs and "at step 20" in logs

    # Nothing lost: the same weights as the run that never crashed.
    assert json.loads((run_dir / "final.json").read_text()) == json.loads((clean_dir / "final.json").read_text())


def test_an_incomplete_newest_checkpoint_is_passed_over(tmp_path: Path) -> None:
    """A save cut short (no .metadata) is never resumed from: the one before it is."""
    from supervisor.runfiles.checkpoint_scan import pick

    d = tmp_path / "ck"
    for step, complete in ((10, True), (20, False)):
        c = d / f"llama_v3-{step}steps"
        c.mkdir(parents=True)
        (c / "__0_0.distcp").write_bytes(b"x")
        if complete:
            (c / ".metadata").write_bytes(b"m")
    newest, rejected = pick(d, "dcp")
    assert newest is not None and newest.step == 10
    assert [v.step for v in rejected] == [20]


# Exits 4 on its first attempt, then succeeds: "4" is whatever the script means by it.
ONCE_4 = 'if [ -e "$1/failed-once" ]; then exit 0; fi; touch "$1/failed-once"; exit 4'


@pytest.mark.parametrize("declared", [False, True])
def test_an_exit_code_means_a_device_fault_only_when_the_spec_declares_it(tmp_path: Path, declared: bool) -> None:
    spec = command_spec(tmp_path / "once4.toml", "once4", ["sh", "-c", ONCE_4, "once4", "{run_dir}"],
                        resources={"nodes": 1, "ranks_per_node": 1, "spares": 1},
                        **({"exit_codes": "tsup"} if declared else {}))
    proc = tsup("run", spec, "--state-dir", tmp_path / "state", "--json", timeout_s=120)
    s = summary_of(proc)
    assert proc.returncode == 0 and s["state"] == "SUCCEEDED" and s["attempts"] == 2, s
    [fault] = s["faults"]
    if declared:  # the trainer's own word that its device failed: its node goes
        assert fault["kind"] == "device" and s["drained_nodes"] == ["local-1"], s
    else:  # a script's 4 is no evidence against the node
        assert fault["kind"] == "rank-exit" and s["drained_nodes"] == [], s


# Seed 003's error for a TP/DP layout that does not fit (DP 2 x TP 16 on one trn1.32xlarge).
LAYOUT_ERROR = ('echo "2026-Jan-14 11:23:49.987594 95431:108485 ERROR   ENC:enc_init_comm   [rank 0] failed (2) '
                'to init a collective algorithm for provided replica group."; exit 1')


def test_a_configuration_error_fails_the_run_at_its_first_attempt_with_the_trainers_words(tmp_path: Path) -> None:
    spec = command_spec(tmp_path / "layout.toml", "layout", ["sh", "-c", LAYOUT_ERROR],
                        resources={"nodes": 1, "ranks_per_node": 1, "spares": 1})
    proc = tsup("run", spec, "--state-dir", tmp_path / "state", "--json", timeout_s=120)
    s = summary_of(proc)
    assert s["state"] == "FAILED" and s["attempts"] == 1, s
    [fault] = s["faults"]
    assert fault["kind"] == "config" and "failed (2) to init a collective algorithm" in fault["summary"], s
    assert "failed (2) to init a collective algorithm" in s["reason"] and s["drained_nodes"] == [], s


def test_a_command_runs_in_its_cwd_on_the_local_launcher(tmp_path: Path) -> None:
    spec = command_spec(tmp_path / "cwd.toml", "cwd", ["sh", "-c", 'pwd > "$1/cwd"', "cwd", "{run_dir}"],
                        cwd="{run_dir}/attempts")
    state = tmp_path / "state"
    s = summary_of(tsup("run", spec, "--state-dir", state, "--json", timeout_s=120))
    assert s["state"] == "SUCCEEDED", s
    run_dir = state / "runs" / "run-1"
    assert (run_dir / "cwd").read_text().strip() == str(run_dir / "attempts")


def test_a_frozen_node_of_a_trainer_that_sends_nothing_is_found_by_its_agents_silence(tmp_path: Path) -> None:
    """The trainer sends no telemetry, so only the node agents (node/agent.py, each
    simulated node's own process) are heard. Every process of the second node is stopped
    (SIGSTOP): no exit, no will, its peer blocked in all_reduce. The agent's silence past
    silence_timeout_s finds the node, which is drained and replaced by the spare; before
    the agents, this was a hang that blamed no node."""
    script = tmp_path / "user_train.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script), "--steps", "60", "--every", "10", "--save_dir", "{checkpoint_dir}",
            "--out", "{run_dir}/final.json", "--sleep", "0.2"]
    spec = command_spec(tmp_path / "frozen.toml", "frozen", argv,
                        resources={"nodes": 2, "ranks_per_node": 1, "spares": 1},
                        policy={"silence_timeout_s": 4, "hang_timeout_s": 120}, checkpoint_layout="dcp",
                        steps=60, resume=["--resume_from_checkpoint={checkpoint}"])
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "freeze-node@20", timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary_of(proc)
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 60, s
    told = f"{s['faults']}\n--- the run's output ---\n{proc.stderr[-6000:]}"  # what happened, if wrong
    assert len(s["faults"]) == 1, told
    [fault] = s["faults"]
    assert fault["kind"] == "node-lost" and fault["nodes"] == ["local-2"], told
    assert "its agent and every rank" in fault["summary"], fault["summary"]
    # Silence counts from the agent's last report, up to an interval (1 s) before the
    # freeze: never found sooner than that. How soon after is a figure, not an assertion.
    assert fault["detected_at"] - fault["injected_at"] >= 4 - 1.5, fault
    assert s["drained_nodes"] == ["local-2"]
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1", "local-2"], ["local-1", "local-3"]]
    assert s["attempt_history"][1]["resume_step"] >= 20
    assert trainer_processes(state) == [], "the frozen node's processes are gone too"
