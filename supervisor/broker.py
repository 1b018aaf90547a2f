"""The embedded MQTT broker (amqtt), used when no broker URL is configured, and where
ranks find the broker.

The broker runs inside the daemon's event loop. Its port is kept in the state
directory, so that a restarted daemon listens where the trainers that outlived it will
reconnect.

Where it listens and what ranks are told (``broker_addresses``): on a cluster the ranks
run on other hosts, where 127.0.0.1 is the node itself. With the Slurm launcher the
broker listens on the address this host sends from towards the cluster's nodes (the one
they reach it by on a flat cluster network), and ranks are told that address; with the
local launcher, on loopback. ``mqtt_bind`` (HOST or HOST:PORT) and
``mqtt_advertise_url`` override either half, for a controller behind NAT or with
several networks. The daemon refuses to start when the advertised address does not
answer from this host: a typo would otherwise cost every run its telemetry until the
hang rules fire.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from supervisor.errors import SupervisorError
from trainer.routes import route_source

_WILDCARD = ("0.0.0.0", "::")  # noqa: S104 - a bind the operator chose, recognised here

log = logging.getLogger(__name__)


class EmbeddedBroker:
    def __init__(self, state_dir: Path, host: str = "127.0.0.1") -> None:
        self.state_file = state_dir / "broker.json"
        self.host = host  # where it listens
        self.port = 0  # 0: the remembered port, or a free one
        self._broker: Any = None

    @property
    def url(self) -> str:
        """Where this host reaches it (loopback when it listens on every address)."""
        host = "127.0.0.1" if self.host in _WILDCARD else self.host
        return f"mqtt://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> None:
        from amqtt.broker import Broker  # imported here: only the embedded default needs it

        for logger in ("amqtt", "transitions"):
            logging.getLogger(logger).setLevel(logging.WARNING)
        # Trainers that outlived a previous daemon reconnect to the port they know, so
        # a remembered port is reused or the start fails; never silently moved.
        self.port = self.port or self._remembered_port() or _free_port(self.host)
        bind = f"[{self.host}]" if ":" in self.host else self.host
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{bind}:{self.port}"}},
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
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def broker_addresses(bind: str | None, advertise: str | None,
                     node_addrs: Sequence[str] | None) -> tuple[str, int | None, str]:
    """(the host the embedded broker listens on, its port or None, the URL ranks are told
    with ``{port}`` for the broker's port). ``node_addrs``: the cluster's node addresses,
    None for the local launcher (its ranks run on this host)."""
    host, port = (_split_bind(bind) if bind else (None, None))
    towards = None
    if node_addrs is not None and (host is None or host in _WILDCARD) and advertise is None:
        if not node_addrs:
            raise SupervisorError("mqtt_bind: Slurm listed no nodes, so the address they reach this host "
                                  "by is unknown; set mqtt_bind (and mqtt_advertise_url)")
        towards = route_source(node_addrs[0])
        if towards is None:
            raise SupervisorError(f"mqtt_bind: no route from this host to node address {node_addrs[0]}; "
                                  "set mqtt_bind and mqtt_advertise_url")
    if host is None:
        host = towards or "127.0.0.1"
    if advertise is not None:
        return host, port, advertise
    shown = towards or host
    if shown in _WILDCARD:
        shown = "127.0.0.1"  # the local launcher: its ranks are on this host
    return host, port, f"mqtt://{f'[{shown}]' if ':' in shown else shown}:{{port}}"


def _split_bind(bind: str) -> tuple[str, int | None]:
    """'10.0.0.5' or '10.0.0.5:1883' or '[::]:1883' -> (host, port or None); ValueError
    when the port is not one (the config's validation, which names the key, calls it first)."""
    with_port = bind.startswith("[") or bind.count(":") == 1
    if with_port:
        host, _, port = bind.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST or HOST:PORT, got {bind!r}")
        return host.strip("[]"), int(port)
    return bind, None


def check_bind(bind: str) -> str:
    """``mqtt_bind`` as the config validates it: an IP address, optionally with a port."""
    host, _ = _split_bind(bind)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"expected an IP address (HOST or HOST:PORT), got {bind!r}") from None
    return bind
