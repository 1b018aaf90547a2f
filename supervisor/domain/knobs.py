"""``Policy``: the per-run knobs of the decision rules (from the spec's [policy] table),
``DrainBudget``: the daemon's one knob over all of them (its config's), and
``ExitMeaning``: what a trainer's exit code says, for trainers that say anything."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from supervisor.planning import LLAMA3_FAILURES_PER_NODE_DAY


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
    # once hang_min_samples step times are known, however long the steps are (a Trainium
    # step of 635 s is no hang at 300 s); before that, hang_timeout_s, or hang_k x the
    # slowest step timed so far when that is longer. The clock starts again at every
    # phase a rank announces and at its end (supervisor/policy/detection.py).
    hang_timeout_s: float = 300.0
    hang_floor_s: float = 8.0  # the 10 s detection target, less a tick and message latency
    hang_k: float = 3.0
    hang_min_samples: int = 20
    startup_timeout_s: float = 900.0  # no first step for this long after launch (init, restore)
    # A rank compiling (a Neuron graph compile, neuron_parallel_compile's precompile pass):
    # no progress for this long is a hang. At least startup_timeout_s.
    compile_timeout_s: float = 7200.0
    # A rank in the checkpoint phase (a save, the copy of one, or the wait for the one still
    # being written): hang_k x the time the save should take at the pace this run measured
    # (its announced bytes / the slowest recent GB/s, else the slowest recent save), at
    # least hang_floor_s. Before any save was timed: checkpoint_timeout_s, or the announced
    # bytes at checkpoint_min_gb_s when that is longer. A restore gets startup_timeout_s,
    # or hang_k x its bytes at the measured pace when that is longer.
    checkpoint_timeout_s: float = 600.0
    checkpoint_min_gb_s: float = 0.1  # GB/s per rank: the slowest storage assumed before one is measured
    eval_timeout_s: float = 600.0  # a rank announcing an evaluation
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long
    # After the first rank death is seen, wait this long (unless every rank is gone)
    # before attributing the fault, so that ranks dying together are judged together.
    fault_settle_s: float = 1.0
    # Processes still alive this long after the SIGKILL are stuck in the kernel: the
    # attempt is abandoned and their nodes drained.
    abandon_after_s: float = 120.0
    # A paused run gives its nodes back (Slurm: cancels its allocation) once they have
    # been idle this long since its last attempt ended; `resume` asks for new ones.
    pause_release_s: float = 300.0
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
    # A run that slowed as a whole (policy/slowdown.py): rank 0's median step time over
    # its newest slowdown_window steps over slowdown_factor times its first steps'. With
    # [health] diagnose, stopped after its next checkpoint, its nodes probed.
    slowdown_factor: float = 2.0
    slowdown_window: int = 10
    # Lemons: a node blamed in lemon_faults or more distinct faults (of any run; a fault
    # repeating at the same step counts once) within lemon_window_s is drained.
    lemon_faults: int = 3
    lemon_window_s: float = 86_400.0
    # The drain budget: a fault that would drain more than drains_per_fault nodes, or one
    # that would bring the run's drains within drain_window_s past drains_per_window, drains
    # none of them on the trainer's or the telemetry's word: so many nodes failing at once
    # is the network's (a partition) or the trainer's text, not the nodes'. They are probed
    # instead; a probe's verdict or the cluster's own (a node it took out) still drains.
    drains_per_fault: int = 2
    drains_per_window: int = 4
    drain_window_s: float = 3600.0
    # Fewer nodes: when a failed attempt's nodes cannot all be replaced (no spare held and
    # none came from the cluster within shrink_after_s of its end), the next attempt runs
    # on the healthy nodes: the most it can, at least shrink_min_nodes, and a count in
    # shrink_node_counts (filled in at submit: the counts the reference trainer can split
    # its global batch over; None: any). The run grows back to its full size as soon as
    # it holds enough healthy nodes again. 0: never shrink, wait for nodes.
    shrink_after_s: float = 0.0
    shrink_min_nodes: int = 1
    shrink_node_counts: tuple[int, ...] | None = None
    # The cluster's interruption rate, for a run whose checkpoint interval is "auto"
    # (supervisor/planning.py: Young/Daly at each attempt); Llama 3's by default.
    failures_per_node_day: float = LLAMA3_FAILURES_PER_NODE_DAY


@dataclass(frozen=True, slots=True)
class DrainBudget:
    """The daemon's drains of its own accord, whatever the run: at most ``per_window`` in
    ``window_s`` (its config's drains_per_window, drain_window_s; supervisor/effects/nodes.py)."""

    per_window: int = 8
    window_s: float = 3600.0


class ExitMeaning(enum.StrEnum):
    """What a trainer means by an exit code, when it declares a table of them (the
    spec's ``exit_codes``). Any other failure is retried from the newest checkpoint."""

    DO_NOT_RETRY = "do-not-retry"  # a configuration or usage error: a restart cannot fix it -> FAILED
    CHECKPOINT_UNREADABLE = "checkpoint-unreadable"  # resume from the one before the checkpoint it failed on
    DEVICE = "device"  # its accelerator failed: drain its node, restart on a spare
    STORAGE_FULL = "storage-full"  # no checkpoint can be written: FAILED until an operator frees space


# The reference trainer's table (trainer/README.md, wire/errors.py). A trainer the
# supervisor did not write means nothing by its codes unless its spec says so: torchrun
# exits 1 for any child's failure, and a script's 2 may be anything.
TSUP_EXIT_CODES: Mapping[int, ExitMeaning] = MappingProxyType({
    2: ExitMeaning.DO_NOT_RETRY, 3: ExitMeaning.CHECKPOINT_UNREADABLE, 4: ExitMeaning.DEVICE,
    5: ExitMeaning.STORAGE_FULL,
})
