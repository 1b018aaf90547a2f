"""Publishes this rank's telemetry (wire/) to the supervisor over MQTT.

Rule one: telemetry never blocks or slows a training step, whatever the broker does.
The training thread only builds a small message and puts it into a bounded queue
without waiting; when the queue is full the message is dropped and counted. A daemon
thread (the *sender*) owns the paho client: it connects and reconnects with backoff
(paho's network thread does the socket work), publishes what the queue holds, and sends
a ``Heartbeat`` every ``heartbeat_interval_s`` carrying the last completed step and the
current phase, so heartbeats keep flowing while the training thread is busy or stuck.
While the broker is unreachable, messages wait in the queue (QUEUE_SIZE of them) and go
out in order after the reconnect; heartbeats are made fresh, never queued.

Per connection: the ``Lost`` message is the MQTT last will on this rank's topic, and a
fresh ``Register`` goes out on every (re)connect so the supervisor can rebuild its
rank-to-node map after a broker restart. ``close`` publishes ``Exit`` and disconnects
cleanly, which tells the broker to discard the will. Reconnects back off from
RECONNECT_MIN_DELAY_S to at most RECONNECT_MAX_DELAY_S, so that the supervisor hears the
rank again within seconds of a broker's return, with what the queue kept meanwhile. The
queue is flushed once the supervisor says it is subscribed (its retained presence,
wire/topics.py), or after PRESENCE_WAIT_S without a word: back before the
supervisor, the rank would otherwise publish its buffer to nobody. Heartbeats go out at
once either way.

Sealing (wire/sealing.py): with the attempt's key every message carries this
connection's id, a sequence number and a MAC. Each connection attempt gets a new id and
a new will (paho's ``on_pre_connect``), so a will the broker published once cannot be
replayed as a later connection's. One lock covers numbering and handing to paho, so that
the numbers go on the wire in order.

Aggregation (``TSUP_TELEMETRY_AGGREGATE``): ``rank`` (the default) is all of the above,
one heartbeat a second and one StepMetrics a step from every rank. ``node`` cuts the
supervisor's load by the ranks per node: every rank keeps its state (step, phase, last
step time and busy time) in its slot of the node's slot file (wire/slots.py; the
training thread writes it with one pwrite, the sender rewrites it every heartbeat
interval), and one reader publishes, once a heartbeat interval, every slot of the node:
its node agent where the supervisor started one (``TSUP_NODE_AGENT=1``,
node/agent.py, an ``AgentReport``), else the node's local rank 0 (a ``NodeReport``, instead
of its heartbeat). No rank sends Heartbeat or
PhaseChange then, and only global rank 0 sends StepMetrics (the loss, which the
supervisor stores and judges). Register, CheckpointCommitted, FaultInjected, Exit and
the will (``Lost``) stay per rank, each on the rank's own connection. If the slot file
cannot be opened, the rank logs why and falls back to ``rank``.

Configuration comes from the environment the supervisor sets (trainer/telemetry_env.py).

Extending: a sender that is not a rank (the node agent) subclasses ``Telemetry`` and
overrides the methods that say who it is: ``_header``, ``_will``, ``_hello``, ``_beat``,
``_first_word`` and ``_last_word``, and hears the supervisor through ``_subscriptions``
and ``_on_control``; the connection, sealing, buffering and reconnects stay this class's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

import wire as protocol
from trainer import telemetry_env
from trainer.telemetry_env import Aggregation, Broker, Identity, aggregation_from_env, settings_from_env
from wire import Phase
from wire.slots import NodeSlots, report_fields, slot_path

log = logging.getLogger(__name__)

KEEPALIVE_S = 10  # the broker declares a silent connection dead after 1.5x this
RECONNECT_MIN_DELAY_S = 1
RECONNECT_MAX_DELAY_S = 2
QUEUE_SIZE = 1024  # messages; at one StepMetrics per step this is minutes of outage


class Telemetry:
    """This rank's publisher. With ``broker=None`` every method is a cheap no-op."""

    def __init__(self, identity: Identity, broker: Broker | None, *,
                 heartbeat_interval_s: float, queue_size: int = QUEUE_SIZE,
                 aggregation: Aggregation | None = None) -> None:
        self._id = identity
        self._broker = broker
        self._aggregation = aggregation
        # Node aggregation, set up by start(); None: this rank publishes its own state.
        self._slots: NodeSlots | None = None
        self._next_slot_write = 0.0  # time.monotonic() of the sender's next rewrite
        self._heartbeat_interval_s = heartbeat_interval_s
        self._queue: queue.Queue[protocol.Message | None] = queue.Queue(maxsize=queue_size)
        # Written by the training thread, read by the sender for heartbeats. Plain
        # attribute assignment is atomic under the GIL, so no lock is needed.
        self._phase = Phase.INIT
        self._step = 0
        self._final: protocol.Message | None = None
        self._stopping = threading.Event()
        self._close_deadline = 0.0  # time.monotonic() by which the sender must give up
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: mqtt.Client | None = None
        self._unreachable_said = False  # paho's thread alone: "cannot reach" logged this outage
        # The supervisor's presence, as paho's thread last read it (see _may_flush).
        self._presence_since, self._supervisor_online = time.monotonic(), False
        # Counters, read by anyone. The training thread alone writes dropped_queue_full;
        # the other two are written by the sender and paho's thread, hence the lock.
        self.dropped_queue_full = 0  # the queue was full (a long outage or a slow broker)
        self.dropped_not_connected = 0  # still unsent at close (no connection by then)
        self.sent = 0
        # Numbering a message and handing it to paho happen under this lock (the sender
        # and paho's thread both publish), and so do the counters they write.
        self._publish_lock = threading.Lock()
        self._seq = protocol.WILL_SEQ  # the last number used
        self._conn = ""  # this connection's id (a new one before each connection attempt)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, rank: int, local_rank: int,
                 world_size: int, heartbeat_interval_s: float, local_world_size: int = 1) -> Telemetry:
        identity, broker = settings_from_env(environ, rank=rank, local_rank=local_rank,
                                             world_size=world_size, local_world_size=local_world_size)
        aggregation = aggregation_from_env(environ, local_rank=local_rank, local_world_size=local_world_size)
        return cls(identity, broker, heartbeat_interval_s=heartbeat_interval_s, aggregation=aggregation)

    @classmethod
    def started_for(cls, environ: Mapping[str, str], launch: telemetry_env.LaunchedAs, *,
                    heartbeat_interval_s: float) -> Telemetry:
        """This rank's telemetry, as the launcher placed it (``launch``), started."""
        telemetry = cls.from_env(environ, rank=launch.rank, local_rank=launch.local_rank,
                                 world_size=launch.world_size, local_world_size=launch.local_world_size,
                                 heartbeat_interval_s=heartbeat_interval_s)
        telemetry.start()
        return telemetry

    @property
    def identity(self) -> Identity:
        return self._id

    @property
    def enabled(self) -> bool:
        return self._broker is not None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def aggregated(self) -> bool:
        """This rank's step and phase go through its node's slot file (see the docstring)."""
        return self._slots is not None

    def stats(self) -> dict[str, int]:
        return {"sent": self.sent, "dropped_queue_full": self.dropped_queue_full,
                "dropped_not_connected": self.dropped_not_connected}

    # ---- called from the training thread; none of these may block --------------------

    def start(self) -> None:
        """Start the sender thread (it connects in the background)."""
        if self._broker is None or self._thread is not None:
            return
        if self._aggregation is not None:
            self._open_slots(self._aggregation)
        self._thread = threading.Thread(target=self._run_sender, name="telemetry-sender",
                                        daemon=True)
        self._thread.start()
        first = self._first_word()
        if first is not None:
            self._put(first)

    def _open_slots(self, aggregation: Aggregation) -> None:
        ident = self._id
        path = slot_path(aggregation.slots_dir, ident.run, ident.attempt, ident.node, aggregation.job)
        try:
            self._slots = NodeSlots(path, rank=ident.rank, local_rank=ident.local_rank,
                                    local_world_size=ident.local_world_size)
        except OSError as e:
            log.warning("telemetry: cannot open the node slot file %s (%s); publishing per rank", path, e)
            return
        self._slots.update(step=self._step, phase=self._phase)

    def set_phase(self, phase: Phase, step: int, *, size: int = 0) -> None:
        """Enter ``phase``; ``size``: the bytes of this rank's state it moves (a checkpoint
        save or a restore), for an allowance at the pace the run measured."""
        if phase != self._phase:
            self._phase = phase
            if self._slots is not None:
                self._slots.update(phase=phase)
            elif self._broker is not None:
                self._put(protocol.PhaseChange(**self._header(), phase=phase, step=step, bytes=max(0, size)))

    def step_completed(self, *, step: int, loss: float, grad_norm: float | None, lr: float,
                       step_time_s: float, tokens_per_s: float, first_sample: int = 0,
                       busy_s: float = math.nan, param_norm: float = math.nan,
                       mfu: float = math.nan, val_loss: float = math.nan) -> None:
        self._step = step
        if self._broker is None:
            return
        if self._slots is not None:
            self._slots.update(step=step, step_time_s=step_time_s, busy_s=busy_s)
            if self._id.rank != 0:  # global rank 0's metrics carry the loss: always sent
                return
        self._put(protocol.StepMetrics(**self._header(), step=step, loss=loss,
                                       grad_norm=grad_norm, lr=lr, step_time_s=step_time_s,
                                       tokens_per_s=tokens_per_s, first_sample=first_sample,
                                       busy_s=busy_s, param_norm=param_norm, mfu=mfu,
                                       val_loss=val_loss))

    def restored(self, step: int) -> None:
        """The run continues after ``step`` (from a checkpoint): heartbeats say so."""
        self._step = step
        if self._slots is not None:
            self._slots.update(step=step)

    def checkpoint_committed(self, *, step: int, path: str, duration_s: float,
                             tier: str = protocol.TIER_PERSISTENT, total_s: float = math.nan,
                             size: int = 0) -> None:
        """A save is complete: training was blocked ``duration_s``, the whole save took
        ``total_s`` and wrote ``size`` bytes of this rank's state."""
        if self._broker is None:
            return
        self._put(protocol.CheckpointCommitted(**self._header(), step=step, path=path,
                                               duration_s=duration_s, tier=tier, total_s=total_s,
                                               bytes=max(0, size)))

    def checkpoint_restored(self, *, step: int, path: str, tier: str, duration_s: float, size: int) -> None:
        """The ranks resumed from ``path``: the restore took ``duration_s`` for ``size``
        bytes of this rank's state."""
        if self._broker is None:
            return
        self._put(protocol.CheckpointRestored(**self._header(), step=step, path=path, tier=tier,
                                              duration_s=duration_s, bytes=max(0, size)))

    def fault_injected(self, *, action: str, step: int, detail: str) -> None:
        """A chaos drill's fault fired on this rank."""
        if self._broker is None:
            return
        self._put(protocol.FaultInjected(**self._header(), action=action, step=step, detail=detail[:500]))

    def close(self, *, exit_code: int, final_step: int, reason: str,
              timeout_s: float = 3.0) -> None:
        """Publish ``Exit``, disconnect cleanly, stop the sender; waits at most timeout_s."""
        if self._thread is None:
            return
        self._final = self._last_word(exit_code, final_step, reason)
        self._close_deadline = time.monotonic() + timeout_s
        self._stopping.set()
        self._put(None, count_drop=False)  # wake the sender if it is waiting
        self._thread.join(timeout_s)
        self._thread = None
        if self._slots is not None:
            self._slots.close()

    def _put(self, msg: protocol.Message | None, *, count_drop: bool = True) -> None:
        if self._broker is None:
            return
        try:
            self._queue.put_nowait(msg)
        except queue.Full:
            if count_drop:
                self.dropped_queue_full += 1

    # ---- the sender thread --------------------------------------------------------------

    def _run_sender(self) -> None:
        assert self._broker is not None
        client = self._make_client()
        self._client = client
        client.connect_async(self._broker.url.host, self._broker.url.port, keepalive=KEEPALIVE_S)
        client.loop_start()  # paho's network thread: connects, retries with backoff
        try:
            held = self._send_until_stopped()
            self._finish(held)
        except Exception:  # a telemetry bug must not take the training process down
            log.exception("telemetry sender failed; telemetry is off for this rank")
        finally:
            client.disconnect()
            client.loop_stop()

    def _make_client(self) -> mqtt.Client:
        ident = self._id
        who = protocol.sender(self._will())
        client_id = protocol.client_id(ident.run, ident.attempt, who, os.getpid())
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id)
        assert self._broker is not None
        url = self._broker.url
        if url.username:
            client.username_pw_set(url.username, url.password)
        if url.tls:
            client.tls_set(ca_certs=self._broker.ca_file)
        client.reconnect_delay_set(RECONNECT_MIN_DELAY_S, RECONNECT_MAX_DELAY_S)
        client.on_pre_connect = self._on_pre_connect
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_message = self._on_message
        client.on_disconnect = self._on_disconnect
        return client

    def _on_pre_connect(self, client: mqtt.Client, _userdata: Any) -> None:
        """Before each connection attempt: a new connection id, and a will that names it."""
        with self._publish_lock:
            self._conn = secrets.token_hex(8)
            topic, payload = self._encode(self._will(), protocol.WILL_SEQ)
        client.will_set(topic, payload, qos=0, retain=False)

    def _on_connect_fail(self, _client: mqtt.Client, _userdata: Any) -> None:
        """A connection attempt found no broker (refused, unreachable, TLS): said once an outage."""
        if self._unreachable_said:
            return
        self._unreachable_said = True
        assert self._broker is not None
        log.warning("telemetry: cannot reach the broker at %s; training goes on, telemetry is kept "
                    "(up to %d messages) and sent once it answers", self._broker.url, self._queue.maxsize)

    def _on_connect(self, client: mqtt.Client, _userdata: Any, _flags: Any,
                    reason_code: Any, _properties: Any) -> None:
        if getattr(reason_code, "is_failure", False):
            log.warning("telemetry: broker refused the connection: %s", reason_code)
            return
        self._unreachable_said = False
        self._presence_since, self._supervisor_online = time.monotonic(), False
        assert self._broker is not None
        client.subscribe(protocol.presence_topic(self._broker.cluster), qos=0)
        for topic in self._subscriptions():
            client.subscribe(topic, qos=1)
        hello = self._hello()
        if hello is not None:
            self._publish(client, hello)
        self._connected.set()  # after the hello, so that it is this connection's first message

    def _on_message(self, _client: mqtt.Client, _userdata: Any, message: Any) -> None:
        assert self._broker is not None
        if message.topic == protocol.presence_topic(self._broker.cluster):
            self._on_presence(message)
        else:
            self._on_control(message.topic, bytes(message.payload))

    def _on_presence(self, message: Any) -> None:
        """The supervisor's presence: ``online`` lets the buffer go; anything else (its will
        or clean stop cleared it) holds it again, for at most PRESENCE_WAIT_S."""
        online = message.payload == protocol.PRESENCE_ONLINE
        if not online:
            self._presence_since = time.monotonic()
        self._supervisor_online = online

    def _may_flush(self) -> bool:
        return (self._supervisor_online
                or time.monotonic() - self._presence_since >= protocol.PRESENCE_WAIT_S)

    def _on_disconnect(self, _client: mqtt.Client, _userdata: Any, _flags: Any,
                       reason_code: Any, _properties: Any) -> None:
        self._connected.clear()
        if not self._stopping.is_set():
            log.warning("telemetry: lost the broker connection (%s); reconnecting",
                        reason_code)

    def _send_until_stopped(self) -> protocol.Message | None:
        """Publish until close(); returns a message taken but not yet published."""
        next_heartbeat = time.monotonic()
        held: protocol.Message | None = None  # dequeued, waiting for a connection
        while not self._stopping.is_set():
            self._rewrite_slot_when_due()  # connected or not: local rank 0 reads it
            if not self._connected.wait(timeout=0.2):
                # Disconnected: leave messages queued for the next connection (the queue
                # bound turns a long outage into counted drops). No heartbeats: a stale
                # one is worthless, and a fresh one goes out once connected.
                continue
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat()
                next_heartbeat = now + self._heartbeat_interval_s
            if not self._may_flush():  # nobody would hear it yet: keep the buffer
                self._stopping.wait(0.05)
                continue
            if held is None:
                wake_at = min(next_heartbeat, self._next_slot_write) if self._slots else next_heartbeat
                try:
                    held = self._queue.get(timeout=max(0.0, wake_at - time.monotonic()))
                except queue.Empty:
                    continue
            if held is None:  # close()'s wake-up call
                continue
            if self._try_publish(held) is not None:
                held = None
            else:
                # The connection dropped while we waited for the message; keep it for
                # the next connection, and do not spin until paho notices the drop.
                self._stopping.wait(0.05)
        return held

    def _heartbeat(self) -> None:
        beat = self._beat()
        if beat is not None:
            self._try_publish(beat)

    # ---- who this sender is (what a subclass that is not a rank overrides) ------------

    def _header(self) -> dict[str, Any]:
        return {"run": self._id.run, "attempt": self._id.attempt, "rank": self._id.rank,
                "ts": time.time()}

    def _will(self) -> protocol.Message:
        """The last will the broker publishes if this connection dies."""
        return protocol.Lost(**self._header())

    def _hello(self) -> protocol.Message | None:
        """The first message of every connection: who this sender is."""
        ident = self._id
        return protocol.Register(
            **self._header(), local_rank=ident.local_rank, world_size=ident.world_size,
            node=ident.node, pid=os.getpid(), hostname=socket.gethostname()[:64])

    def _first_word(self) -> protocol.Message | None:
        """Queued when the sender starts: a rank's phase, unless its slot says it."""
        if self._slots is not None:
            return None
        return protocol.PhaseChange(**self._header(), phase=self._phase, step=self._step)

    def _last_word(self, exit_code: int, final_step: int, reason: str) -> protocol.Message | None:
        """Published by ``close``, last: a rank's Exit."""
        return protocol.Exit(**self._header(), exit_code=exit_code, final_step=final_step,
                             reason=reason[:2000])

    def _subscriptions(self) -> list[str]:
        """Topics the supervisor speaks to this sender on, beside its presence (a rank: none)."""
        return []

    def _on_control(self, topic: str, payload: bytes) -> None:
        """A message on one of ``_subscriptions`` (paho's thread: return quickly)."""

    def _beat(self) -> protocol.Message | None:
        """What goes out every heartbeat interval. Per rank: a Heartbeat. Aggregated: local
        rank 0 reports its node (unless its agent does), the others nothing."""
        if self._slots is None:
            return protocol.Heartbeat(**self._header(), step=self._step, phase=self._phase)
        agent = self._aggregation is not None and self._aggregation.agent
        return self.node_report() if self._id.local_rank == 0 and not agent else None

    def _rewrite_slot_when_due(self) -> None:
        if self._slots is not None and time.monotonic() >= self._next_slot_write:
            self._slots.touch()
            self._next_slot_write = time.monotonic() + self._heartbeat_interval_s

    def node_report(self) -> protocol.NodeReport:
        """Every slot of this node as one message (aggregated mode, local rank 0)."""
        assert self._slots is not None
        fields = report_fields(self._slots.read_all(), time.time())
        return protocol.NodeReport(**self._header(), node=self._id.node, **fields)

    def _finish(self, held: protocol.Message | None) -> None:
        """Flush what is queued, publish Exit, and wait (bounded) until it is written."""
        pending = [] if held is None else [held]
        while True:
            try:
                msg = self._queue.get_nowait()
            except queue.Empty:
                break
            if msg is not None:
                pending.append(msg)
        if self._final is not None:
            pending.append(self._final)  # last, so that it is the last word of this rank
        info: mqtt.MQTTMessageInfo | None = None
        for msg in pending:
            in_time = time.monotonic() < self._close_deadline
            info = self._try_publish(msg) if in_time else None
            if info is None:
                with self._publish_lock:
                    self.dropped_not_connected += 1
        if self._final is not None and info is not None:  # wait until Exit is on the wire
            remaining = self._close_deadline - time.monotonic()
            # RuntimeError/ValueError: the connection dropped after all, or a bad rc.
            with contextlib.suppress(RuntimeError, ValueError):
                info.wait_for_publish(timeout=max(0.0, remaining))

    def _try_publish(self, msg: protocol.Message) -> mqtt.MQTTMessageInfo | None:
        """Hand ``msg`` to paho if connected; None when it could not be (not counted)."""
        if self._client is None or not self._connected.is_set():
            return None
        return self._publish(self._client, msg)

    def _publish(self, client: mqtt.Client, msg: protocol.Message) -> mqtt.MQTTMessageInfo | None:
        with self._publish_lock:
            topic, payload = self._encode(msg, self._seq + 1)
            info = client.publish(topic, payload, qos=0)
            if info.rc != mqtt.MQTT_ERR_SUCCESS:
                return None
            self._seq += 1
            self.sent += 1
        return info

    def _encode(self, msg: protocol.Message, seq: int) -> tuple[str, bytes]:
        assert self._broker is not None
        key = self._broker.key
        seal = None if key is None else protocol.Seal(key=key, conn=self._conn, seq=seq)
        return protocol.encode(msg, cluster=self._broker.cluster, seal=seal)
