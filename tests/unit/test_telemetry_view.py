"""TelemetryView: what the reconciler learns from the ranks' messages."""

from __future__ import annotations

import wire as p
from supervisor.chaos import ChaosAction, parse_chaos
from supervisor.domain import (
    Attempt,
    AttemptObs,
    AttemptState,
    FaultKind,
    Node,
    NodeState,
    Policy,
    ProcState,
    RankObs,
    RecordFault,
    Run,
    RunState,
    RunView,
)
from supervisor.errors import SpecError
from supervisor.policy import decide
from supervisor.telemetry.view import LOOP_STALL_S, TelemetryView

H = {"run": "run-1", "attempt": 1, "ts": 0.0}


def feed(view: TelemetryView, msg: p.Message, now: float) -> None:
    topic, payload = p.encode(msg)
    view.ingest(topic, payload, now)


def test_progress_exit_and_last_will_per_rank() -> None:
    v = TelemetryView()
    feed(v, p.Register(**H, rank=1, local_rank=1, world_size=2, node="n1", pid=9, hostname="h"), 1.0)
    feed(v, p.Heartbeat(**H, rank=1, step=3, phase=p.Phase.TRAIN), 2.0)
    feed(v, p.Heartbeat(**H, rank=1, step=3, phase=p.Phase.TRAIN), 5.0)
    r = v.ranks("run-1", 1)[1]
    assert (r.node, r.pid, r.last_step, r.phase, r.progress_at, r.last_seen_at) == ("n1", 9, 3, "train", 2.0, 5.0)
    feed(v, p.Lost(**H, rank=1), 6.0)
    r = v.ranks("run-1", 1)[1]  # a copy: read again
    assert r.lost and r.last_seen_at == 5.0
    feed(v, p.Exit(**H, rank=0, exit_code=1, final_step=3, reason="boom"), 7.0)
    r0 = v.ranks("run-1", 1)[0]
    assert (r0.exit_code, r0.exit_reason, r0.exit_at) == (1, "boom", 7.0)
    assert v.max_step("run-1", 1) == 3
    v.forget("run-1", 1)
    assert v.ranks("run-1", 1) == {}


def test_only_rank_zero_metrics_and_checkpoints_are_queued_for_the_store() -> None:
    v = TelemetryView()
    for rank in (0, 1):
        feed(v, p.StepMetrics(**H, rank=rank, step=1, loss=2.0, grad_norm=1.0, lr=0.1, step_time_s=0.1,
                              tokens_per_s=1.0), 1.0)
    feed(v, p.CheckpointCommitted(**H, rank=0, step=20, path="/c", duration_s=0.1), 2.0)
    items = v.peek_durable()
    assert [(type(i.msg).__name__, i.msg.rank, i.at) for i in items] == [
        ("StepMetrics", 0, 1.0), ("CheckpointCommitted", 0, 2.0)]
    assert v.peek_durable() == items, "kept until the reconciler says they are stored"
    v.drop_durable(1)
    assert [type(i.msg).__name__ for i in v.peek_durable()] == ["CheckpointCommitted"]


def test_a_message_after_the_last_will_means_the_rank_is_back() -> None:
    v = TelemetryView()
    feed(v, p.Lost(**H, rank=0), 1.0)
    assert v.ranks("run-1", 1)[0].lost
    feed(v, p.Heartbeat(**H, rank=0, step=1, phase=p.Phase.TRAIN), 2.0)
    assert not v.ranks("run-1", 1)[0].lost


def test_malformed_messages_are_counted_and_ignored() -> None:
    v = TelemetryView()
    v.ingest("tsup/v1/telemetry/run-1/1/0/step", b"{oops", 1.0)
    v.ingest("tsup/v1/telemetry/run-1/1/0/step", b'{"v": 1, "kind": "step"}', 1.0)
    assert v.counts["malformed"] == 2 and v.counts["received"] == 0
    assert v.ranks("run-1", 1) == {}


def test_chaos_syntax() -> None:
    assert parse_chaos("kill-rank@50") == ChaosAction(kind="kill-rank", step=50)
    assert parse_chaos("kill-node@90:1") == ChaosAction(kind="kill-node", step=90, target=1)
    assert parse_chaos("corrupt-ckpt@50") == ChaosAction(kind="corrupt-ckpt", step=50)
    assert parse_chaos("kill-in-save@40:3") == ChaosAction(kind="kill-in-save", step=40, target=3)
    assert parse_chaos("partition-node@40:1") == ChaosAction(kind="partition-node", step=40, target=1, seconds=20)
    assert parse_chaos("partition-all@40/45") == ChaosAction(kind="partition-all", step=40, seconds=45)
    assert str(parse_chaos("partition-node@40/5")) == "partition-node@40/5"
    for bad in ("kill-rank", "kill-rank@x", "explode@5", "kill-node@0", "kill-node@5/10", "partition-all@5:1"):
        try:
            parse_chaos(bad)
        except SpecError as e:
            assert "--chaos" in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def node_report(node: str, ranks: tuple[int, ...], steps: tuple[int, ...], ages: tuple[float, ...],
                busy: float = 0.5, phase: p.Phase = p.Phase.TRAIN) -> p.NodeReport:
    n = len(ranks)
    return p.NodeReport(**H, rank=ranks[0], node=node, ranks=ranks, steps=steps, phases=(phase,) * n,
                        ages=ages, step_times=(1.0,) * n, busy=(busy,) * n)


def test_a_node_report_updates_every_rank_it_lists() -> None:
    v = TelemetryView()
    feed(v, p.Register(**H, rank=2, local_rank=0, world_size=4, node="n2", pid=9, hostname="h"), 1.0)
    feed(v, node_report("n2", (2, 3), (4, 5), (0.0, 0.5), phase=p.Phase.CHECKPOINT), 10.0)
    assert v.counts["node"] == 1 and v.counts["received"] == 2
    r2, r3 = v.ranks("run-1", 1)[2], v.ranks("run-1", 1)[3]
    assert (r2.node, r2.pid, r2.last_step, r2.phase, r2.last_seen_at, r2.progress_at) == (
        "n2", 9, 4, "checkpoint", 10.0, 10.0)
    assert (r3.node, r3.last_step, r3.last_seen_at, r3.progress_at) == ("n2", 5, 9.5, 9.5), \
        "an unregistered rank is known from the report; times are receipt minus age"
    assert v.max_step("run-1", 1) == 5
    assert v.step_time_p99("run-1", 1) == (1.0, 2)
    assert r3.busy_recent == (0.5,)
    # The same steps again: seen later, but no progress and no new step or busy time.
    feed(v, node_report("n2", (2, 3), (4, 5), (0.0, 0.2)), 11.0)
    r3 = v.ranks("run-1", 1)[3]
    assert (r3.last_seen_at, r3.progress_at, r3.busy_recent) == (10.8, 9.5, (0.5,))
    assert v.step_time_p99("run-1", 1)[1] == 2
    # A step further: progress dated by the age; NaN step and busy times are not kept.
    nan = float("nan")
    feed(v, p.NodeReport(**H, rank=2, node="n2", ranks=(3,), steps=(6,), phases=(p.Phase.TRAIN,), ages=(0.1,),
                         step_times=(nan,), busy=(nan,)), 12.0)
    r3 = v.ranks("run-1", 1)[3]
    assert (r3.last_step, r3.progress_at, r3.busy_recent) == (6, 11.9, (0.5,))
    assert v.step_time_p99("run-1", 1)[1] == 2


def test_a_rank_whose_slot_stops_being_written_goes_silent_and_stops_progressing() -> None:
    """Rank 3 froze at 10.0: its slot keeps its last state and grows older in every report."""
    v = TelemetryView()
    for now in range(10, 31):
        frozen_age = now - 10.0
        feed(v, node_report("n2", (2, 3), (now, 7), (0.0, frozen_age)), float(now))
    r2, r3 = v.ranks("run-1", 1)[2], v.ranks("run-1", 1)[3]
    assert (r2.last_seen_at, r2.progress_at) == (30.0, 30.0)
    assert (r3.last_seen_at, r3.progress_at, r3.last_step) == (10.0, 10.0, 7), \
        "silent for 20 s and no progress since 10.0, as if its heartbeats had stopped"


def test_rank_zeros_step_times_keep_the_attempts_first_ones_and_its_newest_and_its_newest_commit() -> None:
    from supervisor.telemetry.view import STEP_TREND_KEPT

    v = TelemetryView()
    for step in range(1, 2 * STEP_TREND_KEPT + 1):
        for rank in (0, 1):  # rank 1's times are pooled for hangs, never in rank 0's trend
            feed(v, p.StepMetrics(**H, rank=rank, step=step, loss=2.0, grad_norm=1.0, lr=0.1,
                                  step_time_s=step / 100 + rank, tokens_per_s=1.0), float(step))
    first, newest = v.step_trend("run-1", 1)
    assert first == tuple((s, s / 100) for s in range(1, STEP_TREND_KEPT + 1))
    assert newest == tuple((s, s / 100) for s in range(STEP_TREND_KEPT + 1, 2 * STEP_TREND_KEPT + 1))
    assert v.committed_step("run-1", 1) is None
    for step in (20, 40, 30):  # a late message never moves it back
        feed(v, p.CheckpointCommitted(**H, rank=0, step=step, path="/c", duration_s=0.1), 200.0)
    assert v.committed_step("run-1", 1) == 40
    v.forget("run-1", 1)
    assert v.step_trend("run-1", 1) == ((), ()) and v.committed_step("run-1", 1) is None


def test_a_node_report_never_moves_a_rank_back_nor_undoes_a_last_will() -> None:
    v = TelemetryView()
    feed(v, p.StepMetrics(**H, rank=0, step=9, loss=2.0, grad_norm=1.0, lr=0.1, step_time_s=0.1,
                          tokens_per_s=1.0), 20.0)
    feed(v, p.Lost(**H, rank=1), 20.0)
    feed(v, node_report("n1", (0, 1), (8, 3), (3.0, 5.0)), 21.0)  # older than what is known
    r0, r1 = v.ranks("run-1", 1)[0], v.ranks("run-1", 1)[1]
    assert (r0.last_step, r0.progress_at) == (9, 20.0)
    assert r0.last_seen_at == 21.0, "the sender itself is heard now"
    assert r1.lost, "its slot was written before its connection died"
    feed(v, node_report("n1", (0, 1), (9, 3), (0.0, 0.0)), 22.0)
    r1 = v.ranks("run-1", 1)[1]  # a copy: read again
    assert not r1.lost and r1.last_seen_at == 22.0, "written after its last will: it is alive"


def judge(v: TelemetryView, now: float, up_since: float | None = 0.0,
          proc: ProcState = ProcState.UNKNOWN) -> list[RecordFault]:
    """The policy's verdict on a 2-node x 2-rank attempt observed only through ``v`` (as
    supervisor/gathering/observe.py builds it: every rank's process UNKNOWN, as under Slurm, unless
    ``proc`` says), with telemetry flowing since ``up_since``."""
    run = Run(number=1, name="t", state=RunState.RUNNING, reason="", nodes=2, ranks_per_node=2, spares=0,
              total_steps=1000, policy=Policy(hang_timeout_s=60), created_at=0.0)
    attempt = Attempt(run_number=1, number=1, state=AttemptState.RUNNING, nodes=("n1", "n2"), resume_from=None,
                      resume_step=0, created_at=0.0, started_at=0.0, first_step_at=1.0, launch_info="{}")
    allocation = tuple(Node(name=n, state=NodeState.ALLOCATED, run_number=1) for n in ("n1", "n2"))
    tele = v.ranks("run-1", 1)
    ranks = tuple(RankObs(rank=r, node=t.node or "", proc=proc, last_step=t.last_step,
                          progress_at=t.progress_at, phase=t.phase, last_seen_at=t.last_seen_at,
                          busy_recent_s=t.busy_recent) for r, t in sorted(tele.items()))
    p99, samples = v.step_time_p99("run-1", 1)
    obs = AttemptObs(ranks=ranks, telemetry_up_since=up_since, step_time_p99_s=p99, step_time_samples=samples)
    view = RunView(run=run, attempts=(attempt,), allocation=allocation, newest_checkpoint=None)
    return [e for e in decide(view, obs, now) if isinstance(e, RecordFault)]


def test_the_policy_finds_a_hang_and_a_lost_node_from_node_reports_alone() -> None:
    # Steps 1..30, one a second on every rank; then rank 3 (n2) freezes at step 30: its
    # slot is no longer written, and the other ranks wait for it in the next collective.
    v = TelemetryView()
    for now in range(1, 61):
        step = min(now, 30)
        feed(v, node_report("n1", (0, 1), (step, step), (0.0, 0.0)), float(now))
        feed(v, node_report("n2", (2, 3), (step, step), (0.0, max(0.0, now - 30.0))), float(now))
        faults = judge(v, float(now))
        if faults:
            break
    [hang] = faults
    assert hang.kind is FaultKind.HANG and hang.ranks == (3,) and hang.nodes == ("n2",), hang
    assert 30 + 8 <= now <= 30 + 12, "the adaptive limit, max(hang floor, 3 x p99 step time 1 s), from step 30"

    # A node whose reports stop (local rank 0 frozen, or the node gone): every rank of it
    # silent while n1 is heard, judged by the silence rule.
    v = TelemetryView()
    for now in range(1, 61):
        feed(v, node_report("n1", (0, 1), (now, now), (0.0, 0.0)), float(now))
        if now <= 20:
            feed(v, node_report("n2", (2, 3), (now, now), (0.0, 0.0)), float(now))
        faults = [f for f in judge(v, float(now)) if f.kind is FaultKind.NODE_LOST]
        if faults:
            break
    [lost] = faults
    assert lost.nodes == ("n2",) and lost.ranks == (2, 3)
    assert 20 + Policy().silence_timeout_s < now <= 20 + Policy().silence_timeout_s + 2


def test_a_stalled_receiving_loop_is_no_silence_of_the_nodes_and_no_hang() -> None:
    """n2 freezes at t=20 (n1 then waits for it, no step further); the launcher sees every
    process running (the local launcher's view). From 21 to 35 the event loop that
    receives telemetry does not run (the daemon's own disk, its GIL): nothing is
    ingested, no pulse. The reconciler's thread judges on meanwhile. Counted as a link
    outage, the stall gives no verdict; once the loop is back and n1's queued reports
    arrive, the silence rule finds n2, not the hang rule. Without the pulse, the hang rule
    still gives no verdict during the stall (it waits for a word heard after its limit),
    and the silence rule finds n2 as soon as the loop is back, counting from n2's last
    word."""

    def frozen_at_20(pulse: bool) -> tuple[float, RecordFault]:
        clock = [0.0]  # the daemon's clock is time here: the stall's too
        v = TelemetryView(monotonic=lambda: clock[0])
        v.link_up(0.0)
        for now in range(1, 61):
            clock[0] = float(now)
            stalled = 21 <= now < 35
            if not stalled:
                if pulse:
                    v.loop_alive(float(now))
                feed(v, node_report("n1", (0, 1), (min(now, 20),) * 2, (0.0, 0.0)), float(now))
                if now <= 20:
                    feed(v, node_report("n2", (2, 3), (now, now), (0.0, 0.0)), float(now))
            faults = judge(v, float(now), v.flowing_since(float(now)), ProcState.RUNNING)
            if faults:
                return float(now), faults[0]
        raise AssertionError("no fault found")

    now, fault = frozen_at_20(pulse=True)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",), fault
    assert 35 + Policy().silence_timeout_s < now <= 35 + Policy().silence_timeout_s + 2, now
    now, fault = frozen_at_20(pulse=False)
    assert fault.kind is FaultKind.NODE_LOST and fault.nodes == ("n2",), (now, fault)
    assert now == 35, "not during the stall"


def test_the_links_pulse_counts_a_stall_as_an_outage_from_which_it_came_back() -> None:
    real = [0.0]  # time, as a monotonic clock says it
    v = TelemetryView(monotonic=lambda: real[0])
    assert v.flowing_since(5.0) is None, "no link yet"
    v.link_up(1.0)
    assert v.flowing_since(5.0) == 1.0, "no pulse yet (a view without a daemon): the link's time"
    for real[0] in (5.0, 5.25):
        v.loop_alive(real[0])
    real[0] = 7.0
    assert v.flowing_since(7.0) == 1.0
    real[0] = 5.25 + LOOP_STALL_S
    assert v.flowing_since(real[0]) is None, "stalled"
    real[0] = 12.0
    v.loop_alive(12.0)
    assert v.flowing_since(12.0) == 12.0, "back: flowing from its return"
    v.link_down(13.0)
    assert v.flowing_since(13.0) is None
    # A daemon's clock that runs faster than time (the soak's) is no stall: time is what counts.
    v.link_up(20.0)
    v.loop_alive(20.0)
    real[0] = 12.1
    assert v.flowing_since(5_000.0) == 20.0 and v.flowing_since(20.0 + 100 * LOOP_STALL_S) == 20.0


# --- authenticity: the daemon's view acts only on sealed messages --------------------

SECRET = b"the-supervisor's-secret"


class Rank:
    """One rank's sealing, as trainer/telemetry.py does it: a connection id, rising numbers."""

    def __init__(self, rank: int, key: bytes, conn: str = "00000000000000aa") -> None:
        self.rank, self.key, self.conn, self.seq = rank, key, conn, 0

    def seal(self, msg: p.Message) -> tuple[str, bytes]:
        self.seq += 1
        return p.encode(msg, cluster="c1", seal=p.Seal(key=self.key, conn=self.conn, seq=self.seq))

    def will(self) -> tuple[str, bytes]:
        return p.encode(p.Lost(**H, rank=self.rank), cluster="c1",
                        seal=p.Seal(key=self.key, conn=self.conn, seq=p.WILL_SEQ))


def sealed_view() -> tuple[TelemetryView, Rank]:
    view = TelemetryView(cluster="c1", secret=SECRET)
    return view, Rank(0, p.attempt_key(SECRET, "c1", "run-1", 1))


def nan_step(step: int) -> p.StepMetrics:
    return p.StepMetrics(**H, rank=0, step=step, loss=float("nan"), grad_norm=1.0, lr=0.1, step_time_s=0.1,
                         tokens_per_s=1.0)


def test_unsealed_and_wrongly_sealed_messages_are_dropped_and_counted() -> None:
    view, rank = sealed_view()
    view.ingest(*p.encode(nan_step(5), cluster="c1"), 1.0)
    other_attempt = Rank(0, p.attempt_key(SECRET, "c1", "run-1", 2))  # a rank of another attempt
    view.ingest(*other_attempt.seal(nan_step(5)), 1.0)
    guessed = Rank(0, p.attempt_key(b"a guess", "c1", "run-1", 1))
    view.ingest(*guessed.seal(nan_step(5)), 1.0)
    counts = view.counts_now()
    assert (counts.get("unsigned"), counts.get("bad_mac"), counts.get("received")) == (1, 2, None)
    assert view.ranks("run-1", 1).get(0) is None or view.ranks("run-1", 1)[0].nonfinite_step is None
    view.ingest(*rank.seal(nan_step(5)), 2.0)
    assert view.ranks("run-1", 1)[0].nonfinite_step == 5, "a genuine message is acted on"


def test_a_replayed_message_is_dropped_even_after_newer_ones() -> None:
    view, rank = sealed_view()
    captured = rank.seal(p.Heartbeat(**H, rank=0, step=3, phase=p.Phase.TRAIN))
    view.ingest(*captured, 1.0)
    view.ingest(*rank.seal(p.Heartbeat(**H, rank=0, step=4, phase=p.Phase.TRAIN)), 2.0)
    view.ingest(*captured, 3.0)
    assert view.counts_now()["replay"] == 1
    assert view.ranks("run-1", 1)[0].last_seen_at == 2.0


def test_a_last_will_counts_only_for_the_ranks_current_connection_and_only_once() -> None:
    view, rank = sealed_view()
    first_will = rank.will()
    view.ingest(*first_will, 0.5)  # before anything was heard on that connection: not evidence
    assert view.counts_now()["will_unattributed"] == 1 and not view.ranks("run-1", 1)[0].lost
    view.ingest(*rank.seal(p.Heartbeat(**H, rank=0, step=3, phase=p.Phase.TRAIN)), 1.0)
    view.ingest(*first_will, 2.0)  # the connection died: its will is evidence
    assert view.ranks("run-1", 1)[0].lost
    rank.conn = "00000000000000bb"  # it reconnects: a new connection, a new will
    view.ingest(*rank.seal(p.Heartbeat(**H, rank=0, step=4, phase=p.Phase.TRAIN)), 3.0)
    assert not view.ranks("run-1", 1)[0].lost
    view.ingest(*first_will, 4.0)  # the old will, replayed
    assert not view.ranks("run-1", 1)[0].lost and view.counts_now()["will_unattributed"] == 2
    forged = Rank(0, b"x" * 32, conn=rank.conn).will()  # the right connection id, no key
    view.ingest(*forged, 5.0)
    assert not view.ranks("run-1", 1)[0].lost and view.counts_now()["bad_mac"] == 1


def test_messages_of_an_ended_attempt_are_dropped() -> None:
    view, rank = sealed_view()
    view.ingest(*rank.seal(p.Heartbeat(**H, rank=0, step=3, phase=p.Phase.TRAIN)), 1.0)
    view.forget("run-1", 1)
    view.ingest(*rank.seal(nan_step(4)), 2.0)
    assert view.ranks("run-1", 1) == {} and view.counts_now()["ended"] == 1


def test_after_a_restart_messages_of_an_attempt_the_store_has_ended_are_dropped() -> None:
    """A restarted daemon has not seen the attempt end: it asks the store, once per attempt,
    and only for a message whose seal is right (a forger cannot make it ask)."""
    asked: list[tuple[str, int]] = []

    def is_live(run: str, n: int) -> bool:
        asked.append((run, n))
        return n == 2

    view = TelemetryView(cluster="c1", secret=SECRET, is_live=is_live)
    ended, live = (Rank(0, p.attempt_key(SECRET, "c1", "run-1", n)) for n in (1, 2))
    beat = p.Heartbeat(**H, rank=0, step=3, phase=p.Phase.TRAIN)
    for _ in range(3):
        view.ingest(*ended.seal(beat), 1.0)
        view.ingest(*live.seal(p.Heartbeat(**{**H, "attempt": 2}, rank=0, step=3, phase=p.Phase.TRAIN)), 1.0)
    view.ingest(*Rank(0, b"x" * 32).seal(p.Heartbeat(**{**H, "attempt": 5}, rank=0, step=3, phase=p.Phase.TRAIN)),
                1.0)
    assert view.counts_now()["ended"] == 3 and view.ranks("run-1", 1) == {}
    assert view.ranks("run-1", 2)[0].last_seen_at == 1.0
    assert asked == [("run-1", 1), ("run-1", 2)], "once per attempt, never for a forgery"


def test_last_wills_that_came_as_the_broker_went_away_are_set_aside() -> None:
    """mosquitto publishes every client's will when it shuts down, just before the
    supervisor's link goes: those wills are the broker's going, not the ranks' deaths.
    A will well before the link went down stays evidence."""
    view, rank = sealed_view()
    view.ingest(*rank.seal(p.Heartbeat(**H, rank=rank.rank, step=3, phase=p.Phase.TRAIN)), 1.0)
    view.ingest(*rank.will(), 10.0)
    assert view.ranks("run-1", 1)[0].lost
    view.link_down(10.5)
    assert not view.ranks("run-1", 1)[0].lost, "it went with the broker"

    view, rank = sealed_view()
    view.ingest(*rank.seal(p.Heartbeat(**H, rank=rank.rank, step=3, phase=p.Phase.TRAIN)), 1.0)
    view.ingest(*rank.will(), 10.0)
    view.link_down(15.0)
    assert view.ranks("run-1", 1)[0].lost, "a death seconds before an outage is still a death"


def test_a_phase_change_is_dated_and_a_checkpoint_phase_is_a_timed_save() -> None:
    """The hang clock restarts at a phase's start and end; a checkpoint phase's length
    stands in for a save's for trainers that time none (trainer.client's NaN)."""
    v = TelemetryView()
    feed(v, p.PhaseChange(**H, rank=0, phase=p.Phase.TRAIN, step=10), 1.0)
    feed(v, p.PhaseChange(**H, rank=0, phase=p.Phase.CHECKPOINT, step=10, bytes=18_000_000_000), 2.0)
    feed(v, p.Heartbeat(**H, rank=0, step=10, phase=p.Phase.CHECKPOINT), 20.0)  # the same phase: no change
    r = v.ranks("run-1", 1)[0]
    assert (r.phase, r.phase_at, r.phase_bytes, r.progress_at) == ("checkpoint", 2.0, 18_000_000_000, 1.0)
    assert v.checkpoint_io("run-1").save_s is None
    feed(v, p.Heartbeat(**H, rank=0, step=10, phase=p.Phase.TRAIN), 36.0)  # its PhaseChange was lost (QoS 0)
    r = v.ranks("run-1", 1)[0]
    assert (r.phase, r.phase_at, r.phase_bytes) == ("train", 36.0, 0)
    assert v.checkpoint_io("run-1").save_s is None, "the phase may be a copy, the save going on beside"
    feed(v, p.CheckpointCommitted(**H, rank=0, step=10, path="/c/10", duration_s=float("nan")), 36.5)
    assert v.checkpoint_io("run-1").save_s == 34.0, "a trainer that times no save: its phases stand in"
    feed(v, p.CheckpointCommitted(**H, rank=0, step=20, path="/c/20", duration_s=5.0), 50.0)
    assert v.checkpoint_io("run-1").save_s == 5.0, "its own timing, once it gives one"


def test_saves_and_restores_give_the_run_its_slowest_recent_pace() -> None:
    v = TelemetryView()
    feed(v, p.CheckpointCommitted(**H, rank=0, step=10, path="/c/10", duration_s=0.3, total_s=36.0,
                                  bytes=18_000_000_000), 1.0)
    feed(v, p.CheckpointCommitted(**H, rank=0, step=20, path="/c/20", duration_s=0.3, total_s=30.0,
                                  bytes=18_000_000_000), 2.0)
    feed(v, p.CheckpointCommitted(**H, rank=0, step=25, path="memory:1:25", duration_s=0.2, tier="memory"), 3.0)
    io = v.checkpoint_io("run-1")
    assert (io.save_s, io.save_gb_s, io.restore_gb_s) == (36.0, 0.5, None)  # an older sender's: its duration only
    feed(v, p.CheckpointRestored(**H, rank=0, step=25, path="memory:1:25", tier="memory", duration_s=2.0,
                                 bytes=18_000_000_000), 4.0)
    assert v.checkpoint_io("run-1").restore_gb_s == 9.0
    assert [type(i.msg).__name__ for i in v.peek_durable()] == [
        "CheckpointCommitted", "CheckpointCommitted", "CheckpointCommitted", "CheckpointRestored"]
    assert v.checkpoint_io("run-2").save_s is None


def test_an_output_phase_does_not_override_a_rank_that_speaks_for_itself() -> None:
    v = TelemetryView()
    feed(v, p.PhaseChange(**H, rank=0, phase=p.Phase.TRAIN, step=1), 1.0)
    v.phase_from_output("run-1", 1, 0, "compile", 2.0)
    v.phase_from_output("run-1", 1, 1, "compile", 2.0)
    ranks = v.ranks("run-1", 1)
    assert (ranks[0].phase, ranks[0].phase_at) == ("train", 1.0)
    assert (ranks[1].phase, ranks[1].phase_at) == ("compile", 2.0)
    v.phase_from_output("run-1", 1, 1, "compile", 3.0)
    assert v.ranks("run-1", 1)[1].phase_at == 2.0, "the same phase again is no new phase"


# --- bounds: what a run's own processes can make the daemon hold (issue 26, item 12) ---


def report_of(ranks: range) -> p.NodeReport:
    n = len(ranks)
    return p.NodeReport(**H, rank=0, node="n0", ranks=tuple(ranks), steps=(1,) * n,
                        phases=(p.Phase.TRAIN,) * n, ages=(0.0,) * n, step_times=(0.1,) * n, busy=(0.1,) * n)


def test_a_node_report_of_ranks_outside_the_world_makes_no_entries() -> None:
    """Before: each NodeReport made an entry per rank number it named (1,024 a message),
    whatever the attempt's world."""
    view, rank = sealed_view()
    view.expect("run-1", 1, 4)
    view.ingest(*rank.seal(report_of(range(1024))), 1.0)
    view.ingest(*Rank(9, rank.key).seal(p.Heartbeat(**H, rank=9, step=1, phase=p.Phase.TRAIN)), 1.0)
    assert view.ranks("run-1", 1) == {} and view.counts_now()["out_of_world"] == 2
    view.ingest(*rank.seal(report_of(range(4))), 2.0)
    assert sorted(view.ranks("run-1", 1)) == [0, 1, 2, 3]


def test_thousands_of_distinct_fault_actions_are_recorded_a_few_times_only() -> None:
    """Before: each distinct action grew a set and made an event row."""
    view, rank = sealed_view()
    for i in range(1000):
        view.ingest(*rank.seal(p.FaultInjected(**H, rank=0, action=f"nan@{i}", step=i, detail="x" * 100)), 1.0)
    assert view.durable_backlog() == 32


def test_a_message_replayed_after_a_daemon_restart_is_still_a_replay() -> None:
    """Before: replay state lived only in memory, so a captured sealed message was accepted
    once by the next daemon (issue 26, item 12)."""
    view, rank = sealed_view()
    captured = rank.seal(p.Heartbeat(**H, rank=0, step=3, phase=p.Phase.TRAIN))
    view.ingest(*captured, 1.0)
    view.ingest(*rank.seal(p.Heartbeat(**H, rank=0, step=4, phase=p.Phase.TRAIN)), 2.0)
    restarted = TelemetryView(cluster="c1", secret=SECRET)
    restarted.load_replay_marks(view.replay_marks())
    restarted.ingest(*captured, 3.0)
    assert restarted.counts_now()["replay"] == 1 and restarted.ranks("run-1", 1)[0].last_seen_at is None
    restarted.ingest(*rank.seal(p.Heartbeat(**H, rank=0, step=5, phase=p.Phase.TRAIN)), 4.0)
    assert restarted.ranks("run-1", 1)[0].last_seen_at == 4.0, "the rank's next message is taken"


# --- node agents (node/agent.py) ---------------------------------------------------

AH = {"run": "run-1", "attempt": 1, "ts": 0.0}


def agent_report(index: int, node: str, **slots: object) -> p.AgentReport:
    return p.AgentReport(**AH, index=index, node=node, pid=50 + index, hostname=node, **slots)  # type: ignore[arg-type]


def agent_will(key: bytes, index: int, conn: str) -> tuple[str, bytes]:
    return p.encode(p.AgentLost(**AH, index=index), cluster="c1", seal=p.Seal(key=key, conn=conn, seq=p.WILL_SEQ))


def test_an_agent_report_says_its_node_lives_and_fans_its_slots_out_to_the_ranks() -> None:
    v = TelemetryView()
    feed(v, agent_report(1, "node2", ranks=(2, 3), steps=(7, 6), phases=(p.Phase.TRAIN, p.Phase.TRAIN),
                         ages=(0.5, 0.0), step_times=(0.1, 0.1), busy=(0.08, 0.09)), 10.0)
    seen = v.agents("run-1", 1)["node2"]
    assert (seen.index, seen.pid, seen.last_seen_at, seen.lost) == (1, 51, 10.0, False)
    ranks = v.ranks("run-1", 1)
    assert {n: (r.node, r.last_step, r.last_seen_at) for n, r in ranks.items()} == {
        2: ("node2", 7, 9.5), 3: ("node2", 6, 10.0)}
    feed(v, agent_report(0, "node1"), 11.0)  # a trainer with no slots: the node, and no ranks
    assert set(v.agents("run-1", 1)) == {"node1", "node2"} and set(v.ranks("run-1", 1)) == {2, 3}
    v.forget("run-1", 1)
    assert v.agents("run-1", 1) == {}


def test_an_agents_last_will_counts_for_its_current_connection_only_and_never_for_a_rank() -> None:
    view = TelemetryView(cluster="c1", secret=SECRET)
    key = p.attempt_key(SECRET, "c1", "run-1", 1)
    agent = Rank(0, key, conn="00000000000000cc")
    view.ingest(*agent_will(key, 0, agent.conn), 0.5)  # nothing heard on that connection yet
    assert view.counts_now()["will_unattributed"] == 1 and view.agents("run-1", 1) == {}
    view.ingest(*agent.seal(agent_report(0, "node1")), 1.0)
    view.ingest(*agent_will(key, 0, agent.conn), 2.0)
    seen = view.agents("run-1", 1)["node1"]
    assert seen.lost and seen.lost_at == 2.0 and seen.last_seen_at == 1.0
    assert view.ranks("run-1", 1) == {}, "an agent's index is not a rank"
    view.ingest(*agent.seal(agent_report(0, "node1")), 3.0)  # it came back (a blip)
    assert not view.agents("run-1", 1)["node1"].lost


def test_an_agents_and_a_ranks_numbers_are_counted_apart_and_survive_a_restart() -> None:
    """Rank 0 and node 0's agent each count their own sequence numbers: neither is taken
    for a replay of the other, and a restarted daemon still refuses a replayed report."""
    view, rank = sealed_view()
    agent = Rank(0, p.attempt_key(SECRET, "c1", "run-1", 1), conn="00000000000000cc")
    for _ in range(5):
        view.ingest(*rank.seal(p.Heartbeat(**H, rank=0, step=3, phase=p.Phase.TRAIN)), 1.0)
    captured = agent.seal(agent_report(0, "node1"))
    view.ingest(*captured, 2.0)
    assert "replay" not in view.counts_now() and view.agents("run-1", 1)["node1"].last_seen_at == 2.0
    restarted = TelemetryView(cluster="c1", secret=SECRET)
    restarted.load_replay_marks(view.replay_marks())
    restarted.ingest(*captured, 3.0)
    assert restarted.counts_now()["replay"] == 1 and restarted.agents("run-1", 1) == {}
