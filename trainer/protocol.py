"""Telemetry wire protocol between trainer ranks and the supervisor.

This module is the one piece of code that both sides share, so it uses the standard
library only: the supervisor imports it without importing torch, and the trainer
imports nothing else from the supervisor.

Transport: MQTT, QoS 0, one topic per (run, attempt, rank, kind)::

    tsup/v1/telemetry/<run_id>/<attempt>/<rank>/<kind>

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
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum, StrEnum
from typing import Any, ClassVar
from urllib.parse import urlsplit

VERSION = 1
TOPIC_ROOT = "tsup/v1/telemetry"
# Subscribe to this to receive every rank's telemetry of every run.
TOPIC_FILTER_ALL = TOPIC_ROOT + "/#"

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
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    first_sample: int = 0  # the data stream position (samples consumed) the step's batch began at
    # The time this rank spent computing the step, its waits for other ranks left out
    # (NaN where the device does not measure it): what tells a straggler apart.
    busy_s: float = math.nan


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChange(Header):
    kind: ClassVar[str] = "phase"
    phase: Phase
    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointCommitted(Header):
    """Rank 0 sends this once a checkpoint is complete on storage."""

    kind: ClassVar[str] = "checkpoint"
    step: int
    path: str
    duration_s: float


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


Message = (Register | Heartbeat | StepMetrics | PhaseChange | CheckpointCommitted | Exit | FaultInjected
           | NodeReport | Lost)

_TYPES: dict[str, type[Any]] = {
    cls.kind: cls
    for cls in (Register, Heartbeat, StepMetrics, PhaseChange, CheckpointCommitted, Exit, FaultInjected,
                NodeReport, Lost)
}
KINDS = frozenset(_TYPES)


DEFAULT_PORT = 1883


def parse_mqtt_url(url: str) -> tuple[str, int]:
    """'mqtt://host:port' (port defaults to 1883) -> (host, port); ValueError naming the problem."""
    parts = urlsplit(url)
    if parts.scheme != "mqtt" or not parts.hostname:
        raise ValueError(f"expected mqtt://HOST:PORT, got {url!r}")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"bad port in {url!r}") from None
    return parts.hostname, port


def topic_for(run: str, attempt: int, rank: int, kind: str) -> str:
    return f"{TOPIC_ROOT}/{run}/{attempt}/{rank}/{kind}"


def encode(msg: Message) -> tuple[str, bytes]:
    """Return (topic, payload) for a message."""
    body: dict[str, Any] = {"v": VERSION, "kind": msg.kind}
    for name, value in asdict(msg).items():
        body[name] = _to_json(value)
    payload = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    return topic_for(msg.run, msg.attempt, msg.rank, msg.kind), payload


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


def decode(payload: bytes | str, topic: str | None = None) -> Message:
    """Parse and validate one message; raise ProtocolError on anything malformed.

    When ``topic`` is given it must agree with the payload's header, so that a rank
    cannot publish on another rank's topic by mistake.
    """
    try:
        body = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ProtocolError(f"not JSON: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError("payload is not a JSON object")
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
    if isinstance(msg, NodeReport):
        _check_node_report(msg)
    if topic is not None and topic != topic_for(msg.run, msg.attempt, msg.rank, msg.kind):
        raise ProtocolError(f"topic {topic!r} does not match the message header")
    return msg


def _check_field(kind: str, name: str, annotation: Any, value: Any) -> Any:
    where = f"{kind}.{name}"
    if isinstance(annotation, str) and annotation.startswith("tuple[") and annotation.endswith(", ...]"):
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {value!r}")
        if len(value) > MAX_NODE_RANKS:
            raise ProtocolError(f"{where}: longer than {MAX_NODE_RANKS} entries")
        item = annotation.removeprefix("tuple[").removesuffix(", ...]")
        return tuple(_check_field(kind, name, item, v) for v in value)
    if annotation in ("int", int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {value!r}")
        if value < 0 and name != "exit_code":
            raise ProtocolError(f"{where}: must not be negative, got {value}")
        if abs(value) > _MAX_INT:
            raise ProtocolError(f"{where}: out of range")
        return value
    if annotation in ("float", float):
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


def _check_node_report(msg: NodeReport) -> None:
    """What field checks alone cannot say: the lists are parallel, ranks unique, ages finite."""
    lists = {"steps": msg.steps, "phases": msg.phases, "ages": msg.ages, "step_times": msg.step_times,
             "busy": msg.busy}
    for name, values in lists.items():
        if len(values) != len(msg.ranks):
            raise ProtocolError(f"node.{name}: {len(values)} entries for {len(msg.ranks)} ranks")
    if len(set(msg.ranks)) != len(msg.ranks):
        raise ProtocolError("node.ranks: a rank is listed twice")
    if not all(math.isfinite(a) and a >= 0 for a in msg.ages):
        raise ProtocolError("node.ages: expected finite numbers >= 0")


def _is_id(value: str) -> bool:
    """Ids travel inside MQTT topics, so they may not hold topic syntax."""
    return bool(value) and all(c.isalnum() or c in "-_." for c in value)
