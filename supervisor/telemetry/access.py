"""Who may do what on the embedded broker (supervisor/telemetry/broker.py): its accounts, each
login's account, and why a CONNECT is refused. Pure: no socket, no amqtt.

Nobody gets in without an account, and an account
publishes and subscribes only where its list says (``<c>``: the daemon's cluster id):

    supervisor   the daemon itself; its password is made on the first start and kept in
                 <state dir>/broker-password (0600). Reads tsup/v1/<c>/telemetry/#;
                 writes tsup/v1/<c>/events/#, the fences of ended attempts
                 (tsup/v1/<c>/control/#) and its presence tsup/v1/<c>/supervisor, the
                 only messages this broker retains.
    reader       a dashboard; its password is the API's read-only token. Reads the
                 event log, the telemetry and the presence; writes nothing.
    <c>/<run>/<attempt>  that attempt's ranks (wire/sealing.py: attempt_login, its
                 password derived from the telemetry secret, handed to its ranks in
                 their environment). Writes tsup/v1/<c>/telemetry/<run>/<attempt>/+/+,
                 reads the presence and its own attempt's fence; nothing else.

A login longer than ``MAX_LOGIN_CHARS`` is refused unread; only logins that open an
account are remembered (a stranger's guesses cost nothing kept); an attempt's login opens
its account only while the store has the attempt live (``is_live``, asked at its CONNECT:
across a daemon's restart too) and no more once it ended (``end_attempt``). Refusals are
counted per address, for the log lines the broker writes about them (``refused``).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

import wire as protocol

SUPERVISOR_USER = "supervisor"
READER_USER = "reader"
# The longest packet a rank or a reader may send: a NodeReport of MAX_NODE_RANKS ranks
# (wire/messages.py), the longest message the protocol has, is about half of it.
MAX_PACKET_BYTES = 256 * 1024
_SUPERVISOR_IDS = "training-supervisor"  # the supervisor's client ids start so
# A username or password longer than this is no login of this broker's (an attempt's
# username is two ids and a number, its password 64 hex digits; the tokens are 43).
MAX_LOGIN_CHARS = 256
_LOGINS_KEPT = 10_000  # logins that opened an account (each checked once), for every message's ACL
REFUSALS_LOGGED = 20  # refused CONNECTs from one address logged ...
REFUSAL_WINDOW_S = 60.0  # ... in this long; the rest counted
_ADDRESSES_KEPT = 10_000  # addresses whose refusals are counted


@dataclass(frozen=True, slots=True)
class Account:
    """What one login may do: the topic filters it may publish to, subscribe to (and so
    receive from) and retain on, the client ids that are its own, and the longest packet
    it may send (None: any)."""

    username: str
    owns_client_id: Callable[[str], bool]
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    retain: tuple[str, ...] = ()
    max_packet: int | None = MAX_PACKET_BYTES

    def may_publish(self, topic: str) -> bool:
        return any(covers(f, topic) for f in self.publish)

    def may_subscribe(self, topic_filter: str) -> bool:
        """Whether every topic ``topic_filter`` matches is one this account may read."""
        return any(covers(f, topic_filter) for f in self.subscribe)

    def may_retain(self, topic: str) -> bool:
        return any(covers(f, topic) for f in self.retain)


def covers(allowed: str, wanted: str) -> bool:
    """Whether the topic filter ``allowed`` matches every topic that ``wanted`` (a topic or
    a filter) matches: ``tsup/v1/c/telemetry/#`` covers ``tsup/v1/c/telemetry/run-1/1/+/step``,
    and not ``tsup/v1/#``."""
    have, want = allowed.split("/"), wanted.split("/")
    for i, level in enumerate(have):
        if level == "#":
            return True
        if i >= len(want) or want[i] == "#" or level not in ("+", want[i]):
            return False
    return len(want) == len(have)


class BrokerAccess:
    """The embedded broker's accounts, and what each may do (see the module docstring).
    ``secret`` is the telemetry secret the attempts' passwords derive from."""

    def __init__(self, cluster: str, secret: bytes, supervisor_password: str,
                 reader_password: str | None = None, *,
                 is_live: Callable[[str, int], bool] | None = None) -> None:
        self.cluster = cluster
        self._secret = secret
        self._passwords = {SUPERVISOR_USER: supervisor_password}
        if reader_password:
            self._passwords[READER_USER] = reader_password
        # Whether an attempt (run id, number) is live in the store; asked at an attempt's
        # CONNECT once its password is right (None: every attempt is).
        self._is_live = is_live
        self._logins: dict[tuple[str, str], Account] = {}  # successes only, oldest first
        self._refusals: dict[str, tuple[float, int]] = {}  # address: (window start, refusals in it)
        self._ended: dict[str, None] = {}  # the usernames of attempts that ended, oldest first

    def account(self, username: str | None, password: str | None) -> Account | None:
        """The account a login opens; None for a wrong, missing or overlong one."""
        if not username or password is None or max(len(username), len(password)) > MAX_LOGIN_CHARS:
            return None
        login = (username, password)
        known = self._logins.get(login)
        if known is not None:
            return known
        account = self._check(username, password)
        if account is not None:
            if len(self._logins) >= _LOGINS_KEPT:
                del self._logins[next(iter(self._logins))]
            self._logins[login] = account
        return account

    def attempt_live(self, username: str) -> bool:
        """Whether ``username``, when it is an attempt's, names one live in the store."""
        attempt = protocol.attempt_of_login(username)
        return attempt is None or self._is_live is None or self._is_live(attempt[1], attempt[2])

    def end_attempt(self, run: str, number: int) -> None:
        """The attempt is over: its login opens nothing from now on (its live sessions
        keep their connection until they drop it; what they send, telemetry drops)."""
        name = f"{self.cluster}/{run}/{number}"
        self._logins = {k: v for k, v in self._logins.items() if k[0] != name}
        self._ended[name] = None
        if len(self._ended) > _LOGINS_KEPT:
            del self._ended[next(iter(self._ended))]

    def refused(self, address: str, now: float) -> tuple[bool, int]:
        """Count one refusal of ``address``: (whether to log it, how many of its refusals
        went unlogged in the window before)."""
        began, count = self._refusals.get(address, (now, 0))
        unlogged = 0
        if now - began >= REFUSAL_WINDOW_S:
            began, unlogged, count = now, max(0, count - REFUSALS_LOGGED), 0
        if address not in self._refusals and len(self._refusals) >= _ADDRESSES_KEPT:
            del self._refusals[next(iter(self._refusals))]
        self._refusals[address] = (began, count + 1)
        return count < REFUSALS_LOGGED, unlogged

    def _check(self, username: str, password: str) -> Account | None:
        c = self.cluster
        presence = protocol.presence_topic(c)
        if username in self._passwords:
            if not _same(password, self._passwords[username]):
                return None
            if username == SUPERVISOR_USER:
                fences = protocol.fence_filter(c)
                return Account(username, lambda cid: cid.startswith(_SUPERVISOR_IDS),
                               publish=(f"tsup/v1/{c}/events/#", presence, fences),
                               subscribe=(protocol.topic_filter(c),), retain=(presence, fences),
                               max_packet=None)
            return Account(username, lambda cid: not cid.startswith((_SUPERVISOR_IDS, "tsup-")),
                           subscribe=(f"tsup/v1/{c}/events/#", protocol.topic_filter(c), presence))
        attempt = protocol.attempt_of_login(username)
        if attempt is None or attempt[0] != c or username in self._ended:
            return None
        _, run, number = attempt
        if not _same(password, protocol.attempt_login(self._secret, c, run, number)[1]):
            return None
        return Account(username, lambda cid: protocol.attempt_of_client_id(cid) == (run, number),
                       publish=(f"tsup/v1/{c}/telemetry/{run}/{number}/+/+",),
                       subscribe=(presence, protocol.fence_topic(c, run, number)))

    def refusal(self, account: Account | None, *, client_id: str, clean_session: bool,
                will: tuple[str, bool] | None, holder: str | None) -> str | None:
        """Why a CONNECT is refused (None: it is not). ``will``: its last will's (topic,
        retain); ``holder``: the username of a connected session with the same client id."""
        if account is None:
            return "no such login"
        if not self.attempt_live(account.username):
            return "an attempt that is not live"
        if not account.owns_client_id(client_id):
            return f"client id {client_id!r} is not one of {account.username!r}'s"
        if holder is not None and holder != account.username:
            return f"client id {client_id!r} is another account's"
        if not clean_session:
            return "a persistent session (this broker keeps none: connect with a clean session)"
        if will is not None:
            topic, retain = will
            if not account.may_publish(topic):
                return f"a last will on {topic!r}, where {account.username!r} may not publish"
            if retain and not account.may_retain(topic):
                return f"a retained last will on {topic!r}, where {account.username!r} may not retain"
        return None


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(errors="surrogateescape"), expected.encode())
