"""Checkpoint interval advice (supervisor/planning.py) and the cluster simulation's bookkeeping."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor import planning
from tests.conftest import REPO


def test_llama3_rate_and_the_young_daly_interval() -> None:
    mtbf = planning.job_mtbf_s(2048)
    assert mtbf == pytest.approx(54 * 86_400 / 419)  # the whole Llama 3 job: one interruption per 3.1 h
    assert planning.young_daly_interval_s(30.0, mtbf) == pytest.approx(math.sqrt(2 * 30 * mtbf))
    assert planning.advise_every_steps(30.0, 4.0, 2048) == round(math.sqrt(2 * 30 * mtbf) / 4)
    assert planning.job_mtbf_s(1024) == pytest.approx(2 * mtbf)
    with pytest.raises(ValueError):
        planning.job_mtbf_s(0)


def test_an_auto_interval_follows_what_the_run_measured() -> None:
    first = planning.auto_every_steps(None, 0.2, nodes=2, failures_per_node_day=1.0, total_steps=1000)
    assert first.every_steps == planning.AUTO_FIRST_EVERY_STEPS and "until a checkpoint" in first.why
    # 2 nodes failing once a day each: MTBF 12 h; 0.5 s checkpoints -> sqrt(2 x 0.5 x 43200) = 207.8 s
    auto = planning.auto_every_steps(0.5, 0.2, nodes=2, failures_per_node_day=1.0, total_steps=100_000)
    assert auto.every_steps == round(math.sqrt(2 * 0.5 * 43_200) / 0.2) == 1039
    assert "MTBF 12.0 h" in auto.why and "0.50 s a checkpoint" in auto.why
    capped = planning.auto_every_steps(0.5, 0.2, nodes=2, failures_per_node_day=1.0, total_steps=80)
    assert capped.every_steps == 80 and "only 80 steps" in capped.why
    often = planning.auto_every_steps(0.5, 0.2, nodes=2048, failures_per_node_day=1.0, total_steps=10**6)
    assert often.every_steps < auto.every_steps, "more nodes fail more often: checkpoint more often"


def test_each_tier_gets_its_own_interval_from_its_own_cost() -> None:
    first = planning.auto_every_steps(None, 0.2, nodes=2, failures_per_node_day=1.0, total_steps=1000,
                                      tier=planning.TIER_MEMORY)
    assert first.every_steps == planning.AUTO_FIRST_MEMORY_EVERY_STEPS
    memory = planning.auto_every_steps(0.005, 0.2, nodes=2, failures_per_node_day=1.0, total_steps=10**6,
                                       tier=planning.TIER_MEMORY)
    persistent = planning.auto_every_steps(2.0, 0.2, nodes=2, failures_per_node_day=1.0, total_steps=10**6)
    assert memory.every_steps == round(math.sqrt(2 * 0.005 * 43_200) / 0.2) == 104
    assert persistent.every_steps == round(math.sqrt(2 * 2.0 * 43_200) / 0.2) == 2078, "20 x: 400 x the cost"
    assert "0.005 s a checkpoint" in memory.why


def test_the_advise_command() -> None:
    out = subprocess.run([sys.executable, "-m", "cli.daemon", "advise", "--nodes", "2048", "--checkpoint-s",
                          "30", "--step-time-s", "4", "--json"], capture_output=True, text=True, cwd=REPO,
                         check=True)
    doc = json.loads(out.stdout)
    assert doc["checkpoint_every_s"] == pytest.approx(817.4, abs=0.1) and doc["checkpoint_every_steps"] == 204


def test_the_simulation_accounts_for_every_second_and_drives_the_policy() -> None:
    out = subprocess.run([sys.executable, "bench/simulate.py", "--nodes", "256", "--spares", "2", "--days", "20",
                          "--seed", "3"], capture_output=True, text=True, cwd=REPO, check=True, timeout=300)
    d = json.loads(out.stdout)
    assert d["accounted"] == pytest.approx(1.0, abs=1e-3)
    assert 0.5 < d["ettr"] < 1.0 and d["run_state"] == "RUNNING"
    failures = d["failures"]["hardware"] + d["failures"]["software"]
    assert failures > 5 and d["attempts"] == failures + 1, "every interruption is one restart"
    assert d["policy_decisions"] >= 3 * failures
    assert d["breakdown"]["lost_work"] > 0 and d["breakdown"]["checkpoint"] > 0


def test_with_the_memory_tier_the_policy_resumes_from_memory_and_less_is_lost() -> None:
    def simulate(*extra: str) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "bench/simulate.py", "--nodes", "256", "--spares", "2", "--days",
                              "20", "--seed", "3", *extra], capture_output=True, text=True, cwd=REPO, check=True,
                             timeout=300)
        return dict(json.loads(out.stdout))

    base, tiers = simulate(), simulate("--tiers", "--copy-gb-s", "2.5")
    assert tiers["accounted"] == pytest.approx(1.0, abs=1e-3)
    failures = tiers["failures"]["hardware"] + tiers["failures"]["software"]
    # The first attempt starts from scratch; every recovery after it resumes from memory
    # (one node lost at a time: its replicas are on the next node), decided by the policy.
    assert tiers["resumed_from_memory"] == tiers["attempts"] - 1 == failures
    assert tiers["breakdown"]["lost_work"] < base["breakdown"]["lost_work"] / 5
    assert tiers["breakdown"]["checkpoint"] < base["breakdown"]["checkpoint"] / 5
    assert tiers["ettr"] > base["ettr"]
    assert "copy_gb_s" in tiers["inputs"] and "checkpoint_every_s" not in tiers["inputs"]
    with pytest.raises(subprocess.CalledProcessError):
        simulate("--tiers")  # the copy rate is a measurement: it must be given


def test_the_tiers_costs_come_from_a_gpu_run_scaled_by_bytes_a_rank(tmp_path: Path) -> None:
    """simulate.py --from-gpu: the blocking and restart costs of a bench/gpu_recovery.py run
    (here a hand-made one, 18 GB a rank), scaled to the simulated job's 68 MB a rank."""
    run = {"gpu": True, "limits": {"device": "NVIDIA H200"}, "state_bytes_per_rank": 18_000_000_000,
           "saves": [{"tier": "memory", "blocked_s": 0.4}, {"tier": "memory", "blocked_s": 0.2},
                     {"tier": "memory", "blocked_s": 0.3}, {"tier": "persistent", "blocked_s": 0.5}],
           "restores": [{"tier": "memory", "seconds": 3.0}, {"tier": "persistent", "seconds": 6.0}],
           "recoveries": [{"kind": "rank-exit", "detect_s": 1.0, "kill_to_first_step_s": 10.0},
                          {"kind": "node-lost", "detect_s": 10.0, "kill_to_first_step_s": 25.0}]}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(run))
    out = subprocess.run([sys.executable, "bench/simulate.py", "--nodes", "256", "--spares", "2", "--days", "20",
                          "--seed", "3", "--from-gpu", str(path)], capture_output=True, text=True, cwd=REPO,
                         check=True, timeout=300)
    d = json.loads(out.stdout)
    scale = 70e9 * 16 / (2048 * 8) / 18e9
    assert d["memory_checkpoint_s"] == pytest.approx(0.3 * scale, abs=1e-4), "the median memory save, scaled"
    assert d["persistent_blocking_s"] == pytest.approx(0.5 * scale, abs=1e-4)
    # Around the restore (launch, standby, first step) unscaled; the restore scaled; the rendezvous at 256 nodes.
    assert d["warm_restart_s"] == pytest.approx(10.0 - 1.0 - 3.0 + 3.0 * scale + 0.01 * 256, abs=0.01)
    assert d["restart_s"] == pytest.approx(25.0 - 10.0 - 6.0 + 6.0 * scale + 0.01 * 256, abs=0.1)
    assert "NVIDIA H200 (GPU), 18 GB of state a rank" in d["inputs"]["warm_restart_s"]
    assert d["resumed_from_memory"] > 0 and d["accounted"] == pytest.approx(1.0, abs=1e-3)
    del run["recoveries"]
    path.write_text(json.dumps(run))
    failed = subprocess.run([sys.executable, "bench/simulate.py", "--nodes", "256", "--from-gpu", str(path)],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert failed.returncode != 0 and "no rank-exit recovery" in failed.stderr


def test_the_measured_costs_leave_out_each_attempts_first_step_and_keep_each_tiers_own_saves() -> None:
    from supervisor.domain import AttemptStats

    stats = [AttemptStats(attempt=1, steps=11, step_time_s=12.0, first_step_time_s=2.0, checkpoints=2, checkpoint_s=3.0),
             AttemptStats(attempt=2, steps=1, step_time_s=5.0, first_step_time_s=5.0),  # its warm-up only
             AttemptStats(attempt=3, steps=6, step_time_s=6.0, first_step_time_s=1.0, checkpoints=1, checkpoint_s=3.0)]
    assert planning.measured_costs(stats, [0.2, 0.4], planning.TIER_PERSISTENT) == (2.0, 1.0)
    cost, step_s = planning.measured_costs(stats, [0.2, 0.4], planning.TIER_MEMORY)
    assert cost == pytest.approx(0.3) and step_s == 1.0
    assert planning.measured_costs([], [], planning.TIER_PERSISTENT) == (None, None)

