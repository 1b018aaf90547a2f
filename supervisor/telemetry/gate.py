"""The telemetry's gate: which messages the daemon's view (supervisor/telemetry/view.py) acts on.

Authenticity (wire/sealing.py): the view holds the supervisor's secret and acts only
on messages sealed with their attempt's key. The gate drops, and the view counts by
reason, a message without a seal (``unsigned``), with a wrong one (``bad_mac``), one
whose sequence number its sender has already passed (``replay``), and a last will that
is not the sender's current connection's (``will_unattributed``: a forged or replayed
will, or one of a connection the supervisor never heard). Each verified message names
its connection, so a sender's current connection is that of its newest message.

Beyond authenticity: a message of an attempt that has ended (``ended``), and one about a
rank outside its attempt's world (``out_of_world``), are dropped too, so that no sender,
however authentic, grows the view beyond the attempts and worlds the store knows. An
attempt this process has not heard of is asked of the store (``is_live``) at its first
verified message: one that ended before a daemon's restart stays ended.

Sequence numbers survive a daemon restart as floors (``floors``, ``load_floors``): a
message at or below its sender's floor is a replay, though this process never saw the
original.

The gate has no lock of its own: the view calls it under its lock.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import wire as p

# The reasons a message is dropped (TelemetryView.counts keys, tsup_mqtt_dropped_total).
DROP_REASONS = ("malformed", "unsigned", "bad_mac", "replay", "will_unattributed", "ended",
                "out_of_world")
_ENDED_KEPT = 10_000  # ended attempts remembered, so that their messages stay dropped
_KEYS_KEPT = 10_000  # attempt keys cached: forged attempt numbers must not grow it for ever

Floor = tuple[str, int, str]  # (run, attempt, sender: a rank's number or a node agent's n<index>)


class Sender(Protocol):
    """What the gate reads and moves of a sender's state (the view keeps it)."""

    conn: str | None  # the connection of its newest verified message (None: gone)
    seq: int  # the highest sequence number verified


@dataclass(slots=True)
class Gate:
    cluster: str
    _worlds: dict[tuple[str, int], int] = field(default_factory=dict)  # an attempt's world size, once known
    _floors: dict[Floor, int] = field(default_factory=dict)
    _keys: dict[tuple[str, int], bytes] = field(default_factory=dict, repr=False)
    _ended: dict[tuple[str, int], None] = field(default_factory=dict)  # oldest first
    # Whether an attempt is live in the store (None: every attempt the gate has not seen end is).
    is_live: Callable[[str, int], bool] | None = None
    _live: dict[tuple[str, int], None] = field(default_factory=dict)  # found live there, oldest first

    def why_dropped(self, topic: str, sealed: p.Sealed, secret: bytes | None,
                    sender_of: Callable[[p.Message], Sender]) -> str | None:
        """Why ``sealed`` is dropped (a DROP_REASONS entry), or None when it is acted on.
        With no ``secret``, messages are taken unsealed (tests and benches of the view).
        ``sender_of`` gives (making it on first word) the state of the message's sender:
        asked only once the seal is verified, so a forgery makes no state."""
        msg = sealed.msg
        if (msg.run, msg.attempt) in self._ended:
            return "ended"
        if not self._in_world(msg):
            return "out_of_world"
        if secret is None:
            return None
        if sealed.mac is None or sealed.conn is None or sealed.seq is None:
            return "unsigned"
        if not hmac.compare_digest(p.mac_of(self._key(secret, msg.run, msg.attempt), topic, sealed.signed),
                                   sealed.mac):
            return "bad_mac"
        if not self._known_live(msg.run, msg.attempt):
            self.end(msg.run, msg.attempt)
            return "ended"
        who = sender_of(msg)
        if isinstance(msg, (p.Lost, p.AgentLost)):
            if sealed.seq != p.WILL_SEQ or who.conn is None or sealed.conn != who.conn:
                return "will_unattributed"
            who.conn = None  # that connection is gone: its will cannot come twice
            return None
        if sealed.seq <= max(who.seq, self._floors.get((msg.run, msg.attempt, p.sender(msg)), 0)):
            return "replay"
        who.seq, who.conn = sealed.seq, sealed.conn
        return None

    def _key(self, secret: bytes, run: str, attempt: int) -> bytes:
        key = self._keys.get((run, attempt))
        if key is None:
            if len(self._keys) > _KEYS_KEPT:
                self._keys.clear()
            key = self._keys[(run, attempt)] = p.attempt_key(secret, self.cluster, run, attempt)
        return key

    def _known_live(self, run: str, attempt: int) -> bool:
        """Whether the attempt of a verified message is live: known so, or so in the store."""
        key = (run, attempt)
        if self.is_live is None or key in self._worlds or key in self._live:
            return True
        if not self.is_live(run, attempt):
            return False
        if len(self._live) >= _ENDED_KEPT:
            del self._live[next(iter(self._live))]
        self._live[key] = None
        return True

    def _in_world(self, msg: p.Message) -> bool:
        world = self._worlds.get((msg.run, msg.attempt))
        if world is None:
            return True
        ranks = msg.ranks if isinstance(msg, (p.NodeReport, p.AgentReport)) else ()
        # A node holds one rank at least: a node index is below the world size too.
        number = msg.index if isinstance(msg, (p.AgentReport, p.AgentLost)) else msg.rank
        return 0 <= number < world and all(0 <= r < world for r in ranks)

    def expect(self, run_id: str, attempt: int, world_size: int) -> None:
        """The attempt's world size: a message about a rank outside it is dropped."""
        if (run_id, attempt) not in self._ended:
            self._worlds[(run_id, attempt)] = world_size

    def end(self, run_id: str, attempt: int) -> None:
        """The attempt is over: its messages are dropped from now on."""
        self._keys.pop((run_id, attempt), None)
        self._worlds.pop((run_id, attempt), None)
        self._live.pop((run_id, attempt), None)
        self._floors = {k: v for k, v in self._floors.items() if k[:2] != (run_id, attempt)}
        self._ended[(run_id, attempt)] = None
        if len(self._ended) > _ENDED_KEPT:
            del self._ended[next(iter(self._ended))]

    def floors(self) -> dict[Floor, int]:
        return dict(self._floors)

    def load_floors(self, marks: Iterable[tuple[str, int, str | int, int]]) -> None:
        for run, attempt, who, seq in marks:
            key = (str(run), int(attempt), str(who))
            self._floors[key] = max(self._floors.get(key, 0), int(seq))
