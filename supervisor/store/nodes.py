"""Queries of nodes, their probes, and the supervisor's intents for them."""

from __future__ import annotations

import json
from collections.abc import Collection

from sqlalchemy import Connection, func, insert, select, update

from supervisor.domain import (
    Node,
    NodeCommand,
    NodeCommandKind,
    NodeIntent,
    NodeState,
    ProbeRecord,
    ProbeRoundRecord,
)
from supervisor.errors import NotFound
from supervisor.policy.transitions import check_node
from supervisor.store import schema as t
from supervisor.store.rows import intent_of, new_id, node_of

LINK_FIGURES_KEPT = 20  # a node's newest link-test figures its baseline is the median of


class NodeQueries:
    c: Connection

    # --- nodes ----------------------------------------------------------------------

    def list_nodes(self) -> list[Node]:
        return [node_of(r) for r in self.c.execute(select(t.nodes).order_by(t.nodes.c.name))]

    def node_counts(self) -> dict[NodeState, int]:
        """How many nodes are in each state (counted by SQLite: a cluster may know thousands)."""
        q = select(t.nodes.c.state, func.count()).group_by(t.nodes.c.state)
        return {NodeState(state): int(count) for state, count in self.c.execute(q)}

    def drained_by(self, run_number: int, newest: int) -> tuple[list[str], int]:
        """The names of the ``newest`` nodes the run drained (sorted by name), and how many it
        drained in all: a run of weeks may drain a node a day."""
        c = t.nodes.c
        where = (c.run_number == run_number, c.state == NodeState.DRAINED.value)
        total = self.c.execute(select(func.count()).select_from(t.nodes).where(*where)).scalar_one()
        q = select(c.name).where(*where).order_by(c.updated_at.desc(), c.name).limit(newest)
        return sorted(str(name) for (name,) in self.c.execute(q)), int(total)

    def get_node(self, name: str) -> Node:
        row = self.c.execute(select(t.nodes).where(t.nodes.c.name == name)).first()
        if row is None:
            raise NotFound(f"no such node: {name}")
        return node_of(row)

    def allocation(self, run_number: int, *, drained: bool = True) -> list[Node]:
        """The run's nodes; without ``drained``, those it drained left out (a run of weeks
        keeps every node it drained: hundreds)."""
        q = select(t.nodes).where(t.nodes.c.run_number == run_number)
        if not drained:
            q = q.where(t.nodes.c.state != NodeState.DRAINED.value)
        return [node_of(r) for r in self.c.execute(q.order_by(t.nodes.c.name))]

    def spares_probed_at(self, run_number: int,
                         busy: Collection[str]) -> tuple[tuple[str, float | None], ...]:
        """The nodes the run holds outside ``busy`` (its live attempt's), each with when it
        was last probed (None: never): one indexed look-up a spare."""
        newest = (select(t.probes.c.at).where(t.probes.c.node == t.nodes.c.name)
                  .order_by(t.probes.c.id.desc()).limit(1).correlate(t.nodes).scalar_subquery())
        q = (select(t.nodes.c.name, newest)
             .where(t.nodes.c.run_number == run_number, t.nodes.c.state == NodeState.ALLOCATED.value,
                    t.nodes.c.name.not_in(sorted(busy)))
             .order_by(t.nodes.c.name))
        return tuple((str(name), at) for name, at in self.c.execute(q))

    def nodes_named(self, names: Collection[str]) -> list[Node]:
        """The records of those of ``names`` the store knows."""
        q = select(t.nodes).where(t.nodes.c.name.in_(sorted(names))).order_by(t.nodes.c.name)
        return [node_of(r) for r in self.c.execute(q)]

    def put_node(self, node: Node, now: float) -> None:
        """Write a node's record, its state change checked against the table (an illegal
        one raises IllegalTransition, and the transaction rolls back)."""
        old = self.c.execute(select(t.nodes.c.state).where(t.nodes.c.name == node.name)).scalar_one_or_none()
        if old is not None:
            check_node(NodeState(old), node.state)
        values = {"state": node.state.value, "reason": node.reason, "run_number": node.run_number,
                  "updated_at": now}
        done = self.c.execute(update(t.nodes).where(t.nodes.c.name == node.name).values(**values))
        if done.rowcount == 0:
            self.c.execute(insert(t.nodes).values(name=node.name, **values))

    # --- probes ---------------------------------------------------------------------

    def add_probe(self, p: ProbeRecord) -> None:
        self.c.execute(insert(t.probes).values(
            node=p.node, at=p.at, kind=p.kind, status=p.status, action=p.action, reason=p.reason,
            findings=json.dumps(p.findings), run_number=p.run_number, link_gbps=p.link_gbps))

    def probe_counts(self) -> dict[str, int]:
        """How many probes ended with each status, over all time."""
        q = select(t.probes.c.status, func.count()).group_by(t.probes.c.status)
        return {str(status): int(count) for status, count in self.c.execute(q)}

    def recent_probes(self, node: str, limit: int = 5) -> list[ProbeRecord]:
        """The node's newest probes, newest first."""
        q = select(t.probes).where(t.probes.c.node == node).order_by(t.probes.c.id.desc()).limit(limit)
        return [ProbeRecord(node=r.node, at=r.at, kind=r.kind, status=r.status, action=r.action,
                            reason=r.reason, findings=json.loads(r.findings), run_number=r.run_number,
                            link_gbps=r.link_gbps)
                for r in self.c.execute(q)]

    def link_figures(self, node: str, limit: int = LINK_FIGURES_KEPT) -> list[float]:
        """The node's newest figures in link tests (GB/s), newest first: its baseline."""
        q = (select(t.probes.c.link_gbps).where(t.probes.c.node == node, t.probes.c.link_gbps.is_not(None))
             .order_by(t.probes.c.id.desc()).limit(limit))
        return [float(g) for (g,) in self.c.execute(q)]

    # --- rounds of probes ------------------------------------------------------------

    def add_probe_round(self, r: ProbeRoundRecord) -> int:
        """Record a round asked for (``r.id`` is ignored); its id."""
        res = self.c.execute(insert(t.probe_rounds).values(
            run_number=r.run_number, kind=r.kind, nodes=json.dumps(list(r.nodes)),
            argv=json.dumps(list(r.argv)), timeout_s=r.timeout_s, round=r.round, started_at=r.started_at))
        return new_id(res)

    def end_probe_round(self, round_id: int, at: float) -> None:
        self.c.execute(update(t.probe_rounds).where(t.probe_rounds.c.id == round_id).values(ended_at=at))

    def open_probe_rounds(self) -> list[ProbeRoundRecord]:
        """Rounds asked for whose answers were never judged, oldest first."""
        q = select(t.probe_rounds).where(t.probe_rounds.c.ended_at.is_(None)).order_by(t.probe_rounds.c.id)
        return [ProbeRoundRecord(id=r.id, run_number=r.run_number, kind=r.kind,
                                 nodes=tuple(json.loads(r.nodes)), argv=tuple(json.loads(r.argv)),
                                 timeout_s=r.timeout_s, round=r.round, started_at=r.started_at)
                for r in self.c.execute(q)]

    def add_node_command(self, node: str, kind: NodeCommandKind, reason: str, now: float) -> int:
        self.get_node(node)  # NotFound for a node nobody knows
        res = self.c.execute(
            insert(t.commands).values(node=node, kind=kind.value, reason=reason, created_at=now)
        )
        return new_id(res)

    def pending_node_commands(self) -> list[NodeCommand]:
        """Nodes' commands not yet carried out, oldest first."""
        q = select(t.commands).where(t.commands.c.handled_at.is_(None), t.commands.c.node.is_not(None))
        return [
            NodeCommand(id=r.id, node=r.node, kind=NodeCommandKind(r.kind), reason=r.reason,
                        created_at=r.created_at)
            for r in self.c.execute(q.order_by(t.commands.c.id))
        ]


    # --- intents: what the cluster must be told, until it shows it --------------------

    def want(self, node: str, action: str, reason: str, now: float) -> None:
        """Record the newest wish for ``node`` (it replaces any earlier one)."""
        values = {"action": action, "reason": reason, "requested_at": now, "sent": 0, "sent_at": None,
                  "last_error": None, "confirmed_at": None}
        done = self.c.execute(update(t.node_intents).where(t.node_intents.c.node == node).values(**values))
        if done.rowcount == 0:
            self.c.execute(insert(t.node_intents).values(node=node, **values))

    def pending_intents(self) -> list[NodeIntent]:
        q = select(t.node_intents).where(t.node_intents.c.confirmed_at.is_(None)).order_by(
            t.node_intents.c.requested_at)
        return [intent_of(r) for r in self.c.execute(q)]

    def intent(self, node: str) -> NodeIntent | None:
        row = self.c.execute(select(t.node_intents).where(t.node_intents.c.node == node)).first()
        return intent_of(row) if row is not None else None

    def intent_sent(self, node: str, error: str | None, now: float) -> None:
        self.c.execute(update(t.node_intents).where(t.node_intents.c.node == node)
                       .values(sent=t.node_intents.c.sent + 1, sent_at=now, last_error=error))

    def confirm_intent(self, node: str, now: float) -> None:
        self.c.execute(update(t.node_intents).where(t.node_intents.c.node == node).values(confirmed_at=now))
