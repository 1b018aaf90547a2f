"""The daemon's event loop receives the telemetry (and runs the embedded broker). When
it does not run (a blocking call on it, the host's disk), it hears no node, and the
telemetry view must know: no silence is judged until telemetry flows again
(supervisor/telemetry.py, ``loop_alive`` and ``flowing_since``)."""

from __future__ import annotations

import time
from pathlib import Path

from supervisor.telemetry import LOOP_STALL_S
from tests.conftest import wait_for
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
