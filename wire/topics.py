"""Where messages go: the broker's URL, the topics, the supervisor's presence and the fences.

Transport: MQTT, QoS 0, one topic per (cluster, run, attempt, sender, kind)::

    tsup/v1/<cluster>/telemetry/<run_id>/<attempt>/<rank>/<kind>

A node agent's sender is ``n<index>`` in place of a rank's number (wire/messages.py).
The cluster id is the supervisor's (``TSUP_CLUSTER``): two supervisors on one broker
subscribe to their own topics only and never see each other's runs.

Presence: the supervisor keeps a retained ``online`` on ``tsup/v1/<cluster>/supervisor``
while it is subscribed (its last will, and a clean stop, clear it). A rank that comes
back to a broker before the supervisor does (a restarted broker, a daemon restart)
keeps what it buffered until it reads ``online``, or for at most ``PRESENCE_WAIT_S``,
so that QoS 0 messages do not go out while nobody listens. Only what the ranks send
depends on it, never what the supervisor believes: a forged presence can at worst lose
buffered telemetry, as an outage does.

Fences go the other way, on ``tsup/v1/<cluster>/control/<run>/<attempt>/fence``: see
wire/sealing.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from wire.messages import MAX_ID_LEN, is_id

DEFAULT_CLUSTER = "default"


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
    if not is_id(value) or len(value) > MAX_ID_LEN:
        raise ValueError(f"expected up to {MAX_ID_LEN} of [A-Za-z0-9._-], got {value!r}")
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


def topic_filter(cluster: str = DEFAULT_CLUSTER) -> str:
    """Subscribe to this to receive every rank's telemetry of every run of ``cluster``."""
    return f"tsup/v1/{cluster}/telemetry/#"
