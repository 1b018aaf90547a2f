"""Queries of what the trainers and the supervisor said: step metrics, events, the outbox."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select

from supervisor.domain import EventRecord, MetricRecord
from supervisor.store import schema as t
from supervisor.store.rows import event_of, finite, new_id


class TelemetryQueries:
    c: Connection

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
                run_number=run_number, attempt=attempt, step=step, loss=finite(loss),
                grad_norm=finite(grad_norm), lr=finite(lr), step_time_s=step_time_s,
                tokens_per_s=finite(tokens_per_s), received_at=now,
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
        event_id = new_id(res)
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
        return [event_of(r) for r in self.c.execute(q)]

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
        return [event_of(r) for r in self.c.execute(q)]

    def outbox_size(self) -> int:
        return int(self.c.execute(select(func.count()).select_from(t.outbox)).scalar_one())

    def mark_published(self, event_ids: Sequence[int]) -> None:
        """Published events leave the outbox (the events table keeps them)."""
        if event_ids:
            self.c.execute(delete(t.outbox).where(t.outbox.c.event_id.in_(list(event_ids))))

