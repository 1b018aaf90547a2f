"""Every kind of event the supervisor records.

An event is a line of a run's audit log (the ``events`` table), published on MQTT
through the outbox (``supervisor/events``), listed by ``GET /v1/events`` and streamed by
the API. Its kind is one of these, so that a dashboard or an alert can match on it and
a typo is a type error, not a silent new kind. The values are the strings the log and
the API have always carried.
"""

from __future__ import annotations

from enum import StrEnum


class EventKind(StrEnum):
    # The run.
    RUN_SUBMITTED = "run.submitted"  # a spec was accepted
    RUN_STATE = "run.state"  # the run changed state ("OLD -> NEW: reason")
    RUN_RECOVERED = "run.recovered"  # training again after a fault
    RUN_SHRUNK = "run.shrunk"  # the next attempt runs on fewer nodes (no spare came)
    RUN_GROW = "run.grow"  # a shrunk run stops its attempt to grow back to its size
    # Its attempts.
    ATTEMPT_LAUNCHING = "attempt.launching"  # recorded, about to start
    ATTEMPT_STARTED = "attempt.started"  # its processes exist
    ATTEMPT_STOPPING = "attempt.stopping"  # being stopped (a fault, a command)
    ATTEMPT_ENDED = "attempt.ended"  # no process of it is left
    ATTEMPT_ADOPTED = "attempt.adopted"  # found running by a restarted daemon
    ATTEMPT_ABORTED = "attempt.aborted"  # a launch a killed daemon left half done
    ATTEMPT_ABANDONED = "attempt.abandoned"  # processes outlived SIGKILL: left, nodes drained
    ATTEMPT_BACKOFF = "attempt.backoff"  # the next launch waits (failures in a row)
    PRECOMPILED = "attempt.precompiled"  # the precompile pass finished: training starts next
    # Faults and what the rules made of them.
    FAULT_DETECTED = "fault.detected"
    SPIKE_TRANSIENT = "spike.transient"  # a one-step loss or grad-norm spike, tolerated
    SPIKE_PERSISTS = "spike.persists"  # back after its rollback, and the trainer cannot skip data: tolerated
    STRAGGLER = "straggler"  # a rank far slower than the others
    STRAGGLER_KEPT = "straggler.kept"  # ... kept in the next attempt (no spare)
    STRAGGLER_LEFT_OUT = "straggler.left-out"  # ... left out of the next attempt
    DATA_SKIP = "data.skip"  # a data window the run skips after a spike
    MEMORY_LOST = "memory.lost"  # the memory tier's save cannot be resumed from
    # Over a drain budget: the run's (probed instead) or the daemon's (left to an operator).
    DRAIN_HELD = "drain.held"
    # Checkpoints.
    CHECKPOINT_COMMITTED = "checkpoint.committed"
    CHECKPOINT_RESTORED = "checkpoint.restored"
    CHECKPOINT_REJECTED = "checkpoint.rejected"  # found, and fails verification
    CHECKPOINT_SKIPPED = "checkpoint.skipped"  # found, with a step no run could reach: passed over
    CHECKPOINT_SET_ASIDE = "checkpoint.set-aside"  # newer than the resume point: moved aside
    CHECKPOINT_INTERVAL = "checkpoint.interval"  # an "auto" interval, and why
    # Nodes.
    NODES_ALLOCATED = "nodes.allocated"
    NODES_SHORT = "nodes.short"  # holding fewer nodes than asked for: waiting
    NODES_RELEASED = "nodes.released"
    ALLOCATION_RELEASED = "allocation.released"  # a paused run's nodes go back
    NODE_DRAINED = "node.drained"
    NODE_RETURNED = "node.returned"  # back in service
    NODE_DRAIN_FAILED = "node.drain_failed"  # the cluster refused the drain (sent again)
    NODE_RETURN_FAILED = "node.return_failed"
    PROBE_STARTED = "probe.started"
    PROBE_HEALTHY = "probe.healthy"  # a probe's verdict (health/model.py's Status)
    PROBE_DEGRADED = "probe.degraded"
    PROBE_UNHEALTHY = "probe.unhealthy"
    PROBE_UNKNOWN = "probe.unknown"
    PROBE_RUN_FILES = "probe.run_files"  # the run's own files missing on all its nodes: its fault
    PROBE_BROKER = "probe.broker"  # the broker answers none of the nodes probed: not theirs
    PROBE_RUN_USER = "probe.run_user"  # the run's user exists on none of its nodes: its fault
    # Operators, drills, the daemon.
    COMMAND_ACCEPTED = "command.accepted"
    COMMAND_REJECTED = "command.rejected"
    CHAOS_INJECTED = "chaos.injected"
    CHAOS_HEALED = "chaos.healed"
    DAEMON_STARTED = "daemon.started"

    @classmethod
    def probe(cls, status: str) -> EventKind:
        """The kind of a probe's verdict ``status`` (ValueError for another word)."""
        return cls(f"probe.{status}")

    @classmethod
    def node_failed(cls, verb: str) -> EventKind:
        """The kind of a ``verb`` ("drain", "return") the cluster refused."""
        return cls(f"node.{verb}_failed")
