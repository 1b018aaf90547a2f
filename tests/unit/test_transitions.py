"""The state tables (supervisor/policy/transitions.py): every state is in them, the ends
are ends, and a change they do not list raises."""

from __future__ import annotations

import pytest

from supervisor.domain import AttemptState, NodeState, RunState
from supervisor.policy.transitions import (
    ATTEMPT_TRANSITIONS,
    NODE_TRANSITIONS,
    RUN_TRANSITIONS,
    IllegalTransition,
    check_attempt,
    check_node,
    check_run,
)


def test_every_state_has_its_row() -> None:
    assert set(RUN_TRANSITIONS) == set(RunState)
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptState)
    assert set(NODE_TRANSITIONS) == set(NodeState)


def test_the_ends_are_ends_and_only_an_operator_reopens_a_failed_run() -> None:
    assert RUN_TRANSITIONS[RunState.SUCCEEDED] == RUN_TRANSITIONS[RunState.CANCELLED] == frozenset()
    assert RUN_TRANSITIONS[RunState.FAILED] == {RunState.PENDING}
    assert ATTEMPT_TRANSITIONS[AttemptState.ENDED] == frozenset()
    check_attempt(AttemptState.LAUNCHING, AttemptState.RUNNING)  # the executor's write once started
    with pytest.raises(IllegalTransition, match="attempt state ENDED -> RUNNING"):
        check_attempt(AttemptState.ENDED, AttemptState.RUNNING)
    with pytest.raises(IllegalTransition, match="run state SUCCEEDED -> RUNNING"):
        check_run(RunState.SUCCEEDED, RunState.RUNNING)


def test_a_drained_node_goes_back_to_service_before_any_run_takes_it() -> None:
    check_node(NodeState.DRAINED, NodeState.IDLE)
    check_node(NodeState.DRAINED, NodeState.DRAINED)  # drained again, with a new reason
    check_node(NodeState.ALLOCATED, NodeState.DRAINED)
    with pytest.raises(IllegalTransition, match="node state DRAINED -> ALLOCATED"):
        check_node(NodeState.DRAINED, NodeState.ALLOCATED)
