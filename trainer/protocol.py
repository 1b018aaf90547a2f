"""Telemetry wire protocol between trainer ranks and the supervisor.

This module is the one piece of code that both sides share, so it uses the standard
library only: the supervisor imports it without importing torch, and the trainer
imports nothing else from the supervisor.

Transport: MQTT, QoS 0, one topic per (cluster, run, attempt, rank, kind)::

    tsup/v1/<cluster>/telemetry/<run_id>/<attempt>/<rank>/<kind>

The cluster id is the supervisor's (``TSUP_CLUSTER``): two supervisors on one broker
subscribe to their own topics only and never see each other's runs.

Presence: the supervisor keeps a retained ``online`` on ``tsup/v1/<cluster>/supervisor``
while it is subscribed (its last will, and a clean stop, clear it). A rank that comes
back to a broker before the supervisor does (a restarted broker, a daemon restart)
keeps what it buffered until it reads ``online``, or for at most ``PRESENCE_WAIT_S``,
so that QoS 0 messages do not go out while nobody listens. Only what the ranks send
depends on it, never what the supervisor believes: a forged presence can at worst lose
buffered telemetry, as an outage does.

Payload: a UTF-8 JSON object. Every message carries the header fields

    v        protocol version (int); a receiver rejects versions it does not know
    kind     one of KINDS
    run      run id, for example "run-42"
    attempt  attempt number within the run (1, 2, ...)
    rank     global rank (0 .. world_size - 1)
    ts       sender's wall clock, unix seconds (float)

plus the fields of its kind (the dataclasses below). Floats that are not finite
(a NaN loss, an infinite grad norm) travel as the strings "nan", "inf" and "-inf",
because JSON has no literal for them.

With ``[telemetry] aggregate = "node"`` (trainer/telemetry.py) most ranks publish no
heartbeats and no step metrics of their own: each node's local rank 0 sends one ``node``
message a heartbeat interval (``NodeReport``) with the state of every rank of its node,
equal-length lists indexed alike, at most ``MAX_NODE_RANKS`` long.

The ``lost`` kind is never published by a live rank: each rank registers it as its
MQTT last will, so the broker publishes it when the rank's connection dies without a
clean disconnect (process killed, node gone).

Node agents (supervisor/agent.py, one per node of an attempt) speak the same protocol
under a sender of their own: the node's index in the attempt, written ``n<index>`` in
the topic (``tsup/v1/<cluster>/telemetry/<run>/<attempt>/n<index>/<kind>``) and carried
as ``index`` in the header in place of ``rank``. An agent sends ``agent`` once a
heartbeat interval (``AgentReport``: the node is alive, whatever its trainer says, with
the slots of its ranks where the trainer aggregates per node) and leaves ``agent_lost``
as its last will: the node's own word that it went, for any trainer.

Fences go the other way. Once an attempt has ended, the supervisor publishes, retained,
a ``fence`` on ``tsup/v1/<cluster>/control/<run>/<attempt>/fence``: a JSON object
``{"v", "kind": "fence", "run", "attempt", "reason", "mac"}`` sealed with the attempt's
key like the ranks' messages (``encode_fence``). Each of the attempt's node agents
subscribes to it and, on an authentic one (``fence_reason``), ends whatever of the
attempt is left on its node: ranks the launcher could no longer reach (a node cut off
while its attempt ended), which would otherwise train on, and write, beside the next.
Only the supervisor and the attempt's own ranks hold the key: a forged fence is
ignored, and a rank can at most fence its own attempt.

Authenticity. Anyone who can publish to the broker could otherwise make the supervisor
act (a NaN loss rolls a run back, a last will drains a node), so every message is sealed
with the attempt's key, which only the attempt's ranks hold (``TSUP_TELEMETRY_KEY``, in
their environment): the payload gets three more fields,

    conn     this MQTT connection's id, 16 hex characters, fresh for every connection
    seq      the sender's message counter, rising across its connections; 0 is the
             connection's last will, which the broker publishes at most once
    mac      HMAC-SHA256 with the attempt's key over the topic, a NUL byte and the
             payload up to ``mac`` (``mac`` is always the last field)

so that a receiver holding the key rejects a forgery (no or a wrong ``mac``), a replay
(a ``seq`` it has already passed) and a last will of a connection that is not the rank's
current one. The keys derive from the supervisor's own secret (``attempt_key``): each
attempt's key is new, and one attempt's ranks can compute no other attempt's.

Broker accounts. The supervisor's embedded broker (supervisor/broker.py) lets nobody in
without an account. Each attempt has its own, derived from the same secret
(``attempt_login``): the username ``<cluster>/<run>/<attempt>`` and a password that is
not the attempt's key (a password crosses the network in the clear on an ``mqtt://``
broker; the key never does). The ranks find them in ``TSUP_MQTT_USERNAME`` and
``TSUP_MQTT_PASSWORD``, beside the key. With the account a rank publishes on its own
attempt's topics only, reads the supervisor's presence only, retains nothing, and
connects with a client id of its own attempt (``client_id``), so that no other account
can take its session over.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum, StrEnum
from typing import Any, ClassVar
from urllib.parse import urlsplit

VERSION = 1
DEFAULT_CLUSTER = "default"
TIER_PERSISTENT, TIER_MEMORY = "persistent", "memory"  # CheckpointCommitted.tier
KEY_ENV = "TSUP_TELEMETRY_KEY"  # the attempt's key, hex: in the ranks' environment only
# The attempt's broker account (attempt_login), in the ranks' environment only; they
# override the user and password of TSUP_MQTT_URL.
USERNAME_ENV = "TSUP_MQTT_USERNAME"
PASSWORD_ENV = "TSUP_MQTT_PASSWORD"  # noqa: S105 - the variable's name, not a password
WILL_SEQ = 0  # a connection's last will; a sender's own messages count from 1
NODE_AGENT_ENV = "TSUP_NODE_AGENT"  # "1" in the ranks' environment: a node agent reports their slots
_MAC = re.compile(rb',"mac":"([0-9a-f]{64})"}$')

_MAX_ID_LEN = 64
_MAX_TEXT_LEN = 2000
_MAX_INT = 2**63 - 1  # what SQLite and every receiver can store
MAX_NODE_RANKS = 1024  # ranks in one NodeReport: far more than any node holds


class ProtocolError(ValueError):
    """A message that does not follow this protocol (bad JSON, wrong field, unknown kind)."""


class Phase(StrEnum):
    """What a rank is doing; a hang detector gives each phase its own allowance."""

    INIT = "init"  # process start, process group setup, model build
    COMPILE = "compile"  # graph compilation (Neuron, torch.compile)
    RESTORE = "restore"  # loading a checkpoint
    TRAIN = "train"
    CHECKPOINT = "checkpoint"  # saving a checkpoint
    EVAL = "eval"
    DONE = "done"


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    run: str
    attempt: int
    rank: int
    ts: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Register(Header):
    """Sent once per connection: which process and node this rank is."""

    kind: ClassVar[str] = "register"
    local_rank: int
    world_size: int
    node: str
    pid: int
    hostname: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Header):
    """Sent every few seconds from a thread beside the training loop."""

    kind: ClassVar[str] = "heartbeat"
    step: int  # last completed step
    phase: Phase


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics(Header):
    kind: ClassVar[str] = "step"
    step: int  # the step just completed (1-based)
    loss: float
    grad_norm: float | None  # None (JSON null): not measured; NaN is a NaN grad norm
    lr: float
    step_time_s: float
    tokens_per_s: float
    first_sample: int = 0  # the data stream position (samples consumed) the step's batch began at
    # The time this rank spent computing the step, its waits for other ranks left out
    # (NaN where the device does not measure it): what tells a straggler apart.
    busy_s: float = math.nan
    # Added later in version 1 (older senders leave them out; NaN: not measured).
    param_norm: float = math.nan  # global L2 norm of the parameters after the step
    mfu: float = math.nan  # model FLOPs utilization (trainer/flops.py)
    val_loss: float = math.nan  # mean held-out loss, on the steps that ran validation


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChange(Header):
    kind: ClassVar[str] = "phase"
    phase: Phase
    step: int
    # Added later in version 1: the bytes of this rank's state that the phase moves (a
    # checkpoint save or a restore), for an allowance at the pace the run measured; 0: not said.
    bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointCommitted(Header):
    """Rank 0 sends this once a checkpoint is complete: on storage (tier "persistent"),
    or every rank's state and its replica in node memory (tier "memory"; the path is
    ``memory:ATTEMPT:STEP``). ``duration_s`` is how long training was blocked."""

    kind: ClassVar[str] = "checkpoint"
    step: int
    path: str
    duration_s: float
    tier: str = TIER_PERSISTENT  # added later in version 1: older senders leave it out
    # Added later in version 1 (NaN and 0: not measured): the whole save, from the copy to
    # the commit (the same as duration_s for a save on the training thread), and the bytes
    # of rank 0's state it wrote: the pace the supervisor's allowances follow.
    total_s: float = math.nan
    bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRestored(Header):
    """Rank 0 sends this once the ranks resumed from a checkpoint (tier as in
    CheckpointCommitted): how long the restore took, and the bytes of rank 0's state."""

    kind: ClassVar[str] = "restored"
    step: int
    path: str
    tier: str
    duration_s: float
    bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Exit(Header):
    """Sent just before a rank exits on its own (success or a caught error)."""

    kind: ClassVar[str] = "exit"
    exit_code: int
    final_step: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultInjected(Header):
    """A chaos drill's fault, injected by this rank (trainer/faults.py): when it happened,
    so that the time to detect it can be measured."""

    kind: ClassVar[str] = "fault"
    action: str  # as TSUP_FAULT spells it, e.g. "nan@60"
    step: int
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeReport(Header):
    """A node's local rank 0, once a heartbeat interval: every rank of its node at once,
    read from the node's slot file (trainer/slots.py). Entry i of each list is about rank
    ``ranks[i]``; ``rank`` in the header is the sender's."""

    kind: ClassVar[str] = "node"
    node: str
    ranks: tuple[int, ...]
    steps: tuple[int, ...]  # last completed step
    phases: tuple[Phase, ...]
    # Seconds (finite, >= 0) since the rank last wrote its slot: it writes at each step and
    # phase change, and its telemetry thread rewrites it every heartbeat interval.
    ages: tuple[float, ...]
    step_times: tuple[float, ...]  # its last step's step_time_s (NaN before its first step)
    busy: tuple[float, ...]  # its last step's busy_s, as in StepMetrics (NaN where unmeasured)


@dataclass(frozen=True, slots=True, kw_only=True)
class Lost(Header):
    """The MQTT last will: the broker publishes it when the rank's connection dies."""

    kind: ClassVar[str] = "lost"


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentHeader:
    """The header of a node agent's messages: ``index`` (the node's place in the
    attempt's node list, 0-based) stands where a rank's message has ``rank``."""

    run: str
    attempt: int
    index: int
    ts: float


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentReport(AgentHeader):
    """A node agent, once a heartbeat interval: the node lives. Where the trainer keeps
    slots (``[telemetry] aggregate = "node"``) the lists are every rank of the node, as
    in NodeReport; otherwise they are empty."""

    kind: ClassVar[str] = "agent"
    node: str
    pid: int
    hostname: str
    ranks: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    phases: tuple[Phase, ...] = ()
    ages: tuple[float, ...] = ()
    step_times: tuple[float, ...] = ()
    busy: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentLost(AgentHeader):
    """A node agent's last will: its connection died without a goodbye (the node went,
    or was cut off)."""

    kind: ClassVar[str] = "agent_lost"


RankMessage = (Register | Heartbeat | StepMetrics | PhaseChange | CheckpointCommitted | CheckpointRestored
               | Exit | FaultInjected | NodeReport | Lost)
AgentMessage = AgentReport | AgentLost
Message = RankMessage | AgentMessage

_TYPES: dict[str, type[Any]] = {
    cls.kind: cls
    for cls in (Register, Heartbeat, StepMetrics, PhaseChange, CheckpointCommitted, CheckpointRestored, Exit,
                FaultInjected, NodeReport, Lost, AgentReport, AgentLost)
}
KINDS = frozenset(_TYPES)
AGENT_KINDS = frozenset({AgentReport.kind, AgentLost.kind})


def sender(msg: Message) -> str:
    """Who sent ``msg``, as its topic names it: a rank's number, or ``n<index>`` for a node agent."""
    return f"n{msg.index}" if isinstance(msg, (AgentReport, AgentLost)) else str(msg.rank)


DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883


@dataclass(frozen=True, slots=True)
class BrokerUrl:
    """``mqtt://[USER[:PASSWORD]@]HOST[:PORT]``, or ``mqtts://`` for TLS."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None

    def __str__(self) -> str:
        """The URL with its password left out: for logs and messages."""
        user = f"{self.username}:***@" if self.password else f"{self.username}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{host}:{self.port}"


def check_cluster_id(value: str) -> str:
    """A cluster id travels in every topic: the same rule as a run id."""
    if not _is_id(value) or len(value) > _MAX_ID_LEN:
        raise ValueError(f"expected up to {_MAX_ID_LEN} of [A-Za-z0-9._-], got {value!r}")
    return value


def parse_broker_url(url: str) -> BrokerUrl:
    """The parts of a broker URL; ValueError naming the problem."""
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise ValueError(f"expected mqtt://HOST:PORT or mqtts://HOST:PORT, got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"a broker URL has no path or query, got {url!r}")
    tls = parts.scheme == "mqtts"
    try:
        port = parts.port or (DEFAULT_TLS_PORT if tls else DEFAULT_PORT)
    except ValueError:
        raise ValueError(f"bad port in {url!r}") from None
    return BrokerUrl(host=parts.hostname, port=port, tls=tls, username=parts.username,
                     password=parts.password)


def parse_mqtt_url(url: str) -> tuple[str, int]:
    """'mqtt://host:port' (port defaults to 1883) -> (host, port); ValueError naming the problem."""
    broker = parse_broker_url(url)
    return broker.host, broker.port


def topic_for(run: str, attempt: int, rank: int | str, kind: str, cluster: str = DEFAULT_CLUSTER) -> str:
    """The topic of a message; ``rank``: the sender (a rank's number, or ``sender``'s text)."""
    return f"tsup/v1/{cluster}/telemetry/{run}/{attempt}/{rank}/{kind}"


PRESENCE_ONLINE = b"online"
PRESENCE_CLEARED = b""  # an empty retained message deletes the retained one
PRESENCE_WAIT_S = 10.0  # a rank holds its buffer this long for a supervisor that says nothing


def presence_topic(cluster: str = DEFAULT_CLUSTER) -> str:
    """The supervisor's retained presence (see the module docstring)."""
    return f"tsup/v1/{cluster}/supervisor"


def fence_topic(cluster: str, run: str, attempt: int) -> str:
    """Where the supervisor fences an attempt that has ended (see the module docstring)."""
    return f"tsup/v1/{cluster}/control/{run}/{attempt}/fence"


def fence_filter(cluster: str) -> str:
    """Every attempt's fence topic of ``cluster``: what the supervisor may publish on."""
    return f"tsup/v1/{cluster}/control/#"


def encode_fence(run: str, attempt: int, reason: str, *, key: bytes,
                 cluster: str = DEFAULT_CLUSTER) -> tuple[str, bytes]:
    """(topic, payload) of the attempt's fence, sealed with its key."""
    topic = fence_topic(cluster, run, attempt)
    body = {"v": VERSION, "kind": "fence", "run": run, "attempt": attempt, "reason": reason[:_MAX_TEXT_LEN]}
    signed = json.dumps(body, separators=(",", ":")).encode()
    return topic, signed[:-1] + b',"mac":"' + mac_of(key, topic, signed).encode() + b'"}'


def fence_reason(payload: bytes, topic: str, *, key: bytes, cluster: str, run: str,
                 attempt: int) -> str | None:
    """Why the attempt was fenced, when ``payload`` is its authentic fence on its own
    topic; None for anything else (a forgery, another attempt's, an empty retained
    message that cleared it)."""
    if topic != fence_topic(cluster, run, attempt):
        return None
    found = _MAC.search(payload)
    if found is None:
        return None
    signed = payload[:found.start()] + b"}"
    if not hmac.compare_digest(mac_of(key, topic, signed), found.group(1).decode()):
        return None
    try:
        body = json.loads(signed)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict) or (body.get("kind"), body.get("run"), body.get("attempt")) != (
            "fence", run, attempt):
        return None
    reason = body.get("reason")
    return reason if isinstance(reason, str) else ""


def topic_filter(cluster: str = DEFAULT_CLUSTER) -> str:
    """Subscribe to this to receive every rank's telemetry of every run of ``cluster``."""
    return f"tsup/v1/{cluster}/telemetry/#"


@dataclass(frozen=True, slots=True)
class Seal:
    """What makes a message authentic: see the module docstring."""

    key: bytes
    conn: str
    seq: int


@dataclass(frozen=True, slots=True)
class Sealed:
    """A decoded message with its seal's fields, for the receiver to check."""

    msg: Message
    conn: str | None
    seq: int | None
    mac: str | None
    signed: bytes  # what ``mac`` was made over (with the topic)


def attempt_key(secret: bytes, cluster: str, run: str, attempt: int) -> bytes:
    """The attempt's key, derived from the supervisor's secret."""
    label = f"tsup/v1/attempt-key/{cluster}/{run}/{attempt}".encode()
    return hmac.new(secret, label, hashlib.sha256).digest()


def attempt_login(secret: bytes, cluster: str, run: str, attempt: int) -> tuple[str, str]:
    """The attempt's account on the embedded broker, (username, password), derived from
    the supervisor's secret under a label of its own: the password gives away nothing of
    the attempt's key."""
    label = f"tsup/v1/broker-password/{cluster}/{run}/{attempt}".encode()
    return f"{cluster}/{run}/{attempt}", hmac.new(secret, label, hashlib.sha256).hexdigest()


def attempt_of_login(username: str) -> tuple[str, str, int] | None:
    """(cluster, run, attempt) of an attempt's username; None when it is not one."""
    parts = username.split("/")
    if len(parts) != 3 or not all(_is_id(x) and len(x) <= _MAX_ID_LEN for x in parts[:2]):
        return None
    attempt = _number(parts[2])
    return None if attempt is None or attempt < 1 else (parts[0], parts[1], attempt)


def client_id(run: str, attempt: int, rank: int | str, pid: int) -> str:
    """A sender's MQTT client id: ``tsup-<run>-<attempt>-<sender>-<pid>`` (the sender: a
    rank's number, or a node agent's ``n<index>``)."""
    return f"tsup-{run}-{attempt}-{rank}-{pid}"


def attempt_of_client_id(value: str) -> tuple[str, int] | None:
    """(run, attempt) of a sender's client id; None when it is not one. The attempt, sender
    and pid hold no ``-``, so that the run is what is left: two attempts never share an id."""
    head, *parts = value.rsplit("-", 3)
    if len(parts) != 3 or not head.startswith("tsup-"):
        return None
    attempt, who, pid = parts
    if _number(attempt) is None or _number(pid) is None or _number(who.removeprefix("n")) is None:
        return None
    run = head.removeprefix("tsup-")
    return (run, int(attempt)) if _is_id(run) else None


def _number(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def mac_of(key: bytes, topic: str, signed: bytes) -> str:
    return hmac.new(key, topic.encode() + b"\0" + signed, hashlib.sha256).hexdigest()


def encode(msg: Message, *, cluster: str = DEFAULT_CLUSTER, seal: Seal | None = None) -> tuple[str, bytes]:
    """Return (topic, payload) for a message, sealed with ``seal`` when given."""
    body: dict[str, Any] = {"v": VERSION, "kind": msg.kind}
    for name, value in asdict(msg).items():
        body[name] = _to_json(value)
    topic = topic_for(msg.run, msg.attempt, sender(msg), msg.kind, cluster)
    if seal is None:
        return topic, json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    body["conn"], body["seq"] = seal.conn, seal.seq
    signed = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    return topic, signed[:-1] + b',"mac":"' + mac_of(seal.key, topic, signed).encode() + b'"}'


def _to_json(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return _NONFINITE_OUT[str(value)]
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    return value


_NONFINITE_OUT = {"nan": "nan", "inf": "inf", "-inf": "-inf"}
_NONFINITE_IN = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def decode(payload: bytes | str, topic: str | None = None, *, cluster: str = DEFAULT_CLUSTER) -> Message:
    """Parse and validate one message; raise ProtocolError on anything malformed.

    When ``topic`` is given it must agree with the payload's header, so that a rank
    cannot publish on another rank's topic by mistake. A seal's fields are read and
    not checked: ``decode_sealed`` hands them to a receiver that holds the key.
    """
    return decode_sealed(payload, topic, cluster=cluster).msg


def decode_sealed(payload: bytes | str, topic: str | None = None, *,
                  cluster: str = DEFAULT_CLUSTER) -> Sealed:
    raw = payload.encode() if isinstance(payload, str) else payload
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ProtocolError(f"not JSON: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError("payload is not a JSON object")
    mac = body.pop("mac", None)
    found = _MAC.search(raw) if mac is not None else None
    if mac is not None and (found is None or found.group(1).decode() != mac):
        raise ProtocolError("mac: expected 64 lowercase hex digits as the payload's last field")
    signed = raw[:found.start()] + b"}" if found is not None else raw
    conn, seq = body.pop("conn", None), body.pop("seq", None)
    if conn is not None and not (isinstance(conn, str) and re.fullmatch(r"[0-9a-f]{16}", conn)):
        raise ProtocolError(f"conn: expected 16 lowercase hex digits, got {conn!r}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= _MAX_INT):
        raise ProtocolError(f"seq: expected an integer >= 0, got {seq!r}")
    version = body.pop("v", None)
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this side speaks {VERSION})")
    kind = body.pop("kind", None)
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in body:
            if f.default is not MISSING:
                continue  # added later in this version: an older sender leaves it out
            raise ProtocolError(f"{kind}: missing field {f.name!r}")
        values[f.name] = _check_field(kind, f.name, f.type, body.pop(f.name))
    if body:
        raise ProtocolError(f"{kind}: unknown field(s) {sorted(body)}")
    msg: Message = cls(**values)
    if isinstance(msg, (NodeReport, AgentReport)):
        _check_node_report(msg)
    if isinstance(msg, (CheckpointCommitted, CheckpointRestored)) and msg.tier not in (TIER_PERSISTENT,
                                                                                       TIER_MEMORY):
        raise ProtocolError(f"{msg.kind}.tier: expected {TIER_PERSISTENT!r} or {TIER_MEMORY!r}, "
                            f"got {msg.tier!r}")
    if topic is not None and topic != topic_for(msg.run, msg.attempt, sender(msg), msg.kind, cluster):
        raise ProtocolError(f"topic {topic!r} does not match the message header")
    return Sealed(msg=msg, conn=conn, seq=seq, mac=mac, signed=signed)


_PHASES_BY_VALUE = {p.value: p for p in Phase}


def _fast_list(item: str, value: list[Any]) -> tuple[Any, ...] | None:
    """A node report's list checked in one pass, as ``_check_field`` would check each entry
    (a node report's lists are most of what the supervisor decodes at scale); None when an
    entry is not plainly valid, for the entry-by-entry check to name it."""
    if item == "int":
        ok = all(type(v) is int and 0 <= v <= _MAX_INT for v in value)
        return tuple(value) if ok else None
    if item == "float":
        out = []
        for v in value:
            t = type(v)
            if t is float or t is int:
                out.append(float(v))
            elif t is str and v in _NONFINITE_IN:
                out.append(_NONFINITE_IN[v])
            else:
                return None
        return tuple(out)
    if item == "Phase":
        phases = [_PHASES_BY_VALUE.get(v) if type(v) is str else None for v in value]
        return None if None in phases else tuple(phases)
    return None


def _check_field(kind: str, name: str, annotation: Any, value: Any) -> Any:
    where = f"{kind}.{name}"
    if isinstance(annotation, str) and annotation.startswith("tuple[") and annotation.endswith(", ...]"):
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {value!r}")
        if len(value) > MAX_NODE_RANKS:
            raise ProtocolError(f"{where}: longer than {MAX_NODE_RANKS} entries")
        item = annotation.removeprefix("tuple[").removesuffix(", ...]")
        fast = _fast_list(item, value)
        if fast is not None:
            return fast
        return tuple(_check_field(kind, name, item, v) for v in value)  # says which entry is wrong
    if annotation in ("int", int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {value!r}")
        if value < 0 and name != "exit_code":
            raise ProtocolError(f"{where}: must not be negative, got {value}")
        if abs(value) > _MAX_INT:
            raise ProtocolError(f"{where}: out of range")
        return value
    if annotation == "float | None" and value is None:
        return None
    if annotation in ("float", float, "float | None"):
        if isinstance(value, str) and value in _NONFINITE_IN:
            return _NONFINITE_IN[value]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation in ("str", str):
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {value!r}")
        limit = _MAX_TEXT_LEN if name in ("reason", "path", "detail") else _MAX_ID_LEN
        if len(value) > limit:
            raise ProtocolError(f"{where}: longer than {limit} characters")
        if name == "run" and not _is_id(value):
            raise ProtocolError(f"{where}: not a valid run id: {value!r}")
        return value
    if annotation in ("Phase", Phase):
        try:
            return Phase(value)
        except ValueError as e:
            raise ProtocolError(f"{where}: unknown phase {value!r}") from e
    raise AssertionError(f"unhandled field type {annotation!r} for {where}")


def _check_node_report(msg: NodeReport | AgentReport) -> None:
    """What field checks alone cannot say: the lists are parallel, ranks unique, ages finite."""
    lists = {"steps": msg.steps, "phases": msg.phases, "ages": msg.ages, "step_times": msg.step_times,
             "busy": msg.busy}
    for name, values in lists.items():
        if len(values) != len(msg.ranks):
            raise ProtocolError(f"{msg.kind}.{name}: {len(values)} entries for {len(msg.ranks)} ranks")
    if len(set(msg.ranks)) != len(msg.ranks):
        raise ProtocolError(f"{msg.kind}.ranks: a rank is listed twice")
    if not all(math.isfinite(a) and a >= 0 for a in msg.ages):
        raise ProtocolError(f"{msg.kind}.ages: expected finite numbers >= 0")


def _is_id(value: str) -> bool:
    """Ids travel inside MQTT topics, so they may not hold topic syntax."""
    return bool(value) and all(c.isalnum() or c in "-_." for c in value)
