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

Who may do what: supervisor/telemetry/access.py (``BrokerAccess``), which this broker
asks at every CONNECT and for every message.

amqtt cannot be told most of this, so the broker is amqtt's with its connection step
replaced (``_admit``). amqtt drops or takes over the session that holds a client id
before it authenticates the client that asks for it; here a CONNECT is judged first,
and refused (CONNACK 5, not authorized) for a bad or missing login, a client id that is
not the account's (a rank's is ``tsup-<run>-<attempt>-<rank>-<pid>`` of its own
attempt, the supervisor's starts ``training-supervisor``, a reader's is neither), a
persistent session (this broker keeps none: what it queued for one would grow without
bound), a last will the account could not publish (or retain) itself, and an attempt
that is not live in the store. A CONNECT longer than ``MAX_CONNECT_BYTES`` is refused at
its header. A refusal's log line names the login escaped and cut short, and an address
gets at most ``REFUSALS_LOGGED`` of them every ``REFUSAL_WINDOW_S`` (then one line with
how many more there were). A node's probe of the broker (health/broker.py: client id
``tsup-probe``, no login) is refused like any stranger, and logged at debug only.
Nothing cuts an address off: on a shared node, that would let one tenant keep another's
ranks out. A CONNECT must come within ``CONNECT_WITHIN_S``.
A packet longer than ``MAX_PACKET_BYTES`` (the supervisor's own excepted) ends its
connection as its header announces it, before its body is read (``PacketLimit``). A
retained message is kept only from the supervisor on its presence topic and its fences;
from anyone else it is delivered and not kept. A retained message reaches only a
session that may subscribe to its filter: amqtt itself hands a session that connects the
retained messages of every filter any session has subscribed to, unchecked (another
attempt's fence, for one).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from health.broker import PROBE_CLIENT_ID
from supervisor.errors import SupervisorError
from supervisor.logs import printable
from supervisor.ports import free_port
from supervisor.telemetry.access import (
    MAX_PACKET_BYTES,
    BrokerAccess,
)
from wire.routes import route_source

_WILDCARD = ("0.0.0.0", "::")  # noqa: S104 - a bind the operator chose, recognised here

SUPERVISOR_PASSWORD_FILE = "broker-password"  # noqa: S105 - in the state directory, 0600
# The broker's read-only login's (a dashboard's), a secret of its own: the API's read
# token opens the API, never the broker too. 0600, or 0640 for a dashboards' group.
READER_PASSWORD_FILE = "broker-reader-password"  # noqa: S105 - a file name, not a secret
CONNECT_WITHIN_S = 10.0  # a connection that sends no CONNECT in this long is closed
# The longest CONNECT: two logins, a client id and a last will (a rank's is a few hundred bytes).
MAX_CONNECT_BYTES = 4 * 1024
_SHOWN_CHARS = 64  # of a refused login, in the log

log = logging.getLogger(__name__)


class PacketTooLarge(Exception):
    """A client announced a packet longer than it may send."""


class PacketLimit:
    """A client's stream, as amqtt reads it (its ReaderAdapter), that ends the connection
    at a packet longer than ``limit`` bytes (None: any), as the packet's fixed header
    announces its length: before amqtt reads the body into memory."""

    def __init__(self, reader: asyncio.StreamReader, limit: int | None) -> None:
        self._reader = reader
        self.limit = limit
        self._body_left = 0  # bytes of the current packet still to come
        self._length: int | None = None  # its remaining length so far; None: at a packet's first byte
        self._shift = 0

    async def read(self, n: int = -1) -> bytes:
        data = await (self._reader.read() if n < 0 else self._reader.readexactly(n))
        self._follow(data)
        return data

    def feed_eof(self) -> None:
        self._reader.feed_eof()

    def _follow(self, data: bytes) -> None:
        """Follow the packets' boundaries through ``data``: a type byte, the remaining
        length (7 bits a byte, at most 4 bytes), then that many bytes of body."""
        i = 0
        while i < len(data):
            if self._body_left:
                took = min(self._body_left, len(data) - i)
                self._body_left -= took
                i += took
            elif self._length is None:
                self._length, self._shift = 0, 0
                i += 1
            else:
                byte = data[i]
                i += 1
                self._length += (byte & 0x7F) << self._shift
                self._shift += 7
                if byte & 0x80 and self._shift >= 28:
                    raise PacketTooLarge("a remaining length of more than 4 bytes")
                if not byte & 0x80:
                    if self.limit is not None and self._length > self.limit:
                        raise PacketTooLarge(f"a packet of {self._length} bytes (at most {self.limit})")
                    self._body_left, self._length = self._length, None


async def _admit(broker: Any, reader: Any, writer: Any, address: str, port: int) -> tuple[Any, Any]:
    """amqtt's connection step, with the checks first (see the module docstring):
    (its protocol handler, its session), or AMQTTError when refused (logged here)."""
    from amqtt.errors import AMQTTError, MQTTError, NoDataError
    from amqtt.mqtt.connack import NOT_AUTHORIZED, ConnackPacket
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
    from amqtt.utils import gen_client_id

    access: BrokerAccess = broker.access
    try:
        async with asyncio.timeout(CONNECT_WITHIN_S):
            handler, session = await BrokerProtocolHandler.init_from_connect(reader, writer,
                                                                             broker.plugins_manager)
    except (AMQTTError, MQTTError, NoDataError, PacketTooLarge, TimeoutError) as e:
        await _close(writer)
        _log_refusal(access, address, port, f"no acceptable CONNECT: {_shown(str(e) or type(e).__name__)}")
        raise AMQTTError(f"{address}:{port}: no acceptable CONNECT") from e
    session.client_id = session.client_id or gen_client_id()
    account = access.account(session.username, session.password)
    held = broker.sessions.get(session.client_id)
    holder = held[0].username if held is not None and held[0].transitions.is_connected() else None
    will = (session.will_topic, bool(session.will_retain)) if session.will_flag else None
    why = access.refusal(account, client_id=session.client_id, clean_session=session.clean_session,
                         will=will, holder=holder)
    if why is not None:
        if session.client_id == PROBE_CLIENT_ID and session.username is None:
            log.debug("embedded broker: %s:%d: a node's probe, answered", address, port)  # health/broker.py
        else:
            who = _shown(session.username or "anonymous")
            _log_refusal(access, address, port, f"refused {who!r}: {_shown(why)}")
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await ConnackPacket.build(0, NOT_AUTHORIZED).to_stream(writer)
        await _close(writer)
        raise AMQTTError(f"{address}:{port}: refused")
    if isinstance(reader, PacketLimit):
        reader.limit = account.max_packet if account is not None else MAX_PACKET_BYTES
    # A clean session, as every one is here: the account's own earlier one with this id goes.
    await broker._delete_session(session.client_id)
    session.parent = 0
    return handler, session


def _log_refusal(access: BrokerAccess, address: str, port: int, why: str) -> None:
    """A refused CONNECT's line in the log (amqtt's own is filtered out), as many as
    ``refused`` lets through."""
    logged, unlogged = access.refused(address, time.monotonic())
    if unlogged:
        log.warning("embedded broker: %d more refused CONNECTs from %s were not logged", unlogged, address)
    if logged:
        log.warning("embedded broker: %s:%d: %s", address, port, why)


class _AmqttRefusals(logging.Filter):
    """amqtt's line for each connection it could not set up: ``_admit`` logs its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to initialize client session")


def _shown(text: str) -> str:
    """A stranger's text for a log line: control and format characters escaped, cut short."""
    cut = f"... ({len(text)} characters)" if len(text) > _SHOWN_CHARS else ""
    return printable(text[:_SHOWN_CHARS]) + cut


async def _close(writer: Any) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5):
            await writer.close()


@functools.cache
def _guarded_broker() -> type:
    """amqtt's Broker with the checks of the module docstring (amqtt is imported here:
    only the embedded default needs it)."""
    from amqtt.adapters import StreamWriterAdapter
    from amqtt.broker import Broker
    from amqtt.contexts import Action

    class GuardedBroker(Broker):  # type: ignore[misc]
        def __init__(self, config: dict[str, Any], access: BrokerAccess) -> None:
            super().__init__(config)
            self.access = access

        async def stream_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                   listener_name: str) -> None:
            await self._client_connected(listener_name, PacketLimit(reader, MAX_CONNECT_BYTES),
                                         StreamWriterAdapter(writer))

        async def _initialize_client_session(self, reader: Any, writer: Any, address: str,
                                             port: int) -> tuple[Any, Any]:
            return await _admit(self, reader, writer, address, port)

        async def _authenticate(self, session: Any, _listener: Any) -> bool:
            return self.access.account(session.username, session.password) is not None

        async def _topic_filtering(self, session: Any, topic: str, action: Action) -> bool:
            account = self.access.account(session.username, session.password)
            if account is None:
                return False
            if action == Action.PUBLISH:
                return account.may_publish(topic)
            return account.may_subscribe(topic)  # SUBSCRIBE, and RECEIVE: what it may read

        async def _publish_retained_messages_for_subscription(self, subscription: tuple[str, int],
                                                              session: Any) -> None:
            # amqtt hands a session that connects the retained messages of every filter any
            # session subscribed to, unchecked: a login reads here only what it may subscribe to.
            if await self._topic_filtering(session, subscription[0], Action.SUBSCRIBE):
                await super()._publish_retained_messages_for_subscription(subscription, session)

        async def retain_message(self, source_session: Any, topic_name: str | None, data: Any,
                                 qos: int | None = None) -> None:
            if source_session is not None:  # None: the broker's own
                account = self.access.account(source_session.username, source_session.password)
                if account is None or topic_name is None or not account.may_retain(topic_name):
                    log.debug("embedded broker: not retained: %s on %s", source_session.client_id, topic_name)
                    return
            await super().retain_message(source_session, topic_name, data, qos)

    return GuardedBroker


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

    async def start(self, access: BrokerAccess) -> None:
        """Listen, letting in only the logins of ``access``."""
        for logger in ("amqtt", "transitions"):
            logging.getLogger(logger).setLevel(logging.WARNING)
        amqtt_broker = logging.getLogger("amqtt.broker")
        if not any(isinstance(f, _AmqttRefusals) for f in amqtt_broker.filters):
            amqtt_broker.addFilter(_AmqttRefusals())
        # Trainers that outlived a previous daemon reconnect to the port they know, so
        # a remembered port is reused or the start fails; never silently moved.
        self.port = self.port or self._remembered_port() or free_port(self.host)
        bind = f"[{self.host}]" if ":" in self.host else self.host
        # No plugins: the broker's own checks stand in for amqtt's authentication and topic ones.
        config = {"listeners": {"default": {"type": "tcp", "bind": f"{bind}:{self.port}"}}, "plugins": {}}
        broker = _guarded_broker()(config, access)
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
        log.info("embedded MQTT broker listening on %s (logins required)", self.url)

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
