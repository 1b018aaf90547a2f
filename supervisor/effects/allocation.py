"""The nodes a run holds: asked for, recorded as the cluster grants them, given back or
parked (the run's Slurm job kept, held in the queue, for its resume)."""

from __future__ import annotations

from typing import assert_never, get_args

from supervisor.domain import AllocateNodes, Node, NodeState, ReleaseNodes, Run
from supervisor.domain.events import EventKind
from supervisor.effects.base import Acting, Deps, Family, Recording
from supervisor.launchers.base import AllocationRequest
from supervisor.policy.grants import GrantChanges, grant_changes
from supervisor.spec import RunSpec
from supervisor.store import Tx

AllocationEffect = AllocateNodes | ReleaseNodes


def record_grant(tx: Tx, n: int, changes: GrantChanges, now: float) -> None:
    """What the cluster granted run ``n``: its allocation's record, its nodes', and the
    events that say what it gained and lost."""
    if changes.info != tx.get_run(n).allocation_info:
        tx.update_run(n, allocation_info=changes.info)
    for node in changes.puts:
        tx.put_node(node, now)
    if changes.added:
        tx.add_event(n, EventKind.NODES_ALLOCATED, f"allocated {', '.join(changes.added)}",
                     {"nodes": list(changes.added)}, now)
    if changes.released:
        tx.add_event(n, EventKind.NODES_RELEASED, f"no longer held: {', '.join(changes.released)}",
                     {"nodes": list(changes.released)}, now)


class AllocationEffects(Family):
    handles = get_args(AllocationEffect)

    def __init__(self, deps: Deps) -> None:
        super().__init__(deps)
        self._short: dict[int, tuple[int, int] | None] = {}  # run -> last (asked, got) shortage said

    def record(self, r: Recording, e: AllocationEffect) -> None:
        match e:
            case ReleaseNodes():
                # A drained node keeps the run that drained it.
                for node in r.tx.allocation(r.of_run().number):
                    if node.state is NodeState.ALLOCATED:
                        r.tx.put_node(Node(name=node.name, state=NodeState.IDLE), r.now)
            case AllocateNodes():
                pass  # nothing to record before asking
            case _:
                assert_never(e)

    def act(self, a: Acting, e: AllocationEffect) -> None:
        seen = a.of_run()
        run, spec, d = seen.run, seen.spec, self.d
        match e:
            case AllocateNodes():
                if spec is not None:
                    self._allocate(run, spec, e.count, e.keep, a.now)
            case ReleaseNodes(park=True):
                kept = d.launcher.park(run.run_id, run.allocation_info, spec.user if spec else None)
                if kept.done:
                    with d.store.tx() as tx:
                        tx.update_run(run.number, allocation_info=None, parked_allocation=kept.info)
            case ReleaseNodes():
                if d.launcher.release(run.run_id, run.allocation_info or run.parked_allocation):
                    with d.store.tx() as tx:
                        tx.update_run(run.number, allocation_info=None, parked_allocation=None)
                # else the record stays, and the next tick asks to release again
            case _:
                assert_never(e)

    def _allocate(self, run: Run, spec: RunSpec, missing: int, keep: int | None, now: float) -> None:
        d = self.d
        with d.store.tx() as tx:
            nodes = tx.list_nodes()
            current = tx.get_run(run.number)
        held = tuple(x.name for x in nodes if x.run_number == run.number and x.state is NodeState.ALLOCATED)
        count = len(held) + missing
        req = AllocationRequest(
            run_id=run.run_id, count=count, minimum=run.nodes, keep=keep, held=held,
            drained=frozenset(x.name for x in nodes if x.state is NodeState.DRAINED),
            idle=tuple(x.name for x in nodes if x.state is NodeState.IDLE),
            known=frozenset(x.name for x in nodes), info=current.allocation_info or current.parked_allocation,
            partition=spec.resources.partition, time_limit_min=spec.resources.time_limit_min,
            handles_usr1=spec.handles_usr1, user=spec.user,
        )
        grant = d.launcher.allocate(req)
        with d.store.tx() as tx:
            if current.parked_allocation is not None:  # the run goes on in the job it kept
                tx.update_run(run.number, parked_allocation=None)
            changes = grant_changes(tx.list_nodes(), run.number, grant.nodes, grant.info)
            record_grant(tx, run.number, changes, now)
            got = len([x for x in tx.allocation(run.number) if x.state is NodeState.ALLOCATED])
            short = (count, got) if got < count else None
            if short is not None and self._short.get(run.number) != short:  # say it once, not every tick
                why = f" ({grant.note})" if grant.note else ""
                tx.add_event(run.number, EventKind.NODES_SHORT,
                             f"asked for {count} nodes, holding {got}; waiting{why}",
                             {"asked": count, "got": got, "note": grant.note}, now)
            self._short[run.number] = short
