"""The decision core: every rule that decides what happens to a run or a node.

``decide(view, obs, now)`` takes one run's recorded state (``RunView``), what was
observed of its live attempt this tick (``AttemptObs``), and the time, and returns the
effects to persist and carry out. For nodes, ``judge_probes`` judges a finished round of
probe results and ``node_command`` an operator's drain, undrain or probe (nodes.py; the
reconciler calls them). Nothing here does I/O or reads a clock (import-linter checks it:
``make lint``), so every rule is unit-tested with plain values.

    lifecycle.py    decide(): operator commands, stopping, judging the live attempt
    detection.py    deaths, NaN, spikes, silent nodes, hangs, stragglers
    attribution.py  whom a fault blames, which nodes it drains, the drain budget, lemons
    recovery.py     the next attempt: placement, resume point, rollback, shrinking and growing
                    back, probes before a launch
    budget.py       when a run stops trying (failures without progress, crash loops, fault
                    rate), and the backoff
    trainer_inputs.py  what the next attempt's trainer is told: its data step ({skip_to_step})
                    and the "auto" checkpoint intervals (Young/Daly from what the run measured)
    memory.py       whether the next attempt's nodes still hold the in-memory save
    slowdown.py     a run slowed as a whole against its own first steps (a slow link): stopped
                    after its next checkpoint so that the diagnosis probes its nodes
    nodes.py        judge_probes(), node_command(): probes, lemons' return, operators' drains and probes
    transitions.py  the table of run and attempt states; an illegal change raises

Run transitions (state, condition -> next state: effects):

    any             the cluster does not answer  -> (same): nothing at all this tick
    not terminal    the stored spec no longer validates -> FAILED: FinishRun
    any active, PAUSED  cancel command       -> CANCELLED:   StopAttempt
    any active      pause command            -> PAUSED:      StopAttempt
    not active (paused or over) with a live attempt -> (same): StopAttempt
    PAUSED, FAILED  resume command           -> PENDING     (the budget starts afresh)
    PAUSED          nodes idle pause_release_s -> (same):    ReleaseNodes(park): the nodes go back,
                                                the job waits held in the queue, and a resume
                                                goes on in it (its id kept)
    STARTING, RUNNING, RECOVERING with a live attempt
                    restart command          -> RECOVERING:  StopAttempt (not a failure: no budget)
    PENDING, STARTING, RECOVERING with no live attempt:
                    nodes being probed       -> (same): nothing until their results are in
                    a stop rule holds        -> FAILED (crash loop, faults too frequent,
                                                failures without progress: recovery.py)
                    a backoff is due         -> (same): nothing until it has passed
                    fewer healthy nodes than needed -> (same):  AllocateNodes
                    ... for shrink_after_s since the last attempt ended (or it ran shrunk)
                                             -> STARTING:    StartAttempt on fewer nodes (run.shrunk)
                    otherwise                -> STARTING:    StartAttempt (resume point: recovery.py)
                                                (STARTING and RECOVERING stay as they are)
    STARTING, RUNNING, RECOVERING with a live attempt:
                    the launch failed        -> RECOVERING:  RecordFault, EndAttempt
                    ... the command cannot be executed -> FAILED (no restart would run it)
                    a LAUNCHING attempt with no process, or only some (daemon killed mid-launch)
                                             -> (same):      KillOrphans (those found), EndAttempt ABORTED
                    first step seen          -> RUNNING:     MarkAttemptRunning, MarkFaultsRecovered
                    result written, ranks gone, no NaN said -> SUCCEEDED: EndAttempt, FinishRun
                    a fault                  -> RECOVERING:  RecordFault, StopAttempt, DrainNode*
                                                (over the drain budget: ProbeNodes), SkipData
                    a fault, an exit code the trainer declares do-not-retry or
                    storage-full (the reference trainer: 2, 5; RunView.exit_codes)
                                             -> FAILED:     RecordFault, StopAttempt (do not retry)
                    the cluster ended the allocation -> RECOVERING: the attempt ends INTERRUPTED
                    a straggler with straggler_restart and a free spare
                                             -> RECOVERING:  RecordFault, StopAttempt
                    slowed as a whole (slowdown_factor), [health] diagnose, a checkpoint
                    since the slowdown committed -> RECOVERING: RecordFault, StopAttempt
    RUNNING on fewer nodes than the run's
                    missing nodes held, a checkpoint of its own committed
                                             -> RECOVERING:  StopAttempt INTERRUPTED (run.grow)
                    missing nodes not held   -> (same):      AllocateNodes

Attempts: LAUNCHING -> RUNNING (processes exist: started, or adopted after a daemon
restart) -> STOPPING (StopAttempt) -> ENDED (EndAttempt, once no process of it is left,
or abandoned with its nodes drained when processes outlive SIGKILL by
``abandon_after_s``); a launch that failed or never happened goes from LAUNCHING to
ENDED. With ``[health] preflight`` the nodes a run just got, and with ``[health]
diagnose`` a FAILED attempt's nodes that the run still holds, are probed (ProbeNodes)
before the next launch. A terminal run with no live attempt gives its nodes back
(ReleaseNodes); a FAILED one keeps its job parked (``park``: held in the queue with no
node) for a resume to go on in, and a SUCCEEDED or CANCELLED one gives a parked job up.

Attribution (attribution.py): a node is drained only on evidence about the node itself:
every rank of it vanished at once, and the cluster took it out of the allocation or
its own process died with them (where the launcher watches one; elsewhere, at least two
of its processes at once: one process SIGKILLed alone, the only rank of a node, is that
process's fault, not the node's; but a run's only node, its every rank gone with its
agent's last will, is lost, never a hang nor a network cut: one node has no peer whose
word could tell a cut from a death; and a node whose ranks and agent ended in the moment
the cluster took out another node of the attempt went with that node's steps, not of its
own failure), or it fell silent while the others are heard, or its
device failed (an exit code its trainer declares a device fault, the reference
trainer's 4, or a device error in its output), or a probe confirmed it bad, or it is a
lemon (blamed in ``lemon_faults`` distinct faults within ``lemon_window_s``). The drain
budget: a fault that would drain more than ``drains_per_fault`` nodes, or take the run
past ``drains_per_window`` within ``drain_window_s``, drains none of them and probes
them instead (so many at once is the network's or the trainer's text, not the nodes'),
except the nodes the cluster itself took out, drained whatever the budget. A straggler
is reported, and left out of the next attempt when a spare can take its place; only
``straggler_restart`` makes it a fault.
"""

from supervisor.policy.budget import backoff
from supervisor.policy.data_steps import data_step, skip_to
from supervisor.policy.detection import (
    find_spike,
    find_stragglers,
    hang_limit,
    stalled_first,
    transient_spikes,
)
from supervisor.policy.lifecycle import decide
from supervisor.policy.recovery import resume_before, skip_window, unreadable_checkpoints

__all__ = [
    "backoff",
    "data_step",
    "decide",
    "find_spike",
    "find_stragglers",
    "hang_limit",
    "resume_before",
    "skip_to",
    "skip_window",
    "stalled_first",
    "transient_spikes",
    "unreadable_checkpoints",
]
