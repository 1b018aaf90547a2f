"""``/metrics`` for Prometheus: what the supervisor knows, read at scrape time.

Most series are derived from SQLite on each scrape, so they survive a daemon restart
and never disagree with the API; the rest count what only this process sees (the MQTT
link, the reconciler's ticks). Every name starts with ``tsup_``:

    tsup_runs{state}                          runs in each state (gauge)
    tsup_attempts_total                       attempts of every run (counter)
    tsup_faults_total{kind}                   faults detected, by kind (counter)
    tsup_fault_detection_seconds              fault to detection (histogram): from the chaos
                                              injection when there was one, else from the
                                              attempt's last step before it (an upper bound)
    tsup_fault_recovery_seconds               detection to the first step after it (histogram)
    tsup_run_ettr{run_id,name}                effective training time ratio (gauge)
    tsup_run_step{run_id,name}                the newest step (gauge)
    tsup_run_attempts{run_id,name}            attempts so far (gauge)
    tsup_nodes{state}                         nodes in each state; DRAINED is the drained ones
    tsup_probes_total{status}                 node probes by verdict; unhealthy and unknown
                                              are probe failures (counter)
    tsup_mqtt_connected                       1 while the telemetry link is up
    tsup_mqtt_messages_total{kind}            trainer messages received, by kind (counter)
    tsup_mqtt_dropped_total{reason}           messages dropped (counter): malformed; not
                                              authentic (unsigned, bad_mac, replay,
                                              will_unattributed: supervisor/telemetry/view.py);
                                              of an attempt that has ended; or over the
                                              buffer while the store lagged (buffer_full)
    tsup_outbox_events                        events not yet published on MQTT (gauge)
    tsup_standby_processes{run_id,node}       warm standbys waiting for the run's next attempt
                                              ([resources] standby; gauge)
    tsup_reconcile_tick_seconds               reconciler tick duration (histogram)

Per-run series cover the runs that are active or ended in the last day, so that a
daemon that ran for months does not export every run it ever saw.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from supervisor.domain import TERMINAL_RUN_STATES, FaultRecord, NodeState, RunState
from supervisor.gathering.settled import SettledHistory, is_over
from supervisor.store import SqlStore
from supervisor.telemetry.gate import DROP_REASONS
from supervisor.telemetry.view import TelemetryView

DETECTION_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RECOVERY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
TICK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
RECENT_S = 86_400.0  # per-run series: active runs and those ended this recently
# TelemetryView.counts keys -> the reason label
_DROPS = {**{reason: reason for reason in DROP_REASONS}, "durable_dropped": "buffer_full"}


class SupervisorMetrics:
    """The daemon's registry: the store collector plus the tick histogram it observes."""

    def __init__(self, store: SqlStore, telemetry: TelemetryView, mqtt_connected: Callable[[], bool],
                 clock: Callable[[], float] = time.time,
                 standbys: Callable[[], Mapping[str, Mapping[str, int]]] = dict,
                 history: SettledHistory | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.tick_seconds = Histogram("tsup_reconcile_tick_seconds", "Reconciler tick duration",
                                      buckets=TICK_BUCKETS, registry=self.registry)
        self.registry.register(_StoreCollector(store, telemetry, mqtt_connected, clock, standbys,
                                               history or SettledHistory()))


class _Buckets:
    """A histogram's counts, built a value at a time (each value in the first bucket whose
    bound is at least it, as Prometheus's ``le``)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def add(self, value: float) -> None:
        value = max(0.0, value)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def merged(self, other: _Buckets) -> _Buckets:
        out = _Buckets(self.bounds)
        out.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        out.total = self.total + other.total
        return out


class _FaultTotals:
    """What faults add to a scrape: counts by kind, and the detection and recovery times."""

    def __init__(self) -> None:
        self.folded = 0  # of the run's faults, oldest first, how many are summed here
        self.kinds: dict[str, int] = {}
        self.detection = _Buckets(DETECTION_BUCKETS)
        self.recovery = _Buckets(RECOVERY_BUCKETS)

    def add(self, f: FaultRecord) -> None:
        self.kinds[f.kind.value] = self.kinds.get(f.kind.value, 0) + 1
        since = f.injected_at if f.injected_at is not None else f.last_step_at
        if since is not None:
            self.detection.add(f.detected_at - since)
        if f.recovered_at is not None:
            self.recovery.add(f.recovered_at - f.detected_at)

    def merged(self, other: _FaultTotals) -> _FaultTotals:
        out = _FaultTotals()
        out.kinds = {k: self.kinds.get(k, 0) + other.kinds.get(k, 0) for k in {*self.kinds, *other.kinds}}
        out.detection = self.detection.merged(other.detection)
        out.recovery = self.recovery.merged(other.recovery)
        return out


class _StoreCollector(Collector):
    def __init__(self, store: SqlStore, telemetry: TelemetryView, mqtt_connected: Callable[[], bool],
                 clock: Callable[[], float], standbys: Callable[[], Mapping[str, Mapping[str, int]]],
                 history: SettledHistory) -> None:
        self.store, self.telemetry, self.mqtt_connected, self.clock = store, telemetry, mqtt_connected, clock
        self.standbys = standbys
        self.history = history
        # Recovered faults never change: each run's are summed once, as they come; a scrape
        # adds only the faults not recovered yet (a run of weeks has a thousand of them).
        self._settled: dict[int, _FaultTotals] = {}
        self._lock = threading.Lock()  # scrapes run in the API's worker threads

    def _fault_totals(self, faults_by_run: Mapping[int, Sequence[FaultRecord]]) -> _FaultTotals:
        out = _FaultTotals()
        with self._lock:
            for number, faults in faults_by_run.items():
                settled = self._settled.get(number)
                if settled is None or settled.folded > len(faults):
                    settled = self._settled[number] = _FaultTotals()
                while settled.folded < len(faults) and faults[settled.folded].recovered_at is not None:
                    settled.add(faults[settled.folded])
                    settled.folded += 1
                out = out.merged(settled)
                for f in faults[settled.folded:]:
                    out.add(f)
        return out

    def describe(self) -> list[Metric]:
        return []  # families are built at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        with self.store.tx() as tx:  # settled history decoded once (gathering/settled.py), steps never
            runs = tx.list_runs()
            histories = {r.number: self.history.read(tx, r.number, over=is_over(r, now))
                         for r in runs}
            attempts = {n: h.attempts for n, h in histories.items()}
            faults = self._fault_totals({n: h.faults for n, h in histories.items()})
            nodes = tx.node_counts()
            probes = tx.probe_counts()
            outbox = tx.outbox_size()
            recent = [r for r in runs if r.state not in TERMINAL_RUN_STATES
                      or (r.ended_at is not None and now - r.ended_at <= RECENT_S)]

        g = GaugeMetricFamily("tsup_runs", "Runs in each state", labels=["state"])
        for state in RunState:
            g.add_metric([state.value], sum(1 for r in runs if r.state is state))
        yield g
        yield CounterMetricFamily("tsup_attempts", "Attempts of every run",
                                  value=sum(len(a) for a in attempts.values()))
        c = CounterMetricFamily("tsup_faults", "Faults detected, by kind", labels=["kind"])
        for kind, count in sorted(faults.kinds.items()):
            c.add_metric([kind], count)
        yield c
        yield _histogram("tsup_fault_detection_seconds",
                         "Fault to detection: from the injection, else from the last step before it",
                         faults.detection)
        yield _histogram("tsup_fault_recovery_seconds", "Fault detection to the first step after it",
                         faults.recovery)

        ettr = GaugeMetricFamily("tsup_run_ettr", "Effective training time ratio", labels=["run_id", "name"])
        step = GaugeMetricFamily("tsup_run_step", "The newest step", labels=["run_id", "name"])
        tries = GaugeMetricFamily("tsup_run_attempts", "Attempts so far", labels=["run_id", "name"])
        for r in recent:
            history = histories[r.number]
            stats = history.stats
            account = history.account(r, now)
            labels = [r.run_id, r.name]
            if account.ettr is not None:
                ettr.add_metric(labels, account.ettr)
            latest = max((s.last_step for s in stats.values() if s.last_step is not None), default=None)
            newest = r.final_step if r.final_step is not None else latest
            if newest is not None:
                step.add_metric(labels, newest)
            tries.add_metric(labels, len(attempts[r.number]))
        yield ettr
        yield step
        yield tries

        g = GaugeMetricFamily("tsup_nodes", "Nodes in each state (DRAINED: out of service)", labels=["state"])
        for node_state in NodeState:
            g.add_metric([node_state.value], nodes.get(node_state, 0))
        yield g
        c = CounterMetricFamily("tsup_probes", "Node probes by verdict (unhealthy, unknown: failed)",
                                labels=["status"])
        for status in ("healthy", "degraded", "unhealthy", "unknown"):
            c.add_metric([status], probes.get(status, 0))
        yield c

        yield GaugeMetricFamily("tsup_mqtt_connected", "1 while the telemetry link is up",
                                value=1.0 if self.mqtt_connected() else 0.0)
        counts = self.telemetry.counts_now()
        c = CounterMetricFamily("tsup_mqtt_messages", "Trainer messages received, by kind", labels=["kind"])
        for kind, count in sorted(counts.items()):
            if kind not in _DROPS and kind != "received":
                c.add_metric([kind], count)
        yield c
        c = CounterMetricFamily("tsup_mqtt_dropped", "Trainer messages dropped", labels=["reason"])
        for key, reason in _DROPS.items():
            c.add_metric([reason], counts.get(key, 0))
        yield c
        yield GaugeMetricFamily("tsup_outbox_events", "Events not yet published on MQTT", value=outbox)
        g = GaugeMetricFamily("tsup_standby_processes", "Warm standbys waiting for a run's next attempt",
                              labels=["run_id", "node"])
        for run_id, per_node in sorted(self.standbys().items()):
            for node, count in sorted(per_node.items()):
                g.add_metric([run_id, node], count)
        yield g


def _histogram(name: str, documentation: str, b: _Buckets) -> HistogramMetricFamily:
    running, cumulative = 0, []
    for bound, count in zip([*map(str, b.bounds), "+Inf"], b.counts, strict=True):
        running += count
        cumulative.append((bound, running))
    return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=b.total)
