"""Nodes: drains, returns to service, probe rounds and their results, operators' node
commands (a drain, an undrain, a probe); and the intents that make the cluster show them.

Every effect on the outside world that must hold is an intent first: a drain (with its
Reason) or a return to service is recorded with the decision, then sent by
``NodeIntents.push``, and sent again (at most every ``RESEND_S``) until the cluster shows
it, whoever asked for it (the policy, a probe, an operator). A failed ``scontrol`` is
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
from pathlib import Path
from typing import assert_never, get_args

from supervisor import node_health
from supervisor.domain import (
    CommandHandled,
    DrainNode,
    Node,
    NodeState,
    ProbeAgain,
    ProbeNode,
    ProbeNodes,
    RecordProbe,
    ReturnNode,
)
from supervisor.domain.events import EventKind
from supervisor.effects.base import Acting, Deps, Family, Recording
from supervisor.errors import LaunchError
from supervisor.link_steps import LinkTest, link_test
from supervisor.policy.nodes import DRAINED_BY_US
from supervisor.runfiles import trainer_cmd
from supervisor.spec import RunSpec

log = logging.getLogger(__name__)

RESEND_S = 1.0  # an intent the cluster does not show yet is sent again after this long
DRAIN_REBOOT = "drain-reboot"  # an intent's action: a drain whose fix is a reboot
MANUAL_TIMEOUT_S = 60.0  # an operator's probe of a node gives up after this long
REPAIR_LOOK_S = 5.0  # how often nodes handed to the cluster's repair are looked at (repairs take minutes)

NodeFamilyEffect = DrainNode | ReturnNode | RecordProbe | ProbeAgain | ProbeNode | CommandHandled | ProbeNodes


class NodeEffects(Family):
    handles = get_args(NodeFamilyEffect)

    def record(self, r: Recording, e: NodeFamilyEffect) -> None:
        tx, now = r.tx, r.now
        match e:
            case DrainNode():
                ours = e.reason.startswith(DRAINED_BY_US)
                b = self.d.drain_budget
                if ours and tx.drains_by_us_since(now - b.window_s) >= b.per_window:
                    tx.add_event(e.run_number, EventKind.DRAIN_HELD, (
                        f"node {e.node} not drained: this supervisor has drained {b.per_window} nodes in the "
                        f"last {b.window_s:.0f} s, the daemon's drain budget (drains_per_window); an "
                        f"operator decides (it would have been drained for: {e.reason})"),
                        {"node": e.node, "reason": e.reason}, now)
                    return
                tx.put_node(Node(name=e.node, state=NodeState.DRAINED, reason=e.reason,
                                 run_number=e.run_number), now)
                tx.want(e.node, DRAIN_REBOOT if e.reboot else "drain", e.reason, now)
                tx.add_event(e.run_number, EventKind.NODE_DRAINED,
                             e.message or f"node {e.node} drained: {e.reason}",
                             {"node": e.node, "by": "supervisor" if ours else "operator"}, now)
            case ReturnNode():
                # Idle again; a run whose allocation still has it takes it back at its next
                # look at what it holds (launchers.base.Launcher.held).
                tx.put_node(Node(name=e.node, state=NodeState.IDLE), now)
                tx.want(e.node, "undrain", "", now)
                tx.add_event(e.run_number, EventKind.NODE_RETURNED, e.message,
                             {"node": e.node, "operator": e.operator}, now)
            case RecordProbe():
                tx.add_probe(e.record)
            case CommandHandled():
                tx.finish_command(e.command_id, e.result, now)
            case ProbeAgain() | ProbeNode() | ProbeNodes():
                pass  # nothing to record before acting
            case _:
                assert_never(e)

    def act(self, a: Acting, e: NodeFamilyEffect) -> None:
        match e:
            case ProbeAgain():
                self._probe_again(e)
            case ProbeNodes():
                self._probe_for_run(a, e)
            case ProbeNode():
                self._probe_for_operator(e)
            case DrainNode() | ReturnNode():
                pass  # an intent: NodeIntents.push sends it, this tick and until the cluster shows it
            case RecordProbe() | CommandHandled():
                pass  # recorded; nothing to do outside
            case _:
                assert_never(e)

    def _probe_again(self, e: ProbeAgain) -> None:
        d = self.d
        info = None
        drained: dict[str, str] = {}
        held: list[str] = []
        with d.store.tx() as tx:
            if e.run_number is not None:
                info = tx.get_run(e.run_number).allocation_info
                held = [n.name for n in tx.allocation(e.run_number, drained=False)]
            else:
                drained = {x.name: x.reason for x in tx.nodes_named(e.nodes) if x.state is NodeState.DRAINED}
        spec, run_dir = d.memory.spec(e.run_number) if e.run_number is not None else (None, None)
        run_spec = spec if isinstance(spec, RunSpec) else None
        args = self._run_probe_args(run_spec, run_dir) if run_spec and run_dir else d.probes.sweep_args
        timeout_s = run_spec.health.timeout_s if run_spec else d.probes.sweep_timeout_s
        needs = trainer_cmd.node_requirements(run_spec, run_dir) if run_spec and run_dir else []
        d.probes.submit(run_number=e.run_number, kind=e.kind, nodes=list(e.nodes),
                        argv=node_health.probe_argv(args, needs, interpreter=d.launch_specs.node_python),
                        timeout_s=timeout_s, round_=e.round,
                        allocation_info=info, drained=drained,
                        links=links_of(run_spec, e.kind, e.nodes, held) if run_spec else None)

    def _probe_for_operator(self, e: ProbeNode) -> None:
        """``python -m health`` with its default checks, in the allocation of the run that
        holds the node, if one does."""
        d = self.d
        with d.store.tx() as tx:
            info = tx.get_run(e.run_number).allocation_info if e.run_number is not None else None
        d.probes.submit(run_number=e.run_number, kind=node_health.MANUAL, nodes=[e.node],
                        argv=node_health.probe_argv(interpreter=d.launch_specs.node_python),
                        timeout_s=MANUAL_TIMEOUT_S, allocation_info=info,
                        command_id=e.command_id)

    def _run_probe_args(self, spec: RunSpec, run_dir: Path) -> tuple[str, ...]:
        """A run's probe: its [health] keys, its checkpoint directory, the broker its ranks
        will be told, the account they execute as (each proven on the node: health/host.py,
        health/broker.py)."""
        user = ("--run-user", spec.user) if spec.user else ()
        checkpoints = ("--checkpoint-dir", str(trainer_cmd.checkpoint_dir(spec, run_dir)))
        return (*spec.health.probe_args(), *checkpoints, *self.d.launch_specs.broker_probe_args(), *user)

    def _probe_for_run(self, a: Acting, e: ProbeNodes) -> None:
        if a.seen is None or a.seen.spec is None:
            return  # without a valid spec, no probe it could ask for
        d, run, spec = self.d, a.seen.run, a.seen.spec
        with d.store.tx() as tx:
            info = tx.get_run(run.number).allocation_info
            held = [n.name for n in tx.allocation(run.number, drained=False)]
        needs = trainer_cmd.node_requirements(spec, a.seen.run_dir)
        d.probes.submit(run_number=run.number, kind=e.kind, nodes=list(e.nodes),
                        argv=node_health.probe_argv(self._run_probe_args(spec, a.seen.run_dir), needs,
                                                    interpreter=d.launch_specs.node_python),
                        timeout_s=spec.health.timeout_s, allocation_info=info,
                        links=links_of(spec, e.kind, e.nodes, held))
        d.post_event(run.number, EventKind.PROBE_STARTED, f"{e.kind} probe of {', '.join(e.nodes)}",
                     {"nodes": list(e.nodes), "kind": e.kind})


class NodeIntents:
    """Drains and returns, sent until the cluster shows them; and the nodes the cluster
    repaired, found again."""

    def __init__(self, deps: Deps) -> None:
        self.d = deps
        self._repairs_looked_at = -REPAIR_LOOK_S

    def repaired(self, now: float) -> list[ReturnNode]:
        """Nodes this supervisor took out that the cluster repaired and brought back (SageMaker
        HyperPod replaces or reboots them, then resumes them): to return to the pool, for any
        run. Every REPAIR_LOOK_S, not every tick: a store read for a repair of minutes."""
        if now - self._repairs_looked_at < REPAIR_LOOK_S:
            return []
        self._repairs_looked_at = now
        with self.d.store.tx() as tx:
            ours = [n for n in tx.list_nodes()
                    if n.state is NodeState.DRAINED and n.reason.startswith(DRAINED_BY_US)]
            done = [n for n in ours if (it := tx.intent(n.name)) is not None
                    and it.action in ("drain", DRAIN_REBOOT) and it.confirmed_at is not None]
        return [ReturnNode(node=n.name, run_number=n.run_number, message=(
                    f"node {n.name} is back in service after the cluster's repair: returned to the pool "
                    f"(taken out for: {n.reason})"))
                for n in done if self.d.nodes.repaired(n.name)]

    def push(self, now: float) -> None:
        d = self.d
        with d.store.tx() as tx:
            pending = tx.pending_intents()
        for it in pending:
            want_drained = it.action in ("drain", DRAIN_REBOOT)
            shown = d.nodes.drained(it.node)
            if shown is None:
                continue  # the cluster cannot tell now: send nothing blind
            if shown == want_drained:
                with d.store.tx() as tx:
                    tx.confirm_intent(it.node, now)
                continue
            if it.sent_at is not None and now - it.sent_at < RESEND_S:
                continue
            error = None
            try:
                if want_drained:
                    d.nodes.drain(it.node, it.reason, reboot=it.action == DRAIN_REBOOT)
                else:
                    d.nodes.undrain(it.node)
            except LaunchError as err:
                error = str(err)
                log.error("%s", err)
            with d.store.tx() as tx:
                tx.intent_sent(it.node, error, now)
                if error is None and d.nodes.drained(it.node) == want_drained:
                    tx.confirm_intent(it.node, now)
                if error is not None and error != it.last_error:  # said once, not every tick
                    node = next(iter(tx.nodes_named([it.node])), None)
                    verb = "drain" if want_drained else "return"
                    tx.add_event(node.run_number if node else None, EventKind.node_failed(verb),
                                 f"{error}; sending it again until the cluster shows it",
                                 {"node": it.node, "sent": it.sent + 1}, now)


def links_of(spec: RunSpec, kind: str, nodes: Sequence[str], held: Sequence[str]) -> LinkTest | None:
    """The link test a probe round of ``nodes`` runs for a run of ``spec`` holding ``held``;
    none for an idle spare's (``kind`` "spare": the others' links are busy training)."""
    h = spec.health
    return link_test(h.links and kind != "spare", h.link_fraction, nodes, held, tool=h.pair_tool(),
                     tasks_per_node=spec.resources.ranks_per_node)
