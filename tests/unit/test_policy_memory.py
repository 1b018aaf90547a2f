"""The next attempt resumes from the in-memory tier only when its nodes still hold every
rank's state (supervisor/policy/memory.py), and says why when they do not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.domain import (
    AttemptOutcome,
    AttemptState,
    CheckpointRef,
    Emit,
    MemoryCheckpointRecord,
    MemoryCheckpointRef,
    NodeState,
    RunState,
    StartAttempt,
)
from supervisor.policy import decide
from supervisor.policy.memory import newest_resumable, unrecoverable
from tests.unit.policy_world import NOW, attempt, nodes, of, run, view


def save(*ring: str, step: int = 45) -> MemoryCheckpointRef:
    return MemoryCheckpointRef(attempt=1, step=step, nodes=ring)


@pytest.mark.parametrize(("ring", "next_nodes", "lost"), [
    (("a", "b", "c", "d"), ("a", "b", "c", "d"), []),  # a rank's death: every node kept
    (("a", "b", "c", "d"), ("a", "x", "c", "d"), []),  # b lost: c holds its replicas
    (("a", "b", "c", "d"), ("a", "x", "y", "d"), ["b"]),  # b and c (its replica holder) lost
    (("a", "b", "c", "d"), ("x", "b", "y", "d"), []),  # two lost, not neighbours
    (("a", "b", "c", "d"), ("a", "b", "c", "x"), []),  # d's replicas wrap around to a
    (("a", "b", "c", "d"), ("x", "b", "c", "y"), ["d"]),  # d and a lost: d's state is gone
    (("a", "b"), ("x", "b"), []),
    (("a", "b"), ("x", "y"), ["a", "b"]),
    (("a",), ("a",), []),  # one node: no replica, but its own memory
    (("a",), ("x",), ["a"]),
    (("a", "b"), ("a", "b", "c"), ["a", "b"]),  # another world size
])
def test_a_save_is_recoverable_unless_a_node_and_the_next_one_are_both_gone(
        ring: tuple[str, ...], next_nodes: tuple[str, ...], lost: list[str]) -> None:
    assert unrecoverable(save(*ring), next_nodes) == lost


def test_the_name_the_trainer_resumes_by() -> None:
    assert save("a", "b").resume_from == "memory:1:45"


def failed_on(*ring: str) -> object:
    return attempt(state=AttemptState.ENDED, outcome=AttemptOutcome.FAILED, nodes=ring)


CK40 = CheckpointRef(step=40, path="/ck/step_00000040")


def test_after_a_lost_node_the_next_attempt_resumes_from_memory() -> None:
    alloc = nodes(NodeState.ALLOCATED, NodeState.DRAINED, NodeState.ALLOCATED)  # n2 lost, n3 the spare
    v = replace(view(run(RunState.RECOVERING), (failed_on("n1", "n2"),), alloc, CK40),  # type: ignore[arg-type]
                newest_memory=save("n1", "n2"))
    effects = decide(v, None, NOW)
    [start] = of(effects, StartAttempt)
    assert (start.nodes, start.resume_from, start.resume_step) == (("n1", "n3"), "memory:1:45", 45)
    [launching] = [e for e in of(effects, Emit) if e.kind == "attempt.launching"]
    assert "from memory (attempt 1's save of step 45)" in launching.message
    assert not [e for e in of(effects, Emit) if e.kind == "memory.lost"]


def test_when_a_node_and_its_replica_holder_are_lost_the_persistent_checkpoint_is_used() -> None:
    alloc = (*nodes(NodeState.DRAINED, NodeState.DRAINED),
             *(replace(n, name=f"n{i + 3}") for i, n in enumerate(nodes(NodeState.ALLOCATED, NodeState.ALLOCATED))))
    v = replace(view(run(RunState.RECOVERING), (failed_on("n1", "n2"),), alloc, CK40),  # type: ignore[arg-type]
                newest_memory=save("n1", "n2"))
    effects = decide(v, None, NOW)
    [start] = of(effects, StartAttempt)
    assert (start.nodes, start.resume_from, start.resume_step) == (("n3", "n4"), "/ck/step_00000040", 40)
    [lost] = [e for e in of(effects, Emit) if e.kind == "memory.lost"]
    assert "n1, n2" in lost.message and "resuming from the checkpoint at step 40" in lost.message
    assert lost.data["step"] == 45


def test_a_memory_save_as_new_as_the_persistent_checkpoint_is_the_one_resumed_from() -> None:
    """The node lived: its memory holds step 40 as storage does, and reading memory reads
    no storage. An older memory save never wins; one the trainer could not read is passed."""
    from supervisor.domain import FaultKind, FaultRecord
    from supervisor.policy import unreadable_checkpoints

    attempts = (attempt(1, AttemptState.ENDED, nodes=("a", "b")),)
    saves = [MemoryCheckpointRecord(attempt=1, step=s, duration_s=0.1, created_at=NOW) for s in (35, 40)]
    newest = newest_resumable(saves, attempts, CheckpointRef(step=40, path="/ck/40"), None, frozenset())
    assert newest is not None and newest.step == 40
    assert newest_resumable(saves, attempts, CheckpointRef(step=45, path="/ck/45"), None, frozenset()) is None
    # Attempt 2 resumed from memory:1:40 and could not read it (exit 3): memory's 40 is out, storage's 40 is not.
    tried = (*attempts, attempt(2, AttemptState.ENDED, resume_from="memory:1:40", resume_step=40))
    failed = [FaultRecord(id=1, run_number=7, attempt=2, kind=FaultKind.CHECKPOINT, ranks=(0,), nodes=(),
                          step=40, summary="x", detected_at=NOW, recovered_at=None)]
    assert unreadable_checkpoints(failed, tried, memory=True) == {40}
    assert unreadable_checkpoints(failed, tried) == frozenset()
    assert newest_resumable(saves, tried, CheckpointRef(step=40, path="/ck/40"), None,
                            unreadable_checkpoints(failed, tried, memory=True)) is None


def memory_save(attempt_number: int, step: int) -> MemoryCheckpointRecord:
    return MemoryCheckpointRecord(attempt=attempt_number, step=step, duration_s=0.1, created_at=NOW)


def test_the_memory_save_resumed_from_is_the_newest_usable_one_with_its_attempts_nodes() -> None:
    attempts = (attempt(1, AttemptState.ENDED, nodes=("a", "b")), attempt(2, nodes=("c", "d")))
    saves = [memory_save(1, 40), memory_save(2, 60), memory_save(2, 80), memory_save(1, 90)]
    # the newest: step 90, on its own attempt's nodes
    assert newest_resumable(saves, attempts, None, None, frozenset()) == MemoryCheckpointRef(
        attempt=1, step=90, nodes=("a", "b"))
    # a rollback before step 85, and step 80 found unreadable: step 60
    assert newest_resumable(saves, attempts, None, 85, frozenset({80})) == MemoryCheckpointRef(
        attempt=2, step=60, nodes=("c", "d"))
    # older than the newest persistent checkpoint: storage is read instead
    assert newest_resumable(saves, attempts, CheckpointRef(step=95, path="/ck/95"), None, frozenset()) is None
    # a save of an attempt the run does not have (a record from elsewhere) is never picked
    assert newest_resumable([memory_save(3, 99)], attempts, None, None, frozenset()) is None

