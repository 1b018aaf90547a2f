"""A TCP port that is free now and stays free until its listener binds it.

A port the kernel hands out for ``bind(0)`` comes from its ephemeral range, the same range
every outgoing connection takes its local port from: between this process closing its
probe socket and a trainer's rendezvous store binding the port (seconds later, after
torch's import), any connection on the host (an MQTT client, a rank's store client) may
take it, and the store then fails to bind while the other ranks wait for it until their
timeout. Ports below the ephemeral range are taken only by a program that names them, so
the port chosen here is one of those, checked free by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below: the well-known and registered services a host may run
_TRIES = 64


def ephemeral_range(text: str | None = None) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default when it cannot be read)."""
    try:
        low, high = (int(n) for n in (text if text is not None else _RANGE_FILE.read_text()).split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1", *, rng: random.Random | None = None) -> int:
    """A port free on ``host`` now, outside the ephemeral range where one is left below it
    (else the kernel's choice)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, _ = ephemeral_range()
    choose = rng or random.SystemRandom()
    for _ in range(_TRIES if low > _LOWEST else 0):
        port = choose.randrange(_LOWEST, low)
        if _bindable(family, host, port):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
