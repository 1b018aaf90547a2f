"""`training-supervisor serve` + `supervisorctl`: SIGKILL of the daemon mid-run loses nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port, port_open, wait_for
from tests.e2e.conftest import EXAMPLE, ctl, db_rows, env, trainer_processes

pytestmark = pytest.mark.e2e


class Serve:
    """One `training-supervisor serve` process on a state directory."""

    def __init__(self, state: Path, port: int, *args: str, extra_env: dict[str, str] | None = None) -> None:
        self.state, self.port = state, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = state.parent / f"serve-{port}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "serve", "--state-dir", str(state),
             "--api-bind", f"127.0.0.1:{port}", *args], stdout=self.log, stderr=subprocess.STDOUT,
            env={**env(), **(extra_env or {})}, cwd=REPO)
        wait_for(lambda: port_open(port) or self.proc.poll() is not None, 30, "the API to listen")
        assert self.proc.poll() is None, (state.parent / f"serve-{port}.log").read_text()

    def kill(self, sig: int) -> int:
        os.kill(self.proc.pid, sig)
        return self.proc.wait(30)


def ctl_json(url: str, *args: str) -> Any:
    proc = ctl(url, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "state"
    yield d
    for p in trainer_processes(d):  # never leave training behind, whatever failed
        p.kill()


def test_sigkill_of_the_daemon_mid_run_loses_nothing_and_starts_no_duplicate(
        fault_free: dict[str, Any], state: Path) -> None:
    port = free_port()
    daemon = Serve(state, port)
    submitted = ctl_json(daemon.url, "submit", str(EXAMPLE))
    run_id = submitted["run_id"]
    wait_for(lambda: (ctl_json(daemon.url, "status", run_id)["step"] or 0) >= 30, 120, "step 30")
    before = ctl_json(daemon.url, "events", run_id)
    trainers = trainer_processes(state)
    assert len(trainers) == 4

    assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
    assert all(p.is_running() for p in trainers), "the trainers outlive the daemon"

    daemon = Serve(state, port)  # same state dir, same port
    try:
        final = wait_for(lambda: (d := ctl_json(daemon.url, "status", run_id))["state"] == "SUCCEEDED" and d,
                         240, "the run to succeed under the restarted daemon")
        assert final["attempts"] == 1, "no duplicate attempt"
        assert final["faults"] == []
        assert final["model_digest"] == fault_free["model_digest"]
        after = ctl_json(daemon.url, "events", run_id)
        assert after[: len(before)] == before, "every event from before the kill is still there"
        ids = [e["id"] for e in after]
        assert ids == sorted(set(ids))
        starts = db_rows(state, "SELECT message FROM events WHERE kind = 'daemon.started' ORDER BY id")
        assert len(starts) == 2 and f"{run_id}#1" in starts[1][0]
        assert db_rows(state, "SELECT count(*) FROM attempts")[0][0] == 1
        assert db_rows(state, "SELECT count(DISTINCT step) FROM metrics")[0][0] >= 100

        # supervisorctl against the live daemon: every command, human and --json
        runs = ctl(daemon.url, "runs")
        assert runs.returncode == 0 and run_id in runs.stdout and "SUCCEEDED" in runs.stdout
        status = ctl(daemon.url, "status", run_id)
        assert status.returncode == 0 and "goodput:  ETTR" in status.stdout
        assert ctl(daemon.url, "events", run_id, "--follow").returncode == 0  # ends: the run is over
        nodes = ctl_json(daemon.url, "nodes")
        assert {n["name"]: n["state"] for n in nodes} == {"local-1": "IDLE", "local-2": "IDLE", "local-3": "IDLE"}
        rejected = ctl(daemon.url, "resume", run_id)
        assert rejected.returncode == 1 and "rejected: run is SUCCEEDED" in rejected.stdout
        missing = ctl(daemon.url, "status", "run-999")
        assert missing.returncode == 3 and "no such run: run-999" in missing.stderr
        bad = ctl(daemon.url, "cancel", "nonsense")
        assert bad.returncode == 3 and "run ids look like run-42" in bad.stderr

        # a second run, cancelled while it trains
        second = ctl_json(daemon.url, "submit", str(EXAMPLE))["run_id"]
        wait_for(lambda: ctl_json(daemon.url, "status", second)["state"] == "RUNNING", 120, "run 2 training")
        cancel = ctl_json(daemon.url, "cancel", second)
        assert cancel["result"] == "accepted"
        wait_for(lambda: ctl_json(daemon.url, "status", second)["attempt_history"][-1]["state"] == "ENDED", 60,
                 "run 2's attempt to end")
        assert ctl_json(daemon.url, "status", second)["state"] == "CANCELLED"
        wait_for(lambda: trainer_processes(state) == [], 30, "no trainer left")
    finally:
        assert daemon.kill(signal.SIGTERM) == 0, "SIGTERM is a clean shutdown"
    down = ctl(daemon.url, "runs")
    assert down.returncode == 1 and "cannot reach training-supervisor" in down.stderr


def test_a_second_daemon_on_the_same_state_dir_refuses_to_start(state: Path) -> None:
    first = Serve(state, free_port())
    try:
        proc = subprocess.run([sys.executable, "-m", "supervisor.cli", "serve", "--state-dir", str(state),
                               "--api-bind", f"127.0.0.1:{free_port()}"], capture_output=True, text=True,
                              timeout=60, env=env(), cwd=REPO, check=False)
        assert proc.returncode == 2
        assert f"pid {first.proc.pid}" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        first.kill(signal.SIGTERM)


class FakeSystemd:
    """The notify socket systemd gives a Type=notify service: every datagram the daemon
    sends, read as it comes (a receiver that stopped reading would drop messages)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096))
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._reader.join()
        self.sock.close()


def test_under_systemd_sigterm_stops_within_the_bound_and_loses_nothing(
        fault_free: dict[str, Any], state: Path, tmp_path: Path) -> None:
    """serve --config, as the unit runs it: READY=1 after the first tick, WATCHDOG=1 from
    the ticks, JSON log lines; SIGTERM mid-run exits 0 within the bound (finish the tick,
    flush the outbox), the trainers train on, and the next daemon finishes the run."""
    config = tmp_path / "config.toml"
    config.write_text('log_format = "json"\ntick_s = 0.25\n')
    systemd = FakeSystemd(tmp_path / "notify")
    try:
        port = free_port()
        daemon = Serve(state, port, "--config", str(config),
                       extra_env={"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "2000000"})
        wait_for(lambda: len(systemd.messages) >= 2, 30, "READY and a first WATCHDOG")
        assert systemd.messages[0].startswith(b"READY=1\nSTATUS=reconciling")
        assert systemd.messages[1] == b"WATCHDOG=1"
        run_id = ctl_json(daemon.url, "submit", str(EXAMPLE))["run_id"]
        wait_for(lambda: (ctl_json(daemon.url, "status", run_id)["step"] or 0) >= 20, 120, "step 20")
        trainers = trainer_processes(state)

        began = time.monotonic()
        assert daemon.kill(signal.SIGTERM) == 0
        took = time.monotonic() - began
        assert took < 10, f"SIGTERM took {took:.1f} s"
        wait_for(lambda: systemd.messages[-1] == b"STOPPING=1\nSTATUS=stopping", 5, "STOPPING=1")
        pings = systemd.messages.count(b"WATCHDOG=1")
        assert pings >= 10, f"{pings} WATCHDOG=1 while training: the ticks ping the watchdog"
    finally:
        systemd.close()
    assert all(p.is_running() for p in trainers), "a daemon stop leaves training alone"
    lines = [line for line in daemon.log_path.read_text().splitlines() if line.strip()]
    assert lines and all(json.loads(line)["level"] for line in lines if line.startswith("{"))
    assert any(json.loads(line)["message"].startswith("stopped:") for line in lines if line.startswith("{"))

    daemon = Serve(state, port)
    try:
        final = wait_for(lambda: (d := ctl_json(daemon.url, "status", run_id))["state"] == "SUCCEEDED" and d,
                         240, "the run to succeed under the next daemon")
        assert final["attempts"] == 1 and final["model_digest"] == fault_free["model_digest"]
        wait_for(lambda: db_rows(state, "SELECT COUNT(*) FROM outbox") == [(0,)], 30, "every event published")
    finally:
        daemon.kill(signal.SIGTERM)
