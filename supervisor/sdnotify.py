"""systemd's notify protocol (sd_notify(3)), without libsystemd.

Under ``Type=notify`` systemd sets ``NOTIFY_SOCKET`` and waits for ``READY=1``; with
``WatchdogSec=`` it also sets ``WATCHDOG_USEC`` and restarts the service when no
``WATCHDOG=1`` arrives within that time. The daemon says READY after its first
reconcile tick and WATCHDOG after each tick that completes, so a wedged reconciler loop
is restarted even while the process and its API look alive. Outside systemd every call
does nothing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        # "@name" is a socket in the abstract namespace
        self.address: str | None = ("\0" + path[1:] if path.startswith("@") else path) or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_s: float | None = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self._pinged_at = -float("inf")

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=value`` lines in one datagram; False when not under systemd or it failed.

        Never blocks: a receiver whose queue is full (a wedged systemd, a test that stopped
        reading) must not stall the reconciler that calls this. The message is dropped."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.sendto("\n".join(assignments).encode(), self.address)
        except OSError:  # BlockingIOError included
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        """WATCHDOG=1, at most four times per watchdog interval."""
        if self.watchdog_s is None:
            return False
        now = time.monotonic()
        if now - self._pinged_at < self.watchdog_s / 4:
            return False
        self._pinged_at = now
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={status}")
