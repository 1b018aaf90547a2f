"""The host probes and the verdict rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from health import host
from health.model import Action, Finding, Status, verdict
from tests.conftest import REPO, wait_for
from tests.fake_tools.replay import make_tools


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
                                                   "neuron-ls", "nvidia-smi", "fi_info"}
    assert v["node"] and "no Neuron or NVIDIA devices found" in v["summary"] and v["reason"].startswith("disk:")


def test_on_a_machine_without_accelerators_the_cli_says_so_plainly(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "TSUP_HEALTH_TOOLS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "health", "--checkpoint-dir", str(tmp_path), "--min-free-gib", "0",
                           "--json", "--compact"], capture_output=True, text=True, cwd=REPO, check=False, env=env)
    [line] = proc.stdout.splitlines()
    v = json.loads(line)
    assert v["summary"] == ("no Neuron or NVIDIA devices found (neither neuron-ls nor nvidia-smi is installed); "
                            "host checks only")
    assert v["status"] in ("healthy", "degraded") and proc.returncode in (0, 1)


def test_a_node_with_nvidia_gpus_runs_the_nvidia_probes(tmp_path: Path) -> None:
    """Stand-in nvidia-smi answering both queries with the recorded fixtures: GPU 3 has
    uncorrected ECC errors, so the node is unhealthy and must be replaced."""
    nv = REPO / "tests" / "fixtures" / "health" / "nvidia"
    hw = tmp_path / "hw" / "default"
    hw.mkdir(parents=True)
    (hw / "nvidia-smi.query-gpu").write_text((nv / "nvidia-smi_query_gpu_health_SYNTHESIZED.csv").read_text())
    (hw / "nvidia-smi.query-remapped-rows").write_text(
        (nv / "nvidia-smi_query_remapped_rows_SYNTHESIZED.csv").read_text())
    tools = make_tools(tmp_path / "tools", ["nvidia-smi"])
    env = {"PATH": "/usr/bin:/bin", "TSUP_HEALTH_TOOLS": str(tools), "TSUP_FAKE_HW": str(tmp_path / "hw"),
           "TSUP_NODE": "gpu-7"}
    proc = subprocess.run([sys.executable, "-m", "health", "--checkpoint-dir", str(tmp_path), "--min-free-gib", "0",
                           "--gpus", "8", "--json"], capture_output=True, text=True, cwd=REPO, check=False, env=env)
    v = json.loads(proc.stdout)
    assert proc.returncode == 2 and v["status"] == "unhealthy" and v["action"] == "replace"
    assert v["node"] == "gpu-7" and v["summary"] == "NVIDIA probes ran"
    bad = [f["evidence"] for f in v["findings"] if f["status"] == "unhealthy"]
    assert any(e.startswith("GPU 3 (00000000:86:00.0): ecc.errors.uncorrected.volatile.total=2") for e in bad)
    assert any("00000000:B9:00.0: remapped_rows.failure=Yes" in e for e in bad)
    assert "GPU 3" in v["reason"]


def test_the_write_probe_never_writes_through_a_planted_link_nor_removes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """H5 of issue 37: the root probe opened .tsup-health-<pid> in the checkpoint directory
    (a user's) without O_NOFOLLOW, and so overwrote a root-only file a link there named."""
    victim = tmp_path / "root-only"
    victim.write_text("root's\n")
    victim.chmod(0o600)
    monkeypatch.setattr(host.secrets, "token_hex", lambda n: "guessed")
    planted = tmp_path / f".tsup-health-{os.getpid()}-guessed"
    planted.symlink_to(victim)
    finding = host.write_latency(tmp_path)
    assert finding.status is Status.UNHEALTHY and "File exists" in finding.evidence
    assert victim.read_text() == "root's\n" and planted.is_symlink(), "not written through, not removed"


def test_any_process_of_an_attempt_left_on_a_node_is_a_leftover_trainer_not_only_the_reference_one(
        tmp_path: Path) -> None:
    """A user's train.sh, torchrun and its workers carry the attempt's marker the launchers
    set; a node's own agent carries it too but is no trainer."""
    marker = f"{tmp_path}/runs/run-1/attempts/3/trainer.json"
    train_sh = subprocess.Popen(["sleep", "60"], env={"PATH": "/usr/bin:/bin", "TSUP_MARKER": marker})
    agent = subprocess.Popen(["sleep", "61"], env={"PATH": "/usr/bin:/bin", "TSUP_MARKER": marker,
                                                   "TSUP_NODE_PROCESS": "1"})
    try:
        wait_for(lambda: psutil.Process(train_sh.pid).environ().get("TSUP_MARKER") == marker, 10, "its environment")
        found = host.leftover_trainers()
        assert found.status is Status.DEGRADED and train_sh.pid in host.trainer_pids(), found
        assert agent.pid not in host.trainer_pids(), "a node's own process is no trainer"
    finally:
        for p in (train_sh, agent):
            p.kill()
            p.wait()
    assert train_sh.pid not in host.trainer_pids()


def test_a_node_sharing_its_host_reports_the_hosts_trainers_and_load_without_judging_them(
        tmp_path: Path) -> None:
    """A trainer process on the host is a leftover of the node that owns the host, and a
    degraded finding; on a node that shares its host with others (the local launcher's,
    a Slurm box's) it is its neighbours' and the load is theirs too: both reported, the
    verdict not moved by them. Through the command line, as the launchers run it."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__main__.py").write_text("import time\ntime.sleep(60)\n")
    other = subprocess.Popen([sys.executable, "-m", "trainer"], cwd=tmp_path)  # cmdline: python -m trainer
    try:
        # Other tests' trainers may run beside this one (the evidence names ten pids).
        own = host.leftover_trainers()
        assert own.status is Status.DEGRADED and other.pid in host.trainer_pids(), own
        shared = host.leftover_trainers(shared=True)
        assert shared.status is Status.HEALTHY and "trainer process(es) running" in shared.evidence
        assert "not judged" in shared.evidence and "not judged" in host.load(shared=True).evidence
        assert "not judged" not in host.load().evidence
        for env, judged in (({}, True), ({host.SHARED_HOST_ENV: "1"}, False)):
            done = subprocess.run([sys.executable, "-m", "health", "--checkpoint-dir", str(tmp_path),
                                   "--min-free-gib", "0", "--json", "--compact"], capture_output=True,
                                  text=True, cwd=REPO, check=False,
                                  env={"PATH": "/usr/bin:/bin", "TSUP_HEALTH_TOOLS": str(tmp_path), **env})
            [left] = [f for f in json.loads(done.stdout)["findings"] if f["probe"] == "leftover_trainers"]
            assert (left["status"] == "degraded") is judged and "trainer process(es) running" in left["evidence"], left
    finally:
        other.kill()
        other.wait()


def test_the_leftover_evidence_names_ten_pids_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "trainer_pids", lambda: list(range(100, 112)))
    found = host.leftover_trainers()
    assert found.status is Status.DEGRADED
    assert found.evidence == ("12 trainer process(es) running: pids 100, 101, 102, 103, 104, 105, 106, 107,"
                              " 108, 109 and 2 more")


def test_the_runs_user_is_known_here_or_the_node_cannot_start_its_processes() -> None:
    assert host.run_user("root").status is Status.HEALTHY and "uid 0" in host.run_user("root").evidence
    missing = host.run_user("tsup-nobody-here")
    assert missing.status is Status.UNHEALTHY and "does not exist on this node" in missing.evidence
