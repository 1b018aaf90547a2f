"""The debounce rule of supervisor/node_health.py."""

from __future__ import annotations

from supervisor.node_health import CONFIRMATIONS, judge


def test_a_healthy_or_degraded_node_trains() -> None:
    assert judge(["healthy"], ["ok"]) == judge(["degraded", "unhealthy"], ["slow", "x"])
    assert not judge([], []).drain and not judge(["degraded"], ["slow"]).confirm


def test_one_bad_result_is_confirmed_before_anything_is_drained() -> None:
    j = judge(["unhealthy", "healthy", "unhealthy"], ["ECC", "ok", "ECC"])
    assert (j.drain, j.confirm, j.reason) == (False, True, "ECC")
    assert judge(["unknown"], ["probe failed"]).confirm


def test_bad_results_in_a_row_drain_with_the_newest_reason() -> None:
    assert CONFIRMATIONS == 2
    j = judge(["unhealthy", "unknown", "healthy"], ["HBM UE", "timeout", "ok"])
    assert (j.drain, j.confirm, j.reason) == (True, False, "HBM UE")


def test_a_node_answer_that_is_not_a_verdict_is_unknown() -> None:
    from supervisor.node_health import record

    ok = record("n1", 'srun noise\n{"node": "n1", "status": "unhealthy", "action": "replace", "reason": "ECC"}\n',
                "preflight", 3, 1.0)
    assert (ok.status, ok.action, ok.reason, ok.run_number) == ("unhealthy", "replace", "ECC", 3)
    for garbage in (None, "", "{not json", '{"status": "great"}', "[1, 2]", '{"node": "n1"}'):
        r = record("n1", garbage, "preflight", None, 1.0)
        assert r.status == "unknown" and r.reason.startswith("unknown: probe failed:"), garbage
