"""Fewer nodes (supervisor/policy/recovery.py): a run whose lost nodes cannot be replaced
goes on with the healthy ones after ``shrink_after_s``, and grows back when nodes return."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.domain import (
    AllocateNodes,
    AttemptOutcome,
    AttemptState,
    CheckpointRef,
    Emit,
    Node,
    NodeState,
    RunState,
    StartAttempt,
    StopAttempt,
)
from supervisor.errors import SpecError
from supervisor.policy import decide
from supervisor.spec import parse_spec
from tests.unit.policy_world import NOW, attempt, nodes, obs, of, rank, run, view

CK = CheckpointRef(step=40, path="/ck/step_00000040")
# 4 nodes, no spare; n4 drained: 3 healthy nodes left.
ALLOC = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.DRAINED)


def shrinking(after_s: float = 60.0, counts: tuple[int, ...] | None = (1, 2), minimum: int = 1) -> object:
    r = run(RunState.RECOVERING, nodes=4, spares=0)
    return replace(r, policy=replace(r.policy, shrink_after_s=after_s, shrink_node_counts=counts,
                                     shrink_min_nodes=minimum))


def failed(ended_at: float, nodes_: tuple[str, ...] = ("n1", "n2", "n3", "n4")) -> object:
    return attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED, nodes=nodes_, ended_at=ended_at)


def test_without_shrinking_the_run_waits_for_nodes() -> None:
    r = run(RunState.RECOVERING, nodes=4, spares=0)
    effects = decide(view(r, (failed(NOW - 10_000),), ALLOC, CK), None, NOW)
    assert of(effects, AllocateNodes) == [AllocateNodes(count=1, keep=None)]
    assert not of(effects, StartAttempt)


def test_the_run_waits_shrink_after_s_for_a_node_before_going_on_with_fewer() -> None:
    r = shrinking(after_s=60.0)
    waiting = decide(view(r, (failed(NOW - 59),), ALLOC, CK), None, NOW)  # type: ignore[arg-type]
    # It keeps asking, and keeps an allocation of as few as 1 node meanwhile.
    assert of(waiting, AllocateNodes) == [AllocateNodes(count=1, keep=1)]
    assert not of(waiting, StartAttempt)

    effects = decide(view(r, (failed(NOW - 60),), ALLOC, CK), None, NOW)  # type: ignore[arg-type]
    [start] = of(effects, StartAttempt)
    # 3 nodes are healthy, but the trainer's batch splits over 1 or 2 nodes only: 2.
    assert start.nodes == ("n1", "n2") and start.resume_from == CK.path
    [shrunk] = [e for e in of(effects, Emit) if e.kind == "run.shrunk"]
    assert shrunk.data == {"nodes": 2, "of": 4}
    assert "continuing on 2 of 4 nodes" in shrunk.message


def test_a_shrunk_attempt_that_fails_shrinks_again_at_once() -> None:
    r = shrinking()
    prev = failed(NOW - 1, nodes_=("n1", "n2"))
    alloc = nodes(NodeState.ALLOCATED, NodeState.DRAINED, NodeState.DRAINED, NodeState.DRAINED)
    [start] = of(decide(view(r, (prev,), alloc, CK), None, NOW), StartAttempt)  # type: ignore[arg-type]
    assert start.nodes == ("n1",)


def test_no_count_the_trainer_can_run_on_means_waiting() -> None:
    r = shrinking(counts=(), minimum=1)
    effects = decide(view(r, (failed(NOW - 1000),), ALLOC, CK), None, NOW)  # type: ignore[arg-type]
    assert not of(effects, StartAttempt)


def test_below_shrink_min_nodes_the_run_waits() -> None:
    r = shrinking(counts=None, minimum=3)
    alloc = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.DRAINED, NodeState.DRAINED)
    effects = decide(view(r, (failed(NOW - 1000),), alloc, CK), None, NOW)  # type: ignore[arg-type]
    assert not of(effects, StartAttempt)
    assert of(effects, AllocateNodes) == [AllocateNodes(count=2, keep=3)]


def test_a_shrunk_attempt_asks_for_nodes_and_grows_back_when_they_come() -> None:
    r = replace(shrinking(), state=RunState.RUNNING)  # type: ignore[type-var]
    live = attempt(2, nodes=("n1", "n2"))
    ranks = obs(*(rank(i, node="n1" if i < 2 else "n2") for i in range(4)))
    two_held = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED)
    effects = decide(view(r, (live,), two_held, CK), ranks, NOW)
    assert of(effects, AllocateNodes) == [AllocateNodes(count=2, keep=2)]
    assert not of(effects, StopAttempt)

    four_held = (*two_held, Node(name="n5", state=NodeState.ALLOCATED, run_number=7),
                 Node(name="n6", state=NodeState.ALLOCATED, run_number=7))
    effects = decide(view(r, (live,), four_held, CK), ranks, NOW)
    [stop] = of(effects, StopAttempt)
    assert stop.outcome is AttemptOutcome.INTERRUPTED  # not a failure: it costs no budget
    assert "growing back to 4 nodes: n5, n6 joined" in stop.reason
    assert "run.grow" in [e.kind for e in of(effects, Emit)]


def test_a_full_size_attempt_does_not_grow() -> None:
    r = replace(shrinking(), state=RunState.RUNNING, nodes=2)  # type: ignore[type-var]
    three_held = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.ALLOCATED)
    effects = decide(view(r, (attempt(2),), three_held, CK), obs(), NOW)
    assert not of(effects, StopAttempt) and not of(effects, AllocateNodes)


def test_the_spec_lists_the_counts_the_reference_trainer_can_split_its_batch_over() -> None:
    def spec(trainer: dict[str, object], nodes_: int = 8, per_node: int = 2) -> object:
        return parse_spec({"name": "s", "resources": {"nodes": nodes_, "ranks_per_node": per_node},
                           "trainer": {"steps": 10, **trainer}}, "test")
    assert spec({"global_batch_size": 16}).shrink_counts == (1, 2, 4)  # type: ignore[attr-defined]
    # 12 samples over 2 x k ranks in micro-batches of 2: k = 1 (6 each) and 3 (2 each).
    assert spec({"global_batch_size": 12, "micro_batch_size": 2}).shrink_counts == (1, 3)  # type: ignore[attr-defined]
    command = parse_spec({"name": "s", "resources": {"nodes": 4},
                          "command": {"argv": ["torchrun", "train.py"], "steps": 10,
                                      "checkpoint_dir": "ck"}}, "test")
    assert command.shrink_counts is None


def test_the_neuron_backend_cannot_shrink_and_a_spec_that_cannot_shrink_says_so() -> None:
    def spec(trainer: dict[str, object], policy: dict[str, object], nodes_: int = 4) -> object:
        return parse_spec({"name": "s", "resources": {"nodes": nodes_, "ranks_per_node": 2},
                           "trainer": {"steps": 10, **trainer}, "policy": policy}, "test")
    assert spec({"backend": "neuron"}, {}).shrink_counts == ()  # type: ignore[attr-defined]
    with pytest.raises(SpecError, match="cannot reshard"):
        spec({"backend": "neuron"}, {"shrink_after_s": 60})
    with pytest.raises(SpecError, match=r"leaves no count below resources\.nodes 4"):
        spec({}, {"shrink_after_s": 60, "shrink_min_nodes": 4})
    with pytest.raises(SpecError, match="no node count from shrink_min_nodes up splits"):
        spec({"global_batch_size": 8}, {"shrink_after_s": 60, "shrink_min_nodes": 3})  # 3 x 2 ranks: no
    assert spec({"global_batch_size": 8}, {"shrink_after_s": 60})  # 1 or 2 nodes: fine


def test_the_first_attempt_never_shrinks() -> None:
    r = replace(shrinking(), state=RunState.PENDING)  # type: ignore[type-var]
    effects = decide(view(r, (), ALLOC, None), None, NOW)
    assert not of(effects, StartAttempt)
    assert of(effects, AllocateNodes) == [AllocateNodes(count=1, keep=1)]


def test_a_shrunk_attempt_grows_back_only_after_a_checkpoint_of_its_own() -> None:
    r = replace(shrinking(), state=RunState.RUNNING)  # type: ignore[type-var]
    live = attempt(2, nodes=("n1", "n2"), resume_step=40)
    ranks = obs(*(rank(i, node="n1" if i < 2 else "n2") for i in range(4)))
    four_held = nodes(NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.ALLOCATED, NodeState.ALLOCATED)
    assert not of(decide(view(r, (live,), four_held, CK), ranks, NOW), StopAttempt)  # CK is step 40
    newer = CheckpointRef(step=60, path="/ck/step_00000060")
    assert of(decide(view(r, (live,), four_held, newer), ranks, NOW), StopAttempt)
    not_started = replace(live, first_step_at=None)
    assert not of(decide(view(r, (not_started,), four_held, newer), ranks, NOW), StopAttempt)
