"""The broker probe (health/broker.py) against real brokers and real sockets: mosquitto
open and with TLS and logins, a closed port, a listener that is no broker, one that never
answers; and through ``python -m health``, as the supervisor runs it on a node."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from health import broker
from health.model import Status
from supervisor.ports import free_port
from tests.conftest import REPO, Broker, secure_mosquitto, stop_by_pid


def test_an_open_broker_answers_and_lets_the_probe_in(mosquitto: Broker) -> None:
    found = broker.probe(mosquitto.url)
    assert found.status is Status.HEALTHY, found
    assert found.evidence.startswith(f"mqtt://127.0.0.1:{mosquitto.port} answers from this node in ")
    assert "accepted" in found.evidence


def test_a_broker_with_tls_and_logins_refuses_the_probe_and_that_proves_it_answers(tmp_path: Path) -> None:
    secured = secure_mosquitto(tmp_path)
    try:
        url = f"mqtts://127.0.0.1:{secured.broker.port}"
        found = broker.probe(url, ca_file=secured.ca_file)
        assert found.status is Status.HEALTHY and "refused: not authorized" in found.evidence, found
        unknown_ca = broker.probe(url)  # the system's CAs do not know the site's
        assert unknown_ca.status is Status.UNHEALTHY and "TLS handshake failed" in unknown_ca.evidence
        gone = broker.probe(url, ca_file=tmp_path / "no-such-ca.pem")
        assert gone.status is Status.UNHEALTHY and "no-such-ca.pem is missing here" in gone.evidence
    finally:
        stop_by_pid(secured.proc)


@pytest.fixture
def listener() -> Iterator[tuple[int, list[socket.socket]]]:
    """A TCP port that accepts connections and holds them (the test decides what they get)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        server.close()
        for conn in accepted:
            conn.close()


def test_a_port_that_accepts_but_never_answers_is_unhealthy_within_the_timeout(
        listener: tuple[int, list[socket.socket]]) -> None:
    port, _ = listener
    found = broker.probe(f"mqtt://127.0.0.1:{port}", timeout_s=0.5)
    assert found.status is Status.UNHEALTHY
    assert found.evidence == (f"cannot reach the broker mqtt://127.0.0.1:{port} from this node: connected, but no "
                              "answer to a CONNECT in 0.5 s; its ranks would train with no telemetry heard")


def test_what_answers_but_is_no_broker_and_a_closed_port_are_unhealthy() -> None:
    web = socket.create_server(("127.0.0.1", 0))

    def answer_http() -> None:
        conn, _ = web.accept()
        with conn:
            conn.recv(64)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    threading.Thread(target=answer_http, daemon=True).start()
    try:
        found = broker.probe(f"mqtt://127.0.0.1:{web.getsockname()[1]}")
    finally:
        web.close()
    assert found.status is Status.UNHEALTHY and "not as an MQTT broker" in found.evidence, found
    closed = broker.probe(f"mqtt://127.0.0.1:{free_port()}")
    assert closed.status is Status.UNHEALTHY and "Connection refused" in closed.evidence, closed


def test_a_url_with_a_login_is_refused_before_anything_is_sent() -> None:
    found = broker.probe("mqtt://rank:secret@127.0.0.1:1883")
    assert found.status is Status.UNKNOWN and "takes none" in found.evidence
    assert "secret" not in found.evidence


def test_the_node_probe_reports_the_broker_it_was_given(mosquitto: Broker, tmp_path: Path) -> None:
    """``python -m health --broker``, as a node runs it: the finding joins the verdict, and
    a broker that does not answer makes the node unhealthy (exit 2)."""
    def node_probe(url: str) -> tuple[int, dict[str, object]]:
        done = subprocess.run([sys.executable, "-m", "health", "--checkpoint-dir", str(tmp_path),
                               "--min-free-gib", "0", "--shared-host", "--json", "--compact", "--broker", url],
                              capture_output=True, text=True, cwd=REPO, check=False, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "TSUP_HEALTH_TOOLS": str(tmp_path)})
        [found] = [f for f in json.loads(done.stdout)["findings"] if f["probe"] == "broker"]
        return done.returncode, found

    code, found = node_probe(mosquitto.url)
    assert found["status"] == "healthy", found
    code, found = node_probe(f"mqtt://127.0.0.1:{free_port()}")
    assert code == 2 and found["status"] == "unhealthy", found
