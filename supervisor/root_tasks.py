"""Ending the daemon's root tasks (the reconciler, the API, the outbox, the telemetry
link): cancelled, each is waited for until it has ended.

On Python 3.11, ``asyncio.wait_for`` (aiomqtt awaits every acknowledgement through it)
drops a cancellation that arrives as the awaited acknowledgement does: the outbox, so
cancelled while it published a run's last events, published on, and the daemon's stop
waited for it forever. A task still running a second after it was cancelled is
cancelled again.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 1.0  # a task still running this long after it was cancelled is cancelled again


async def cancelled(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and return once every one has ended (its outcome retrieved)."""
    pending = [t for t in tasks if not t.done()]
    while pending:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=RECANCEL_S)
        pending = [t for t in pending if not t.done()]
    for task in tasks:  # retrieved, so that none is reported as never retrieved
        if not task.cancelled():
            task.exception()
