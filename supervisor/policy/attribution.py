"""Attribution: which ranks and nodes a fault blames, and which nodes it drains.

The rules (the header of supervisor/policy/__init__.py lists them all):

- a node is lost (blamed, and drained) only on evidence about the node itself: EVERY
  rank on it vanished abruptly in the same observation (killed by SIGKILL, or gone with
  no exit report of its own), and the cluster took the node out of the allocation while
  keeping the attempt's others, or the node's own process died with them (the launcher
  watches one: ``RankObs.node_up`` False), or the cluster declared the node down
  (``RankObs.node_down``: Slurm's DOWN, the only word a node that lost its power leaves;
  its silent ranks count as vanished then), or, where nothing watches the node itself, at
  least two of its processes (its ranks, each a process) vanished together. A node
  whose only word is the end of its ranks and its agent, at the moment the cluster took
  out or declared down another node of the attempt, is not lost: the trainer's ranks and
  the agents are each one Slurm step across the nodes, and the other node's failure
  ended both everywhere. One process
  killed alone (the only rank of a node, a node's torchrun with its one worker) is that
  process's fault: blamed, never drained, and so is any death on a node whose own
  process lives on. One rank's crash never drains a node;
- a node the run no longer holds (the cluster ended or shrank the allocation) is not
  blamed; when the cluster took every node, the attempt was interrupted, not failed.
  But a node that failed on its own word (its agent or its own process died with its
  ranks) is lost whether the allocation holds it or not: a one-node allocation ends
  with its only node;
- a run's only node lost is a node loss (blamed, drained, handed to the cluster's repair
  where it has one), never a hang nor a cut: last wills from every node at once are the
  network's only where there are two nodes or more to tell a cut from a death
  (``cut_off_together``); one node's will is its own, as one rank's SIGKILL alone is
  that rank's (the rule above);
- a rank the launcher cannot see (UNKNOWN: a Slurm step's rank) is dead when its last
  will arrived or it reported a failed exit, and gone when it reported any exit;
- trainer exit codes with a meaning: 2 do not retry, 3 the checkpoint it resumed from is
  unreadable, 4 its device failed (drain its node), 5 checkpoint storage full;
- otherwise the fault blames the ranks that died first: those killed by a signal or
  gone without a report; failing that, the earliest self-reported exit;
- a node blamed in ``lemon_faults`` distinct faults (of any run) within
  ``lemon_window_s`` is a lemon, and drained.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from supervisor.domain import (
    Attempt,
    AttemptObs,
    ExitMeaning,
    FaultKind,
    NodeState,
    ProcState,
    RankObs,
    RecordFault,
    RunView,
    run_id_of,
)


@dataclass(frozen=True, slots=True)
class Finding:
    """A fault found in the live attempt: what to record, whom to drain, and how it ends."""

    record: RecordFault
    drains: list[tuple[str, str]] = field(default_factory=list)  # (node, Reason)
    do_not_retry: bool = False
    interrupted: bool = False  # the cluster took the nodes away: not a failure


def attribute(view: RunView, live: Attempt, ranks: Iterable[RankObs], dead: list[RankObs],
              step: int) -> Finding:
    by = by_node(ranks)
    # A node the run no longer holds (Slurm ended the allocation: preemption, a time
    # limit, scancel) is not to blame: its ranks died because the allocation did. One
    # that left while the allocation keeps other nodes failed (Slurm shrinks a --no-kill
    # job by its dead nodes): still that node's fault.
    held = held_nodes(view, live)
    dropped = dropped_nodes(view, live)
    # A node that failed on its own word (its agent or its own process went with its
    # ranks) is lost even when the allocation went with it: a one-node allocation's only
    # node ends the allocation by dying.
    failed = {n for n, rs in by.items() if n not in held and any(r.node_up is False for r in rs)}
    lost_nodes = sorted(n for n, rs in by.items() if (n in held or n in failed)
                        and node_lost(rs, dropped=n in dropped))
    # The trainer's ranks and the node agents are each one Slurm step across the
    # attempt's nodes: a node the cluster took out (or says is down) ends both on every
    # node. Another node's ranks and agent that went at the same time say nothing
    # against their own node.
    if any(n in dropped or any(r.node_down for r in by[n]) for n in lost_nodes):
        lost_nodes = [n for n in lost_nodes if n in dropped or not _only_its_steps_went(by[n])]
    released = sorted(n for n in by if n not in held and n not in failed)
    # What the trainer means by an exit code: only what its spec declares (view.exit_codes).
    def meaning(r: RankObs) -> ExitMeaning | None:
        code = exit_code(r)
        return None if code is None else view.exit_codes.get(code)

    refused = [r for r in dead if meaning(r) is ExitMeaning.DO_NOT_RETRY]
    do_not_retry = bool(refused)
    where = f"{view.run.run_id}, attempt {live.number}, step {step}"

    if lost_nodes:
        blamed = [r for r in dead if r.node in lost_nodes]
        evidence = {n: node_lost_evidence(by[n], dropped=n in dropped) for n in lost_nodes}
        said = "; ".join(dict.fromkeys(evidence.values()))
        summary = (f"every rank of node {', '.join(lost_nodes)} vanished at once "
                   f"(ranks {ranks_text(blamed)}), and {said}: node lost")
        record = RecordFault(kind=FaultKind.NODE_LOST, attempt=live.number, nodes=tuple(lost_nodes),
                             ranks=tuple(r.rank for r in blamed), summary=summary, step=step)
        drains = [(n, f"training-supervisor: node lost, all its ranks vanished at once, and {evidence[n]} "
                      f"({where})"[:500]) for n in lost_nodes]
        return Finding(record, drains, do_not_retry)

    # The trainer's own word that a device failed (its exit code, or a device error in its
    # output: supervisor/gathering/output_progress.py) is evidence enough to drain.
    broken = [r for r in dead if meaning(r) is ExitMeaning.DEVICE or r.fatal_kind == "device"]
    if broken:
        code = exit_code(broken[0])
        nodes = sorted({r.node for r in broken if r.node in held})
        drains = []
        for n in nodes:
            words = ("; ".join(r.reported_reason or r.fatal_line for r in broken if r.node == n)
                     or f"exit code {code}")
            why = f"training-supervisor: device fault reported by the trainer: {words} ({where})"
            drains.append((n, why[:500]))
        summary = f"device fault (exit code {code}): " + "; ".join(
            describe_exit(r) + (f", after printing: {r.fatal_line}" if r.fatal_line else "") for r in broken)
        record = RecordFault(kind=FaultKind.DEVICE, attempt=live.number, ranks=tuple(r.rank for r in broken),
                             nodes=tuple(nodes), summary=summary, step=step)
        return Finding(record, drains)
    # An error of the job's own configuration (supervisor/gathering/output_progress.py): every
    # attempt would print it again, so the run ends at the first, in the trainer's words.
    misconfigured = [r for r in dead if r.fatal_kind == "config"]
    if misconfigured:
        first_said = misconfigured[0]
        summary = (f"the trainer's configuration cannot run: {describe_exit(first_said)} after printing: "
                   f"{first_said.fatal_line}; fix the job, then resume the run")
        record = RecordFault(kind=FaultKind.CONFIG, attempt=live.number, nodes=(), summary=summary,
                             ranks=tuple(r.rank for r in misconfigured), step=step)
        return Finding(record, do_not_retry=True)
    full = [r for r in dead if meaning(r) is ExitMeaning.STORAGE_FULL]
    if full:  # every later save would fail the same way: stop, keep what is saved, say why
        summary = (f"checkpoint storage full (exit code {exit_code(full[0])}): {describe_exit(full[0])}; "
                   "free space, then resume the run")
        record = RecordFault(kind=FaultKind.STORAGE, attempt=live.number, ranks=tuple(r.rank for r in full),
                             nodes=(), summary=summary, step=step)
        return Finding(record, do_not_retry=True)
    unreadable = [r for r in dead if meaning(r) is ExitMeaning.CHECKPOINT_UNREADABLE]
    if unreadable and live.resume_from is not None:
        summary = (f"the checkpoint at step {live.resume_step} cannot be read "
                   f"({describe_exit(unreadable[0])}): resuming from an older one")
        return Finding(RecordFault(kind=FaultKind.CHECKPOINT, attempt=live.number, nodes=(), summary=summary,
                                   ranks=tuple(r.rank for r in unreadable), step=live.resume_step))

    first = _died_first(dead)
    summary = "; ".join(describe_exit(r) for r in first)
    if len(dead) > len(first):
        summary += f" (then {len(dead) - len(first)} more rank(s) exited)"
    # An error that names no device (NCCL's, a hang in Neuron collectives) points at the
    # node that printed it first, without proof against it: it is blamed, not drained.
    printed = next((r for r in dead if r.fatal_kind == "peer"), None)
    blamed_nodes = {r.node for r in first}
    if printed is not None:
        summary += f"; rank {printed.rank} on {printed.node} printed: {printed.fatal_line}"
        blamed_nodes.add(printed.node)
    if released and len(released) == len(by) and not do_not_retry:
        summary = (f"the cluster ended the allocation under the attempt (nodes {', '.join(released)} "
                   f"released): {summary}")
        return Finding(RecordFault(kind=FaultKind.ALLOCATION_ENDED, attempt=live.number, ranks=(), nodes=(),
                                   summary=summary, step=step), interrupted=True)
    if do_not_retry:
        summary = f"trainer reported a configuration error (exit code {exit_code(refused[0])}): {summary}"
    record = RecordFault(kind=FaultKind.RANK_EXIT, attempt=live.number, ranks=tuple(r.rank for r in first),
                         nodes=tuple(sorted(blamed_nodes)), summary=summary, step=step)
    return Finding(record, do_not_retry=do_not_retry)


def within_budget(view: RunView, live: Attempt, drains: list[tuple[str, str]],
                  now: float) -> tuple[list[tuple[str, str]], list[str]]:
    """The drains a fault may make, and the nodes it holds back (to be probed). A node the
    cluster itself took out of the allocation is drained whatever the budget (the cluster's
    word); the others only while the fault drains at most ``drains_per_fault`` and the run's
    drains within ``drain_window_s`` stay within ``drains_per_window`` (every node a NODE_LOST
    or DEVICE fault named counts: a held-back one too, so a flood never pays)."""
    policy = view.run.policy
    dropped = dropped_nodes(view, live)
    cluster_says = [d for d in drains if d[0] in dropped]
    ours = [d for d in drains if d[0] not in dropped]
    draining = (FaultKind.NODE_LOST, FaultKind.DEVICE)
    recent = sum(len(f.nodes) for f in view.faults
                 if f.kind in draining and now - f.detected_at <= policy.drain_window_s)
    if len(ours) > policy.drains_per_fault or recent + len(ours) > policy.drains_per_window:
        return cluster_says, sorted({n for n, _ in ours})
    return drains, []


def node_lost(ranks: list[RankObs], *, dropped: bool = False) -> bool:
    """The node of ``ranks`` (every rank on it) is gone: they all vanished abruptly, and
    something beyond one process says the node went with them (the module docstring):
    the cluster took it out of the allocation (``dropped``), its own process died, or,
    where nothing watches it, at least two of its processes vanished together."""
    if not all(vanished_abruptly(r) for r in ranks):
        return False
    if dropped:
        return True
    watched = {r.node_up for r in ranks} - {None}
    if watched:
        return False in watched
    return len(_processes(ranks)) >= 2


def _only_its_steps_went(ranks: list[RankObs]) -> bool:
    """The only word against the node of ``ranks`` is the end of its ranks and its agent
    (the steps'): the cluster does not say it is down, and no process the launcher
    watches for the node itself was seen to die."""
    return (not any(r.node_down for r in ranks)
            and all(r.node_seen_at is not None for r in ranks if r.node_up is False))


def _processes(ranks: list[RankObs]) -> set[object]:
    """The distinct processes ``ranks`` ran in (a node's torchrun for all of its ranks, or
    each rank its own)."""
    return {r.process if r.process is not None else ("rank", r.rank) for r in ranks}


def node_lost_evidence(ranks: list[RankObs], *, dropped: bool = False) -> str:
    """What beyond its ranks says the node of ``ranks`` went (``node_lost`` held): the
    words a fault and a drain give for it."""
    if dropped:
        return "the cluster took it out of the allocation"
    said = next((r.node_down for r in ranks if r.node_down), "")
    if said:
        return f"the cluster says the node is down: {said}"
    if any(r.node_up is False and r.node_seen_at is not None for r in ranks):
        return "its node agent went with them"
    if any(r.node_up is False for r in ranks):
        return "the node's own process died with them"
    return f"{len(_processes(ranks))} of its processes vanished together"


def dropped_nodes(view: RunView, live: Attempt) -> set[str]:
    """The attempt's nodes the cluster took out of the allocation while it keeps the
    attempt's others (Slurm drops a --no-kill job's failed nodes): the cluster's word that
    the node failed. None when it took them all (an allocation ended: nobody's fault)."""
    held = {n.name for n in view.allocation if n.state is NodeState.ALLOCATED}
    return set(live.nodes) - held if held & set(live.nodes) else set()


def held_nodes(view: RunView, live: Attempt) -> set[str]:
    """The nodes the run holds, as far as judging the live attempt goes: all of its nodes
    while the allocation keeps any node (Slurm shrinks a --no-kill job by its failed nodes
    only; an allocation that ended keeps none)."""
    held = {n.name for n in view.allocation if n.state is NodeState.ALLOCATED}
    return held | set(live.nodes) if held else held


def with_failed_nodes(view: RunView, live: Attempt, obs: AttemptObs, now: float) -> AttemptObs:
    """Ranks whose processes the launcher cannot see, on a node the cluster says is down
    (``node_down``: a node that lost its power sends no last will), or, for ranks never
    heard on telemetry (a [command] trainer's on Slurm), on a node the allocation lost
    while it keeps others (the attempt's, or a spare: a one-node attempt has no peer to
    outlive it): the cluster's word that the node died is their last will."""
    held = {n.name for n in view.allocation if n.state is NodeState.ALLOCATED}
    # Heard ranks speak for themselves; the whole allocation going is an interruption.
    dropped = obs.unheard and bool(held)

    def failed(r: RankObs) -> bool:
        return r.proc is ProcState.UNKNOWN and (bool(r.node_down) or (dropped and r.node not in held))

    if not any(failed(r) for r in obs.ranks):
        return obs
    return replace(obs, ranks=tuple(
        replace(r, proc=ProcState.VANISHED, lost=True, dead_since=r.dead_since or now) if failed(r) else r
        for r in obs.ranks))


def _died_first(dead: list[RankObs]) -> list[RankObs]:
    """Of those killed, the ones seen dead first; failing that, the earliest self-reported exit."""
    killed = [r for r in dead if vanished_abruptly(r) or (exit_code(r) or 0) < 0]
    if killed:
        def seen(r: RankObs) -> float:
            return r.dead_since if r.dead_since is not None else math.inf

        t0 = min(seen(r) for r in killed)
        return [r for r in killed if seen(r) == t0]
    reported = [r for r in dead if r.reported_exit_at is not None]
    if reported:
        t0 = min(r.reported_exit_at for r in reported if r.reported_exit_at is not None)
        return [r for r in reported if r.reported_exit_at == t0]
    return dead


def lemons(view: RunView, record: RecordFault, draining: set[str], now: float) -> list[tuple[str, str]]:
    """Nodes that the new fault blames and that were blamed in enough other faults lately.

    One attempt's fault proves little about a node (a rank crash may be the code's), but a
    node that keeps turning up in faults of different steps and runs is a lemon. A fault
    repeating at the same step of the same run (a crash loop) counts once: it follows the
    step, not the node."""
    policy = view.run.policy
    since = now - policy.lemon_window_s
    out = []
    for node in record.nodes:
        if node in draining:
            continue
        blamed = [f for f in view.cluster_faults if node in f.nodes and f.detected_at >= since]
        distinct = {(f.run_number, f.kind, f.step): f for f in blamed}
        distinct.pop((view.run.number, record.kind, record.step), None)
        if len(distinct) + 1 < policy.lemon_faults:
            continue
        earlier = "; ".join(f"{run_id_of(f.run_number)} {f.kind} at step {f.step}"
                            for f in sorted(distinct.values(), key=lambda f: f.detected_at))
        hours = policy.lemon_window_s / 3600
        out.append((node, f"training-supervisor: lemon: blamed in {len(distinct) + 1} faults in {hours:g} h "
                          f"({earlier}; now {record.kind} at step {record.step}) ({view.run.run_id})"))
    return out


# --- what a rank's observation says ------------------------------------------------


def exit_code(r: RankObs) -> int | None:
    return r.exit_code if r.exit_code is not None else r.reported_exit_code


def gone(r: RankObs) -> bool:
    """The rank's process has ended. When the launcher cannot see it (UNKNOWN: a Slurm
    step's rank, whose step may linger in Slurm until a dead node is declared down,
    SlurmdTimeout later), its own exit report or its last will says so."""
    if r.proc in (ProcState.EXITED, ProcState.VANISHED):
        return True
    return r.proc is ProcState.UNKNOWN and (r.lost or r.reported_exit_code is not None)


def is_dead(r: RankObs) -> bool:
    """Died unsuccessfully. A clean exit 0 is not a death; UNKNOWN is never a death
    unless the rank's last will says its connection broke or it reported a failed exit."""
    if r.proc is ProcState.EXITED:
        return r.exit_code != 0
    if r.proc is ProcState.VANISHED:
        return r.reported_exit_code != 0
    if r.proc is ProcState.UNKNOWN:
        # The launcher cannot see the process (a Slurm step's ranks): the rank's own
        # exit report, or its last will, is the evidence.
        return r.lost or (r.reported_exit_code is not None and r.reported_exit_code != 0)
    return False


def vanished_abruptly(r: RankObs) -> bool:
    """Killed outright: SIGKILL seen, or its connection died with no exit report.

    A VANISHED rank (adopted after a daemon restart, so no exit code) counts only with
    its last will as evidence: ranks that ended while the daemon was down left no
    trace of how, and that is no reason to drain their nodes.
    """
    if r.proc is ProcState.EXITED:
        return r.exit_code == -signal.SIGKILL
    if r.proc in (ProcState.VANISHED, ProcState.UNKNOWN):
        return r.lost and r.reported_exit_code is None
    return False


def cut_off_together(ranks: Iterable[RankObs]) -> bool:
    """Last wills from every node of an attempt of two nodes or more, and nothing else
    says a rank ended (no exit code, no exit report, no process seen to end): the ranks
    lost the broker together, which is the network or the broker, and no evidence against
    any node. A node that really died leaves its ranks' processes to say so (Slurm ends
    its step). An attempt of one node has no other node whose word could tell a cut from
    a death: its node's will is its loss (the module docstring)."""
    by = by_node(ranks)
    ended = (ProcState.EXITED, ProcState.VANISHED)
    if len(by) < 2:
        return False
    if any(r.proc in ended or r.reported_exit_code is not None for rs in by.values() for r in rs):
        return False
    return all(any(r.proc is ProcState.UNKNOWN and r.lost for r in rs) for rs in by.values())


def describe_exit(r: RankObs) -> str:
    who = f"rank {r.rank} (node {r.node})"
    code = exit_code(r)
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"{who} killed by {name}"
    if code is not None:
        text = f"{who} exited with code {code}"
        return f"{text}: {r.reported_reason}" if r.reported_reason else text
    return f"{who} vanished without an exit report"


def by_node(ranks: Iterable[RankObs]) -> dict[str, list[RankObs]]:
    out: dict[str, list[RankObs]] = {}
    for r in ranks:
        out.setdefault(r.node, []).append(r)
    return out


def numbers_text(numbers: Iterable[int]) -> str:
    return ", ".join(str(n) for n in sorted(numbers))


def ranks_text(rs: Iterable[RankObs]) -> str:
    return numbers_text(r.rank for r in rs)


def all_gone(obs: AttemptObs | None) -> bool:
    if obs is None:
        return False
    return obs.never_started or all(gone(r) for r in obs.ranks)
