"""The REST API over a real store: statuses, bodies, and bad input that must not be a 500."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import wire as p
from api.app import create_app
from api.auth import TokenAuth
from supervisor.domain import FaultKind, Node, NodeCommandKind, NodeState, RunState
from supervisor.launchers.base import waiting_standbys
from supervisor.launchers.local import LocalLauncher
from supervisor.launchers.standby import _RunPool, _Standby
from supervisor.metrics import SupervisorMetrics
from supervisor.recorder import TelemetryRecorder
from supervisor.service import SupervisorService
from supervisor.store import SqlStore
from supervisor.telemetry.view import TelemetryView
from supervisor.views import DaemonHealth

SPEC = {"name": "api", "resources": {"nodes": 2, "ranks_per_node": 2, "spares": 1}, "trainer": {"steps": 5}}
TOKEN = "a-token-for-the-tests-0123456789abcdefghijk"
READ_TOKEN = "a-read-only-token-for-the-tests-0123456789"


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    store = SqlStore(tmp_path / "supervisor.db")
    store.open()
    health = {"ok": True}
    service = SupervisorService(
        store, tmp_path / "runs", mqtt_url="mqtt://127.0.0.1:1", launcher=LocalLauncher(max_nodes=4),
        check_trainer=False, allow_root_runs=True,
        health=lambda: DaemonHealth(ok=health["ok"], last_tick_age_s=0.1, mqtt_connected=True))
    app = create_app(service, TokenAuth(TOKEN, tmp_path / "api-token", read_token=READ_TOKEN,
                                        read_token_file=tmp_path / "api-read-token"),
                     SupervisorMetrics(store, TelemetryView(), lambda: True))
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        c.health = health  # type: ignore[attr-defined]
        c.store = store  # type: ignore[attr-defined]
        c.app_ = app  # type: ignore[attr-defined]
        yield c
    store.close()


def test_submit_list_show_and_queue_commands(client: TestClient) -> None:
    created = client.post("/v1/runs", json={"spec": SPEC})
    assert created.status_code == 201 and created.json()["run_id"] == "run-1"
    assert [r["state"] for r in client.get("/v1/runs").json()] == ["PENDING"]
    detail = client.get("/v1/runs/run-1").json()
    assert (detail["nodes"], detail["spares"], detail["attempts"], detail["goodput"]["ettr"]) == (2, 1, 0, None)
    assert [e["kind"] for e in client.get("/v1/runs/run-1/events").json()] == ["run.submitted"]
    for kind in ("pause", "resume", "cancel"):
        r = client.post(f"/v1/runs/run-1/{kind}")
        assert r.status_code == 202 and r.json()["kind"] == kind
        assert client.get(f"/v1/commands/{r.json()['command_id']}").json()["result"] is None  # not yet handled
    assert client.get("/v1/nodes").json() == []


@pytest.mark.parametrize("path", ["/v1/runs/run-9", "/v1/runs/nonsense", "/v1/runs/42/events",
                                  "/v1/commands/77"])
def test_unknown_things_are_404_with_a_readable_detail(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 404 and r.json()["error"] == "NotFound" and "no such" in r.json()["detail"]


def test_commands_for_unknown_runs_are_404(client: TestClient) -> None:
    r = client.post("/v1/runs/run-5/cancel")
    assert r.status_code == 404 and r.json()["detail"] == "no such run: run-5"


@pytest.mark.parametrize(("body", "complaint"), [
    ({"spec": {"trainer": {"steps": 1}}}, "missing required key 'name'"),
    ({"spec": {**SPEC, "resources": {"nodse": 1}}}, "unknown key 'resources.nodse'"),
    ({"spec": {**SPEC, "resources": {"nodes": 4, "spares": 1}}}, "exceed the 4 nodes"),
    ({"spec": {**SPEC, "trainer": {"steps": 10**23}}}, "trainer.steps"),
    ({"spec": {**SPEC, "trainer": {"steps": 1, "output_dir": [1]}}}, "trainer.output_dir"),
])
def test_bad_specs_are_422_naming_the_key(client: TestClient, body: dict[str, object], complaint: str) -> None:
    r = client.post("/v1/runs", json=body)
    assert r.status_code == 422 and complaint in r.json()["detail"]


def test_an_infinite_timeout_is_refused(client: TestClient) -> None:
    body = '{"spec": {"name": "x", "trainer": {"steps": 1}, "policy": {"hang_timeout_s": 1e400}}}'
    r = client.post("/v1/runs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "policy.hang_timeout_s" in r.json()["detail"]


@pytest.mark.parametrize("path", ["/v1/commands/99999999999999999999",
                                  "/v1/runs/run-1/events?after=99999999999999999999",
                                  "/v1/runs/run-99999999999999999999999"])
def test_huge_numbers_are_client_errors_not_500(client: TestClient, path: str) -> None:
    client.post("/v1/runs", json={"spec": SPEC})
    assert client.get(path).status_code in (404, 422)


def test_healthz_follows_the_reconciler(client: TestClient) -> None:
    assert client.get("/healthz").status_code == 200
    client.health["ok"] = False  # type: ignore[attr-defined]
    r = client.get("/healthz")
    assert r.status_code == 503 and r.json()["ok"] is False


def test_a_probe_of_a_node_is_a_queued_command_of_a_node_the_supervisor_knows(client: TestClient) -> None:
    missing = client.post("/v1/nodes/local-9/probe")
    assert missing.status_code == 404 and "no such node: local-9" in missing.json()["detail"]
    assert client.post("/v1/nodes/bad$name/probe").status_code == 422
    with client.store.tx() as tx:  # type: ignore[attr-defined]
        tx.put_node(Node(name="local-1", state=NodeState.IDLE), 1.0)
    accepted = client.post("/v1/nodes/local-1/probe")
    assert accepted.status_code == 202 and accepted.json()["kind"] == "probe"
    command = accepted.json()["command_id"]
    assert client.get(f"/v1/commands/{command}").json() == {"command_id": command, "result": None}
    with client.store.tx() as tx:  # type: ignore[attr-defined]
        [queued] = tx.pending_node_commands()
    assert (queued.id, queued.node, queued.kind) == (command, "local-1", NodeCommandKind.PROBE)


# --- access -------------------------------------------------------------------------


def _without_token(client: TestClient, host: str) -> TestClient:
    return TestClient(client.app_, client=(host, 40000))  # type: ignore[attr-defined]


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/runs"), ("POST", "/v1/runs/run-1/cancel"), ("POST", "/v1/runs/run-1/restart"),
    ("POST", "/v1/nodes/local-1/drain"), ("POST", "/v1/nodes/local-1/undrain"),
    ("POST", "/v1/nodes/local-1/probe"),
])
def test_every_write_needs_the_token_even_from_this_host(client: TestClient, method: str, path: str) -> None:
    anonymous = _without_token(client, "127.0.0.1")
    r = anonymous.request(method, path, json={"spec": SPEC, "reason": "x"})
    assert r.status_code == 401 and r.json()["error"] == "Unauthorized"
    assert "Authorization: Bearer" in r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"
    wrong = anonymous.request(method, path, json={"spec": SPEC}, headers={"Authorization": "Bearer " + "x" * 43})
    assert wrong.status_code == 403 and wrong.json() == {"error": "Forbidden",
                                                         "detail": "the API token is not this daemon's, nor a person's it issued"}
    assert anonymous.request(method, path, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    assert client.get("/v1/runs").json() == [], "nothing was written"


def test_reads_need_a_token_from_anywhere_and_the_read_only_one_changes_nothing(client: TestClient) -> None:
    """No client is trusted for its address (a tunnel or a proxy makes everyone local)."""
    client.post("/v1/runs", json={"spec": SPEC})
    for host in ("127.0.0.1", "::1", "10.1.2.3"):
        anonymous = _without_token(client, host)
        for path in ("/v1/runs", "/v1/runs/run-1", "/v1/nodes", "/metrics"):
            r = anonymous.get(path)
            assert r.status_code == 401 and "api-read-token" in r.json()["detail"], (host, path)
        assert anonymous.get("/healthz").status_code == 200, "health checks need no token"
        assert anonymous.get("/").text.startswith("<!DOCTYPE html>"), "the page's HTML holds no data"
    watcher = _without_token(client, "10.1.2.3")
    read_only = {"Authorization": f"Bearer {READ_TOKEN}"}
    assert watcher.get("/v1/runs/run-1", headers=read_only).json()["run_id"] == "run-1"
    assert watcher.get("/metrics", headers=read_only).status_code == 200
    refused = watcher.post("/v1/runs/run-1/cancel", headers=read_only)
    assert refused.status_code == 403 and refused.json()["detail"] == "the read-only token cannot change anything"
    assert watcher.get("/v1/runs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_bodies_over_the_limit_are_413_announced_or_streamed(client: TestClient) -> None:
    big = b'{"spec": {"name": "' + b"x" * (1 << 20) + b'"}}'
    r = client.post("/v1/runs", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "ContentTooLarge"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b"x" * 65536

    r = client.post("/v1/runs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.get("/v1/runs").json() == []


# --- the rest of the API ------------------------------------------------------------


def test_restart_drain_and_undrain_are_queued_for_the_reconciler(client: TestClient) -> None:
    client.post("/v1/runs", json={"spec": SPEC})
    r = client.post("/v1/runs/run-1/restart")
    assert r.status_code == 202 and r.json()["kind"] == "restart" and r.json()["run_id"] == "run-1"
    assert client.post("/v1/nodes/local-1/drain", json={"reason": "bad fan"}).status_code == 404
    with client.store.tx() as tx:  # type: ignore[attr-defined]
        tx.put_node(Node(name="local-1", state=NodeState.IDLE), 1.0)
    drain = client.post("/v1/nodes/local-1/drain", json={"reason": "bad fan, ticket 7"})
    assert drain.status_code == 202 and drain.json()["node"] == "local-1" and drain.json()["run_id"] is None
    assert client.post("/v1/nodes/local-1/undrain").status_code == 202, "the body is optional"
    with client.store.tx() as tx:  # type: ignore[attr-defined]
        queued = [(c.node, c.kind.value, c.reason) for c in tx.pending_node_commands()]
        assert [c.kind.value for c in tx.pending_commands()] == ["restart"]
    assert queued == [("local-1", "drain", "bad fan, ticket 7"), ("local-1", "undrain", "")]
    assert client.get(f"/v1/commands/{drain.json()['command_id']}").json()["result"] is None


@pytest.mark.parametrize("reason", ["", "two\nlines", "x" * 201])
def test_a_drain_reason_is_one_line_of_text(client: TestClient, reason: str) -> None:
    with client.store.tx() as tx:  # type: ignore[attr-defined]
        tx.put_node(Node(name="local-1", state=NodeState.IDLE), 1.0)
    assert client.post("/v1/nodes/local-1/drain", json={"reason": reason}).status_code == 422


def test_checkpoints_goodput_and_the_loss_curve(client: TestClient) -> None:
    client.post("/v1/runs", json={"spec": SPEC})
    telemetry = TelemetryView()  # rank 0's steps, recorded as the daemon records them
    for step in range(1, 51):
        telemetry.ingest(*p.encode(p.StepMetrics(run="run-1", attempt=1, rank=0, ts=0.0, step=step,
                                                 loss=5.0 - step / 20, grad_norm=0.5, lr=1e-3, step_time_s=0.1,
                                                 tokens_per_s=1e4)), 1000.0 + step)
    telemetry.ingest(*p.encode(p.CheckpointCommitted(run="run-1", attempt=1, rank=0, ts=0.0, step=20,
                                                     path="/ck/20", duration_s=0.3)), 1020.5)
    telemetry.ingest(*p.encode(p.CheckpointCommitted(run="run-1", attempt=1, rank=0, ts=0.0, step=25,
                                                     path="memory:1:25", duration_s=0.004, tier=p.TIER_MEMORY)),
                     1025.5)
    TelemetryRecorder(client.store, telemetry).record()  # type: ignore[attr-defined]
    assert client.get("/v1/runs/run-1/checkpoints").json() == [
        {"step": 20, "path": "/ck/20", "complete": True, "duration_s": 0.3, "attempt": 1}], "persistent ones"
    detail = client.get("/v1/runs/run-1").json()
    assert detail["memory_checkpoint"] == {"attempt": 1, "step": 25, "duration_s": 0.004, "created_at": 1025.5}
    assert detail["standbys"] == {}
    assert client.get("/v1/runs/run-1/goodput").json()["ettr"] is None, "no attempt has started"
    curve = client.get("/v1/runs/run-1/metrics", params={"max_points": 10}).json()
    assert len(curve) == 10 and curve[0]["step"] == 1 and curve[-1]["step"] == 50
    assert [p["step"] for p in curve] == sorted(p["step"] for p in curve)
    assert len(client.get("/v1/runs/run-1/metrics").json()) == 50
    assert client.get("/v1/runs/run-2/goodput").status_code == 404


def test_a_drills_report_that_comes_after_its_fault_still_dates_the_injection(client: TestClient) -> None:
    """A rank reports the fault it injects, then dies of it; on a busy host its death can
    be recorded before its report arrives. The report fills in the fault's injection time
    from the rank's own clock, believed only when it is before the receipt and at most a
    minute before it (attempt 2's, an hour old, is not: its fault keeps no time)."""
    client.post("/v1/runs", json={"spec": SPEC})
    with client.store.tx() as tx:  # type: ignore[attr-defined]
        for attempt in (1, 2):
            tx.add_fault(1, attempt=attempt, kind=FaultKind.RANK_EXIT, ranks=[3], nodes=["local-2"], step=25,
                         summary="rank 3 exited with code 1", now=1010.0 + attempt,
                         injected_at=tx.injected_at(1, attempt, 1010.0 + attempt))
    telemetry = TelemetryView()
    for attempt, sent in ((1, 1009.5), (2, 1012.0 - 3600)):
        telemetry.ingest(*p.encode(p.FaultInjected(run="run-1", attempt=attempt, rank=3, ts=sent, step=25,
                                                   action="crash@25", detail="InjectedFault")), 1013.0)
    TelemetryRecorder(client.store, telemetry).record()  # type: ignore[attr-defined]
    faults = client.get("/v1/runs/run-1").json()["faults"]
    assert [(f["attempt"], f["injected_at"]) for f in faults] == [(1, 1009.5), (2, None)], faults


def test_the_event_stream_sends_what_is_recorded_and_ends_with_the_run(client: TestClient) -> None:
    client.post("/v1/runs", json={"spec": SPEC})
    with client.store.tx() as tx:  # type: ignore[attr-defined]
        first = tx.list_events(1)[0].id
        tx.update_run(1, state=RunState.CANCELLED, reason="cancelled by operator")
        tx.add_event(1, "run.state", "PENDING -> CANCELLED", {}, 2.0)
    with client.stream("GET", "/v1/runs/run-1/events/stream", headers={"Last-Event-ID": str(first)}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = "".join(r.iter_text())
    events = [line for line in body.split("\n\n") if line]
    assert events[0].startswith("id: ") and '"kind":"run.state"' in events[0], "after Last-Event-ID only"
    assert events[-1].startswith("event: end") and '"state":"CANCELLED"' in events[-1]
    assert client.get("/v1/runs/run-9/events/stream").status_code == 404


def test_metrics_for_prometheus(tmp_path: Path) -> None:
    """With the daemon's registry: runs by state, faults and their latencies, and the
    launcher's live standbys (real processes in its pool; a dead one is not counted)."""
    store = SqlStore(tmp_path / "supervisor.db")
    store.open()
    service = SupervisorService(store, tmp_path / "runs", allow_root_runs=True, mqtt_url="mqtt://127.0.0.1:1",
                                launcher=(local := LocalLauncher(max_nodes=4)), check_trainer=False)
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    local.standbys._runs["run-1"] = _RunPool(  # as a refill leaves it: two per node
        spec=object(), refill_at=0.0,  # type: ignore[arg-type]
        waiting=[_Standby(proc, node, slot) for proc, (node, slot)
                 in zip(procs, [("local-1", 0), ("local-1", 1), ("local-3", 0), ("local-3", 1)], strict=True)])
    procs[3].kill()
    procs[3].wait()
    metrics = SupervisorMetrics(store, TelemetryView(), lambda: True, standbys=waiting_standbys(local))
    metrics.tick_seconds.observe(0.004)
    client = TestClient(create_app(service, TokenAuth(TOKEN), metrics),
                        headers={"Authorization": f"Bearer {TOKEN}"})
    client.post("/v1/runs", json={"spec": SPEC})
    with store.tx() as tx:  # as the executor records a fault: with the attempt's last step's time
        tx.add_fault(1, attempt=1, kind=FaultKind.RANK_EXIT, ranks=[3], nodes=["local-2"], step=1,
                     summary="rank 3 killed", now=103.0, last_step_at=100.0)
        tx.mark_faults_recovered(1, 112.0)
    try:
        text = client.get("/metrics").text
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    store.close()
    assert 'tsup_runs{state="PENDING"} 1.0' in text
    assert 'tsup_faults_total{kind="rank-exit"} 1.0' in text
    assert 'tsup_fault_detection_seconds_bucket{le="5.0"} 1.0' in text  # 3 s after the last step
    assert 'tsup_fault_detection_seconds_bucket{le="2.0"} 0.0' in text
    assert 'tsup_fault_recovery_seconds_bucket{le="10.0"} 1.0' in text  # 9 s to train again
    assert "tsup_fault_recovery_seconds_sum 9.0" in text
    assert "tsup_reconcile_tick_seconds_count 1.0" in text and "tsup_mqtt_connected 1.0" in text
    assert 'tsup_standby_processes{node="local-1",run_id="run-1"} 2.0' in text
    assert 'tsup_standby_processes{node="local-3",run_id="run-1"} 1.0' in text


def test_a_runs_curves_are_pointed_at_by_its_detail_and_its_status_text(client: TestClient, tmp_path: Path) -> None:
    """[curves]: the reference trainer's TensorBoard directory unless the spec names one,
    and a link with its placeholders filled, in the API's detail and `supervisorctl status`."""
    from supervisor.report import run_detail
    from supervisor.views import RunDetail

    spec = {**SPEC, "trainer": {"steps": 5, "output_dir": str(tmp_path / "out")},
            "curves": {"url": "https://wandb.example/team/llama/runs/{run_id}"}}
    run_id = client.post("/v1/runs", json={"spec": spec}).json()["run_id"]
    d = client.get(f"/v1/runs/{run_id}").json()
    assert d["tensorboard"] == str(tmp_path / "out" / "tensorboard")
    assert d["curves_url"] == f"https://wandb.example/team/llama/runs/{run_id}"
    text = run_detail(RunDetail.model_validate(d))
    assert f"curves:   tensorboard --logdir {tmp_path / 'out' / 'tensorboard'}" in text
    bad = client.post("/v1/runs", json={"spec": {**SPEC, "curves": {"tensorboard": "/tb/{jobid}"}}})
    assert bad.status_code == 422 and "{jobid} is no placeholder" in bad.json()["detail"], bad.json()
