"""Read models: what the API, the CLI and `training-supervisor run` show of a run.

Pydantic models, so that the API's OpenAPI schema and the JSON the CLIs print are one
and the same thing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import BaseModel

from supervisor.domain import (
    Attempt,
    AttemptStats,
    CheckpointRecord,
    EventRecord,
    FaultRecord,
    Node,
    ProbeRecord,
    Run,
)
from supervisor.goodput import Goodput

# A run's detail lists its newest checkpoints, not all of them: a run of weeks makes
# thousands (GET /v1/runs/{id}/checkpoints lists more).
CHECKPOINTS_SHOWN = 20
# Likewise its newest attempts and faults: at Llama 3's failure rate a run of weeks makes
# hundreds (the events, and GET .../goodput, cover them all).
HISTORY_SHOWN = 100


class RunSummary(BaseModel):
    run_id: str
    name: str
    state: str
    reason: str
    step: int | None
    total_steps: int
    loss: float | None
    attempts: int
    attempt_state: str | None  # the latest attempt's; ENDED once a finished run is settled
    created_at: float
    ended_at: float | None


class AttemptView(BaseModel):
    number: int
    state: str
    nodes: list[str]
    resume_step: int
    resume_from: str | None
    started_at: float | None
    first_step_at: float | None
    ended_at: float | None
    outcome: str | None
    reason: str
    final_step: int | None
    precompile: bool = False  # the job's precompile pass (supervisor/runfiles/precompile.py), not training


class FaultView(BaseModel):
    kind: str
    attempt: int
    step: int
    ranks: list[int]
    nodes: list[str]
    summary: str
    injected_at: float | None = None  # chaos runs: when the fault was injected (Unix seconds)
    detected_at: float
    recovered_at: float | None


class CheckpointView(BaseModel):
    step: int
    path: str
    complete: bool
    duration_s: float | None
    attempt: int | None


class MemoryCheckpointView(BaseModel):
    """A save of the in-memory tier (trainer/memory_tier.py)."""

    attempt: int
    step: int
    duration_s: float | None  # how long training was blocked
    created_at: float


class StragglerView(BaseModel):
    """A rank reported straggling (a row of the stragglers table)."""

    attempt: int
    rank: int
    node: str
    busy_s: float  # its median compute per step over the window
    typical_s: float  # the typical rank's


class RunDetail(RunSummary):
    model_digest: str | None
    final_step: int | None
    started_at: float | None
    nodes: int
    ranks_per_node: int
    spares: int
    attempt_history: list[AttemptView]  # the newest HISTORY_SHOWN (``attempts`` counts them all)
    faults: list[FaultView]  # the newest HISTORY_SHOWN
    faults_total: int
    checkpoints: list[CheckpointView]  # the newest CHECKPOINTS_SHOWN, oldest of them first
    memory_checkpoint: MemoryCheckpointView | None = None  # the memory tier's newest save
    standbys: dict[str, int] = {}  # node -> warm standbys waiting for the next attempt
    goodput: Goodput  # the dataclass itself: pydantic serializes it as it is
    drained_nodes: list[str]  # the newest HISTORY_SHOWN it drained, by name (``drained_total``: all)
    drained_total: int = 0
    ettr: float | None
    stragglers: list[StragglerView]
    transient_spikes: int  # loss or grad-norm spikes too short to act on (counted, not acted on)
    tensorboard: str | None = None  # the run's TensorBoard logdir ([curves]; trainer_cmd.curves)
    curves_url: str | None = None  # a link to its curves elsewhere (W&B, MLflow)


class EventView(BaseModel):
    id: int
    run_id: str | None
    ts: float
    kind: str
    message: str
    data: dict[str, object]


class ProbeView(BaseModel):
    node: str
    at: float
    kind: str
    status: str
    action: str
    reason: str
    findings: list[dict[str, str]]
    run_id: str | None


class LinkFigure(BaseModel):
    """A node's figures in link tests (its best pair's bus bandwidth): the newest, and the
    median of its newest ``samples`` (its own baseline: a drift over weeks shows as the
    newest under it)."""

    newest_gbps: float
    median_gbps: float
    samples: int


class NodeView(BaseModel):
    name: str
    state: str
    reason: str
    run_id: str | None
    last_probe: ProbeView | None = None
    link: LinkFigure | None = None  # None: never in a link test that gave it a figure


class CommandAccepted(BaseModel):
    command_id: int
    run_id: str | None = None  # a run's command ...
    node: str | None = None  # ... or a node's
    kind: str


class LogView(BaseModel):
    """A piece of one log file of an attempt (``GET /v1/runs/{run}/logs``)."""

    run_id: str
    attempt: int
    attempt_state: str
    run_state: str
    file: str  # its name in the attempt's log directory
    offset: int  # where this piece starts
    next_offset: int  # where the next read goes on
    size: int  # the file's size when read
    text: str  # the bytes read, decoded (undecodable bytes replaced)


class StepMetricView(BaseModel):
    """One step of rank 0's metrics: a point of the loss curve."""

    attempt: int
    step: int
    loss: float | None  # None: not finite
    grad_norm: float | None
    step_time_s: float
    at: float  # when the supervisor received it (Unix seconds)


def run_summary(run: Run, attempts: list[Attempt], latest: AttemptStats | None) -> RunSummary:
    """``latest``: the stats of the newest attempt that made a step."""
    return RunSummary(
        run_id=run.run_id, name=run.name, state=run.state.value, reason=run.reason,
        step=run.final_step if run.final_step is not None else (latest.last_step if latest else None),
        total_steps=run.total_steps, loss=latest.last_loss if latest else None, attempts=len(attempts),
        attempt_state=attempts[-1].state.value if attempts else None,
        created_at=run.created_at, ended_at=run.ended_at,
    )


class DaemonHealth(BaseModel):
    ok: bool
    last_tick_age_s: float | None  # seconds since the reconciler last finished a tick
    mqtt_connected: bool


def attempt_view(a: Attempt) -> AttemptView:
    return AttemptView(
        number=a.number, state=a.state.value, nodes=list(a.nodes), resume_step=a.resume_step,
        resume_from=a.resume_from, started_at=a.started_at, first_step_at=a.first_step_at,
        ended_at=a.ended_at, outcome=a.outcome.value if a.outcome else None, reason=a.reason,
        final_step=a.final_step, precompile=a.precompile is not None,
    )


def fault_view(f: FaultRecord) -> FaultView:
    return FaultView(kind=f.kind.value, attempt=f.attempt, step=f.step, ranks=list(f.ranks),
                     nodes=list(f.nodes), summary=f.summary, injected_at=f.injected_at,
                     detected_at=f.detected_at, recovered_at=f.recovered_at)


def checkpoint_view(c: CheckpointRecord) -> CheckpointView:
    return CheckpointView(step=c.step, path=c.path, complete=c.complete, duration_s=c.duration_s,
                          attempt=c.attempt)


def event_view(e: EventRecord) -> EventView:
    return EventView(id=e.id, run_id=f"run-{e.run_number}" if e.run_number is not None else None,
                     ts=e.ts, kind=e.kind, message=e.message, data=e.data)


def probe_view(p: ProbeRecord) -> ProbeView:
    return ProbeView(node=p.node, at=p.at, kind=p.kind, status=p.status, action=p.action, reason=p.reason,
                     findings=p.findings, run_id=f"run-{p.run_number}" if p.run_number is not None else None)


def node_view(n: Node, last_probe: ProbeRecord | None = None, link_figures: Sequence[float] = ()) -> NodeView:
    """``link_figures``: the node's newest link-test figures, newest first."""
    link = LinkFigure(newest_gbps=link_figures[0], median_gbps=statistics.median(link_figures),
                      samples=len(link_figures)) if link_figures else None
    return NodeView(name=n.name, state=n.state.value, reason=n.reason,
                    run_id=f"run-{n.run_number}" if n.run_number is not None else None,
                    last_probe=probe_view(last_probe) if last_probe else None, link=link)
