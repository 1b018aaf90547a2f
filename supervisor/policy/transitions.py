"""Which run and attempt states may follow which: the one table, checked on every change.

``RUN_TRANSITIONS``, ``ATTEMPT_TRANSITIONS`` and ``NODE_TRANSITIONS`` map each state to
the states that may follow it. The store checks a node's (``check_node``) on every write of
its record (supervisor/store/nodes.py). The core calls ``check_run`` before it emits a run's state change
(policy/lifecycle.py, policy/recovery.py); the executor calls ``check_run`` again, and
``check_attempt`` for an attempt's, before it writes one (supervisor/effects/). An
illegal transition raises ``IllegalTransition`` and nothing of that decision is written
(the executor's transaction rolls back whole), so a bug shows as an error in the log, the
run retried next tick, and a state left as it was, never as a run in a state no rule
leads to. That includes the one attempt write no effect asks for: the executor marks an
attempt RUNNING once the launcher has started it (LAUNCHING -> RUNNING).
"""

from __future__ import annotations

from collections.abc import Mapping

from supervisor.domain import AttemptState, NodeState, RunState
from supervisor.errors import Conflict

_ACTIVE_EXITS = frozenset({RunState.PAUSED, RunState.CANCELLED, RunState.FAILED, RunState.SUCCEEDED})

RUN_TRANSITIONS: Mapping[RunState, frozenset[RunState]] = {
    # submitted -> the first launch; an operator's pause or cancel; a stop rule or a spec
    # that no longer validates
    RunState.PENDING: frozenset({RunState.STARTING, RunState.RECOVERING, RunState.PAUSED, RunState.CANCELLED,
                                 RunState.FAILED}),
    # launching -> the first step; a fault; a trainer that finished before a step was seen
    RunState.STARTING: _ACTIVE_EXITS | {RunState.RUNNING, RunState.RECOVERING},
    RunState.RUNNING: _ACTIVE_EXITS | {RunState.RECOVERING},
    # tearing down and relaunching -> the first step of the next attempt
    RunState.RECOVERING: _ACTIVE_EXITS | {RunState.RUNNING},
    RunState.PAUSED: frozenset({RunState.PENDING, RunState.CANCELLED}),  # resume, cancel
    RunState.FAILED: frozenset({RunState.PENDING}),  # an operator's resume
    RunState.SUCCEEDED: frozenset(),
    RunState.CANCELLED: frozenset(),
}

ATTEMPT_TRANSITIONS: Mapping[AttemptState, frozenset[AttemptState]] = {
    # recorded before the launch -> processes exist (started or adopted); stopped or ended
    # before they did (a launch error, a daemon killed mid-launch)
    AttemptState.LAUNCHING: frozenset({AttemptState.RUNNING, AttemptState.STOPPING, AttemptState.ENDED}),
    AttemptState.RUNNING: frozenset({AttemptState.STOPPING, AttemptState.ENDED}),
    AttemptState.STOPPING: frozenset({AttemptState.ENDED}),
    AttemptState.ENDED: frozenset(),
}

NODE_TRANSITIONS: Mapping[NodeState, frozenset[NodeState]] = {
    # a run takes it; it is drained (a probe, the policy, an operator)
    NodeState.IDLE: frozenset({NodeState.IDLE, NodeState.ALLOCATED, NodeState.DRAINED}),
    # the run gives it back (or the cluster took it); it is drained; a grant names its run again
    NodeState.ALLOCATED: frozenset({NodeState.ALLOCATED, NodeState.IDLE, NodeState.DRAINED}),
    # returned to service (probes, an operator, a repaired node); drained again with a new
    # reason. Never straight to a run: a drained node the cluster grants stays drained.
    NodeState.DRAINED: frozenset({NodeState.DRAINED, NodeState.IDLE}),
}


class IllegalTransition(Conflict):
    """A state change the table forbids: a bug in a rule, never acted on."""


def check_run(old: RunState, new: RunState) -> None:
    if new not in RUN_TRANSITIONS[old]:
        raise IllegalTransition(f"run state {old} -> {new} is not a transition "
                                "(supervisor/policy/transitions.py)")


def check_attempt(old: AttemptState, new: AttemptState) -> None:
    if new not in ATTEMPT_TRANSITIONS[old]:
        raise IllegalTransition(f"attempt state {old} -> {new} is not a transition "
                                "(supervisor/policy/transitions.py)")


def check_node(old: NodeState, new: NodeState) -> None:
    if new not in NODE_TRANSITIONS[old]:
        raise IllegalTransition(f"node state {old} -> {new} is not a transition "
                                "(supervisor/policy/transitions.py)")
