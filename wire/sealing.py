"""Authenticity: the attempt's key and broker account, sealed messages and fences.

Anyone who can publish to the broker could otherwise make the supervisor act (a NaN loss
rolls a run back, a last will drains a node), so every message is sealed with the
attempt's key, which only the attempt's ranks hold (``TSUP_TELEMETRY_KEY``, in their
environment): the payload gets three more fields,

    conn     this MQTT connection's id, 16 hex characters, fresh for every connection
    seq      the sender's message counter, rising across its connections; 0 is the
             connection's last will, which the broker publishes at most once
    mac      HMAC-SHA256 with the attempt's key over the topic, a NUL byte and the
             payload up to ``mac`` (``mac`` is always the last field)

so that a receiver holding the key rejects a forgery (no or a wrong ``mac``), a replay
(a ``seq`` it has already passed) and a last will of a connection that is not the rank's
current one. The keys derive from the supervisor's own secret (``attempt_key``): each
attempt's key is new, and one attempt's ranks can compute no other attempt's.

Broker accounts. The supervisor's embedded broker (supervisor/telemetry/broker.py) lets nobody in
without an account. Each attempt has its own, derived from the same secret
(``attempt_login``): the username ``<cluster>/<run>/<attempt>`` and a password that is
not the attempt's key (a password crosses the network in the clear on an ``mqtt://``
broker; the key never does). The ranks find them in ``TSUP_MQTT_USERNAME`` and
``TSUP_MQTT_PASSWORD``, beside the key. With the account a rank publishes on its own
attempt's topics only, reads the supervisor's presence only, retains nothing, and
connects with a client id of its own attempt (``client_id``), so that no other account
can take its session over.

Fences. Once an attempt has ended, the supervisor publishes, retained, a ``fence`` on
``tsup/v1/<cluster>/control/<run>/<attempt>/fence``: a JSON object ``{"v", "kind":
"fence", "run", "attempt", "reason", "mac"}`` sealed with the attempt's key like the
ranks' messages (``encode_fence``). Each of the attempt's node agents subscribes to it
and, on an authentic one (``fence_reason``), ends whatever of the attempt is left on its
node: ranks the launcher could no longer reach (a node cut off while its attempt ended),
which would otherwise train on, and write, beside the next. Only the supervisor and the
attempt's own ranks hold the key: a forged fence is ignored, and a rank can at most
fence its own attempt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass

from wire.messages import MAX_ID_LEN, MAX_TEXT_LEN, VERSION, is_id
from wire.topics import DEFAULT_CLUSTER, fence_topic

KEY_ENV = "TSUP_TELEMETRY_KEY"  # the attempt's key, hex: in the ranks' environment only
# The attempt's broker account (attempt_login), in the ranks' environment only; they
# override the user and password of TSUP_MQTT_URL.
USERNAME_ENV = "TSUP_MQTT_USERNAME"
PASSWORD_ENV = "TSUP_MQTT_PASSWORD"  # noqa: S105 - the variable's name, not a password
WILL_SEQ = 0  # a connection's last will; a sender's own messages count from 1
MAC_FIELD = re.compile(rb',"mac":"([0-9a-f]{64})"}$')  # a sealed payload's last field


@dataclass(frozen=True, slots=True)
class Seal:
    """What makes a message authentic: see the module docstring."""

    key: bytes
    conn: str
    seq: int


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
    if len(parts) != 3 or not all(is_id(x) and len(x) <= MAX_ID_LEN for x in parts[:2]):
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
    return (run, int(attempt)) if is_id(run) else None


def _number(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def mac_of(key: bytes, topic: str, signed: bytes) -> str:
    return hmac.new(key, topic.encode() + b"\0" + signed, hashlib.sha256).hexdigest()



def encode_fence(run: str, attempt: int, reason: str, *, key: bytes,
                 cluster: str = DEFAULT_CLUSTER) -> tuple[str, bytes]:
    """(topic, payload) of the attempt's fence, sealed with its key."""
    topic = fence_topic(cluster, run, attempt)
    body = {"v": VERSION, "kind": "fence", "run": run, "attempt": attempt, "reason": reason[:MAX_TEXT_LEN]}
    signed = json.dumps(body, separators=(",", ":")).encode()
    return topic, signed[:-1] + b',"mac":"' + mac_of(key, topic, signed).encode() + b'"}'


def fence_reason(payload: bytes, topic: str, *, key: bytes, cluster: str, run: str,
                 attempt: int) -> str | None:
    """Why the attempt was fenced, when ``payload`` is its authentic fence on its own
    topic; None for anything else (a forgery, another attempt's, an empty retained
    message that cleared it)."""
    if topic != fence_topic(cluster, run, attempt):
        return None
    found = MAC_FIELD.search(payload)
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

