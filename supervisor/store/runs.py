"""Queries of runs, attempts and operators' commands."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, and_, insert, or_, select, update

from supervisor.domain import (
    TERMINAL_RUN_STATES,
    Attempt,
    AttemptOutcome,
    AttemptState,
    Command,
    CommandKind,
    NodeState,
    Policy,
    Run,
    RunState,
)
from supervisor.errors import NotFound
from supervisor.store import schema as t
from supervisor.store.rows import attempt_of, attempt_values, new_id, run_of


class RunQueries:
    c: Connection

    # --- runs -----------------------------------------------------------------------

    def create_run(
        self, *, name: str, spec_json: str, run_dir_root: Path, nodes: int, ranks_per_node: int,
        spares: int, total_steps: int, policy: Policy, now: float,
    ) -> Run:
        res = self.c.execute(
            insert(t.runs).values(
                name=name, state=RunState.PENDING.value, reason="submitted", spec=spec_json,
                run_dir="", nodes=nodes, ranks_per_node=ranks_per_node, spares=spares,
                total_steps=total_steps, policy=json.dumps(asdict(policy)), created_at=now,
                budget_from_attempt=0,
            )
        )
        number = new_id(res)
        run_dir = run_dir_root / f"run-{number}"
        self.c.execute(update(t.runs).where(t.runs.c.number == number).values(run_dir=str(run_dir)))
        return self.get_run(number)

    def get_run(self, number: int) -> Run:
        row = self.c.execute(select(t.runs).where(t.runs.c.number == number)).first()
        if row is None:
            raise NotFound(f"no such run: run-{number}")
        return run_of(row)

    def run_spec_and_dir(self, number: int) -> tuple[str, Path]:
        row = self.c.execute(
            select(t.runs.c.spec, t.runs.c.run_dir).where(t.runs.c.number == number)
        ).first()
        if row is None:
            raise NotFound(f"no such run: run-{number}")
        return row.spec, Path(row.run_dir)

    def list_runs(self, states: Sequence[RunState] | None = None) -> list[Run]:
        q = select(t.runs).order_by(t.runs.c.number)
        if states is not None:
            q = q.where(t.runs.c.state.in_([s.value for s in states]))
        return [run_of(r) for r in self.c.execute(q)]

    def finished_runs_holding_resources(self) -> set[int]:
        """Terminal runs that still have a live attempt or hold nodes (to tear down), or keep
        a job in the queue that no resume will take (a failed run's is kept for one)."""
        live = select(t.attempts.c.run_number).where(t.attempts.c.state != AttemptState.ENDED.value)
        held = select(t.nodes.c.run_number).where(t.nodes.c.state == NodeState.ALLOCATED.value)
        parked = and_(t.runs.c.parked_allocation.is_not(None), t.runs.c.state != RunState.FAILED.value)
        q = select(t.runs.c.number).where(
            t.runs.c.state.in_([s.value for s in TERMINAL_RUN_STATES]),
            or_(t.runs.c.number.in_(live), t.runs.c.number.in_(held), t.runs.c.allocation_info.is_not(None),
                parked),
        )
        return {int(n) for n in self.c.execute(q).scalars()}

    def update_run(self, number: int, **values: Any) -> None:
        for k, v in list(values.items()):
            if isinstance(v, RunState):
                values[k] = v.value
        self.c.execute(update(t.runs).where(t.runs.c.number == number).values(**values))

    # --- attempts -------------------------------------------------------------------

    def add_attempt(self, a: Attempt) -> None:
        self.c.execute(insert(t.attempts).values(**attempt_values(a)))

    def update_attempt(self, run_number: int, number: int, **values: Any) -> None:
        for k, v in list(values.items()):
            if isinstance(v, (AttemptState, AttemptOutcome)):
                values[k] = v.value
        self.c.execute(
            update(t.attempts)
            .where(t.attempts.c.run_number == run_number, t.attempts.c.number == number)
            .values(**values)
        )

    def attempt_is_live(self, run_number: int, number: int) -> bool:
        """Whether the run's attempt ``number`` exists and has not ended."""
        a = t.attempts.c
        state = self.c.execute(select(a.state).where(a.run_number == run_number, a.number == number)).scalar()
        return state is not None and state != AttemptState.ENDED.value

    def list_attempts(self, run_number: int, after: int = 0) -> list[Attempt]:
        """The run's attempts numbered above ``after``, in order."""
        q = (select(t.attempts).where(t.attempts.c.run_number == run_number, t.attempts.c.number > after)
             .order_by(t.attempts.c.number))
        return [attempt_of(r) for r in self.c.execute(q)]

    def unreleased_attempts(self, limit: int = 100) -> list[tuple[Run, Attempt]]:
        """Ended attempts the launcher has not let go of yet (``released``), oldest first,
        at most ``limit`` (an upgraded database has its whole history to let go of: a
        tick takes a slice of it)."""
        a = t.attempts.c
        q = (select(t.attempts).where(a.released_at.is_(None), a.state == AttemptState.ENDED.value)
             .order_by(a.run_number, a.number).limit(limit))
        ended = [attempt_of(r) for r in self.c.execute(q)]
        runs = {n: self.get_run(n) for n in {x.run_number for x in ended}}
        return [(runs[x.run_number], x) for x in ended]

    def released(self, run_number: int, number: int, now: float) -> None:
        """The launcher has let go of the ended attempt (``unreleased_attempts``)."""
        self.update_attempt(run_number, number, released_at=now)

    # --- commands -------------------------------------------------------------------

    def add_command(self, run_number: int, kind: CommandKind, now: float, step: int | None = None) -> int:
        self.get_run(run_number)  # NotFound for an unknown run
        res = self.c.execute(
            insert(t.commands).values(run_number=run_number, kind=kind.value, reason="", created_at=now,
                                      step=step)
        )
        return new_id(res)

    def pending_commands(self) -> list[Command]:
        """Runs' commands not yet carried out, oldest first."""
        q = select(t.commands).where(t.commands.c.handled_at.is_(None), t.commands.c.run_number.is_not(None))
        return [
            Command(id=r.id, run_number=r.run_number, kind=CommandKind(r.kind), created_at=r.created_at,
                    step=r.step)
            for r in self.c.execute(q.order_by(t.commands.c.id))
        ]

    def finish_command(self, command_id: int, result: str, now: float) -> None:
        self.c.execute(
            update(t.commands).where(t.commands.c.id == command_id).values(handled_at=now, result=result)
        )

    def get_command_result(self, command_id: int) -> str | None:
        row = self.c.execute(select(t.commands.c.result).where(t.commands.c.id == command_id)).first()
        if row is None:
            raise NotFound(f"no such command: {command_id}")
        return row.result  # type: ignore[no-any-return]


    def command_run_number(self, command_id: int) -> int | None:
        """The run a command is about (None: a node's); NotFound for no such command."""
        row = self.c.execute(select(t.commands.c.run_number).where(t.commands.c.id == command_id)).first()
        if row is None:
            raise NotFound(f"no such command: {command_id}")
        return None if row.run_number is None else int(row.run_number)
