"""Records: what the store persists and hands back. Pure data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from supervisor.domain.knobs import Policy
from supervisor.domain.states import (
    AttemptOutcome,
    AttemptState,
    CommandKind,
    FaultKind,
    NodeCommandKind,
    NodeState,
    RunState,
    run_id_of,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    number: int
    name: str
    state: RunState
    reason: str
    nodes: int  # nodes one attempt trains on
    ranks_per_node: int
    spares: int  # hot spares held beside them
    total_steps: int
    policy: Policy
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    final_step: int | None = None
    model_digest: str | None = None
    # Failed attempts numbered at or below this do not count against the budget for
    # failures (nor toward a crash loop): an operator's `resume` starts it afresh.
    budget_from_attempt: int = 0
    allocation_info: str | None = None  # the launcher's handle on the nodes held
    # The launcher's handle on an allocation kept with no node (a paused or failed run's
    # Slurm job, held in the queue), for the next one to go on in; None: none kept.
    parked_allocation: str | None = None

    @property
    def run_id(self) -> str:
        return run_id_of(self.number)


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    run_number: int
    number: int  # 1, 2, ... within the run
    state: AttemptState
    nodes: tuple[str, ...]
    resume_from: str | None  # checkpoint path, None for a fresh start
    resume_step: int  # 0 for a fresh start
    created_at: float
    started_at: float | None = None  # processes started
    first_step_at: float | None = None  # first training step observed
    stop_requested_at: float | None = None
    ended_at: float | None = None
    outcome: AttemptOutcome | None = None
    reason: str = ""
    final_step: int | None = None
    launch_info: str | None = None  # launcher-specific handle (JSON), for re-adoption
    launch_error: str | None = None  # the launcher refused to start it
    launch_fatal: bool = False  # ... because the command cannot be executed at all: no retry
    # A precompile attempt (the job's precompile pass, [command] precompile_env): the
    # fingerprint of what it compiles (supervisor/runfiles/precompile.py). None: a training attempt.
    precompile: str | None = None
    # A [command] job's inputs when it was launched, the same fingerprint (None: the
    # reference trainer's): a resume that would fail as this attempt did is refused.
    inputs: str | None = None
    # A precompile attempt's moves of the run's checkpoints out of its way, while they are
    # out (JSON [[from, to], ...]; None once back): supervisor/runfiles/precompile.py.
    set_aside: str | None = None
    # How far the daemon read each of its logs (JSON {file name: offset}, at a line's
    # end), saved every OFFSETS_EVERY_S: a restarted daemon reads on from there
    # (supervisor/gathering/output_progress.py).
    output_offsets: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultRecord:
    id: int
    run_number: int
    attempt: int
    kind: FaultKind
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    step: int
    summary: str
    detected_at: float
    recovered_at: float | None
    last_step_at: float | None = None  # when the attempt's last step before it was received
    injected_at: float | None = None  # a drill's: when the fault was injected


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    name: str
    state: NodeState
    reason: str = ""
    run_number: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeRecord:
    """One probe of one node, as stored (health/ produced it)."""

    node: str
    at: float
    kind: str  # preflight, diagnosis, manual
    status: str  # healthy, degraded, unhealthy, unknown
    action: str  # none, restart, reboot, replace
    reason: str
    findings: list[dict[str, str]]
    run_number: int | None = None
    link_gbps: float | None = None  # its best pair in the round's link test (None: none ran, or no figure)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeRoundRecord:
    """A round of probes as stored: asked for, and until its answers are judged, open (a
    daemon that dies meanwhile asks again for a run's, supervisor/probes.py)."""

    id: int
    run_number: int | None  # None: the sweep
    kind: str  # preflight, diagnosis, sweep, manual
    nodes: tuple[str, ...]
    argv: tuple[str, ...]  # python -m health and its arguments
    timeout_s: float
    round: int  # 1, or the probe asked again of nodes whose first answer could not tell
    started_at: float
    ended_at: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRef:
    step: int
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCheckpointRef:
    """A save of the in-memory tier (trainer/memory_tier.py): every rank's state after
    ``step`` in the memory of its node, and a replica on the next one of ``nodes`` (the
    saving attempt's nodes, in rank order)."""

    attempt: int
    step: int
    nodes: tuple[str, ...]

    @property
    def resume_from(self) -> str:
        """How the reference trainer's ``--resume`` names it."""
        return f"memory:{self.attempt}:{self.step}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    id: int
    run_number: int
    kind: CommandKind
    created_at: float
    step: int | None = None  # resume: the checkpoint step to go back to (None: the newest)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCommand:
    id: int
    node: str
    kind: NodeCommandKind
    reason: str
    created_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Person:
    """Someone who holds a token of their own (supervisor/people.py): a Unix account."""

    user: str
    operator: bool  # acts on every run and node; otherwise on their own runs only
    issued_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class EventRecord:
    """One event of the audit log (published on MQTT through the outbox)."""

    id: int
    run_number: int | None
    ts: float
    kind: str
    message: str
    data: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricRecord:
    """Rank 0's step metrics of one step of one attempt."""

    attempt: int
    step: int
    loss: float | None
    grad_norm: float | None
    lr: float | None
    step_time_s: float
    tokens_per_s: float | None
    received_at: float
    param_norm: float | None = None  # the reference trainer's; None: not sent, or not finite
    mfu: float | None = None
    val_loss: float | None = None  # on the steps that ran validation


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRecord:
    step: int
    path: str
    complete: bool
    duration_s: float | None
    attempt: int | None
    created_at: float
    attempt_time_s: float | None = None  # its attempt's summed step time when it was committed


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCheckpointRecord:
    attempt: int
    step: int
    duration_s: float | None  # how long training was blocked
    created_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeIntent:
    """What the supervisor wants the cluster to do with a node, until the cluster shows it."""

    node: str
    action: str  # "drain" (with its Reason) or "undrain"
    reason: str
    requested_at: float
    sent: int  # times sent so far
    sent_at: float | None  # when last sent
    last_error: str | None
    confirmed_at: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerRecord:
    """A rank reported straggling in one attempt, with the numbers that said so."""

    attempt: int
    rank: int
    node: str
    busy_s: float
    typical_s: float
    window: int
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptStats:
    """What rank 0's recorded steps of one attempt add up to (kept as they arrive)."""

    attempt: int
    steps: int = 0
    first_step: int | None = None
    last_step: int | None = None
    first_at: float | None = None  # when its first step was received
    first_step_time_s: float | None = None
    last_at: float | None = None
    step_time_s: float = 0.0  # summed over its steps
    last_loss: float | None = None
    last_grad_norm: float | None = None
    checkpoints: int = 0
    checkpoint_s: float = 0.0  # its blocking checkpoint saves, summed


@dataclass(frozen=True, slots=True, kw_only=True)
class CurvePoint:
    """One kept point of a run's (downsampled) loss curve."""

    attempt: int
    step: int
    loss: float | None
    grad_norm: float | None
    step_time_s: float
    at: float
