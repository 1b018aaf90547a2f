"""What a rank's telemetry is told by its environment: who it is, where the broker is, how
it aggregates. ``UsageError`` for a value the protocol would reject.

Configuration comes from the environment the supervisor sets:

    TSUP_MQTT_URL   mqtt://[user:password@]host:port (port defaults to 1883), or mqtts://
                    for TLS (port 8883); unset or empty: no telemetry
    TSUP_MQTT_CA_FILE  the CA bundle an mqtts:// broker's certificate is checked against
                    (default: the system's)
    TSUP_MQTT_USERNAME, TSUP_MQTT_PASSWORD  the attempt's broker account (the embedded
                    broker's, wire/sealing.py); set, they replace the URL's
    TSUP_CLUSTER    the supervisor's cluster id, in every topic (default "default")
    TSUP_TELEMETRY_KEY  the attempt's key (hex) that seals every message; unset: unsealed
    TSUP_RUN_ID     run id in topics and messages (default "run-local")
    TSUP_ATTEMPT    attempt number, >= 1 (default 1)
    TSUP_NODE       node name for the rank-to-node map (default: Slurm's SLURMD_NODENAME,
                    else this host's name)
    TSUP_TELEMETRY_AGGREGATE  "rank" (default) or "node"
    TSUP_SLOTS_DIR  node-local directory of the slot files (wire/slots.py); default
                    /dev/shm if it exists, else the temporary directory
    TSUP_NODE_AGENT "1": a node agent reads the slot file and reports the node
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import wire as protocol
from wire.errors import UsageError
from wire.slots import AGGREGATE_MODES, default_slots_dir


class LaunchedAs(Protocol):
    """Where the launcher placed this process (trainer.distributed.LaunchEnv)."""

    @property
    def rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def local_world_size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this rank is, in every message header and in Register."""

    run: str
    attempt: int
    rank: int
    local_rank: int
    world_size: int
    node: str
    local_world_size: int = 1


@dataclass(frozen=True, slots=True)
class Aggregation:
    """``TSUP_TELEMETRY_AGGREGATE=node``: where this node's slot file goes."""

    slots_dir: Path
    job: str = ""  # MASTER_PORT, in the slot file's name (wire/slots.py)
    agent: bool = False  # a node agent reports the slots: local rank 0 does not


@dataclass(frozen=True, slots=True)
class Broker:
    """Where and how this rank publishes (``TSUP_MQTT_URL`` and its companions)."""

    url: protocol.BrokerUrl
    cluster: str = protocol.DEFAULT_CLUSTER
    key: bytes | None = field(default=None, repr=False)  # the attempt's key: None, unsealed
    ca_file: str | None = None


def parse_mqtt_url(url: str) -> protocol.BrokerUrl:
    """``mqtt://host:port`` to its parts; UsageError when malformed."""
    try:
        return protocol.parse_broker_url(url)
    except ValueError as e:
        raise UsageError(f"TSUP_MQTT_URL: {e}") from None


def broker_from_env(environ: Mapping[str, str]) -> Broker | None:
    url = environ.get("TSUP_MQTT_URL", "")
    if not url:
        return None
    cluster = environ.get("TSUP_CLUSTER") or protocol.DEFAULT_CLUSTER
    try:
        protocol.check_cluster_id(cluster)
    except ValueError as e:
        raise UsageError(f"TSUP_CLUSTER: {e}") from None
    raw_key = environ.get(protocol.KEY_ENV, "")
    try:
        key = bytes.fromhex(raw_key) if raw_key else None
    except ValueError:
        key = b""
    if key is not None and len(key) < 16:
        raise UsageError(f"{protocol.KEY_ENV}: expected at least 32 hex digits")
    parsed = parse_mqtt_url(url)
    username = environ.get(protocol.USERNAME_ENV) or None
    if username is not None:
        parsed = replace(parsed, username=username, password=environ.get(protocol.PASSWORD_ENV) or None)
    return Broker(url=parsed, cluster=cluster, key=key, ca_file=environ.get("TSUP_MQTT_CA_FILE") or None)


def aggregation_from_env(environ: Mapping[str, str], *, local_rank: int,
                         local_world_size: int) -> Aggregation | None:
    """``TSUP_TELEMETRY_AGGREGATE``: None for ``rank`` (or unset), an Aggregation for ``node``."""
    mode = environ.get("TSUP_TELEMETRY_AGGREGATE") or "rank"
    if mode not in AGGREGATE_MODES:
        raise UsageError(f"TSUP_TELEMETRY_AGGREGATE: expected one of {', '.join(AGGREGATE_MODES)}, "
                         f"got {mode!r}")
    if mode == "rank":
        return None
    if local_world_size > protocol.MAX_NODE_RANKS:
        raise UsageError(f"TSUP_TELEMETRY_AGGREGATE=node: at most {protocol.MAX_NODE_RANKS} ranks a node, "
                         f"LOCAL_WORLD_SIZE is {local_world_size}")
    if not 0 <= local_rank < local_world_size:
        raise UsageError(f"TSUP_TELEMETRY_AGGREGATE=node: LOCAL_RANK {local_rank} is not within "
                         f"LOCAL_WORLD_SIZE {local_world_size}")
    return Aggregation(slots_dir=default_slots_dir(environ), job=environ.get("MASTER_PORT", ""),
                       agent=environ.get(protocol.NODE_AGENT_ENV) == "1")


def settings_from_env(environ: Mapping[str, str], *, rank: int, local_rank: int,
                      world_size: int, local_world_size: int = 1) -> tuple[Identity, Broker | None]:
    """Read the TSUP_* variables; UsageError on values the protocol would reject."""
    run = environ.get("TSUP_RUN_ID", "run-local")
    if not run or len(run) > 64 or not all(c.isalnum() or c in "-_." for c in run):
        raise UsageError(f"TSUP_RUN_ID: expected up to 64 of [A-Za-z0-9._-], got {run!r}")
    raw_attempt = environ.get("TSUP_ATTEMPT", "1")
    try:
        attempt = int(raw_attempt)
    except ValueError:
        attempt = 0
    if attempt < 1:
        raise UsageError(f"TSUP_ATTEMPT: expected an integer >= 1, got {raw_attempt!r}")
    # Slurm's name for the node where the launcher sets none: on hosts that share a name (the
    # development box's namespaced nodes), the node's slot file and memory directory are its own.
    node = environ.get("TSUP_NODE") or environ.get("SLURMD_NODENAME") or socket.gethostname()
    broker = broker_from_env(environ)
    identity = Identity(run=run, attempt=attempt, rank=rank, local_rank=local_rank,
                        world_size=world_size, node=node[:64], local_world_size=local_world_size)
    return identity, broker
