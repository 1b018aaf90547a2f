"""The drain budget (issue 26, item 9): a fault drains at most ``drains_per_fault`` nodes
and a run at most ``drains_per_window`` within ``drain_window_s`` on the trainer's or the
telemetry's word; beyond that nothing is drained, the nodes are probed. The cluster's own
word (a node it took out of the allocation) drains whatever the budget."""

from __future__ import annotations

from dataclasses import replace

from supervisor.domain import (
    DrainNode,
    Emit,
    FaultKind,
    FaultRecord,
    Node,
    NodeState,
    ProbeNodes,
    ProcState,
    RankObs,
    RecordFault,
)
from supervisor.policy import decide
from tests.unit.policy_world import NOW, attempt, obs, of, run, view

SIGKILL = -9
FIVE = tuple(f"n{i}" for i in range(1, 6))
ALLOC5 = tuple(Node(name=n, state=NodeState.ALLOCATED, run_number=7) for n in FIVE)


def one_rank(node_index: int, **kw: object) -> RankObs:
    base = RankObs(rank=node_index, node=FIVE[node_index], proc=ProcState.RUNNING, last_step=50,
                   progress_at=NOW - 1, last_seen_at=NOW - 0.5)
    return replace(base, **kw)  # type: ignore[arg-type]


def five_node_view(faults: tuple[FaultRecord, ...] = (), alloc: tuple[Node, ...] = ALLOC5):  # type: ignore[no-untyped-def]
    r = run(nodes=5, ranks_per_node=1)
    return replace(view(r, (attempt(nodes=FIVE),), alloc=alloc), faults=faults)


def lost(node: str, minutes_ago: float) -> FaultRecord:
    return FaultRecord(id=0, run_number=7, attempt=1, kind=FaultKind.NODE_LOST, ranks=(0,), nodes=(node,), step=10,
                       summary="", detected_at=NOW - minutes_ago * 60, recovered_at=None)


def test_a_partial_partition_drains_nothing_and_probes_the_cut_off_side() -> None:
    """Three of five nodes silent (a switch cut them off). Before: the three were drained
    (only all five silent was recognised as the network)."""
    ranks = [one_rank(0), one_rank(1), *(one_rank(i, last_seen_at=NOW - 30) for i in (2, 3, 4))]
    effects = decide(five_node_view(), obs(*ranks), NOW)
    assert of(effects, RecordFault)[0].kind is FaultKind.NODE_LOST
    assert of(effects, DrainNode) == []
    [probe] = of(effects, ProbeNodes)
    assert probe.nodes == ("n3", "n4", "n5")
    assert any(e.kind == "drain.held" for e in of(effects, Emit))


def test_one_node_silent_is_still_drained_within_the_budget() -> None:
    ranks = [one_rank(0), one_rank(1), one_rank(2), one_rank(3), one_rank(4, last_seen_at=NOW - 30)]
    assert [d.node for d in of(decide(five_node_view(), obs(*ranks), NOW), DrainNode)] == ["n5"]


def test_past_the_windows_budget_a_lost_node_is_probed_not_drained() -> None:
    """Four nodes lost in the last hour already: a fifth is held back; an hour later it
    would be drained again."""
    ranks = [one_rank(0), one_rank(1), one_rank(2), one_rank(3), one_rank(4, last_seen_at=NOW - 30)]
    recent = tuple(lost(f"x{i}", minutes_ago=10 * i) for i in range(1, 5))
    effects = decide(five_node_view(recent), obs(*ranks), NOW)
    assert of(effects, DrainNode) == [] and of(effects, ProbeNodes)[0].nodes == ("n5",)
    old = tuple(lost(f"x{i}", minutes_ago=61 + i) for i in range(1, 5))
    assert [d.node for d in of(decide(five_node_view(old), obs(*ranks), NOW), DrainNode)] == ["n5"]


def test_nodes_the_cluster_took_out_are_drained_whatever_the_budget() -> None:
    """Slurm dropped n4 and n5 from the allocation, and their ranks vanished: the cluster's
    word, past any budget (three more lost this hour)."""
    ranks = [one_rank(0), one_rank(1), one_rank(2),
             one_rank(3, proc=ProcState.EXITED, exit_code=SIGKILL, dead_since=NOW - 5, process=4),
             one_rank(4, proc=ProcState.EXITED, exit_code=SIGKILL, dead_since=NOW - 5, process=5)]
    alloc = tuple(n for n in ALLOC5 if n.name not in ("n4", "n5"))
    recent = tuple(lost(f"x{i}", minutes_ago=5) for i in range(3))
    effects = decide(five_node_view(recent, alloc), obs(*ranks), NOW)
    assert sorted(d.node for d in of(effects, DrainNode)) == ["n4", "n5"]
