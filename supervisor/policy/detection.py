"""Detection: what is wrong with the live attempt, from one tick's observation.

In the order they are judged (the first that holds is the fault):

- a rank died (``attribute`` says whom it blames), once every rank is gone or
  ``fault_settle_s`` after the first death was seen: processes of one node killed
  together are not reaped together; while ranks nothing can see remain (no telemetry,
  unknown to the launcher, no node agent heard), up to ``silence_timeout_s``, for the
  cluster to say whether their node died (``with_failed_nodes``). A node that fell
  silent before the deaths (cut off, frozen: its peers die of it) is judged first, by
  the silence rule below, waiting up to ``silence_timeout_s`` for it. A trainer whose
  output is read (a [command] trainer's) is judged no sooner than the tick after the
  death was first seen: its output is read at the start of a tick, before its processes
  are looked at, so the lines a rank printed as it died are in only at the next;
- a resumed trainer whose first step is not after the checkpoint it resumed from (it
  did not load it, or loaded another): the run fails, never retried from step zero;
- a resumed reference trainer whose first step's loss differs from the one reported for
  that step before (its steps are deterministic): that checkpoint is not what was saved;
- a loss or grad norm that is not finite;
- a loss or grad-norm spike that has lasted ``spike_persist_steps`` steps;
- a node silent for ``silence_timeout_s`` (neither its agent nor any of its ranks heard)
  while other nodes are heard;
- every rank exited 0 and no result was written;
- no step progress, and no phase begun or ended, for ``hang_limit`` (never while the
  broker link is down).

The network is not the nodes: last wills from every node of an attempt of two or more
at once (``cut_off_together``) are not deaths (one node's are: attribution.py), and while
no rank of an attempt whose processes the launcher cannot see (Slurm steps) has been heard
for ``STALL_GAP_S``, no hang is judged, for at most ``hang_timeout_s``: the ranks lost the
broker together (a partition between the nodes and the controller, a stalled broker),
which says nothing of the nodes or of training. Once they are heard again the usual rules
judge them.

Stragglers are found here too (``find_stragglers``); what is done about them is the
recovery module's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import median, median_low

from supervisor.domain import (
    Attempt,
    AttemptObs,
    FaultKind,
    Policy,
    ProcState,
    RankObs,
    RecordFault,
    RunView,
    StepSample,
)
from supervisor.policy.attribution import (
    Finding,
    all_gone,
    attribute,
    by_node,
    cut_off_together,
    gone,
    held_nodes,
    is_dead,
    ranks_text,
)
from supervisor.policy.resumes import resume_diverged, wrong_resume


def find_fault(view: RunView, live: Attempt, obs: AttemptObs, now: float) -> Finding | None:
    step = max((r.last_step for r in obs.ranks), default=live.resume_step)
    dead = [r for r in obs.ranks if is_dead(r)]
    if dead and cut_off_together(obs.ranks):
        dead = []  # the network or the broker, not the nodes (see the module docstring)
    # A trainer that did not load its checkpoint: why it died too, most likely; a retry would do the same.
    wrong = wrong_resume(live, obs, view.resume_advice)
    if dead:
        first_seen = min(r.dead_since if r.dead_since is not None else now for r in dead)
        if obs.output_read and first_seen >= now:
            return None  # what it printed as it died is read at the next tick's start: judged then
        if wrong is not None:
            return wrong
        if now - first_seen < view.run.policy.fault_settle_s and not all_gone(obs):
            return None  # let ranks that die together (a node) show themselves first
        silent = _find_silent_node(view, live, obs, now, step)
        if silent is not None:
            return silent  # the node that fell silent is why its peers died
        if _silent_before(obs, now) and now - first_seen < view.run.policy.silence_timeout_s:
            return None  # a node went quiet before these deaths: its silence is judged first
        unseen = obs.unheard and any(r.proc is ProcState.UNKNOWN and r.node_seen_at is None
                                     for r in obs.ranks)
        if unseen and now - first_seen < view.run.policy.silence_timeout_s:
            # Ranks nothing can see (a [command] trainer's on Slurm, with no node agent heard)
            # may have died with their node, the others of its peers' loss: give the cluster
            # time to say which. A node agent's word (its reports, its last will) says it now.
            return None
        return attribute(view, live, obs.ranks, dead, step)
    wrong = wrong or resume_diverged(live, obs)
    if wrong is not None:
        return wrong
    # A precompile pass's losses are not a model's (its graphs run on placeholder data).
    poisoned = [r for r in obs.ranks if r.nonfinite_step is not None] if live.precompile is None else []
    if poisoned:
        at = min(r.nonfinite_step for r in poisoned if r.nonfinite_step is not None)
        again = any(f.kind is FaultKind.NONFINITE and f.step == at and f.attempt < live.number
                    for f in view.faults)
        summary = (f"loss or grad norm not finite at step {at} (ranks {ranks_text(poisoned)}): rolling back "
                   f"to the newest checkpoint before step {at}"
                   + ("; again at this step: skipping its data" if again else ""))
        return Finding(RecordFault(kind=FaultKind.NONFINITE, attempt=live.number, ranks=(), nodes=(), step=at,
                                   summary=summary))
    spike = find_spike(obs.recent, view.run.policy, skips=view.data_skip_unit is not None) \
        if live.precompile is None else None
    if spike is not None and not spike_rolled_back(view, live):
        return Finding(RecordFault(kind=FaultKind.SPIKE, attempt=live.number, ranks=(), nodes=(),
                                   step=spike.step, summary=spike.summary))
    silent = _find_silent_node(view, live, obs, now, step)
    if silent is not None:
        return silent
    if obs.ranks and all(r.proc in (ProcState.EXITED, ProcState.VANISHED) for r in obs.ranks):
        return Finding(RecordFault(kind=FaultKind.NO_RESULT, attempt=live.number, ranks=(), nodes=(),
                                   step=step, summary="every rank exited 0 but the trainer wrote no result"))
    return _find_hang(view, live, obs, now, step)


# --- silence and hangs --------------------------------------------------------------


def _find_silent_node(view: RunView, live: Attempt, obs: AttemptObs, now: float, step: int) -> Finding | None:
    """A node silent past the limit (no word from its agent or from any of its ranks)
    while other nodes are heard. A node agent (node/agent.py) makes this hold for
    trainers that say nothing themselves (a [command] trainer's).

    Judged only while the supervisor's own broker link has been up for longer than the
    limit (after a reconnect, heartbeats need time to arrive again), and never when
    every node is silent: that is the broker or the link, not the nodes.
    """
    limit_s = view.run.policy.silence_timeout_s
    if obs.telemetry_up_since is None or now - obs.telemetry_up_since <= limit_s:
        return None

    def silent(r: RankObs) -> bool:
        heard = r.heard_at
        return (heard is not None and now - heard > limit_s
                and r.reported_exit_code is None and r.proc not in (ProcState.EXITED, ProcState.VANISHED))

    by = by_node(obs.ranks)
    # A node cut off is soon one Slurm stops answering for, and leaves the allocation while
    # the attempt's other nodes stay in it: still that node's fault (held_nodes).
    held = held_nodes(view, live)
    quiet = sorted(n for n, rs in by.items() if n in held and all(silent(r) for r in rs))
    if not quiet or len(quiet) == len(by):
        return None
    blamed = [r for r in obs.ranks if r.node in quiet]
    heard_s = now - max(r.heard_at or now for r in blamed)
    where = f"{view.run.run_id}, attempt {live.number}, step {step}"
    agent = any(r.node_seen_at is not None for r in blamed)
    who = "its agent and every rank" if agent else "every rank"
    summary = (f"node {', '.join(quiet)} silent for {heard_s:.0f} s ({who}) while the others are heard "
               f"(ranks {ranks_text(blamed)}): node lost")
    record = RecordFault(kind=FaultKind.NODE_LOST, attempt=live.number, ranks=tuple(r.rank for r in blamed),
                         nodes=tuple(quiet), summary=summary, step=step)
    why = (f"training-supervisor: node silent, no heartbeat from {'its agent or ' if agent else ''}any rank "
           f"for {heard_s:.0f} s ({where})")
    return Finding(record, [(n, why) for n in quiet])


def hang_limit(policy: Policy, obs: AttemptObs, first_step_seen: bool, *,
               precompile: bool = False, past_last_step: bool = False) -> tuple[float, str]:
    """How long without step progress is a hang (``_limit``); once the run's last step is
    done (``past_last_step``) the trainer winds down (a final save, its process group, its
    results), as slow as a start, so never less than ``startup_timeout_s``: a step time's
    multiple would call a busy node's exit a hang."""
    limit, what = _limit(policy, obs, first_step_seen, precompile=precompile)
    if past_last_step and limit < policy.startup_timeout_s:
        return policy.startup_timeout_s, "finishing allowance (past the last step)"
    return limit, what


def _limit(policy: Policy, obs: AttemptObs, first_step_seen: bool, *, precompile: bool) -> tuple[float, str]:
    """How long without step progress (or a phase's start or end) is a hang, and why that
    long. Every limit follows what this run measured; the constants are for before it has
    measured anything (the header of supervisor/domain/knobs.py says which is which):

    - compiling (Neuron's graphs, a precompile pass), and throughout the job's own
      precompile attempt (``precompile``, supervisor/runfiles/precompile.py): ``compile_timeout_s``;
    - restoring: ``startup_timeout_s``, or ``hang_k`` x its announced bytes at the run's
      measured restore pace (its save pace before a restore was timed) when longer: a
      restore from node memory and one from storage differ by orders of magnitude, so a
      fast one never shortens the next one's limit;
    - before the first step, and in init: ``startup_timeout_s``;
    - in the checkpoint phase (a save, the copy of one, the wait for the previous one):
      ``hang_k`` x the time the save should take (``_expected_save_s``), at least
      ``hang_floor_s``; before any save was timed, ``checkpoint_timeout_s`` or the
      announced bytes at ``checkpoint_min_gb_s`` when longer;
    - evaluating: ``eval_timeout_s``;
    - training, once ``hang_min_samples`` step times are known: max(``hang_floor_s``,
      ``hang_k`` x the p99 step time), however long the steps are; with fewer,
      ``hang_timeout_s`` or ``hang_k`` x the slowest step so far when longer.
    """
    phases = {r.phase for r in obs.ranks}
    k = policy.hang_k
    if precompile or "compile" in phases:
        return max(policy.compile_timeout_s, policy.startup_timeout_s), "compile allowance"
    if "restore" in phases:
        size = _phase_bytes(obs, "restore")
        pace = obs.restore_gb_s or obs.save_gb_s
        if size and pace and k * size / (pace * 1e9) > policy.startup_timeout_s:
            return k * size / (pace * 1e9), f"restore allowance: {k:g} x {_gb(size)} at {pace:.3g} GB/s"
        return policy.startup_timeout_s, "startup allowance"
    if not first_step_seen or "init" in phases:
        return policy.startup_timeout_s, "startup allowance"
    if "checkpoint" in phases:
        size = _phase_bytes(obs, "checkpoint")
        expected = _expected_save_s(obs, size)
        if expected is None:
            floor = size / (policy.checkpoint_min_gb_s * 1e9)
            if floor > policy.checkpoint_timeout_s:
                return floor, f"checkpoint allowance: {_gb(size)} at {policy.checkpoint_min_gb_s:g} GB/s"
            return policy.checkpoint_timeout_s, "checkpoint allowance"
        seconds, how = expected
        return max(policy.hang_floor_s, k * seconds), \
            f"checkpoint allowance: max({policy.hang_floor_s:g} s, {k:g} x {how})"
    if "eval" in phases:
        return policy.eval_timeout_s, "evaluation allowance"
    p99 = obs.step_time_p99_s
    if p99 is not None and obs.step_time_samples >= policy.hang_min_samples:
        limit = max(policy.hang_floor_s, k * p99)
        return limit, (f"adaptive hang timeout: max({policy.hang_floor_s:g} s, {k:g} x p99 step time "
                       f"{p99:.3f} s)")
    if p99 is not None and k * p99 > policy.hang_timeout_s:
        return k * p99, f"hang timeout: {k:g} x the slowest step so far, {p99:.3f} s"
    return policy.hang_timeout_s, "hang timeout"


def _phase_bytes(obs: AttemptObs, phase: str) -> int:
    """The most bytes a rank in ``phase`` said that phase moves (0: none said)."""
    return max((r.phase_bytes for r in obs.ranks if r.phase == phase), default=0)


def _expected_save_s(obs: AttemptObs, size: int) -> tuple[float, str] | None:
    """How long a save of ``size`` bytes (0: not said) should take at this run's pace:
    the bytes at the slowest recent GB/s, and never less than the slowest recent save (the
    size said may be a part of it); None before any save was timed."""
    by_pace = size / (obs.save_gb_s * 1e9) if size and obs.save_gb_s else None
    if by_pace is not None and (obs.save_s is None or by_pace >= obs.save_s):
        assert obs.save_gb_s is not None
        return by_pace, f"{_gb(size)} at {obs.save_gb_s:.3g} GB/s"
    if obs.save_s is not None:
        return obs.save_s, f"slowest save {obs.save_s:.2f} s"
    return None


def _gb(size: int) -> str:
    return f"{size / 1e9:.3g} GB"


def _find_hang(view: RunView, live: Attempt, obs: AttemptObs, now: float, step: int) -> Finding | None:
    """No progress for too long (``hang_limit``), judged only while telemetry flows.

    The clock runs from the newest sign of work: a step, or a rank entering a phase (the
    end of a save is the start of training again; a save that outlasts many steps is no
    stall once it ends). While the broker link is down no verdict is given, and after it
    comes back the clock starts again from the moment it did: a broker outage is never a
    hang. The fault names the ranks that stalled first (``stalled_first``) and their
    nodes, and drains nothing: a stalled rank is no evidence against its node.

    A verdict needs a word heard after the limit passed (a heartbeat, a node report, its
    agent's): the broker hands the daemon its messages in the order it got them, so such a
    word means any progress sent before it has been heard too. A loaded daemon or broker
    hears late, and what it has not heard yet is no stall. With no word at all, the verdict
    comes ``silence_timeout_s`` later.
    """
    if obs.telemetry_up_since is None or live.started_at is None:
        return None
    limit_s, what = hang_limit(view.run.policy, obs, live.first_step_at is not None,
                               precompile=live.precompile is not None,
                               past_last_step=0 < view.run.total_steps <= step)
    progress = [t for r in obs.ranks for t in (r.progress_at, r.phase_at) if t is not None]
    since = max([live.started_at, obs.telemetry_up_since, *progress])
    if live.first_step_at is not None:
        since = max(since, live.first_step_at)
    idle_s = now - since
    if idle_s <= limit_s or _node_going_silent(view, obs, now) or _all_cut_off(view, obs, now):
        return None
    if not _heard_since(obs, since + limit_s) and idle_s <= limit_s + view.run.policy.silence_timeout_s:
        return None  # nothing heard since the limit passed: the word of progress may be on its way
    first = stalled_first(obs.ranks)
    nodes = tuple(sorted({r.node for r in first}))
    who = f"; stalled first: ranks {ranks_text(first)} on {', '.join(nodes)}" if first else ""
    return Finding(RecordFault(
        kind=FaultKind.HANG, attempt=live.number, ranks=tuple(r.rank for r in first), nodes=nodes, step=step,
        summary=f"no step progress for {idle_s:.0f} s ({what} {limit_s:.0f} s), last step {step}{who}",
    ))


def _heard_since(obs: AttemptObs, t: float) -> bool:
    """Some rank of the attempt (or its node's agent) was heard after ``t``."""
    return any(r.heard_at is not None and r.heard_at > t for r in obs.ranks)


STALL_GAP_S = 5.0  # a rank unheard this much longer than the most recently heard one stalled first


def heard_again_at(last_heard: float | None, heard: float, back_at: float | None) -> float | None:
    """When an attempt's ranks were heard again after all of them fell silent together (a
    cut between the nodes and the broker): ``heard``, the newest word of any rank, when it
    came over ``STALL_GAP_S`` after the one before (``last_heard``); else ``back_at`` as it was."""
    return heard if last_heard is not None and heard - last_heard > STALL_GAP_S else back_at


def _node_going_silent(view: RunView, obs: AttemptObs, now: float) -> bool:
    """Every rank of some node unheard for STALL_GAP_S while other nodes are heard, and
    the silence rule's verdict on it still to come (and a grace): it will judge it a lost
    node and drain it; a hang verdict now would blame no one. That verdict waits for the
    silence limit, counted from the node's last word or, when telemetry flows again after
    an outage or a stall of the daemon's own loop, from then (``_find_silent_node``)."""
    by = by_node(obs.ranks)
    if len(by) < 2:
        return False
    quiet_for = {n: now - max(r.heard_at or 0.0 for r in rs) for n, rs in by.items()}
    heard = [n for n, q in quiet_for.items() if q <= STALL_GAP_S]
    limit = view.run.policy.silence_timeout_s + STALL_GAP_S
    flowing_for = now - obs.telemetry_up_since if obs.telemetry_up_since is not None else 0.0
    return bool(heard) and any(q > STALL_GAP_S and min(q, flowing_for) <= limit for q in quiet_for.values())


def _silent_before(obs: AttemptObs, now: float) -> bool:
    """Some node, none of whose ranks is gone, unheard (ranks and agent) for STALL_GAP_S
    while another node is heard: cut off or frozen, most likely the cause of its peers'
    deaths. A node whose own ranks ended is no such node: their silence is their death."""
    by = by_node(obs.ranks)
    last = {n: max((t for t in (r.heard_at for r in rs) if t is not None), default=None)
            for n, rs in by.items()}
    quiet_for = {n: now - t for n, t in last.items() if t is not None}  # a node never heard is not one
    heard = [n for n, q in quiet_for.items() if q <= STALL_GAP_S]
    return bool(heard) and any(q > STALL_GAP_S and not any(gone(r) or is_dead(r) for r in by[n])
                               for n, q in quiet_for.items())


def _all_cut_off(view: RunView, obs: AttemptObs, now: float) -> bool:
    """No rank heard (neither it nor its node's agent, the only voice of a ``[command]``
    trainer's ranks) for STALL_GAP_S, none of them visible to the launcher, for less than
    ``hang_timeout_s``: they lost the broker together, or their only node its power (which
    the cluster will say); a hang cannot be told from either."""
    if not obs.ranks or any(r.proc is not ProcState.UNKNOWN for r in obs.ranks):
        return False
    heard = max((t for t in (r.heard_at for r in obs.ranks) if t is not None), default=None)
    return heard is not None and STALL_GAP_S < now - heard < view.run.policy.hang_timeout_s


def stalled_first(ranks: Iterable[RankObs]) -> list[RankObs]:
    """The ranks a hang began with: those behind the others in steps; failing that, those
    that fell silent (no heartbeat) well before the rest. Empty when all stalled together."""
    rs = list(ranks)
    if not rs:
        return []
    behind = min(r.last_step for r in rs)
    laggards = [r for r in rs if r.last_step == behind]
    if len(laggards) < len(rs):
        return laggards
    heard = [r.last_seen_at for r in rs if r.last_seen_at is not None]
    if not heard:
        return []
    newest = max(heard)
    silent = [r for r in rs if r.last_seen_at is None or newest - r.last_seen_at > STALL_GAP_S]
    return silent if len(silent) < len(rs) else []


# --- spikes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spike:
    step: int  # the first step of it
    steps: int  # how many steps in a row, from it, are above the threshold
    summary: str


def _spikes(recent: tuple[StepSample, ...], policy: Policy) -> list[Spike]:
    """Every run of spiking steps in ``recent`` (consecutive steps, oldest first), each
    judged against the median of the ``spike_window`` steps before its first step."""
    w = policy.spike_window
    found: list[Spike] = []
    i = w
    while i < len(recent):
        before = recent[i - w:i]
        if any(b.step != recent[i].step - w + k for k, b in enumerate(before)):
            i += 1
            continue  # a gap in what was received: no judgement on a broken window
        loss_m = median([b.loss for b in before if math.isfinite(b.loss)] or [math.inf])
        grad_m = median([b.grad_norm for b in before if math.isfinite(b.grad_norm)] or [math.inf])
        limits = (loss_m * (1 + policy.spike_loss_rel), grad_m * policy.spike_grad_factor)
        if not _above(recent[i], limits):
            i += 1
            continue
        j = i
        while (j + 1 < len(recent) and recent[j + 1].step == recent[j].step + 1
               and _above(recent[j + 1], limits)):
            j += 1
        x = recent[i]
        found.append(Spike(step=x.step, steps=j - i + 1, summary=(
            f"loss spike from step {x.step}: loss {x.loss:.4g} (median of the {w} steps before: "
            f"{loss_m:.4g}), grad norm {x.grad_norm:.4g} (median {grad_m:.4g}), for {j - i + 1} steps")))
        i = j + 1
    return found


def _above(x: StepSample, limits: tuple[float, float]) -> bool:
    return x.loss > limits[0] or x.grad_norm > limits[1]


def find_spike(recent: tuple[StepSample, ...], policy: Policy, *, skips: bool = True) -> Spike | None:
    """The first spike that has lasted ``spike_persist_steps`` steps: act on it (``skips``:
    the trainer can step over its data)."""
    for s in persistent_spikes(recent, policy):
        then = (f"skipping {policy.spike_skip_steps} steps of data from it" if skips
                else "training through it if it comes back (the trainer cannot skip data)")
        return Spike(step=s.step, steps=s.steps, summary=(
            f"{s.summary}: rolling back to the newest checkpoint before step {s.step} and {then}"))
    return None


def persistent_spikes(recent: tuple[StepSample, ...], policy: Policy) -> list[Spike]:
    """Spikes that have lasted ``spike_persist_steps`` steps."""
    return [s for s in _spikes(recent, policy) if s.steps >= policy.spike_persist_steps]


def spike_rolled_back(view: RunView, live: Attempt) -> bool:
    """A trainer that cannot skip data replays a spike's batches after its rollback: an
    earlier attempt's spike past this attempt's checkpoint is the same one, already rolled
    back once. Another rollback would replay it again, into a crash loop."""
    return view.data_skip_unit is None and any(
        f.kind is FaultKind.SPIKE and f.attempt < live.number and f.step > live.resume_step
        for f in view.faults)


def transient_spikes(recent: tuple[StepSample, ...], policy: Policy) -> list[Spike]:
    """Spikes that ended before ``spike_persist_steps``: counted and reported, never acted on."""
    last = recent[-1].step if recent else 0
    return [s for s in _spikes(recent, policy)
            if s.steps < policy.spike_persist_steps and s.step + s.steps <= last]


# --- stragglers ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    node: str
    busy_s: float  # its median busy time per step over the window
    typical_s: float  # the typical rank's: the lower median of every judged rank's median

    @property
    def slower(self) -> float:
        """How much slower than typical: 0.5 is 50 % slower."""
        return self.busy_s / self.typical_s - 1.0 if self.typical_s > 0 else math.inf


def find_stragglers(ranks: Iterable[RankObs], policy: Policy) -> list[Straggler]:
    """Ranks whose own compute per step stays above the typical rank's by the margin.

    In a synchronous job every rank's wall-clock step time is the same (the fast ones
    wait for the slow one in the collectives), so the judgement is on busy time, which
    leaves the waits out. Each rank with a full window is summarised by its median over
    the window (one slow step is not a straggler); "typical" is the lower median of those
    medians, so that with two ranks the slower is compared with the faster, and a
    majority of slow ranks is the new normal rather than a crowd of stragglers.
    """
    window = policy.straggler_window
    judged = [(r, median(r.busy_recent_s[-window:])) for r in ranks if len(r.busy_recent_s) >= window]
    if len(judged) < 2:
        return []
    typical = median_low(m for _, m in judged)
    return [Straggler(rank=r.rank, node=r.node, busy_s=m, typical_s=typical)
            for r, m in judged
            if m > typical * (1.0 + policy.straggler_margin) and m - typical >= policy.straggler_min_s]
