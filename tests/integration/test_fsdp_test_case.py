"""The FSDP test case's job, as its users run it, supervised unchanged on the local
launcher: one torchrun per node (c10d rendezvous), ``--resume_from_checkpoint`` given
the checkpoint directory to search, progress only in its own log lines
(tests/standins/fsdp_test_case.py). Its faults are found from its processes and its
output, and every recovery ends with the weights of a run that never failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO, free_port
from tests.e2e.conftest import command_spec, summary_of, tsup

SCRIPT = REPO / "tests" / "standins" / "fsdp_test_case.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS = 60
TRAIN = ["--max_steps", str(STEPS), "--checkpoint_freq", "10", "--step_sleep", "0.1"]


def torchrun(*rendezvous: str) -> list[str]:
    return [TORCHRUN, "--nnodes=2", "--nproc_per_node=2", *rendezvous, "--rdzv_backend=c10d", str(SCRIPT)]


@pytest.fixture(scope="module")
def never_failed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of the same job run by hand, no supervisor and no fault."""
    work = tmp_path_factory.mktemp("unsupervised")
    port = free_port()
    argv = torchrun("--rdzv_id=by-hand", f"--rdzv_endpoint=127.0.0.1:{port}")
    args = [*TRAIN, "--checkpoint_dir", str(work / "checkpoints"), "--out", str(work / "final.pt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([*argv, *args], cwd=work, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(2)]
    assert [p.wait(timeout=300) for p in nodes] == [0, 0]
    return torch.load(work / "final.pt")  # type: ignore[no-any-return]


def spec(tmp_path: Path, *faults: str) -> Path:
    argv = [*torchrun("--rdzv_id={rdzv_id}", "--rdzv_endpoint={master_addr}:{master_port}"),
            *TRAIN, "--checkpoint_dir={checkpoint_dir}", "--out={run_dir}/final.pt", "--fault_dir={run_dir}",
            *faults]
    return command_spec(tmp_path / "fsdp.toml", "fsdp-test-case", argv, launch="node",
                        resources={"nodes": 2, "ranks_per_node": 2, "spares": 1},
                        policy={"hang_floor_s": 10, "hang_timeout_s": 120, "failures_without_progress": 4},
                        resume=["--resume_from_checkpoint={checkpoint_dir}"], checkpoint_layout="dcp",
                        steps=STEPS)


def supervised(tmp_path: Path, *args: str) -> tuple[dict[str, Any], Path]:
    state = tmp_path / "state"
    proc = tsup("run", *args, "--state-dir", state, "--json", timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return summary_of(proc), state / "runs" / "run-1"


def assert_same_weights(run_dir: Path, never_failed: dict[str, torch.Tensor]) -> None:
    final = torch.load(run_dir / "final.pt")
    assert final.keys() == never_failed.keys()
    for name, tensor in final.items():
        assert torch.equal(tensor, never_failed[name]), f"{name} differs from the run that never failed"


def test_a_killed_rank_then_a_hung_rank_are_found_and_recovered_to_the_same_weights(
        tmp_path: Path, never_failed: dict[str, torch.Tensor]) -> None:
    """SIGKILL of rank 3 (a worker under node 2's torchrun) at step 15; in the attempt that
    resumed, SIGSTOP of rank 1 at step 35: found from its output within max(10 s, 3 x p99)."""
    s, run_dir = supervised(tmp_path, spec(tmp_path), "--chaos", "kill-rank@15:3", "--chaos", "hang-rank@35:1")
    assert s["state"] == "SUCCEEDED", s
    killed, hung = s["faults"]
    assert killed["kind"] == "rank-exit", killed
    assert hung["kind"] == "hang" and "adaptive hang timeout" in hung["summary"], hung
    assert hung["detected_at"] - hung["injected_at"] <= 10 + 2.0, "max(10 s, 3 x p99 step time), plus a read"
    history = s["attempt_history"]
    assert [a["resume_step"] for a in history] == [0, 10, 30]
    assert all(a["resume_from"] is None or a["resume_from"].endswith(f"llama_v3-{a['resume_step']}steps")
               for a in history)
    logs = (run_dir / "attempts" / "3" / "node-0000.local-1.log").read_text()
    assert "Checkpoint loaded from" in logs and "Batch 30 Loss" in logs and "Batch 29 Loss" not in logs
    assert s["drained_nodes"] == [], "a killed worker or a stopped rank is no evidence against a node"
    assert_same_weights(run_dir, never_failed)


def test_a_nan_and_a_loss_spike_in_its_log_lines_roll_back_to_the_same_weights(
        tmp_path: Path, never_failed: dict[str, torch.Tensor]) -> None:
    """The loss of step 25 turns NaN; later the data of steps 45-52 is 8 x worse (once
    each): both read from "Batch %d Loss: ..." lines, both rolled back."""
    s, run_dir = supervised(tmp_path, spec(tmp_path, "--nan_at", "25", "--spike_at", "45"))
    assert s["state"] == "SUCCEEDED", s
    nan, spike = s["faults"]
    assert nan["kind"] == "nonfinite" and nan["step"] == 25, nan
    assert spike["kind"] == "spike" and spike["step"] == 45 and "loss spike from step 45" in spike["summary"]
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 20, 40]
    assert_same_weights(run_dir, never_failed)
