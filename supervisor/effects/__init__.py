"""Record a decision and carry it out: one table of effects, a handler a family.

Each kind of ``Effect`` (supervisor/domain/effects.py) has one family here, which holds
both its steps: ``record`` writes it in the decision's transaction, ``act`` carries it
out once that transaction committed.

    runs.py         a run's state, events, faults, data skips, stragglers
    attempts.py     an attempt recorded, started (its config, fence, set-asides), stopped, ended
    allocation.py   nodes asked for, granted, given back or parked
    nodes.py        drains, returns, probe rounds, operators' node commands; the intents
                    sent until the cluster shows them
    checkpoint_moves.py  checkpoints moved out of a trainer's way and back, as the run's user

``Effects.apply`` writes everything a run's decision says (its state changes, its
records, its events and their outbox rows) and what was observed with it (``Facts``: the
allocation granted, the checkpoints found, how far the output was read) in one SQLite
transaction, and then acts. A state change an effect makes is checked against the
transition table (supervisor/policy/transitions.py) before it is written; an illegal one
raises, the whole transaction rolls back, and nothing of the decision is acted on.
``Effects.apply_nodes`` does the same for a decision about nodes alone.

To add an effect: its class in domain/effects.py (a member of the ``Effect`` union), its
handling in the family it belongs to (a type in ``handles``, a case in ``record`` and in
``act``). ``TABLE`` is checked against the union when this module is imported: an effect
with no family, or with two, stops the daemon from starting (and fails
tests/unit/test_effects_table.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

from supervisor.domain import Effect, Emit, NodeEffect
from supervisor.domain.events import EventKind
from supervisor.effects.allocation import AllocationEffects, record_grant
from supervisor.effects.attempts import AttemptEffects
from supervisor.effects.base import Acting, Deps, Family, Recording
from supervisor.effects.nodes import NodeEffects, NodeIntents
from supervisor.effects.runs import RunEffects
from supervisor.gathering.observed import Observed
from supervisor.store import Tx

__all__ = ["FAMILIES", "TABLE", "Deps", "Effects", "table_problems"]

FAMILIES: tuple[type[Family], ...] = (RunEffects, AttemptEffects, AllocationEffects, NodeEffects)


def table_problems(families: Sequence[type[Family]]) -> list[str]:
    """What keeps ``families`` from being the one table of ``Effect``: kinds no family
    handles, kinds two handle, types that are no effect. Empty: complete."""
    kinds = set(get_args(Effect))
    seen: dict[type, str] = {}
    problems = []
    for family in families:
        for t in family.handles:
            if t in seen:
                problems.append(f"{t.__name__} is handled by {seen[t]} and {family.__name__}")
            seen[t] = family.__name__
    problems += [f"{t.__name__} is handled by no family" for t in sorted(kinds - set(seen), key=str)]
    problems += [f"{t.__name__} is no Effect" for t in sorted(set(seen) - kinds, key=str)]
    return problems


if problems := table_problems(FAMILIES):
    raise ImportError("supervisor.effects: " + "; ".join(problems))

TABLE: dict[type, type[Family]] = {t: f for f in FAMILIES for t in f.handles}


class Effects:
    """The daemon's hands: every decision the reconciler makes is applied here."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        families = {f: f(deps) for f in FAMILIES}
        self._handler = {t: families[f] for t, f in TABLE.items()}
        attempts = families[AttemptEffects]
        assert isinstance(attempts, AttemptEffects)
        self._attempts = attempts
        self.intents = NodeIntents(deps)

    def apply(self, seen: Observed, effects: Sequence[Effect], now: float) -> None:
        """A run's decision, and what was observed with it."""
        self._apply(effects, now, seen)

    def apply_nodes(self, effects: Sequence[NodeEffect | Emit], now: float) -> None:
        """A decision about nodes (supervisor/policy/nodes.py)."""
        self._apply(effects, now, None)

    def _apply(self, effects: Sequence[Effect], now: float, seen: Observed | None) -> None:
        """Record every effect in one transaction, then act on each."""
        with self.deps.store.tx() as tx:
            r = Recording(tx=tx, now=now)
            if seen is not None:
                r.run, r.state = seen.run, seen.run.state
                r.attempts = {a.number: a for a in seen.view.attempts}
                self._record_facts(tx, seen, now)
            for e in effects:
                self._handler[type(e)].record(r, e)
        a = Acting(now=now, seen=seen, attempts=r.attempts)
        for e in effects:
            self._handler[type(e)].act(a, e)

    def release_ended(self, now: float) -> None:
        """Ended attempts not let go of yet (supervisor/effects/attempts.py)."""
        self._attempts.release_ended(now)

    def push_intents(self, now: float) -> None:
        self.intents.push(now)

    def take_back_repaired(self, now: float) -> None:
        self.apply_nodes(self.intents.repaired(now), now)

    def post_event(self, run_number: int | None, kind: EventKind, message: str,
                   data: dict[str, object]) -> None:
        self.deps.post_event(run_number, kind, message, data)

    def _record_facts(self, tx: Tx, seen: Observed, now: float) -> None:
        n = seen.run.number
        if seen.facts.grant is not None:
            record_grant(tx, n, seen.facts.grant, now)
        for v in seen.facts.checkpoints:
            changed = tx.record_checkpoint(n, step=v.step, path=str(v.path), complete=v.ok, duration_s=None,
                                           attempt=None, now=now)
            if changed and not v.ok:
                tx.add_event(n, EventKind.CHECKPOINT_REJECTED,
                             f"checkpoint at step {v.step} fails verification: {v.why}",
                             {"step": v.step, "path": str(v.path)}, now)
        if seen.facts.output_offsets is not None:
            number, offsets = seen.facts.output_offsets
            tx.update_attempt(n, number, output_offsets=offsets)
        for path in seen.facts.out_of_range:  # each found for the first time (the observer's memory)
            tx.add_event(n, EventKind.CHECKPOINT_SKIPPED,
                         f"{path}: its step is beyond what a run can reach; "
                         "not a checkpoint of this run, passed over", {"path": str(path)}, now)
