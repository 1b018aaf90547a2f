"""The REST API over a real store: statuses, bodies, and bad input that must not be a 500."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from supervisor.domain import Node, NodeState
from supervisor.launchers.local import LocalLauncher
from supervisor.service import SupervisorService
from supervisor.store import SqlStore
from supervisor.views import DaemonHealth

SPEC = {"name": "api", "resources": {"nodes": 2, "ranks_per_node": 2, "spares": 1}, "trainer": {"steps": 5}}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    store = SqlStore(tmp_path / "supervisor.db")
    store.open()
    health = {"ok": True}
    service = SupervisorService(
        store, tmp_path / "runs", mqtt_url="mqtt://127.0.0.1:1", launcher=LocalLauncher(max_nodes=4),
        check_trainer=False,
        health=lambda: DaemonHealth(ok=health["ok"], last_tick_age_s=0.1, mqtt_connected=True))
    with TestClient(create_app(service)) as c:
        c.health = health  # type: ignore[attr-defined]
        c.store = store  # type: ignore[attr-defined]
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


def test_probe_a_node_now_and_see_it_in_the_node_list(client: TestClient, tmp_path: Path) -> None:
    missing = client.post("/v1/nodes/local-9/probe")
    assert missing.status_code == 404 and "no such node: local-9" in missing.json()["detail"]
    assert client.post("/v1/nodes/bad$name/probe").status_code == 422
    with client.store.tx() as tx:  # type: ignore[attr-defined]
        tx.put_node(Node(name="local-1", state=NodeState.IDLE), 1.0)
    probe = client.post("/v1/nodes/local-1/probe").json()  # python -m health, for real, on this host
    assert probe["node"] == "local-1" and probe["kind"] == "manual"
    assert probe["status"] in ("healthy", "degraded") and probe["action"] == "none"
    assert any("no Neuron devices found" in f["evidence"] for f in probe["findings"])
    [node] = client.get("/v1/nodes").json()
    assert node["last_probe"]["status"] == probe["status"]
