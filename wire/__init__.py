"""What the supervisor and the trainer ranks must agree on, and nothing else: the one
package both sides import, so it imports only the standard library (the supervisor
loads it without torch; a rank loads nothing of the supervisor's).

The telemetry protocol, one module a concern (the names below are its public face:
``import wire`` and write ``wire.encode``, ``wire.Heartbeat``):

    wire/messages.py  the messages and their fields
    wire/topics.py    the broker URL, the topics, the supervisor's presence
    wire/sealing.py   the attempt's key and broker account; sealed messages and fences
    wire/codec.py     a message to (topic, payload) and back, every field checked

and the other things both sides read or write:

    wire/errors.py       the trainer's errors and exit codes, which the supervisor reads
    wire/slots.py        a node's slot file: its ranks' state, read by the node agent
    wire/standby.py      a warm standby's assignment, written by the launchers
    wire/files.py        the names of the files both write or read: manifest, fence, result
    wire/batch.py        how a global batch splits over replicas (a spec is checked by it)
    wire/neuron_launch.py the Neuron launch line (torchrun, precompile) and its environment
    wire/routes.py       which of a host's addresses faces another host
    wire/private_dir.py  a directory of one user's own under /dev/shm or /tmp
"""

from wire.codec import Sealed, decode, decode_sealed, encode
from wire.messages import (
    AGENT_KINDS,
    KINDS,
    MAX_NODE_RANKS,
    NODE_AGENT_ENV,
    TIER_MEMORY,
    TIER_PERSISTENT,
    VERSION,
    AgentHeader,
    AgentLost,
    AgentMessage,
    AgentReport,
    CheckpointCommitted,
    CheckpointRestored,
    Exit,
    FaultInjected,
    Header,
    Heartbeat,
    Lost,
    Message,
    NodeReport,
    Phase,
    PhaseChange,
    ProtocolError,
    RankMessage,
    Register,
    StepMetrics,
    sender,
)
from wire.sealing import (
    KEY_ENV,
    PASSWORD_ENV,
    USERNAME_ENV,
    WILL_SEQ,
    Seal,
    attempt_key,
    attempt_login,
    attempt_of_client_id,
    attempt_of_login,
    client_id,
    encode_fence,
    fence_reason,
    mac_of,
)
from wire.topics import (
    DEFAULT_CLUSTER,
    DEFAULT_PORT,
    DEFAULT_TLS_PORT,
    PRESENCE_CLEARED,
    PRESENCE_ONLINE,
    PRESENCE_WAIT_S,
    BrokerUrl,
    check_cluster_id,
    fence_filter,
    fence_topic,
    parse_broker_url,
    parse_mqtt_url,
    presence_topic,
    topic_filter,
    topic_for,
)

__all__ = [
    "AGENT_KINDS", "DEFAULT_CLUSTER", "DEFAULT_PORT", "DEFAULT_TLS_PORT", "KEY_ENV", "KINDS",
    "MAX_NODE_RANKS", "NODE_AGENT_ENV", "PASSWORD_ENV", "PRESENCE_CLEARED", "PRESENCE_ONLINE",
    "PRESENCE_WAIT_S", "TIER_MEMORY", "TIER_PERSISTENT", "USERNAME_ENV", "VERSION", "WILL_SEQ",
    "AgentHeader", "AgentLost", "AgentMessage", "AgentReport", "BrokerUrl", "CheckpointCommitted",
    "CheckpointRestored", "Exit", "FaultInjected", "Header", "Heartbeat", "Lost", "Message",
    "NodeReport", "Phase", "PhaseChange", "ProtocolError", "RankMessage", "Register", "Seal",
    "Sealed", "StepMetrics", "attempt_key", "attempt_login", "attempt_of_client_id",
    "attempt_of_login", "check_cluster_id", "client_id", "decode", "decode_sealed", "encode",
    "encode_fence", "fence_filter", "fence_reason", "fence_topic", "mac_of", "parse_broker_url",
    "parse_mqtt_url", "presence_topic", "sender", "topic_filter", "topic_for",
]
