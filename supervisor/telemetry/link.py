"""The supervisor's MQTT connection (aiomqtt): it subscribes to every rank's and node
agent's telemetry and feeds it to the ``TelemetryView`` (supervisor/telemetry/view.py), keeps
the supervisor's retained presence, and publishes what the daemon sends (its events,
the fences of ended attempts). Reconnects with capped backoff for as long as it runs.
Its loop's pulse (``pulse_forever``) tells the view when that loop stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from pathlib import Path

import aiomqtt
import tenacity

import wire as p
from supervisor.telemetry.view import TelemetryView

log = logging.getLogger(__name__)


# A broker that comes back is heard again within this (a local reconnect attempt is cheap).
LINK_MAX_BACKOFF_S = 1.0
PULSE_S = 0.25  # the receiving loop's pulse (TelemetryView.loop_alive): well under LOOP_STALL_S


class MqttLink:
    """One aiomqtt connection: subscribes to all telemetry, publishes supervisor events.

    Reconnects with capped backoff for as long as it runs; stop it by cancelling its task.
    """

    def __init__(
        self, broker: p.BrokerUrl, view: TelemetryView, clock: Callable[[], float],
        *, client_id: str = "training-supervisor", ca_file: Path | None = None,
    ) -> None:
        self.broker = broker
        self.view = view
        self.clock = clock
        self.client_id = client_id
        self.ca_file = ca_file
        self._client: aiomqtt.Client | None = None

    def client(self) -> aiomqtt.Client:
        """A client for the broker (not connected): credentials and TLS as its URL says."""
        b = self.broker
        tls = None
        if b.tls:
            tls = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        # Gone without a word (killed, cut off): the broker clears the presence for us.
        will = aiomqtt.Will(p.presence_topic(self.view.cluster), p.PRESENCE_CLEARED, qos=1, retain=True)
        return aiomqtt.Client(b.host, b.port, identifier=self.client_id, username=b.username,
                              password=b.password, tls_context=tls, keepalive=10, timeout=5, will=will)

    async def check(self) -> None:
        """Connect once and hang up: MqttError (refused, unreachable, bad TLS) if it cannot."""
        async with self.client():
            pass

    async def run(self) -> None:
        """Connected for as long as it runs: a session until the broker or the network ends
        it, then the next. A connection that cannot be made is tried again after a wait
        that doubles from 0.1 s to LINK_MAX_BACKOFF_S (tenacity); once a session was up,
        the waits start again from the shortest."""
        while True:
            retrying = tenacity.AsyncRetrying(
                retry=tenacity.retry_if_exception_type(aiomqtt.MqttError),
                wait=tenacity.wait_exponential(multiplier=0.1, min=0.1, max=LINK_MAX_BACKOFF_S))
            async for attempt in retrying:
                with attempt:
                    await self._session()

    async def pulse_forever(self) -> None:
        """The pulse of the loop this link receives on, for the view to tell a stalled loop
        (which hears no node) from silent nodes (TelemetryView.loop_alive)."""
        while True:
            self.view.loop_alive(self.clock())
            await asyncio.sleep(PULSE_S)

    async def _session(self) -> None:
        """One connection: MqttError when it cannot be made; returns once it ends after it
        was up."""
        up = False
        try:
            async with self.client() as client:
                await client.subscribe(p.topic_filter(self.view.cluster))
                # Subscribed: the ranks may send what they buffered (wire/topics.py).
                await client.publish(p.presence_topic(self.view.cluster), p.PRESENCE_ONLINE, qos=1,
                                     retain=True)
                self._client, up = client, True
                self.view.link_up(self.clock())
                log.info("telemetry link up (%s)", self.broker)
                try:
                    async for message in client.messages:
                        self._take(message)
                except asyncio.CancelledError:  # the daemon stops: say so, briefly
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(1.0):
                            await client.publish(p.presence_topic(self.view.cluster), p.PRESENCE_CLEARED,
                                                 qos=1, retain=True)
                    raise
        except aiomqtt.MqttError as e:
            if not up:
                raise
            log.warning("telemetry link down: %s", e)
        finally:
            self._client = None
            self.view.link_down(self.clock())

    def _take(self, message: aiomqtt.Message) -> None:
        payload = message.payload
        if isinstance(payload, (bytes, str)):
            self.view.ingest(message.topic.value, payload, self.clock())
        else:
            self.view.count("malformed")

    @property
    def connected(self) -> bool:
        return self._client is not None

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> bool:
        client = self._client
        if client is None:
            return False
        try:
            await client.publish(topic, payload, qos=1, retain=retain)
        except aiomqtt.MqttError:
            return False
        return True
