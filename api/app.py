"""The REST API (FastAPI), served by uvicorn inside the daemon.

Handlers are plain functions (FastAPI runs them in its thread pool) over
``SupervisorService``; the domain's errors map to HTTP statuses in one place,
``_ERROR_STATUS``. Every error body is ``{"error": <kind>, "detail": <message>}``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from supervisor.domain import CommandKind
from supervisor.errors import Conflict, NotFound, SpecError, StateDirLocked, SupervisorError
from supervisor.service import SupervisorService
from supervisor.spec import parse_spec
from supervisor.views import CommandAccepted, EventView, NodeView, ProbeView, RunDetail, RunSummary

# Checked by the service, which answers 404 with a readable message for a malformed id.
RunId = Annotated[str, Path(max_length=64, description="a run id, e.g. run-42")]
MAX_ID = 2**63 - 1  # SQLite's integers

_ERROR_STATUS: dict[type[SupervisorError], int] = {
    NotFound: 404,
    Conflict: 409,
    StateDirLocked: 409,
    SpecError: 422,
}


class SubmitRequest(BaseModel):
    spec: dict[str, Any]


class CommandResult(BaseModel):
    command_id: int
    result: str | None  # None while the reconciler has not handled it yet


def create_app(service: SupervisorService) -> FastAPI:
    app = FastAPI(title="training-supervisor", version="1", summary="Keeps training runs training")

    @app.exception_handler(SupervisorError)
    async def _domain_error(_request: Request, exc: SupervisorError) -> JSONResponse:
        status = next((s for cls, s in _ERROR_STATUS.items() if isinstance(exc, cls)), 500)
        return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=status)

    @app.get("/healthz", responses={503: {"description": "the reconciler is stalled"}})
    def healthz() -> JSONResponse:
        health = service.health()
        return JSONResponse(health.model_dump(), status_code=200 if health.ok else 503)

    @app.get("/v1/runs")
    def list_runs() -> list[RunSummary]:
        return service.list_runs()

    @app.post("/v1/runs", status_code=201)
    def submit(body: SubmitRequest) -> RunSummary:
        return service.submit(parse_spec(body.spec, "spec"))

    @app.get("/v1/runs/{run_id}")
    def get_run(run_id: RunId) -> RunDetail:
        return service.get_run(run_id)

    @app.get("/v1/runs/{run_id}/events")
    def run_events(
        run_id: RunId,
        after: Annotated[int, Query(ge=0, le=MAX_ID, description="only events with a larger id")] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> list[EventView]:
        return service.events(run_id, after, limit)

    def command(kind: CommandKind) -> Any:
        def handler(run_id: RunId) -> CommandAccepted:
            return service.request(run_id, kind)

        handler.__name__ = f"{kind.value}_run"
        return handler

    for kind in CommandKind:
        app.post(f"/v1/runs/{{run_id}}/{kind.value}", status_code=202,
                 summary=f"{kind.value.capitalize()} a run")(command(kind))

    @app.get("/v1/commands/{command_id}")
    def command_result(command_id: Annotated[int, Path(ge=1, le=MAX_ID)]) -> CommandResult:
        return CommandResult(command_id=command_id, result=service.command_result(command_id))

    @app.get("/v1/nodes")
    def nodes() -> list[NodeView]:
        return service.nodes()

    @app.post("/v1/nodes/{name}/probe", summary="Probe a node now (python -m health on it)")
    def probe(name: Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]) -> ProbeView:
        return service.probe(name)

    return app
