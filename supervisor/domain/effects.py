"""Effects: what the decision core asks the shell to persist and carry out."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.domain.events import EventKind
from supervisor.domain.records import ProbeRecord
from supervisor.domain.states import AttemptOutcome, FaultKind, RunState


@dataclass(frozen=True, slots=True, kw_only=True)
class Emit:
    """Append an event to the audit log (and the outbox): the run's that was decided about,
    or ``run_number``'s (a node's decision names the run holding the node, if any)."""

    kind: EventKind
    message: str
    data: dict[str, object] = field(default_factory=dict)
    run_number: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SetRunState:
    state: RunState
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRun:
    """Back to PENDING after an operator's resume; the budget for failures starts afresh.
    With ``from_step``, every checkpoint newer than that step is set aside first (and
    memory saves newer than it forgotten): the run goes on from the one of that step."""

    reason: str
    from_step: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocateNodes:
    count: int  # nodes to add to those the run holds
    # The fewest healthy nodes an allocation may be left with and still be kept (a Slurm
    # job that lost more is replaced by a new one); None: the run's attempt size. A new
    # allocation always asks for the attempt size.
    keep: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StartAttempt:
    number: int
    nodes: tuple[str, ...]
    resume_from: str | None
    resume_step: int
    precompile: str | None = None  # the job's precompile pass, of these inputs (Attempt.precompile)
    # What its trainer is told (policy/intervals.py): the data step a [command] that names
    # {skip_to_step} reads first, and the skip window widened back to it (start, new
    # start); the checkpoint tiers' intervals where the spec left them "auto".
    skip_to_step: int | None = None
    widen_skip: tuple[int, int] | None = None
    every_steps: int | None = None
    memory_every_steps: int | None = None


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
    """Take a node out of service: recorded DRAINED at once, and a drain intent that the
    shell sends to the cluster, and sends again, until the cluster shows it."""

    node: str
    reason: str
    run_number: int | None = None  # the run the drained node stays recorded with
    message: str = ""  # for the event log ("node N drained: REASON" when empty)
    reboot: bool = False  # a reboot is the fix (a cluster that repairs nodes is told so)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReturnNode:
    """Back in service: recorded IDLE at once, and an undrain intent, sent until shown."""

    node: str
    message: str  # for the event log
    operator: bool = False
    run_number: int | None = None  # the run the event belongs to


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordProbe:
    """Keep one node's probe result."""

    record: ProbeRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeNode:
    """An operator's probe of a node (``supervisorctl probe``): a round of its own; its
    result is recorded and said, and hands the command its result (nothing is drained
    for it)."""

    node: str
    run_number: int | None  # the run holding it: probed in its allocation
    command_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeAgain:
    """Probe these nodes once more, at once: a bad result not yet confirmed."""

    nodes: tuple[str, ...]
    kind: str
    run_number: int | None  # None: the sweep's
    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AdoptAttempt:
    """The launcher found this attempt's processes running, unrecorded (a daemon killed
    between launching and recording them): they are the attempt's."""

    number: int
    launch_info: str


@dataclass(frozen=True, slots=True, kw_only=True)
class KillOrphans:
    """Processes of an attempt that never fully started (the daemon died part-way through
    launching it): they wait for peers that never come. SIGKILL them."""

    number: int
    launch_info: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportStraggler:
    attempt: int
    rank: int
    node: str
    busy_s: float
    typical_s: float
    window: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeNodes:
    """Probe these nodes of the run (``python -m health``); the run launches nothing until
    their results are in (``RunView.probing``)."""

    nodes: tuple[str, ...]
    kind: str  # "preflight": newly allocated; "diagnosis": after a failed attempt; "spare": idle, stale


@dataclass(frozen=True, slots=True, kw_only=True)
class SkipData:
    """From the next attempt on, the trainer steps over samples [start, end) of its data;
    with ``unit`` "steps" (a [command] told ``{skip_to_step}``), data steps [start, end)
    of its data stream."""

    start: int
    end: int
    reason: str
    unit: str = "samples"


@dataclass(frozen=True, slots=True, kw_only=True)
class BringBackCheckpoints:
    """After precompile attempt ``number``: what it saved set aside, and the run's own
    checkpoints, kept out of its way, moved back (supervisor/runfiles/precompile.py)."""

    number: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseNodes:
    """Give back every healthy node the run holds (drained ones stay drained). ``park``:
    keep the allocation's identity for the run to go on in (Slurm: its job, held in the
    queue with no node), for a run that may be resumed; else give it up for good."""

    park: bool = False


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


# The effects a decision about nodes is made of (supervisor/policy/nodes.py; the drains of
# a run's decision too), carried out by supervisor/effects/nodes.py.
NodeEffect = DrainNode | ReturnNode | RecordProbe | ProbeAgain | ProbeNode | CommandHandled

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
    | ReturnNode
    | RecordProbe
    | ProbeAgain
    | ProbeNode
    | AdoptAttempt
    | KillOrphans
    | ReportStraggler
    | BringBackCheckpoints
)
