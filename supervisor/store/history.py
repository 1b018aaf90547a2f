"""Queries of a run's history: checkpoints (persistent and in memory), faults, stragglers and data skips."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import Connection, Select, func, insert, select, update

from supervisor.domain import (
    CheckpointRecord,
    FaultKind,
    FaultRecord,
    MemoryCheckpointRecord,
    StragglerRecord,
)
from supervisor.store import schema as t
from supervisor.store.rows import new_id

MEMORY_CHECKPOINTS_KEPT = 8  # a run's newest saves of the memory tier in the table


class HistoryQueries:
    c: Connection

    # --- checkpoints ----------------------------------------------------------------

    def record_checkpoint(
        self, run_number: int, *, step: int, path: str, complete: bool, duration_s: float | None,
        attempt: int | None, now: float, attempt_time_s: float | None = None,
    ) -> bool:
        """Insert or refresh one checkpoint row; True if it is new or its completeness changed."""
        key = (t.checkpoints.c.run_number == run_number, t.checkpoints.c.step == step)
        was = self.c.execute(select(t.checkpoints).where(*key)).first()
        if was is not None:
            values: dict[str, Any] = {"path": path, "complete": complete}
            if duration_s is not None:
                values["duration_s"] = duration_s
            if attempt is not None:
                values["attempt"] = attempt
            if attempt_time_s is not None:
                values["attempt_time_s"] = attempt_time_s
            if any(getattr(was, k) != v for k, v in values.items()):  # no write (and fsync) for nothing
                self.c.execute(update(t.checkpoints).where(*key).values(**values))
            return bool(was.complete) != complete
        self.c.execute(
            insert(t.checkpoints).values(
                run_number=run_number, step=step, path=path, complete=complete,
                duration_s=duration_s, attempt=attempt, created_at=now, attempt_time_s=attempt_time_s,
            )
        )
        return True

    def committed_by(self, run_number: int, steps: Collection[int]) -> dict[int, int]:
        """The attempt that last committed each complete checkpoint at ``steps`` (none
        asked: no query)."""
        if not steps:
            return {}
        return {c.step: c.attempt for c in self.list_checkpoints(run_number, steps=steps)
                if c.complete and c.attempt is not None}

    def list_checkpoints(self, run_number: int, newest: int | None = None,
                         steps: Collection[int] | None = None) -> list[CheckpointRecord]:
        """The run's checkpoints in step order: all, the ``newest`` few, or those at ``steps``."""
        q = select(t.checkpoints).where(t.checkpoints.c.run_number == run_number)
        if steps is not None:
            q = q.where(t.checkpoints.c.step.in_(list(steps)))
        if newest is not None:
            q = select(q.order_by(t.checkpoints.c.step.desc()).limit(newest).subquery())
        q = q.order_by("step")
        return [
            CheckpointRecord(step=r.step, path=r.path, complete=r.complete, duration_s=r.duration_s,
                             attempt=r.attempt, created_at=r.created_at, attempt_time_s=r.attempt_time_s)
            for r in self.c.execute(q)
        ]

    def record_memory_checkpoint(self, run_number: int, *, attempt: int, step: int, duration_s: float | None,
                                 now: float) -> bool:
        """One save of the in-memory tier; True if it is new. Only the newest
        ``MEMORY_CHECKPOINTS_KEPT`` of a run are kept."""
        mc = t.memory_checkpoints.c
        key = (mc.run_number == run_number, mc.attempt == attempt, mc.step == step)
        if self.c.execute(select(mc.step).where(*key)).first() is not None:
            return False
        self.c.execute(insert(t.memory_checkpoints).values(run_number=run_number, attempt=attempt, step=step,
                                                           duration_s=duration_s, created_at=now))
        oldest_kept = (select(mc.created_at).where(mc.run_number == run_number).order_by(mc.created_at.desc())
                       .offset(MEMORY_CHECKPOINTS_KEPT - 1).limit(1)).scalar_subquery()
        self.c.execute(t.memory_checkpoints.delete().where(mc.run_number == run_number,
                                                           mc.created_at < oldest_kept))
        return True

    def forget_memory_checkpoints_after(self, run_number: int, step: int) -> None:
        mc = t.memory_checkpoints.c
        self.c.execute(t.memory_checkpoints.delete().where(mc.run_number == run_number, mc.step > step))

    def list_memory_checkpoints(self, run_number: int) -> list[MemoryCheckpointRecord]:
        """The run's memory saves kept, oldest first."""
        mc = t.memory_checkpoints.c
        rows = self.c.execute(select(t.memory_checkpoints).where(mc.run_number == run_number)
                              .order_by(mc.created_at, mc.step))
        return [MemoryCheckpointRecord(attempt=r.attempt, step=r.step, duration_s=r.duration_s,
                                       created_at=r.created_at) for r in rows]

    # --- faults ---------------------------------------------------------------------

    def add_fault(
        self, run_number: int, *, attempt: int, kind: FaultKind, ranks: Sequence[int],
        nodes: Sequence[str], step: int, summary: str, now: float, last_step_at: float | None = None,
        injected_at: float | None = None,
    ) -> int:
        res = self.c.execute(
            insert(t.faults).values(
                run_number=run_number, attempt=attempt, kind=kind.value, ranks=json.dumps(list(ranks)),
                nodes=json.dumps(list(nodes)), step=step, summary=summary, detected_at=now,
                last_step_at=last_step_at, injected_at=injected_at,
            )
        )
        return new_id(res)

    def fill_injected_at(self, run_number: int, attempt: int, at: float) -> int:
        """A drill's report of its fault came after the fault was recorded (the ranks died
        first, or the report waited in a busy broker): the attempt's faults detected at or
        after ``at`` that have no injection time get this one."""
        f = t.faults.c
        res = self.c.execute(update(t.faults).where(
            f.run_number == run_number, f.attempt == attempt, f.injected_at.is_(None), f.detected_at >= at,
        ).values(injected_at=at))
        return int(res.rowcount)

    def mark_faults_recovered(self, run_number: int, now: float) -> int:
        res = self.c.execute(
            update(t.faults)
            .where(t.faults.c.run_number == run_number, t.faults.c.recovered_at.is_(None))
            .values(recovered_at=now)
        )
        return int(res.rowcount)

    def count_open_faults(self, run_number: int) -> int:
        q = select(func.count()).select_from(t.faults).where(
            t.faults.c.run_number == run_number, t.faults.c.recovered_at.is_(None)
        )
        return int(self.c.execute(q).scalar_one())

    def list_faults(self, run_number: int, after_id: int = 0) -> list[FaultRecord]:
        """The run's faults recorded after the fault ``after_id``, oldest first."""
        return self._faults(select(t.faults).where(t.faults.c.run_number == run_number,
                                                   t.faults.c.id > after_id))

    def faults_since(self, since: float) -> list[FaultRecord]:
        """Every run's faults detected at or after ``since``, oldest first."""
        return self._faults(select(t.faults).where(t.faults.c.detected_at >= since))

    def _faults(self, q: Select[Any]) -> list[FaultRecord]:
        q = q.order_by(t.faults.c.id)
        return [
            FaultRecord(
                id=r.id, run_number=r.run_number, attempt=r.attempt, kind=FaultKind(r.kind),
                ranks=tuple(json.loads(r.ranks)), nodes=tuple(json.loads(r.nodes)), step=r.step,
                summary=r.summary, detected_at=r.detected_at, recovered_at=r.recovered_at,
                last_step_at=r.last_step_at, injected_at=r.injected_at,
            )
            for r in self.c.execute(q)
        ]


    # --- stragglers and data skips ------------------------------------------------------

    def add_straggler(self, run_number: int, s: StragglerRecord) -> None:
        self.c.execute(insert(t.stragglers).prefix_with("OR IGNORE").values(
            run_number=run_number, attempt=s.attempt, rank=s.rank, node=s.node, busy_s=s.busy_s,
            typical_s=s.typical_s, window=s.window, at=s.at))

    def list_stragglers(self, run_number: int) -> list[StragglerRecord]:
        q = select(t.stragglers).where(t.stragglers.c.run_number == run_number).order_by(
            t.stragglers.c.at, t.stragglers.c.attempt, t.stragglers.c.rank)
        return [StragglerRecord(attempt=r.attempt, rank=r.rank, node=r.node, busy_s=r.busy_s,
                                typical_s=r.typical_s, window=r.window, at=r.at) for r in self.c.execute(q)]

    def add_data_skip(self, run_number: int, start: int, end: int, reason: str, now: float) -> None:
        self.c.execute(insert(t.data_skips).values(run_number=run_number, start=start, end=end, reason=reason,
                                                   at=now))

    def widen_data_skip(self, run_number: int, start: int, new_start: int) -> None:
        """Move the start of the run's skip windows that begin at ``start`` back to ``new_start``."""
        self.c.execute(update(t.data_skips).where(t.data_skips.c.run_number == run_number,
                                                  t.data_skips.c.start == start).values(start=new_start))

    def list_data_skips(self, run_number: int) -> list[tuple[int, int]]:
        """Ranges [start, end) of the data every later attempt of the run steps over, oldest
        first: samples for the reference trainer, data steps for a [command] told
        ``{skip_to_step}`` (supervisor/policy/recovery.py)."""
        q = select(t.data_skips.c.start, t.data_skips.c.end).where(
            t.data_skips.c.run_number == run_number).order_by(t.data_skips.c.id)
        return [(int(a), int(b)) for a, b in self.c.execute(q)]
