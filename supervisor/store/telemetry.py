"""Queries of what the trainers and the supervisor said: step metrics and what is kept of them
(per-attempt stats, the downsampled loss curve), events, the outbox, and their retention."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Select, delete, func, insert, literal_column, select, update

from supervisor.domain import AttemptStats, CurvePoint, EventKind, EventRecord, MetricRecord
from supervisor.store import schema as t
from supervisor.store.rows import STATS_COLUMNS, event_of, finite, new_id, stats_of


class TelemetryQueries:
    c: Connection

    # --- metrics: raw rows (pruned by retention), per-attempt stats, the loss curve ---------

    def add_metric(
        self, run_number: int, *, attempt: int, step: int, loss: float, grad_norm: float | None, lr: float,
        step_time_s: float, tokens_per_s: float, now: float, param_norm: float | None = None,
        mfu: float | None = None, val_loss: float | None = None,
    ) -> bool:
        """Keep one of rank 0's steps; False when it was kept already (a duplicate delivery)."""
        res = self.c.execute(insert(t.metrics).prefix_with("OR IGNORE").values(
            run_number=run_number, attempt=attempt, step=step, loss=finite(loss), grad_norm=finite(grad_norm),
            lr=finite(lr), step_time_s=step_time_s, tokens_per_s=finite(tokens_per_s), received_at=now,
            param_norm=finite(param_norm), mfu=finite(mfu), val_loss=finite(val_loss)))
        return bool(res.rowcount)

    def list_metrics(self, run_number: int) -> list[MetricRecord]:
        """The raw steps still kept (retention prunes them): for tools and tests; every
        read the daemon serves comes from the stats and the curve."""
        q = select(t.metrics).where(t.metrics.c.run_number == run_number).order_by(
            t.metrics.c.attempt, t.metrics.c.step)
        return [MetricRecord(attempt=r.attempt, step=r.step, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr,
                             step_time_s=r.step_time_s, tokens_per_s=r.tokens_per_s,
                             received_at=r.received_at, param_norm=r.param_norm, mfu=r.mfu,
                             val_loss=r.val_loss) for r in self.c.execute(q)]

    def loss_before(self, run_number: int, step: int, attempt: int) -> tuple[int, float | None] | None:
        """(attempt, loss): the loss rank 0 reported for ``step`` in the newest attempt
        before ``attempt`` that got there (None: none did, or retention pruned it; a loss
        that was not finite is None)."""
        m = t.metrics.c
        q = (select(m.attempt, m.loss).where(m.run_number == run_number, m.step == step, m.attempt < attempt)
             .order_by(m.attempt.desc()).limit(1))
        row = self.c.execute(q).first()
        return None if row is None else (row.attempt, row.loss)

    def attempt_stats(self, run_number: int, after: int = 0) -> dict[int, AttemptStats]:
        """The stats of the run's attempts numbered above ``after``."""
        q = select(t.attempt_stats).where(t.attempt_stats.c.run_number == run_number,
                                          t.attempt_stats.c.attempt > after)
        return {r.attempt: stats_of(r) for r in self.c.execute(q)}

    def stats_of_attempt(self, run_number: int, attempt: int) -> AttemptStats | None:
        row = self.c.execute(select(t.attempt_stats).where(t.attempt_stats.c.run_number == run_number,
                                                           t.attempt_stats.c.attempt == attempt)).first()
        return stats_of(row) if row is not None else None

    def newest_stats(self, run_number: int) -> AttemptStats | None:
        """The stats of the newest attempt that made a step: the run's latest step and loss."""
        row = self.c.execute(select(t.attempt_stats).where(
            t.attempt_stats.c.run_number == run_number, t.attempt_stats.c.steps > 0).order_by(
            t.attempt_stats.c.attempt.desc()).limit(1)).first()
        return stats_of(row) if row is not None else None

    def put_attempt_stats(self, run_number: int, s: AttemptStats) -> None:
        values = {k: getattr(s, k) for k in STATS_COLUMNS}
        key = (t.attempt_stats.c.run_number == run_number, t.attempt_stats.c.attempt == s.attempt)
        done = self.c.execute(update(t.attempt_stats).where(*key).values(**values))
        if done.rowcount == 0:
            self.c.execute(insert(t.attempt_stats).values(run_number=run_number, attempt=s.attempt, **values))

    def extend_curve(self, run_number: int, points: Sequence[CurvePoint]) -> None:
        """Rank 0's new steps, in order, into the run's downsampled loss curve."""
        row = self.c.execute(select(t.runs.c.curve_seq, t.runs.c.curve_stride).where(
            t.runs.c.number == run_number)).first()
        if row is None or not points:
            return
        seq, stride = int(row.curve_seq), int(row.curve_stride)
        for p in points:
            seq += 1
            if seq % stride == 0:
                self.c.execute(insert(t.loss_curve).prefix_with("OR IGNORE").values(
                    run_number=run_number, seq=seq, attempt=p.attempt, step=p.step, loss=finite(p.loss),
                    grad_norm=finite(p.grad_norm), step_time_s=p.step_time_s, at=p.at))
            if seq // stride > t.CURVE_POINTS:  # twice the points wanted: keep every other
                stride *= 2
                self.c.execute(delete(t.loss_curve).where(t.loss_curve.c.run_number == run_number,
                                                          t.loss_curve.c.seq % stride != 0))
        self.c.execute(update(t.runs).where(t.runs.c.number == run_number).values(curve_seq=seq,
                                                                                 curve_stride=stride))

    def curve(self, run_number: int) -> list[CurvePoint]:
        q = select(t.loss_curve).where(t.loss_curve.c.run_number == run_number).order_by(t.loss_curve.c.seq)
        return [CurvePoint(attempt=r.attempt, step=r.step, loss=r.loss, grad_norm=r.grad_norm,
                           step_time_s=r.step_time_s, at=r.at) for r in self.c.execute(q)]

    # --- retention --------------------------------------------------------------------

    def prune_metrics(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` raw steps received before ``before``; how many went."""
        old: Select[Any] = select(literal_column("rowid")).select_from(t.metrics).where(
            t.metrics.c.received_at < before).limit(limit)
        return int(self.c.execute(delete(t.metrics).where(literal_column("rowid").in_(old))).rowcount)

    def prune_events(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` events older than ``before`` that have been published."""
        old = select(t.events.c.id).where(t.events.c.ts < before,
                                          t.events.c.id.not_in(select(t.outbox.c.event_id))).limit(limit)
        return int(self.c.execute(delete(t.events).where(t.events.c.id.in_(old))).rowcount)

    # --- events and outbox ----------------------------------------------------------

    def add_event(
        self, run_number: int | None, kind: EventKind, message: str, data: dict[str, Any], now: float
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

    def injected_at(self, run_number: int, attempt: int, before: float) -> float | None:
        """When a drill last injected a fault into ``attempt`` at or before ``before``."""
        q = select(t.events.c.ts, t.events.c.data).where(
            t.events.c.run_number == run_number, t.events.c.kind == EventKind.CHAOS_INJECTED,
            t.events.c.ts <= before,
        ).order_by(t.events.c.id.desc()).limit(50)
        for ts, data in self.c.execute(q):
            said = json.loads(data)
            if said.get("attempt") == attempt:
                return float(said.get("at", ts))  # the trainer's own time of it, when it said
        return None

    def drains_by_us_since(self, since: float) -> int:
        """How many nodes this supervisor drained of its own accord (not an operator) since ``since``."""
        e = t.events.c
        by_us = func.json_extract(e.data, "$.by") == "supervisor"
        q = select(func.count()).select_from(t.events).where(e.ts >= since, e.kind == EventKind.NODE_DRAINED,
                                                              by_us)
        return int(self.c.execute(q).scalar_one())

    def count_events(self, run_number: int, kind: EventKind) -> int:
        q = select(func.count()).select_from(t.events).where(t.events.c.run_number == run_number,
                                                              t.events.c.kind == kind)
        return int(self.c.execute(q).scalar_one())

    def notify_cursor(self, name: str) -> int | None:
        """The newest event id webhook ``name`` delivered or passed over (None: never started)."""
        q = select(t.notify_cursors.c.event_id).where(t.notify_cursors.c.name == name)
        found = self.c.execute(q).scalar_one_or_none()
        return None if found is None else int(found)

    def set_notify_cursor(self, name: str, event_id: int) -> None:
        c = t.notify_cursors.c
        done = self.c.execute(update(t.notify_cursors).where(c.name == name).values(event_id=event_id))
        if done.rowcount == 0:
            self.c.execute(insert(t.notify_cursors).values(name=name, event_id=event_id))

    def newest_event_id(self) -> int:
        return int(self.c.execute(select(func.max(t.events.c.id))).scalar_one() or 0)

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

