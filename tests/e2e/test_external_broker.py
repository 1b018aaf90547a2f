"""An external broker as a site runs one (tests/conftest.py: secure_mosquitto: TLS, a
password file, an ACL): two daemons share it with a run each and never mix telemetry;
bad credentials or an advertised address nobody answers on stop `serve` with one line
naming the key; ranks that cannot reach their broker train on, and the supervisor
follows them from their processes, output and checkpoints."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from slurmbox.box import Box
from tests.conftest import SecuredBroker, free_port, secure_mosquitto, start_mosquitto, stop_by_pid, wait_for
from tests.e2e.conftest import EXAMPLE, Serve, serve_config, spec_for_slurm, tsup

pytestmark = pytest.mark.e2e


@pytest.fixture
def secured(tmp_path: Path) -> Any:
    broker = secure_mosquitto(tmp_path)
    try:
        yield broker
    finally:
        stop_by_pid(broker.proc)


def site_daemon(tmp_path: Path, name: str, secured: SecuredBroker) -> Serve:
    """A daemon on the site's broker: its own account, and the ranks' account handed to its ranks."""
    state, port = tmp_path / name, free_port()
    state.mkdir()
    conf = serve_config(tmp_path / f"{name}.toml", state, port, mqtt_url=secured.url("supervisor"),
                  mqtt_advertise_url=secured.url("rank"), mqtt_ca_file=str(secured.ca_file))
    return Serve(state, port, config=conf)


def metrics(daemon: Serve) -> dict[str, float]:
    text = daemon.metrics()
    return {f"{m.group(1)}:{m.group(2)}": float(m.group(3))
            for m in re.finditer(r'tsup_mqtt_(messages|dropped)_total\{(?:kind|reason)="([a-z_]+)"\} (\S+)', text)}


def test_two_daemons_share_a_tls_broker_with_passwords_and_an_acl(tmp_path: Path, secured: SecuredBroker) -> None:
    # One node of two ranks and 40 steps each: what is checked is whose telemetry reaches whom.
    spec = tmp_path / "small.toml"
    spec.write_text(EXAMPLE.read_text().replace("steps = 80", "steps = 40").replace("nodes = 2", "nodes = 1")
                    .replace("spares = 1", "spares = 0"))
    daemons = [site_daemon(tmp_path, name, secured) for name in ("west", "east")]
    try:
        runs = [d.ctl_json("submit", str(spec))["run_id"] for d in daemons]
        assert runs == ["run-1", "run-1"], "the same run id, attempt and ranks on both: only the cluster differs"
        finals = [wait_for(lambda d=d, r=r: (s := d.read("status", r))["state"] in ("SUCCEEDED", "FAILED") and s,
                           400, "both runs to end", interval_s=1.0) for d, r in zip(daemons, runs, strict=True)]
        for final in finals:
            assert final["state"] == "SUCCEEDED" and final["attempts"] == 1 and final["faults"] == [], final
            assert final["step"] == 40, final
        assert finals[0]["model_digest"] == finals[1]["model_digest"], "the same spec, the same model"
        for d in daemons:
            seen = metrics(d)
            assert seen["messages:step"] >= 40 * 2, seen  # every rank's every step, over TLS
            # Dropped as "ended": a node agent's report that crossed its attempt's end (its own
            # run's, not the other daemon's). Any other reason would be the other's telemetry.
            assert not {k: v for k, v in seen.items() if k.startswith("dropped:") and k != "dropped:ended" and v}, \
                f"a daemon received (and dropped) the other's telemetry: {seen}"
    finally:
        for d in daemons:
            d.kill(15)


def test_bad_broker_credentials_or_an_unreachable_advertised_url_stop_serve(
        tmp_path: Path, secured: SecuredBroker) -> None:
    state = tmp_path / "state"
    wrong = serve_config(tmp_path / "wrong.toml", state, free_port(), mqtt_url=secured.url("supervisor", "wrong"),
                   mqtt_ca_file=str(secured.ca_file))
    out = tsup("serve", "--config", wrong, timeout_s=60)
    assert out.returncode != 0
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("training-supervisor: mqtt_url: ") and "sup-pass" not in line and "wrong" not in line, line

    nobody = serve_config(tmp_path / "nobody.toml", state, free_port(), mqtt_url=secured.url("supervisor"),
                    mqtt_ca_file=str(secured.ca_file), mqtt_advertise_url=f"mqtt://127.0.0.1:{free_port()}")
    out = tsup("serve", "--config", nobody, timeout_s=60)
    assert out.returncode != 0
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("training-supervisor: mqtt_advertise_url: ranks would be told "), line


def test_ranks_that_cannot_reach_the_broker_train_on(tmp_path: Path, fault_free: dict[str, Any]) -> None:
    """The ranks are told a broker that is gone by the time they start: each says so in
    its log and trains on; the supervisor, hearing nothing, follows the processes, the
    output and the checkpoints, and the run ends as the fault-free one does."""
    own, own_proc = start_mosquitto(tmp_path)
    told, told_proc = start_mosquitto(tmp_path)
    state, port = tmp_path / "state", free_port()
    state.mkdir()
    daemon = Serve(state, port, config=serve_config(tmp_path / "c.toml", state, port, mqtt_url=own.url,
                                              mqtt_advertise_url=told.url))
    try:
        stop_by_pid(told_proc)  # after serve's start-up check: gone before any rank starts
        # Allowances shorter than the run: judged by telemetry alone, it would be a hang.
        spec = tmp_path / "spec.toml"
        spec.write_text(EXAMPLE.read_text().replace("hang_timeout_s = 60", "hang_timeout_s = 15")
                        .replace("startup_timeout_s = 300", "startup_timeout_s = 30"))
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]
        final = wait_for(lambda: (s := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and s,
                         300, "the run to end", interval_s=1.0)
        assert final["state"] == "SUCCEEDED" and final["attempts"] == 1 and final["faults"] == [], final
        assert final["model_digest"] == fault_free["model_digest"]
        assert metrics(daemon).get("messages:step", 0) == 0, "nothing reached the supervisor's broker"
        logs = list((state / "runs" / run_id).rglob("rank-*.log"))
        said = [p for p in logs if "telemetry: cannot reach the broker at mqtt://127.0.0.1" in p.read_text()]
        assert len(said) == 4, [str(p) for p in logs]
    finally:
        daemon.kill(15)
        stop_by_pid(own_proc)


def test_the_broker_stopped_for_15_s_on_the_box_costs_nothing(slurm_box: Box, tmp_path: Path) -> None:
    """The cluster's broker (a mosquitto on the controller's bridge address) stopped for
    15 s (past the nodes' silence_timeout_s of 10 s) in the middle of a run on the
    multi-host box, then started again on its port:
    training goes on meanwhile (the steps made then arrive from the ranks' buffers), and
    nothing is drained, no fault recorded, no attempt restarted."""
    broker, mosquitto = start_mosquitto(tmp_path, host=slurm_box.controller_addr)
    state, port = tmp_path / "state", free_port()
    state.mkdir()
    conf = serve_config(tmp_path / "c.toml", state, port, mqtt_url=broker.url, launcher="slurm",
                        slurm_conf=str(slurm_box.conf))
    spec = spec_for_slurm(tmp_path)
    # About 65 s here: the outage falls well inside the run, and the run goes on long after
    # the broker is back (ranks flush their buffers once the supervisor is heard, or 10 s on;
    # a run that ends first takes the rest with it). 350 steps ended 1 s after the broker's
    # return in a loaded suite, and the outage's steps were lost with the ranks.
    steps = 500
    spec.write_text(spec.read_text().replace("steps = 80", f"steps = {steps}"))
    daemon = Serve(state, port, config=conf)
    try:
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]
        wait_for(lambda: (daemon.read("status", run_id)["step"] or 0) >= 50, 240, "step 50")
        stop_by_pid(mosquitto)
        stopped_at = daemon.ctl_json("status", run_id)["step"]
        time.sleep(15)
        assert daemon.ctl_json("status", run_id)["attempt_state"] == "RUNNING"
        # How far rank 0 got meanwhile, from its own output (telemetry was away).
        log = state / "runs" / run_id / "attempts" / "1" / "rank-0.log"
        back = max(int(m) for m in re.findall(r"^step (\d+)/", log.read_text(), re.MULTILINE))
        _, mosquitto = start_mosquitto(tmp_path, port=broker.port, host=slurm_box.controller_addr)
        wait_for(lambda: (daemon.read("status", run_id)["step"] or 0) > stopped_at, 10, "the ranks heard again")
        assert back > stopped_at + 50, f"step {stopped_at} when the broker went, {back} when it was back: " \
                                       "training went on meanwhile"
        final = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and d,
                         300, "the run to end", interval_s=1.0)
        assert final["state"] == "SUCCEEDED" and final["step"] == steps, final
        assert final["attempts"] == 1 and final["faults"] == [] and final["drained_nodes"] == [], final
        # Rank 0's step metrics, every one kept: those of the outage came from its buffer.
        curve = {p["step"] for p in daemon.get_json(f"/v1/runs/{run_id}/metrics?max_points={2 * steps}")}
        during = set(range(stopped_at + 1, back))
        assert len(during & curve) >= len(during) - 2, f"{len(during - curve)} of the outage's steps missing"
    finally:
        daemon.kill(15)
        stop_by_pid(mosquitto)
