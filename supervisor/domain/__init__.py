"""The supervisor's vocabulary: states, records, observations and effects.

Pure data, no I/O. Records are what the store persists; observations are what the
reconciler gathers each tick from the launcher and the trainer's telemetry; effects
are what the decision core (supervisor/policy/) asks the shell to do. Times are unix
seconds (float) from the supervisor's clock, never the trainer's.

    states.py        RunState, AttemptState, NodeState, FaultKind, ... and run ids
    knobs.py         Policy: the per-run knobs of the rules
    records.py       Run, Attempt, Node, FaultRecord, events, metrics, intents, ...
    observations.py  RankObs, AttemptObs, RunView: what decide() sees
    effects.py       what decide() asks for
"""

from supervisor.domain.effects import (
    AdoptAttempt,
    AllocateNodes,
    CommandHandled,
    DrainNode,
    Effect,
    Emit,
    EndAttempt,
    EnsureStopped,
    FinishRun,
    KillOrphans,
    MarkAttemptRunning,
    MarkFaultsRecovered,
    ProbeAgain,
    ProbeNodes,
    RecordFault,
    RecordProbe,
    ReleaseNodes,
    ReportStraggler,
    ResumeRun,
    ReturnNode,
    SetRunState,
    SkipData,
    StartAttempt,
    StopAttempt,
)
from supervisor.domain.knobs import (
    Policy,
)
from supervisor.domain.observations import (
    AttemptObs,
    ProcState,
    RankObs,
    RunView,
    StepSample,
    StragglerReport,
    TrainerResult,
)
from supervisor.domain.records import (
    Attempt,
    CheckpointRecord,
    CheckpointRef,
    Command,
    EventRecord,
    FaultRecord,
    MetricRecord,
    Node,
    NodeCommand,
    NodeIntent,
    ProbeRecord,
    Run,
    StragglerRecord,
)
from supervisor.domain.states import (
    LIVE_ATTEMPT_STATES,
    TERMINAL_RUN_STATES,
    AttemptOutcome,
    AttemptState,
    CommandKind,
    FaultKind,
    NodeCommandKind,
    NodeState,
    RunState,
    parse_run_id,
    run_id_of,
)

__all__ = [
    "LIVE_ATTEMPT_STATES",
    "TERMINAL_RUN_STATES",
    "AdoptAttempt",
    "AllocateNodes",
    "Attempt",
    "AttemptObs",
    "AttemptOutcome",
    "AttemptState",
    "CheckpointRecord",
    "CheckpointRef",
    "Command",
    "CommandHandled",
    "CommandKind",
    "DrainNode",
    "Effect",
    "Emit",
    "EndAttempt",
    "EnsureStopped",
    "EventRecord",
    "FaultKind",
    "FaultRecord",
    "FinishRun",
    "KillOrphans",
    "MarkAttemptRunning",
    "MarkFaultsRecovered",
    "MetricRecord",
    "Node",
    "NodeCommand",
    "NodeCommandKind",
    "NodeIntent",
    "NodeState",
    "Policy",
    "ProbeAgain",
    "ProbeNodes",
    "ProbeRecord",
    "ProcState",
    "RankObs",
    "RecordFault",
    "RecordProbe",
    "ReleaseNodes",
    "ReportStraggler",
    "ResumeRun",
    "ReturnNode",
    "Run",
    "RunState",
    "RunView",
    "SetRunState",
    "SkipData",
    "StartAttempt",
    "StepSample",
    "StopAttempt",
    "StragglerRecord",
    "StragglerReport",
    "TrainerResult",
    "parse_run_id",
    "run_id_of",
]
