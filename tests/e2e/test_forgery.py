"""Telemetry nobody can forge: during a live run, a second process with the attempt's
broker login but without its key publishes a forgery of every kind the protocol has on the real ranks' topics, and
replays a genuine message it captured (tests/fake_tools/forger.py). Nothing is acted
on: one attempt, no fault, no drain, the fault-free model; every forgery is counted as
dropped on /metrics. On the local launcher and on the multi-host Slurm box, where the
ranks also have to reach the broker over the cluster network, not loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurmbox.box import Box
from supervisor.slurm.launcher import prefix_for
from supervisor.telemetry.broker import READER_PASSWORD_FILE
from supervisor.token_file import TELEMETRY_SECRET_NAME
from tests.conftest import REPO, free_port, wait_for
from tests.e2e.conftest import (
    EXAMPLE,
    Serve,
    db_rows,
    env,
    serve_config,
    slurm_serve,
    spec_for_slurm,
    trainer_processes,
)
from wire import attempt_login

pytestmark = pytest.mark.e2e


def forge(state: Path, run_id: str, ranks: int, nodes: list[str]) -> dict[str, Any]:
    """The forger, with what a neighbour of the ranks could learn of the embedded broker's
    logins: the attempt's (it crosses the network in the clear) and a dashboard's."""
    broker = json.loads((state / "broker.json").read_text())
    secret = (state / TELEMETRY_SECRET_NAME).read_text().strip().encode()
    login = ":".join(attempt_login(secret, prefix_for(state), run_id, 1))
    reader = (state / READER_PASSWORD_FILE).read_text().strip()
    proc = subprocess.run([sys.executable, "-m", "tests.fake_tools.forger", broker["host"], str(broker["port"]),
                           run_id, "1", str(ranks), *nodes], capture_output=True, text=True, timeout=120,
                          env={**env(), "FORGER_LOGIN": login, "FORGER_READER": reader}, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _dropped(daemon: Serve) -> dict[str, float]:
    text = daemon.metrics()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'tsup_mqtt_dropped_total\{reason="([a-z_]+)"\} (\S+)', text)}


def run_with_forger(daemon: Serve, spec: Path, nodes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    run_id = daemon.ctl_json("submit", str(spec))["run_id"]
    wait_for(lambda: (daemon.read("status", run_id)["step"] or 0) >= 20, 180, "step 20")
    forged = forge(daemon.state, run_id, 4, nodes)
    final = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED") and d,
                     240, "the run to end")
    return final, forged


def assert_nothing_acted_on(final: dict[str, Any], forged: dict[str, Any], drops: dict[str, float],
                            fault_free: dict[str, Any]) -> None:
    assert final["state"] == "SUCCEEDED", final
    assert final["attempts"] == 1 and final["faults"] == [], "nothing rolled back, nothing restarted"
    assert final["drained_nodes"] == [], "nothing drained"
    assert final["model_digest"] == fault_free["model_digest"]
    kinds = {k.split(" ", 1)[1] for k in forged["published"] if k.startswith("unsigned ")}
    assert kinds == {"exit", "step", "fault", "checkpoint", "node", "lost"}, kinds
    each = sum(n for k, n in forged["published"].items() if k.startswith("unsigned "))
    assert drops.get("unsigned") == each, drops
    assert drops.get("bad_mac") == each, drops
    assert (drops.get("replay") or 0) >= 1, drops


def test_forged_and_replayed_messages_change_nothing_on_the_local_launcher(
        fault_free: dict[str, Any], state: Path) -> None:
    daemon = Serve(state, free_port())
    try:
        final, forged = run_with_forger(daemon, EXAMPLE, ["local-1", "local-2"])
        drops = _dropped(daemon)
    finally:
        daemon.kill(15)
    assert_nothing_acted_on(final, forged, drops, fault_free)


def _tcp_peers(pid: int) -> set[tuple[str, int]]:
    """The remote (address, port) of every established TCP connection in ``pid``'s
    network namespace (its /proc/PID/net/tcp: the node's own table)."""
    peers = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] != "01":  # ESTABLISHED
            continue
        addr, port = fields[2].split(":")
        peers.add((socket.inet_ntoa(struct.pack("<I", int(addr, 16))), int(port, 16)))
    return peers


def _texts_under(root: Path, limit: int = 1_000_000) -> Iterator[str]:
    """The text of every file under ``root`` smaller than ``limit``, read while the run
    writes there: a file or directory that goes meanwhile (a pruned checkpoint) is
    skipped."""
    for directory, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                path = Path(directory) / name
                if path.is_file() and path.stat().st_size < limit:
                    yield path.read_text(errors="replace")


def test_on_the_multi_host_box_ranks_reach_the_broker_over_the_bridge_and_forgeries_change_nothing(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, state: Path) -> None:
    daemon = slurm_serve(state, free_port(), slurm_box)
    broker_port = None
    try:
        spec = spec_for_slurm(tmp_path)
        run_id = daemon.ctl_json("submit", str(spec))["run_id"]
        wait_for(lambda: (daemon.read("status", run_id)["step"] or 0) >= 10, 180, "step 10")
        broker = json.loads((state / "broker.json").read_text())
        broker_port = broker["port"]
        assert broker["host"] == slurm_box.controller_addr, "the broker listens on the cluster network"
        trainers = trainer_processes(state)
        assert len(trainers) == 4
        key = None
        for t in trainers:
            environ = t.environ()
            assert environ["TSUP_MQTT_URL"] == f"mqtt://{slurm_box.controller_addr}:{broker_port}"
            key = environ["TSUP_TELEMETRY_KEY"]
            assert key not in " ".join(t.cmdline()), "the key is never in argv"
            # Each rank's connection to the broker is in its node's own network namespace.
            assert (slurm_box.controller_addr, broker_port) in _tcp_peers(t.pid), _tcp_peers(t.pid)
        assert key and not any(key in text for text in _texts_under(state / "runs")), "the key is in no file"
        forged = forge(state, run_id, 4, ["node1", "node2"])
        final = wait_for(lambda: (d := daemon.read("status", run_id))["state"] in ("SUCCEEDED", "FAILED")
                         and d, 240, "the run to end")
        drops = _dropped(daemon)
    finally:
        daemon.kill(15)
        for p in trainer_processes(state):
            p.kill()
    assert_nothing_acted_on(final, forged, drops, fault_free)
    # Full telemetry across hosts: every step's metrics were received and stored.
    assert db_rows(state, "SELECT count(DISTINCT step) FROM metrics")[0][0] >= 70


def flood(state: Path, count: int, login_chars: int) -> dict[str, Any]:
    """tests/fake_tools/login_flood.py against the daemon's embedded broker: a second process."""
    port = json.loads((state / "broker.json").read_text())["port"]
    out = subprocess.run([sys.executable, "-m", "tests.fake_tools.login_flood", "127.0.0.1", str(port),
                          str(count), str(login_chars)],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=env(), check=True)
    return dict(json.loads(out.stdout))


def test_refused_connects_with_huge_logins_grow_neither_the_daemon_nor_its_log(tmp_path: Path) -> None:
    """H6 of issue 37: 3,000 refused CONNECTs with 60 KB logins grew the daemon by 517 MiB
    (every refused login was kept) and wrote 180 MB of log. Now such a CONNECT is refused
    at its header, a login that fits is checked and forgotten, and an address gets a few
    log lines a minute: the daemon grows by little, its log by a few lines, and it serves."""
    import psutil

    state, port = tmp_path / "state", free_port()
    daemon = Serve(state, port, config=serve_config(tmp_path / "config.toml", state, port))
    try:
        proc = psutil.Process(daemon.proc.pid)
        flood(state, 50, 200)  # warm: the first refusals' code paths
        rss, log_size = proc.memory_info().rss, daemon.log_path.stat().st_size
        huge = flood(state, 3000, 60_000)
        fitting = flood(state, 3000, 250)
        grown = (proc.memory_info().rss - rss) / 2**20
        logged = daemon.log_path.stat().st_size - log_size
        assert grown < 48, f"the daemon grew by {grown:.0f} MiB ({huge}, {fitting})"
        assert logged < 20_000, f"{logged} bytes of log for 6,000 refusals"
        assert huge["refused"] == 0 and huge["closed"] == 3000, huge
        assert fitting["refused"] == 3000, fitting
        assert daemon.ctl_json("nodes") is not None, "it still serves"
        text = daemon.log_path.read_text()
        assert "u" * 100 not in text, "a login is cut short in the log"
    finally:
        daemon.kill(15)
