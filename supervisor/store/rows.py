"""Row mapping between the tables and the domain's records."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any

from sqlalchemy import CursorResult, Row

from supervisor.domain import (
    Attempt,
    AttemptOutcome,
    AttemptState,
    AttemptStats,
    EventRecord,
    Node,
    NodeIntent,
    NodeState,
    Policy,
    Run,
    RunState,
)


def new_id(res: CursorResult[Any]) -> int:
    key = res.inserted_primary_key
    assert key is not None
    return int(key[0])


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def run_of(r: Row[Any]) -> Run:
    return Run(
        number=r.number, name=r.name, state=RunState(r.state), reason=r.reason, nodes=r.nodes,
        ranks_per_node=r.ranks_per_node, spares=r.spares, total_steps=r.total_steps,
        policy=policy_of(r.policy), created_at=r.created_at, started_at=r.started_at,
        ended_at=r.ended_at, final_step=r.final_step, model_digest=r.model_digest,
        budget_from_attempt=r.budget_from_attempt, allocation_info=r.allocation_info,
        parked_allocation=r.parked_allocation,
    )


_POLICY_KEYS = frozenset(f.name for f in fields(Policy))


def policy_of(text: str) -> Policy:
    """A run's stored policy; keys an older release knew and this one does not are left
    out (the run's spec is validated on its own: supervisor/spec.py)."""
    known = {k: v for k, v in json.loads(text).items() if k in _POLICY_KEYS}
    if known.get("shrink_node_counts") is not None:  # JSON has no tuples
        known["shrink_node_counts"] = tuple(known["shrink_node_counts"])
    return Policy(**known)


def attempt_values(a: Attempt) -> dict[str, Any]:
    return {
        "run_number": a.run_number, "number": a.number, "state": a.state.value,
        "nodes": json.dumps(list(a.nodes)), "resume_from": a.resume_from, "resume_step": a.resume_step,
        "created_at": a.created_at, "started_at": a.started_at, "first_step_at": a.first_step_at,
        "stop_requested_at": a.stop_requested_at, "ended_at": a.ended_at,
        "outcome": a.outcome.value if a.outcome else None, "reason": a.reason,
        "final_step": a.final_step, "launch_info": a.launch_info, "launch_error": a.launch_error,
        "launch_fatal": a.launch_fatal, "precompile": a.precompile, "inputs": a.inputs,
        "set_aside": a.set_aside, "output_offsets": a.output_offsets,
    }


def attempt_of(r: Row[Any]) -> Attempt:
    return Attempt(
        run_number=r.run_number, number=r.number, state=AttemptState(r.state),
        nodes=tuple(json.loads(r.nodes)), resume_from=r.resume_from, resume_step=r.resume_step,
        created_at=r.created_at, started_at=r.started_at, first_step_at=r.first_step_at,
        stop_requested_at=r.stop_requested_at, ended_at=r.ended_at,
        outcome=AttemptOutcome(r.outcome) if r.outcome else None, reason=r.reason,
        final_step=r.final_step, launch_info=r.launch_info, launch_error=r.launch_error,
        launch_fatal=bool(r.launch_fatal), precompile=r.precompile, inputs=r.inputs, set_aside=r.set_aside,
        output_offsets=r.output_offsets,
    )


def node_of(r: Row[Any]) -> Node:
    return Node(name=r.name, state=NodeState(r.state), reason=r.reason, run_number=r.run_number)


def event_of(r: Row[Any]) -> EventRecord:
    return EventRecord(id=r.id, run_number=r.run_number, ts=r.ts, kind=r.kind, message=r.message,
                       data=json.loads(r.data))


def intent_of(r: Row[Any]) -> NodeIntent:
    return NodeIntent(node=r.node, action=r.action, reason=r.reason, requested_at=r.requested_at, sent=r.sent,
                      sent_at=r.sent_at, last_error=r.last_error, confirmed_at=r.confirmed_at)


STATS_COLUMNS = tuple(f.name for f in fields(AttemptStats) if f.name != "attempt")


def stats_of(r: Row[Any]) -> AttemptStats:
    return AttemptStats(attempt=r.attempt, **{k: getattr(r, k) for k in STATS_COLUMNS})
