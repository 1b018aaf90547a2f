"""The link test on the Slurm box: an all-reduce between nodes that are separate hosts
(network namespaces joined by a bridge), one node's link slowed by ``tc`` or down
(health/links.py, supervisor/slurm/nodes.py: ``probe_links``). The broker proven from
each node, with one node's way to it blocked by nftables: tests/e2e/test_install.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slurmbox.box import Box, heal_node, partition_node, set_slurmd_timeout, throttle_node, unthrottle_node
from supervisor.slurm import parse
from supervisor.slurm.parse import NodeInfo
from tests.e2e.conftest import db_rows, slurm, spec_for_slurm, summary_of, tsup

pytestmark = pytest.mark.e2e


def run_with_node2_broken(box: Box, tmp_path: Path, health: str, fault_free: dict[str, Any],
                          break_: Callable[[], None], mend: Callable[[], None]) -> tuple[dict[str, Any], NodeInfo]:
    """The example on the box with ``[health]`` ``health``, node2 broken (``break_``) from
    before the submit to the run's end (``mend``): the run's summary, once it succeeded with
    the fault-free weights, and node2 as Slurm has it then."""
    spec = spec_for_slurm(tmp_path)
    spec.write_text(spec.read_text() + "\n[health]\n" + health)
    break_()
    try:
        proc = tsup("run", spec, "--state-dir", tmp_path / "state", "--json")
    finally:
        mend()
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    return s, parse.parse_nodes(slurm(box, "scontrol", "-o", "show", "node", "node2"))["node2"]


def test_a_node_on_a_throttled_link_is_named_by_the_preflight_drained_and_never_trains(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """node2's link at 4 Mbit/s both ways before submit. Its own probe finds nothing (a
    slow link is no fault of the node's own devices); the preflight's link test finds its
    pairs slow against the others', the confirmation finds it again, and it is drained
    with a Reason that says the test, its figure and the others'. The run trains on node1
    and the spare, node3, and ends with the weights of a run that never failed. Each
    node's figure is kept with its probe result."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    s, node2 = run_with_node2_broken(slurm_box, tmp_path, "preflight = true\ndiagnose = true\n", fault_free,
                                     lambda: throttle_node(slurm_box, "node2"),
                                     lambda: unthrottle_node(slurm_box, "node2"))
    assert s["faults"] == [] and s["attempts"] == 1, "the slow node never got the trainer"
    assert s["attempt_history"][0]["nodes"] == ["node1", "node3"]
    assert s["drained_nodes"] == ["node2"]
    assert "DRAIN" in node2.flags
    assert node2.reason.startswith("training-supervisor: probe: links: best pair node"), node2.reason
    assert "median of 3 nodes' best pairs" in node2.reason and "its link is slow" in node2.reason
    probes = db_rows(tmp_path / "state", "SELECT node, kind, status FROM probes ORDER BY id")
    assert probes.count(("node2", "preflight", "unhealthy")) == 2, "confirmed by a second probe"
    assert ("node1", "preflight", "healthy") in probes and ("node3", "preflight", "healthy") in probes
    figures = db_rows(tmp_path / "state", "SELECT node, link_gbps FROM probes WHERE link_gbps IS NOT NULL")
    slow = [g for n, g in figures if n == "node2"]
    assert len(slow) == 2 and max(slow) < 0.5 * min(g for n, g in figures if n != "node2"), figures


def test_a_node_cut_off_at_preflight_is_named_by_the_link_test_and_drained_never_a_hang(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """node2's link down before submit, and Slurm slow to notice (SlurmdTimeout 300 s, its
    default): Slurm still allocates node2. The preflight's own probe hears nothing from
    node2, and its link test completes no pair with it while node1 and node3 complete
    theirs: node2 is named ("reaches no peer"), confirmed, and drained; nothing waits past
    the probe's timeout, and node1 and node3, which answered, are not blamed. The run
    trains on them and ends with the weights of a run that never failed."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    set_slurmd_timeout(slurm_box, 300)
    s, node2 = run_with_node2_broken(slurm_box, tmp_path, "preflight = true\ntimeout_s = 30\n", fault_free,
                                     lambda: partition_node(slurm_box, "node2"),
                                     lambda: heal_node(slurm_box, "node2"))
    assert s["attempt_history"][-1]["nodes"] == ["node1", "node3"] and s["drained_nodes"] == ["node2"]
    assert node2.reason.startswith("training-supervisor: probe: links: no all-reduce with node1, node3"), \
        node2.reason
    probes = db_rows(tmp_path / "state", "SELECT node, kind, status FROM probes ORDER BY id")
    assert ("node2", "preflight", "unhealthy") in probes
    assert [p for p in probes if p[0] != "node2" and p[2] != "healthy"] == [], probes

