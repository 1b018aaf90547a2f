"""What the telemetry view (supervisor/telemetry/view.py) keeps of each sender, a rank
(``RankTelemetry``) or a node agent (``AgentTelemetry``), and the copies it hands the
reconciler's thread (``RankSeen``, ``AgentSeen``), never the structures ingestion is
changing; and ``Received``, a message to persist with its receipt time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import wire as p

BUSY_TIMES_KEPT = 100  # per rank: the longest window stragglers may be judged on


@dataclass(slots=True)
class RankTelemetry:
    conn: str | None = None  # the connection of its newest verified message (None: gone)
    seq: int = 0  # the highest sequence number verified
    node: str | None = None
    pid: int | None = None
    last_seen_at: float | None = None
    last_step: int = 0
    progress_at: float | None = None  # when last_step last increased
    phase: str | None = None
    phase_at: float | None = None  # when it entered that phase
    phase_bytes: int = 0  # the bytes of its state the phase moves, when it said
    exit_code: int | None = None
    exit_reason: str = ""
    exit_at: float | None = None
    lost: bool = False
    lost_at: float | None = None
    busy_times: deque[float] = field(default_factory=lambda: deque(maxlen=BUSY_TIMES_KEPT))
    nonfinite_step: int | None = None  # the first step whose loss or grad norm was NaN or infinite
    first_step: int | None = None  # the lowest step it reported in this attempt (its first)


@dataclass(slots=True)
class AgentTelemetry:
    """What a node's agent last said (its index in the attempt is its key)."""

    conn: str | None = None
    seq: int = 0
    node: str | None = None
    pid: int | None = None
    last_seen_at: float | None = None
    lost: bool = False  # its last will arrived: the node went (or was cut off)
    lost_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSeen:
    """A copy of one node agent's telemetry, for the reconciler's thread."""

    index: int
    node: str
    pid: int | None
    last_seen_at: float | None
    lost: bool
    lost_at: float | None


@dataclass(slots=True, kw_only=True)
class RankSeen:
    """A copy of one rank's telemetry, for the reconciler's thread (made for every rank on
    every tick, so not frozen, which triples its cost: nobody changes a copy)."""

    node: str | None
    pid: int | None
    last_seen_at: float | None
    last_step: int
    progress_at: float | None
    phase: str | None
    phase_at: float | None
    phase_bytes: int
    exit_code: int | None
    exit_reason: str
    exit_at: float | None
    lost: bool
    nonfinite_step: int | None
    first_step: int | None
    busy_recent: tuple[float, ...]  # its newest busy times, oldest first


NOTHING_HEARD = RankSeen(  # a rank never heard
    node=None, pid=None, last_seen_at=None, last_step=0, progress_at=None, phase=None, phase_at=None,
    phase_bytes=0, exit_code=None, exit_reason="", exit_at=None, lost=False, nonfinite_step=None,
    first_step=None, busy_recent=())


@dataclass(frozen=True, slots=True)
class Received:
    """A message to persist, with its receipt time."""

    msg: p.StepMetrics | p.CheckpointCommitted | p.CheckpointRestored | p.FaultInjected
    at: float
