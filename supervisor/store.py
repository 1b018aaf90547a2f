"""The SQLite store (SQLAlchemy 2.0 Core): the only module that writes SQL.

    store = SqlStore(path)        # no I/O yet
    store.open()                  # engine, WAL, migrations
    with store.tx() as tx:        # one transaction
        run = tx.get_run(42)

SQLite runs in WAL mode so that API readers never block the reconciler, with
``synchronous=FULL`` so that a committed event survives a power cut, and a busy
timeout so that the API's small writes (queued commands) wait instead of failing.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Connection,
    CursorResult,
    Engine,
    Row,
    Select,
    create_engine,
    delete,
    event,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import ConnectionPoolEntry

from supervisor import store_schema as t
from supervisor.domain import (
    TERMINAL_RUN_STATES,
    Attempt,
    AttemptOutcome,
    AttemptState,
    Command,
    CommandKind,
    FaultKind,
    FaultRecord,
    Node,
    NodeCommand,
    NodeCommandKind,
    NodeState,
    Policy,
    ProbeRecord,
    Run,
    RunState,
)
from supervisor.errors import NotFound, StoreError


@dataclass(frozen=True, slots=True, kw_only=True)
class EventRecord:
    id: int
    run_number: int | None
    ts: float
    kind: str
    message: str
    data: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricRecord:
    attempt: int
    step: int
    loss: float | None
    grad_norm: float | None
    lr: float | None
    step_time_s: float
    tokens_per_s: float | None
    received_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRecord:
    step: int
    path: str
    complete: bool
    duration_s: float | None
    attempt: int | None
    created_at: float


class SqlStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._engine: Engine | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(f"sqlite:///{self.path}", connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        try:
            with engine.begin() as conn:
                _migrate(conn)
        except SQLAlchemyError as e:
            engine.dispose()
            raise StoreError(f"{self.path}: cannot open the database: {e}") from e
        self._engine = engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    @contextmanager
    def tx(self) -> Iterator[Tx]:
        if self._engine is None:
            raise StoreError("store is not open")
        with self._engine.begin() as conn:
            yield Tx(conn)


def _sqlite_pragmas(dbapi_conn: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def _migrate(conn: Connection) -> None:
    t.schema_version.create(conn, checkfirst=True)
    current = conn.execute(select(t.schema_version.c.version)).scalar()
    if current is None:
        current = 0
        conn.execute(insert(t.schema_version).values(version=0))
    if current > t.SCHEMA_VERSION:
        raise StoreError(
            f"database schema v{current} is newer than this supervisor understands "
            f"(v{t.SCHEMA_VERSION}); upgrade training-supervisor"
        )
    for version in range(current, t.SCHEMA_VERSION):
        t.MIGRATIONS[version](conn)
        conn.execute(update(t.schema_version).values(version=version + 1))


def _new_id(res: CursorResult[Any]) -> int:
    key = res.inserted_primary_key
    assert key is not None
    return int(key[0])


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class Tx:
    """Every query and write, inside one transaction."""

    def __init__(self, conn: Connection) -> None:
        self.c = conn

    # --- runs -----------------------------------------------------------------------

    def create_run(
        self, *, name: str, spec_json: str, run_dir_root: Path, nodes: int, ranks_per_node: int,
        spares: int, total_steps: int, policy: Policy, now: float,
    ) -> Run:
        res = self.c.execute(
            insert(t.runs).values(
                name=name, state=RunState.PENDING.value, reason="submitted", spec=spec_json,
                run_dir="", nodes=nodes, ranks_per_node=ranks_per_node, spares=spares,
                total_steps=total_steps, policy=json.dumps(asdict(policy)), created_at=now,
                budget_from_attempt=0,
            )
        )
        number = _new_id(res)
        run_dir = run_dir_root / f"run-{number}"
        self.c.execute(update(t.runs).where(t.runs.c.number == number).values(run_dir=str(run_dir)))
        return self.get_run(number)

    def get_run(self, number: int) -> Run:
        row = self.c.execute(select(t.runs).where(t.runs.c.number == number)).first()
        if row is None:
            raise NotFound(f"no such run: run-{number}")
        return _run(row)

    def run_spec_and_dir(self, number: int) -> tuple[str, Path]:
        row = self.c.execute(
            select(t.runs.c.spec, t.runs.c.run_dir).where(t.runs.c.number == number)
        ).first()
        if row is None:
            raise NotFound(f"no such run: run-{number}")
        return row.spec, Path(row.run_dir)

    def list_runs(self, states: Sequence[RunState] | None = None) -> list[Run]:
        q = select(t.runs).order_by(t.runs.c.number)
        if states is not None:
            q = q.where(t.runs.c.state.in_([s.value for s in states]))
        return [_run(r) for r in self.c.execute(q)]

    def finished_runs_holding_resources(self) -> set[int]:
        """Terminal runs that still have a live attempt or hold nodes (to tear down)."""
        live = select(t.attempts.c.run_number).where(t.attempts.c.state != AttemptState.ENDED.value)
        held = select(t.nodes.c.run_number).where(t.nodes.c.state == NodeState.ALLOCATED.value)
        q = select(t.runs.c.number).where(
            t.runs.c.state.in_([s.value for s in TERMINAL_RUN_STATES]),
            or_(t.runs.c.number.in_(live), t.runs.c.number.in_(held), t.runs.c.allocation_info.is_not(None)),
        )
        return {int(n) for n in self.c.execute(q).scalars()}

    def update_run(self, number: int, **values: Any) -> None:
        for k, v in list(values.items()):
            if isinstance(v, RunState):
                values[k] = v.value
        self.c.execute(update(t.runs).where(t.runs.c.number == number).values(**values))

    # --- attempts -------------------------------------------------------------------

    def add_attempt(self, a: Attempt) -> None:
        self.c.execute(insert(t.attempts).values(**_attempt_values(a)))

    def update_attempt(self, run_number: int, number: int, **values: Any) -> None:
        for k, v in list(values.items()):
            if isinstance(v, (AttemptState, AttemptOutcome)):
                values[k] = v.value
        self.c.execute(
            update(t.attempts)
            .where(t.attempts.c.run_number == run_number, t.attempts.c.number == number)
            .values(**values)
        )

    def list_attempts(self, run_number: int) -> list[Attempt]:
        q = select(t.attempts).where(t.attempts.c.run_number == run_number).order_by(t.attempts.c.number)
        return [_attempt(r) for r in self.c.execute(q)]

    # --- nodes ----------------------------------------------------------------------

    def list_nodes(self) -> list[Node]:
        return [_node(r) for r in self.c.execute(select(t.nodes).order_by(t.nodes.c.name))]

    def get_node(self, name: str) -> Node:
        row = self.c.execute(select(t.nodes).where(t.nodes.c.name == name)).first()
        if row is None:
            raise NotFound(f"no such node: {name}")
        return _node(row)

    def allocation(self, run_number: int) -> list[Node]:
        q = select(t.nodes).where(t.nodes.c.run_number == run_number).order_by(t.nodes.c.name)
        return [_node(r) for r in self.c.execute(q)]

    def put_node(self, node: Node, now: float) -> None:
        values = {"state": node.state.value, "reason": node.reason, "run_number": node.run_number,
                  "updated_at": now}
        done = self.c.execute(update(t.nodes).where(t.nodes.c.name == node.name).values(**values))
        if done.rowcount == 0:
            self.c.execute(insert(t.nodes).values(name=node.name, **values))

    # --- probes ---------------------------------------------------------------------

    def add_probe(self, p: ProbeRecord) -> None:
        self.c.execute(insert(t.probes).values(
            node=p.node, at=p.at, kind=p.kind, status=p.status, action=p.action, reason=p.reason,
            findings=json.dumps(p.findings), run_number=p.run_number))

    def probe_counts(self) -> dict[str, int]:
        """How many probes ended with each status, over all time."""
        q = select(t.probes.c.status, func.count()).group_by(t.probes.c.status)
        return {str(status): int(count) for status, count in self.c.execute(q)}

    def recent_probes(self, node: str, limit: int = 5) -> list[ProbeRecord]:
        """The node's newest probes, newest first."""
        q = select(t.probes).where(t.probes.c.node == node).order_by(t.probes.c.id.desc()).limit(limit)
        return [ProbeRecord(node=r.node, at=r.at, kind=r.kind, status=r.status, action=r.action,
                            reason=r.reason, findings=json.loads(r.findings), run_number=r.run_number)
                for r in self.c.execute(q)]

    # --- checkpoints ----------------------------------------------------------------

    def record_checkpoint(
        self, run_number: int, *, step: int, path: str, complete: bool, duration_s: float | None,
        attempt: int | None, now: float,
    ) -> bool:
        """Insert or refresh one checkpoint row; True if it is new or its completeness changed."""
        key = (t.checkpoints.c.run_number == run_number, t.checkpoints.c.step == step)
        was = self.c.execute(select(t.checkpoints).where(*key)).first()
        if was is not None:
            values: dict[str, Any] = {"path": path, "complete": complete}
            if duration_s is not None:
                values["duration_s"] = duration_s
            if attempt is not None:
                values["attempt"] = attempt
            if any(getattr(was, k) != v for k, v in values.items()):  # no write (and fsync) for nothing
                self.c.execute(update(t.checkpoints).where(*key).values(**values))
            return bool(was.complete) != complete
        self.c.execute(
            insert(t.checkpoints).values(
                run_number=run_number, step=step, path=path, complete=complete,
                duration_s=duration_s, attempt=attempt, created_at=now,
            )
        )
        return True

    def list_checkpoints(self, run_number: int) -> list[CheckpointRecord]:
        q = select(t.checkpoints).where(t.checkpoints.c.run_number == run_number).order_by(
            t.checkpoints.c.step
        )
        return [
            CheckpointRecord(step=r.step, path=r.path, complete=r.complete, duration_s=r.duration_s,
                             attempt=r.attempt, created_at=r.created_at)
            for r in self.c.execute(q)
        ]

    # --- faults ---------------------------------------------------------------------

    def add_fault(
        self, run_number: int, *, attempt: int, kind: FaultKind, ranks: Sequence[int],
        nodes: Sequence[str], step: int, summary: str, now: float,
    ) -> int:
        res = self.c.execute(
            insert(t.faults).values(
                run_number=run_number, attempt=attempt, kind=kind.value, ranks=json.dumps(list(ranks)),
                nodes=json.dumps(list(nodes)), step=step, summary=summary, detected_at=now,
            )
        )
        return _new_id(res)

    def mark_faults_recovered(self, run_number: int, now: float) -> int:
        res = self.c.execute(
            update(t.faults)
            .where(t.faults.c.run_number == run_number, t.faults.c.recovered_at.is_(None))
            .values(recovered_at=now)
        )
        return int(res.rowcount)

    def count_open_faults(self, run_number: int) -> int:
        q = select(func.count()).select_from(t.faults).where(
            t.faults.c.run_number == run_number, t.faults.c.recovered_at.is_(None)
        )
        return int(self.c.execute(q).scalar_one())

    def list_faults(self, run_number: int) -> list[FaultRecord]:
        return self._faults(select(t.faults).where(t.faults.c.run_number == run_number))

    def faults_since(self, since: float) -> list[FaultRecord]:
        """Every run's faults detected at or after ``since``, oldest first."""
        return self._faults(select(t.faults).where(t.faults.c.detected_at >= since))

    def _faults(self, q: Select[Any]) -> list[FaultRecord]:
        q = q.order_by(t.faults.c.id)
        return [
            FaultRecord(
                id=r.id, run_number=r.run_number, attempt=r.attempt, kind=FaultKind(r.kind),
                ranks=tuple(json.loads(r.ranks)), nodes=tuple(json.loads(r.nodes)), step=r.step,
                summary=r.summary, detected_at=r.detected_at, recovered_at=r.recovered_at,
            )
            for r in self.c.execute(q)
        ]

    # --- metrics --------------------------------------------------------------------

    def add_metric(
        self, run_number: int, *, attempt: int, step: int, loss: float, grad_norm: float, lr: float,
        step_time_s: float, tokens_per_s: float, now: float,
    ) -> None:
        key = (t.metrics.c.run_number == run_number, t.metrics.c.attempt == attempt,
               t.metrics.c.step == step)
        if self.c.execute(select(t.metrics.c.step).where(*key)).first() is not None:
            return  # a duplicate delivery
        self.c.execute(
            insert(t.metrics).values(
                run_number=run_number, attempt=attempt, step=step, loss=_finite(loss),
                grad_norm=_finite(grad_norm), lr=_finite(lr), step_time_s=step_time_s,
                tokens_per_s=_finite(tokens_per_s), received_at=now,
            )
        )

    def list_metrics(self, run_number: int) -> list[MetricRecord]:
        q = select(t.metrics).where(t.metrics.c.run_number == run_number).order_by(
            t.metrics.c.attempt, t.metrics.c.step
        )
        return [
            MetricRecord(attempt=r.attempt, step=r.step, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr,
                         step_time_s=r.step_time_s, tokens_per_s=r.tokens_per_s,
                         received_at=r.received_at)
            for r in self.c.execute(q)
        ]

    def last_step_before(self, run_number: int, attempt: int, at: float) -> float | None:
        """When the attempt's last step before ``at`` was received (None: no step)."""
        q = select(func.max(t.metrics.c.received_at)).where(
            t.metrics.c.run_number == run_number, t.metrics.c.attempt == attempt,
            t.metrics.c.received_at <= at)
        value = self.c.execute(q).scalar()
        return None if value is None else float(value)

    def latest_metric(self, run_number: int) -> MetricRecord | None:
        q = (
            select(t.metrics)
            .where(t.metrics.c.run_number == run_number)
            .order_by(t.metrics.c.received_at.desc(), t.metrics.c.step.desc())
            .limit(1)
        )
        r = self.c.execute(q).first()
        if r is None:
            return None
        return MetricRecord(attempt=r.attempt, step=r.step, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr,
                            step_time_s=r.step_time_s, tokens_per_s=r.tokens_per_s,
                            received_at=r.received_at)

    # --- events and outbox ----------------------------------------------------------

    def add_event(
        self, run_number: int | None, kind: str, message: str, data: dict[str, Any], now: float
    ) -> int:
        res = self.c.execute(
            insert(t.events).values(run_number=run_number, ts=now, kind=kind, message=message,
                                    data=json.dumps(data, sort_keys=True))
        )
        event_id = _new_id(res)
        self.c.execute(insert(t.outbox).values(event_id=event_id))
        return event_id

    def list_events(
        self, run_number: int | None = None, after_id: int = 0, limit: int = 1000, kind: str | None = None
    ) -> list[EventRecord]:
        q = select(t.events).where(t.events.c.id > after_id).order_by(t.events.c.id).limit(limit)
        if run_number is not None:
            q = q.where(t.events.c.run_number == run_number)
        if kind is not None:
            q = q.where(t.events.c.kind == kind)
        return [_event(r) for r in self.c.execute(q)]

    def count_events(self, run_number: int, kind: str) -> int:
        q = select(func.count()).select_from(t.events).where(t.events.c.run_number == run_number,
                                                              t.events.c.kind == kind)
        return int(self.c.execute(q).scalar_one())

    def unpublished_events(self, limit: int = 100) -> list[EventRecord]:
        q = (
            select(t.events)
            .join(t.outbox, t.outbox.c.event_id == t.events.c.id)
            .order_by(t.events.c.id)
            .limit(limit)
        )
        return [_event(r) for r in self.c.execute(q)]

    def outbox_size(self) -> int:
        return int(self.c.execute(select(func.count()).select_from(t.outbox)).scalar_one())

    def mark_published(self, event_ids: Sequence[int]) -> None:
        """Published events leave the outbox (the events table keeps them)."""
        if event_ids:
            self.c.execute(delete(t.outbox).where(t.outbox.c.event_id.in_(list(event_ids))))

    # --- commands -------------------------------------------------------------------

    def add_command(self, run_number: int, kind: CommandKind, now: float) -> int:
        self.get_run(run_number)  # NotFound for an unknown run
        res = self.c.execute(
            insert(t.commands).values(run_number=run_number, kind=kind.value, reason="", created_at=now)
        )
        return _new_id(res)

    def add_node_command(self, node: str, kind: NodeCommandKind, reason: str, now: float) -> int:
        self.get_node(node)  # NotFound for a node nobody knows
        res = self.c.execute(
            insert(t.commands).values(node=node, kind=kind.value, reason=reason, created_at=now)
        )
        return _new_id(res)

    def pending_commands(self) -> list[Command]:
        """Runs' commands not yet carried out, oldest first."""
        q = select(t.commands).where(t.commands.c.handled_at.is_(None), t.commands.c.run_number.is_not(None))
        return [
            Command(id=r.id, run_number=r.run_number, kind=CommandKind(r.kind), created_at=r.created_at)
            for r in self.c.execute(q.order_by(t.commands.c.id))
        ]

    def pending_node_commands(self) -> list[NodeCommand]:
        """Nodes' commands not yet carried out, oldest first."""
        q = select(t.commands).where(t.commands.c.handled_at.is_(None), t.commands.c.node.is_not(None))
        return [
            NodeCommand(id=r.id, node=r.node, kind=NodeCommandKind(r.kind), reason=r.reason,
                        created_at=r.created_at)
            for r in self.c.execute(q.order_by(t.commands.c.id))
        ]

    def finish_command(self, command_id: int, result: str, now: float) -> None:
        self.c.execute(
            update(t.commands).where(t.commands.c.id == command_id).values(handled_at=now, result=result)
        )

    def get_command_result(self, command_id: int) -> str | None:
        row = self.c.execute(select(t.commands.c.result).where(t.commands.c.id == command_id)).first()
        if row is None:
            raise NotFound(f"no such command: {command_id}")
        return row.result  # type: ignore[no-any-return]


# --- row mapping --------------------------------------------------------------------


def _run(r: Row[Any]) -> Run:
    return Run(
        number=r.number, name=r.name, state=RunState(r.state), reason=r.reason, nodes=r.nodes,
        ranks_per_node=r.ranks_per_node, spares=r.spares, total_steps=r.total_steps,
        policy=_policy(r.policy), created_at=r.created_at, started_at=r.started_at,
        ended_at=r.ended_at, final_step=r.final_step, model_digest=r.model_digest,
        budget_from_attempt=r.budget_from_attempt, allocation_info=r.allocation_info,
    )


_POLICY_KEYS = frozenset(f.name for f in fields(Policy))


def _policy(text: str) -> Policy:
    """A run's stored policy; keys an older release knew and this one does not are left
    out (the run's spec is validated on its own: supervisor/spec.py)."""
    return Policy(**{k: v for k, v in json.loads(text).items() if k in _POLICY_KEYS})


def _attempt_values(a: Attempt) -> dict[str, Any]:
    return {
        "run_number": a.run_number, "number": a.number, "state": a.state.value,
        "nodes": json.dumps(list(a.nodes)), "resume_from": a.resume_from, "resume_step": a.resume_step,
        "created_at": a.created_at, "started_at": a.started_at, "first_step_at": a.first_step_at,
        "stop_requested_at": a.stop_requested_at, "ended_at": a.ended_at,
        "outcome": a.outcome.value if a.outcome else None, "reason": a.reason,
        "final_step": a.final_step, "launch_info": a.launch_info, "launch_error": a.launch_error,
    }


def _attempt(r: Row[Any]) -> Attempt:
    return Attempt(
        run_number=r.run_number, number=r.number, state=AttemptState(r.state),
        nodes=tuple(json.loads(r.nodes)), resume_from=r.resume_from, resume_step=r.resume_step,
        created_at=r.created_at, started_at=r.started_at, first_step_at=r.first_step_at,
        stop_requested_at=r.stop_requested_at, ended_at=r.ended_at,
        outcome=AttemptOutcome(r.outcome) if r.outcome else None, reason=r.reason,
        final_step=r.final_step, launch_info=r.launch_info, launch_error=r.launch_error,
    )


def _node(r: Row[Any]) -> Node:
    return Node(name=r.name, state=NodeState(r.state), reason=r.reason, run_number=r.run_number)


def _event(r: Row[Any]) -> EventRecord:
    return EventRecord(id=r.id, run_number=r.run_number, ts=r.ts, kind=r.kind, message=r.message,
                       data=json.loads(r.data))
