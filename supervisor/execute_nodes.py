"""Execute the effects on nodes: drains, returns to service, probe results, probes again.

``apply`` records a decision about nodes (supervisor/policy/nodes.py: a round of probe
results, an operator's drain or undrain) in one transaction and acts on it; a run's
decision records its drains through ``record`` in its own transaction.

Every effect on the outside world that must hold is an intent first: a drain (with its
Reason) or a return to service is recorded with the decision, then sent by
``push_intents``, and sent again (at most every ``RESEND_S``) until the cluster shows it,
whoever asked for it (the policy, a probe, an operator). A failed ``scontrol`` is
therefore retried by the next tick, and a daemon killed between recording and sending
sends it after its restart. While the cluster cannot tell what it shows, nothing is sent.

Every drain this supervisor makes of its own accord, whatever the cause (a fault, a
probe's verdict, a lemon), passes the daemon's one drain budget here: at most
``DrainBudget.per_window`` in ``window_s`` across the cluster. A drain past it is held:
the node stays in service, and a ``drain.held`` event says what would have drained
it, for an operator to decide. A run's own budget (its policy's drains_per_fault and
drains_per_window) can only be tighter: a spec cannot raise this one. An operator's
drain is never held.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import assert_never

from supervisor import node_health, trainer_cmd
from supervisor.domain import (
    CommandHandled,
    DrainBudget,
    DrainNode,
    Emit,
    Node,
    NodeEffect,
    NodeState,
    ProbeAgain,
    RecordProbe,
    ReturnNode,
)
from supervisor.domain.events import EventKind
from supervisor.errors import LaunchError
from supervisor.launchers.base import NodeAdmin
from supervisor.policy.nodes import DRAINED_BY_US
from supervisor.spec import RunSpec
from supervisor.store import SqlStore, Tx
from supervisor.tick_state import ProbeSubmitter, RunMemory

log = logging.getLogger(__name__)

RESEND_S = 1.0  # an intent the cluster does not show yet is sent again after this long
DRAIN_REBOOT = "drain-reboot"  # an intent's action: a drain whose fix is a reboot
REPAIR_LOOK_S = 5.0  # how often nodes handed to the cluster's repair are looked at (repairs take minutes)


class NodeEffects:
    def __init__(self, store: SqlStore, nodes: NodeAdmin, probes: ProbeSubmitter, memory: RunMemory,
                 budget: DrainBudget | None = None) -> None:
        self.store = store
        self.nodes = nodes
        self.probes = probes
        self.memory = memory
        self.budget = budget or DrainBudget()
        self._repairs_looked_at = -REPAIR_LOOK_S

    def apply(self, effects: Sequence[NodeEffect | Emit], now: float) -> None:
        """Record and carry out a decision about nodes (supervisor/policy/nodes.py)."""
        with self.store.tx() as tx:
            for e in effects:
                self.record(tx, e, now)
        for e in effects:
            self.act(e)

    def record(self, tx: Tx, e: NodeEffect | Emit, now: float) -> None:
        match e:
            case Emit():
                tx.add_event(e.run_number, e.kind, e.message, e.data, now)
            case DrainNode():
                ours = e.reason.startswith(DRAINED_BY_US)
                if ours and tx.drains_by_us_since(now - self.budget.window_s) >= self.budget.per_window:
                    b = self.budget
                    tx.add_event(e.run_number, EventKind.DRAIN_HELD, (
                        f"node {e.node} not drained: this supervisor has drained {b.per_window} nodes in the "
                        f"last {b.window_s:.0f} s, the daemon's drain budget (drains_per_window); an "
                        f"operator decides (it would have been drained for: {e.reason})"),
                        {"node": e.node, "reason": e.reason}, now)
                    return
                tx.put_node(Node(name=e.node, state=NodeState.DRAINED, reason=e.reason,
                                 run_number=e.run_number),
                            now)
                tx.want(e.node, DRAIN_REBOOT if e.reboot else "drain", e.reason, now)
                tx.add_event(e.run_number, EventKind.NODE_DRAINED,
                             e.message or f"node {e.node} drained: {e.reason}",
                             {"node": e.node, "by": "supervisor" if ours else "operator"}, now)
            case ReturnNode():
                # Idle again; a run whose allocation still has it takes it back at its next
                # look at what it holds (launchers.base.Launcher.held).
                tx.put_node(Node(name=e.node, state=NodeState.IDLE), now)
                tx.want(e.node, "undrain", "", now)
                tx.add_event(e.run_number, EventKind.NODE_RETURNED, e.message, {"node": e.node,
                                                                        "operator": e.operator}, now)
            case RecordProbe():
                tx.add_probe(e.record)
            case CommandHandled():
                tx.finish_command(e.command_id, e.result, now)
            case ProbeAgain():
                pass  # nothing to record before acting
            case _:
                assert_never(e)

    def act(self, e: NodeEffect | Emit) -> None:
        if isinstance(e, ProbeAgain):
            info = None
            drained: dict[str, str] = {}
            with self.store.tx() as tx:
                if e.run_number is not None:
                    info = tx.get_run(e.run_number).allocation_info
                else:
                    drained = {x.name: x.reason for x in tx.nodes_named(e.nodes)
                               if x.state is NodeState.DRAINED}
            spec, run_dir = self.memory.spec(e.run_number) if e.run_number is not None else (None, None)
            args = spec.health.probe_args() if isinstance(spec, RunSpec) else self.probes.sweep_args
            timeout_s = spec.health.timeout_s if isinstance(spec, RunSpec) else self.probes.sweep_timeout_s
            run_spec = spec if isinstance(spec, RunSpec) else None
            needs = trainer_cmd.node_requirements(run_spec, run_dir) if run_spec and run_dir else []
            self.probes.submit(run_number=e.run_number, kind=e.kind, nodes=list(e.nodes),
                               argv=node_health.probe_argv(args, needs), timeout_s=timeout_s, round_=e.round,
                               allocation_info=info, drained=drained)

    def take_back_repaired(self, now: float) -> None:
        """Nodes this supervisor took out that the cluster repaired and brought back (SageMaker
        HyperPod replaces or reboots them, then resumes them): idle again, for any run.
        Every REPAIR_LOOK_S, not every tick: a store read for a repair of minutes."""
        if now - self._repairs_looked_at < REPAIR_LOOK_S:
            return
        self._repairs_looked_at = now
        with self.store.tx() as tx:
            ours = [n for n in tx.list_nodes()
                    if n.state is NodeState.DRAINED and n.reason.startswith(DRAINED_BY_US)]
            done = [n for n in ours if (it := tx.intent(n.name)) is not None
                    and it.action in ("drain", DRAIN_REBOOT) and it.confirmed_at is not None]
        back = [n for n in done if self.nodes.repaired(n.name)]
        if back:
            self.apply([ReturnNode(node=n.name, run_number=n.run_number, message=(
                f"node {n.name} is back in service after the cluster's repair: returned to the pool "
                f"(taken out for: {n.reason})")) for n in back], now)

    # --- intents: drains and returns, sent until the cluster shows them ---------------

    def push_intents(self, now: float) -> None:
        with self.store.tx() as tx:
            pending = tx.pending_intents()
        for it in pending:
            want_drained = it.action in ("drain", DRAIN_REBOOT)
            shown = self.nodes.drained(it.node)
            if shown is None:
                continue  # the cluster cannot tell now: send nothing blind
            if shown == want_drained:
                with self.store.tx() as tx:
                    tx.confirm_intent(it.node, now)
                continue
            if it.sent_at is not None and now - it.sent_at < RESEND_S:
                continue
            error = None
            try:
                if want_drained:
                    self.nodes.drain(it.node, it.reason, reboot=it.action == DRAIN_REBOOT)
                else:
                    self.nodes.undrain(it.node)
            except LaunchError as err:
                error = str(err)
                log.error("%s", err)
            with self.store.tx() as tx:
                tx.intent_sent(it.node, error, now)
                if error is None and self.nodes.drained(it.node) == want_drained:
                    tx.confirm_intent(it.node, now)
                if error is not None and error != it.last_error:  # said once, not every tick
                    node = next(iter(tx.nodes_named([it.node])), None)
                    verb = "drain" if want_drained else "return"
                    tx.add_event(node.run_number if node else None, EventKind.node_failed(verb),
                                 f"{error}; sending it again until the cluster shows it",
                                 {"node": it.node, "sent": it.sent + 1}, now)

