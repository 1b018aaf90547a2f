"""Which of this host's addresses faces another host: stdlib only, shared with the
supervisor (which tells ranks the broker address their nodes reach it by)."""

from __future__ import annotations

import socket


def route_source(host: str, port: int = 9) -> str | None:
    """The address of this host that a packet to ``host`` leaves from (the address ``host``
    sees it come from, on a flat network); None when there is no route."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: picks the route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return None
