"""The daemon's event loop receives the telemetry (and runs the embedded broker). When
it does not run (a blocking call on it, the host's disk), it hears no node, and the
telemetry view must know: no silence is judged until telemetry flows again
(supervisor/telemetry/view.py, ``loop_alive`` and ``flowing_since``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from supervisor.telemetry.view import LOOP_STALL_S
from tests.conftest import REPO, wait_for
from tests.integration.test_broker_security import Running


def test_a_stall_of_the_daemons_own_loop_stops_the_telemetry_flowing_until_it_runs_again(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    running = Running(state)
    try:
        view = running.daemon.telemetry
        wait_for(lambda: view.flowing_since(time.time()) is not None, 10, "telemetry flowing")
        assert running._loop is not None
        stall_s = LOOP_STALL_S + 1.5
        running._loop.call_soon_threadsafe(time.sleep, stall_s)  # a blocking call on the loop
        wait_for(lambda: view.flowing_since(time.time()) is None, stall_s, "the stall seen from another thread")
        stalled_at = time.time()
        wait_for(lambda: view.flowing_since(time.time()) is not None, stall_s + 5, "the loop back")
        since = view.flowing_since(time.time())
        assert since is not None and since >= stalled_at, "flowing again from the loop's return, not before"
    finally:
        running.stop()


_WEDGED_SERVE = """
import sys, time
from cli import daemon as cli
from supervisor.daemon import Daemon

cli.STOP_WITHIN_S = 1.0
async def wedged_stop(self, stop):  # a stop that never ends, whatever holds it: wedged
    await stop.wait()               # from its first moment, so that the deadline finds
    time.sleep(3600)                # it there however loaded the host is
Daemon.run = wedged_stop
sys.exit(cli.main(["serve", "--state-dir", sys.argv[1], "--api-bind", "127.0.0.1:0"]))
"""


def test_a_stop_that_does_not_end_ends_the_process_at_its_deadline_with_the_stacks(tmp_path: Path) -> None:
    """The CI run of issue 36's last stop saw a SIGTERMed daemon still there after 30 s. A
    stop is bounded by the serve process itself: past STOP_WITHIN_S it logs what held it and
    ends with status 1, as systemd's SIGKILL would (nothing is lost: the store is durable)."""
    proc = subprocess.Popen([sys.executable, "-c", _WEDGED_SERVE, str(tmp_path / "state")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (tmp_path / "state" / "api-token").exists(), 60, "the daemon to start")
        time.sleep(1.0)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - began
    finally:
        proc.kill()
    assert proc.returncode == 1 and took < 10, (proc.returncode, took, out[-2000:])
    assert "still stopping after 1 s" in out and "wedged_stop" in out, out[-4000:]
