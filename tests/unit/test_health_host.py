"""The host probes and the verdict rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from health import host
from health.model import Action, Finding, Status, verdict
from tests.conftest import REPO


def test_worst_finding_wins_and_a_failed_probe_is_never_healthy() -> None:
    ok = Finding(probe="a", status=Status.HEALTHY, evidence="")
    slow = Finding(probe="b", status=Status.DEGRADED, evidence="")
    broken = Finding(probe="c", status=Status.UNKNOWN, evidence="unknown: probe failed: x")
    bad = Finding(probe="d", status=Status.UNHEALTHY, evidence="ECC", action=Action.REPLACE)
    reboot = Finding(probe="e", status=Status.UNHEALTHY, evidence="XID 79", action=Action.REBOOT)
    assert verdict([ok]).status is Status.HEALTHY and verdict([]).status is Status.HEALTHY
    assert verdict([ok, slow]).status is Status.DEGRADED
    assert verdict([ok, slow, broken]).status is Status.UNKNOWN and verdict([broken]).exit_code == 2
    v = verdict([ok, broken, reboot, bad])
    assert (v.status, v.action, v.exit_code) == (Status.UNHEALTHY, Action.REPLACE, 2)
    assert v.reason() == "e: XID 79; d: ECC"


def test_disk_thresholds(tmp_path: Path) -> None:
    assert host.disk(tmp_path, min_free_gib=0.0, degraded_free_gib=0.0).status is Status.HEALTHY
    assert host.disk(tmp_path, min_free_gib=1e9).status is Status.UNHEALTHY
    missing = host.disk(tmp_path / "absent")
    assert missing.status is Status.UNKNOWN and "probe failed" in missing.evidence


def test_write_latency_on_a_real_directory_and_an_unwritable_one(tmp_path: Path) -> None:
    f = host.write_latency(tmp_path)
    assert f.status in (Status.HEALTHY, Status.DEGRADED) and "written and synced" in f.evidence
    assert list(tmp_path.iterdir()) == []
    assert host.write_latency(tmp_path / "absent").status is Status.UNHEALTHY


def test_cli_prints_json_and_exits_by_status(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "health", "--checkpoint-dir", str(tmp_path), "--json",
                           "--min-free-gib", "1e9"], capture_output=True, text=True, cwd=REPO, check=False)
    v = json.loads(proc.stdout)
    assert v["status"] == "unhealthy" and proc.returncode == 2
    assert {f["probe"] for f in v["findings"]} == {"disk", "write_latency", "memory", "load", "leftover_trainers",
                                                   "neuron-ls"}
    assert v["node"] and "no Neuron devices found" in v["summary"] and v["reason"].startswith("disk:")


def test_on_a_machine_without_accelerators_the_cli_says_so_plainly(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "TSUP_HEALTH_TOOLS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "health", "--checkpoint-dir", str(tmp_path), "--min-free-gib", "0",
                           "--json", "--compact"], capture_output=True, text=True, cwd=REPO, check=False, env=env)
    [line] = proc.stdout.splitlines()
    v = json.loads(line)
    assert v["summary"] == "no Neuron devices found (neuron-ls not installed); host checks only"
    assert v["status"] in ("healthy", "degraded") and proc.returncode in (0, 1)
