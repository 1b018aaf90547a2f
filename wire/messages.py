"""The messages a rank and a node agent send, and the fields of each.

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

Node agents (node/agent.py, one per node of an attempt) speak the same protocol
under a sender of their own: the node's index in the attempt, written ``n<index>`` in
the topic and carried as ``index`` in the header in place of ``rank``. An agent sends
``agent`` once a heartbeat interval (``AgentReport``: the node is alive, whatever its
trainer says, with the slots of its ranks where the trainer aggregates per node) and
leaves ``agent_lost`` as its last will: the node's own word that it went, for any trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

VERSION = 1
TIER_PERSISTENT, TIER_MEMORY = "persistent", "memory"  # CheckpointCommitted.tier
NODE_AGENT_ENV = "TSUP_NODE_AGENT"  # "1" in the ranks' environment: a node agent reports their slots
MAX_ID_LEN = 64
MAX_TEXT_LEN = 2000
MAX_INT = 2**63 - 1  # what SQLite and every receiver can store
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
    read from the node's slot file (wire/slots.py). Entry i of each list is about rank
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

TYPES: dict[str, type[Any]] = {
    cls.kind: cls
    for cls in (Register, Heartbeat, StepMetrics, PhaseChange, CheckpointCommitted, CheckpointRestored, Exit,
                FaultInjected, NodeReport, Lost, AgentReport, AgentLost)
}
KINDS = frozenset(TYPES)
AGENT_KINDS = frozenset({AgentReport.kind, AgentLost.kind})


def sender(msg: Message) -> str:
    """Who sent ``msg``, as its topic names it: a rank's number, or ``n<index>`` for a node agent."""
    return f"n{msg.index}" if isinstance(msg, (AgentReport, AgentLost)) else str(msg.rank)



def is_id(value: str) -> bool:
    """Ids travel inside MQTT topics, so they may not hold topic syntax."""
    return bool(value) and all(c.isalnum() or c in "-_." for c in value)
