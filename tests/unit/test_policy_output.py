"""What a [command] trainer's output says: device, NCCL and configuration errors, the resumed step (supervisor/policy/)."""

from __future__ import annotations

from dataclasses import replace

from supervisor.domain import (
    AttemptState,
    DrainNode,
    FaultKind,
    FinishRun,
    NodeState,
    ProcState,
    RecordFault,
    RunState,
    StartAttempt,
    StepSample,
)
from supervisor.policy import decide
from tests.unit.policy_world import HEALTHY3, NOW, SIGKILL, attempt, nodes, obs, of, rank, run, view


def test_a_device_error_in_a_ranks_output_drains_the_node_that_printed_it() -> None:
    ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    ranks = [rank(0, ProcState.EXITED, exit_code=1), rank(1, ProcState.EXITED, exit_code=1),
             rank(2, ProcState.EXITED, exit_code=1, fatal_kind="device", fatal_line=ecc),
             rank(3, ProcState.EXITED, exit_code=1)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.DEVICE and fault.nodes == ("n2",) and ecc in fault.summary
    [drain] = of(effects, DrainNode)
    assert drain.node == "n2" and ecc in drain.reason


def test_an_nccl_error_in_a_ranks_output_names_its_node_without_draining_it() -> None:
    nccl = "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."
    ranks = [rank(0, ProcState.EXITED, exit_code=SIGKILL), rank(1, ProcState.EXITED, exit_code=1),
             rank(2, ProcState.EXITED, exit_code=1, fatal_kind="peer", fatal_line=nccl),
             rank(3, ProcState.EXITED, exit_code=1)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT and fault.nodes == ("n1", "n2") and fault.ranks == (0,)
    assert f"rank 2 on n2 printed: {nccl}" in fault.summary
    assert not of(effects, DrainNode)


def test_a_configuration_error_in_a_ranks_output_fails_the_run_at_once_with_its_words() -> None:
    """Seed 003's DP 2 x TP 16 layout: every attempt would fail the same way, so the first
    ends the run, naming the line, draining nothing, starting nothing."""
    layout = ("2026-Jan-14 11:23:49.987594 95431:108485 ERROR   ENC:enc_init_comm   [rank 0] failed (2) to "
              "init a collective algorithm for provided replica group.")
    ranks = [rank(0, ProcState.EXITED, exit_code=1, fatal_kind="config", fatal_line=layout),
             rank(1, ProcState.EXITED, exit_code=SIGKILL), rank(2, ProcState.EXITED, exit_code=1),
             rank(3, ProcState.EXITED, exit_code=1)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.CONFIG and fault.ranks == (0,) and layout in fault.summary
    [finish] = of(effects, FinishRun)
    assert finish.state is RunState.FAILED and layout in finish.reason
    assert not of(effects, DrainNode) and not of(effects, StartAttempt)


def test_a_trainer_that_resumes_at_the_wrong_step_fails_the_run_with_the_reason() -> None:
    resumed = attempt(2, resume_from="/ck/llama_v3-20steps", resume_step=20, first_step_at=None)
    ranks = [rank(0, first_step=1, last_step=1), rank(1), rank(2), rank(3)]
    effects = decide(view(run(), (attempt(1, AttemptState.ENDED), resumed)), obs(*ranks), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.WRONG_RESUME and fault.step == 1
    assert "resumed at step 1, not after step 20" in fault.summary and "command.resume" in fault.summary
    assert not of(effects, StartAttempt)
    # Dead too by the time its output is judged (the FSDP test case saving step 10 again over
    # the directory it left, on a loaded host): the wrong resume is why, not its exit.
    dead = [rank(0, ProcState.EXITED, exit_code=1, first_step=1, last_step=10, dead_since=NOW - 1),
            rank(1), rank(2), rank(3)]
    effects = decide(view(run(), (attempt(1, AttemptState.ENDED), resumed)), obs(*dead), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.WRONG_RESUME and not of(effects, StartAttempt)
    right = [rank(0, first_step=21, last_step=21), rank(1), rank(2), rank(3)]
    effects = decide(view(run(), (attempt(1, AttemptState.ENDED), resumed)), obs(*right), NOW)
    assert not of(effects, RecordFault)


def test_unseen_ranks_on_a_node_the_allocation_lost_are_that_nodes_loss() -> None:
    """A [command] trainer on Slurm: no telemetry, and its step's ranks are UNKNOWN to the
    launcher. node n1 dies; Slurm shrinks the allocation by it (--no-kill) while n2's
    ranks exit 1 (their peer is gone): n1 is lost, not n2 to blame."""
    unseen = [rank(0, ProcState.UNKNOWN), rank(1, ProcState.UNKNOWN)]
    crashed = [rank(2, ProcState.EXITED, exit_code=1), rank(3, ProcState.EXITED, exit_code=1)]
    without_n1 = tuple(n for n in HEALTHY3 if n.name != "n1")
    effects = decide(view(run(), (attempt(),), alloc=without_n1), obs(*unseen, *crashed, unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",) and fault.ranks == (0, 1)
    assert [d.node for d in of(effects, DrainNode)] == ["n1"]
    # While the allocation still holds n1 nothing says it died: n2's crash waits for the
    # cluster's word, up to silence_timeout_s (10 s) after it.
    effects = decide(view(run(), (attempt(),)), obs(*unseen, *crashed, unheard=True), NOW)
    assert not of(effects, RecordFault)
    effects = decide(view(run(), (attempt(),)),
                     obs(*unseen, *(replace(r, dead_since=NOW - 11) for r in crashed), unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT and not of(effects, DrainNode)
    # A one-node attempt's node gone, its spare still held: that node's loss (every rank
    # silent at once is no network cut when the cluster itself took the node out).
    one = attempt(nodes=("n1",))
    alone = [rank(0, ProcState.UNKNOWN, lost=True), rank(1, ProcState.UNKNOWN, lost=True)]
    effects = decide(view(run(nodes=1), (one,), alloc=without_n1), obs(*alone, unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",)
    assert not of(decide(view(run(nodes=1), (one,)), obs(*alone, unheard=True), NOW), RecordFault), \
        "while the allocation holds it, every rank silent at once is the network's"
    # The cluster taking every node is an interruption, not two lost nodes.
    effects = decide(view(run(), (attempt(),), alloc=nodes(NodeState.ALLOCATED)[:0]),
                     obs(*unseen, rank(2, ProcState.UNKNOWN), rank(3, ProcState.UNKNOWN), unheard=True), NOW)
    assert not of(effects, DrainNode)


def test_a_resumed_step_whose_loss_differs_from_before_quarantines_its_checkpoint() -> None:
    """The reference trainer's steps are deterministic: after resuming from step 40, step
    41 must have the loss attempt 1 reported for it. A checkpoint that loads but differs
    (a weight changed in storage) is never resumed from again."""
    resumed = attempt(2, resume_from="/ck/step_00000040", resume_step=40)
    history = (attempt(1, AttemptState.ENDED), resumed)
    sample = StepSample(step=41, loss=2.5000001, grad_norm=1.0, first_sample=640)
    effects = decide(view(run(), history), obs(recent=(sample,), expected_first=(41, 2.5)), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.CHECKPOINT and fault.step == 40
    assert "resume diverged: step 41 after resuming from step 40 has loss 2.5000001" in fault.summary
    assert not of(decide(view(run(), history), obs(recent=(replace(sample, loss=2.5),), expected_first=(41, 2.5)),
                         NOW), RecordFault), "the same loss: the checkpoint held what was saved"
    assert not of(decide(view(run(), history), obs(recent=(sample,)), NOW), RecordFault), "nothing to compare"


def test_a_node_agents_last_will_is_its_nodes_loss_at_once_for_ranks_that_say_nothing() -> None:
    """The train.sh case on Slurm: a [command] trainer's ranks are UNKNOWN to the launcher
    and send nothing. n1 dies; its agent's last will arrives (the observer makes it the
    will of n1's silent ranks, and n1's node_up False) while n2's torchrun exits 1 on the
    loss of its peer. Slurm still holds n1 (SlurmdTimeout is minutes away): the agent's
    word is enough, with no wait for the cluster's."""
    gone = [rank(r, ProcState.UNKNOWN, lost=True, node_up=False, node_seen_at=NOW - 6, dead_since=NOW - 5)
            for r in (0, 1)]
    peers = [rank(r, ProcState.EXITED, exit_code=1, node_up=True, node_seen_at=NOW - 0.5, dead_since=NOW - 4)
             for r in (2, 3)]
    effects = decide(view(run(), (attempt(),)), obs(*gone, *peers, unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",) and fault.ranks == (0, 1)
    assert fault.summary.endswith("(ranks 0, 1), and its node agent went with them: node lost"), fault.summary
    [drain] = of(effects, DrainNode)
    assert drain.node == "n1" and "its node agent went with them (run-7" in drain.reason, drain.reason
    # Without an agent's word the same deaths wait for the cluster (the test above).
    silent = [replace(r, lost=False, node_up=None, node_seen_at=None, dead_since=None) for r in gone]
    bare = [replace(r, node_up=None, node_seen_at=None) for r in peers]
    assert not of(decide(view(run(), (attempt(),)), obs(*silent, *bare, unheard=True), NOW), RecordFault)


def test_a_node_whose_agent_falls_silent_is_lost_for_a_trainer_that_says_nothing() -> None:
    """A [command] trainer's ranks are never heard; only the agents are. n1's agent silent
    past silence_timeout_s (10 s) while n2's is heard: n1 is lost (cut off, frozen), and the
    reason names the agent. Under the limit, nothing yet."""
    ranks = [rank(r, ProcState.UNKNOWN, node_seen_at=NOW - (12 if r < 2 else 0.5)) for r in range(4)]
    effects = decide(view(run(), (attempt(),)), obs(*ranks, unheard=True), NOW)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",)
    assert "its agent and every rank" in fault.summary
    [drain] = of(effects, DrainNode)
    assert drain.node == "n1" and "no heartbeat from its agent or any rank for 12 s" in drain.reason
    early = [replace(r, node_seen_at=NOW - 8) if r.rank < 2 else r for r in ranks]
    assert not of(decide(view(run(), (attempt(),)), obs(*early, unheard=True), NOW), RecordFault)
    # Every agent silent at once is the broker or the link, not the nodes.
    all_quiet = [replace(r, node_seen_at=NOW - 12) for r in ranks]
    assert not of(decide(view(run(), (attempt(),)), obs(*all_quiet, unheard=True), NOW), DrainNode)


def test_peers_dying_after_a_node_fell_silent_wait_for_its_silence_to_be_judged() -> None:
    """n1 is cut off (its agent unheard for 6 s); then n2's ranks exit 1 (their peer is
    gone). Blaming n2 now would drain nothing and keep n1: the deaths wait, up to
    silence_timeout_s, and n1's silence, once past the limit, is the fault."""
    quiet = [rank(r, ProcState.UNKNOWN, node_seen_at=NOW - 6) for r in (0, 1)]
    peers = [rank(r, ProcState.EXITED, exit_code=1, node_seen_at=NOW - 0.5, dead_since=NOW - 3) for r in (2, 3)]
    assert not of(decide(view(run(), (attempt(),)), obs(*quiet, *peers, unheard=True), NOW), RecordFault)
    later = NOW + 5
    quiet = [replace(r, node_seen_at=NOW - 6) for r in quiet]
    peers = [replace(r, node_seen_at=later - 0.5) for r in peers]
    effects = decide(view(run(), (attempt(),)), obs(*quiet, *peers, unheard=True), later)
    [fault] = of(effects, RecordFault)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n1",)
    assert [d.node for d in of(effects, DrainNode)] == ["n1"]
    # A node whose own ranks died is silent because they did: no wait for it.
    crashed = [rank(r, ProcState.EXITED, exit_code=1, last_seen_at=NOW - 6, dead_since=NOW - 3) for r in (0, 1)]
    heard = [rank(r, last_seen_at=NOW - 0.5) for r in (2, 3)]
    [fault] = of(decide(view(run(), (attempt(),)), obs(*crashed, *heard), NOW), RecordFault)
    assert fault.kind is FaultKind.RANK_EXIT
