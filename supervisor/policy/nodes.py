"""Node health: what a round of probe results, or an operator's command, does to nodes.

Probes (``python -m health`` on a node; the debounce rule is supervisor/node_health.py):

- every result is kept (``RecordProbe``) and logged;
- a bad result (unhealthy, unknown) not yet confirmed probes the node again at once
  (``ProbeAgain``, up to ``CONFIRMATIONS`` rounds); a confirmed one drains it with the
  tool's own words;
- the sweep (no run) judges only nodes nobody holds: one a run took while the sweep
  probed it is that run's to judge;
- a node this supervisor drained returns to service after ``return_after`` clean sweep
  probes in a row (0: never; an operator returns it). A node an operator drained is
  never returned by a probe.

An operator's drain or undrain of a node is carried out here too, so that every drain
(the policy's, a probe's, an operator's) is one effect with one protocol in the shell:
recorded, sent, and sent again until the cluster shows it. An operator's probe of a node
is a round of its own (``ProbeNode``), queued while another round probes the node (two
probes at once on one node would each measure the other); its result is kept and said
like any other, and is its command's result: it drains nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from health.model import BROKER, RUN_FILES, RUN_USER
from supervisor import node_health
from supervisor.domain import (
    CommandHandled,
    DrainNode,
    Emit,
    Node,
    NodeCommand,
    NodeCommandKind,
    NodeEffect,
    NodeState,
    ProbeAgain,
    ProbeNode,
    ProbeRecord,
    RecordProbe,
    ReturnNode,
    run_id_of,
)
from supervisor.domain.events import EventKind

DRAINED_BY_US = "training-supervisor:"  # how every drain Reason this supervisor writes begins


def judge_probes(*, kind: str, run_number: int | None, round_: int, answers: Mapping[str, str | None],
                 known: Mapping[str, Node], history: Mapping[str, Sequence[ProbeRecord]], return_after: int,
                 now: float, command_id: int | None = None,
                 link_gbps: Mapping[str, float] | None = None) -> list[NodeEffect | Emit]:
    """One finished round of probes of ``answers``' nodes (None: the node gave no answer).
    ``history``: each node's earlier results, newest first. ``command_id``: the round is
    an operator's probe (``ProbeNode``), which only reports. ``link_gbps``: each node's
    figure in the round's link test, kept with its result."""
    out: list[NodeEffect | Emit] = []
    again: list[str] = []
    sweep = run_number is None
    figures = link_gbps or {}
    records = {n: node_health.record(n, answer, kind, run_number, now, link_gbps=figures.get(n))
               for n, answer in answers.items()}
    if command_id is not None:
        for node, record in records.items():
            out += [RecordProbe(record=record), _said(kind, node, record, run_number)]
        results = [f"{r.status} (action: {r.action})" + (f": {r.reason}" if r.reason else "")
                   for r in records.values()]
        return [*out, CommandHandled(command_id=command_id, result="; ".join(results) or "no answer")]
    # A fault every node of a run's round shares (node_health.SHARED_CAUSES) is not a node's:
    # none is drained, or probed again, for it (a node with a fault of its own besides is,
    # for that). The run's own files missing: the launch fails and the run's budget ends it.
    # The broker unreachable from all of them: the run trains on, its nodes' loss found by
    # the cluster's own timeout. Judged in a round's first pass only: a confirmation probes
    # again just the nodes with faults of their own, where "every node" would be one node.
    shared = node_health.shared_faults(list(records.values())) if not sweep and round_ == 1 else frozenset()
    if RUN_FILES in shared:
        missing = next(iter(records.values())).reason
        out.append(Emit(kind=EventKind.PROBE_RUN_FILES, run_number=run_number, message=(
            f"{kind} probe: the run's own files are missing on every node it probed ({missing}): the run's "
            "fault, not its nodes': none is drained for it"), data={"nodes": sorted(records)}))
    if RUN_USER in shared:
        out.append(Emit(kind=EventKind.PROBE_RUN_USER, run_number=run_number, message=(
            f"{kind} probe: the run's user exists on none of the nodes it probed: the run's fault (or the "
            "cluster's accounts'), not its nodes': none is drained for it"), data={"nodes": sorted(records)}))
    if BROKER in shared:
        out.append(Emit(kind=EventKind.PROBE_BROKER, run_number=run_number, message=(
            f"{kind} probe: the MQTT broker answers none of the nodes it probed: the broker's or the "
            "controller's network's fault, not theirs: none is drained for it; no telemetry will be "
            "heard from them until it does"), data={"nodes": sorted(records)}))
    for node, record in records.items():
        out.append(RecordProbe(record=record))
        recent = [record, *history.get(node, ())]
        statuses, reasons = [p.status for p in recent], [p.reason for p in recent]
        verdict = node_health.judge(statuses, reasons)
        out.append(_said(kind, node, record, run_number))
        if node_health.only_for(record, shared):
            continue  # the round's shared fault (above): not this node's
        current = known.get(node)
        if sweep and (current is None or current.state is NodeState.ALLOCATED):
            continue  # taken by a run while the sweep probed it: that run's probes judge it
        if current is not None and current.state is NodeState.DRAINED:
            if sweep and current.reason.startswith(DRAINED_BY_US) and node_health.may_return(statuses,
                                                                                               return_after):
                out.append(ReturnNode(node=node, message=(
                    f"node {node} returned to service: {return_after} clean probes in a row "
                    f"(drained for: {current.reason})")))
            continue
        if verdict.drain:
            where = f"{run_id_of(run_number)}, {kind}" if run_number is not None else kind
            reason = f"{DRAINED_BY_US} probe: {verdict.reason[:200]} ({where})"
            # A node whose probe could not tell (unknown: it hung, timed out, found no tool)
            # is rebooted where the cluster repairs nodes, never replaced on no evidence.
            out.append(DrainNode(node=node, reason=reason, run_number=run_number,
                                 reboot=record.action == "reboot" or record.status == "unknown"))
        elif verdict.confirm:
            again.append(node)
    if again and round_ < node_health.CONFIRMATIONS:
        out.append(ProbeAgain(nodes=tuple(again), kind=kind, run_number=run_number, round=round_ + 1))
    return out


def _said(kind: str, node: str, record: ProbeRecord, run_number: int | None) -> Emit:
    why = f" ({record.reason})" if record.reason else ""
    return Emit(kind=EventKind.probe(record.status), run_number=run_number,
                message=f"{kind} probe of {node}: {record.status}{why}",
                data={"node": node, "status": record.status, "action": record.action})


def node_command(cmd: NodeCommand, node: Node | None, *, probing: bool = False) -> list[NodeEffect | Emit]:
    """An operator's drain, undrain or probe of ``node`` (None: a node the store does not
    know). ``probing``: a round probes the node now; a probe waits for it to end (no effect:
    the command stays queued)."""
    def rejected(why: str, run_number: int | None) -> list[NodeEffect | Emit]:
        return [CommandHandled(command_id=cmd.id, result=f"rejected: {why}"),
                Emit(kind=EventKind.COMMAND_REJECTED, message=f"{cmd.kind} {cmd.node} rejected: {why}",
                     data={"node": cmd.node}, run_number=run_number)]

    if node is None:
        return rejected("no such node", None)
    if cmd.kind is NodeCommandKind.PROBE:
        return [] if probing else [ProbeNode(node=node.name, run_number=node.run_number, command_id=cmd.id)]
    accepted = CommandHandled(command_id=cmd.id, result="accepted")
    if cmd.kind is NodeCommandKind.DRAIN:
        reason = f"operator: {cmd.reason}"
        held = node.state is NodeState.ALLOCATED and node.run_number is not None
        after = f"; run-{node.run_number} trains on, its next attempt leaves it out" if held else ""
        return [accepted, DrainNode(node=node.name, reason=reason, run_number=node.run_number,
                                    message=f"node {node.name} drained: {reason}{after}")]
    if node.state is not NodeState.DRAINED:
        return rejected(f"{node.name} is {node.state}, not drained", node.run_number)
    why = f": {cmd.reason}" if cmd.reason else ""
    return [accepted, ReturnNode(node=node.name, operator=True, run_number=node.run_number, message=(
        f"node {node.name} returned to service by an operator{why} (drained for: {node.reason})"))]
