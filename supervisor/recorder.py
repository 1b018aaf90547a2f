"""The telemetry that must outlive the daemon, written to the store once per tick.

Rank 0's step metrics, checkpoint commits and restores, and the faults the trainer
injected itself wait in the telemetry view's durable queue until they are committed
here, in one transaction per tick. With each step the per-attempt stats (``AttemptStats``: what
every read of a run adds up) and the downsampled loss curve are kept up to date, so
that no read has to go through the raw steps, which retention then prunes: raw steps
after ``metrics_days``, events after ``events_days`` (published ones only).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import wire as p
from supervisor.domain import AttemptStats, CurvePoint, MetricRecord
from supervisor.domain.events import EventKind
from supervisor.goodput import with_step
from supervisor.store import SqlStore, Tx
from supervisor.telemetry.records import Received
from supervisor.telemetry.view import TelemetryView

log = logging.getLogger(__name__)

_DAY_S = 86_400.0
PRUNE_EVERY_S = 60.0  # how often retention runs
PRUNE_BATCH = 20_000  # rows per table per pass: a long backlog is cleared over several passes


@dataclass(frozen=True, slots=True, kw_only=True)
class Retention:
    metrics_days: float = 14.0  # raw step metrics (the stats and the curve are kept for ever)
    events_days: float = 90.0  # the audit log (an event still waiting in the outbox is kept)


class TelemetryRecorder:
    def __init__(self, store: SqlStore, telemetry: TelemetryView, retention: Retention | None = None) -> None:
        self.store = store
        self.telemetry = telemetry
        self.retention = retention or Retention()
        self._pruned_at: float | None = None

    def record(self) -> None:
        items = self.telemetry.peek_durable()
        if not items:
            return
        with self.store.tx() as tx:
            numbers = {r.run_id: r.number for r in tx.list_runs()}
        try:
            with self.store.tx() as tx:
                _Batch(tx, numbers).add(items)
        except Exception:
            # One bad item must not block the rest forever: store them one by one and
            # drop (and count) only those that fail on their own.
            log.exception("persisting telemetry failed; retrying item by item")
            failed = 0
            for item in items:
                try:
                    with self.store.tx() as tx:
                        _Batch(tx, numbers).add([item])
                except Exception:
                    failed += 1
            if failed == len(items):
                raise  # the database, not the items: keep them all for the next tick
            self.telemetry.count("durable_dropped", failed)
        self.telemetry.drop_durable(len(items))  # only once they are committed (or hopeless)

    def prune(self, now: float) -> tuple[int, int]:
        """Retention, at most every PRUNE_EVERY_S: (raw steps, events) deleted."""
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY_S:
            return 0, 0
        self._pruned_at = now
        with self.store.tx() as tx:
            steps = tx.prune_metrics(now - self.retention.metrics_days * _DAY_S, PRUNE_BATCH)
            events = tx.prune_events(now - self.retention.events_days * _DAY_S, PRUNE_BATCH)
        if steps or events:
            log.info("retention: deleted %d raw step(s) and %d event(s)", steps, events)
        return steps, events


SENDER_CLOCK_TRUSTED_S = 60.0  # how far before its receipt a message's own time is believed


def _sent_at(sent: float, received: float) -> float:
    """When a rank says it sent a message: its own clock, unless that is later than the
    message's receipt or more than SENDER_CLOCK_TRUSTED_S before it (then the receipt's)."""
    return sent if math.isfinite(sent) and received - SENDER_CLOCK_TRUSTED_S <= sent <= received else received


class _Batch:
    """One tick's items, in one transaction: the stats of each attempt touched are read
    once, folded with its new steps, and written once."""

    def __init__(self, tx: Tx, numbers: dict[str, int]) -> None:
        self.tx = tx
        self.numbers = numbers
        self.stats: dict[tuple[int, int], AttemptStats] = {}
        self.curve: dict[int, list[CurvePoint]] = {}

    def add(self, items: list[Received]) -> None:
        for item in items:
            self._one(item)
        for run_number, points in self.curve.items():
            self.tx.extend_curve(run_number, points)
        for (run_number, _), stats in self.stats.items():
            self.tx.put_attempt_stats(run_number, stats)

    def _stats(self, run_number: int, attempt: int) -> AttemptStats:
        key = (run_number, attempt)
        if key not in self.stats:
            self.stats[key] = self.tx.stats_of_attempt(run_number, attempt) or AttemptStats(attempt=attempt)
        return self.stats[key]

    def _one(self, item: Received) -> None:
        msg, tx = item.msg, self.tx
        number = self.numbers.get(msg.run)
        if number is None:
            return  # telemetry of a run this daemon does not know
        if isinstance(msg, p.StepMetrics):
            if tx.add_metric(number, attempt=msg.attempt, step=msg.step, loss=msg.loss,
                             grad_norm=msg.grad_norm,
                             lr=msg.lr, step_time_s=msg.step_time_s, tokens_per_s=msg.tokens_per_s,
                             now=item.at, param_norm=msg.param_norm, mfu=msg.mfu, val_loss=msg.val_loss):
                m = MetricRecord(attempt=msg.attempt, step=msg.step, loss=msg.loss, grad_norm=msg.grad_norm,
                                 lr=msg.lr, step_time_s=msg.step_time_s, tokens_per_s=msg.tokens_per_s,
                                 received_at=item.at, param_norm=_finite(msg.param_norm),
                                 mfu=_finite(msg.mfu), val_loss=_finite(msg.val_loss))
                self.stats[(number, msg.attempt)] = with_step(self._stats(number, msg.attempt), m)
                self.curve.setdefault(number, []).append(CurvePoint(
                    attempt=msg.attempt, step=msg.step, loss=msg.loss, grad_norm=msg.grad_norm,
                    step_time_s=msg.step_time_s, at=item.at))
        elif isinstance(msg, p.FaultInjected):  # a drill's fault, injected by the trainer itself
            at = _sent_at(msg.ts, item.at)
            tx.add_event(number, EventKind.CHAOS_INJECTED,
                         f"chaos {msg.action} fired in the trainer at step {msg.step}: {msg.detail} "
                         f"(rank {msg.rank})",
                         {"action": msg.action, "step": msg.step, "attempt": msg.attempt, "rank": msg.rank,
                          "at": at}, item.at)
            tx.fill_injected_at(number, msg.attempt, at)  # a fault recorded before this report came
        elif isinstance(msg, p.CheckpointRestored):
            timed = msg.bytes and msg.duration_s > 0
            pace = f", {msg.bytes / msg.duration_s / 1e9:.2f} GB/s" if timed else ""
            tx.add_event(number, EventKind.CHECKPOINT_RESTORED,
                         f"attempt {msg.attempt} resumed after step {msg.step} from {msg.path} in "
                         f"{msg.duration_s:.2f} s ({msg.bytes / 1e9:.3g} GB a rank{pace})",
                         {"step": msg.step, "path": msg.path, "tier": msg.tier, "attempt": msg.attempt,
                          "seconds": _finite(msg.duration_s), "bytes": msg.bytes}, item.at)
        elif msg.tier == p.TIER_MEMORY:  # often (every few steps): recorded without an event
            tx.record_memory_checkpoint(number, attempt=msg.attempt, step=msg.step,
                                        duration_s=_blocked_s(msg), now=item.at)
        else:
            stats = self._stats(number, msg.attempt)
            duration = _blocked_s(msg)
            if tx.record_checkpoint(number, step=msg.step, path=msg.path, complete=True,
                                    duration_s=duration,
                                    attempt=msg.attempt, now=item.at, attempt_time_s=stats.step_time_s):
                saved_s = stats.checkpoint_s + (duration or 0.0)
                self.stats[(number, msg.attempt)] = replace(stats, checkpoints=stats.checkpoints + 1,
                                                            checkpoint_s=saved_s)
                took = f" in {duration:.2f} s" if duration is not None else ""
                tx.add_event(number, EventKind.CHECKPOINT_COMMITTED,
                             f"checkpoint at step {msg.step} committed{took}",
                             {"step": msg.step, "path": msg.path, "attempt": msg.attempt}, item.at)


def _blocked_s(msg: p.CheckpointCommitted) -> float | None:
    """How long the save blocked training; None if not timed (a trainer of the user's may
    not time its saves: trainer.client sends NaN)."""
    return msg.duration_s if math.isfinite(msg.duration_s) and msg.duration_s >= 0 else None


def _finite(x: float) -> float | None:
    """As the store keeps it: a value that is not finite (NaN: not measured) is None."""
    return x if math.isfinite(x) else None
