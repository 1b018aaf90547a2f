"""The REST API (FastAPI), served by uvicorn inside the daemon.

Handlers are plain functions (FastAPI runs them in its thread pool) over
``SupervisorService``; the domain's errors map to HTTP statuses in one place,
``_ERROR_STATUS``. Every error body is ``{"error": <kind>, "detail": <message>}``
(FastAPI's own 422 for a malformed request keeps its list of problems as ``detail``).

Access (api/auth.py, supervisor/people.py): every write needs the daemon's API token or
a person's; every read any token. A person's token reads and acts on that person's runs
only (403 for another's), lists only theirs, and neither reads /metrics nor commands a
node; an operator's is the API token's equal. ``/healthz`` and the status page's HTML
are open. Bodies are limited to ``max_body_bytes``.

    GET  /healthz                       is the reconciler ticking (503 when stalled)
    GET  /metrics                       Prometheus (supervisor/metrics.py)
    GET  /                              the status page (api/status.html)
    GET  /v1/runs                       every run
    POST /v1/runs                       submit a run spec                         (token)
    GET  /v1/runs/{run}                 one run: attempts, faults, goodput, ...
    GET  /v1/runs/{run}/events          its event log, a page at a time
    GET  /v1/runs/{run}/events/stream   the same as server-sent events, until the run ends
    GET  /v1/runs/{run}/checkpoints     the newest checkpoints it made or found (?newest=N)
    GET  /v1/runs/{run}/goodput         where its wall-clock time went
    GET  /v1/runs/{run}/metrics         rank 0's step metrics (the loss curve)
    GET  /v1/runs/{run}/logs            a piece of an attempt's log (?attempt, rank|node, offset)
    POST /v1/runs/{run}/{pause|resume|restart|cancel}  (resume: ?from_step=N&force=true)  (token)
    GET  /v1/commands/{id}              what came of a queued command
    GET  /v1/nodes                      every node, its state and last probe
    POST /v1/nodes/{node}/{drain|undrain}                                         (token)
    POST /v1/nodes/{node}/probe         run the health probes on it; the result is the command's,
                                        and the node's last probe                 (token)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from http import HTTPStatus
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Header, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.auth import TokenAuth
from supervisor import people
from supervisor.domain import TERMINAL_RUN_STATES, CommandKind, NodeCommandKind
from supervisor.errors import Conflict, Forbidden, NotFound, SpecError, StateDirLocked, SupervisorError
from supervisor.goodput import Goodput
from supervisor.metrics import SupervisorMetrics
from supervisor.people import Caller
from supervisor.service import SupervisorService
from supervisor.spec import parse_spec
from supervisor.token_file import ApiTokens
from supervisor.views import (
    CheckpointView,
    CommandAccepted,
    EventView,
    LogView,
    NodeView,
    RunDetail,
    RunSummary,
    StepMetricView,
)

# Checked by the service, which answers 404 with a readable message for a malformed id.
RunId = Annotated[str, Path(max_length=64, description="a run id, e.g. run-42")]
NodeName = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="a node name")]
MAX_ID = 2**63 - 1  # SQLite's integers
MAX_BODY_BYTES = 1 << 20
STATUS_PAGE = FilePath(__file__).with_name("status.html")
_STREAM_POLL_S = 0.5
_STREAM_KEEPALIVE_S = 15.0
_STREAM_BATCH = 500
_ERROR_STATUS: dict[type[SupervisorError], int] = {
    NotFound: 404,
    Forbidden: 403,
    Conflict: 409,
    StateDirLocked: 409,
    SpecError: 422,
}


class SubmitRequest(BaseModel):
    spec: dict[str, Any]


class DrainRequest(BaseModel):
    # One line of printable text: it becomes the node's drain Reason in Slurm.
    reason: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")]


class UndrainRequest(BaseModel):
    reason: Annotated[str, Field(max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")] = ""


class CommandResult(BaseModel):
    command_id: int
    result: str | None  # None while the reconciler has not handled it yet


def daemon_app(service: SupervisorService, tokens: ApiTokens, metrics: SupervisorMetrics) -> FastAPI:
    """The app the daemon serves (supervisor/daemon.py, ApiFactory)."""
    auth = TokenAuth(tokens.token, tokens.token_file, read_token=tokens.read_token,
                     read_token_file=tokens.read_token_file, people=service.person)
    return create_app(service, auth, metrics)


def create_app(service: SupervisorService, auth: TokenAuth, metrics: SupervisorMetrics,
               *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="training-supervisor", version="1", summary="Keeps training runs training")
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    read = [Depends(auth.read)]
    page = STATUS_PAGE.read_text()

    def run_reader(run_id: RunId, caller: Caller = Depends(auth.read)) -> Caller:  # noqa: B008
        people.may_see(caller, run_id, service.owner(run_id))
        return caller

    def run_writer(run_id: RunId, caller: Caller = Depends(auth.write)) -> Caller:  # noqa: B008
        people.may_see(caller, run_id, service.owner(run_id))
        return caller

    def operator_reader(caller: Caller = Depends(auth.read)) -> None:  # noqa: B008
        people.operators_only(caller, "this")

    def operator_writer(caller: Caller = Depends(auth.write)) -> None:  # noqa: B008
        people.operators_only(caller, "a node's command")

    see, act = [Depends(run_reader)], [Depends(run_writer)]

    @app.exception_handler(SupervisorError)
    async def _domain_error(_request: Request, exc: SupervisorError) -> JSONResponse:
        status = next((s for cls, s in _ERROR_STATUS.items() if isinstance(exc, cls)), 500)
        return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": _error_name(exc.status_code), "detail": str(exc.detail)},
                            status_code=exc.status_code, headers=exc.headers)

    @app.get("/healthz", responses={503: {"description": "the reconciler is stalled"}})
    def healthz() -> JSONResponse:
        health = service.health()
        return JSONResponse(health.model_dump(), status_code=200 if health.ok else 503)

    @app.get("/metrics", dependencies=[Depends(operator_reader)], response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)  # its data: read, with a token
    def status_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/v1/runs")
    def list_runs(caller: Caller = Depends(auth.read)) -> list[RunSummary]:  # noqa: B008
        return service.list_runs(None if caller.operator else caller.user)

    @app.post("/v1/runs", status_code=201)
    def submit(body: SubmitRequest, caller: Caller = Depends(auth.write)) -> RunSummary:  # noqa: B008
        spec = parse_spec(body.spec, "spec")
        return service.submit(spec.model_copy(update={"user": people.submitter(caller, spec.user)}))

    @app.get("/v1/runs/{run_id}", dependencies=see)
    def get_run(run_id: RunId) -> RunDetail:
        return service.get_run(run_id)

    @app.get("/v1/runs/{run_id}/events", dependencies=see)
    def run_events(
        run_id: RunId,
        after: Annotated[int, Query(ge=0, le=MAX_ID, description="only events with a larger id")] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> list[EventView]:
        return service.events(run_id, after, limit)

    @app.get("/v1/runs/{run_id}/events/stream", dependencies=see, response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "one `data:` line per event (EventView JSON), `id:` its id; "
                                             "`event: end` once the run has ended"}})
    def stream_events(
        request: Request,
        run_id: RunId,
        after: Annotated[int, Query(ge=0, le=MAX_ID, description="only events with a larger id")] = 0,
        last_event_id: Annotated[int | None, Header(alias="Last-Event-ID", ge=0, le=MAX_ID)] = None,
    ) -> StreamingResponse:
        service.summary(run_id)  # 404 now, not inside the stream
        start = max(after, last_event_id or 0)
        return StreamingResponse(_event_stream(service, request, run_id, start),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/v1/runs/{run_id}/checkpoints", dependencies=see)
    def checkpoints(run_id: RunId,
                    newest: Annotated[int, Query(ge=1, le=100_000)] = 100) -> list[CheckpointView]:
        return service.checkpoints(run_id, newest)

    @app.get("/v1/runs/{run_id}/goodput", dependencies=see)
    def goodput(run_id: RunId) -> Goodput:
        return service.goodput(run_id)

    @app.get("/v1/runs/{run_id}/logs", dependencies=see,
             responses={404: {"description": "no such run, attempt, node of it, or log"}})
    def logs(
        run_id: RunId,
        attempt: Annotated[int | None, Query(ge=1, le=MAX_ID, description="default: the newest")] = None,
        rank: Annotated[int | None, Query(ge=0, le=10**7, description="default: rank 0")] = None,
        node: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                          description="a node of the attempt: its own log")] = None,
        offset: Annotated[int, Query(ge=0, le=MAX_ID, description="where to start reading")] = 0,
        max_bytes: Annotated[int, Query(ge=1, le=1 << 20)] = 65536,
    ) -> LogView:
        if rank is not None and node is not None:
            raise SpecError("give rank or node, not both")
        return service.logs(run_id, attempt=attempt, rank=rank, node=node, offset=offset, max_bytes=max_bytes)

    @app.get("/v1/runs/{run_id}/metrics", dependencies=see)
    def step_metrics(
        run_id: RunId, max_points: Annotated[int, Query(ge=2, le=100_000)] = 1000,
    ) -> list[StepMetricView]:
        return service.step_metrics(run_id, max_points)

    def run_command(kind: CommandKind) -> Callable[[str], CommandAccepted]:
        def handler(run_id: RunId) -> CommandAccepted:
            return service.request(run_id, kind)

        handler.__name__ = f"{kind.value}_run"
        return handler

    for kind in CommandKind:
        if kind is not CommandKind.RESUME:
            app.post(f"/v1/runs/{{run_id}}/{kind.value}", status_code=202, dependencies=act,
                     summary=f"{kind.value.capitalize()} a run")(run_command(kind))

    @app.post("/v1/runs/{run_id}/resume", status_code=202, dependencies=act, summary="Resume a run",
              responses={404: {"description": "no such run, or no complete checkpoint of from_step"},
                         409: {"description": "it would fail again: nothing the job reads changed"}})
    def resume_run(
        run_id: RunId,
        from_step: Annotated[int | None, Query(ge=1, le=10**12, description=(
            "go on from the complete checkpoint of this step (newer ones are set aside); "
            "absent: the newest"))] = None,
        force: Annotated[bool, Query(description=(
            "resume a run that failed to resume from its checkpoint though nothing the job reads "
            "changed since"))] = False,
    ) -> CommandAccepted:
        return service.request(run_id, CommandKind.RESUME, from_step, force)

    @app.get("/v1/commands/{command_id}")
    def command_result(command_id: Annotated[int, Path(ge=1, le=MAX_ID)],
                       caller: Caller = Depends(auth.read)) -> CommandResult:  # noqa: B008
        run_id, owner = service.command_owner(command_id)
        if run_id is None:
            people.operators_only(caller, "a node's command")
        else:
            people.may_see(caller, run_id, owner)
        return CommandResult(command_id=command_id, result=service.command_result(command_id))

    @app.get("/v1/nodes", dependencies=read)
    def nodes() -> list[NodeView]:
        return service.nodes()

    nodes_act = [Depends(operator_writer)]

    @app.post("/v1/nodes/{name}/drain", status_code=202, dependencies=nodes_act,
              summary="Take a node out of service (a running attempt trains on; the next leaves it out)")
    def drain(name: NodeName, body: DrainRequest) -> CommandAccepted:
        return service.request_node(name, NodeCommandKind.DRAIN, body.reason)

    @app.post("/v1/nodes/{name}/undrain", status_code=202, dependencies=nodes_act,
              summary="Return a drained node to service")
    def undrain(name: NodeName, body: Annotated[UndrainRequest | None, Body()] = None) -> CommandAccepted:
        return service.request_node(name, NodeCommandKind.UNDRAIN, body.reason if body else "")

    @app.post("/v1/nodes/{name}/probe", status_code=202, dependencies=nodes_act,
              summary="Probe a node (python -m health on it): queued while another round probes it; "
                      "its result is the command's, its findings the node's last probe")
    def probe(name: NodeName) -> CommandAccepted:
        return service.request_node(name, NodeCommandKind.PROBE)

    return app


async def _event_stream(service: SupervisorService, request: Request, run_id: str,
                        after: int) -> AsyncIterator[str]:
    """Server-sent events: the run's events after ``after`` as they are recorded, a
    comment now and then to keep proxies from closing a quiet stream, and ``event: end``
    once the run has ended and its last attempt is torn down."""
    terminal = {s.value for s in TERMINAL_RUN_STATES}
    said_at = time.monotonic()
    while True:
        events = await run_in_threadpool(service.events, run_id, after, _STREAM_BATCH)
        for e in events:
            after = e.id
            yield f"id: {e.id}\ndata: {e.model_dump_json()}\n\n"
        if events:
            said_at = time.monotonic()
            if len(events) == _STREAM_BATCH:
                continue  # more are waiting
        else:
            run = await run_in_threadpool(service.summary, run_id)
            if run.state in terminal and run.attempt_state in (None, "ENDED"):
                yield f"event: end\ndata: {run.model_dump_json()}\n\n"
                return
        if await request.is_disconnected():
            return
        if time.monotonic() - said_at >= _STREAM_KEEPALIVE_S:
            yield ": keepalive\n\n"
            said_at = time.monotonic()
        await asyncio.sleep(_STREAM_POLL_S)


def _error_name(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "")
    except ValueError:
        return "Error"


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, whether announced by
    Content-Length or streamed in chunks, before any handler parses them."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._too_large(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: disconnects, for streams
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse({"error": "ContentTooLarge",
                                 "detail": f"the request body is over {self.limit} bytes"}, status_code=413)
        await response(scope, receive, send)
