"""Is the MQTT broker reachable from this node, as the ranks will reach it?

The supervisor hears a run's heartbeats and metrics, and its node agents, through a broker
on the controller (or one it was given). A firewall or a security group that lets Slurm
through but not the broker's port leaves a node training blind: no heartbeat, no step
progress, and node loss found only by Slurm's own timeout (SlurmdTimeout, 300 s by default).

``probe(url)`` connects to the broker's address, with TLS for ``mqtts://`` (``ca_file``: the
CA the ranks are told), and sends an MQTT 3.1.1 CONNECT without a login. Any CONNACK, a
refusal included ("not authorized" is what a broker that requires logins answers), proves
that an MQTT broker answers there: healthy. No connection, a failed TLS handshake, or an
answer that is not a CONNACK is unhealthy, naming the address and what failed. The URL
carries no credentials (the supervisor strips them; they would show in ``ps``).
"""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path
from urllib.parse import urlsplit

from health.model import BROKER, Finding, Status

TIMEOUT_S = 5.0  # the connection, the handshake and the answer, each
PROBE_CLIENT_ID = "tsup-probe"  # a broker may tell a probe's CONNECT from a rank's by it
_CONNACK = 0x20
_RETURN_CODES = {0: "accepted", 1: "refused: protocol version", 2: "refused: client id",
                 3: "refused: server unavailable", 4: "refused: bad login", 5: "refused: not authorized"}


def connect_packet(client_id: str = PROBE_CLIENT_ID) -> bytes:
    """An MQTT 3.1.1 CONNECT: clean session, keep-alive 10 s, no login, no will."""
    ident = client_id.encode()
    header = b"\x00\x04MQTT" + bytes([4, 0x02]) + (10).to_bytes(2, "big")  # MQTT 3.1.1, clean, 10 s
    body = header + len(ident).to_bytes(2, "big") + ident
    return bytes([0x10, len(body)]) + body  # len(body) < 128: one length byte


def connack_code(answer: bytes) -> int | None:
    """The return code of a CONNACK (4 bytes), None for anything else."""
    if len(answer) != 4 or answer[0] != _CONNACK or answer[1] != 2:
        return None
    return answer[3]


def probe(url: str, *, ca_file: Path | None = None, timeout_s: float = TIMEOUT_S) -> Finding:
    try:
        host, port, tls = _address(url)
    except ValueError as e:
        return Finding(probe=BROKER, status=Status.UNKNOWN, evidence=f"unknown: probe failed: {e}")
    where = f"{'mqtts' if tls else 'mqtt'}://{host}:{port}"
    if tls and ca_file is not None and not ca_file.is_file():
        return _unreachable(where, f"the broker's CA file {ca_file} is missing here")
    started = time.monotonic()
    try:
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        return _unreachable(where, f"no connection in {timeout_s:g} s (a firewall or security group dropping "
                                   "the port between this node and the broker?)")
    except OSError as e:
        return _unreachable(where, e.strerror or str(e))
    try:
        with raw:
            if tls:
                context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
                with context.wrap_socket(raw, server_hostname=host) as conn:
                    code = _ask(conn)
            else:
                code = _ask(raw)
    except ssl.SSLError as e:
        return _unreachable(where, f"TLS handshake failed: {e.reason or e}")
    except TimeoutError:
        return _unreachable(where, f"connected, but no answer to a CONNECT in {timeout_s:g} s")
    except OSError as e:
        return _unreachable(where, f"connected, then {e.strerror or e}")
    took_ms = (time.monotonic() - started) * 1000
    if code is None:
        return _unreachable(where, "something answers there, but not as an MQTT broker (no CONNACK)")
    said = _RETURN_CODES.get(code, f"return code {code}")
    return Finding(probe=BROKER, status=Status.HEALTHY,
                   evidence=f"{where} answers from this node in {took_ms:.0f} ms "
                            f"(CONNACK without a login: {said})")


def _ask(conn: socket.socket) -> int | None:
    conn.sendall(connect_packet())
    answer = b""
    while len(answer) < 4:
        chunk = conn.recv(4 - len(answer))
        if not chunk:
            break
        answer += chunk
    code = connack_code(answer)
    if code == 0:
        conn.sendall(b"\xe0\x00")  # DISCONNECT: a broker that let it in is told it is leaving
    return code


def _unreachable(where: str, why: str) -> Finding:
    return Finding(probe=BROKER, status=Status.UNHEALTHY,
                   evidence=f"cannot reach the broker {where} from this node: {why}; its ranks would train "
                            "with no telemetry heard")


def _address(url: str) -> tuple[str, int, bool]:
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise ValueError(f"expected mqtt://HOST:PORT or mqtts://HOST:PORT, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("a broker URL with a login: the probe takes none (it would show in ps)")
    tls = parts.scheme == "mqtts"
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError:
        raise ValueError(f"bad port in {url!r}") from None
    return parts.hostname, port, tls
