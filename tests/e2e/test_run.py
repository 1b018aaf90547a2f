"""`training-supervisor run`: real tiny training, killed by real signals, recovered."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conftest import REPO, Broker, free_port, wait_for
from tests.e2e.conftest import EXAMPLE, ctl, db_rows, env, summary_of, tsup
from tests.fake_tools.replay import make_tools

pytestmark = pytest.mark.e2e


def test_fault_free_run_succeeds_with_a_digest(fault_free: dict[str, Any]) -> None:
    s = fault_free
    assert (s["state"], s["final_step"], s["attempts"], s["faults"]) == ("SUCCEEDED", 80, 1, [])
    assert re.fullmatch(r"[0-9a-f]{64}", s["model_digest"])
    assert 0 < s["ettr"] <= 1
    assert s["goodput"]["kept_steps"] == 80 and s["goodput"]["lost_steps"] == 0
    assert s["stragglers"] == [], "ranks of equal speed are never stragglers"


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
    sub.subscribe("tsup/v1/+/events/#", qos=1)  # events carry the daemon's cluster id
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
    # 30 steps, not 80: what is checked is the probes around one fault, not the training.
    spec.write_text(EXAMPLE.read_text().replace("steps = 80", "steps = 30").replace("every_steps = 20", "every_steps = 10")
                    + '\n[health]\npreflight = true\ndiagnose = true\n'
                    'instance_type = "trn1.32xlarge"\nmin_free_gib = 0.1\n')
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json", "--chaos", "kill-rank@15")
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



def _long_run(tmp_path: Path, state: Path, *args: str) -> subprocess.Popen[str]:
    spec = tmp_path / "long.toml"
    # One rank: what is checked is how `run` ends, and a run of four ranks would train them all meanwhile.
    spec.write_text(EXAMPLE.read_text().replace("steps = 80", "steps = 100000").replace("nodes = 2", "nodes = 1")
                    .replace("ranks_per_node = 2", "ranks_per_node = 1").replace("spares = 1", "spares = 0"))
    return subprocess.Popen([sys.executable, "-m", "cli.daemon", "run", str(spec), "--state-dir", str(state),
                             "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            cwd=REPO)


def _stepped(state: Path) -> bool:
    try:
        return bool(db_rows(state, "SELECT count(*) FROM attempt_stats WHERE steps >= 3")[0][0])
    except sqlite3.OperationalError:  # not created yet
        return False


def test_run_exits_130_on_ctrl_c_and_1_when_an_operator_cancels(tmp_path: Path) -> None:
    """README, "Exit codes": interrupted, the run is cancelled and `run` says 130; cancelled
    by an operator through the API, it says 1 (the run did not succeed)."""
    first = tmp_path / "interrupted"
    run = _long_run(tmp_path, first, "--api-port", "-1")
    try:
        wait_for(lambda: _stepped(first), 120, "three steps")
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err[-3000:]
    assert json.loads(out)["state"] == "CANCELLED" and "interrupted: cancelling the run" in err

    second = tmp_path / "cancelled"
    port = free_port()
    run = _long_run(tmp_path, second, "--api-port", str(port))
    try:
        wait_for(lambda: _stepped(second), 120, "three steps")
        cancel = ctl(f"http://127.0.0.1:{port}", "cancel", "run-1",
                     extra_env={"TSUP_API_TOKEN_FILE": str(second / "api-token")})
        assert cancel.returncode == 0, cancel.stderr
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, err[-3000:]
    s = json.loads(out)
    assert s["state"] == "CANCELLED" and s["reason"] == "cancelled by operator"
