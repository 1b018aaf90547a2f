"""The debounce rule of supervisor/node_health.py."""

from __future__ import annotations

import json

from health import wire
from supervisor import node_health
from supervisor.node_health import CONFIRMATIONS, judge, may_return


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


def test_verdicts_of_many_nodes_come_back_together_from_an_interleaved_stream() -> None:
    """srun forwards at most 1024 bytes of a line at a time, mixing nodes' output: each
    verdict travels as short tagged lines and is put back together per node."""
    import random

    docs = {f"node{i}": json.dumps({"node": f"node{i}", "status": "healthy", "action": "none", "reason": "",
                                    "findings": [{"probe": "x", "evidence": "e" * 900 * i}]}) for i in (1, 2, 3)}
    streams = {n: wire.lines(n, d) for n, d in docs.items()}
    assert all(len(line.encode()) < 1024 for ls in streams.values() for line in ls)
    assert len(streams["node3"]) > 3
    mixed: list[str] = []
    rng = random.Random(7)
    queues = {n: list(ls) for n, ls in streams.items()}
    while any(queues.values()):
        n = rng.choice([k for k, q in queues.items() if q])
        mixed.append(queues[n].pop(0))
    mixed.insert(2, "srun: warning: something unrelated")
    assert wire.answers("\n".join(mixed)) == docs
    rec = node_health.record("node2", "\n".join(mixed), "preflight", 1, 0.0)
    assert rec.status == "healthy" and rec.findings[0]["evidence"] == "e" * 1800


def test_a_verdict_with_a_line_missing_is_no_verdict() -> None:
    lines = wire.lines("node1", json.dumps({"node": "node1", "status": "healthy", "pad": "p" * 2000}))
    del lines[1]
    assert wire.answers("\n".join(lines)) == {}
    rec = node_health.record("node1", "\n".join(lines), "preflight", 1, 0.0)
    assert rec.status == "unknown" and rec.reason.startswith("unknown: probe failed")


def test_a_drained_node_returns_only_after_n_clean_results_in_a_row_when_enabled() -> None:
    assert may_return(["healthy", "degraded"], 2)
    assert not may_return(["healthy", "unknown", "healthy"], 2)
    assert not may_return(["healthy"], 2), "too few results yet"
    assert not may_return(["healthy"] * 5, 0), "not enabled"


def _answer(node: str, *findings: tuple[str, str]) -> str:
    bad = [f"{probe}: x" for probe, status in findings if status == "unhealthy"]
    return json.dumps({"node": node, "status": "unhealthy" if bad else "healthy", "action": "none",
                       "reason": "; ".join(bad), "findings": [
                           {"probe": probe, "status": status, "evidence": "x"} for probe, status in findings]})


def test_the_runs_own_files_missing_on_every_node_drain_none_and_on_one_node_drain_it() -> None:
    """H4 of issue 37: a run whose train.sh deleted itself had its 8 nodes drained, its
    missing file taken for 8 node faults. Missing on every node it is the run's fault; on
    some nodes only, theirs (a shared file system not mounted there)."""
    from supervisor.domain import DrainNode, Emit
    from supervisor.policy.nodes import judge_probes

    def judged(answers: dict[str, str | None]) -> list[object]:
        history = {n: [node_health.record(n, answers[n], "diagnosis", 1, 0.0)] for n in answers}
        return list(judge_probes(kind="diagnosis", run_number=1, round_=1, answers=answers, known={},
                                 history=history, return_after=0, now=1.0))

    gone = {f"n{i}": _answer(f"n{i}", ("run-files", "unhealthy"), ("disk", "healthy")) for i in range(8)}
    out = judged(dict(gone))
    assert not [e for e in out if isinstance(e, DrainNode)]
    said = [e for e in out if isinstance(e, Emit) and e.kind == "probe.run_files"]
    assert len(said) == 1 and "the run's fault, not its nodes'" in said[0].message
    one = {**{f"n{i}": _answer(f"n{i}", ("run-files", "healthy")) for i in range(7)}, "n7": gone["n7"]}
    assert [e.node for e in judged(one) if isinstance(e, DrainNode)] == ["n7"]
    also_ecc = {**gone, "n3": _answer("n3", ("run-files", "unhealthy"), ("neuron-monitor", "unhealthy"))}
    assert [e.node for e in judged(also_ecc) if isinstance(e, DrainNode)] == ["n3"], "its ECC error is its own"


def test_a_broker_unreachable_from_one_node_drains_it_and_from_every_node_drains_none() -> None:
    """A node whose security group blocks the broker's port would train with no telemetry
    heard: drained, as any confirmed fault. The broker answering none of them is the
    broker's or the controller's fault: said once, nobody drained. (A confirmation round
    that held the one bad node shared by all, its first version, let the node train.)"""
    from supervisor.domain import DrainNode, Emit, ProbeAgain
    from supervisor.policy.nodes import judge_probes

    def judged(answers: dict[str, str | None], round_: int = 1, seen: int = 1) -> list[object]:
        history = {n: [node_health.record(n, answers[n], "preflight", 1, 0.0)] * (seen - 1) for n in answers}
        return list(judge_probes(kind="preflight", run_number=1, round_=round_, answers=answers, known={},
                                 history=history, return_after=0, now=1.0))

    blocked = {n: _answer(n, ("broker", "unhealthy"), ("disk", "healthy")) for n in ("n1", "n2", "n3")}
    fine = {n: _answer(n, ("broker", "healthy")) for n in ("n1", "n3")}
    out = judged({**fine, "n2": blocked["n2"]})
    assert [e.nodes for e in out if isinstance(e, ProbeAgain)] == [("n2",)], "confirmed first"
    assert not [e for e in out if isinstance(e, Emit) and e.kind == "probe.broker"]
    # The confirmation probes n2 alone: "every node it probed" is n2, and still its own fault.
    assert [e.node for e in judged({"n2": blocked["n2"]}, round_=2, seen=2) if isinstance(e, DrainNode)] == ["n2"]
    out = judged(dict(blocked), seen=2)
    assert not [e for e in out if isinstance(e, DrainNode | ProbeAgain)], "nobody drained, nobody probed again"
    said = [e for e in out if isinstance(e, Emit) and e.kind == "probe.broker"]
    assert len(said) == 1 and "none is drained for it" in said[0].message
    also_ecc = {**blocked, "n3": _answer("n3", ("broker", "unhealthy"), ("neuron-monitor", "unhealthy"))}
    assert [e.node for e in judged(also_ecc, seen=2) if isinstance(e, DrainNode)] == ["n3"], "its ECC error is its own"


def test_an_operators_probe_reports_to_its_command_and_drains_nothing_however_bad() -> None:
    from supervisor.domain import CommandHandled, DrainNode, Emit, ProbeAgain, RecordProbe
    from supervisor.policy.nodes import judge_probes

    bad = _answer("n1", ("neuron-monitor", "unhealthy"))
    history = {"n1": [node_health.record("n1", bad, "sweep", None, 0.0)]}  # bad twice: a sweep would drain
    out = judge_probes(kind=node_health.MANUAL, run_number=None, round_=1, answers={"n1": bad}, known={},
                       history=history, return_after=0, now=1.0, command_id=7)
    assert [type(e) for e in out] == [RecordProbe, Emit, CommandHandled]
    assert not [e for e in out if isinstance(e, (DrainNode, ProbeAgain))]
    handled = out[-1]
    assert isinstance(handled, CommandHandled) and handled.command_id == 7
    assert handled.result.startswith("unhealthy (action: ")
    silent = judge_probes(kind=node_health.MANUAL, run_number=None, round_=1, answers={"n1": None}, known={},
                          history={}, return_after=0, now=1.0, command_id=8)
    assert isinstance(silent[-1], CommandHandled) and silent[-1].result.startswith("unknown")


def test_an_operators_probe_of_a_node_another_round_probes_waits_in_the_queue() -> None:
    from supervisor.domain import Node, NodeCommand, NodeCommandKind, NodeState, ProbeNode
    from supervisor.policy.nodes import node_command

    cmd = NodeCommand(id=3, node="n1", kind=NodeCommandKind.PROBE, reason="", created_at=0.0)
    node = Node(name="n1", state=NodeState.ALLOCATED, run_number=4)
    assert node_command(cmd, node, probing=True) == []
    assert node_command(cmd, node) == [ProbeNode(node="n1", run_number=4, command_id=3)]
    assert [type(e).__name__ for e in node_command(cmd, None)] == ["CommandHandled", "Emit"], "no such node"


def test_a_run_user_missing_on_one_node_drains_it_and_on_every_node_none() -> None:
    """A replacement whose lifecycle script did not create the account cannot start the
    run's processes: drained. No node knowing the user is the run's or the accounts' fault."""
    from supervisor.domain import DrainNode, Emit
    from supervisor.policy.nodes import judge_probes

    def judged(answers: dict[str, str | None]) -> list[object]:
        history = {n: [node_health.record(n, answers[n], "preflight", 1, 0.0)] for n in answers}
        return list(judge_probes(kind="preflight", run_number=1, round_=1, answers=answers, known={},
                                 history=history, return_after=0, now=1.0))

    unknown = {n: _answer(n, ("run-user", "unhealthy")) for n in ("n1", "n2")}
    known = _answer("n1", ("run-user", "healthy"))
    assert [e.node for e in judged({"n1": known, "n2": unknown["n2"]}) if isinstance(e, DrainNode)] == ["n2"]
    out = judged(dict(unknown))
    assert not [e for e in out if isinstance(e, DrainNode)]
    assert [e.kind for e in out if isinstance(e, Emit) and e.kind.startswith("probe.run")] == ["probe.run_user"]
