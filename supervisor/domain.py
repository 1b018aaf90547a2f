"""The supervisor's vocabulary: states, records, observations and effects.

Pure data, no I/O. Records are what the store persists; observations are what the
reconciler gathers each tick from the launcher and the trainer's telemetry; effects
are what the policy (supervisor/policy/) asks the reconciler to do. Times are unix
seconds (float) from the supervisor's clock, never the trainer's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from supervisor.planning import LLAMA3_FAILURES_PER_NODE_DAY


class RunState(StrEnum):
    PENDING = "PENDING"  # submitted, waiting for nodes or a first launch
    STARTING = "STARTING"  # an attempt is launching or restoring, no step yet
    RUNNING = "RUNNING"  # an attempt is making steps
    RECOVERING = "RECOVERING"  # a fault was detected; tearing down and relaunching
    PAUSED = "PAUSED"  # stopped by an operator; `resume` continues it
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL_RUN_STATES = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED})


class AttemptState(StrEnum):
    LAUNCHING = "LAUNCHING"  # intent recorded; processes may or may not exist yet
    RUNNING = "RUNNING"  # the launcher started the processes
    STOPPING = "STOPPING"  # teardown requested, processes may still be alive
    ENDED = "ENDED"


LIVE_ATTEMPT_STATES = frozenset({AttemptState.LAUNCHING, AttemptState.RUNNING, AttemptState.STOPPING})


class AttemptOutcome(StrEnum):
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"  # a fault ended it (what it costs: supervisor/policy/recovery.py)
    STOPPED = "STOPPED"  # an operator paused, restarted or cancelled the run
    ABORTED = "ABORTED"  # never started (supervisor restarted before launch); not a fault
    # The cluster took its nodes away (preemption, a time limit, an allocation cancelled
    # outside the supervisor): the run's own outcome, not a failure, and costs nothing.
    INTERRUPTED = "INTERRUPTED"


class NodeState(StrEnum):
    IDLE = "IDLE"
    ALLOCATED = "ALLOCATED"  # held by a run (training or as a hot spare)
    DRAINED = "DRAINED"  # taken out of service, with a reason


class CommandKind(StrEnum):
    """An operator's command to a run."""

    CANCEL = "cancel"
    PAUSE = "pause"
    RESUME = "resume"
    RESTART = "restart"  # stop the live attempt and start another from the newest checkpoint


class NodeCommandKind(StrEnum):
    """An operator's command to a node."""

    DRAIN = "drain"  # out of service: no attempt starts on it (a running one trains on)
    UNDRAIN = "undrain"  # back in service


class FaultKind(StrEnum):
    RANK_EXIT = "rank-exit"  # a rank process exited or was killed
    NODE_LOST = "node-lost"  # every rank of a node vanished at once
    HANG = "hang"  # no step progress within the allowed time
    NONFINITE = "nonfinite"  # a NaN or infinite loss or grad norm
    SPIKE = "spike"  # loss or grad norm far above its running level for several steps
    NO_RESULT = "no-result"  # every rank exited 0 but the trainer wrote no result
    LAUNCH = "launch"  # the launcher could not start the attempt
    DEVICE = "device"  # a rank exited with code 4: its accelerator failed
    CHECKPOINT = "checkpoint"  # a rank exited with code 3: the checkpoint it resumed from is unreadable
    STRAGGLER = "straggler"  # a rank far slower than the others (acted on only with straggler_restart)
    STORAGE = "storage"  # a rank exited with code 5: no checkpoint can be written (disk full)
    ALLOCATION_ENDED = "allocation-ended"  # the cluster ended the allocation under the attempt


_RUN_ID = re.compile(r"^run-([1-9][0-9]{0,17})$")


def run_id_of(number: int) -> str:
    return f"run-{number}"


def parse_run_id(text: str) -> int | None:
    """'run-42' -> 42; None for anything that is not a run id."""
    m = _RUN_ID.match(text)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """Per-run knobs of the decision rules (from the spec's [policy] table)."""

    # The budget for failures without progress. An attempt made progress when the run
    # got a newer complete checkpoint than the one it resumed from, or when it trained
    # progress_steps steps beyond that point. failures_without_progress failed attempts
    # in a row that made none: FAILED. A node lost and replaced, and an allocation the
    # cluster ended, cost nothing (supervisor/policy/recovery.py).
    failures_without_progress: int = 4
    progress_steps: int = 100
    # More than fault_rate_max faults within fault_rate_window_s (progress or not): the
    # cluster or the job is broken beyond what restarts can fix, FAILED.
    fault_rate_max: int = 30
    fault_rate_window_s: float = 3600.0
    # The same fault (kind and step) ending this many attempts in a row: a crash loop, FAILED.
    crash_loop_attempts: int = 3
    # Before the n-th failed attempt in a row that resumed from the same checkpoint (n >= 2):
    # wait backoff_base_s x 2^(n-2), at most backoff_max_s. The first restart after
    # progress is immediate (hot spares).
    backoff_base_s: float = 5.0
    backoff_max_s: float = 300.0
    # Spikes: a step whose loss exceeds the median of the spike_window steps before it by
    # more than spike_loss_rel (0.5: 50 %), or whose grad norm exceeds that median by a
    # factor spike_grad_factor. Persisting for spike_persist_steps steps in a row: roll back
    # to the newest checkpoint before it and skip spike_skip_steps steps of data from it.
    # Shorter spikes are counted and reported, not acted on.
    spike_window: int = 20
    spike_loss_rel: float = 0.5
    spike_grad_factor: float = 5.0
    spike_persist_steps: int = 5
    spike_skip_steps: int = 50
    # Hang while training: no step progress for max(hang_floor_s, hang_k x p99 step time)
    # once hang_min_samples step times are known, never more than hang_timeout_s (which is
    # also the limit before enough steps were timed).
    hang_timeout_s: float = 300.0
    hang_floor_s: float = 8.0  # the 10 s detection target, less a tick and message latency
    hang_k: float = 3.0
    hang_min_samples: int = 20
    startup_timeout_s: float = 900.0  # no first step for this long after launch (init, compile, restore)
    checkpoint_timeout_s: float = 600.0  # a rank announcing a checkpoint save (before one was timed)
    eval_timeout_s: float = 600.0  # a rank announcing an evaluation
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long
    # After the first rank death is seen, wait this long (unless every rank is gone)
    # before attributing the fault, so that ranks dying together are judged together.
    fault_settle_s: float = 1.0
    # Processes still alive this long after the SIGKILL are stuck in the kernel: the
    # attempt is abandoned and their nodes drained.
    abandon_after_s: float = 120.0
    # Every rank of a node silent this long (no heartbeat, no message) while other nodes'
    # ranks are heard: the node is lost (powered off, kernel hung, network gone), found
    # without waiting for Slurm's SlurmdTimeout (300 s by default).
    silence_timeout_s: float = 10.0
    # Stragglers: a rank whose median busy time (its own compute per step, waits left
    # out) over its last straggler_window steps exceeds the typical rank's by more than
    # straggler_margin (0.25: 25 %) and by at least straggler_min_s is reported with its
    # node, once per attempt; its node is left out of the next attempt when another held
    # node can take its place. With straggler_restart the attempt is also stopped and
    # relaunched without it at once, when a spare is free; never by default.
    straggler_window: int = 20
    straggler_margin: float = 0.25
    straggler_min_s: float = 0.005
    straggler_restart: bool = False
    # Lemons: a node blamed in lemon_faults or more distinct faults (of any run; a fault
    # repeating at the same step counts once) within lemon_window_s is drained.
    lemon_faults: int = 3
    lemon_window_s: float = 86_400.0
    # The cluster's interruption rate, for a run whose checkpoint interval is "auto"
    # (supervisor/planning.py: Young/Daly at each attempt); Llama 3's by default.
    failures_per_node_day: float = LLAMA3_FAILURES_PER_NODE_DAY


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


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRef:
    step: int
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    id: int
    run_number: int
    kind: CommandKind
    created_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCommand:
    id: int
    node: str
    kind: NodeCommandKind
    reason: str
    created_at: float


# --- observations -------------------------------------------------------------------


class ProcState(StrEnum):
    RUNNING = "RUNNING"
    EXITED = "EXITED"  # exited and we know the code (our own child)
    VANISHED = "VANISHED"  # no longer exists; exit code unknown (adopted after a restart)
    UNKNOWN = "UNKNOWN"  # could not be observed this tick: never treated as dead


@dataclass(frozen=True, slots=True, kw_only=True)
class RankObs:
    rank: int
    node: str
    proc: ProcState
    exit_code: int | None = None  # negative: killed by that signal (subprocess convention)
    # From telemetry (None / False when no telemetry arrived):
    reported_exit_code: int | None = None  # the rank's own Exit message
    reported_reason: str = ""
    reported_exit_at: float | None = None
    lost: bool = False  # its MQTT last will arrived
    dead_since: float | None = None  # when the supervisor first saw it dead
    last_step: int = 0
    progress_at: float | None = None  # when last_step last increased
    phase: str | None = None
    last_seen_at: float | None = None  # its last message of any kind (heartbeats included)
    nonfinite_step: int | None = None  # the first step it reported a NaN/Inf loss or grad norm
    busy_recent_s: tuple[float, ...] = ()  # its busy time in its recent steps, oldest first


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerResult:
    final_step: int
    model_digest: str | None  # None: a trainer that reports none (a [command] trainer)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSample:
    """One training step as rank 0 reported it."""

    step: int
    loss: float
    grad_norm: float
    first_sample: int  # the data stream position its batch began at


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptObs:
    """What the reconciler saw of the live attempt this tick."""

    ranks: tuple[RankObs, ...]
    result: TrainerResult | None = None
    never_started: bool = False  # LAUNCHING, and no process of it exists
    launch_error: str | None = None  # why it never started, when the launcher said so
    telemetry_up_since: float | None = None  # None while the broker link is down
    step_time_p99_s: float | None = None  # over the attempt's recent steps, all ranks
    step_time_samples: int = 0
    checkpoint_p99_s: float | None = None  # the run's recent checkpoint saves
    recent: tuple[StepSample, ...] = ()  # rank 0's recent steps, oldest first


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerReport:
    """A rank reported straggling (a ``straggler`` event of the run)."""

    attempt: int
    rank: int
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RunView:
    """Everything decide() may look at for one run."""

    run: Run
    attempts: tuple[Attempt, ...]
    allocation: tuple[Node, ...]  # nodes this run holds, drained ones included
    newest_checkpoint: CheckpointRef | None
    commands: tuple[Command, ...] = ()
    open_faults: int = 0  # faults not yet marked recovered
    faults: tuple[FaultRecord, ...] = ()  # the run's faults, oldest first
    probing: bool = False  # some of its nodes are being probed: launch nothing until they answer
    diagnose: bool = False  # probe a failed attempt's nodes before the next launch ([health] diagnose)
    stragglers: tuple[StragglerReport, ...] = ()  # the run's straggler reports, oldest first
    # Every run's faults within the run's lemon window (for lemon nodes), oldest first.
    cluster_faults: tuple[FaultRecord, ...] = ()

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None


# --- effects ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Emit:
    """Append an event to the run's audit log (and the outbox)."""

    kind: str
    message: str
    data: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class SetRunState:
    state: RunState
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRun:
    """Back to PENDING after an operator's resume; the budget for failures starts afresh."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocateNodes:
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StartAttempt:
    number: int
    nodes: tuple[str, ...]
    resume_from: str | None
    resume_step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MarkAttemptRunning:
    """The first training step of the attempt was seen."""

    number: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StopAttempt:
    number: int
    outcome: AttemptOutcome
    reason: str
    force: bool  # SIGKILL at once (a broken attempt) instead of SIGTERM first


@dataclass(frozen=True, slots=True, kw_only=True)
class EnsureStopped:
    """Re-send the stop (escalating to SIGKILL after the grace) while processes live."""

    number: int
    force: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class EndAttempt:
    number: int
    outcome: AttemptOutcome
    reason: str
    final_step: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordFault:
    kind: FaultKind
    attempt: int
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    summary: str
    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MarkFaultsRecovered:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class DrainNode:
    node: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeNodes:
    """Probe these nodes of the run (``python -m health``); the run launches nothing until
    their results are in (``RunView.probing``)."""

    nodes: tuple[str, ...]
    kind: str  # "diagnosis": after a failed attempt


@dataclass(frozen=True, slots=True, kw_only=True)
class SkipData:
    """From the next attempt on, the trainer steps over samples [start, end) of its data."""

    start: int
    end: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseNodes:
    """Give back every healthy node the run holds (drained ones stay drained)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishRun:
    """Enter a terminal state (the only effect that does)."""

    state: RunState
    reason: str
    final_step: int | None = None
    model_digest: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandHandled:
    command_id: int
    result: str


Effect = (
    Emit
    | SetRunState
    | ResumeRun
    | AllocateNodes
    | StartAttempt
    | MarkAttemptRunning
    | StopAttempt
    | EnsureStopped
    | EndAttempt
    | RecordFault
    | MarkFaultsRecovered
    | DrainNode
    | ProbeNodes
    | SkipData
    | ReleaseNodes
    | FinishRun
    | CommandHandled
)
