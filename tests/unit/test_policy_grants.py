"""What a grant changes in the node records (supervisor/policy/grants.py)."""

from __future__ import annotations

from supervisor.domain import Node, NodeState
from supervisor.policy.grants import allocation_after, grant_changes


def node(name: str, state: NodeState, run: int | None = None) -> Node:
    return Node(name=name, state=state, run_number=run)


def test_a_grant_allocates_its_new_nodes_keeps_drained_ones_drained_and_frees_the_rest() -> None:
    known = [node("a", NodeState.ALLOCATED, 7), node("b", NodeState.DRAINED, 7), node("c", NodeState.ALLOCATED, 7),
             node("d", NodeState.IDLE), node("e", NodeState.ALLOCATED, 8)]
    changes = grant_changes(known, 7, ("a", "b", "d", "e"), "job 42")
    assert changes.info == "job 42"
    assert changes.added == ("d", "e")  # idle, and another run's record: the cluster says they are run 7's
    assert changes.released == ("c",)
    assert {x.name: (x.state, x.run_number) for x in changes.puts} == {
        "d": (NodeState.ALLOCATED, 7), "e": (NodeState.ALLOCATED, 7), "c": (NodeState.IDLE, None)}
    after = allocation_after(known, 7, changes)
    assert [(x.name, x.state) for x in after] == [
        ("a", NodeState.ALLOCATED), ("b", NodeState.DRAINED), ("d", NodeState.ALLOCATED), ("e", NodeState.ALLOCATED)]


def test_a_grant_that_changes_nothing_writes_nothing() -> None:
    known = [node("a", NodeState.ALLOCATED, 7), node("b", NodeState.ALLOCATED, 7)]
    changes = grant_changes(known, 7, ("a", "b"), None)
    assert changes.puts == () and changes.added == () and changes.released == ()
    assert allocation_after(known, 7, None) == tuple(known)
