"""`training-supervisor run`: real tiny training, killed by real signals, recovered."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conftest import REPO, Broker, start_mosquitto, stop_by_pid, wait_for
from tests.e2e.conftest import EXAMPLE, db_rows, env, summary_of, trainer_processes, tsup
from tests.fake_tools.replay import make_tools

pytestmark = pytest.mark.e2e


def test_fault_free_run_succeeds_with_a_digest(fault_free: dict[str, Any]) -> None:
    s = fault_free
    assert (s["state"], s["final_step"], s["attempts"], s["faults"]) == ("SUCCEEDED", 80, 1, [])
    assert re.fullmatch(r"[0-9a-f]{64}", s["model_digest"])
    assert 0 < s["ettr"] <= 1
    assert s["goodput"]["kept_steps"] == 80 and s["goodput"]["lost_steps"] == 0
    assert s["stragglers"] == [], "ranks of equal speed are never stragglers"


def test_a_frozen_node_is_found_by_its_silence_and_replaced(fault_free: dict[str, Any], tmp_path: Path) -> None:
    """SIGSTOP of every process of a node: no exit, no last will for 15 s, only silence."""
    proc = tsup("run", EXAMPLE, "--state-dir", tmp_path, "--json", "--chaos", "freeze-node@50")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "node-lost" and fault["nodes"] == ["local-2"]
    assert "silent for" in fault["summary"]
    assert s["drained_nodes"] == ["local-2"]
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1", "local-2"], ["local-1", "local-3"]]
    times = dict(db_rows(tmp_path, "SELECT kind, ts FROM events WHERE kind IN ('chaos.injected', 'fault.detected')"))
    # found by silence: 10 s (the default) after the last message, which came up to one
    # heartbeat (1 s) before the freeze; before the broker's keepalive fires the wills (15 s)
    assert 9 <= times["fault.detected"] - times["chaos.injected"] < 15
    assert trainer_processes(tmp_path) == []


def test_a_hung_rank_is_found_within_the_target_and_the_run_recovers(fault_free: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    """SIGSTOP of one rank: the other ranks wait for it in the next all-reduce and every
    rank stops progressing; the adaptive limit finds it within max(10 s, 3 x p99 step time)."""
    proc = tsup("run", EXAMPLE, "--state-dir", tmp_path, "--json", "--chaos", "hang-rank@40")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "hang" and fault["ranks"] == [3] and fault["nodes"] == ["local-2"], fault
    # Step 40 is also a checkpoint step: the hang may be judged under the checkpoint
    # allowance (adapted to the saves timed so far) or the step-time one.
    assert "adaptive hang timeout" in fault["summary"] or "slowest save" in fault["summary"], fault["summary"]
    p99 = re.search(r"p99 step time ([0-9.]+) s", fault["summary"])
    target = max(10.0, 3 * float(p99.group(1))) if p99 else 10.0
    assert fault["injected_at"] is not None
    assert 0 < fault["detected_at"] - fault["injected_at"] <= target
    assert fault["recovered_at"] > fault["detected_at"]
    assert s["drained_nodes"] == [], "a stalled rank is no evidence against its node"
    assert trainer_processes(tmp_path) == []


def test_a_trainer_that_crashes_at_the_same_step_every_time_ends_in_a_crash_loop(tmp_path: Path) -> None:
    proc = tsup("run", EXAMPLE, "--state-dir", tmp_path, "--json", "--chaos", "crash@25")
    s = summary_of(proc)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert s["state"] == "FAILED" and s["reason"].startswith("crash loop: rank-exit at step 25 in 3 attempts")
    assert s["attempts"] == 3 and [f["step"] for f in s["faults"]] == [25, 25, 25]
    # the trainer said when it injected each crash: detection is measured from there
    assert all(0 < f["detected_at"] - f["injected_at"] < 5 for f in s["faults"]), s["faults"]
    assert all("InjectedFault" in f["summary"] for f in s["faults"])
    assert s["drained_nodes"] == [], "a crash the code makes is no node's fault"
    assert trainer_processes(tmp_path) == []


def test_a_nan_loss_rolls_back_to_the_checkpoint_before_it_and_ends_with_the_same_model(
        fault_free: dict[str, Any], tmp_path: Path) -> None:
    proc = tsup("run", EXAMPLE, "--state-dir", tmp_path, "--json", "--chaos", "nan@60")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "nonfinite" and fault["step"] == 60 and fault["nodes"] == []
    assert 0 < fault["detected_at"] - fault["injected_at"] < 5, fault
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 40], "rolled back to before step 60"
    assert s["drained_nodes"] == []
    log = (tmp_path / "runs" / "run-1" / "attempts" / "1" / "rank-0000.local-1.log").read_text()
    assert "step 60: loss nan is not finite: no checkpoint" in log


def test_a_persistent_loss_spike_rolls_back_before_it_and_skips_its_data(tmp_path: Path) -> None:
    """spike@60:30: the data of steps 60-89 is bad in every attempt that reads it, so only
    rolling back and stepping over that data window cures it (as PaLM did)."""
    proc = tsup("run", EXAMPLE, "--state-dir", tmp_path, "--json", "--chaos", "spike@60:30")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 80
    [fault] = s["faults"]
    assert fault["kind"] == "spike" and fault["step"] == 60, fault
    assert 0 < fault["detected_at"] - fault["injected_at"] < 10, "5 spiked steps, then the verdict"
    assert [a["resume_step"] for a in s["attempt_history"]] == [0, 40], "rolled back to before the spike"
    [(message, data)] = [(m, json.loads(d)) for m, d in db_rows(
        tmp_path, "SELECT message, data FROM events WHERE kind = 'data.skip'")]
    assert (data["start"], data["end"]) == (59 * 16, 109 * 16) and "loss spike from step 60" in message
    log = (tmp_path / "runs" / "run-1" / "attempts" / "2" / "rank-0000.local-1.log").read_text()
    assert "step 60: skipping samples 944 to 1744 (data.skip)" in log
    trainer_json = json.loads((tmp_path / "runs" / "run-1" / "attempts" / "2" / "trainer.json").read_text())
    assert trainer_json["data"]["skip"] == [[944, 1744]]


def _straggler_reports(state: Path) -> list[dict[str, Any]]:
    return [json.loads(d) for (d,) in db_rows(state, "SELECT data FROM events WHERE kind = 'straggler' ORDER BY id")]


def test_a_straggling_node_is_reported_and_left_out_at_the_next_restart(fault_free: dict[str, Any],
                                                                        tmp_path: Path) -> None:
    """slow@30:3: from step 30 the node of rank 3 (local-2) computes at half speed. It is
    reported, the run goes on (a straggler alone restarts nothing), and when a rank dies
    at step 60 the next attempt runs on the spare instead of local-2."""
    proc = tsup("run", EXAMPLE, "--state-dir", tmp_path, "--json", "--chaos", "slow@30:3",
                "--chaos", "kill-rank@60:0")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    reports = _straggler_reports(tmp_path)
    assert {r["node"] for r in reports} == {"local-2"} and 3 in {r["rank"] for r in reports}, reports
    assert {r["attempt"] for r in reports} == {1}, "attempt 2 runs without the slow node: no straggler"
    assert all(r["busy_s"] > 1.25 * r["typical_s"] for r in reports)
    assert [(x["attempt"], x["node"]) for x in s["stragglers"]] == [(1, r["node"]) for r in reports]
    assert [f["kind"] for f in s["faults"]] == ["rank-exit"], "the straggler itself is not a fault"
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1", "local-2"], ["local-1", "local-3"]]
    assert s["drained_nodes"] == [], "a straggler is left out, not drained"
    [(message,)] = db_rows(tmp_path, "SELECT message FROM events WHERE kind = 'straggler.left-out'")
    assert message == "leaving out local-2: it straggled in attempt 1"


def test_straggler_restart_replaces_a_straggling_node_with_a_spare(fault_free: dict[str, Any],
                                                                   tmp_path: Path) -> None:
    """With [policy] straggler_restart the straggler alone is a fault: the attempt stops
    and the next one runs on the spare, from the newest checkpoint."""
    spec = tmp_path / "spec.toml"
    spec.write_text(EXAMPLE.read_text().replace("[policy]\n", "[policy]\nstraggler_restart = true\n"))
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "slow@30:3")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert fault["kind"] == "straggler" and fault["nodes"] == ["local-2"], fault
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1", "local-2"], ["local-1", "local-3"]]
    assert s["drained_nodes"] == []


def test_a_device_fault_reported_by_the_trainer_drains_its_node(fault_free: dict[str, Any], tmp_path: Path) -> None:
    """device@50:3: rank 3's accelerator fails (the trainer exits with code 4): its node
    is drained with the trainer's words, and the spare takes its place."""
    proc = tsup("run", EXAMPLE, "--state-dir", tmp_path, "--json", "--chaos", "device@50:3")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    [fault] = s["faults"]
    assert (fault["kind"], fault["nodes"], fault["ranks"]) == ("device", ["local-2"], [3])
    assert 0 < fault["detected_at"] - fault["injected_at"] < 5, fault
    assert s["drained_nodes"] == ["local-2"]
    [(reason,)] = db_rows(tmp_path, "SELECT reason FROM nodes WHERE state = 'DRAINED'")
    assert reason.startswith("training-supervisor: device fault reported by the trainer: DeviceFault: "
                             "injected: CUDA error: uncorrectable ECC error encountered after step 50 on rank 3")
    assert [a["nodes"] for a in s["attempt_history"]] == [["local-1", "local-2"], ["local-1", "local-3"]]


def test_kill_rank_then_kill_node_recover_to_the_same_model(fault_free: dict[str, Any], tmp_path: Path) -> None:
    proc = tsup("run", EXAMPLE, "--state-dir", tmp_path, "--json", "--chaos", "kill-rank@50",
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
    assert db_rows(tmp_path, "SELECT number, outcome FROM attempts ORDER BY number") == [
        (1, "FAILED"), (2, "FAILED"), (3, "SUCCEEDED")]
    events = [k for (k,) in db_rows(tmp_path, "SELECT kind FROM events ORDER BY id")]
    assert events.count("chaos.injected") == 2 and events.count("fault.detected") == 2
    assert events.count("node.drained") == 1 and events.count("run.recovered") == 2
    assert db_rows(tmp_path, "SELECT reason FROM nodes WHERE state = 'DRAINED'")[0][0].startswith(
        "training-supervisor: node lost")
    assert trainer_processes(tmp_path) == []
    # the human progress stream told the story
    assert "fault.detected" in proc.stderr and "run.recovered" in proc.stderr


def test_an_external_mosquitto_carries_telemetry_and_supervisor_events(mosquitto: Broker, tmp_path: Path) -> None:
    spec = tmp_path / "small.toml"
    spec.write_text(EXAMPLE.read_text().replace("steps = 80", "steps = 30").replace("nodes = 2", "nodes = 1")
                    + f'\n[telemetry]\nmqtt_url = "{mosquitto.url}"\n')
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()

    def on_message(_c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
        with lock:
            seen.append(json.loads(msg.payload))

    sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="dashboard")
    sub.on_message = on_message
    sub.connect(mosquitto.host, mosquitto.port)
    sub.subscribe("tsup/v1/events/#", qos=1)
    sub.loop_start()
    try:
        proc = tsup("run", spec, "--state-dir", tmp_path / "state", "--json")
        s = summary_of(proc)
        assert proc.returncode == 0 and s["state"] == "SUCCEEDED" and s["final_step"] == 30
        metrics = db_rows(tmp_path / "state", "SELECT count(*) FROM metrics")[0][0]
        assert metrics == 30, "every step's metrics came through mosquitto"
    finally:
        sub.loop_stop()
        sub.disconnect()
    with lock:
        kinds = [e["kind"] for e in seen]
    assert "run.submitted" in kinds and "attempt.started" in kinds


def test_a_30_s_broker_outage_mid_run_restarts_nothing_and_drains_nothing(tmp_path: Path) -> None:
    """The broker (a real mosquitto) is stopped for 30 s while the trainers train: no
    telemetry is no evidence. Verdicts pause, and resume once the link is back."""
    broker, broker_proc = start_mosquitto(tmp_path)
    spec = tmp_path / "long.toml"
    spec.write_text(EXAMPLE.read_text().replace("steps = 80", "steps = 300")
                    + f'\n[telemetry]\nmqtt_url = "{broker.url}"\n')
    state = tmp_path / "state"
    run = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", str(spec), "--state-dir", str(state),
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
        out, err = run.communicate(timeout=400)
    finally:
        if run.poll() is None:
            run.kill()
        stop_by_pid(broker_proc)
    assert run.returncode == 0, err[-3000:]
    s = json.loads(out)
    assert s["state"] == "SUCCEEDED" and s["final_step"] == 300
    assert (s["attempts"], s["faults"], s["drained_nodes"]) == (1, [], [])
    steps = [r[0] for r in db_rows(state, "SELECT step FROM metrics ORDER BY step")]
    assert steps[:30] == list(range(1, 31)) and steps[-1] == 300, "telemetry flowed again after the outage"
    late = db_rows(state, f"SELECT min(step) FROM metrics WHERE received_at > {down_at}")[0][0]
    assert late is not None and late > 30, "training went on while the broker was down"


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (lambda t: t.replace('name = "tiny-llama"\n', ""), "missing required key 'name'"),
        (lambda t: t.replace("spares = 1", "spraes = 1"), "unknown key 'resources.spraes'"),
        (lambda t: t.replace("nodes = 2", 'nodes = "two"'), "resources.nodes"),
        (lambda t: t.replace('model = "tiny"', 'model = "gpt-5"'), "[trainer]"),
        (lambda t: t.replace("seed = 1234", "sede = 1234"), "[trainer]"),
        (lambda t: t + "\n[[oops", "not valid TOML"),
    ],
)
def test_bad_specs_get_a_clear_message_and_exit_2(tmp_path: Path, edit, complaint: str) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "bad.toml"
    spec.write_text(edit(EXAMPLE.read_text()))
    proc = tsup("run", spec, "--state-dir", tmp_path / "state", timeout_s=60)
    assert proc.returncode == 2
    assert complaint in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (("run", "/nonexistent/spec.toml"), "no such file"),
        (("run", str(EXAMPLE), "--chaos", "explode@5"), "--chaos 'explode@5'"),
        (("serve", "--api-bind", "nowhere"), "--api-bind: expected HOST:PORT, for example 127.0.0.1:8470, got 'nowhere'"),
        (("serve", "--mqtt-url", "http://x"), "--mqtt-url"),
    ],
)
def test_bad_arguments_get_a_clear_message_and_exit_2(tmp_path: Path, args: tuple[str, ...], complaint: str) -> None:
    proc = tsup(*args, "--state-dir", tmp_path, timeout_s=60)
    assert proc.returncode == 2, proc.stderr
    assert complaint in proc.stderr and "Traceback" not in proc.stderr


def test_preflight_and_diagnosis_probes_on_the_local_launcher(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated nodes probed with stand-in Neuron tools: local-2 has lost a device and is
    drained before launch; after a fault the attempt's nodes are probed again."""
    fixtures = REPO / "tests" / "fixtures" / "health" / "neuron"
    hw = tmp_path / "hw"
    (hw / "default").mkdir(parents=True)
    (hw / "local-2").mkdir()
    (hw / "default" / "neuron-ls").write_text((fixtures / "neuron-ls_json_trn1.32xlarge_SYNTHESIZED.json").read_text())
    (hw / "local-2" / "neuron-ls").write_text(
        (fixtures / "neuron-ls_json_trn1.32xlarge_missing_device_SYNTHESIZED.json").read_text())
    (hw / "default" / "neuron-monitor").write_text(
        (fixtures / "neuron-monitor_report_trn1_healthy_SYNTHESIZED.json").read_text())
    monkeypatch.setenv("TSUP_HEALTH_TOOLS", str(make_tools(tmp_path / "tools", ["neuron-ls", "neuron-monitor"])))
    monkeypatch.setenv("TSUP_FAKE_HW", str(hw))
    spec = tmp_path / "spec.toml"
    spec.write_text(EXAMPLE.read_text() + '\n[health]\npreflight = true\ndiagnose = true\n'
                    'args = ["--instance-type", "trn1.32xlarge", "--min-free-gib", "0.1"]\n')
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-rank@50")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED"
    assert s["drained_nodes"] == ["local-2"]
    assert s["attempt_history"][0]["nodes"] == ["local-1", "local-3"]
    reason = db_rows(state, "SELECT reason FROM nodes WHERE name = 'local-2'")[0][0]
    assert reason.startswith("training-supervisor: probe: neuron-ls:") and "15" in reason
    probes = db_rows(state, "SELECT node, kind, status FROM probes ORDER BY id")
    assert probes.count(("local-2", "preflight", "unhealthy")) == 2
    assert {p for p in probes if p[1] == "diagnosis"} == {("local-1", "diagnosis", "healthy"),
                                                          ("local-3", "diagnosis", "healthy")}
