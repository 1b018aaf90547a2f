"""The embedded MQTT broker (amqtt), used when no broker URL is configured.

It runs inside the daemon's event loop and listens on loopback only. Its port is
kept in the state directory, so that a restarted daemon listens where the trainers
that outlived it will reconnect.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

from supervisor.errors import SupervisorError

log = logging.getLogger(__name__)


class EmbeddedBroker:
    def __init__(self, state_dir: Path, host: str = "127.0.0.1") -> None:
        self.state_file = state_dir / "broker.json"
        self.host = host
        self.port = 0
        self._broker: Any = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    async def start(self) -> None:
        from amqtt.broker import Broker  # imported here: only the embedded default needs it

        for logger in ("amqtt", "transitions"):
            logging.getLogger(logger).setLevel(logging.WARNING)
        # Trainers that outlived a previous daemon reconnect to the port they know, so
        # a remembered port is reused or the start fails; never silently moved.
        self.port = self._remembered_port() or _free_port(self.host)
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        broker = Broker(config)
        try:
            await broker.start()
        except Exception as e:  # amqtt raises its own and OSError subclasses
            raise SupervisorError(
                f"cannot start the embedded MQTT broker on {self.url}: {e} (the port is kept in "
                f"{self.state_file} for trainers that outlive a daemon; free it, or remove the file "
                "if no run is live)"
            ) from e
        self._broker = broker
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"host": self.host, "port": self.port}))
        tmp.replace(self.state_file)
        log.info("embedded MQTT broker listening on %s", self.url)

    async def stop(self) -> None:
        if self._broker is not None:
            try:
                await self._broker.shutdown()
            except Exception as e:  # shutting down: log and carry on
                log.warning("embedded broker shutdown: %s", e)
            self._broker = None

    def _remembered_port(self) -> int | None:
        try:
            return int(json.loads(self.state_file.read_text())["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
