"""Chaos on the local launcher: simulated nodes on this host, real training processes,
real signals, a real mosquitto where the broker is the fault.

Each scenario checks its own verdict; the chaos conftest adds to every one of them that
no two attempts ever ran at once, and ``assert_records`` that SQLite holds the story.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import assert_records
from tests.conftest import REPO, free_port, require, start_mosquitto, stop_by_pid, wait_for
from tests.e2e.conftest import EXAMPLE, Serve, ctl, db_rows, env, summary_of, trainer_processes, tsup
from wire.files import FENCE_FILE

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]


def test_a_frozen_node_is_found_by_its_silence_and_replaced(fault_free: dict[str, Any], state: Path) -> None:
    """SIGSTOP of every process of a node: no exit, no last will for 15 s, only silence."""
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "freeze-node@50")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "node-lost" and fault["nodes"] == ["local-2"]
    assert "silent for" in fault["summary"]
    assert s["drained_nodes"] == ["local-2"]
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1", "local-2"], ["local-1", "local-3"]]
    times = dict(db_rows(state, "SELECT kind, ts FROM events WHERE kind IN ('chaos.injected', 'fault.detected')"))
    # Found by silence ("silent for" above), not by the broker's last wills; how soon is
    # bench/mttr.py's to measure (freeze-node).
    assert times["fault.detected"] > times["chaos.injected"]
    assert trainer_processes(state) == []
    assert_records(state, s, injected=1)


def test_a_hung_rank_is_found_within_the_target_and_the_run_recovers(fault_free: dict[str, Any],
                                                                    state: Path) -> None:
    """SIGSTOP of one rank: the other ranks wait for it in the next all-reduce and every
    rank stops progressing; the adaptive limit finds it within max(10 s, 3 x p99 step time)."""
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "hang-rank@40")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "hang" and fault["ranks"] == [3] and fault["nodes"] == ["local-2"], fault
    # Step 40 is also a checkpoint step: the hang may be judged under the checkpoint
    # allowance (adapted to the saves timed so far) or the step-time one.
    assert "adaptive hang timeout" in fault["summary"] or "checkpoint allowance: max(" in fault["summary"], \
        fault["summary"]
    # How soon (the 10 s target) is bench/mttr.py's to measure (hang-rank); here, the order.
    assert fault["injected_at"] is not None and fault["detected_at"] > fault["injected_at"]
    assert fault["recovered_at"] > fault["detected_at"]
    assert s["drained_nodes"] == [], "a stalled rank is no evidence against its node"
    assert trainer_processes(state) == []
    assert_records(state, s, injected=1)


def test_a_trainer_that_crashes_at_the_same_step_every_time_ends_in_a_crash_loop(state: Path) -> None:
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "crash@25")
    s = summary_of(proc)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert s["state"] == "FAILED" and s["reason"].startswith("crash loop: rank-exit at step 25 in 3 attempts")
    assert s["attempts"] == 3 and [f["step"] for f in s["faults"]] == [25, 25, 25]
    # the trainer said when it injected each crash: detection is measured from there
    assert all(f["detected_at"] > f["injected_at"] for f in s["faults"]), s["faults"]
    assert all("InjectedFault" in f["summary"] for f in s["faults"])
    assert s["drained_nodes"] == [], "a crash the code makes is no node's fault"
    assert trainer_processes(state) == []
    assert_records(state, s, injected=3)


def test_a_nan_loss_rolls_back_to_the_checkpoint_before_it_and_ends_with_the_same_model(
        fault_free: dict[str, Any], state: Path) -> None:
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "nan@60")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "nonfinite" and fault["step"] == 60 and fault["nodes"] == []
    assert fault["detected_at"] > fault["injected_at"], fault
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 40], "rolled back to before step 60"
    assert s["drained_nodes"] == []
    log = (state / "runs" / "run-1" / "attempts" / "1" / "rank-0000.local-1.log").read_text()
    assert "step 60: loss nan is not finite: no checkpoint" in log
    assert_records(state, s, injected=1)


def test_a_persistent_loss_spike_rolls_back_before_it_and_skips_its_data(fault_free: dict[str, Any],
                                                                         state: Path) -> None:
    """spike@60:30: the data of steps 60-89 is bad in every attempt that reads it, so only
    rolling back and stepping over that data window cures it (as PaLM did). The negative
    control of every scenario that compares digests: a run that trained on other data
    ends with another model, so equal digests elsewhere do mean the same trajectory."""
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "spike@60:30")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 80
    assert s["model_digest"] != fault_free["model_digest"], "skipped data: another model"
    [fault] = s["faults"]
    assert fault["kind"] == "spike" and fault["step"] == 60, fault
    assert fault["detected_at"] > fault["injected_at"], "5 spiked steps, then the verdict"
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 40], "rolled back to before the spike"
    [(message, data)] = [(m, json.loads(d)) for m, d in db_rows(
        state, "SELECT message, data FROM events WHERE kind = 'data.skip'")]
    assert (data["start"], data["end"]) == (59 * 16, 109 * 16) and "loss spike from step 60" in message
    log = (state / "runs" / "run-1" / "attempts" / "2" / "rank-0000.local-1.log").read_text()
    assert "step 60: skipping samples 944 to 1744 (data.skip)" in log
    trainer_json = json.loads((state / "runs" / "run-1" / "attempts" / "2" / "trainer.json").read_text())
    assert trainer_json["data"]["skip"] == [[944, 1744]]
    assert_records(state, s)


def _straggler_reports(state: Path) -> list[dict[str, Any]]:
    return [json.loads(d) for (d,) in db_rows(state, "SELECT data FROM events WHERE kind = 'straggler' ORDER BY id")]


def test_a_straggling_node_is_reported_and_left_out_at_the_next_restart(fault_free: dict[str, Any],
                                                                        state: Path) -> None:
    """slow@30:3: from step 30 the node of rank 3 (local-2) computes at half speed. It is
    reported, the run goes on (a straggler alone restarts nothing), and when a rank dies
    at step 60 the next attempt runs on the spare instead of local-2."""
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "slow@30:3",
                "--chaos", "kill-rank@60:0")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    reports = _straggler_reports(state)
    assert {r["node"] for r in reports} == {"local-2"} and 3 in {r["rank"] for r in reports}, reports
    assert {r["attempt"] for r in reports} == {1}, "attempt 2 runs without the slow node: no straggler"
    assert all(r["busy_s"] > 1.25 * r["typical_s"] for r in reports)
    assert [(x["attempt"], x["node"]) for x in s["stragglers"]] == [(1, r["node"]) for r in reports]
    assert [f["kind"] for f in s["faults"]] == ["rank-exit"], "the straggler itself is not a fault"
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1", "local-2"], ["local-1", "local-3"]]
    assert s["drained_nodes"] == [], "a straggler is left out, not drained"
    [(message,)] = db_rows(state, "SELECT message FROM events WHERE kind = 'straggler.left-out'")
    assert message == "leaving out local-2: it straggled in attempt 1"


def test_straggler_restart_replaces_a_straggling_node_with_a_spare(fault_free: dict[str, Any],
                                                                   tmp_path: Path, state: Path) -> None:
    """With [policy] straggler_restart the straggler alone is a fault: the attempt stops
    and the next one runs on the spare, from the newest checkpoint."""
    spec = tmp_path / "spec.toml"
    spec.write_text(EXAMPLE.read_text().replace("[policy]\n", "[policy]\nstraggler_restart = true\n"))
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "slow@30:3")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "straggler" and fault["nodes"] == ["local-2"], fault
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1", "local-2"], ["local-1", "local-3"]]
    assert s["drained_nodes"] == []
    assert_records(state, s)


def test_a_device_fault_reported_by_the_trainer_drains_its_node(fault_free: dict[str, Any], state: Path) -> None:
    """device@50:3: rank 3's accelerator fails (the trainer exits with code 4): its node
    is drained with the trainer's words, and the spare takes its place."""
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "device@50:3")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert (fault["kind"], fault["nodes"], fault["ranks"]) == ("device", ["local-2"], [3])
    assert fault["detected_at"] > fault["injected_at"], fault
    assert s["drained_nodes"] == ["local-2"]
    [(reason,)] = db_rows(state, "SELECT reason FROM nodes WHERE state = 'DRAINED'")
    assert reason.startswith("training-supervisor: device fault reported by the trainer: DeviceFault: "
                             "injected: CUDA error: uncorrectable ECC error encountered after step 50 on rank 3")
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1", "local-2"], ["local-1", "local-3"]]
    assert_records(state, s, injected=1)


def test_kill_rank_then_kill_node_recover_to_the_same_model(fault_free: dict[str, Any], state: Path) -> None:
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "kill-rank@50",
                "--chaos", "kill-node@70")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 80
    assert s["model_digest"] == fault_free["model_digest"], "the faults changed the math"

    kinds = [(f["kind"], f["nodes"]) for f in s["faults"]]
    assert kinds == [("rank-exit", ["local-2"]), ("node-lost", ["local-2"])]
    assert all(f["recovered_at"] and f["recovered_at"] > f["detected_at"] for f in s["faults"])
    assert s["faults"][0]["ranks"] == [3], "the killed rank is blamed, not the ranks that died after it"
    assert s["drained_nodes"] == ["local-2"], "only the lost node is drained"
    assert s["attempts"] == 3
    history = s["attempt_history"]
    assert [a["resume_step"] for a in history] == [0, 40, 60]
    assert history[1]["nodes"] == ["local-1", "local-2"]  # a rank's death keeps the nodes
    assert history[2]["nodes"] == ["local-1", "local-3"]  # the spare replaces the lost node
    assert s["goodput"]["lost_steps"] > 0 and s["ettr"] < fault_free["ettr"]

    # Everything is in SQLite, and nothing is left running.
    assert db_rows(state, "SELECT number, outcome FROM attempts ORDER BY number") == [
        (1, "FAILED"), (2, "FAILED"), (3, "SUCCEEDED")]
    events = [k for (k,) in db_rows(state, "SELECT kind FROM events ORDER BY id")]
    assert events.count("chaos.injected") == 2 and events.count("fault.detected") == 2
    assert events.count("node.drained") == 1 and events.count("run.recovered") == 2
    assert db_rows(state, "SELECT reason FROM nodes WHERE state = 'DRAINED'")[0][0].startswith(
        "training-supervisor: node lost")
    assert trainer_processes(state) == []
    # the human progress stream told the story
    assert "fault.detected" in proc.stderr and "run.recovered" in proc.stderr
    assert_records(state, s, injected=2)


def test_warm_standbys_become_the_next_attempts_ranks_and_are_replaced(fault_free: dict[str, Any],
                                                                      state: Path, tmp_path: Path) -> None:
    """[resources] standby: every rank of each resumed attempt is a process that was
    waiting, torch imported, before the fault; the ones the first recovery used are
    replaced in time for the second. Same model; no standby outlives the run."""
    spec = tmp_path / "standby.toml"
    spec.write_text(EXAMPLE.read_text().replace("spares = 1", "spares = 1\nstandby = true"))
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-rank@30", "--chaos", "kill-node@75")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert [(f["kind"], f["nodes"]) for f in s["faults"]] == [("rank-exit", ["local-2"]), ("node-lost", ["local-2"])]
    assert [a["nodes"] for a in s["attempt_history"]] == [
        ["local-1", "local-2"], ["local-1", "local-2"], ["local-1", "local-3"]]
    attempts = state / "runs" / "run-1" / "attempts"
    became: dict[int, set[str]] = {}
    for n in (1, 2, 3):
        for log in sorted((attempts / str(n)).glob("rank-*.log")):
            first = (log.read_text().splitlines() or [""])[0]
            m = re.match(r"standby: pid (\d+) is rank (\d+) of attempt (\d+)", first)
            if m:
                assert (m[2], m[3]) == (log.name[5:9].lstrip("0") or "0", str(n)), first
                became.setdefault(n, set()).add(m[1])
    assert 1 not in became, "the first attempt starts cold: nothing was waiting yet"
    assert len(became.get(2, ())) == 4 and len(became.get(3, ())) == 4, became
    # local-1's standbys became ranks 0 and 1 of attempt 2: those of attempt 3 are their replacements
    assert not became[2] & became[3], "a used standby is not used again"
    assert trainer_processes(state) == [], "no standby outlives its run"
    assert_records(state, s, injected=2)


def _memory_tier_spec(tmp_path: Path, spares: int = 1) -> Path:
    """The example with the memory tier every 5 steps and persistent saves beside training."""
    spec = tmp_path / "memory.toml"
    spec.write_text(EXAMPLE.read_text().replace("spares = 1", f"spares = {spares}")
                    .replace("keep = 3", "keep = 3\nmemory_every_steps = 5\nasynchronous = true"))
    return spec


def test_a_node_lost_while_the_next_node_holds_its_replica_resumes_from_memory(
        fault_free: dict[str, Any], state: Path, tmp_path: Path) -> None:
    """kill-node@47 takes local-2 and its memory; local-1 holds the replicas of its ranks
    (and its own), so attempt 2 on local-1 and the spare resumes from memory at step 45,
    not from the persistent checkpoint of step 40. Same model."""
    proc = tsup("run", _memory_tier_spec(tmp_path), "--state-dir", state, "--json", "--chaos", "kill-node@47")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert [(f["kind"], f["nodes"]) for f in s["faults"]] == [("node-lost", ["local-2"])]
    first, second = s["attempt_history"]
    assert second["nodes"] == ["local-1", "local-3"]
    # The memory save of step 45 (or of 50, if it was whole before the kill landed).
    assert second["resume_from"] in ("memory:1:45", "memory:1:50"), second
    assert second["resume_step"] > 40, "fewer steps redone than from the persistent checkpoint"
    log = (state / "runs" / "run-1" / "attempts" / "2" / "rank-0000.local-1.log").read_text()
    assert f"resumed from memory:1:{second['resume_step']} at step {second['resume_step']} in " in log
    saves = db_rows(state, "SELECT attempt, step FROM memory_checkpoints ORDER BY attempt, step")
    assert (1, second["resume_step"]) in saves and {a for a, _ in saves} <= {1, 2}
    assert trainer_processes(state) == []
    assert_records(state, s, injected=1)


def test_a_node_lost_with_the_node_that_holds_its_replica_falls_back_to_the_persistent_checkpoint(
        fault_free: dict[str, Any], state: Path, tmp_path: Path) -> None:
    """Both nodes die at step 47: each held the other's replicas, so rank state is on no
    node of the next attempt. The supervisor says so and resumes from the persistent
    checkpoint of step 40, on the two spares. Same model."""
    proc = tsup("run", _memory_tier_spec(tmp_path, spares=2), "--state-dir", state, "--json",
                "--chaos", "kill-node@47:0", "--chaos", "kill-node@47:1")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert sorted(s["drained_nodes"]) == ["local-1", "local-2"]
    last = s["attempt_history"][-1]
    assert last["nodes"] == ["local-3", "local-4"] and last["resume_step"] == 40, s["attempt_history"]
    assert last["resume_from"].endswith("step_00000040")
    lost = db_rows(state, "SELECT message FROM events WHERE kind = 'memory.lost'")
    assert lost and "cannot be resumed from" in lost[0][0], lost
    assert trainer_processes(state) == []


def test_a_node_lost_with_no_spare_and_no_node_to_get_continues_on_fewer_ranks(
        fault_free: dict[str, Any], state: Path, tmp_path: Path) -> None:
    """No spare, and a cluster of 2 nodes: after kill-node@47 the supervisor asks for a
    node, none comes within shrink_after_s, and attempt 2 goes on with local-1's 2 ranks
    alone, from the 4-rank checkpoint of step 40 resharded, the global batch of 16 now 2 x
    8. It finishes with the loss of the fault-free run, up to rounding: the same samples
    in the same steps, summed in another order."""
    spec = tmp_path / "no-spare.toml"
    spec.write_text(EXAMPLE.read_text().replace("spares = 1", "spares = 0")
                    .replace("[policy]", "[policy]\nshrink_after_s = 2"))
    proc = tsup("run", spec, "--state-dir", state, "--json", "--local-nodes", "2", "--chaos", "kill-node@47")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 80
    assert [(f["kind"], f["nodes"]) for f in s["faults"]] == [("node-lost", ["local-2"])]
    first, second = s["attempt_history"]
    assert first["nodes"] == ["local-1", "local-2"] and second["nodes"] == ["local-1"]
    assert second["resume_step"] == 40
    [shrunk] = db_rows(state, "SELECT message FROM events WHERE kind = 'run.shrunk'")
    assert "continuing on 1 of 2 nodes" in shrunk[0]
    log = (state / "runs" / "run-1" / "attempts" / "2" / "rank-0000.local-1.log").read_text()
    assert "resharding step_00000040 from 4 to 2 ranks" in log
    result = json.loads(next((state / "runs" / "run-1").rglob("result.json")).read_text())
    assert result["world_size"] == 2 and result["consumed_samples"] == 80 * 16
    assert result["final_loss"] == pytest.approx(fault_free["loss"], rel=1e-3)
    assert s["loss"] == pytest.approx(result["final_loss"])
    assert trainer_processes(state) == []


def test_a_shrunk_run_grows_back_when_its_node_returns(state: Path, tmp_path: Path) -> None:
    """As above, then the operator returns local-2 (`supervisorctl undrain`) while attempt
    2 trains on local-1 alone: the supervisor takes the node, and once attempt 2 has
    committed a checkpoint of its own it stops it (an interruption, not a fault); attempt 3
    resumes that 2-rank checkpoint resharded and finishes on both nodes, 4 ranks again."""
    spec = tmp_path / "grow.toml"
    spec.write_text(EXAMPLE.read_text().replace("spares = 1", "spares = 0").replace("steps = 80", "steps = 400")
                    .replace("[policy]", "[policy]\nshrink_after_s = 2"))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli.daemon", "run", str(spec), "--state-dir", str(state),
                             "--json", "--quiet", "--local-nodes", "2", "--api-port", str(port),
                             "--chaos", "kill-node@47"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(), cwd=REPO)
    try:
        wait_for(lambda: _events(state, "run.shrunk"), 240, "the run to shrink")
        wait_for(lambda: db_rows(state, "SELECT 1 FROM attempts WHERE number = 2 AND first_step_at IS NOT NULL"),
                 120, "attempt 2 to train")
        undrained = ctl(f"http://127.0.0.1:{port}", "undrain", "local-2", "--json",
                        extra_env={"TSUP_API_TOKEN_FILE": str(state / "api-token")})
        assert undrained.returncode == 0, undrained.stderr
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    s = json.loads(out)
    assert proc.returncode == 0 and s["state"] == "SUCCEEDED", err[-3000:]
    nodes = [a["nodes"] for a in s["attempt_history"]]
    assert nodes == [["local-1", "local-2"], ["local-1"], ["local-1", "local-2"]], s["attempt_history"]
    assert s["attempt_history"][1]["outcome"] == "INTERRUPTED"
    [grow] = db_rows(state, "SELECT message FROM events WHERE kind = 'run.grow'")
    assert "growing back to 2 nodes: local-2 joined the 1 of attempt 2" in grow[0]
    third = s["attempt_history"][2]
    assert third["resume_step"] > 40 and third["resume_step"] % 20 == 0, s["attempt_history"]
    log = (state / "runs" / "run-1" / "attempts" / "3" / "rank-0000.local-1.log").read_text()
    assert f"resharding step_{third['resume_step']:08d} from 2 to 4 ranks" in log, log[:2000]
    result = json.loads(next((state / "runs" / "run-1").rglob("result.json")).read_text())
    assert (result["world_size"], result["final_step"]) == (4, 400)
    assert trainer_processes(state) == []


def test_a_30_s_broker_outage_mid_run_restarts_nothing_and_drains_nothing(tmp_path: Path, state: Path) -> None:
    """The broker (a real mosquitto) is stopped for 30 s while the trainers train: no
    telemetry is no evidence. Verdicts pause, and resume once the link is back. Sized by
    steps after the outage, not by wall time: a run too long to end, interrupted (SIGINT,
    as Ctrl-C: cancelled, exit 130) once 50 steps were heard after the broker came back."""
    broker, broker_proc = start_mosquitto(tmp_path)
    spec = tmp_path / "long.toml"
    spec.write_text(EXAMPLE.read_text().replace("steps = 80", "steps = 100000")
                    + f'\n[telemetry]\nmqtt_url = "{broker.url}"\n')
    run = subprocess.Popen([sys.executable, "-m", "cli.daemon", "run", str(spec), "--state-dir", str(state),
                            "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                           cwd=REPO)
    try:
        def metrics() -> int:
            try:
                return int(db_rows(state, "SELECT count(*) FROM metrics")[0][0])
            except sqlite3.OperationalError:  # not created yet
                return 0

        wait_for(lambda: metrics() >= 30, 120, "30 steps of training")
        stop_by_pid(broker_proc)
        down_at = time.time()
        time.sleep(30)
        broker_proc = start_mosquitto(tmp_path, port=broker.port)[1]
        up_at = time.time()

        def heard_after() -> int:
            return int(db_rows(state, f"SELECT count(*) FROM metrics WHERE received_at > {up_at}")[0][0])

        wait_for(lambda: heard_after() >= 50, 180, "50 steps heard after the outage")
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
        stop_by_pid(broker_proc)
    assert run.returncode == 130, err[-3000:]
    s = json.loads(out)
    assert s["state"] == "CANCELLED" and s["reason"] == "cancelled by operator"
    assert (s["attempts"], s["faults"], s["drained_nodes"]) == (1, [], [])
    steps = [r[0] for r in db_rows(state, "SELECT step FROM metrics ORDER BY step")]
    assert steps[:30] == list(range(1, 31)), "one attempt, from the start"
    late = db_rows(state, f"SELECT min(step) FROM metrics WHERE received_at > {down_at}")[0][0]
    assert late is not None and late > 30, "training went on while the broker was down"
    assert_records(state, s)


def test_a_corrupt_newest_checkpoint_before_a_fault_is_passed_over_for_the_one_before(
        fault_free: dict[str, Any], state: Path) -> None:
    """corrupt-ckpt@50 flips bytes inside a shard of step 40's checkpoint (it still looks
    complete, and its size is right), then a rank dies: the next attempt finds the shard
    differs from the checkpoint's manifest (exit code 3), so the one after it resumes
    from step 20 and never tries step 40 again."""
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "corrupt-ckpt@50",
                "--chaos", "kill-rank@50")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert [f["kind"] for f in s["faults"]] == ["rank-exit", "checkpoint"]
    assert "the checkpoint at step 40 cannot be read" in s["faults"][1]["summary"]
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 40, 20]
    assert s["drained_nodes"] == [], "a torn checkpoint is no node's fault"
    [(message,)] = db_rows(state, "SELECT message FROM events WHERE kind = 'chaos.injected' "
                                  "AND message LIKE '%corrupt-ckpt%'")
    assert "step_00000040" in message and "flipped" in message
    log = (state / "runs" / "run-1" / "attempts" / "2" / "rank-0000.local-1.log").read_text()
    assert "step_00000040: not what was written" in log and "BLAKE3" in log, log[-2000:]
    assert_records(state, s, injected=2)


def test_a_checkpoint_that_loads_but_is_not_what_was_saved_is_caught_by_the_resumed_loss(
        fault_free: dict[str, Any], state: Path) -> None:
    """tamper-ckpt@40 saves step 40 with one weight changed (it loads fine), then a rank
    dies at step 50: the attempt that resumes from step 40 reports a loss for step 41 that
    differs from attempt 1's, so step 40 is quarantined and the run goes back to step 20,
    ending with the fault-free model."""
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "tamper-ckpt@40",
                "--chaos", "kill-rank@50")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert [f["kind"] for f in s["faults"]] == ["rank-exit", "checkpoint"], s["faults"]
    assert s["faults"][1]["summary"].startswith("resume diverged: step 41 after resuming from step 40 has loss ")
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 40, 20]
    assert s["drained_nodes"] == []
    assert_records(state, s, injected=2)


def test_a_rank_killed_in_the_middle_of_a_checkpoint_save_leaves_no_checkpoint_behind(
        fault_free: dict[str, Any], state: Path) -> None:
    """kill-in-save@40:3: rank 3 is SIGKILLed with its shards of step 40 written and the
    checkpoint not committed. Step 40 never counts as a checkpoint: the run resumes from
    step 20 and ends with the fault-free model."""
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "kill-in-save@40:3")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "rank-exit" and fault["ranks"] == [3] and "SIGKILL" in fault["summary"]
    assert fault["detected_at"] > fault["injected_at"], fault
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 20], "the torn save at 40 is not resumed from"
    assert s["drained_nodes"] == []
    committed = [json.loads(d)["step"] for (d,) in db_rows(
        state, "SELECT data FROM events WHERE kind = 'checkpoint.committed' ORDER BY id")]
    assert committed == [20, 40, 60, 80], "step 40 was saved again, by attempt 2"
    assert_records(state, s, injected=1)


def test_two_faults_in_quick_succession_recover_to_the_same_model(fault_free: dict[str, Any], state: Path) -> None:
    """A rank dies at step 45 (the run goes back to step 40); 8 steps into the next
    attempt, at step 48, a whole node dies."""
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", "--chaos", "kill-rank@45:0",
                "--chaos", "kill-node@48")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert [(f["kind"], f["nodes"]) for f in s["faults"]] == [("rank-exit", ["local-1"]), ("node-lost", ["local-2"])]
    first, second = s["faults"]
    assert second["injected_at"] > first["recovered_at"], "the second fault came after the first recovered"
    assert s["drained_nodes"] == ["local-2"]
    assert [a["nodes"] for a in s["attempt_history"]] == [
        ["local-1", "local-2"], ["local-1", "local-2"], ["local-1", "local-3"]]
    assert_records(state, s, injected=2)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small tmpfs at ``path``, unmounted at the end (root only)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
    require("a tmpfs mount (root)", mounted.returncode == 0)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_checkpoint_filesystem_stops_the_run_and_resume_finishes_it(
        fault_free: dict[str, Any], tmp_path: Path, state: Path) -> None:
    """Checkpoints go to a 5 MB file system: steps 20 and 40 fit (1.9 MB each), step 60
    does not. The trainer says so (exit code 5), the run ends FAILED with that reason and
    no node drained, and the partial save is gone. Once there is room, `supervisorctl
    resume` finishes the run from step 40, with the fault-free model."""
    with tmpfs(tmp_path / "ckpt", "5m") as ckpt:
        spec = tmp_path / "spec.toml"
        spec.write_text(EXAMPLE.read_text().replace("keep = 3\n", f'keep = 3\ndir = "{ckpt}"\n'))
        daemon = Serve(state, free_port())
        try:
            run_id = daemon.ctl_json("submit", str(spec))["run_id"]
            failed = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("FAILED", "SUCCEEDED")
                              and d, 240, "the run to stop")
            assert failed["state"] == "FAILED", failed
            assert failed["reason"].startswith("not retrying: checkpoint storage full (exit code 5): ")
            assert "No space left on device" in failed["reason"] and "free space, then resume" in failed["reason"]
            assert [f["kind"] for f in failed["faults"]] == ["storage"]
            assert sorted(p.name for p in ckpt.iterdir()) == [FENCE_FILE, "step_00000020", "step_00000040"], \
                "the partial save of step 60 was removed (the live attempt's fence stays)"
            assert db_rows(state, "SELECT count(*) FROM nodes WHERE state = 'DRAINED'")[0][0] == 0

            subprocess.run(["mount", "-o", "remount,size=64m", str(ckpt)], check=True)
            assert daemon.ctl("resume", run_id).returncode == 0
            done = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("FAILED", "SUCCEEDED")
                            and d, 240, "the resumed run to finish")
        finally:
            daemon.kill(signal.SIGTERM)
    assert done["state"] == "SUCCEEDED", done
    assert done["model_digest"] == fault_free["model_digest"]
    assert [a["resume_step"] for a in done["attempt_history"]] == [0, 40]


def _events(state: Path, kind: str) -> int:
    try:
        return int(db_rows(state, f"SELECT count(*) FROM events WHERE kind = '{kind}'")[0][0])
    except sqlite3.OperationalError:  # not created yet
        return 0


def test_sigkill_of_the_supervisor_at_random_points_loses_nothing(
        request: pytest.FixtureRequest, fault_free: dict[str, Any], tmp_path: Path, state: Path) -> None:
    """The daemon is SIGKILLed four times and started again each time: at a random moment
    of the first attempt's launch, at a random step of its training, the instant the
    fault (kill-in-save@40:3, a rank's SIGKILL) is detected, that is mid-recovery, and a
    random moment after that while the next attempt starts. The run ends with the
    fault-free model; every kill lost nothing: one fault on record, no attempt left open,
    never two attempts at once (the watch)."""
    rng = random.Random(request.config.getoption("--seed"))
    spec = tmp_path / "spec.toml"
    spec.write_text(EXAMPLE.read_text().replace('name = "tiny-llama"\n',
                                                'name = "tiny-llama"\nchaos = ["kill-in-save@40:3"]\n'))
    port = free_port()
    daemon = Serve(state, port)
    kills: list[str] = []

    def kill_and_restart(when: str) -> Serve:
        assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
        kills.append(when)
        return Serve(state, port)

    try:
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]
        wait_for(lambda: _events(state, "attempt.launching") >= 1, 60, "the first launch")
        time.sleep(rng.uniform(0, 2))
        daemon = kill_and_restart("launch")
        step = rng.randint(5, 35)
        wait_for(lambda: (daemon.read("status", run_id)["step"] or 0) >= step, 120, f"step {step}")
        daemon = kill_and_restart(f"step {step}")
        wait_for(lambda: _events(state, "fault.detected") >= 1, 120, "the fault's detection", interval_s=0.02)
        daemon = kill_and_restart("fault detected")
        time.sleep(rng.uniform(0, 5))
        daemon = kill_and_restart("recovery")
        final = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED")
                         and d, 300, "the run to end")
    finally:
        daemon.kill(signal.SIGTERM)
    assert final["state"] == "SUCCEEDED", (kills, final)
    assert final["model_digest"] == fault_free["model_digest"]
    # One fault. Its blame is rank 3 when its death left evidence (its exit seen by a
    # daemon, or its last will). When it died while no daemon was up (the kill-in-save and
    # a daemon kill can coincide, and the embedded broker, with the last will it held,
    # dies with the daemon), rank 3 left no trace: the rule blames the earliest exit a
    # rank reported of its own, or, when the next daemon found every rank already gone
    # with no report, every rank (at no known step).
    [fault] = final["faults"]
    assert fault["kind"] == "rank-exit", (kills, fault)
    assert 3 in fault["ranks"] or "exited with code" in fault["summary"], (kills, fault)
    assert final["drained_nodes"] == [], "a daemon's death is no node's fault"
    assert db_rows(state, "SELECT count(*) FROM events WHERE kind = 'daemon.started'")[0][0] == 5
    outcomes = [o for (o,) in db_rows(state, "SELECT outcome FROM attempts ORDER BY number")]
    assert outcomes[-1] == "SUCCEEDED" and all(o in ("FAILED", "ABORTED") for o in outcomes[:-1]), outcomes
    assert_records(state, final)  # SQLite holds each attempt, fault and event once; each resume's step
    assert trainer_processes(state) == []


def mixed_faults(seed: int) -> tuple[list[str], list[str]]:
    """A random but valid mix of 2 or 3 faults that the model must not notice, and the
    nodes it should drain. At most one fault takes a node (there is one spare); steps
    are 6 or more apart, so no two faults land in one observation. Each item makes one
    fault; ``corrupt-ckpt@S`` comes with ``kill-rank@S`` (two faults: the rank's, then
    the unreadable checkpoint's), at a step past a checkpoint and not on one."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(12, 72, 6), rng.choice((2, 3))))
    node_fault_at = rng.choice([*steps, None])
    chaos: list[str] = []
    drained: list[str] = []
    saves: set[int] = set()
    for step in steps:
        rank = rng.randrange(4)
        if step == node_fault_at:
            kind = rng.choice(("kill-node", "freeze-node", "device"))
            chaos.append(f"device@{step}:{rank}" if kind == "device" else f"{kind}@{step}")
            drained.append(f"local-{rank // 2 + 1}" if kind == "device" else "local-2")
            continue
        kind = rng.choice(("kill-rank", "hang-rank", "nan", "kill-in-save", "corrupt-ckpt"))
        save = 20 * max(1, round(step / 20))
        if kind == "kill-in-save" and save not in saves:
            saves.add(save)
            chaos.append(f"kill-in-save@{save}:{rank}")
        elif kind == "corrupt-ckpt" and step > 20 and step % 20:
            chaos += [f"corrupt-ckpt@{step}", f"kill-rank@{step}:{rank}"]
        elif kind == "nan":
            chaos.append(f"nan@{step}")
        else:
            chaos.append(f"{'hang-rank' if kind == 'hang-rank' else 'kill-rank'}@{step}:{rank}")
    return chaos, drained


def test_a_seeded_mix_of_faults(request: pytest.FixtureRequest, fault_free: dict[str, Any], state: Path) -> None:
    """`pytest tests/chaos --seed N`: a mix of faults drawn from N (the same N, the same
    mix). Whatever the mix, the run ends with the fault-free model, each fault is found
    and recovered from, and exactly the node a node fault took is drained."""
    seed = request.config.getoption("--seed")
    chaos, drained = mixed_faults(seed)
    args = [a for c in chaos for a in ("--chaos", c)]
    proc = tsup("run", EXAMPLE, "--state-dir", state, "--json", *args)
    s = summary_of(proc)
    assert proc.returncode == 0, (chaos, proc.stderr[-3000:])
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"], chaos
    assert s["drained_nodes"] == drained, (chaos, s["faults"])
    assert len(s["faults"]) == len(chaos), (chaos, s["faults"])
    assert_records(state, s, injected=len(chaos))


@pytest.mark.parametrize(("chaos", "kind"), [("kill-rank@50", "rank-exit"), ("hang-rank@40", "hang")])
def test_node_aggregated_telemetry_finds_the_fault_and_recovers_to_the_same_digest(
        fault_free: dict[str, Any], tmp_path: Path, state: Path, chaos: str, kind: str) -> None:
    """[telemetry] aggregate = "node": heartbeats and all step metrics but rank 0's go
    through each node's local rank 0. A killed rank, and a stopped one whose slot goes
    stale, are still found and blamed; rank 0's loss curve is whole."""
    spec = tmp_path / "node.toml"
    spec.write_text(EXAMPLE.read_text() + '\n[telemetry]\naggregate = "node"\n')
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", chaos)
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == kind and fault["ranks"] == [3] and fault["nodes"] == ["local-2"], fault
    assert s["drained_nodes"] == []
    steps = [r[0] for r in db_rows(state, "SELECT DISTINCT step FROM metrics ORDER BY step")]
    assert steps == list(range(1, 81)), "global rank 0 still sends every step's metrics"
    assert_records(state, s, injected=1)
