"""Node probes in the reconciler: preflight and diagnosis rounds run off the loop and hold
the run's launch until judged; the periodic sweep drains idle nodes and returns nodes this
supervisor drained once they probe clean (a real SQLite store, a scripted launcher)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import pytest

from health.links import PairResult, ring_rounds
from supervisor.domain import DrainBudget, Node, NodeCommandKind, NodeState, RunState
from supervisor.errors import NotFound
from supervisor.launchers.local import LocalLauncher
from supervisor.link_steps import LinkTest
from supervisor.reconciler import Reconciler, ReconcilerConfig
from supervisor.service import SupervisorService
from supervisor.spec import parse_spec
from supervisor.store import SqlStore
from supervisor.telemetry.view import TelemetryView
from tests.fakes import ScriptedLauncher
from tests.integration.test_reconciler import SPEC, Clock, kinds


class HeldExecutor(Executor):
    """Runs a submitted call only when the test says so: a probe 'in flight'."""

    def __init__(self) -> None:
        self.held: list[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:  # type: ignore[override]
        f: Future[Any] = Future()
        self.held.append((f, fn, args, kwargs))
        return f

    def finish(self) -> int:
        done, self.held = self.held, []
        for f, fn, args, kwargs in done:
            f.set_result(fn(*args, **kwargs))
        return len(done)


class ProbedLauncher(ScriptedLauncher):
    """Every node answers with the next status scripted for it (healthy once the script ends)."""

    def __init__(self, script: Mapping[str, list[str]]) -> None:
        super().__init__()
        self.script = {k: list(v) for k, v in script.items()}
        self.probed: list[tuple[str, ...]] = []
        self.drained_probes: list[dict[str, str]] = []
        self.drains: list[tuple[str, str]] = []
        self.reboots: list[bool] = []  # each drain's: a reboot is the fix (HyperPod: Action:Reboot)
        self.undrained: list[str] = []
        self.slow_links: set[str] = set()
        self.link_tests: list[tuple[str, ...]] = []  # the nodes of each link test

    def _answer(self, node: str) -> str:
        queue = self.script.get(node, [])
        status = queue.pop(0) if queue else "healthy"
        reason = "" if status == "healthy" else f"neuron-monitor: mem_ecc_uncorrected=1 on {node}"
        return json.dumps({"node": node, "status": status, "action": "replace" if reason else "none",
                           "reason": reason, "findings": []})

    def probe(self, nodes: Sequence[str], argv: Sequence[str], *, allocation_info: str | None,
              timeout_s: float) -> dict[str, str]:
        self.probed.append(tuple(nodes))
        return {n: self._answer(n) for n in nodes}

    def probe_drained(self, nodes: Mapping[str, str], argv: Sequence[str], *,
                      timeout_s: float) -> dict[str, str]:
        self.drained_probes.append(dict(nodes))
        return {n: self._answer(n) for n in nodes}

    def probe_links(self, test: LinkTest, *, allocation_info: str | None,
                    timeout_s: float) -> list[PairResult]:
        """Each pair of the ring at 1.2 GB/s, or at 0.5 MB/s where a node of ``slow_links`` is in it."""
        self.link_tests.append(test.over)
        return [PairResult(p, 0.0005 if self.slow_links & set(p) else 1.2) for r in ring_rounds(test.over) for p in r]

    def drain(self, node: str, reason: str, *, reboot: bool = False) -> None:
        self.drains.append((node, reason))
        self.reboots.append(reboot)
        self.drained_now.add(node)

    def undrain(self, node: str) -> None:
        self.undrained.append(node)
        self.drained_now.discard(node)


def make(tmp_path: Path, launcher: ProbedLauncher, **config: Any) -> tuple[SqlStore, Clock, Reconciler,
                                                                            HeldExecutor]:
    store = SqlStore(tmp_path / "supervisor.db")
    store.open()
    clock = Clock()
    rec, pool = reconciler_on(store, launcher, clock, **config)
    return store, clock, rec, pool


def reconciler_on(store: SqlStore, launcher: ProbedLauncher, clock: Clock,
                  **config: Any) -> tuple[Reconciler, HeldExecutor]:
    """A daemon's reconciler on ``store`` (a restarted one, when another was there), its
    probes held until the test says."""
    telemetry = TelemetryView()
    telemetry.link_up(clock())
    pool = HeldExecutor()
    rec = Reconciler(store, telemetry, ReconcilerConfig(mqtt_url="mqtt://127.0.0.1:1", **config),
                     launcher=launcher, nodes=launcher, clock=clock, probe_pool=pool)
    return rec, pool


def preflighted(tmp_path: Path, store: SqlStore, clock: Clock, rec: Reconciler,
                **service: Any) -> SupervisorService:
    """The service, and a run of the example spec with ``[health] preflight`` submitted
    through it: two ticks later its nodes are allocated and their preflight round asked for."""
    local = LocalLauncher(max_nodes=8)
    out = SupervisorService(store, tmp_path / "runs", allow_root_runs=True, mqtt_url="mqtt://127.0.0.1:1",
                            launcher=local, check_trainer=False, clock=clock, **service)
    out.submit(parse_spec({**SPEC, "health": {"preflight": True}}))
    rec.tick()
    rec.tick()
    return out


def node_states(store: SqlStore) -> dict[str, tuple[NodeState, str]]:
    with store.tx() as tx:
        return {n.name: (n.state, n.reason) for n in tx.list_nodes()}


def test_preflight_holds_the_launch_until_the_nodes_are_judged_and_drains_a_confirmed_bad_one(
        tmp_path: Path) -> None:
    launcher = ProbedLauncher({"node-2": ["unhealthy", "unhealthy"]})
    store, clock, rec, pool = make(tmp_path, launcher)
    preflighted(tmp_path, store, clock, rec)  # node-1..3 allocated, seen new: their preflight round in flight
    assert len(pool.held) == 1 and launcher.started == []
    for _ in range(3):  # however long the probes take, nothing launches meanwhile
        clock.t += 5
        rec.tick()
    assert launcher.started == [] and "probe.started" in kinds(store)
    assert pool.finish() == 1
    rec.tick()  # node-2 bad once: probed again at once, still no launch
    assert launcher.started == [] and len(pool.held) == 1
    assert pool.finish() == 1 and launcher.probed[-1] == ("node-2",)
    rec.tick()  # confirmed: drained; the run now has 2 healthy nodes and launches on them
    assert node_states(store)["node-2"][0] is NodeState.DRAINED
    assert launcher.drains[0][0] == "node-2" and "mem_ecc_uncorrected=1" in launcher.drains[0][1]
    assert "(run-1, preflight)" in launcher.drains[0][1]
    rec.tick()
    assert [s.nodes for s in launcher.started] == [("node-1", "node-3")]
    with store.tx() as tx:
        assert tx.get_run(1).state is RunState.STARTING
        assert [p.status for p in tx.recent_probes("node-2", 5)] == ["unhealthy", "unhealthy"]


def test_a_node_on_a_slow_link_is_named_by_the_link_test_confirmed_against_the_others_and_drained(
        tmp_path: Path) -> None:
    """Every node's own probe is healthy; the link test of the preflight finds node-2's
    pairs slow against the others'. The confirmation probes node-2 alone, and its link
    test runs over all the run's nodes again (the others are its baseline)."""
    launcher = ProbedLauncher({})
    launcher.slow_links = {"node-2"}
    store, clock, rec, pool = make(tmp_path, launcher)
    preflighted(tmp_path, store, clock, rec)
    assert pool.finish() == 1
    rec.tick()
    assert pool.finish() == 1 and launcher.probed[-1] == ("node-2",)
    rec.tick()
    assert launcher.link_tests == [("node-1", "node-2", "node-3")] * 2
    [(node, reason)] = launcher.drains
    assert node == "node-2" and reason.startswith("training-supervisor: probe: links: best pair")
    assert "0.0005 GB/s" in reason and "median of 3 nodes' best pairs, 1.2 GB/s" in reason
    rec.tick()
    assert [s.nodes for s in launcher.started] == [("node-1", "node-3")]
    with store.tx() as tx:
        assert [p.status for p in tx.recent_probes("node-1", 5)] == ["healthy"]
        # Each node's figure in each round (its best pair) is kept with its result: the
        # nodes that were probed, newest first.
        assert [p.link_gbps for p in tx.recent_probes("node-2", 5)] == [0.0005, 0.0005]
        assert tx.link_figures("node-1") == [1.2] and tx.link_figures("node-2") == [0.0005, 0.0005]
    service = SupervisorService(store, tmp_path / "runs", allow_root_runs=True, mqtt_url="mqtt://127.0.0.1:1",
                                launcher=LocalLauncher(max_nodes=8), check_trainer=False, clock=clock)
    link = {n.name: n.link for n in service.nodes()}
    assert link["node-2"] is not None and (link["node-2"].newest_gbps, link["node-2"].samples) == (0.0005, 2)
    assert link["node-1"] is not None and link["node-1"].median_gbps == 1.2


def test_without_links_in_the_spec_no_link_test_runs(tmp_path: Path) -> None:
    launcher = ProbedLauncher({})
    launcher.slow_links = {"node-2"}
    store, clock, rec, pool = make(tmp_path, launcher)
    local = LocalLauncher(max_nodes=8)
    service = SupervisorService(store, tmp_path / "runs", allow_root_runs=True, mqtt_url="mqtt://127.0.0.1:1",
                                launcher=local, check_trainer=False, clock=clock)
    service.submit(parse_spec({**SPEC, "health": {"preflight": True, "links": False}}))
    rec.tick()
    rec.tick()
    assert pool.finish() == 1
    rec.tick()
    rec.tick()
    assert launcher.link_tests == [] and launcher.drains == []
    assert [s.nodes for s in launcher.started] == [("node-1", "node-2")]


@pytest.mark.parametrize(("status", "reboot"), [("unhealthy", False), ("unknown", True)])
def test_a_node_whose_probe_cannot_tell_twice_is_drained_for_a_reboot_not_a_replacement(
        tmp_path: Path, status: str, reboot: bool) -> None:
    """Confirmed unhealthy with the tool's "replace": replaced. Confirmed unknown (the probe
    hung, or found no tool) says nothing about the hardware: a reboot, never a replacement."""
    launcher = ProbedLauncher({"node-2": [status, status]})
    store, clock, rec, pool = make(tmp_path, launcher)
    preflighted(tmp_path, store, clock, rec)
    for _ in range(2):  # the round, then the confirmation
        assert pool.finish() == 1
        rec.tick()
    assert [d[0] for d in launcher.drains] == ["node-2"] and launcher.reboots == [reboot]


def test_one_flaky_preflight_result_drains_nothing(tmp_path: Path) -> None:
    launcher = ProbedLauncher({"node-1": ["unknown"]})
    store, clock, rec, pool = make(tmp_path, launcher)
    preflighted(tmp_path, store, clock, rec)
    pool.finish()
    rec.tick()
    pool.finish()  # the confirmation round: healthy
    rec.tick()
    rec.tick()
    assert launcher.drains == [] and [s.nodes for s in launcher.started] == [("node-1", "node-2")]


def seed(store: SqlStore, *nodes: Node) -> None:
    with store.tx() as tx:
        for n in nodes:
            tx.put_node(n, 0.0)


def test_the_sweep_drains_a_bad_idle_node_and_returns_a_clean_one_it_drained(tmp_path: Path) -> None:
    ours = "training-supervisor: probe: neuron-ls: 15 of 16 devices (run-1, preflight)"
    launcher = ProbedLauncher({"idle-1": ["unhealthy", "unhealthy"], "drained-1": ["healthy", "degraded"]})
    store, clock, rec, pool = make(tmp_path, launcher, sweep_every_s=60.0, return_after=2)
    seed(store, Node(name="idle-1", state=NodeState.IDLE), Node(name="idle-2", state=NodeState.IDLE),
         Node(name="drained-1", state=NodeState.DRAINED, reason=ours),
         Node(name="by-hand", state=NodeState.DRAINED, reason="memory upgrade"))
    launcher.drained_now.update({"drained-1", "by-hand"})  # what the cluster shows
    rec.tick()
    assert pool.held == []  # the first sweep comes one interval after start
    clock.t += 61
    rec.tick()
    pool.finish()
    assert launcher.probed == [("idle-1", "idle-2")]
    assert launcher.drained_probes == [{"drained-1": ours}]  # never the node an operator drained
    rec.tick()  # idle-1 bad once: again at once; drained-1 clean once: not yet back
    pool.finish()
    rec.tick()
    states = node_states(store)
    assert states["idle-1"][0] is NodeState.DRAINED and states["idle-1"][1].endswith("(sweep)")
    assert states["drained-1"][0] is NodeState.DRAINED and states["idle-2"][0] is NodeState.IDLE
    assert states["by-hand"] == (NodeState.DRAINED, "memory upgrade")
    clock.t += 61
    rec.tick()
    pool.finish()
    rec.tick()  # drained-1's second clean result in a row: back in service
    states = node_states(store)
    assert states["drained-1"] == (NodeState.IDLE, "") and launcher.undrained == ["drained-1"]
    assert "node.returned" in kinds_all(store)
    assert states["idle-1"][0] is NodeState.DRAINED  # one clean result is not enough for it


def test_without_return_after_a_drained_node_stays_drained_however_clean(tmp_path: Path) -> None:
    ours = "training-supervisor: node lost, all its ranks vanished at once (run-1)"
    launcher = ProbedLauncher({})
    store, clock, rec, pool = make(tmp_path, launcher, sweep_every_s=60.0)
    seed(store, Node(name="d", state=NodeState.DRAINED, reason=ours))
    launcher.drained_now.add("d")
    for _ in range(4):
        clock.t += 61
        rec.tick()
        pool.finish()
    rec.tick()
    assert len(launcher.drained_probes) == 4 and launcher.undrained == []
    assert node_states(store)["d"] == (NodeState.DRAINED, ours)


def kinds_all(store: SqlStore) -> list[str]:
    with store.tx() as tx:
        return [e.kind for e in tx.list_events(None)]


def test_no_sweep_unless_configured(tmp_path: Path) -> None:
    launcher = ProbedLauncher({})
    store, clock, rec, pool = make(tmp_path, launcher)
    seed(store, Node(name="idle-1", state=NodeState.IDLE))
    clock.t += 10_000
    rec.tick()
    assert pool.held == [] and launcher.probed == []


def open_rounds(store: SqlStore) -> list[tuple[str, tuple[str, ...]]]:
    with store.tx() as tx:
        return [(r.kind, r.nodes) for r in tx.open_probe_rounds()]


def test_a_preflight_left_open_by_a_daemon_that_died_is_asked_again_before_anything_launches(
        tmp_path: Path) -> None:
    """The round is a row from the moment it is asked for: the next daemon asks again for
    it, and the run launches only once its answers are judged (before, the nodes it had
    were known new only to the daemon that died, and the next one launched on them
    unprobed)."""
    launcher = ProbedLauncher({})
    store, clock, rec, pool = make(tmp_path, launcher)
    preflighted(tmp_path, store, clock, rec)
    assert len(pool.held) == 1 and open_rounds(store) == [("preflight", ("node-1", "node-2", "node-3"))]
    # The daemon dies with the round in flight: its probes are never answered.
    rec, again = reconciler_on(store, launcher, clock)
    assert again.held == [], "building the reconciler does no I/O"
    rec.tick()
    assert len(again.held) == 1, "asked again at the first tick, before anything of it launches"
    for _ in range(3):
        clock.t += 5
        rec.tick()
    assert launcher.started == [], "nothing launches on nodes whose preflight is open"
    assert again.finish() == 1
    rec.tick()
    rec.tick()
    assert [s.nodes for s in launcher.started] == [("node-1", "node-2")]
    assert open_rounds(store) == [], "judged: closed"
    with store.tx() as tx:
        assert [p.kind for p in tx.recent_probes("node-1", 5)] == ["preflight"], "one answer recorded"


def command_result(store: SqlStore, command_id: int) -> str | None:
    with store.tx() as tx:
        return tx.get_command_result(command_id)


def test_an_operators_probe_waits_for_the_round_that_probes_the_node_then_reports_and_drains_nothing(
        tmp_path: Path) -> None:
    launcher = ProbedLauncher({"node-2": ["healthy", "unhealthy"]})
    store, clock, rec, pool = make(tmp_path, launcher)
    service = preflighted(tmp_path, store, clock, rec)  # node-1..3's preflight round in flight
    command = service.request_node("node-2", NodeCommandKind.PROBE).command_id
    rec.tick()
    assert len(pool.held) == 1 and command_result(store, command) is None, "queued behind the preflight"
    pool.finish()
    rec.tick()  # the preflight judged (node-2 healthy); the operator's round asked for
    assert open_rounds(store) == [("manual", ("node-2",))] and command_result(store, command) is None
    assert [s.nodes for s in launcher.started] == [("node-1", "node-2")], "the run's launch is not held by it"
    rec.tick()
    assert len(pool.held) == 1, "asked for once, though its command waits for the answer"
    pool.finish()
    rec.tick()
    assert command_result(store, command) == (
        "unhealthy (action: replace): neuron-monitor: mem_ecc_uncorrected=1 on node-2")
    assert node_states(store)["node-2"] == (NodeState.ALLOCATED, ""), "an operator's probe drains nothing"
    assert launcher.probed[-1] == ("node-2",) and pool.held == [] and open_rounds(store) == []
    with store.tx() as tx:
        assert [(p.kind, p.status) for p in tx.recent_probes("node-2", 5)] == [
            ("manual", "unhealthy"), ("preflight", "healthy")]
    with store.tx() as tx:
        assert any(e.message.startswith("manual probe of node-2: unhealthy") for e in tx.list_events(1))
    with pytest.raises(NotFound, match="node-9"):
        service.request_node("node-9", NodeCommandKind.PROBE)


def test_an_operators_probe_left_open_by_a_daemon_that_died_is_carried_out_by_the_next(tmp_path: Path) -> None:
    launcher = ProbedLauncher({})
    store, clock, rec, pool = make(tmp_path, launcher)
    seed(store, Node(name="idle-1", state=NodeState.IDLE))
    with store.tx() as tx:
        command = tx.add_node_command("idle-1", NodeCommandKind.PROBE, "", clock())
    rec.tick()
    assert len(pool.held) == 1 and open_rounds(store) == [("manual", ("idle-1",))]
    again, pool = reconciler_on(store, launcher, clock)  # the daemon died with the probe in flight
    again.tick()
    assert len(pool.held) == 1, "the next daemon probes the node for the command still queued"
    pool.finish()
    again.tick()
    assert command_result(store, command) == "healthy (action: none)" and open_rounds(store) == []


def test_probe_verdicts_drain_within_the_daemons_one_budget_and_an_operator_past_it(tmp_path: Path) -> None:
    """H4 of issue 37: probe verdicts drained with no budget (8 of 8 nodes for a run's
    deleted file). Every drain of the supervisor's own now passes the daemon's one budget;
    past it the node stays in service and an event leaves it to an operator, whose own
    drain is never held."""
    nodes = [f"idle-{i}" for i in range(1, 9)]
    launcher = ProbedLauncher({n: ["unhealthy", "unhealthy"] for n in nodes})
    store, clock, rec, pool = make(tmp_path, launcher, sweep_every_s=60.0,
                                   drain_budget=DrainBudget(per_window=3, window_s=3600.0))
    seed(store, *(Node(name=n, state=NodeState.IDLE) for n in nodes))
    clock.t += 61
    rec.tick()
    pool.finish()
    rec.tick()  # bad once: asked again
    pool.finish()
    rec.tick()  # confirmed bad, all eight
    states = node_states(store)
    drained = sorted(n for n in nodes if states[n][0] is NodeState.DRAINED)
    assert len(drained) == 3 and sorted(n for n, _ in launcher.drains) == drained
    with store.tx() as tx:
        held = [e for e in tx.list_events(None) if e.kind == "drain.held"]
    assert len(held) == 5 and all("the daemon's drain budget" in e.message for e in held)
    assert {e.data["node"] for e in held} == set(nodes) - set(drained)
    with store.tx() as tx:
        tx.add_node_command(held[0].data["node"], NodeCommandKind.DRAIN, "fan failure", clock())
    rec.tick()
    assert node_states(store)[str(held[0].data["node"])] == (NodeState.DRAINED, "operator: fan failure")
