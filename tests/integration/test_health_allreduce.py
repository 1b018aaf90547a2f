"""health.allreduce with two real ranks: gloo on this CPU machine, launched the way torchrun
launches them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), rank 0's JSON graded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from health import allreduce
from health.model import Action, Status
from tests.conftest import REPO, free_port, require_module

torch = require_module("torch", "the trainer extra; the CPU wheel on machines without a GPU")


def run_ranks(*args: str, world: int = 2, timeout_s: float = 60) -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        procs.append(subprocess.Popen([sys.executable, "-m", "health.allreduce", *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def test_two_gloo_ranks_measure_bus_bandwidth() -> None:
    began = time.monotonic()
    rank0, rank1 = run_ranks("--sizes", "64K,1M", "--iters", "5", "--warmup", "2", "--backend", "gloo", "--json")
    assert time.monotonic() - began < 30, "two ranks on gloo must finish in well under 30 s"
    assert (rank0.returncode, rank1.returncode) == (0, 0), (rank0.stderr, rank1.stderr)
    assert rank1.stdout == "", "only rank 0 prints"
    doc = json.loads(rank0.stdout)  # one JSON object, nothing else on stdout
    assert (doc["probe"], doc["backend"], doc["world_size"], doc["device"]) == ("allreduce", "gloo", 2, "cpu")
    assert [r["bytes"] for r in doc["results"]] == [64 << 10, 1 << 20]
    for r in doc["results"]:
        assert r["time_us"] > 0 and r["algbw_gbps"] > 0 and r["busbw_gbps"] > 0, r
        assert r["wrong"] == 0, r
        # two ranks: busbw = algbw * 2 * (2 - 1) / 2 = algbw, and algbw = bytes / time
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-3)
    largest = max(doc["results"], key=lambda r: r["bytes"])
    assert doc["busbw_gbps_at_largest"] == largest["busbw_gbps"]

    f = allreduce.check_allreduce(rank0.stdout)[0]
    assert f.status is Status.HEALTHY
    assert "at 1 MiB (largest of 2 sizes; gloo, 2 ranks)" in f.evidence
    assert f"busbw {largest['busbw_gbps']:.2f} GB/s" in f.evidence
    slow = allreduce.check_allreduce(rank0.stdout, min_busbw_gbps=largest["busbw_gbps"] * 10)[0]
    assert (slow.status, slow.action) == (Status.DEGRADED, Action.NONE)


def test_rank0_grades_its_own_run_and_reports_failures() -> None:
    rank0, rank1 = run_ranks("--sizes", "64K", "--iters", "2", "--warmup", "1", "--min-busbw-gbps", "1000000")
    assert (rank0.returncode, rank1.returncode) == (1, 0), (rank0.stderr, rank1.stderr)  # 1: degraded
    assert "# all-reduce (gloo, 2 ranks, cpu, float32, 2 iters)" in rank0.stdout
    assert "degraded: allreduce: busbw" in rank0.stdout and "under the floor 1000000.00 GB/s" in rank0.stdout

    # a rank that cannot reach its peer: the error, as JSON on rank 0, graded UNKNOWN
    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": ""}
    alone = subprocess.run([sys.executable, "-m", "health.allreduce", "--sizes", "64K", "--backend", "gloo",
                            "--timeout-s", "3", "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=60)
    assert alone.returncode == 2, alone.stderr
    doc = json.loads(alone.stdout)
    assert doc["probe"] == "allreduce" and doc["error"]
    f = allreduce.check_allreduce(alone.stdout)[0]
    assert f.status is Status.UNKNOWN and f.evidence.startswith("unknown: probe failed: the all-reduce run failed")
