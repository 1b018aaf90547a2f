"""The reconciler's wiring: a real SQLite store, a scripted launcher, a fake clock.

The policy's rules are tested in tests/unit/test_policy_*.py; these tests check that
the loop persists and acts on them, and that a restarted daemon neither loses an
attempt nor launches a second copy of one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import wire as p
from supervisor.domain import (
    AttemptOutcome,
    AttemptState,
    CommandKind,
    Node,
    NodeCommandKind,
    NodeState,
    ProcState,
    RunState,
)
from supervisor.errors import NotFound, SpecError
from supervisor.launchers.base import LaunchSpec
from supervisor.launchers.local import LocalLauncher
from supervisor.reconciler import Reconciler, ReconcilerConfig
from supervisor.service import SupervisorService
from supervisor.spec import parse_spec
from supervisor.store import SqlStore
from supervisor.telemetry.view import TelemetryView
from tests.fakes import ScriptedLauncher


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


SPEC = {"name": "wiring", "resources": {"nodes": 2, "ranks_per_node": 1, "spares": 1},
        "trainer": {"steps": 10}, "policy": {"fault_settle_s": 0.5}}


@pytest.fixture
def world(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = SqlStore(tmp_path / "supervisor.db")
    store.open()
    clock = Clock()
    launcher = ScriptedLauncher()
    telemetry = TelemetryView()
    telemetry.link_up(clock())
    rec = Reconciler(store, telemetry, ReconcilerConfig(mqtt_url="mqtt://127.0.0.1:1"), launcher=launcher,
                     nodes=launcher, clock=clock)
    service = SupervisorService(store, tmp_path / "runs", allow_root_runs=True, mqtt_url="mqtt://127.0.0.1:1",
                                launcher=LocalLauncher(max_nodes=8),
                                check_trainer=False, clock=clock)
    yield store, clock, launcher, telemetry, rec, service
    store.close()


def attempts(store: SqlStore, number: int = 1):  # type: ignore[no-untyped-def]
    with store.tx() as tx:
        return tx.list_attempts(number)


def kinds(store: SqlStore, number: int = 1) -> list[str]:
    with store.tx() as tx:
        return [e.kind for e in tx.list_events(number)]


def step(telemetry: TelemetryView, attempt: int, rank: int, n: int, now: float) -> None:
    msg = p.StepMetrics(run="run-1", attempt=attempt, rank=rank, ts=now, step=n, loss=1.0, grad_norm=1.0,
                        lr=0.1, step_time_s=0.1, tokens_per_s=1.0)
    telemetry.ingest(*p.encode(msg), now)


def make_checkpoint(root: Path, step_n: int) -> None:
    d = root / "runs" / "run-1" / "checkpoints" / f"step_{step_n:08d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    (d / "trainer_meta.json").write_text(json.dumps({"step": step_n}))

def command_run_training(world, root: Path) -> Path:  # type: ignore[no-untyped-def]
    """A [command] run submitted and ticked until its attempt runs; the path of its rank
    0's log (its folder made, the file not)."""
    store, _, _, _, rec, service = world
    service.submit(parse_spec({"name": "wiring", "resources": {"nodes": 1, "ranks_per_node": 1},
                               "command": {"argv": ["sh", "-c", "true"], "steps": 10_000,
                                           "checkpoint_dir": "{run_dir}/checkpoints"}}))
    for _ in range(3):
        rec.tick()
    assert attempts(store)[0].state is AttemptState.RUNNING
    log = root / "runs" / "run-1" / "attempts" / "1" / "rank-0000.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return log



def test_a_run_from_submit_through_a_fault_to_success(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()  # allocates 3 nodes
    rec.tick()  # launches on the first 2
    [a1] = attempts(store)
    assert a1.state is AttemptState.RUNNING and a1.nodes == ("node-1", "node-2") and a1.resume_from is None
    [spec1] = launcher.started
    assert spec1.env["TSUP_RUN_ID"] == "run-1" and spec1.env["TSUP_ATTEMPT"] == "1"
    assert json.loads(Path(spec1.marker).read_text())["checkpoint"]["dir"].endswith("run-1/checkpoints")

    for r in (0, 1):
        step(telemetry, 1, r, 5, clock())
    clock.t += 1
    rec.tick()
    with store.tx() as tx:
        assert tx.get_run(1).state is RunState.RUNNING
        assert [m.step for m in tx.list_metrics(1)] == [5]  # rank 0's metrics are persisted

    make_checkpoint(tmp_path, 4)
    assert a1.launch_info is not None
    launcher.kill_node(a1.launch_info, "node-2")
    rec.tick()  # the death is seen; attribution waits for the settle window
    assert attempts(store)[0].state is AttemptState.RUNNING
    clock.t += 1
    rec.tick()  # fault recorded, attempt stopped with SIGKILL
    assert attempts(store)[0].state is AttemptState.STOPPING and launcher.stops[-1][1] is True
    clock.t += 1
    rec.tick()  # every process gone: ended, and attempt 2 launched from the checkpoint on the spare
    a1, a2 = attempts(store)
    assert a1.outcome is AttemptOutcome.FAILED and a2.resume_step == 4 and a2.nodes == ("node-1", "node-3")
    with store.tx() as tx:
        [fault] = tx.list_faults(1)  # the node's rank vanished, and the node's own process with it
        assert (fault.kind.value, fault.ranks, fault.nodes) == ("node-lost", (1,), ("node-2",))
        assert fault.recovered_at is None
        assert tx.get_node("node-2").state is NodeState.DRAINED
        assert tx.get_run(1).state is RunState.RECOVERING

    step(telemetry, 2, 0, 5, clock())
    clock.t += 1
    rec.tick()
    with store.tx() as tx:
        assert tx.list_faults(1)[0].recovered_at == clock()
        assert tx.get_run(1).state is RunState.RUNNING

    out = tmp_path / "runs" / "run-1" / "output"
    out.mkdir(parents=True)
    (out / "result.json").write_text(json.dumps({"final_step": 10, "model_digest": "abc", "run_id": "run-1",
                                                 "attempt": 2}))
    info2 = json.dumps({"attempt": 2, "nodes": ["node-1", "node-3"], "rpn": 1})
    launcher.procs[info2] = {0: (ProcState.EXITED, 0), 1: (ProcState.EXITED, 0)}
    clock.t += 1
    rec.tick()
    with store.tx() as tx:
        run = tx.get_run(1)
        assert (run.state, run.final_step, run.model_digest) == (RunState.SUCCEEDED, 10, "abc")
        assert {n.name: n.state for n in tx.list_nodes()} == {
            "node-1": NodeState.IDLE, "node-2": NodeState.DRAINED, "node-3": NodeState.IDLE}
    assert kinds(store)[:3] == ["run.submitted", "nodes.allocated", "attempt.launching"]
    assert {"attempt.started", "fault.detected", "attempt.stopping", "attempt.ended",
            "run.recovered"} <= set(kinds(store))


def test_restart_with_an_unrecorded_launch_adopts_instead_of_launching_again(world) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    [a1] = attempts(store)
    # Pretend the daemon died after launching but before recording the launch.
    with store.tx() as tx:
        tx.update_attempt(1, 1, state=AttemptState.LAUNCHING, launch_info=None)
    fresh = Reconciler(store, telemetry, rec.config, launcher=launcher, nodes=launcher, clock=clock)
    fresh.tick()
    [a1] = attempts(store)
    assert a1.state is AttemptState.RUNNING and a1.launch_info is not None
    assert len(launcher.started) == 1, "no duplicate launch"
    assert "attempt.adopted" in kinds(store)


def test_restart_with_a_launch_that_never_happened_aborts_it_and_relaunches_from_the_checkpoint(
        world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    make_checkpoint(tmp_path, 8)
    [a1] = attempts(store)
    launcher.vanish(a1.launch_info)  # the daemon died before starting any process of it
    with store.tx() as tx:
        tx.update_attempt(1, 1, state=AttemptState.LAUNCHING, launch_info=None)
    fresh = Reconciler(store, telemetry, rec.config, launcher=launcher, nodes=launcher, clock=clock)
    fresh.tick()
    a1, a2 = attempts(store)
    assert a1.outcome is AttemptOutcome.ABORTED and a2.state is AttemptState.RUNNING
    assert a2.resume_step == 8, "an aborted launch must not throw the progress away"
    assert len(launcher.started) == 2


def test_a_partly_started_world_is_killed_not_adopted(world) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    [a1] = attempts(store)
    half = json.dumps({"attempt": 1, "nodes": ["node-1"], "rpn": 1})  # 1 of the 2 ranks came up
    launcher.vanish(a1.launch_info)
    launcher.procs[half] = {0: (ProcState.RUNNING, None)}
    launcher.cluster.markers[launcher.started[0].marker] = half
    with store.tx() as tx:
        tx.update_attempt(1, 1, state=AttemptState.LAUNCHING, launch_info=None)
    Reconciler(store, telemetry, rec.config, launcher=launcher, nodes=launcher, clock=clock).tick()
    assert (half, True) in launcher.stops
    a1, a2 = attempts(store)
    assert a1.outcome is AttemptOutcome.ABORTED and a2.state is AttemptState.RUNNING


def test_a_short_spike_is_said_once_by_this_daemon_and_by_the_next(world) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec({**SPEC, "trainer": {"steps": 100}}))
    rec.tick()
    rec.tick()
    for n in range(1, 41):  # one step at step 30 with three times the loss: shorter than spike_persist_steps
        for r in (0, 1):
            msg = p.StepMetrics(run="run-1", attempt=1, rank=r, ts=clock(), step=n, loss=3.0 if n == 30 else 1.0,
                                grad_norm=1.0, lr=0.1, step_time_s=0.1, tokens_per_s=1.0)
            telemetry.ingest(*p.encode(msg), clock())
        clock.t += 0.2
        rec.tick()
    for _ in range(3):
        clock.t += 0.2
        rec.tick()
    Reconciler(store, telemetry, rec.config, launcher=launcher, nodes=launcher, clock=clock).tick()
    with store.tx() as tx:
        said = [e.data for e in tx.list_events(1, kind="spike.transient")]
    assert [(d["attempt"], d["step"]) for d in said] == [(1, 30)]


class DiesAtForget(ScriptedLauncher):
    """A daemon killed after recording an attempt's end, before acting on it."""

    def forget(self, launch_info: str) -> None:
        raise SystemExit("killed")


def test_an_end_recorded_by_a_daemon_that_died_before_acting_is_let_go_of_by_the_next(world) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    [a1] = attempts(store)
    dying = DiesAtForget(launcher.cluster)
    doomed = Reconciler(store, telemetry, rec.config, launcher=dying, nodes=dying, clock=clock)
    launcher.cluster.procs[a1.launch_info] = {0: (ProcState.EXITED, 1), 1: (ProcState.EXITED, 1)}
    clock.t += 1
    with pytest.raises(SystemExit):
        for _ in range(5):  # the fault, then the attempt's end; the act kills the daemon
            doomed.tick()
            clock.t += 1
    a1, *_ = attempts(store)
    assert a1.state is AttemptState.ENDED, "the end was recorded before the daemon died"

    fresh = launcher.fresh()
    Reconciler(store, telemetry, rec.config, launcher=fresh, nodes=fresh, clock=clock).tick()
    assert fresh.forgotten == [a1.launch_info], "its node agents would live on with nothing to end them"
    again = launcher.fresh()
    Reconciler(store, telemetry, rec.config, launcher=again, nodes=again, clock=clock).tick()
    assert again.forgotten == [], "an attempt is let go of once"


def test_every_ended_attempt_is_let_go_of_once(world) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    [a1] = attempts(store)
    launcher.cluster.procs[a1.launch_info] = {0: (ProcState.EXITED, 1), 1: (ProcState.EXITED, 1)}
    for _ in range(6):
        clock.t += 1
        rec.tick()
    a1, a2, *_ = attempts(store)
    assert a1.state is AttemptState.ENDED and a2.state is AttemptState.RUNNING
    assert launcher.forgotten == [a1.launch_info]


class FailingLauncher(ScriptedLauncher):
    def start(self, spec: LaunchSpec) -> str:
        raise OSError(28, "No space left on device")


def test_an_os_error_at_launch_is_a_launch_fault_within_the_budget(tmp_path: Path) -> None:
    store = SqlStore(tmp_path / "supervisor.db")
    store.open()
    clock = Clock()
    failing = FailingLauncher()
    rec = Reconciler(store, TelemetryView(), ReconcilerConfig(mqtt_url=None), launcher=failing, nodes=failing, clock=clock)
    service = SupervisorService(store, tmp_path / "runs", allow_root_runs=True, mqtt_url=None, launcher=LocalLauncher(max_nodes=8),
                                check_trainer=False, clock=clock)
    service.submit(parse_spec({**SPEC, "policy": {"failures_without_progress": 3, "crash_loop_attempts": 5}}))
    for _ in range(12):
        rec.tick()
        clock.t += 20  # past the backoff between attempts that made no progress
    with store.tx() as tx:
        run = tx.get_run(1)
        faults = tx.list_faults(1)
    assert run.state is RunState.FAILED and run.reason.startswith("no progress: 3 failed attempts in a row")
    assert len(faults) == 3 and all("No space left" in f.summary for f in faults)
    store.close()


def test_a_result_from_another_run_is_no_success(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    [a1] = attempts(store)
    out = tmp_path / "runs" / "run-1" / "output"
    out.mkdir(parents=True)
    (out / "result.json").write_text(json.dumps({"final_step": 10, "model_digest": "old", "run_id": "run-7",
                                                 "attempt": 1}))
    launcher.procs[a1.launch_info] = {0: (ProcState.EXITED, 0), 1: (ProcState.EXITED, 0)}
    rec.tick()
    with store.tx() as tx:
        assert tx.get_run(1).state is RunState.RECOVERING
        assert tx.list_faults(1)[0].kind.value == "no-result"


def test_cancel_through_the_service_stops_gracefully(world) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    accepted = service.request("run-1", CommandKind.CANCEL)
    rec.tick()
    assert service.command_result(accepted.command_id) == "accepted"
    assert launcher.stops[-1][1] is False  # SIGTERM first
    clock.t += 1
    rec.tick()
    with store.tx() as tx:
        assert tx.get_run(1).state is RunState.CANCELLED
    assert attempts(store)[0].outcome is AttemptOutcome.STOPPED
    assert service.request("run-1", CommandKind.RESUME).command_id
    rec.tick()
    assert len(launcher.started) == 1, "a cancelled run is never restarted"


def test_restart_through_the_service_stops_gracefully_and_starts_the_next_attempt(world) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    step(telemetry, 1, 0, 1, clock())
    rec.tick()
    accepted = service.request("run-1", CommandKind.RESTART)
    rec.tick()
    assert service.command_result(accepted.command_id) == "accepted"
    assert launcher.stops[-1][1] is False  # SIGTERM first
    clock.t += 1
    rec.tick()
    rec.tick()
    a1, a2 = attempts(store)
    assert (a1.outcome, a1.reason) == (AttemptOutcome.STOPPED, "restarted by operator")
    assert a2.state in (AttemptState.LAUNCHING, AttemptState.RUNNING) and a2.nodes == a1.nodes
    with store.tx() as tx:
        assert tx.get_run(1).state is RunState.RECOVERING and tx.list_faults(1) == []


def test_resume_from_an_older_step_sets_the_newer_checkpoints_aside(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    for n in (4, 8):
        make_checkpoint(tmp_path, n)
    service.request("run-1", CommandKind.PAUSE)
    rec.tick()
    clock.t += 1
    rec.tick()
    with store.tx() as tx:
        assert tx.get_run(1).state is RunState.PAUSED
    with pytest.raises(NotFound, match=r"no complete checkpoint of step 6; complete checkpoints at steps: 4, 8"):
        service.request("run-1", CommandKind.RESUME, from_step=6)
    with pytest.raises(SpecError, match="from_step is for resume"):
        service.request("run-1", CommandKind.RESTART, from_step=4)
    accepted = service.request("run-1", CommandKind.RESUME, from_step=4)
    rec.tick()
    assert service.command_result(accepted.command_id) == "accepted"
    checkpoints = tmp_path / "runs" / "run-1" / "checkpoints"
    assert sorted(x.name for x in checkpoints.iterdir() if x.name.startswith("step_")) == ["step_00000004"]
    assert [x.name for x in (checkpoints / ".set-aside").glob("*/step_*")] == ["step_00000008"], "moved, not deleted"
    rec.tick()
    rec.tick()
    a1, a2 = attempts(store)
    assert a2.resume_step == 4 and a2.resume_from is not None and a2.resume_from.endswith("step_00000004")
    with store.tx() as tx:
        assert "resumed by operator from the checkpoint of step 4" in [e.message.split(": ", 1)[-1]
                                                                      for e in tx.list_events(1)]


def test_an_operator_drains_a_node_in_use_and_the_next_attempt_leaves_it_out(world) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    [a1] = attempts(store)
    drained = a1.nodes[1]
    accepted = service.request_node(drained, NodeCommandKind.DRAIN, "fan failure, ticket 42")
    rec.tick()
    assert service.command_result(accepted.command_id) == "accepted"
    assert launcher.drains == [(drained, "operator: fan failure, ticket 42")]
    with store.tx() as tx:
        node = tx.get_node(drained)
        events = [e.message for e in tx.list_events(1, kind="node.drained")]
    assert (node.state, node.reason, node.run_number) == (NodeState.DRAINED, "operator: fan failure, ticket 42", 1)
    assert events == [f"node {drained} drained: operator: fan failure, ticket 42; run-1 trains on, "
                      "its next attempt leaves it out"]
    assert attempts(store)[0].state is AttemptState.RUNNING, "a drain stops nothing"

    launcher.procs[a1.launch_info][0] = (ProcState.EXITED, 1)  # a crash: the spare replaces the drained node
    for _ in range(3):
        clock.t += 1
        rec.tick()
    assert len(attempts(store)) == 2 and attempts(store)[-1].nodes == (a1.nodes[0], "node-3")

    again = service.request_node(drained, NodeCommandKind.UNDRAIN, "fan replaced")
    rec.tick()
    assert service.command_result(again.command_id) == "accepted" and launcher.undrains == [drained]
    with store.tx() as tx:
        assert tx.get_node(drained).state is NodeState.IDLE
        [returned] = tx.list_events(1, kind="node.returned")
    assert "returned to service by an operator: fan replaced" in returned.message
    nope = service.request_node(drained, NodeCommandKind.UNDRAIN)
    rec.tick()
    assert service.command_result(nope.command_id) == f"rejected: {drained} is IDLE, not drained"


def test_a_drain_the_cluster_refuses_is_sent_again_every_tick_until_it_shows(world) -> None:  # type: ignore[no-untyped-def]
    """The intent protocol: recorded with the decision, sent, and sent again (at most every
    RESEND_S) until the cluster shows it; the failure is said once, not every tick."""
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    rec.tick()
    node = attempts(store)[0].nodes[0]
    launcher.refuse.add(node)
    accepted = service.request_node(node, NodeCommandKind.DRAIN, "suspect")
    rec.tick()
    assert service.command_result(accepted.command_id) == "accepted"
    with store.tx() as tx:
        assert tx.get_node(node).state is NodeState.DRAINED, "the supervisor's own record: drained at once"
        intent = tx.intent(node)
        assert intent is not None and intent.confirmed_at is None and intent.sent == 1
        assert intent.last_error == f"cannot drain {node}: scontrol: Invalid node name specified"
    for _ in range(3):  # within RESEND_S: not sent again
        clock.t += 0.25
        rec.tick()
    with store.tx() as tx:
        assert tx.intent(node).sent == 1  # type: ignore[union-attr]
    clock.t += 1.0
    rec.tick()
    with store.tx() as tx:
        assert tx.intent(node).sent == 2  # type: ignore[union-attr]
    assert launcher.drains == []
    launcher.refuse.clear()  # the controller takes it now
    clock.t += 1.0
    rec.tick()
    assert launcher.drains == [(node, "operator: suspect")] and launcher.drained(node)
    with store.tx() as tx:
        intent = tx.intent(node)
        assert intent is not None and intent.confirmed_at == clock.t and intent.sent == 3
        failures = tx.list_events(1, kind="node.drain_failed")
    assert len(failures) == 1, "said once, not at every send"
    clock.t += 5
    rec.tick()
    assert launcher.drains == [(node, "operator: suspect")], "confirmed: never sent again"


def test_a_drain_lost_with_the_daemon_is_sent_by_the_next(world) -> None:  # type: ignore[no-untyped-def]
    """Recorded before it is sent: a daemon killed in between leaves the intent, and the next
    daemon sends it (and confirms one the cluster already shows, sending nothing)."""
    store, clock, launcher, telemetry, rec, service = world
    with store.tx() as tx:
        for name in ("n1", "n2"):
            tx.put_node(Node(name=name, state=NodeState.DRAINED, reason="training-supervisor: probe: bad"), clock())
            tx.want(name, "drain", "training-supervisor: probe: bad", clock())
    launcher.drained_now.add("n2")  # sent before the crash, and applied
    Reconciler(store, telemetry, rec.config, launcher=launcher, nodes=launcher, clock=clock).tick()
    assert launcher.drains == [("n1", "training-supervisor: probe: bad")]
    with store.tx() as tx:
        assert tx.pending_intents() == []


def test_an_auto_checkpoint_interval_is_set_at_each_attempt_from_what_was_measured(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    spec = {**SPEC, "trainer": {"steps": 10_000, "checkpoint": {"every_steps": "auto"}},
            "policy": {"fault_settle_s": 0.5, "failures_per_node_day": 50}}
    service.submit(parse_spec(spec))
    rec.tick()
    rec.tick()
    [a1] = attempts(store)
    config = json.loads((tmp_path / "runs" / "run-1" / "attempts" / "1" / "trainer.json").read_text())
    assert config["checkpoint"]["every_steps"] == 50, "nothing measured yet: the first attempt's interval"
    for n in range(1, 31):  # what rank 0 reports, recorded by the next tick
        telemetry.ingest(*p.encode(p.StepMetrics(run="run-1", attempt=1, rank=0, ts=0.0, step=n, loss=1.0,
                                                 grad_norm=1.0, lr=0.1, step_time_s=0.1, tokens_per_s=1.0)), clock())
    telemetry.ingest(*p.encode(p.CheckpointCommitted(run="run-1", attempt=1, rank=0, ts=0.0, step=20, path="/ck/20",
                                                     duration_s=0.5)), clock())
    launcher.procs[a1.launch_info][0] = (ProcState.EXITED, 1)
    for _ in range(3):
        clock.t += 1
        rec.tick()
    assert len(attempts(store)) == 2
    config = json.loads((tmp_path / "runs" / "run-1" / "attempts" / "2" / "trainer.json").read_text())
    # 2 nodes at 50 failures a node-day: MTBF 864 s; sqrt(2 x 0.5 s x 864 s) = 29.4 s = 294 steps of 0.1 s
    assert config["checkpoint"]["every_steps"] == 294
    with store.tx() as tx:
        said = [e.message for e in tx.list_events(1, kind="checkpoint.interval")]
    assert said[0] == "checkpoint every 50 steps until a checkpoint and steps are timed"
    assert said[1].startswith("checkpoint every 294 steps: Young/Daly sqrt(2 x 0.50 s a checkpoint x MTBF 0.2 h")


def test_a_drain_and_an_undrain_queued_together_are_carried_out_in_order(world) -> None:  # type: ignore[no-untyped-def]
    store, clock, launcher, telemetry, rec, service = world
    service.submit(parse_spec(SPEC))
    rec.tick()
    node = "node-3"  # the spare
    drain = service.request_node(node, NodeCommandKind.DRAIN, "reseat the cable")
    undrain = service.request_node(node, NodeCommandKind.UNDRAIN, "done")
    rec.tick()
    assert (service.command_result(drain.command_id), service.command_result(undrain.command_id)) == (
        "accepted", "accepted")
    with store.tx() as tx:
        assert tx.get_node(node).state is NodeState.IDLE
        assert tx.pending_intents() == []
    # Level-triggered: the newest wish (in service) is what the cluster already shows; the
    # drain that it replaced before anything was sent never reaches the cluster.
    assert not launcher.drained(node) and launcher.drains == []


def test_a_restarted_reconciler_reads_a_commands_logs_on_from_the_offsets_the_store_kept(  # type: ignore[no-untyped-def]
        world, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37, item 5: a restarted daemon read every log of a live [command] attempt
    from its start again (weeks of output, a tick's worth at a time, its old steps
    replayed as new). The offsets are kept in the store every OFFSETS_EVERY_S."""
    from supervisor import user_files
    from supervisor.gathering.output_progress import OFFSETS_EVERY_S

    store, clock, launcher, telemetry, rec, service = world
    log = command_run_training(world, tmp_path)
    line = "Batch {} Loss: 2.0, Speed: 1 samples/sec, lr: 0.1\n"
    log.write_text("".join(line.format(i) for i in range(500)))
    clock.t += OFFSETS_EVERY_S
    rec.tick()
    kept = json.loads(attempts(store)[0].output_offsets or "{}")
    assert kept == {"rank-0000.log": log.stat().st_size}
    with open(log, "a") as f:
        f.write(line.format(500))
    restarted = Reconciler(store, telemetry, ReconcilerConfig(mqtt_url="mqtt://127.0.0.1:1"), launcher=launcher,
                           nodes=launcher, clock=clock)
    reads: list[int] = []
    read_bytes = user_files.read_bytes

    def spy(path: Path, limit: int, *, base: Path | None = None, offset: int = 0) -> bytes:
        reads.append(offset)
        return read_bytes(path, limit, base=base, offset=offset)

    monkeypatch.setattr(user_files, "read_bytes", spy)
    clock.t += 1
    restarted.tick()
    assert reads == [kept["rank-0000.log"]], "read on from where the last daemon was, not from 0"
    output = restarted.memory.attempt(1, 1).output
    assert output.ranks[0].step == 501 and output.files["rank-0000.log"].offset == log.stat().st_size


def test_a_commands_output_reaches_the_view_before_observe_which_writes_nothing_to_it(  # type: ignore[no-untyped-def]
        world, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reconciler feeds the telemetry view (supervisor/gathering/feed.py) before it
    observes: the steps a [command] trainer printed are in the view when observe reads
    it, and observe itself writes nothing there."""
    store, clock, launcher, telemetry, rec, service = world
    log = command_run_training(world, tmp_path)
    log.write_text("".join(f"Batch {i} Loss: 2.0, Speed: 1 samples/sec, lr: 0.1\n" for i in range(7)))

    observing = False
    seen_in_view: list[int] = []
    observe = rec.observer.observe

    def watched_observe(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal observing
        seen_in_view.append(telemetry.max_step("run-1", 1))
        observing = True
        try:
            return observe(*args, **kwargs)
        finally:
            observing = False

    writes: list[str] = []
    for name in ("expect", "apply_from_output", "phase_from_output", "apply", "ingest"):
        original = getattr(TelemetryView, name)

        def guarded(self, *args, _name=name, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            if observing:
                writes.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TelemetryView, name, guarded)
    monkeypatch.setattr(rec.observer, "observe", watched_observe)
    clock.t += 1
    rec.tick()
    assert seen_in_view == [7], "the printed steps are in the view when observe reads it"
    assert writes == [], f"observe wrote to the telemetry view: {writes}"
