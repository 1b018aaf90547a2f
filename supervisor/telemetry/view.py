"""Trainer telemetry: the in-memory view of what the ranks and node agents said.

``MqttLink`` (supervisor/telemetry/link.py) subscribes to every rank's topic
(wire/) and feeds each message to ``TelemetryView``, which keeps the
latest state per (run, attempt, rank) for the reconciler to read. Times in the view are
the supervisor's receipt times, never the trainer's clock. Malformed messages are counted and dropped.

Rank 0's step metrics and checkpoint commits are also queued for the reconciler to
persist, so the loss curve and the goodput accounting survive a restart.

A ``node`` message (``NodeReport``, sent by a node's local rank 0 when the run aggregates
per node) stands for one message from each rank it lists, dated ``age`` seconds before
its receipt: it updates each listed rank as a heartbeat would, and as a step message
would where the rank's step advanced (a step time for the pooled window, a busy time for
the straggler rule). A rank whose slot stops being written grows older in each report:
it is not seen again, so the silence and hang rules judge it as if its messages stopped.

A node agent's ``agent`` message (``AgentReport``, node/agent.py) says that its
node lives, whatever the trainer says, and carries the node's slots as a NodeReport
does; its last will (``agent_lost``) says the node went. ``agents`` hands the reconciler
what each node's agent last said.

Authenticity: the view holds the supervisor's secret and acts only on messages sealed
with their attempt's key, of attempts that have not ended, about ranks in their world;
the others are dropped and counted by reason. Which is which is the gate's to say
(supervisor/telemetry/gate.py).

The view knows whether the broker link is up (``up_since``). While it is down no
telemetry arrives, and the policy must not read silence as a hang. Nor while the event
loop that receives it is not running (a stalled loop hears no node, however well they
are): the daemon reports the loop's pulse (``loop_alive``), and ``flowing_since`` says
since when telemetry has flowed, counting a stall like an outage.

Messages arrive on the event loop; the reconciler reads on its own thread. One lock
guards the view: readers get copies (``ranks`` hands back ``RankSeen``), never the
structures ingestion is changing. What the view keeps of each sender, and the copies it
hands out, are in supervisor/telemetry/records.py.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import wire as p
from supervisor.checkpoint_pace import CheckpointIo, IoPace
from supervisor.domain import StepSample
from supervisor.telemetry.gate import Gate
from supervisor.telemetry.records import (
    BUSY_TIMES_KEPT,
    AgentSeen,
    AgentTelemetry,
    RankSeen,
    RankTelemetry,
    Received,
)

log = logging.getLogger(__name__)

# Step metrics and checkpoint commits waiting to be persisted; beyond this many (a
# reconciler stalled for minutes) the oldest are dropped and counted.
_DURABLE_QUEUE_MAX = 100_000
# Per attempt, over all its ranks: the window the adaptive hang timeout is drawn from.
# One pooled window, not one per rank, so that its p99 costs the same at 4 ranks and at
# 32,768 (a sort of every rank's window on every tick did not scale).
STEP_TIMES_KEPT = 2048
RECENT_STEPS_KEPT = 400  # rank 0's steps per attempt: the window spikes are judged on
STEP_TREND_KEPT = 64  # rank 0's step times per attempt, its first and its newest (a slowdown)


# Last wills received this shortly before the broker link went down came with the
# broker's own shutdown (see TelemetryView.link_down).
WILLS_WITH_THE_BROKER_S = 2.0
# Distinct chaos actions recorded per attempt: a drill names a few; a run's own process
# sending thousands must not grow the daemon's memory and event log with them.
_INJECTED_PER_ATTEMPT = 32
_PRINTED_ALL = frozenset({"loss", "grad_norm"})  # a StepMetrics message carries both
# The receiving loop not run for this long is stalled (TelemetryView.loop_alive): what the
# nodes sent meanwhile waits in its socket, and their silence says nothing of them.
LOOP_STALL_S = 2.0


@dataclass(slots=True)
class TelemetryView:
    cluster: str = p.DEFAULT_CLUSTER
    # The supervisor's secret, from which each attempt's key derives; None: messages are
    # taken unsealed (tests and benches of what the view does with them).
    secret: bytes | None = field(default=None, repr=False)
    # The broker takes one login per attempt (the embedded one, supervisor/telemetry/broker.py): each
    # attempt's ranks are given theirs, derived from ``secret`` (wire/sealing.py).
    broker_logins: bool = False
    up_since: float | None = None
    # A stall of the receiving loop is one of time, whatever the daemon's clock says (the
    # soak's runs thousands of times faster): timed on this one (loop_alive).
    monotonic: Callable[[], float] = field(default=time.monotonic, repr=False)
    _loop_at: float | None = None  # when, on ``monotonic``, the receiving event loop last ran
    counts: Counter[str] = field(default_factory=Counter)
    _ranks: dict[tuple[str, int], dict[int, RankTelemetry]] = field(default_factory=dict)
    _agents: dict[tuple[str, int], dict[int, AgentTelemetry]] = field(default_factory=dict)  # by node index
    _durable: deque[Received] = field(default_factory=deque)
    _io: dict[str, CheckpointIo] = field(default_factory=dict)  # run -> its recent checkpoint I/O
    _recent: dict[tuple[str, int], deque[StepSample]] = field(default_factory=dict)  # rank 0's steps
    _step_times: dict[tuple[str, int], deque[float]] = field(default_factory=dict)  # every rank's, pooled
    # rank 0's (step, seconds): the attempt's first STEP_TREND_KEPT, and its newest
    _trend: dict[tuple[str, int], tuple[list[tuple[int, float]], deque[tuple[int, float]]]] = field(
        default_factory=dict)
    _committed: dict[tuple[str, int], int] = field(default_factory=dict)  # rank 0's newest commit
    _injected: set[tuple[str, int, str]] = field(default_factory=set)  # (run, attempt, chaos action)
    # Whether an attempt (run id, number) is live in the store: a verified message of one
    # this process has not heard of is acted on only if so (None: it is).
    is_live: Callable[[str, int], bool] | None = field(default=None, repr=False)
    # Called with (run id, number) as an attempt ends (the broker forgets its login).
    on_end: list[Callable[[str, int], None]] = field(default_factory=list, repr=False)
    _gate: Gate = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._gate = Gate(self.cluster, is_live=self.is_live)

    def link_up(self, now: float) -> None:
        self.up_since = now

    def loop_alive(self, now: float) -> None:
        """The event loop that receives telemetry ran at ``now`` (its pulse, a few times a
        second). Back from a stall of LOOP_STALL_S or more, the link counts as up from now:
        what queued meanwhile is only now arriving, so silence is timed afresh."""
        at = self.monotonic()
        with self._lock:
            last, self._loop_at = self._loop_at, at
            if last is None or at - last < LOOP_STALL_S:
                return
            if self.up_since is not None:
                self.up_since = max(self.up_since, now)
        log.warning("the event loop that receives telemetry did not run for %.1f s: no node's silence "
                    "is judged from that time", at - last)

    def flowing_since(self, now: float) -> float | None:
        """Since when telemetry has flowed: the link's up time; None while the link is down
        or while the loop that receives it is stalled (no pulse for LOOP_STALL_S)."""
        with self._lock:
            if self._loop_at is not None and self.monotonic() - self._loop_at >= LOOP_STALL_S:
                return None
            return self.up_since

    def link_down(self, now: float) -> None:
        """The link to the broker is gone. A broker that shuts down publishes every client's
        last will first (mosquitto does): wills that came just before are the broker's
        going, not the ranks' deaths, and are set aside. A rank that did die then is found
        once the link is back, by its silence or by Slurm."""
        with self._lock:
            self.up_since = None
            senders: list[RankTelemetry | AgentTelemetry] = [
                *(r for ranks in self._ranks.values() for r in ranks.values()),
                *(a for agents in self._agents.values() for a in agents.values())]
            for who in senders:
                if who.lost and who.lost_at is not None and now - who.lost_at <= WILLS_WITH_THE_BROKER_S:
                    who.lost = False

    def ingest(self, topic: str, payload: bytes | str, now: float) -> None:
        try:
            sealed = p.decode_sealed(payload, topic, cluster=self.cluster)
        except p.ProtocolError as e:
            self.count("malformed")
            log.debug("dropped a malformed message on %s: %s", topic, e)
            return
        msg = sealed.msg
        with self._lock:
            why = self._gate.why_dropped(topic, sealed, self.secret, self._sender)
            if why is not None:
                self.counts[why] += 1
                log.debug("dropped a %s message on %s: %s", msg.kind, topic, why)
                return
            self.counts["received"] += 1
            self.counts[msg.kind] += 1
            self._apply(msg, now)

    def replay_marks(self) -> list[tuple[str, int, str, int]]:
        """(run, attempt, sender, highest verified sequence number) of every live sender (a
        rank's number, a node agent's ``n<index>``: wire.sender): what a
        restarted daemon needs to refuse a replay of what this one verified."""
        with self._lock:
            marks = {(run, attempt, str(number)): r.seq for (run, attempt), ranks in self._ranks.items()
                     for number, r in ranks.items() if r.seq > 0}
            marks |= {(run, attempt, f"n{index}"): a.seq for (run, attempt), agents in self._agents.items()
                      for index, a in agents.items() if a.seq > 0}
            for key, seq in self._gate.floors().items():
                marks[key] = max(marks.get(key, 0), seq)
            return [(*key, seq) for key, seq in marks.items()]

    def load_replay_marks(self, marks: Iterable[tuple[str, int, str | int, int]]) -> None:
        """The marks a daemon before this one kept (``replay_marks``)."""
        with self._lock:
            self._gate.load_floors(marks)

    def expect(self, run_id: str, attempt: int, world_size: int) -> None:
        """The attempt's world size (the observer's, from the store): a message about a
        rank outside it is dropped, so that no message grows the view beyond the world."""
        with self._lock:
            self._gate.expect(run_id, attempt, world_size)

    def _sender(self, msg: p.Message) -> RankTelemetry | AgentTelemetry:
        """The state of the rank or node agent that sent ``msg`` (made on first word)."""
        if isinstance(msg, (p.AgentReport, p.AgentLost)):
            return self._agents.setdefault((msg.run, msg.attempt), {}).setdefault(msg.index, AgentTelemetry())
        return self._ranks.setdefault((msg.run, msg.attempt), {}).setdefault(msg.rank, RankTelemetry())

    def apply(self, msg: p.Message, now: float) -> None:
        with self._lock:
            self._apply(msg, now)

    def apply_from_output(self, msg: p.StepMetrics, now: float, *, printed: frozenset[str],
                          record: bool = True) -> None:
        """A step read from a trainer's output (supervisor/gathering/output_progress.py): progress,
        but no sign that the rank's node is heard (output stops in a hang as everywhere
        else); only what the line ``printed`` (loss, grad_norm) is judged, the rest is NaN
        for "not known". ``record=False``: progress only, not a step of the run's history
        (a precompile pass's)."""
        with self._lock:
            rank = self._ranks.setdefault((msg.run, msg.attempt), {}).setdefault(msg.rank, RankTelemetry())
            self._step(rank, msg, now, printed, record=record)

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def counts_now(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def _apply(self, msg: p.Message, now: float) -> None:
        if isinstance(msg, (p.AgentReport, p.AgentLost)):
            self._apply_agent(msg, now)
            return
        rank = self._ranks.setdefault((msg.run, msg.attempt), {}).setdefault(msg.rank, RankTelemetry())
        if not isinstance(msg, p.Lost):
            rank.last_seen_at = now
            rank.lost = False  # it is back: the last will was a network blip
        match msg:
            case p.Register():
                rank.node, rank.pid = msg.node, msg.pid
            case p.Heartbeat():
                self._enter(msg.run, rank, msg.phase.value, now)
                self._progress(rank, msg.step, now)
            case p.PhaseChange():
                self._enter(msg.run, rank, msg.phase.value, now, msg.bytes)
                self._progress(rank, msg.step, now)
            case p.StepMetrics():
                self._step(rank, msg, now, _PRINTED_ALL)
            case p.CheckpointCommitted():
                self._queue(Received(msg, now))
                newest = self._committed.get((msg.run, msg.attempt), msg.step)
                self._committed[(msg.run, msg.attempt)] = max(newest, msg.step)
                whole = msg.total_s if math.isfinite(msg.total_s) else msg.duration_s
                self._run_io(msg.run).saved(whole, msg.bytes)
            case p.CheckpointRestored():
                self._queue(Received(msg, now))
                self._run_io(msg.run).restored(msg.duration_s, msg.bytes)
            case p.FaultInjected():
                key = (msg.run, msg.attempt, msg.action[:200])
                if key not in self._injected and self._injected_room(msg.run, msg.attempt):
                    self._injected.add(key)  # every rank may say so: the first one counts
                    self._queue(Received(msg, now))
            case p.Exit():
                rank.exit_code, rank.exit_reason, rank.exit_at = msg.exit_code, msg.reason, now
                self._progress(rank, msg.final_step, now)
            case p.NodeReport():
                self._fan_out_slots(msg, now)
            case p.Lost():
                rank.lost, rank.lost_at = True, now

    def _apply_agent(self, msg: p.AgentMessage, now: float) -> None:
        agent = self._agents.setdefault((msg.run, msg.attempt), {}).setdefault(msg.index, AgentTelemetry())
        match msg:
            case p.AgentReport():
                agent.node, agent.pid, agent.last_seen_at, agent.lost = msg.node, msg.pid, now, False
                self._fan_out_slots(msg, now)
            case p.AgentLost():
                agent.lost, agent.lost_at = True, now

    def _injected_room(self, run_id: str, attempt: int) -> bool:
        """Room for one more distinct chaos action of this attempt (a few are all a drill has)."""
        return sum(1 for k in self._injected if k[:2] == (run_id, attempt)) < _INJECTED_PER_ATTEMPT

    def phase_from_output(self, run_id: str, attempt: int, rank: int, phase: str, now: float) -> None:
        """The phase a trainer's output shows (supervisor/gathering/output_progress.py), for a rank
        that says nothing of its own on telemetry (what it says there is exact)."""
        with self._lock:
            seen = self._ranks.setdefault((run_id, attempt), {}).setdefault(rank, RankTelemetry())
            if seen.last_seen_at is None:
                self._enter(run_id, seen, phase, now)

    def _enter(self, run_id: str, rank: RankTelemetry, phase: str, at: float, size: int = 0) -> None:
        """``rank`` is in ``phase`` (said at ``at``): when it is a new one, the clock of the
        hang rule starts again, and a checkpoint phase that ends is timed (CheckpointIo)."""
        if phase == rank.phase:
            if size:
                rank.phase_bytes = size
            return
        if rank.phase == "checkpoint" and rank.phase_at is not None and at >= rank.phase_at:
            self._run_io(run_id).phase_ended(at - rank.phase_at)
        rank.phase, rank.phase_at, rank.phase_bytes = phase, at, size

    def _run_io(self, run_id: str) -> CheckpointIo:
        io = self._io.get(run_id)
        if io is None:
            io = self._io[run_id] = CheckpointIo()
        return io

    def _step(self, rank: RankTelemetry, msg: p.StepMetrics, now: float, printed: frozenset[str], *,
              record: bool = True) -> None:
        self._progress(rank, msg.step, now)
        if rank.first_step is None or msg.step < rank.first_step:
            rank.first_step = msg.step
        if math.isfinite(msg.step_time_s) and msg.step_time_s > 0:
            self._add_step_time(msg.run, msg.attempt, msg.step_time_s)
        if math.isfinite(msg.busy_s) and msg.busy_s >= 0:
            rank.busy_times.append(msg.busy_s)
        finite = all(x is None or math.isfinite(x)
                     for name, x in (("loss", msg.loss), ("grad_norm", msg.grad_norm)) if name in printed)
        if not finite and (rank.nonfinite_step is None or msg.step < rank.nonfinite_step):
            rank.nonfinite_step = msg.step
        if msg.rank == 0:
            if record:
                self._queue(Received(msg, now))
            if math.isfinite(msg.step_time_s) and msg.step_time_s > 0:
                first, newest = self._trend.setdefault((msg.run, msg.attempt),
                                                       ([], deque(maxlen=STEP_TREND_KEPT)))
                if len(first) < STEP_TREND_KEPT:
                    first.append((msg.step, msg.step_time_s))
                newest.append((msg.step, msg.step_time_s))
            sample = StepSample(step=msg.step, loss=msg.loss,
                                grad_norm=math.nan if msg.grad_norm is None else msg.grad_norm,
                                first_sample=msg.first_sample)
            self._recent.setdefault((msg.run, msg.attempt), deque(maxlen=RECENT_STEPS_KEPT)).append(sample)

    def _fan_out_slots(self, msg: p.NodeReport | p.AgentReport, now: float) -> None:
        """Fan one node's slots out to its ranks (see the module docstring)."""
        ranks = self._ranks.setdefault((msg.run, msg.attempt), {})
        entries = zip(msg.ranks, msg.steps, msg.phases, msg.ages, msg.step_times, msg.busy, strict=True)
        for number, step, phase, age, step_time, busy in entries:
            rank = ranks.get(number)
            if rank is None:
                rank = ranks[number] = RankTelemetry()
            if rank.node is None:
                rank.node = msg.node
            written_at = now - age  # when the rank last wrote its slot
            if rank.last_seen_at is None or written_at > rank.last_seen_at:
                rank.last_seen_at = written_at
            if rank.lost and rank.lost_at is not None and written_at > rank.lost_at:
                rank.lost = False  # alive after its last will: the connection blipped
            self._enter(msg.run, rank, phase.value, max(written_at, rank.phase_at or written_at))
            if step > rank.last_step or rank.progress_at is None:
                # Never back: rank 0's step metrics may have dated it later (on receipt).
                known = rank.progress_at
                rank.progress_at = written_at if known is None else max(known, written_at)
                if step > rank.last_step:
                    if math.isfinite(step_time) and step_time > 0:
                        self._add_step_time(msg.run, msg.attempt, step_time)
                    if math.isfinite(busy) and busy >= 0:
                        rank.busy_times.append(busy)
            rank.last_step = max(rank.last_step, step)

    @staticmethod
    def _progress(rank: RankTelemetry, step: int, now: float) -> None:
        if step > rank.last_step or rank.progress_at is None:
            rank.progress_at = now
        rank.last_step = max(rank.last_step, step)

    def _queue(self, item: Received) -> None:
        if len(self._durable) >= _DURABLE_QUEUE_MAX:
            self._durable.popleft()
            self.counts["durable_dropped"] += 1
        self._durable.append(item)

    def durable_backlog(self) -> int:
        """Items waiting to be recorded."""
        with self._lock:
            return len(self._durable)

    def peek_durable(self) -> list[Received]:
        with self._lock:
            return list(self._durable)

    def drop_durable(self, count: int) -> None:
        """Forget the oldest ``count`` items, once they are safely stored."""
        with self._lock:
            for _ in range(min(count, len(self._durable))):
                self._durable.popleft()

    def ranks(self, run_id: str, attempt: int, busy_window: int = BUSY_TIMES_KEPT) -> dict[int, RankSeen]:
        """A copy of every rank's telemetry, with its newest ``busy_window`` busy times."""
        with self._lock:
            return {number: RankSeen(
                node=r.node, pid=r.pid, last_seen_at=r.last_seen_at, last_step=r.last_step,
                progress_at=r.progress_at, phase=r.phase, phase_at=r.phase_at, phase_bytes=r.phase_bytes,
                exit_code=r.exit_code, exit_reason=r.exit_reason,
                exit_at=r.exit_at, lost=r.lost,
                nonfinite_step=r.nonfinite_step, first_step=r.first_step,
                busy_recent=_newest(r.busy_times, busy_window))
                for number, r in self._ranks.get((run_id, attempt), {}).items()}

    def agents(self, run_id: str, attempt: int) -> dict[str, AgentSeen]:
        """What each node's agent last said, by node name (agents not yet heard by name are left out)."""
        with self._lock:
            return {a.node: AgentSeen(index=index, node=a.node, pid=a.pid, last_seen_at=a.last_seen_at,
                                      lost=a.lost, lost_at=a.lost_at)
                    for index, a in self._agents.get((run_id, attempt), {}).items() if a.node is not None}

    def max_step(self, run_id: str, attempt: int) -> int:
        with self._lock:
            return max((r.last_step for r in self._ranks.get((run_id, attempt), {}).values()), default=0)

    def add_step_time(self, run_id: str, attempt: int, seconds: float) -> None:
        with self._lock:
            self._add_step_time(run_id, attempt, seconds)

    def _add_step_time(self, run_id: str, attempt: int, seconds: float) -> None:
        key = (run_id, attempt)
        window = self._step_times.get(key)
        if window is None:
            window = self._step_times[key] = deque(maxlen=STEP_TIMES_KEPT)
        window.append(seconds)

    def step_time_p99(self, run_id: str, attempt: int) -> tuple[float | None, int]:
        """(the 99th percentile of the attempt's recent step times over all ranks, how many)."""
        with self._lock:
            times = sorted(self._step_times.get((run_id, attempt), ()))
        if not times:
            return None, 0
        return times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)], len(times)

    def step_trend(self, run_id: str, attempt: int) -> tuple[tuple[tuple[int, float], ...],
                                                             tuple[tuple[int, float], ...]]:
        """Rank 0's step times, (step, seconds): the attempt's first ones and its newest,
        oldest first."""
        with self._lock:
            first, newest = self._trend.get((run_id, attempt), ([], deque()))
            return tuple(first), tuple(newest)

    def committed_step(self, run_id: str, attempt: int) -> int | None:
        """The step of the newest checkpoint the attempt said it committed (None: none yet)."""
        with self._lock:
            return self._committed.get((run_id, attempt))

    def recent_steps(self, run_id: str, attempt: int) -> tuple[StepSample, ...]:
        with self._lock:
            recent = tuple(self._recent.get((run_id, attempt), ()))
        return tuple(sorted(recent, key=lambda x: x.step))

    def checkpoint_io(self, run_id: str) -> IoPace:
        """The run's recent checkpoint I/O, the slowest of each kind."""
        with self._lock:
            io = self._io.get(run_id)
            return io.pace() if io is not None else IoPace()

    def forget(self, run_id: str, attempt: int) -> None:
        with self._lock:
            self._ranks.pop((run_id, attempt), None)
            self._agents.pop((run_id, attempt), None)
            self._recent.pop((run_id, attempt), None)
            self._step_times.pop((run_id, attempt), None)
            self._trend.pop((run_id, attempt), None)
            self._committed.pop((run_id, attempt), None)
            self._injected = {k for k in self._injected if k[:2] != (run_id, attempt)}
            self._gate.end(run_id, attempt)
        for hook in self.on_end:
            hook(run_id, attempt)


def _newest(values: deque[float], count: int) -> tuple[float, ...]:
    """The newest ``count`` of ``values``, oldest first."""
    return tuple(values)[max(0, len(values) - count):] if values else ()
