"""The supervisor on a real Slurm cluster (three slurmd posing as nodes on this host):
what it refuses at submit, and how it probes and drains nodes. The faults a run
survives on Slurm are in tests/chaos/test_slurm.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slurmbox.box import Box
from supervisor.slurm import parse
from tests.conftest import REPO, wait_for
from tests.e2e.conftest import db_rows, slurm, spec_for_slurm, summary_of, tsup
from tests.fake_tools.replay import make_tools

pytestmark = pytest.mark.e2e


def test_specs_the_cluster_cannot_serve_are_refused_at_submit(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    bad_partition = tsup("run", spec_for_slurm(tmp_path, partition="gpu-h100"), "--state-dir", tmp_path / "s1")
    assert bad_partition.returncode == 2
    assert "resources.partition: no partition 'gpu-h100' on this cluster (it has train)" in bad_partition.stderr

    too_big = spec_for_slurm(tmp_path, partition="train")
    too_big.write_text(too_big.read_text().replace("nodes = 2", "nodes = 4"))
    refused = tsup("run", too_big, "--state-dir", tmp_path / "s2")
    assert refused.returncode == 2
    assert "resources.nodes: 4 nodes asked, partition 'train' has 3" in refused.stderr
    assert slurm(slurm_box, "squeue", "-h") == "", "nothing was submitted"


def test_a_node_reporting_an_uncorrectable_hbm_error_is_drained_before_launch(
        slurm_box: Box, fault_free: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight probes through srun on the allocation's nodes; node2's (fake)
    neuron-monitor reports an uncorrectable HBM error."""
    fixtures = REPO / "tests" / "fixtures" / "health" / "neuron"
    hw = tmp_path / "hw"
    (hw / "default").mkdir(parents=True)
    (hw / "node2").mkdir()
    (hw / "default" / "neuron-ls").write_text((fixtures / "neuron-ls_json_trn1.32xlarge_SYNTHESIZED.json").read_text())
    (hw / "default" / "neuron-monitor").write_text(
        (fixtures / "neuron-monitor_report_trn1_healthy_SYNTHESIZED.json").read_text())
    (hw / "node2" / "neuron-monitor").write_text(
        (fixtures / "neuron-monitor_report_trn1_hbm_ue_SYNTHESIZED.json").read_text())
    tools = make_tools(tmp_path / "tools", ["neuron-ls", "neuron-monitor"])
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    monkeypatch.setenv("TSUP_HEALTH_TOOLS", str(tools))
    monkeypatch.setenv("TSUP_FAKE_HW", str(hw))
    spec = spec_for_slurm(tmp_path)
    spec.write_text(spec.read_text() + '\n[health]\npreflight = true\nargs = ["--instance-type", "trn1.32xlarge", '
                    '"--min-free-gib", "0.1"]\n')
    state = tmp_path / "state"
    proc = tsup("run", spec, "--state-dir", state, "--json")
    s = summary_of(proc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["state"] == "SUCCEEDED" and s["model_digest"] == fault_free["model_digest"]
    assert s["faults"] == [] and s["attempts"] == 1, "the bad node never got the trainer"
    assert s["attempt_history"][0]["nodes"] == ["node1", "node3"]
    assert s["drained_nodes"] == ["node2"]
    node2 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node2"))["node2"]
    assert "DRAIN" in node2.flags
    assert node2.reason.startswith("training-supervisor: probe: neuron-monitor:")
    assert "uncorrected" in node2.reason.lower() and "HBM" in node2.reason
    probes = db_rows(state, "SELECT node, kind, status FROM probes ORDER BY id")
    assert probes.count(("node2", "preflight", "unhealthy")) == 2, "confirmed by a second probe"
    assert ("node1", "preflight", "healthy") in probes and ("node3", "preflight", "healthy") in probes


def test_a_drained_node_is_probed_inside_a_reservation_and_stays_drained_until_returned(
        slurm_box: Box, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's path for drained nodes: Slurm runs no job on a drained node, so the
    launcher reserves it, resumes it, probes it and drains it again with the same Reason."""
    from supervisor import node_health
    from supervisor.slurm.cluster import slurm_cluster

    fixtures = REPO / "tests" / "fixtures" / "health" / "neuron"
    hw = tmp_path / "hw" / "default"
    hw.mkdir(parents=True)
    (hw / "neuron-ls").write_text((fixtures / "neuron-ls_json_trn1.32xlarge_SYNTHESIZED.json").read_text())
    (hw / "neuron-monitor").write_text((fixtures / "neuron-monitor_report_trn1_healthy_SYNTHESIZED.json").read_text())
    monkeypatch.setenv("SLURM_CONF", str(slurm_box.conf))
    monkeypatch.setenv("TSUP_HEALTH_TOOLS", str(make_tools(tmp_path / "tools", ["neuron-ls", "neuron-monitor"])))
    monkeypatch.setenv("TSUP_FAKE_HW", str(tmp_path / "hw"))
    reason = "training-supervisor: probe: neuron-monitor: mem_ecc_uncorrected=1 (run-1, preflight)"
    slurm(slurm_box, "scontrol", "update", "NodeName=node3", "State=DRAIN", f"Reason={reason}")
    launcher = slurm_cluster(slurm_conf=str(slurm_box.conf), state_dir=tmp_path / "state").nodes
    argv = node_health.probe_argv(["--instance-type", "trn1.32xlarge", "--min-free-gib", "0.1"])

    answers = launcher.probe_drained({"node3": reason}, argv, timeout_s=60)

    record = node_health.record("node3", answers.get("node3"), "sweep", None, 0.0)
    assert record.status == "healthy", answers
    node3 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node3"))["node3"]
    assert "DRAIN" in node3.flags and node3.reason == reason
    assert "No reservations" in slurm(slurm_box, "scontrol", "show", "reservation")
    assert launcher.probe(["node3"], argv, allocation_info=None, timeout_s=30) == {}, "no job on a drained node"

    launcher.undrain("node3")
    node3 = parse.parse_nodes(slurm(slurm_box, "scontrol", "-o", "show", "node", "node3"))["node3"]
    assert "DRAIN" not in node3.flags
    # Slurm may take a scheduling pass to offer the returned node (under load, the probe
    # job of a moment ago can still be completing there): a sweep would simply try again
    # at its next period, so the test tries again too, for at most a minute.
    def probed() -> bool:
        return "node3" in launcher.probe(["node3"], argv, allocation_info=None, timeout_s=30)
    wait_for(probed, 60, "a probe of the returned node3: " + slurm(slurm_box, "scontrol", "-o", "show", "node", "node3"),
             interval_s=1)
