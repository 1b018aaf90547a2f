"""The node agent: one small process on every node of an attempt (``python -m node.agent``).

The launcher starts it beside the trainer: the local launcher as each simulated node's
own process (supervisor/launchers/local.py), Slurm as a step of its own in the run's
allocation, one task per node, overlapping the trainer's step (supervisor/slurm/
launcher.py). It has no database and keeps nothing: a restarted daemon hears it again on
the broker, as it hears the ranks.

What it does:

- **The node's heartbeat**, whatever the trainer says. Every ``TSUP_AGENT_INTERVAL_S``
  (1 s) it sends an ``AgentReport`` on a connection of its own, sealed with the attempt's
  key like the ranks' telemetry (wire/sealing.py), and leaves ``agent_lost`` as its
  last will. A node killed outright is known by that will at once, and one cut off or
  frozen by its silence within ``silence_timeout_s``: for a ``[command]`` trainer that
  sends nothing of its own too (supervisor/policy/detection.py).
- **Node aggregation.** Where the ranks keep their state in the node's slot file
  (``[telemetry] aggregate = "node"``, wire/slots.py) it reads every slot and carries
  them in that report, so the controller receives one message per node and interval;
  the trainer's local rank 0 then sends none (``TSUP_NODE_AGENT=1``).
- **Fencing.** It listens for its attempt's fence (wire/sealing.py: published,
  retained, once the attempt has ended) and, on an authentic one, SIGKILLs every
  process of the attempt left on its node (this user's processes carrying the attempt's
  ``TSUP_MARKER``: ranks the launcher could no longer reach, such as those of a node
  cut off while its attempt ended), then ends. A node that comes back from a partition
  reconnects, reads the retained fence, and stops training beside the next attempt.

It never ends on its own but on a fence: it runs until the launcher stops it (SIGTERM
or SIGINT: a clean disconnect, so no last will) or kills it with its node. An environment it cannot
use (no broker URL, a bad key) is logged, and it stays a silent node process: the
launcher watches it as the node's own life either way.

Configuration is the attempt's environment, as the ranks get it (``TSUP_MQTT_URL``,
``TSUP_TELEMETRY_KEY``, ``TSUP_MQTT_USERNAME``/``PASSWORD``, ``TSUP_CLUSTER``,
``TSUP_RUN_ID``, ``TSUP_ATTEMPT``, ``TSUP_NODE``, ``MASTER_PORT``, ``TSUP_SLOTS_DIR``:
trainer/telemetry.py), and:

    TSUP_NODE_INDEX       the node's index in the attempt's node list; on Slurm,
                          ``SLURM_NODEID`` stands in (the agent step has one task a node),
                          plus ``TSUP_NODE_BASE`` in one job's part of an attempt that spans
                          two (supervisor/slurm/requests.py: split_env)
    TSUP_AGENT_INTERVAL_S  seconds between reports (default 1)

This module imports only the standard library and the trainer's telemetry sender
(paho): it runs on every node, where the daemon's own dependencies need not be.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

import wire as protocol
from trainer.telemetry import Telemetry
from trainer.telemetry_env import Broker, Identity, broker_from_env, settings_from_env
from wire.errors import UsageError
from wire.slots import default_slots_dir, read_file, report_fields, slot_path

log = logging.getLogger("node.agent")

INDEX_ENV = "TSUP_NODE_INDEX"
NODE_BASE_ENV = "TSUP_NODE_BASE"  # set by the launcher for a split attempt's parts
INTERVAL_ENV = "TSUP_AGENT_INTERVAL_S"
DEFAULT_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class AgentSettings:
    # The attempt, and the node as its ranks name it (TSUP_NODE, else SLURMD_NODENAME, else the
    # host name), in every report; ``rank`` is unused.
    identity: Identity
    index: int  # the node's index in the attempt
    slots: Path  # the node's slot file, where the trainer keeps one
    interval_s: float
    marker: str  # TSUP_MARKER: what every process of the attempt carries ("" when not given)


def settings_from(environ: Mapping[str, str]) -> AgentSettings:
    """The agent's settings from the attempt's environment; UsageError naming a bad value."""
    raw = environ.get(INDEX_ENV) or environ.get("SLURM_NODEID") or ""
    if not (raw.isascii() and raw.isdigit()):
        raise UsageError(f"{INDEX_ENV} (or SLURM_NODEID): expected the node's index, got {raw!r}")
    base = environ.get(NODE_BASE_ENV) or "0"
    if not (base.isascii() and base.isdigit()):
        raise UsageError(f"{NODE_BASE_ENV}: expected the part's first node index, got {base!r}")
    if not environ.get(INDEX_ENV):  # a part of an attempt split over two jobs counts from its first node
        raw = str(int(raw) + int(base))
    raw_interval = environ.get(INTERVAL_ENV) or str(DEFAULT_INTERVAL_S)
    try:
        interval = float(raw_interval)
    except ValueError:
        interval = 0.0
    if not 0.05 <= interval <= 60:
        raise UsageError(f"{INTERVAL_ENV}: expected seconds from 0.05 to 60, got {raw_interval!r}")
    identity, _ = settings_from_env(environ, rank=0, local_rank=0, world_size=1)
    slots = slot_path(default_slots_dir(environ), identity.run, identity.attempt, identity.node,
                      environ.get("MASTER_PORT", ""))
    return AgentSettings(identity=identity, index=int(raw), slots=slots, interval_s=interval,
                         marker=environ.get("TSUP_MARKER", ""))


class AgentLink(Telemetry):
    """The agent's sender: the trainer's telemetry connection (sealing, reconnects, the
    supervisor's presence) speaking for a node instead of a rank."""

    def __init__(self, settings: AgentSettings, broker: Broker, wake: threading.Event) -> None:
        super().__init__(settings.identity, broker, heartbeat_interval_s=settings.interval_s)
        self.settings = settings
        self.broker = broker
        self.fenced: str | None = None  # the fence's reason, once an authentic one came
        self._said_forged = False
        self._wake = wake

    def _header(self) -> dict[str, Any]:
        ident = self.settings.identity
        return {"run": ident.run, "attempt": ident.attempt, "index": self.settings.index, "ts": time.time()}

    def _will(self) -> protocol.Message:
        return protocol.AgentLost(**self._header())

    def _hello(self) -> protocol.Message | None:
        return self.report()  # the first word of a connection is a report like every other

    def _beat(self) -> protocol.Message | None:
        return self.report()

    def _first_word(self) -> protocol.Message | None:
        return None  # its hello says it all

    def _last_word(self, exit_code: int, final_step: int, reason: str) -> protocol.Message | None:
        return None  # a clean disconnect is its goodbye: the broker drops its will

    def _subscriptions(self) -> list[str]:
        ident = self.settings.identity
        return [protocol.fence_topic(self.broker.cluster, ident.run, ident.attempt)]

    def _on_control(self, topic: str, payload: bytes) -> None:
        ident = self.settings.identity
        key = self.broker.key
        if key is None:
            return  # unsealed telemetry: no fence can be told from a forgery
        reason = protocol.fence_reason(payload, topic, key=key, cluster=self.broker.cluster, run=ident.run,
                                       attempt=ident.attempt)
        if reason is not None:
            self.fenced = reason
            self._wake.set()
        elif payload and not self._said_forged:  # (an empty retained message clears a fence)
            self._said_forged = True  # once: a flood of forgeries must not flood the node's log
            log.warning("node agent: ignored a fence on %s that is not this attempt's own (forged, or "
                        "sealed with another key); further ones are ignored without a word", topic)

    def report(self) -> protocol.AgentReport:
        """The node now: alive, with its ranks' slots (none where the trainer keeps no slot file)."""
        fields = report_fields(read_file(self.settings.slots), time.time())
        return protocol.AgentReport(**self._header(), node=self.settings.identity.node, pid=os.getpid(),
                                    hostname=socket.gethostname()[:64], **fields)


def fence(marker: str) -> list[int]:
    """SIGKILL every process of this user's that carries ``marker`` (TSUP_MARKER) but this
    one: what is left of a fenced attempt on this node. The pids signalled."""
    me, uid = os.getpid(), os.geteuid()
    killed: list[int] = []
    if not marker:
        return killed
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.pid == me or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if proc.environ().get("TSUP_MARKER") != marker:
                continue
            proc.send_signal(signal.SIGKILL)
            killed.append(proc.pid)
        except psutil.Error:
            continue
    return killed


def run(environ: Mapping[str, str], stop: threading.Event) -> int:
    """Report until ``stop`` is set or the attempt is fenced; 0. With an environment it
    cannot use, wait for ``stop`` silently."""
    try:
        settings = settings_from(environ)
        broker = broker_from_env(environ)
    except UsageError as e:
        log.error("node agent: %s; staying up without reporting", e)
        stop.wait()
        return 0
    if broker is None:
        log.warning("node agent: no TSUP_MQTT_URL; staying up without reporting")
        stop.wait()
        return 0
    link = AgentLink(settings, broker, stop)
    link.start()
    log.info("node agent for %s attempt %d, node %s (index %d): reporting every %.2g s",
             settings.identity.run, settings.identity.attempt, settings.identity.node, settings.index,
             settings.interval_s)
    stop.wait()
    if link.fenced is not None:
        killed = fence(settings.marker)
        log.info("fenced (%s): SIGKILL to %d process(es) of the attempt on this node%s", link.fenced,
                 len(killed), f" ({', '.join(map(str, killed))})" if killed else "")
    # A clean goodbye: the broker discards the will, so stopping the agent is no node loss.
    link.close(exit_code=0, final_step=0, reason="stopped", timeout_s=2.0)
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return run(os.environ, stop)


if __name__ == "__main__":
    sys.exit(main())
