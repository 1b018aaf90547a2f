"""The codec: a message to its topic and JSON payload, and back, every field checked.

A receiver trusts nothing it decodes: ``decode`` raises ProtocolError for bad JSON, an
unknown kind or version, a missing, unknown or out-of-range field, lists of a node
report that do not line up, and a topic that does not match the header. A seal's fields
are read and handed on (``decode_sealed``); checking them needs the key (wire/sealing.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum
from typing import Any

from wire.messages import (
    MAX_ID_LEN,
    MAX_INT,
    MAX_NODE_RANKS,
    MAX_TEXT_LEN,
    TIER_MEMORY,
    TIER_PERSISTENT,
    TYPES,
    VERSION,
    AgentReport,
    CheckpointCommitted,
    CheckpointRestored,
    Message,
    NodeReport,
    Phase,
    ProtocolError,
    is_id,
    sender,
)
from wire.sealing import MAC_FIELD, Seal, mac_of
from wire.topics import DEFAULT_CLUSTER, topic_for


@dataclass(frozen=True, slots=True)
class Sealed:
    """A decoded message with its seal's fields, for the receiver to check."""

    msg: Message
    conn: str | None
    seq: int | None
    mac: str | None
    signed: bytes  # what ``mac`` was made over (with the topic)


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
    found = MAC_FIELD.search(raw) if mac is not None else None
    if mac is not None and (found is None or found.group(1).decode() != mac):
        raise ProtocolError("mac: expected 64 lowercase hex digits as the payload's last field")
    signed = raw[:found.start()] + b"}" if found is not None else raw
    conn, seq = body.pop("conn", None), body.pop("seq", None)
    if conn is not None and not (isinstance(conn, str) and re.fullmatch(r"[0-9a-f]{16}", conn)):
        raise ProtocolError(f"conn: expected 16 lowercase hex digits, got {conn!r}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_INT):
        raise ProtocolError(f"seq: expected an integer >= 0, got {seq!r}")
    version = body.pop("v", None)
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this side speaks {VERSION})")
    kind = body.pop("kind", None)
    cls = TYPES.get(kind) if isinstance(kind, str) else None
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
        ok = all(type(v) is int and 0 <= v <= MAX_INT for v in value)
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
        if abs(value) > MAX_INT:
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
        limit = MAX_TEXT_LEN if name in ("reason", "path", "detail") else MAX_ID_LEN
        if len(value) > limit:
            raise ProtocolError(f"{where}: longer than {limit} characters")
        if name == "run" and not is_id(value):
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

