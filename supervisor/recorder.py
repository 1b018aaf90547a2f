"""The telemetry that must outlive the daemon, written to the store once per tick.

Rank 0's step metrics (the loss curve, goodput), checkpoint commits and the faults the
trainer injected itself wait in the telemetry view's durable queue until they are
committed here, in one transaction per tick.
"""

from __future__ import annotations

import logging

from supervisor.store import SqlStore, Tx
from supervisor.telemetry import Received, TelemetryView
from trainer import protocol as p

log = logging.getLogger(__name__)


class TelemetryRecorder:
    def __init__(self, store: SqlStore, telemetry: TelemetryView) -> None:
        self.store = store
        self.telemetry = telemetry

    def record(self) -> None:
        items = self.telemetry.peek_durable()
        if not items:
            return
        with self.store.tx() as tx:
            numbers = {r.run_id: r.number for r in tx.list_runs()}
        try:
            with self.store.tx() as tx:
                for item in items:
                    self._record_one(tx, numbers, item)
        except Exception:
            # One bad item must not block the rest forever: store them one by one and
            # drop (and count) only those that fail on their own.
            log.exception("persisting telemetry failed; retrying item by item")
            failed = 0
            for item in items:
                try:
                    with self.store.tx() as tx:
                        self._record_one(tx, numbers, item)
                except Exception:
                    failed += 1
            if failed == len(items):
                raise  # the database, not the items: keep them all for the next tick
            self.telemetry.count("durable_dropped", failed)
        self.telemetry.drop_durable(len(items))  # only once they are committed (or hopeless)

    @staticmethod
    def _record_one(tx: Tx, numbers: dict[str, int], item: Received) -> None:
        msg = item.msg
        number = numbers.get(msg.run)
        if number is None:
            return  # telemetry of a run this daemon does not know
        if isinstance(msg, p.StepMetrics):
            tx.add_metric(number, attempt=msg.attempt, step=msg.step, loss=msg.loss, grad_norm=msg.grad_norm,
                          lr=msg.lr, step_time_s=msg.step_time_s, tokens_per_s=msg.tokens_per_s, now=item.at)
        elif isinstance(msg, p.FaultInjected):  # a drill's fault, injected by the trainer itself
            tx.add_event(number, "chaos.injected",
                         f"chaos {msg.action} fired in the trainer at step {msg.step}: {msg.detail} "
                         f"(rank {msg.rank})",
                         {"action": msg.action, "step": msg.step, "attempt": msg.attempt, "rank": msg.rank},
                         item.at)
        elif tx.record_checkpoint(number, step=msg.step, path=msg.path, complete=True,
                                  duration_s=msg.duration_s,
                                  attempt=msg.attempt, now=item.at):
            tx.add_event(number, "checkpoint.committed",
                         f"checkpoint at step {msg.step} committed in {msg.duration_s:.2f} s",
                         {"step": msg.step, "path": msg.path, "attempt": msg.attempt}, item.at)
