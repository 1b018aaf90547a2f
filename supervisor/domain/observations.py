"""Observations: what the reconciler gathered this tick, and everything decide() may see."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from supervisor.domain.knobs import TSUP_EXIT_CODES, ExitMeaning
from supervisor.domain.records import (
    Attempt,
    AttemptStats,
    CheckpointRef,
    Command,
    FaultRecord,
    MemoryCheckpointRef,
    Node,
    Run,
)


class ProcState(StrEnum):
    RUNNING = "RUNNING"
    EXITED = "EXITED"  # exited and we know the code (our own child)
    VANISHED = "VANISHED"  # no longer exists; exit code unknown (adopted after a restart)
    UNKNOWN = "UNKNOWN"  # could not be observed this tick: never treated as dead


# Not frozen, for speed alone: one is built per rank every tick (32,768 of them in
# bench/scale.py), and a frozen dataclass's __init__ costs 3.4 µs where this one's costs
# 1.0. Treat it as frozen all the same: the policy changes one only through replace().
@dataclass(slots=True, kw_only=True)
class RankObs:
    rank: int
    node: str
    proc: ProcState
    exit_code: int | None = None  # negative: killed by that signal (subprocess convention)
    # From the launcher: the OS process the rank runs in (ranks of one torchrun share one),
    # and whether its node lives apart from its ranks (None: nothing says): launchers/base.py.
    process: int | None = None
    node_up: bool | None = None
    node_down: str = ""  # the cluster's word that the node is down (launchers/base.py: RankProc)
    # From telemetry (None / False when no telemetry arrived):
    reported_exit_code: int | None = None  # the rank's own Exit message
    reported_reason: str = ""
    reported_exit_at: float | None = None
    lost: bool = False  # its MQTT last will arrived
    dead_since: float | None = None  # when the supervisor first saw it dead
    last_step: int = 0
    progress_at: float | None = None  # when last_step last increased
    phase: str | None = None
    phase_at: float | None = None  # when it entered that phase (the hang clock starts again then)
    phase_bytes: int = 0  # the bytes of its state the phase moves, when it said (a save, a restore)
    last_seen_at: float | None = None  # its last message of any kind (heartbeats included)
    # From its node's agent (node/agent.py; None: no agent heard): its last report.
    # Its last will counts as the node's ranks' (``lost``, ``node_up`` False) for ranks that
    # say nothing themselves.
    node_seen_at: float | None = None
    nonfinite_step: int | None = None  # the first step it reported a NaN/Inf loss or grad norm
    busy_recent_s: tuple[float, ...] = ()  # its busy time in its recent steps, oldest first
    first_step: int | None = None  # the first step it reported in this attempt
    # From its output (a [command] trainer): its first line with a fatal signature
    # (supervisor/gathering/output_progress.py), and what failed: "device" or "network".
    fatal_line: str = ""
    fatal_kind: str = ""


    @property
    def heard_at(self) -> float | None:
        """The last word from the rank or its node's agent (None: neither was ever heard)."""
        times = [t for t in (self.last_seen_at, self.node_seen_at) if t is not None]
        return max(times) if times else None


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
    launch_fatal: bool = False  # the command cannot be executed at all: no restart helps
    telemetry_up_since: float | None = None  # None while the broker link is down
    # No rank of the attempt was ever heard on telemetry (a [command] trainer's, or ranks
    # that cannot reach the broker): its ranks unknown to the launcher are seen by nothing.
    unheard: bool = False
    # Its ranks' output is read for their steps and last words (a [command] trainer's), at
    # the start of each tick, before their processes are looked at (gathering/feed.py).
    output_read: bool = False
    # A resumed reference trainer's first step, and the loss an earlier attempt reported for
    # it: the steps are deterministic, so the resumed one must repeat it exactly.
    expected_first: tuple[int, float] | None = None
    step_time_p99_s: float | None = None  # over the attempt's recent steps, all ranks
    step_time_samples: int = 0
    # The run's recent checkpoint I/O, the slowest of each (None: none measured): a whole
    # save (or a checkpoint phase as long), and the pace of saves and of restores, in GB/s
    # of a rank's state.
    save_s: float | None = None
    save_gb_s: float | None = None
    restore_gb_s: float | None = None
    recent: tuple[StepSample, ...] = ()  # rank 0's recent steps, oldest first
    # Rank 0's step times, (step, seconds): its first ones and its newest (policy/slowdown.py).
    first_step_times: tuple[tuple[int, float], ...] = ()
    newest_step_times: tuple[tuple[int, float], ...] = ()
    committed_step: int | None = None  # the newest checkpoint the attempt said it committed
    # A LAUNCHING attempt that was never recorded as started, whose processes the launcher
    # found (a daemon killed between launching and recording): all of them (``found``: the
    # ranks above are theirs), or only some (``orphans``: they wait for peers that never come).
    found: str | None = None
    orphans: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerReport:
    """A rank reported straggling in an attempt of the run (the stragglers table)."""

    attempt: int
    rank: int
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """What a run's attempts measured: their steps and persistent saves, and how long each
    of its memory saves blocked training (seconds)."""

    stats: tuple[AttemptStats, ...] = ()
    memory_saves_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class RunView:
    """Everything decide() may look at for one run."""

    run: Run
    attempts: tuple[Attempt, ...]
    allocation: tuple[Node, ...]  # nodes this run holds; drained ones while the cluster's grant lists them
    newest_checkpoint: CheckpointRef | None
    # The newest in-memory save as new as newest_checkpoint or newer (and not ruled out by a
    # rollback): the next attempt resumes from it if its nodes still hold every rank's state.
    newest_memory: MemoryCheckpointRef | None = None
    commands: tuple[Command, ...] = ()
    open_faults: int = 0  # faults not yet marked recovered
    faults: tuple[FaultRecord, ...] = ()  # the run's faults, oldest first
    probing: bool = False  # some of its nodes are being probed: launch nothing until they answer
    diagnose: bool = False  # probe a failed attempt's nodes before the next launch ([health] diagnose)
    stragglers: tuple[StragglerReport, ...] = ()  # the run's straggler reports, oldest first
    # Every run's faults within the run's lemon window (for lemon nodes), oldest first.
    cluster_faults: tuple[FaultRecord, ...] = ()
    preflight: bool = False  # probe nodes newly allocated before launching on them ([health] preflight)
    newly_allocated: tuple[str, ...] = ()  # nodes the run got since the last tick
    # While an attempt lives: the nodes the run holds outside it (its spares), each with
    # when it was last probed (None: never); and how old a spare's probe may get
    # ([health] spare_probe_every_s; 0: no spare is probed while idle).
    spares_probed_at: tuple[tuple[str, float | None], ...] = ()
    spare_probe_every_s: float = 0.0
    spikes_said: frozenset[int] = frozenset()  # first steps of the live attempt's short spikes, reported
    # False while the cluster's controller does not answer: nothing that needs it is decided.
    cluster_answering: bool = True
    # The run's stored spec no longer validates (an upgrade changed a rule): why. The run
    # cannot be launched again and ends FAILED with this reason.
    spec_error: str | None = None
    # What the trainer means by its exit codes: the reference trainer's table, or what a
    # [command] spec declares (nothing by default).
    exit_codes: Mapping[int, ExitMeaning] = field(default_factory=lambda: TSUP_EXIT_CODES)
    # What to change when the trainer does not resume from the checkpoint it was given
    # (supervisor/runfiles/trainer_cmd.py: resume_advice), for the wrong-resume fault to say once.
    resume_advice: str = "check the spec's resume arguments (command.resume), then resume the run"
    # How the trainer steps over a spike's data (RunSpec.data_skip_unit): "samples",
    # "steps", or None (it cannot: a spike is rolled back once, then only reported).
    data_skip_unit: str | None = "samples"
    # The fingerprint of the job's precompile inputs (supervisor/runfiles/precompile.py) while no
    # precompile attempt of them has succeeded: the next attempt is the precompile pass.
    # None: none is due (compiled already, or the job has no precompile pass).
    precompile_due: str | None = None
    # An ended precompile attempt whose run's checkpoints are still set aside (and its own
    # saves not yet): they are brought back before anything else is launched.
    precompile_aside: int | None = None
    # The run's data skip windows ([start, end): samples; data steps for a [command] told
    # {skip_to_step}).
    data_skips: tuple[tuple[int, int], ...] = ()
    # The checkpoint tiers whose interval the run left "auto" (policy/trainer_inputs.py).
    auto_tiers: tuple[str, ...] = ()
    # What the run measured so far, gathered while a launch may be decided (else None).
    measured: Measured | None = None

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None
