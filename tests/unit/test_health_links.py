"""The link test's pure parts (health/links.py): the ring's pairs, each tool's figure for a
pair (from the tools' real multi-node outputs), and which node a slow or dead pair names;
how each tool runs a pair (supervisor/link_steps.py); and how its finding joins a node's
verdict (supervisor/node_health.py)."""

from __future__ import annotations

import json
from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from health import links, wire
from health.links import ALLREDUCE, NCCL_TESTS, NCCOM_TEST, PairResult, judge, pair_result, ring_rounds
from health.model import Finding, Status
from supervisor import link_steps, node_health
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "health"

FAST, SLOW = 1.2, 0.0005  # GB/s: a veth pair, and one end throttled to 4 Mbit/s


def measured(slow: set[str], nodes: list[str]) -> list[PairResult]:
    """Every pair of the ring measured: slow when either end is."""
    return [PairResult(p, SLOW if slow & set(p) else FAST) for r in ring_rounds(nodes) for p in r]


@given(st.integers(min_value=0, max_value=40))
def test_the_rings_pairs_cover_every_node_twice_in_rounds_of_disjoint_pairs(n: int) -> None:
    nodes = [f"n{i}" for i in range(n)]
    rounds = ring_rounds(nodes)
    pairs = [p for r in rounds for p in r]
    if n < 2:
        assert rounds == []
        return
    for r in rounds:
        ends = [node for p in r for node in p]
        assert len(ends) == len(set(ends)), f"a round's pairs share a node: {r}"
    assert len(rounds) == (1 if n == 2 else 2 if n % 2 == 0 else 3)
    assert len(pairs) == (1 if n == 2 else n) and len(set(pairs)) == len(pairs)
    for node in nodes:
        assert sum(node in p for p in pairs) == (1 if n == 2 else 2)


def test_a_slow_node_is_named_by_its_best_pair_against_the_median_and_its_peers_are_not() -> None:
    nodes = ["node1", "node2", "node3"]
    found = judge(nodes, measured({"node2"}, nodes))
    bad = found["node2"]
    assert bad is not None and bad.status is Status.UNHEALTHY and bad.probe == "links"
    assert "best pair" in bad.evidence and "0.0005 GB/s" in bad.evidence and "1.2 GB/s" in bad.evidence
    assert "median of 3 nodes' best pairs" in bad.evidence and "its link is slow" in bad.evidence
    for node in ("node1", "node3"):
        ok = found[node]
        assert ok is not None and ok.status is Status.HEALTHY, ok


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_in_a_ring_of_any_size_only_the_slow_node_is_named(n: int) -> None:
    nodes = [f"n{i}" for i in range(n)]
    for slow in nodes:
        found = judge(nodes, measured({slow}, nodes))
        named = {node for node, f in found.items() if f is not None and f.status is Status.UNHEALTHY}
        assert named == {slow}


def test_noise_within_the_fraction_names_no_one() -> None:
    nodes = ["a", "b", "c", "d"]
    results = [PairResult(("a", "b"), 1.0), PairResult(("b", "c"), 0.6), PairResult(("c", "d"), 0.55),
               PairResult(("d", "a"), 0.9)]
    assert all(f is not None and f.status is Status.HEALTHY for f in judge(nodes, results).values())


def test_two_nodes_share_one_pair_and_neither_is_judged() -> None:
    found = judge(["a", "b"], [PairResult(("a", "b"), SLOW)])
    assert found == {"a": None, "b": None}
    assert "fewer than 3 nodes with a figure" in links.unjudged(["a", "b"], [PairResult(("a", "b"), SLOW)], found)


def test_a_node_that_reaches_no_peer_while_they_reach_each_other_is_named() -> None:
    nodes = ["node1", "node2", "node3"]
    results = [PairResult(("node1", "node2"), None, "timed out after 60 s"),
               PairResult(("node2", "node3"), None, "timed out after 60 s"), PairResult(("node3", "node1"), FAST)]
    found = judge(nodes, results)
    dead = found["node2"]
    assert dead is not None and dead.status is Status.UNHEALTHY
    assert "no all-reduce with node1, node3 completed" in dead.evidence and "reaches no peer" in dead.evidence
    assert "timed out after 60 s" in dead.evidence
    assert found["node1"] is None and found["node3"] is None, "two figures make no median"


def test_a_test_that_could_not_run_blames_no_node() -> None:
    nodes = ["a", "b", "c"]
    nothing = [PairResult(p, None, "python -m health.allreduce: No module named torch")
               for r in ring_rounds(nodes) for p in r]
    found = judge(nodes, nothing)
    assert found == {"a": None, "b": None, "c": None}
    said = links.unjudged(nodes, nothing, found)
    assert "cannot judge a, b, c" in said and "No module named torch" in said


def test_peers_outside_the_round_make_the_baseline_and_are_not_judged() -> None:
    """A confirmation round probes one node; the run's other nodes are its baseline."""
    nodes = ["node1", "node2", "node3"]
    found = judge(["node2"], measured({"node2"}, nodes))
    assert list(found) == ["node2"]
    assert found["node2"] is not None and found["node2"].status is Status.UNHEALTHY


def test_a_pairs_report_is_read_and_a_bad_one_gives_no_figure() -> None:
    doc = {"probe": "allreduce", "backend": "gloo", "world_size": 2, "device": "cpu", "dtype": "float32",
           "iters": 5, "warmup": 2, "results": [{"bytes": 262144, "time_us": 500.0, "algbw_gbps": 0.524,
                                                 "busbw_gbps": 0.524, "wrong": 0}],
           "busbw_gbps_at_largest": 0.524}
    ok = pair_result(("a", "b"), "srun: noise\n" + json.dumps(doc) + "\n")
    assert ok == PairResult(("a", "b"), 0.524)
    corrupt = {**doc, "results": [{**doc["results"][0], "wrong": 3}]}
    assert "3 wrong elements" in pair_result(("a", "b"), json.dumps(corrupt)).why
    failed = pair_result(("a", "b"), "", "timed out after 60 s")
    assert failed.busbw_gbps is None and failed.why.startswith("timed out after 60 s; ")
    assert pair_result(("a", "b"), '{"probe": "allreduce", "error": "Connection refused"}').why == \
        "the all-reduce run failed: Connection refused"


def test_a_link_finding_joins_the_nodes_verdict_and_the_worst_status_wins() -> None:
    healthy = {"node": "n2", "status": "healthy", "action": "none", "reason": "", "summary": "",
               "findings": [{"probe": "disk", "status": "healthy", "evidence": "12 GiB free", "action": "none"}]}
    answers = {"n2": "\n".join(wire.lines("n2", json.dumps(healthy))), "n3": "srun: error: n3: no answer"}
    slow = Finding(probe="links", status=Status.UNHEALTHY, evidence="best pair n1-n2 0.0005 GB/s: slow")
    out = node_health.with_findings(answers, {"n2": slow, "n3": slow, "n4": None})
    r = node_health.record("n2", out["n2"], "preflight", 1, 0.0)
    assert (r.status, r.reason) == ("unhealthy", "links: best pair n1-n2 0.0005 GB/s: slow")
    assert [f["probe"] for f in r.findings] == ["disk", "links"]
    silent = node_health.record("n3", out["n3"], "preflight", 1, 0.0)
    assert (silent.status, silent.reason) == ("unhealthy", "links: best pair n1-n2 0.0005 GB/s: slow"), \
        "no verdict of its own: the link finding, the worse, is its Reason"
    assert [f["status"] for f in silent.findings] == ["unknown", "unhealthy"]
    assert "n4" not in out, "nothing known of it: nothing made up"
    assert node_health.with_findings(answers, {"n2": None}) == answers


def test_a_link_finding_no_worse_than_the_verdict_only_joins_its_findings() -> None:
    bad = {"node": "n1", "status": "unhealthy", "action": "replace", "reason": "neuron-monitor: HBM UE",
           "summary": "", "findings": [{"probe": "neuron-monitor", "status": "unhealthy", "evidence": "HBM UE",
                                        "action": "replace"}]}
    fine = Finding(probe="links", status=Status.HEALTHY, evidence="best pair n1-n2 1.2 GB/s")
    out = node_health.with_findings({"n1": json.dumps(bad)}, {"n1": fine})
    r = node_health.record("n1", out["n1"], "preflight", 1, 0.0)
    assert (r.status, r.action, r.reason) == ("unhealthy", "replace", "neuron-monitor: HBM UE")
    assert [f["probe"] for f in r.findings] == ["neuron-monitor", "links"]


def test_the_link_test_needs_two_nodes_and_the_specs_word() -> None:
    from supervisor.spec import HealthSpec

    on, off = HealthSpec(preflight=True), HealthSpec(preflight=True, links=False)
    test = link_steps.link_test(on.links, on.link_fraction, ["node3"], ["node1", "node2", "node3"])
    assert test is not None and test.over == ("node1", "node2", "node3") and test.fraction == 0.5
    assert link_steps.link_test(on.links, on.link_fraction, ["node1"], ["node1"]) is None
    assert link_steps.link_test(off.links, off.link_fraction, ["node1", "node2"], ["node1", "node2"]) is None
    with pytest.raises(ValueError, match="link_fraction"):
        HealthSpec(link_fraction=1.5)


def test_the_pair_tool_follows_the_accelerator_the_spec_names_unless_it_names_a_tool() -> None:
    from supervisor.spec import HealthSpec

    assert HealthSpec().pair_tool() == ALLREDUCE
    assert HealthSpec(gpus=8).pair_tool() == NCCL_TESTS
    assert HealthSpec(neuron_devices=16).pair_tool() == NCCOM_TEST
    assert HealthSpec(instance_type="trn1.32xlarge").pair_tool() == NCCOM_TEST
    assert HealthSpec(instance_type="p5.48xlarge").pair_tool() == NCCL_TESTS
    assert HealthSpec(gpus=8, link_tool="allreduce").pair_tool() == ALLREDUCE  # torch's NCCL, no nccl-tests
    with pytest.raises(ValueError, match="link_tool"):
        HealthSpec(link_tool="iperf")


def test_a_rounds_link_test_takes_the_runs_tool_and_ranks_a_node_and_an_idle_spares_has_none() -> None:
    from supervisor.effects.nodes import links_of
    from supervisor.spec import parse_spec

    spec = parse_spec({"name": "p5", "resources": {"nodes": 2, "ranks_per_node": 8, "spares": 1},
                       "trainer": {"model": "tiny", "steps": 10}, "health": {"preflight": True, "gpus": 8}})
    test = links_of(spec, "preflight", ["n3"], ["n1", "n2", "n3"])
    assert test == link_steps.LinkTest(over=("n1", "n2", "n3"), fraction=0.5, tool=NCCL_TESTS, tasks_per_node=8)
    assert links_of(spec, "spare", ["n3"], ["n1", "n2", "n3"]) is None


def test_the_link_task_takes_its_rank_from_slurm() -> None:
    argv = link_steps.link_argv(30, interpreter="/opt/tsup/bin/python")
    assert argv[:2] == ("/bin/sh", "-c") and "RANK=$SLURM_PROCID" in argv[2]
    assert argv[4:7] == ("/opt/tsup/bin/python", "-m", "health.allreduce") and "--json" in argv
    assert argv[argv.index("--timeout-s") + 1] == "30"


def test_each_tool_runs_a_pair_in_the_form_its_users_run_it() -> None:
    pair, addrs = ("node1", "node2"), ("10.0.0.1", "10.0.0.2")

    def step(tool: str, per_node: int = 1) -> link_steps.PairStep:
        test = link_steps.LinkTest(over=pair, fraction=0.5, tool=tool, tasks_per_node=per_node)
        return link_steps.pair_step(test, pair, addrs, 30, interpreter="/opt/tsup/bin/python")

    torch = step(ALLREDUCE, 8)  # one process a node, whatever the ranks a node
    assert (torch.nodes, torch.tasks_per_node, torch.mpi) == (pair, 1, None)
    assert dict(torch.env) == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": str(link_steps.LINK_PORT)}
    nccl = step(NCCL_TESTS, 8)  # one task a GPU on both nodes, wired by PMIx; one GPU a task
    assert (nccl.nodes, nccl.tasks_per_node, nccl.mpi, nccl.env) == (pair, 8, "pmix", ())
    assert nccl.argv[0] == "all_reduce_perf" and nccl.argv[nccl.argv.index("-g") + 1] == "1"
    assert nccl.argv[nccl.argv.index("-c") + 1] == "1", "results checked"
    neuron = step(NCCOM_TEST, 32)  # started once on the first node, which reaches the second
    assert (neuron.nodes, neuron.tasks_per_node) == (("node1",), 1)
    assert dict(neuron.env) == {"NEURON_RT_ROOT_COMM_ID": f"10.0.0.1:{link_steps.LINK_PORT}"}
    argv = neuron.argv
    assert argv[0] == "nccom-test" and argv[argv.index("-r") + 1] == "64" and argv[argv.index("-N") + 1] == "2"
    assert argv[-4:] == ("allr", "--hosts", "127.0.0.1", "10.0.0.2")


def test_a_pairs_figure_from_each_tools_real_multi_node_output() -> None:
    """nccl-tests across two p5 (awsome-distributed-training's rows), nccom-test across
    two trn1 (nccom-test.rst's example): the bus bandwidth at the largest size, the lower
    of out-of-place and in-place; a failed run gives no figure and says why."""
    nccl = (FIXTURES / "nvidia" / "nccl-tests_all_reduce_perf_2xp5_verbatim_rows.txt").read_text()
    assert pair_result(("a", "b"), nccl, tool=NCCL_TESTS) == PairResult(("a", "b"), 487.09)
    neuron = (FIXTURES / "neuron" / "nccom-test_allr_2node_64rank_fp32_sweep.txt").read_text()
    assert pair_result(("a", "b"), neuron, tool=NCCOM_TEST) == PairResult(("a", "b"), 47.09)
    driver = (FIXTURES / "neuron" / "nccom-test_fail_driver.txt").read_text()
    failed = pair_result(("a", "b"), driver, "exit code 1", tool=NCCOM_TEST)
    assert failed.busbw_gbps is None and failed.why.startswith("exit code 1; nccom-test failed: Neuron DKMS")
    cut = "\n".join(nccl.splitlines()[:-3]).replace("      0\n", "     12\n", 1)  # a row with wrong results
    wrong = pair_result(("a", "b"), cut, tool=NCCL_TESTS)
    assert wrong.busbw_gbps is None and "#wrong=12" in wrong.why
    assert pair_result(("a", "b"), nccl, tool=ALLREDUCE).busbw_gbps is None, "each tool's output is its own"


def test_every_pair_of_three_nodes_is_in_the_ring() -> None:
    assert {frozenset(p) for r in ring_rounds(["a", "b", "c"]) for p in r} == \
        {frozenset(p) for p in combinations("abc", 2)}


def test_a_failed_pairs_reason_is_sruns_own_error_not_the_tasks_warnings() -> None:
    from supervisor.slurm.commands import Reply
    from supervisor.slurm.nodes import _short_why

    stderr = ("[W1204 17:06:30.68 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved.\n"
              "srun: error: Task launch for StepId=1.1 failed on node node2: Communication connection failure\n"
              "srun: error: Application launch failed: Communication connection failure\n")
    failed = Reply(("srun",), False, "", stderr, "exit 233: ...")
    assert _short_why(failed) == ("srun: error: Task launch for StepId=1.1 failed on node node2: "
                                  "Communication connection failure")
    assert _short_why(Reply(("srun",), False, "", "", "timed out after 30 s")) == "timed out after 30 s"
    assert _short_why(Reply(("srun",), False, "", "torch: boom\nRuntimeError: gloo\n", "exit 1")) == \
        "RuntimeError: gloo"
