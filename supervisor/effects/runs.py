"""A run's own records: its state, its events, its faults, the data it skips, its
stragglers. Every run state change is checked against the transition table
(supervisor/policy/transitions.py) before it is written: an illegal one raises, and the
whole decision rolls back."""

from __future__ import annotations

from typing import assert_never, get_args

from supervisor.domain import (
    Emit,
    FinishRun,
    MarkFaultsRecovered,
    RecordFault,
    ReportStraggler,
    ResumeRun,
    RunState,
    SetRunState,
    SkipData,
    StragglerRecord,
)
from supervisor.domain.events import EventKind
from supervisor.effects.base import Acting, Family, Recording
from supervisor.policy.transitions import check_run

RunEffect = (Emit | SetRunState | FinishRun | ResumeRun | RecordFault | MarkFaultsRecovered | SkipData
             | ReportStraggler)


class RunEffects(Family):
    handles = get_args(RunEffect)

    def record(self, r: Recording, e: RunEffect) -> None:
        tx, now = r.tx, r.now
        match e:
            case Emit():  # a decision about nodes may say something of no run
                number = e.run_number if e.run_number is not None else r.number
                tx.add_event(number, e.kind, e.message, e.data, now)
            case SetRunState() | FinishRun() | ResumeRun():
                self._record_state(r, e)
            case RecordFault():
                n = r.of_run().number
                stats = tx.stats_of_attempt(n, e.attempt)
                tx.add_fault(n, attempt=e.attempt, kind=e.kind, ranks=e.ranks, nodes=e.nodes, step=e.step,
                             summary=e.summary, now=now, last_step_at=stats.last_at if stats else None,
                             injected_at=tx.injected_at(n, e.attempt, now))
            case MarkFaultsRecovered():
                n = r.of_run().number
                if tx.mark_faults_recovered(n, now):
                    tx.add_event(n, EventKind.RUN_RECOVERED, "training again after the fault", {}, now)
            case SkipData():
                self._record_skip(r, e)
            case ReportStraggler():
                n = r.of_run().number
                tx.add_straggler(n, StragglerRecord(attempt=e.attempt, rank=e.rank, node=e.node,
                                                    busy_s=e.busy_s, typical_s=e.typical_s, window=e.window,
                                                    at=now))
                slower = e.busy_s / e.typical_s - 1.0 if e.typical_s > 0 else float("inf")
                tx.add_event(n, EventKind.STRAGGLER,
                             f"rank {e.rank} on {e.node} straggles: {e.busy_s:.3f} s of compute per step "
                             f"against {e.typical_s:.3f} s typical ({slower:+.0%}) over {e.window} steps",
                             {"attempt": e.attempt, "rank": e.rank, "node": e.node, "busy_s": e.busy_s,
                              "typical_s": e.typical_s, "window": e.window}, now)
            case _:
                assert_never(e)

    def act(self, a: Acting, e: RunEffect) -> None:
        seen = a.seen
        if seen is None or seen.spec is None:
            return  # a decision about nodes; or a run whose spec no longer validates: nothing it can do
        match e:
            case ResumeRun(from_step=int(step)):  # newer checkpoints out of the way of every later resume
                self.d.moves.go_back_to(seen.run, seen.spec, seen.run_dir, step, a.now)
            case _:
                pass  # recorded; nothing to do outside

    @staticmethod
    def _record_state(r: Recording, e: SetRunState | FinishRun | ResumeRun) -> None:
        tx, now, n = r.tx, r.now, r.of_run().number
        state = r.state
        if state is None:
            raise TypeError("a run's state change outside a run's decision")
        new = RunState.PENDING if isinstance(e, ResumeRun) else e.state
        check_run(state, new)  # an illegal transition raises: the whole transaction rolls back
        data: dict[str, object] = {"from": state.value, "to": new.value}
        if isinstance(e, ResumeRun):
            tx.update_run(n, state=new, reason=e.reason, ended_at=None,
                          budget_from_attempt=len(tx.list_attempts(n)))
            if e.from_step is not None:  # a newer memory save is past the step the operator chose
                tx.forget_memory_checkpoints_after(n, e.from_step)
        elif isinstance(e, FinishRun):
            tx.update_run(n, state=new, reason=e.reason, ended_at=now, final_step=e.final_step,
                          model_digest=e.model_digest)
            data |= {"final_step": e.final_step, "model_digest": e.model_digest}
        else:
            tx.update_run(n, state=new, reason=e.reason)
        tx.add_event(n, EventKind.RUN_STATE, f"{state} -> {new}: {e.reason}", data, now)
        r.state = new

    @staticmethod
    def _record_skip(r: Recording, e: SkipData) -> None:
        tx, now, n = r.tx, r.now, r.of_run().number
        tx.add_data_skip(n, e.start, e.end, e.reason, now)
        if e.unit == "steps":  # data steps (policy/recovery.py: data_to_skip)
            tx.add_event(n, EventKind.DATA_SKIP,
                         f"skipping the data of steps {e.start} to {e.end - 1} (of the data stream) from "
                         f"the next attempt on, through {{skip_to_step}}: {e.reason}",
                         {"start": e.start, "end": e.end, "unit": "steps"}, now)
        else:
            tx.add_event(n, EventKind.DATA_SKIP,
                         f"skipping samples {e.start} to {e.end} from the next attempt on: "
                         f"{e.reason}", {"start": e.start, "end": e.end}, now)
