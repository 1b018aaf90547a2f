"""`training-supervisor serve` + `supervisorctl`: SIGKILL of the daemon mid-run loses nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, free_port, wait_for
from tests.e2e.conftest import EXAMPLE, Serve, db_rows, env, trainer_processes

pytestmark = pytest.mark.e2e


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
    submitted = daemon.ctl_json("submit", str(EXAMPLE))
    run_id = submitted["run_id"]
    wait_for(lambda: (daemon.ctl_json("status", run_id)["step"] or 0) >= 30, 120, "step 30")
    before = daemon.ctl_json("events", run_id)
    trainers = trainer_processes(state)
    assert len(trainers) == 4

    assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
    assert all(p.is_running() for p in trainers), "the trainers outlive the daemon"

    daemon = Serve(state, port)  # same state dir, same port
    try:
        final = wait_for(lambda: (d := daemon.ctl_json("status", run_id))["state"] == "SUCCEEDED" and d,
                         240, "the run to succeed under the restarted daemon")
        assert final["attempts"] == 1, "no duplicate attempt"
        assert final["faults"] == []
        assert final["model_digest"] == fault_free["model_digest"]
        after = daemon.ctl_json("events", run_id)
        assert after[: len(before)] == before, "every event from before the kill is still there"
        ids = [e["id"] for e in after]
        assert ids == sorted(set(ids))
        starts = db_rows(state, "SELECT message FROM events WHERE kind = 'daemon.started' ORDER BY id")
        assert len(starts) == 2 and f"{run_id}#1" in starts[1][0]
        assert db_rows(state, "SELECT count(*) FROM attempts")[0][0] == 1
        assert db_rows(state, "SELECT count(DISTINCT step) FROM metrics")[0][0] >= 70

        # supervisorctl against the live daemon: every command, human and --json
        runs = daemon.ctl("runs")
        assert runs.returncode == 0 and run_id in runs.stdout and "SUCCEEDED" in runs.stdout
        status = daemon.ctl("status", run_id)
        assert status.returncode == 0 and "goodput:  ETTR" in status.stdout
        assert daemon.ctl("events", run_id, "--follow").returncode == 0  # ends: the run is over
        nodes = daemon.ctl_json("nodes")
        assert {n["name"]: n["state"] for n in nodes} == {"local-1": "IDLE", "local-2": "IDLE", "local-3": "IDLE"}
        rejected = daemon.ctl("resume", run_id)
        assert rejected.returncode == 1 and "rejected: run is SUCCEEDED" in rejected.stdout
        missing = daemon.ctl("status", "run-999")
        assert missing.returncode == 3 and "no such run: run-999" in missing.stderr
        bad = daemon.ctl("cancel", "nonsense")
        assert bad.returncode == 3 and "run ids look like run-42" in bad.stderr

        # a second run, cancelled while it trains
        second = daemon.ctl_json("submit", str(EXAMPLE))["run_id"]
        wait_for(lambda: daemon.ctl_json("status", second)["state"] == "RUNNING", 120, "run 2 training")
        cancel = daemon.ctl_json("cancel", second)
        assert cancel["result"] == "accepted"
        wait_for(lambda: daemon.ctl_json("status", second)["attempt_history"][-1]["state"] == "ENDED", 60,
                 "run 2's attempt to end")
        assert daemon.ctl_json("status", second)["state"] == "CANCELLED"
        wait_for(lambda: trainer_processes(state) == [], 30, "no trainer left")
    finally:
        assert daemon.kill(signal.SIGTERM) == 0, "SIGTERM is a clean shutdown"
    down = daemon.ctl("runs")
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
