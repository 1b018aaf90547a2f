"""The run's memory between ticks (supervisor/gathering/run_memory.py): what it keeps,
and what it forgets."""

from __future__ import annotations

from pathlib import Path

from supervisor.gathering.run_memory import RunMemory
from supervisor.store import SqlStore


def memory(tmp_path: Path) -> RunMemory:
    return RunMemory(SqlStore(tmp_path / "never-opened.db"))  # these reads need no store


def test_nodes_are_newly_allocated_once_and_none_at_this_processs_first_look(tmp_path: Path) -> None:
    m = memory(tmp_path)
    assert m.newly_allocated(1, ("a", "b")) == (), "held before this daemon: its predecessor preflighted them"
    assert m.newly_allocated(1, ("a", "b", "c")) == ("c",)
    assert m.newly_allocated(1, ("a", "b", "c")) == ()
    assert m.newly_allocated(1, ("a", "c")) == ()
    assert m.newly_allocated(1, ("a", "b", "c")) == ("b",), "a node back in the allocation is new again"
    assert m.newly_allocated(2, ()) == () and m.newly_allocated(2, ("x",)) == ("x",), "a run from nothing"


def test_an_ended_attempt_and_a_finished_run_are_forgotten(tmp_path: Path) -> None:
    m = memory(tmp_path)
    m.attempt(1, 1).dead_since[0] = 5.0
    m.attempt(1, 2).dead_since[1] = 6.0
    m.attempt(2, 1).dead_since[2] = 7.0
    m.newly_allocated(2, ("x",))
    m.keep_live(1, 2)
    assert m.attempt(1, 1).dead_since == {} and m.attempt(1, 2).dead_since == {1: 6.0}
    m.keep_runs({1})
    assert m.attempt(2, 1).dead_since == {}
    assert m.newly_allocated(2, ("x", "y")) == (), "run 2 forgotten: a first look again"


def test_a_checkpoint_out_of_range_is_noted_once_per_run(tmp_path: Path) -> None:
    m = memory(tmp_path)
    far = tmp_path / "step_99999999999"
    assert m.note_out_of_range(1, far) and not m.note_out_of_range(1, far)
    assert m.note_out_of_range(2, far)
