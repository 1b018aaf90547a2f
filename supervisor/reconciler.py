"""The reconciler: observe, decide, record and act; once per tick, for every run and node.

    gathering/        Feed: what the telemetry view must know first (a [command]
                      trainer's output); Observer: what each run looks like now
    policy/           decide(), judge_probes(), node_command(): the pure core
    effects/          Effects: one transaction per decision, then its effects, a family
                      of handlers per kind (one table); the node intents (drains,
                      returns) sent until the cluster shows them
    probes.py         ProbeScheduler: probe rounds on worker threads, the periodic sweep
    recorder.py       TelemetryRecorder: the telemetry that must outlive the daemon, and retention

A tick: trainer telemetry that must survive a restart is recorded; finished probe
rounds are judged, a sweep is started when one is due, and operators' node commands
are carried out; each run's telemetry is fed, then the run is observed, decided and
executed; the node intents are
pushed, nodes the cluster repaired are taken back, and (once a minute) what retention
lets go is deleted. A run whose reconciliation raises is logged and tried again next
tick; it never stops the other runs.

Level-triggered and idempotent: everything it needs is in SQLite or observable, so a
restarted daemon carries on where a killed one stopped. An attempt is recorded before
it is launched (LAUNCHING); if the daemon dies between the two, the next tick finds
the attempt's processes by their marker, or learns that none exist, and never starts
a second copy.

The tick runs on a worker thread of its own (supervisor/daemon.py), never on the event
loop that serves the broker, the telemetry link and the API. Both share the
interpreter, so a tick may take at most ``TICK_DUTY`` of the time (``pause_after``): a
tick that takes longer than that share of ``tick_s`` (an attempt of tens of thousands
of ranks) lengthens the period rather than running back to back and leaving telemetry
unread (bench/scale.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from supervisor import node_health
from supervisor.domain import DrainBudget, NodeState
from supervisor.domain.events import EventKind
from supervisor.effects import Deps, Effects
from supervisor.errors import NotFound
from supervisor.gathering.feed import Feed
from supervisor.gathering.launch_specs import LaunchSpecs
from supervisor.gathering.observe import Observer
from supervisor.gathering.run_memory import RunMemory
from supervisor.launchers.base import Launcher, NodeAdmin
from supervisor.policy import decide
from supervisor.policy.nodes import DRAINED_BY_US, judge_probes, node_command
from supervisor.probes import ProbeScheduler
from supervisor.recorder import Retention, TelemetryRecorder
from supervisor.store import SqlStore
from supervisor.telemetry.view import TelemetryView

log = logging.getLogger(__name__)

TICK_DUTY = 0.25  # the share of the time the ticks may take; the rest is telemetry's
PAUSE_MAX_S = 1.0  # ... but one slow tick (a stalled disk) never holds the next one back longer


def pause_after(tick_s: float, took_s: float) -> float:
    """How long to wait after a tick that took ``took_s`` before the next: what is left of
    ``tick_s``, and never less than keeps the ticks to TICK_DUTY of the time, up to
    PAUSE_MAX_S."""
    return max(tick_s - took_s, min(took_s * (1 - TICK_DUTY) / TICK_DUTY, PAUSE_MAX_S))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconcilerConfig:
    mqtt_url: str | None  # what the trainers publish to; None: no telemetry
    mqtt_ca_file: Path | None = None  # the CA the trainers check an mqtts:// broker with (None: the system's)
    # The periodic sweep of idle nodes and of nodes this supervisor drained (None: off):
    sweep_every_s: float | None = None
    sweep_args: tuple[str, ...] = ()  # extra arguments to python -m health
    sweep_timeout_s: float = 60.0
    # A node this supervisor drained returns to service after this many clean sweep
    # probes in a row (0: never; an operator returns it by hand).
    return_after: int = 0
    retention: Retention = field(default_factory=Retention)
    # The daemon's one budget for the drains it makes of its own accord (supervisor/effects/nodes.py).
    drain_budget: DrainBudget = field(default_factory=DrainBudget)
    node_python: str = sys.executable  # the supervisor's node programs' interpreter on the nodes


class Reconciler:
    def __init__(self, store: SqlStore, telemetry: TelemetryView, config: ReconcilerConfig, *,
                 launcher: Launcher, nodes: NodeAdmin, clock: Callable[[], float] = time.time,
                 probe_pool: Executor | None = None) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.probes = ProbeScheduler(nodes, clock, store=store, sweep_every_s=config.sweep_every_s,
                                     sweep_args=config.sweep_args,
                                     sweep_timeout_s=config.sweep_timeout_s, pool=probe_pool)
        # The run's memory between ticks has one owner, this one; the feed and the observer
        # alone write it, the effects read a run's spec from it (run_memory.py).
        self.memory = RunMemory(store)
        self.feed = Feed(telemetry, self.memory)
        launch_specs = LaunchSpecs(telemetry, mqtt_url=config.mqtt_url, mqtt_ca_file=config.mqtt_ca_file,
                                   node_python=config.node_python)
        self.observer = Observer(store, launcher, telemetry, self.memory, launch_specs,
                                 probing=self.probes.probing, clock=clock)
        self.effects = Effects(Deps(store=store, launcher=launcher, nodes=nodes, telemetry=telemetry,
                                    probes=self.probes, memory=self.memory, launch_specs=launch_specs,
                                    clock=clock, drain_budget=config.drain_budget))
        self.recorder = TelemetryRecorder(store, telemetry, config.retention)
        self.hooks: list[Callable[[], None]] = []  # run first in every tick, on its thread (chaos drills)
        self._reopened = False  # the rounds a daemon before this one left open: asked again at the first tick

    def close(self) -> None:
        self.probes.close()

    def tick(self) -> None:
        if not self._reopened:  # on the tick's thread, not in the constructor: building does no I/O
            self.probes.reopen()
            self._reopened = True
        for hook in self.hooks:
            hook()
        now = self.clock()
        self.recorder.record()
        self._judge_probes(now)
        self._maybe_sweep(now)
        self._node_commands(now)
        for run, commands in self.observer.runs():
            try:
                history = self.observer.history_of(run, now)
                fed = self.feed.feed(run, history.live, now)  # before observe, which only reads the view
                seen = self.observer.observe(run, commands, now, history, fed)
                effects = decide(seen.view, seen.obs, now)
                facts = seen.facts
                if effects or facts.grant or facts.checkpoints or facts.out_of_range or facts.output_offsets:
                    self.effects.apply(seen, effects, now)
            except Exception:
                # One run's trouble (a vanished directory, a full disk) must not stall
                # the others; the next tick tries again from what is recorded.
                log.exception("%s: reconciliation failed; retrying next tick", run.run_id)
        self.effects.release_ended(now)
        self.effects.push_intents(now)
        self.effects.take_back_repaired(now)
        self.recorder.prune(now)

    def post_event(self, run_number: int | None, kind: EventKind, message: str,
                   data: dict[str, object]) -> None:
        """Record an event from outside the loop (chaos injection)."""
        self.effects.post_event(run_number, kind, message, data)

    def _judge_probes(self, now: float) -> None:
        for done in self.probes.finished():
            r = done.round
            with self.store.tx() as tx:
                known = {x.name: x for x in tx.list_nodes()}
                history = {n: tx.recent_probes(n, max(node_health.CONFIRMATIONS, self.config.return_after))
                           for n in r.nodes}
            judged = judge_probes(kind=r.kind, run_number=r.run_number, round_=r.round, answers=done.answers,
                                  known=known, history=history, return_after=self.config.return_after,
                                  now=now, command_id=r.command_id, link_gbps=done.link_gbps)
            self.effects.apply_nodes(judged, now)
            self.probes.done(r)

    def _maybe_sweep(self, now: float) -> None:
        """Every ``sweep_every_s``: probe the idle nodes and the nodes this supervisor
        drained (not those an operator drained by hand), one round at a time."""
        if not self.probes.sweep_due(now):
            return
        with self.store.tx() as tx:
            nodes = [x for x in tx.list_nodes() if x.state is NodeState.IDLE
                     or (x.state is NodeState.DRAINED and x.reason.startswith(DRAINED_BY_US))]
        if nodes:
            self.probes.submit(run_number=None, kind="sweep", nodes=[x.name for x in nodes],
                               argv=node_health.probe_argv(self.config.sweep_args,
                                                           interpreter=self.config.node_python),
                               timeout_s=self.config.sweep_timeout_s,
                               drained={x.name: x.reason for x in nodes if x.state is NodeState.DRAINED})

    def _node_commands(self, now: float) -> None:
        """Operators' drains, undrains and probes, oldest first: each sees the node as the
        command before it left it (a probe, queued while a round probes the node)."""
        with self.store.tx() as tx:
            commands = tx.pending_node_commands()
        for cmd in commands:
            node = None
            with self.store.tx() as tx, contextlib.suppress(NotFound):
                node = tx.get_node(cmd.node)
            self.effects.apply_nodes(node_command(cmd, node, probing=self.probes.probing_node(cmd.node)), now)
