"""What an allocation's grant changes in the store's node records (pure): the nodes the
cluster says a run holds become its allocated nodes, except those drained, which stay
drained; the nodes it held and holds no more are idle again."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.domain import Node, NodeState


@dataclass(frozen=True, slots=True, kw_only=True)
class GrantChanges:
    """What a grant changes in the store's node records for one run."""

    info: str | None
    puts: tuple[Node, ...]  # node records to write
    added: tuple[str, ...]  # nodes the run holds now and did not before
    released: tuple[str, ...]  # nodes it held and holds no more


def grant_changes(known: list[Node], run_number: int, granted: tuple[str, ...],
                  info: str | None) -> GrantChanges:
    """Make the node records say that the run holds the nodes ``granted`` (its grant's,
    ``info`` the grant's record). A drained node stays drained; a node held no more is
    idle again."""
    by_name = {x.name: x for x in known}
    puts: list[Node] = []
    added: list[str] = []
    for name in granted:
        node = by_name.get(name)
        if node is not None and node.state is NodeState.DRAINED:
            continue  # ours, but out of service: it stays drained
        if node is None or node.run_number != run_number or node.state is not NodeState.ALLOCATED:
            puts.append(Node(name=name, state=NodeState.ALLOCATED, run_number=run_number))
            added.append(name)
    held = set(granted)
    gone = [x for x in known if x.run_number == run_number and x.name not in held
            and x.state is NodeState.ALLOCATED]
    puts.extend(Node(name=x.name, state=NodeState.IDLE) for x in gone)
    return GrantChanges(info=info, puts=tuple(puts), added=tuple(added),
                        released=tuple(x.name for x in gone))


def allocation_after(known: list[Node], run_number: int, changes: GrantChanges | None) -> tuple[Node, ...]:
    """The run's nodes (drained ones included) once ``changes`` are recorded."""
    nodes = {x.name: x for x in known}
    for x in changes.puts if changes else ():
        nodes[x.name] = x
    return tuple(sorted((x for x in nodes.values() if x.run_number == run_number), key=lambda x: x.name))
