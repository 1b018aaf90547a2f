"""Event kinds (supervisor/domain/events.py): one list, the strings the log has always
carried, and the kinds made from a word resolve to members."""

from __future__ import annotations

import json

import pytest

from health.model import Status
from supervisor.domain import EventKind


def test_every_kind_is_a_distinct_dotted_word_and_serializes_as_its_string() -> None:
    values = [k.value for k in EventKind]
    assert len(values) == len(set(values))
    assert all(v == "straggler" or "." in v for v in values)
    assert json.dumps({"kind": EventKind.RUN_STATE}) == '{"kind": "run.state"}'
    assert EventKind.RUN_STATE == "run.state" and f"{EventKind.FAULT_DETECTED}" == "fault.detected"


def test_each_probe_verdict_and_refused_node_command_has_its_kind() -> None:
    assert [EventKind.probe(s) for s in Status] == [EventKind.PROBE_HEALTHY, EventKind.PROBE_DEGRADED,
                                                    EventKind.PROBE_UNHEALTHY, EventKind.PROBE_UNKNOWN]
    assert EventKind.node_failed("drain") is EventKind.NODE_DRAIN_FAILED
    assert EventKind.node_failed("return") is EventKind.NODE_RETURN_FAILED
    with pytest.raises(ValueError):
        EventKind.probe("fine")
