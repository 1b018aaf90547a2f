"""Hangs: the fixed and the adaptive hang limits, and whom a hang names (supervisor/policy/detection.py)."""

from __future__ import annotations

from dataclasses import replace

from supervisor.domain import (
    AttemptObs,
    DrainNode,
    FaultKind,
    ProcState,
    RecordFault,
    RunState,
    StopAttempt,
)
from supervisor.policy import decide
from supervisor.policy.detection import STALL_GAP_S, heard_again_at
from tests.unit.policy_world import NOW, attempt, hang_after, obs, of, rank, run, timed, view


def test_no_progress_beyond_the_hang_timeout_is_a_hang() -> None:
    o = obs(*(rank(i, progress_at=NOW - 61, phase="train", last_seen_at=NOW) for i in range(4)))
    [fault] = of(decide(view(run(), (attempt(),)), o, NOW), RecordFault)
    assert fault.kind is FaultKind.HANG and "61 s" in fault.summary


def test_a_hang_needs_a_word_heard_after_the_limit_passed() -> None:
    """A loaded daemon or broker hears late: the heartbeats since the limit passed (and
    any word of progress before them) are still on their way. Without a word heard after
    the limit there is no verdict, until ``silence_timeout_s`` more has passed."""
    silence = run().policy.silence_timeout_s

    def hang(idle_s: float, heard_ago_s: float) -> bool:
        o = obs(*(rank(i, progress_at=NOW - idle_s, phase="train", last_seen_at=NOW - heard_ago_s)
                  for i in range(4)))
        return bool(of(decide(view(run(), (attempt(),)), o, NOW), RecordFault))

    assert hang(61, heard_ago_s=0.5), "heard 0.5 s after the 60 s limit passed"
    assert not hang(61, heard_ago_s=1.5), "last heard before the limit passed"
    assert not hang(60 + silence - 1, heard_ago_s=silence)
    assert hang(60 + silence + 1, heard_ago_s=silence + 2), "nothing heard at all: later, still a hang"


def test_progress_within_the_timeout_is_not_a_hang() -> None:
    o = obs(*(rank(i, progress_at=NOW - 59, phase="train") for i in range(4)))
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_broker_outage_is_never_a_hang() -> None:
    o = replace(obs(*(rank(i, progress_at=NOW - 600) for i in range(4))), telemetry_up_since=None)
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_hang_clock_restarts_when_the_telemetry_link_comes_back() -> None:
    o = replace(obs(*(rank(i, progress_at=NOW - 600) for i in range(4))), telemetry_up_since=NOW - 30)
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_checkpoint_phase_gets_the_longer_allowance() -> None:
    o = obs(*(rank(i, progress_at=NOW - 120, phase="checkpoint") for i in range(4)))
    assert decide(view(run(), (attempt(),)), o, NOW) == []


def test_startup_without_a_first_step_uses_the_startup_timeout() -> None:
    live = attempt(first_step_at=None, started_at=NOW - 301)
    o = obs(*(rank(i, last_step=0, progress_at=None, phase="init", last_seen_at=NOW) for i in range(4)))
    [fault] = of(decide(view(run(RunState.STARTING), (live,)), o, NOW), RecordFault)
    assert fault.kind is FaultKind.HANG and "startup" in fault.summary


def test_the_hang_limit_adapts_to_the_step_time_with_a_floor() -> None:
    assert hang_after(0.2) == 8.5  # max(8 s floor, 3 x 0.2 s)
    assert hang_after(5.0) == 15.5  # 3 x p99
    assert hang_after(40.0) == 120.5  # 3 x p99, however far above hang_timeout_s (60 s)
    assert hang_after(0.2, samples=5) == 60.5  # too few steps timed: the static limit
    assert hang_after(30.0, samples=5) == 90.5  # ... unless 3 x the slowest so far is longer
    assert hang_after(0.2, hang_floor_s=4.0, hang_k=2.0) == 4.5


def test_announced_phases_get_their_own_allowances() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    r = run(policy=replace(run().policy, checkpoint_timeout_s=120.0, eval_timeout_s=200.0, compile_timeout_s=500.0))
    for phase, limit in (("checkpoint", 120.0), ("eval", 200.0), ("compile", 500.0), ("restore", 300.0)):
        o = timed(0.2)
        stuck = tuple(replace(x, phase=phase if x.rank == 0 else "train", progress_at=NOW - limit + 1)
                      for x in o.ranks)
        assert not of(decide(view(r, (live,)), replace(o, ranks=stuck), NOW), RecordFault), phase
        over = tuple(replace(x, progress_at=NOW - limit - 1) for x in stuck)
        assert of(decide(view(r, (live,)), replace(o, ranks=over), NOW), RecordFault), phase


def test_a_hang_names_the_rank_that_fell_silent_first_and_drains_nothing() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    o = timed(0.2)
    stopped = tuple(replace(x, last_seen_at=NOW - 30) if x.rank == 3 else x for x in o.ranks)
    effects = decide(view(run(), (live,)), replace(o, ranks=stopped), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.HANG and fault.ranks == (3,) and fault.nodes == ("n2",)
    assert "stalled first: ranks 3 on n2" in fault.summary
    assert not of(effects, DrainNode) and of(effects, StopAttempt)


def test_a_rank_behind_the_others_is_the_one_that_stalled_first() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    o = timed(0.2)
    behind = tuple(replace(x, last_step=49) if x.rank == 1 else x for x in o.ranks)
    [fault] = of(decide(view(run(), (live,)), replace(o, ranks=behind), NOW), RecordFault)
    assert fault.ranks == (1,) and fault.nodes == ("n1",)


def test_ranks_that_stalled_together_name_no_one() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    [fault] = of(decide(view(run(), (live,)), timed(0.2), NOW), RecordFault)
    assert fault.ranks == () and fault.nodes == ()


def test_a_whole_node_falling_silent_is_left_to_the_silence_rule_not_called_a_hang() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    o = timed(0.2)
    frozen = tuple(replace(x, last_seen_at=NOW - 9, progress_at=NOW - 9.5) if x.node == "n2"
                   else replace(x, progress_at=NOW - 9.5) for x in o.ranks)
    assert not of(decide(view(run(), (live,)), replace(o, ranks=frozen), NOW), RecordFault)
    later = tuple(replace(x, last_seen_at=NOW - 11) if x.node == "n2" else x for x in frozen)
    [fault] = of(decide(view(run(), (live,)), replace(o, ranks=later), NOW), RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",)


def test_a_command_trainers_only_node_silent_with_its_agent_is_no_hang_until_the_hang_timeout() -> None:
    """A [command] trainer's ranks say nothing themselves and are unknown to the Slurm
    launcher: their node's agent is their only voice. Its one node losing its power
    silences all of it at once, like a cut from the broker: no hang under the adaptive
    limit (the cluster says DOWN soon, attribution's node loss), one at hang_timeout_s."""
    live = attempt(nodes=("n1",), started_at=NOW - 1000, first_step_at=NOW - 900)
    o = timed(0.2)

    def silent_for(s: float) -> AttemptObs:
        return replace(o, ranks=tuple(replace(x, node="n1", proc=ProcState.UNKNOWN, last_seen_at=None,
                                              node_seen_at=NOW - s, progress_at=NOW - s) for x in o.ranks))
    one = run(nodes=1, spares=0)
    assert not of(decide(view(one, (live,)), silent_for(12), NOW), RecordFault)
    [fault] = of(decide(view(one, (live,)), silent_for(61), NOW), RecordFault)
    assert fault.kind is FaultKind.HANG
    # Its agent still heard: the step loop is stuck, a hang under the adaptive limit.
    heard = replace(o, ranks=tuple(replace(x, node="n1", proc=ProcState.UNKNOWN, last_seen_at=None,
                                           node_seen_at=NOW - 1, progress_at=NOW - 12) for x in o.ranks))
    [fault] = of(decide(view(one, (live,)), heard, NOW), RecordFault)
    assert fault.kind is FaultKind.HANG


def test_once_a_save_was_timed_the_checkpoint_allowance_adapts_to_it() -> None:
    live = attempt(started_at=NOW - 1000, first_step_at=NOW - 900)
    r = run(policy=replace(run().policy, checkpoint_timeout_s=600.0))
    o = replace(timed(0.2), save_s=0.15)
    saving = tuple(replace(x, phase="checkpoint", progress_at=NOW - 7.5) for x in o.ranks)
    assert not of(decide(view(r, (live,)), replace(o, ranks=saving), NOW), RecordFault)
    stuck = tuple(replace(x, progress_at=NOW - 8.5) for x in saving)
    [fault] = of(decide(view(r, (live,)), replace(o, ranks=stuck), NOW), RecordFault)
    assert "checkpoint allowance: max(8 s, 3 x slowest save 0.15 s)" in fault.summary
    slow = replace(o, ranks=stuck, save_s=100.0)
    assert not of(decide(view(r, (live,)), slow, NOW), RecordFault)


def test_ranks_heard_again_after_a_silence_longer_than_the_stall_gap_mark_the_links_return() -> None:
    assert heard_again_at(None, 100.0, None) is None  # the first word: nothing to come back from
    assert heard_again_at(100.0, 100.0 + STALL_GAP_S / 2, None) is None  # words keep coming
    assert heard_again_at(100.0, 100.0 + STALL_GAP_S + 1, None) == 100.0 + STALL_GAP_S + 1  # back after a cut
    assert heard_again_at(200.0, 201.0, 150.0) == 150.0  # the last return stands while words flow

