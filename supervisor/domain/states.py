"""States and kinds: what a run, an attempt, a node, a command or a fault can be."""

from __future__ import annotations

import re
from enum import StrEnum


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
    PROBE = "probe"  # run the health probes on it now: its result is recorded, nothing is drained for it


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
    WRONG_RESUME = "wrong-resume"  # a resumed trainer's first step is not after the checkpoint it was given
    CONFIG = "config"  # the trainer printed an error of its configuration that no restart can fix
    SLOWDOWN = "slowdown"  # the whole run slowed against its own first steps (a slow link, a slow node)


_RUN_ID = re.compile(r"^run-([1-9][0-9]{0,17})$")


def run_id_of(number: int) -> str:
    return f"run-{number}"


def parse_run_id(text: str) -> int | None:
    """'run-42' -> 42; None for anything that is not a run id."""
    m = _RUN_ID.match(text)
    return int(m.group(1)) if m else None
