"""The daemon as an operator runs it: `serve --config`, under a stand-in systemd, driven
by every `supervisorctl` command, a rank killed by a real SIGKILL, scraped by Prometheus,
stopped by SIGTERM mid-run, fuzzed through its OpenAPI schema. And the API over HTTPS."""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from cli.ctl import main as ctl_main
from tests.conftest import REPO, free_port, require, wait_for
from tests.e2e.conftest import EXAMPLE, FakeSystemd, Serve, ctl, db_rows, env, trainer_processes, tsup

pytestmark = pytest.mark.e2e


def rank_process(state: Path, rank: int) -> psutil.Process:
    [p] = [p for p in trainer_processes(state) if p.environ().get("RANK") == str(rank)]
    return p


def test_the_service_end_to_end(fault_free: dict[str, Any], state: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'state_dir = "{state}"\napi_bind = "127.0.0.1:{port}"\nlog_format = "text"\n'
                      "tick_s = 0.25\nsweep_every_s = 0\n")
    systemd = FakeSystemd(tmp_path / "notify")
    daemon = Serve(state, port, config=config, extra_env={
        "NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "2000000",
        "TSUP_LOG_FORMAT": "json"})  # the environment overrides the file
    follow: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: len(systemd.messages) >= 2, 30, "READY and a first WATCHDOG")
        assert systemd.messages[0].startswith(b"READY=1\nSTATUS=reconciling")
        assert systemd.messages[1] == b"WATCHDOG=1"
        assert stat.S_IMODE(daemon.token_file.stat().st_mode) == 0o600, "the token is made private"

        # One daemon per state directory.
        second = tsup("serve", "--config", config, "--api-bind", f"127.0.0.1:{free_port()}", timeout_s=60)
        assert second.returncode == 2 and f"pid {daemon.proc.pid}" in second.stderr

        # Writes need the API token; reads that or the read-only one, from this host too.
        # (where supervisorctl looks for a token by default: nowhere with one, here)
        monkeypatch.setattr("cli.ctl_settings.SYSTEM_TOKEN_FILE", tmp_path / "no-such-token")
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "no-state"))
        anonymous = quick(daemon, "submit", str(EXAMPLE), token=False)
        assert anonymous.returncode == 4 and "needs the API token" in anonymous.stderr
        assert "no token found (looked in" in anonymous.stderr
        r = httpx.post(f"{daemon.url}/v1/runs", json={"spec": {}})
        assert r.status_code == 401 and r.json()["error"] == "Unauthorized"
        r = httpx.post(f"{daemon.url}/v1/runs", json={"spec": {}}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 403
        assert stat.S_IMODE(daemon.read_token_file.stat().st_mode) == 0o600
        unread = daemon.ctl("runs", token=False)
        assert unread.returncode == 4 and "api-read-token" in unread.stderr, unread.stderr
        watcher = {"TSUP_API_TOKEN_FILE": str(daemon.read_token_file)}
        assert ctl(daemon.url, "runs", extra_env=watcher).returncode == 0
        refused = ctl(daemon.url, "drain", "local-1", "--reason", "x", extra_env=watcher)
        assert refused.returncode == 4 and "the read-only token cannot change anything" in refused.stderr
        dry = daemon.ctl("submit", "--dry-run", str(EXAMPLE), token=False)
        assert dry.returncode == 0 and "4 process(es) on this machine, one per rank" in dry.stdout

        run_id = daemon.ctl_json("submit", str(EXAMPLE))["run_id"]
        follow = subprocess.Popen(
            [sys.executable, "-m", "cli.ctl", "--url", daemon.url, "--json", "events", run_id, "--follow"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**env(), "TSUP_CTL_CONFIG": "/dev/null", "TSUP_API_TOKEN_FILE": str(daemon.read_token_file)})
        # The checkpoint of step 20 committed, not only step 20 reached: a kill during
        # its save would leave the run nothing to resume from (and this test no checkpoint).
        wait_for(lambda: any(c["complete"] for c in quick_json(daemon, "checkpoints", run_id)), 120,
                 "the checkpoint of step 20")

        # A rank killed by a real signal: found, recovered, and on /metrics.
        rank_process(state, 3).send_signal(signal.SIGKILL)
        detail = wait_for(lambda: (d := quick_json(daemon, "status", run_id))["faults"]
                          and d["faults"][0]["recovered_at"] and d, 120, "recovery from the kill")
        assert detail["faults"][0]["kind"] == "rank-exit" and detail["faults"][0]["ranks"] == [3]
        # An attempt's logs, without finding the files: the killed rank's (it prints nothing
        # of its own), rank 0's (the steps it made until the kill).
        killed = quick_json(daemon, "logs", run_id, "--attempt", "1", "--rank", "3")
        assert re.fullmatch(r"rank-0*3\b.*\.log", killed["file"]) and killed["attempt_state"] == "ENDED", killed
        first = quick_json(daemon, "logs", run_id, "--attempt", "1")
        assert re.fullmatch(r"rank-0*0\b.*\.log", first["file"]) and first["text"], first
        assert first["next_offset"] == first["size"] == len(first["text"].encode())
        shown = quick(daemon, "logs", run_id, "--attempt", "1")
        assert shown.returncode == 0 and shown.stdout.splitlines()[0] == first["text"].splitlines()[0]
        followed = quick(daemon, "logs", run_id, "--attempt", "1", "--follow")  # it has ended: to its end, then out
        assert followed.returncode == 0 and followed.stdout == shown.stdout
        absent = quick(daemon, "logs", run_id, "--attempt", "1", "--node", "local-9")
        assert absent.returncode == 3 and "local-9 is not a node of" in absent.stderr
        scrape = httpx.get(f"{daemon.url}/metrics",
                           headers={"Authorization": f"Bearer {daemon.read_token_file.read_text().strip()}"})
        assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
        text = scrape.text
        assert 'tsup_faults_total{kind="rank-exit"} 1.0' in text
        assert "tsup_fault_detection_seconds_count 1.0" in text and "tsup_fault_recovery_seconds_count 1.0" in text
        assert 'tsup_runs{state="RUNNING"} 1.0' in text and f'tsup_run_ettr{{name="tiny-llama",run_id="{run_id}"}}' in text
        assert "tsup_reconcile_tick_seconds_count" in text and "tsup_mqtt_connected 1.0" in text
        assert 'tsup_mqtt_messages_total{kind="step"}' in text
        assert httpx.get(daemon.url + "/").text.startswith("<!DOCTYPE html>")

        # Pause, resume, restart: each a new attempt from the newest checkpoint.
        assert quick_json(daemon, "pause", run_id)["result"] == "accepted"
        wait_for(lambda: (d := quick_json(daemon, "status", run_id))["state"] == "PAUSED"
                 and d["attempt_state"] == "ENDED", 60, "the pause")
        going_back = quick(daemon, "resume", run_id, "--from-step", "19")
        assert going_back.returncode == 3 and "no complete checkpoint of step 19" in going_back.stderr
        assert quick_json(daemon, "resume", run_id, "--from-step", "20")["result"] == "accepted"
        wait_for(lambda: quick_json(daemon, "status", run_id)["state"] == "RUNNING", 120, "the resumed run")
        assert quick_json(daemon, "restart", run_id)["result"] == "accepted"
        wait_for(lambda: (d := quick_json(daemon, "status", run_id))["state"] == "RUNNING" and d["attempts"] == 4,
                 120, "the restarted run")

        # SIGTERM mid-run: out within the bound, STOPPING=1 said, training goes on.
        trainers = trainer_processes(state)
        began = time.monotonic()
        assert daemon.kill(signal.SIGTERM) == 0
        took = time.monotonic() - began
        assert took < 10, f"SIGTERM took {took:.1f} s"
        wait_for(lambda: systemd.messages[-1] == b"STOPPING=1\nSTATUS=stopping", 5, "STOPPING=1")
        pings = systemd.messages.count(b"WATCHDOG=1")
        assert pings >= 20, f"{pings} WATCHDOG=1 while training: the ticks ping the watchdog"
        assert all(p.is_running() for p in trainers), "a daemon stop leaves training alone"
        lines = [json.loads(line) for line in daemon.log_path.read_text().splitlines() if line.startswith("{")]
        assert lines and {"ts", "level", "logger", "message"} <= set(lines[0])
        assert any(line["message"].startswith("stopped:") for line in lines)

        # The next daemon takes over; SIGKILLed mid-run, it loses nothing either. The
        # trainers are held (SIGSTOP) while it starts: on a loaded machine they could
        # otherwise finish all 80 steps before it serves, and there would be no run to take over.
        for p in trainers:
            p.suspend()
        daemon = Serve(state, port)
        at = quick_json(daemon, "status", run_id)["step"] or 0
        for p in trainers:
            p.resume()
        wait_for(lambda: (quick_json(daemon, "status", run_id)["step"] or 0) > at + 2, 60, "steps under daemon 2")
        before = quick_json(daemon, "events", run_id)
        assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
        gone = [p.pid for p in trainers if not p.is_running()]
        assert not gone, f"the trainers outlive a killed daemon: {gone} did not ({before[-3:]})"

        # The third daemon finishes the run with the fault-free model.
        daemon = Serve(state, port)
        # Every read, human and --json.
        for args, expect in ((["runs"], "tiny-llama"), (["runs", "-q"], run_id), (["status", run_id], "faults:   1"),
                             (["status", run_id], "s after detection (a cold start took "),
                             (["events", run_id], "fault.detected"), (["checkpoints", run_id], "COMPLETE"),
                             (["goodput", run_id], "ETTR"), (["nodes"], "local-3"), (["nodes", "-q"], "local-1")):
            out = quick(daemon, *args)
            assert out.returncode == 0 and expect in out.stdout, (args, out.stdout, out.stderr)
            assert quick(daemon, "--json", *[a for a in args if a != "-q"]).returncode == 0
        saved = [c for c in quick_json(daemon, "checkpoints", run_id) if c["complete"]]
        assert saved and saved[0]["step"] == 20 and saved[0]["duration_s"] > 0, saved
        g = quick_json(daemon, "goodput", run_id)
        assert g["kept_steps"] >= 20, g  # the checkpoint of step 20 survives into the trajectory
        parts = ("productive_s", "lost_s", "checkpoint_s", "startup_s", "detection_s", "recovery_s", "other_s")
        assert abs(sum(g[k] for k in parts) - g["wall_s"]) < 0.01 * g["wall_s"] + 0.01, g  # every second once
        assert 0 < g["ettr"] <= 1, g

        # Nodes: drain the spare and return it; probe one now.
        drained = quick_json(daemon, "drain", "local-3", "--reason", "fan failure, ticket 42")
        assert drained["result"] == "accepted"
        assert {n["name"]: (n["state"], n["reason"]) for n in quick_json(daemon, "nodes")}["local-3"] == (
            "DRAINED", "operator: fan failure, ticket 42")
        assert quick_json(daemon, "undrain", "local-3")["result"] == "accepted"
        assert quick(daemon, "undrain", "local-3").returncode == 1, "rejected: it is not drained"
        probe = quick(daemon, "probe", "local-1")
        # healthy, or degraded while trainers run on this host (python -m health notices them)
        assert probe.returncode == 0 and probe.stdout.startswith(("local-1: healthy", "local-1: degraded"))
        assert "no Neuron devices found" in probe.stdout, "the findings of the probe its command made"
        assert quick(daemon, "probe", "local-9").returncode == 3
        assert quick(daemon, "drain", "local-1").returncode == 2, "a drain needs a reason"

        completion = daemon.ctl("completion", "bash", token=False)
        assert completion.returncode == 0 and "complete -F _supervisorctl supervisorctl" in completion.stdout
        final = wait_for(lambda: (d := quick_json(daemon, "status", run_id))["state"] == "SUCCEEDED" and d,
                         240, "the run to succeed under the next daemon")
        assert final["attempts"] == 4 and final["model_digest"] == fault_free["model_digest"]
        assert [a["outcome"] for a in final["attempt_history"]] == ["FAILED", "STOPPED", "STOPPED", "SUCCEEDED"]
        after = quick_json(daemon, "events", run_id)
        assert after[: len(before)] == before, "every event from before the SIGKILL is still there"
        ids = [e["id"] for e in after]
        assert ids == sorted(set(ids))
        starts = db_rows(state, "SELECT message FROM events WHERE kind = 'daemon.started' ORDER BY id")
        assert len(starts) == 3 and all(f"{run_id}#4" in m for (m,) in starts[1:]), "each took over attempt 4"
        assert db_rows(state, "SELECT count(*) FROM attempts")[0][0] == 4, "no duplicate attempt"
        wait_for(lambda: db_rows(state, "SELECT COUNT(*) FROM outbox") == [(0,)], 30, "every event published")

        # Cancel: refused for a finished run; a second run is cancelled as it starts.
        refused = quick(daemon, "cancel", run_id)
        assert refused.returncode == 1 and f"{run_id}: cancel rejected: run is SUCCEEDED" in refused.stdout
        second_run = quick_json(daemon, "submit", str(EXAMPLE))["run_id"]
        wait_for(lambda: quick_json(daemon, "status", second_run)["attempts"] == 1, 30, "run 2's first attempt")
        assert quick_json(daemon, "cancel", second_run)["result"] == "accepted"
        wait_for(lambda: (d := quick_json(daemon, "status", second_run))["state"] == "CANCELLED"
                 and d["attempt_state"] == "ENDED", 60, "run 2 cancelled")
        wait_for(lambda: trainer_processes(state) == [], 30, "no trainer left")
        assert "rejected: run is CANCELLED" in quick(daemon, "resume", second_run).stdout

        out, err = follow.communicate(timeout=60)  # ends by itself once the run has ended
        assert follow.returncode == 0, err
        streamed = [json.loads(line) for line in out.splitlines()]
        recorded = daemon.ctl_json("events", run_id)
        assert [e["id"] for e in streamed] == [e["id"] for e in recorded][: len(streamed)], \
            "every event, once, in order, across the daemon's restart"
        assert any(e["kind"] == "run.state" and e["data"]["to"] == "SUCCEEDED" for e in streamed)

        # Fuzzing the API from its own OpenAPI schema: no request makes it fail (5xx).
        fuzz(daemon, run_id, tmp_path)
        assert db_rows(state, "SELECT state FROM runs ORDER BY number") == [("SUCCEEDED",), ("CANCELLED",)]
    finally:
        if follow is not None and follow.poll() is None:
            follow.kill()
        if daemon.proc.poll() is None:
            daemon.kill(signal.SIGTERM)
        systemd.close()


def quick(daemon: Serve, *args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
    """`supervisorctl ARGS` against ``daemon``, run in this process (the same code as the
    command, without an interpreter's start for each of the many calls)."""
    environ = {"TSUP_CTL_CONFIG": "/dev/null", "HOME": "/nonexistent"}
    if token:
        environ["TSUP_API_TOKEN_FILE"] = str(daemon.token_file)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = ctl_main(["--url", daemon.url, *args], environ)
        except SystemExit as e:  # argparse's usage errors
            code = int(e.code or 0)
    return subprocess.CompletedProcess(["supervisorctl", *args], code, out.getvalue(), err.getvalue())


def quick_json(daemon: Serve, *args: str) -> Any:
    proc = quick(daemon, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def fuzz(daemon: Serve, run_id: str, tmp_path: Path) -> None:
    """schemathesis against the running daemon, with its token, on a run and a node that
    exist (so that requests get past the 404s), every check that a response is not a
    server error. The probe is left out: each call runs the node's probes for real."""
    exe = Path(sys.executable).with_name("schemathesis")
    require("schemathesis (the test extra)", exe.exists())
    config = tmp_path / "schemathesis.toml"
    config.write_text(f'[parameters]\nrun_id = "{run_id}"\nname = "local-3"\ncommand_id = 1\n')
    token = daemon.token_file.read_text().strip()
    proc = subprocess.run(
        [str(exe), "--config-file", str(config), "run", f"{daemon.url}/openapi.json",
         "--checks", "not_a_server_error", "--header", f"Authorization: Bearer {token}",
         "--exclude-path", "/v1/nodes/{name}/probe", "--max-examples", "12", "--seed", "7",
         "--workers", "1", "--no-color", "--request-timeout", "30"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "passed" in proc.stdout and "failed" not in proc.stdout.split("SUMMARY")[-1], proc.stdout[-3000:]


def test_the_api_over_https(tmp_path: Path) -> None:
    """tls_cert and tls_key: the API speaks HTTPS, and supervisorctl trusts the daemon's
    certificate through TSUP_CA_FILE."""
    openssl = subprocess.run(["openssl", "version"], capture_output=True, check=False)
    require("openssl", openssl.returncode == 0)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   capture_output=True, check=True, timeout=60)
    state, port = tmp_path / "state", free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'state_dir = "{state}"\napi_bind = "127.0.0.1:{port}"\ntls_cert = "{cert}"\n'
                      f'tls_key = "{key}"\n')
    daemon = Serve(state, port, config=config, scheme="https")
    try:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{daemon.url}/v1/runs")  # a certificate nobody vouched for
        watcher = {"Authorization": f"Bearer {daemon.read_token_file.read_text().strip()}"}
        assert httpx.get(f"{daemon.url}/v1/runs", verify=ssl.create_default_context(cafile=cert),
                         headers=watcher).json() == []
        trusted = subprocess.run([sys.executable, "-m", "cli.ctl", "--url", daemon.url, "--json", "nodes"],
                                 capture_output=True, text=True, timeout=60, cwd=REPO, check=False,
                                 env={**env(), "TSUP_CA_FILE": str(cert), "TSUP_CTL_CONFIG": "/dev/null",
                                      "TSUP_API_TOKEN_FILE": str(daemon.read_token_file)})
        assert trusted.returncode == 0 and json.loads(trusted.stdout) == []
        assert "API on https://127.0.0.1" in daemon.log_path.read_text()
    finally:
        daemon.kill(signal.SIGTERM)
