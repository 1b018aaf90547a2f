"""health/neuron/: every Neuron fixture through its parser, garbage through every parser,
the log signature table, and the runners with stand-in tools.

Fixtures live in tests/fixtures/health/neuron/ (copies of the team's reference outputs; the
ones built by hand have SYNTHESIZED in their names). The runner tests put tiny `#!/bin/sh`
stand-ins in $TSUP_HEALTH_TOOLS; nothing here needs a Neuron device.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from health import neuron
from health.model import Action, Status, no_devices, verdict
from tests.conftest import REPO
from tests.unit.conftest import write_tool
from tests.unit.health_helpers import assert_failed, only

FIXTURES = REPO / "tests" / "fixtures" / "health" / "neuron"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


JSON_OK = "neuron-ls_json_trn1.32xlarge_SYNTHESIZED.json"
JSON_MISSING = "neuron-ls_json_trn1.32xlarge_missing_device_SYNTHESIZED.json"
TABLE_TRN1 = "neuron-ls_trn1.32xlarge_default_SYNTHESIZED.txt"
TABLE_TOPOLOGY = "neuron-ls_trn1.32xlarge_topology.txt"
TABLE_TRN2 = "neuron-ls_trn2_default_verbatim.txt"
MON_OK = "neuron-monitor_report_trn1_healthy_SYNTHESIZED.json"
MON_HBM = "neuron-monitor_report_trn1_hbm_ue_SYNTHESIZED.json"
MON_NO_DRIVER = "neuron-monitor_report_no_driver_SYNTHESIZED.json"
MON_STREAM = "neuron-monitor_stream_2reports_SYNTHESIZED.jsonl"
SWEEP = "nccom-test_allr_2node_64rank_fp32_sweep.txt"


# --------------------------------------------------------------------------------------------
# neuron-ls

@pytest.mark.parametrize(("name", "kwargs", "status", "action", "evidence"), [
    (JSON_OK, {"instance_type": "trn1.32xlarge"}, Status.HEALTHY, Action.NONE,
     "16 of 16 Neuron devices present, 32 NeuronCores (trn1.32xlarge)"),
    (JSON_OK, {}, Status.HEALTHY, Action.NONE, "16 Neuron devices, 32 NeuronCores (no expected count given)"),
    (JSON_OK, {"expected_devices": 16, "expected_cores": 32}, Status.HEALTHY, Action.NONE, "16 of 16"),
    (JSON_MISSING, {"instance_type": "trn1.32xlarge"}, Status.UNHEALTHY, Action.REBOOT,
     "15 of 16 Neuron devices present (trn1.32xlarge); missing: 15"),
    (JSON_MISSING, {"expected_devices": 16}, Status.UNHEALTHY, Action.REBOOT,
     "15 of 16 Neuron devices present; missing: 15"),
    (JSON_OK, {"instance_type": "trn1.2xlarge"}, Status.DEGRADED, Action.NONE,
     "16 Neuron devices present, expected 1 (trn1.2xlarge)"),
    (TABLE_TRN1, {}, Status.HEALTHY, Action.NONE, "16 of 16 Neuron devices present, 32 NeuronCores (trn1.32xlarge)"),
    (TABLE_TOPOLOGY, {"instance_type": "trn1.32xlarge"}, Status.HEALTHY, Action.NONE,
     "16 of 16 Neuron devices present, 32 NeuronCores (trn1.32xlarge)"),
    (TABLE_TOPOLOGY, {"instance_type": "trn1n.32xlarge"}, Status.HEALTHY, Action.NONE, "16 of 16"),
    # trn2 reports logical cores: 16 x 8 physical / LNC 2 (printed in the header) = 64
    (TABLE_TRN2, {}, Status.HEALTHY, Action.NONE, "16 of 16 Neuron devices present, 64 NeuronCores (trn2n.48xlarge)"),
    (TABLE_TRN2, {"instance_type": "trn2.48xlarge"}, Status.HEALTHY, Action.NONE,
     "(trn2.48xlarge expected; neuron-ls says trn2n.48xlarge)"),
    (TABLE_TRN2, {"expected_cores": 128}, Status.UNHEALTHY, Action.REBOOT, "64 of 128 NeuronCores present"),
])
def test_neuron_ls_fixtures(name: str, kwargs: dict[str, object], status: Status, action: Action,
                            evidence: str) -> None:
    f = only(neuron.check_neuron_ls(fixture(name), **kwargs))  # type: ignore[arg-type]
    assert (f.probe, f.status, f.action) == ("neuron-ls", status, action), f
    assert evidence in f.evidence, f.evidence


def _table_without(device: int) -> str:
    return "\n".join(ln for ln in fixture(TABLE_TRN1).splitlines() if not ln.startswith(f"| {device} "))


def test_neuron_ls_table_with_a_device_gone() -> None:
    last = only(neuron.check_neuron_ls(_table_without(15)))
    assert (last.status, last.action) == (Status.UNHEALTHY, Action.REBOOT)
    assert "15 of 16 Neuron devices present (trn1.32xlarge); missing: 15" in last.evidence
    middle = only(neuron.check_neuron_ls(_table_without(7)))
    assert (middle.status, middle.action) == (Status.UNHEALTHY, Action.REBOOT)
    assert "missing: 7" in middle.evidence
    # without any expectation a gap in the indices still shows the loss
    no_header = "\n".join(ln for ln in fixture(TABLE_TOPOLOGY).splitlines() if not ln.startswith("| 7 "))
    gap = only(neuron.check_neuron_ls(no_header))
    assert gap.status is Status.UNHEALTHY and "gaps; missing: 7" in gap.evidence


def test_neuron_ls_json_forms() -> None:
    devices = json.loads(fixture(JSON_OK))
    new_form = {"instance_type": "trn1.32xlarge", "logical_neuroncore_config": 1, "neuron_devices": devices}
    f = only(neuron.check_neuron_ls(json.dumps(new_form)))
    assert f.status is Status.HEALTHY and "16 of 16 Neuron devices present, 32 NeuronCores (trn1.32xlarge)" in f.evidence
    new_form["neuron_devices"] = devices[:12]
    f = only(neuron.check_neuron_ls(json.dumps(new_form)))
    assert (f.status, f.action) == (Status.UNHEALTHY, Action.REBOOT) and "12 of 16" in f.evidence
    assert "missing: 12, 13, 14, 15" in f.evidence
    one_core = [dict(d) for d in devices]
    one_core[4]["nc_count"] = 1
    f = only(neuron.check_neuron_ls(json.dumps(one_core), instance_type="trn1.32xlarge"))
    assert (f.status, f.action) == (Status.UNHEALTHY, Action.REBOOT) and "31 of 32 NeuronCores" in f.evidence
    f = only(neuron.check_neuron_ls(json.dumps(one_core)))  # no expectation: the odd device still shows
    assert f.status is Status.UNHEALTHY and "neuron_device 4 report 1 NeuronCores, others 2" in f.evidence
    for empty in ("[]", '{"neuron_devices": []}'):
        f = only(neuron.check_neuron_ls(empty, instance_type="trn1.32xlarge"))
        assert (f.status, f.action) == (Status.UNHEALTHY, Action.REBOOT)
        assert "no Neuron devices present, expected 16" in f.evidence


def test_neuron_ls_show_all_procs_rows_are_not_devices() -> None:
    lines = fixture(TABLE_TRN1).splitlines()
    extra = "|        |        |          |        |               |              |               |      |"
    rows = [ln for ln in lines[:-1] for ln in ((ln, extra) if ln.startswith("| 3 ") else (ln,))]
    f = only(neuron.check_neuron_ls("\n".join([*rows, lines[-1]])))
    assert f.status is Status.HEALTHY and "16 of 16" in f.evidence


_TABLE_LINES = fixture(TABLE_TRN1).splitlines()


@pytest.mark.parametrize(("text", "why"), [
    ("", "printed nothing"),
    ("  \n\t\n", "printed nothing"),
    ("garbage", "unrecognised neuron-ls output: 'garbage'"),
    ("neuron-ls: command failed: no such device", "unrecognised neuron-ls output"),
    ("\x00\x01\x02", "unrecognised neuron-ls output"),
    (fixture(JSON_OK)[: len(fixture(JSON_OK)) // 2], "JSON does not parse (truncated?)"),
    ("[{", "JSON does not parse"),
    ("{}", "no list of devices"),
    ('{"instance_type": "trn1.32xlarge"}', "no list of devices"),
    ('[{"foo": 1}]', "entry 0 has no neuron_device / nc_count"),
    ("[1, 2]", "entry 0 is not an object"),
    ('[{"neuron_device": 0, "nc_count": 2}, {"neuron_device": 0, "nc_count": 2}]', "neuron_device 0 twice"),
    ("\n".join([*_TABLE_LINES[:6], _TABLE_LINES[5]]), "has a header but no device rows"),  # closed, empty
    ("\n".join(_TABLE_LINES[:6]), "not closed by a border (truncated?)"),  # the header only
    ("\n".join(_TABLE_LINES[:5]), "header is not closed (truncated?)"),
    ("\n".join(_TABLE_LINES[:3]), "header is not closed"),
    ("\n".join(_TABLE_LINES[:12]), "not closed by a border (truncated?)"),  # cut between rows
    ("\n".join(_TABLE_LINES[:11]) + "\n| 8      | 2      | 16-17", "row is malformed (truncated?)"),
    ("+----+\n| A |\n+----+\n| 1 |\n+----+", "no NEURON DEVICE / NEURON CORES column"),
    ("| x | y |", "no +----+ border"),
])
def test_neuron_ls_garbage_is_unknown(text: str, why: str) -> None:
    assert_failed(neuron.check_neuron_ls(text, instance_type="trn1.32xlarge"), why)


def test_instance_type_table() -> None:
    assert neuron.INSTANCE_TYPES["trn1.2xlarge"] == (1, 2)
    assert neuron.INSTANCE_TYPES["trn1.32xlarge"] == neuron.INSTANCE_TYPES["trn1n.32xlarge"] == (16, 32)
    assert neuron.INSTANCE_TYPES["trn2.48xlarge"] == (16, 128)
    assert neuron.INSTANCE_TYPES["inf2.48xlarge"] == (12, 24)


# --------------------------------------------------------------------------------------------
# neuron-monitor

def _report(name: str = MON_OK) -> dict[str, object]:
    return json.loads(fixture(name))  # type: ignore[no-any-return]


def _with_counter(device: int, **counters: int) -> str:
    doc = _report()
    doc["system_data"]["neuron_hw_counters"]["neuron_devices"][device].update(counters)  # type: ignore[index]
    return json.dumps(doc)


def test_neuron_monitor_healthy_report() -> None:
    f = only(neuron.check_neuron_monitor(fixture(MON_OK)))
    assert (f.probe, f.status, f.action) == ("neuron-monitor", Status.HEALTHY, Action.NONE)
    assert f.evidence == ("16 Neuron devices (trn1.32xlarge), no uncorrected ECC errors; 1 runtime(s), "
                          "no hardware errors")


def test_neuron_monitor_hbm_uncorrectable_error() -> None:
    findings = neuron.check_neuron_monitor(fixture(MON_HBM))
    first = findings[0]
    assert (first.status, first.action) == (Status.UNHEALTHY, Action.REPLACE)
    assert first.evidence == "mem_ecc_uncorrected=1 on neuron_device 5 (HBM)"
    evidence = [f.evidence for f in findings]
    assert "execution_stats.error_summary.hardware=1 (runtime 41237)" in evidence
    timed_out = next(f for f in findings if "timed_out" in f.evidence)
    assert (timed_out.status, timed_out.action) == (Status.DEGRADED, Action.NONE)
    v = verdict(findings)
    assert (v.status, v.action) == (Status.UNHEALTHY, Action.REPLACE)
    assert v.reason().startswith("neuron-monitor: mem_ecc_uncorrected=1 on neuron_device 5 (HBM)")


def test_neuron_monitor_without_a_driver_is_unhealthy_reboot() -> None:
    f = only(neuron.check_neuron_monitor(fixture(MON_NO_DRIVER)))
    assert (f.status, f.action) == (Status.UNHEALTHY, Action.REBOOT)
    assert f.evidence.startswith("neuron_hardware_info.error: failed to retrieve Neuron hardware information")
    assert "neuron_hw_counters.error: failed to read neuron hw counters" in f.evidence


def test_neuron_monitor_stream_uses_the_first_complete_report() -> None:
    stream = fixture(MON_STREAM)
    first, second = stream.splitlines()
    assert only(neuron.check_neuron_monitor(stream)).status is Status.HEALTHY
    swapped = neuron.check_neuron_monitor(f"{second}\n{first}\n")
    assert swapped[0].evidence == "mem_ecc_uncorrected=1 on neuron_device 5 (HBM)"
    cut_first = neuron.check_neuron_monitor(f"{first[: len(first) // 2]}\n{second}\n")
    assert verdict(cut_first).action is Action.REPLACE


@pytest.mark.parametrize("cut", [50, 300, 3000])
def test_a_stream_whose_first_line_lost_its_start_uses_the_next_whole_report(cut: int) -> None:
    """The cut line's first "{" opens an inner object that decodes on its own: it is not a
    report, and the whole line after it is."""
    first, second = fixture(MON_STREAM).splitlines()
    found = neuron.check_neuron_monitor(f"{first[cut:]}\n{second}\n")
    assert verdict(found).action is Action.REPLACE, [f.evidence for f in found]


@pytest.mark.parametrize(("counters", "status", "action", "evidence"), [
    ({"sram_ecc_uncorrected": 2}, Status.UNHEALTHY, Action.REPLACE, "sram_ecc_uncorrected=2 on neuron_device 7 (SRAM)"),
    ({"mem_ecc_repairable_uncorrected": 1}, Status.UNHEALTHY, Action.REBOOT,
     "mem_ecc_repairable_uncorrected=1 on neuron_device 7 (HBM, repairable"),
    ({"mem_ecc_corrected": 150}, Status.DEGRADED, Action.NONE, "mem_ecc_corrected=150 on neuron_device 7 (HBM; corrected"),
    ({"sram_ecc_corrected": 3}, Status.HEALTHY, Action.NONE, "recorded: sram_ecc_corrected=3 on neuron_device 7"),
    ({"future_sram_ecc_uncorrected": 1}, Status.UNHEALTHY, Action.REPLACE, "future_sram_ecc_uncorrected=1"),
])
def test_neuron_monitor_ecc_counters(counters: dict[str, int], status: Status, action: Action,
                                     evidence: str) -> None:
    findings = neuron.check_neuron_monitor(_with_counter(7, **counters))
    f = findings[0]
    assert (f.status, f.action) == (status, action), findings
    assert evidence in f.evidence, f.evidence


def test_neuron_monitor_hardware_errors_follow_the_counters() -> None:
    doc = _report(MON_HBM)
    devices = doc["system_data"]["neuron_hw_counters"]["neuron_devices"]  # type: ignore[index]
    devices[5].update(mem_ecc_uncorrected=0, mem_ecc_repairable_uncorrected=1)
    findings = neuron.check_neuron_monitor(json.dumps(doc))
    assert verdict(findings).action is Action.REBOOT, "a repairable HBM error alone is a reboot"
    devices[5].update(mem_ecc_repairable_uncorrected=0)
    hardware = neuron.check_neuron_monitor(json.dumps(doc))
    assert [(f.status, f.action) for f in hardware if "hardware=" in f.evidence] == [
        (Status.UNHEALTHY, Action.REPLACE)]


def test_neuron_monitor_device_count_and_runtime_errors() -> None:
    doc = _report()
    doc["neuron_hardware_info"]["neuron_device_count"] = 15  # type: ignore[index]
    f = neuron.check_neuron_monitor(json.dumps(doc))[0]
    assert (f.status, f.action) == (Status.UNHEALTHY, Action.REBOOT)
    assert f.evidence == "neuron_device_count=15 of 16 Neuron devices (trn1.32xlarge)"
    doc = _report()
    doc["neuron_runtime_data"][0]["error"] = "failed to read runtime stats"  # type: ignore[index]
    f = only(neuron.check_neuron_monitor(json.dumps(doc)))
    assert (f.status, f.action) == (Status.DEGRADED, Action.NONE)
    assert "cannot read runtime 41237: failed to read runtime stats" in f.evidence


def _monitor_variant(edit: str) -> str:
    doc = _report()
    system = doc["system_data"]
    assert isinstance(system, dict)
    if edit == "no system_data":
        del doc["system_data"]
    elif edit == "counters error":
        system["neuron_hw_counters"]["error"] = "permission denied"
    elif edit == "no devices":
        system["neuron_hw_counters"]["neuron_devices"] = []
    elif edit == "not a count":
        system["neuron_hw_counters"]["neuron_devices"][2]["mem_ecc_uncorrected"] = "lots"
    elif edit == "device not an object":
        system["neuron_hw_counters"]["neuron_devices"][2] = 7
    return json.dumps(doc)


@pytest.mark.parametrize(("text", "why"), [
    ("", "printed nothing"),
    ("garbage\nmore garbage", "no complete JSON report in the output (truncated?): 'garbage'"),
    (fixture(MON_OK)[: len(fixture(MON_OK)) // 2], "no complete JSON report"),
    (fixture(MON_STREAM).splitlines()[0][:5000], "no complete JSON report"),
    ("{}", "not a neuron-monitor report (keys: none)"),
    ('{"foo": 1}', "not a neuron-monitor report (keys: foo)"),
    ("[1, 2, 3]", "no complete JSON report"),
    ("neuron-monitor: error: failed to open config", "no complete JSON report"),
    (_monitor_variant("no system_data"), "no system_data.neuron_hw_counters"),
    (_monitor_variant("counters error"), "neuron_hw_counters.error: permission denied"),
    (_monitor_variant("no devices"), "neuron_hw_counters lists no devices"),
    (_monitor_variant("not a count"), "mem_ecc_uncorrected on neuron_device 2 is not a count: 'lots'"),
    (_monitor_variant("device not an object"), "neuron_devices[2] is not an object"),
])
def test_neuron_monitor_garbage_is_unknown(text: str, why: str) -> None:
    assert_failed(neuron.check_neuron_monitor(text), why)


# --------------------------------------------------------------------------------------------
# nccom-test

@pytest.mark.parametrize(("name", "kwargs", "status", "action", "evidence"), [
    (SWEEP, {}, Status.HEALTHY, Action.NONE, "busbw 47.09 GB/s at 1 GiB (largest size of 28); no floor given"),
    # the "Avg bus bandwidth" line says 9.39: a floor of 10 would fail on it, not on the largest size
    (SWEEP, {"min_busbw_gbps": 10}, Status.HEALTHY, Action.NONE, "busbw 47.09 GB/s at 1 GiB"),
    (SWEEP, {"baseline_gbps": 52.83}, Status.HEALTHY, Action.NONE, "floor 42.26 GB/s"),
    (SWEEP, {"min_busbw_gbps": 50}, Status.DEGRADED, Action.NONE, "busbw 47.09 GB/s at 1 GiB (largest size of 28): "
                                                                  "under the floor 50.00 GB/s"),
    (SWEEP, {"baseline_gbps": 60, "tolerance": 0.9}, Status.DEGRADED, Action.NONE, "under the floor 54.00 GB/s"),
    (SWEEP, {"min_busbw_gbps": 30, "baseline_gbps": 70}, Status.DEGRADED, Action.NONE, "under the floor 56.00"),
    (SWEEP, {"min_busbw_gbps": 100}, Status.UNHEALTHY, Action.REPLACE, "under 0.5 x the floor 100.00 GB/s"),
    ("nccom-test_allr_2rank_pass.txt", {"min_busbw_gbps": 40}, Status.HEALTHY, Action.NONE,
     "busbw 40.69 GB/s at 32 MiB (largest size of 1)"),
    ("nccom-test_allr_2rank_pass.txt", {"min_busbw_gbps": 90}, Status.UNHEALTHY, Action.REPLACE, "under 0.5 x"),
    ("nccom-test_show_algorithm_tab_separator.txt", {"baseline_gbps": 120}, Status.HEALTHY, Action.NONE,
     "busbw 103.89 GB/s at 512 MiB (largest size of 2); floor 96.00 GB/s"),
    ("nccom-test_show_algorithm_tab_separator.txt", {"baseline_gbps": 140}, Status.DEGRADED, Action.NONE,
     "under the floor 112.00 GB/s"),
    ("nccom-test_allr_newer_timeavg_format.txt", {}, Status.HEALTHY, Action.NONE,
     "busbw 2.80 GB/s at 512 KiB (largest size of 17)"),
    # small messages are latency-bound: never more than DEGRADED
    ("nccom-test_allr_newer_timeavg_format.txt", {"min_busbw_gbps": 30}, Status.DEGRADED, Action.NONE,
     "under the floor 30.00 GB/s (sizes under 32 MiB are latency-bound)"),
    ("nccom-test_report.json", {}, Status.HEALTHY, Action.NONE, "busbw 21.98 GB/s at 512 KiB (largest size of 2)"),
    ("nccom-test_report.json", {"min_busbw_gbps": 25}, Status.DEGRADED, Action.NONE, "under the floor 25.00"),
    ("nccom-test_fail_driver.txt", {}, Status.UNHEALTHY, Action.REBOOT,
     "nccom-test failed: Neuron DKMS Driver is not running! Read the troubleshooting guide"),
    ("nccom-test_fail_neuron-bench.txt", {"min_busbw_gbps": 10}, Status.UNHEALTHY, Action.REBOOT,
     "nccom-test failed: 33554432 Failure running neuron-bench - log file /tmp/nccom_test_log_7pqpdfjf.log"),
])
def test_nccom_test_fixtures(name: str, kwargs: dict[str, float], status: Status, action: Action,
                             evidence: str) -> None:
    f = only(neuron.check_nccom_test(fixture(name), **kwargs))
    assert (f.probe, f.status, f.action) == ("nccom-test", status, action), f
    assert evidence in f.evidence, f.evidence


def test_nccom_test_largest_size_wins_whatever_the_row_order() -> None:
    lines = fixture(SWEEP).splitlines()
    shuffled = "\n".join([lines[0], lines[-2], *lines[1:-2], lines[-1]])
    f = only(neuron.check_nccom_test(shuffled, min_busbw_gbps=45))
    assert f.status is Status.HEALTHY and "47.09 GB/s at 1 GiB" in f.evidence
    checked = fixture(SWEEP).replace("Avg bus bandwidth:      9.3924GB/s", "2 errors found - test failed")
    f = only(neuron.check_nccom_test(checked))
    assert (f.status, f.action) == (Status.UNHEALTHY, Action.REBOOT)
    assert f.evidence == "nccom-test failed: 2 errors found - test failed"


_SWEEP_LINES = fixture(SWEEP).splitlines()


@pytest.mark.parametrize(("text", "why"), [
    ("", "printed nothing"),
    ("garbage", "no nccom-test result table: 'garbage'"),
    ("usage: nccom-test [-h] [-r NWORKERS]", "no nccom-test result table"),
    (_SWEEP_LINES[0], "has a header but no rows"),
    (_SWEEP_LINES[0] + "\nAvg bus bandwidth:      9.3924GB/s", "has a header but no rows"),
    ("\n".join(_SWEEP_LINES[:10]), "no 'Avg bus bandwidth' line (truncated?)"),
    ("\n".join(_SWEEP_LINES[:10]) + "\n    4096    1024    fp32", "row is malformed"),
    (_SWEEP_LINES[0] + "\n  8  2  fp32  520  0.00  fast\nAvg bus bandwidth: 1GB/s", "row is malformed"),
    (fixture("nccom-test_report.json")[:200], "JSON report does not parse (truncated?)"),
    ('{"results": []}', "JSON report has no results"),
    ('{"other": 1}', "JSON report has no results"),
    ('{"results": [{"size(B)": 1024, "busbw(GB/s)": "fast"}]}', "JSON result 0 has no size(B) / busbw(GB/s)"),
])
def test_nccom_test_garbage_is_unknown(text: str, why: str) -> None:
    assert_failed(neuron.check_nccom_test(text, min_busbw_gbps=1.0), why)


# --------------------------------------------------------------------------------------------
# logs

_HW_FAULTS = fixture("neuron_runtime_hw_faults_SYNTHESIZED_prefix.log").splitlines()


@pytest.mark.parametrize(("line", "status", "action", "evidence"), [
    (_HW_FAULTS[0], Status.UNHEALTHY, Action.REPLACE,
     "uncorrectable SRAM error (NRT 1202): (FATAL-RT-UNDEFINED-STATE) [ND 0][NC 0] Uncorrectable memory error"),
    (_HW_FAULTS[1], Status.UNHEALTHY, Action.REPLACE, "uncorrectable HBM error (NRT 1201)"),
    (_HW_FAULTS[2], Status.UNHEALTHY, Action.REBOOT, "repairable uncorrectable HBM error (NRT 1205)"),
    (_HW_FAULTS[3], Status.UNHEALTHY, Action.REPLACE, "DMA engine abort (NRT 1203): [MLA 0][NC 0] DMA TX engine 0"),
    (_HW_FAULTS[4], Status.DEGRADED, Action.NONE, "hang in collectives (NRT 1200): the faulty node may be a peer"),
    (_HW_FAULTS[5], Status.UNHEALTHY, Action.REPLACE, "hang on compute (execution timeout): (FATAL-RT-UNDEFINED"),
])
def test_classify_runtime_hardware_faults(line: str, status: Status, action: Action, evidence: str) -> None:
    f = only(neuron.classify_log(line))
    assert (f.probe, f.status, f.action) == ("neuron-log", status, action), f
    assert evidence in f.evidence, f.evidence
    assert "2026-Mar-02" not in f.evidence, "the log prefix is stripped from the quote"


def test_classify_the_hardware_fault_log_as_a_whole() -> None:
    findings = neuron.classify_log("\n".join(_HW_FAULTS))
    assert len(findings) == 6
    assert (verdict(findings).status, verdict(findings).action) == (Status.UNHEALTHY, Action.REPLACE)


def test_classify_kernel_neuron_hw_err_lines() -> None:
    findings = neuron.classify_log(fixture("dmesg_neuron_hw_err.txt"))
    bad = [f for f in findings if f.status is Status.UNHEALTHY]
    assert [f.action for f in bad] == [Action.REPLACE] * 4
    assert [f.evidence.split(":")[1].strip() for f in bad] == [
        "SRAM uncorrectable error", "HBM uncorrectable error", "NeuronCore uncorrectable error", "DMA error"]
    assert "NEURON_HW_ERR=HBM_UNCORRECTABLE_ERROR" in bad[1].evidence and "nd-id=3" in bad[1].evidence
    benign = only([f for f in findings if f.status is not Status.UNHEALTHY])
    assert benign.status is Status.HEALTHY and "DEREG_MR" in benign.evidence
    other = neuron.classify_log("[1.0] NEURON_HW_ERR=PCIE_LINK_DOWN nd-id=2 action=TERMINATE_INSTANCE\n"
                                "[2.0] NEURON_HW_ERR=SOMETHING_NEW nd-id=4 action=RESET")
    assert [(f.status, f.action) for f in other] == [(Status.UNHEALTHY, Action.REPLACE),
                                                     (Status.UNHEALTHY, Action.REBOOT)]


def test_classify_the_verbatim_runtime_errors() -> None:
    findings = neuron.classify_log(fixture("neuron_runtime_errors_verbatim.log"))
    by_text = {f.evidence.split(":")[0]: f for f in findings}
    driver = by_text["the Neuron driver is missing"]
    assert (driver.status, driver.action) == (Status.UNHEALTHY, Action.REBOOT)
    hang = by_text["hang on compute (execution timeout)"]
    assert (hang.status, hang.action) == (Status.UNHEALTHY, Action.REPLACE)
    assert "inference timeout (600000 ms) on Neuron Device 0 NC 0" in hang.evidence
    dge = by_text["configuration"] if "configuration" in by_text else next(
        f for f in findings if "DGE" in f.evidence)
    assert dge.action is Action.NONE
    assert (by_text["NRT_TIMEOUT (5)"].status, by_text["NRT_TIMEOUT (5)"].action) == (Status.DEGRADED, Action.NONE)
    oob = by_text["NRT_EXEC_OOB (1006)"]
    assert (oob.status, oob.action) == (Status.HEALTHY, Action.NONE)
    nq = by_text["NRT_EXEC_SW_NQ_OVERFLOW (1204)"]
    assert (nq.status, nq.action) == (Status.HEALTHY, Action.NONE)
    # the infodump block and the follow-on ENC/NMGR lines match nothing and add nothing
    assert not any("cut here" in f.evidence or "NRT version" in f.evidence for f in findings)
    assert (verdict(findings).status, verdict(findings).action) == (Status.UNHEALTHY, Action.REPLACE)


_AMBIGUOUS = fixture("neuron_ccom_benign_or_ambiguous.log").splitlines()


@pytest.mark.parametrize("line", _AMBIGUOUS)
def test_collectives_messages_never_drain(line: str) -> None:
    findings = neuron.classify_log(line)
    assert findings and all(f.action is Action.NONE for f in findings), findings
    assert all(f.status in (Status.HEALTHY, Status.DEGRADED) for f in findings), findings
    assert not findings[0].evidence.startswith("no known error signature"), "each line is recognised"


def test_collectives_messages_as_a_whole() -> None:
    v = verdict(neuron.classify_log("\n".join(_AMBIGUOUS)))
    assert (v.status, v.action) == (Status.DEGRADED, Action.NONE)
    hang = neuron.classify_log(_HW_FAULTS[4] * 1 + "\n" + "\n".join(_AMBIGUOUS))
    assert all(f.action is Action.NONE for f in hang)


@pytest.mark.parametrize("name", ["hyperpod_auto_resume_srun_verbatim.log", "hyperpod_health_logs_verbatim.txt",
                                  "hyperpod_sinfo_slurmctld_verbatim.txt"])
def test_other_logs_have_no_neuron_signature(name: str) -> None:
    """Negative controls: "replacing nodes", "Replace the Instance", an NVIDIA Xid, Action:Replace."""
    f = only(neuron.classify_log(fixture(name)))
    assert (f.status, f.action) == (Status.HEALTHY, Action.NONE)
    assert f.evidence.startswith("no known error signature in ")


def test_classify_empty_unmatched_repeated_and_binary() -> None:
    for text in ("", "\n\n", "all good\nstep 100 loss 2.3\n"):
        f = only(neuron.classify_log(text))
        assert (f.status, f.action) == (Status.HEALTHY, Action.NONE) and "no known error signature" in f.evidence
    repeated = neuron.classify_log("step 1\n" + (_HW_FAULTS[3] + "\n") * 3 + "step 2")
    assert only(repeated).evidence.startswith("DMA engine abort (NRT 1203) (x3): ")
    interleaved = neuron.classify_log("Timeout waiting for RX (waited 120 sec) - retrying" + _HW_FAULTS[1])
    assert {f.action for f in interleaved} == {Action.NONE, Action.REPLACE}
    assert_failed(neuron.classify_log("\x00\x01ELF\x00"), "binary data")


@pytest.mark.parametrize(("code", "status", "action"), [
    (1200, Status.DEGRADED, Action.NONE),  # collectives: the peer may be at fault
    (1201, Status.UNHEALTHY, Action.REPLACE),  # HBM uncorrectable
    (1202, Status.UNHEALTHY, Action.REPLACE),  # NeuronCore (SRAM) uncorrectable
    (1203, Status.UNHEALTHY, Action.REPLACE),  # DMA abort
    (1204, Status.HEALTHY, Action.NONE),  # software notification-queue overflow
    (1205, Status.UNHEALTHY, Action.REBOOT),  # repairable HBM: reload the driver or reboot
])
def test_nrt_hardware_codes(code: int, status: Status, action: Action) -> None:
    name = neuron.NRT_CODES[code][0]
    for line in (f"2025-Sep-19 18:57:20.901533  4444:4444  ERROR   NRT:nrt_infodump   Failure: {name} in nrt_execute()",
                 f"2023-Jan-09 20:27:41.0600 15042:15042 ERROR  NMGR:dlr_infer   Execution completed with err: {code}"):
        f = only(neuron.classify_log(line))
        assert (f.status, f.action) == (status, action), (line, f)
        assert f"({code})" in f.evidence


def test_every_nrt_code_in_the_table_is_classified() -> None:
    for code, (name, status, action, _) in neuron.NRT_CODES.items():
        f = only(neuron.classify_log(f"Failure: {name} in nrt_execute()"))
        assert (f.status, f.action) == (status, action), (code, f)
    for unrelated in ("comp_status 5 err -22", "completed with err: 50", "ata1: status 1201", "exit status 5"):
        assert neuron.classify_log(unrelated)[0].evidence.startswith("no known error signature"), unrelated
    f = only(neuron.classify_log("nrt_execute: NRT status 1203"))
    assert (f.status, f.action) == (Status.UNHEALTHY, Action.REPLACE)


def test_one_table_maps_every_signature_to_a_status_and_action() -> None:
    names = [s.name for s in neuron.SIGNATURES]
    assert len(names) == len(set(names))
    for s in neuron.SIGNATURES:
        if s.status is Status.UNHEALTHY:
            assert s.action in (Action.REPLACE, Action.REBOOT), s.name
        else:
            assert s.action is Action.NONE, s.name


# --------------------------------------------------------------------------------------------
# runners, with stand-in tools

def _cat(tools: Path, name: str, fixture_name: str, extra: str = "") -> None:
    write_tool(tools, name, f"cat '{FIXTURES / fixture_name}'{extra}")


def test_run_all_with_stand_in_tools(tools: Path) -> None:
    _cat(tools, "neuron-ls", JSON_OK)
    _cat(tools, "neuron-monitor", MON_OK)
    findings = neuron.run_all(instance_type="trn1.32xlarge")
    assert [(f.probe, f.status) for f in findings] == [("neuron-ls", Status.HEALTHY),
                                                        ("neuron-monitor", Status.HEALTHY)]
    assert "16 of 16 Neuron devices present" in findings[0].evidence

    _cat(tools, "neuron-ls", JSON_MISSING)
    _cat(tools, "neuron-monitor", MON_HBM)
    v = verdict(neuron.run_all(instance_type="trn1.32xlarge", kernel_log=fixture("dmesg_neuron_hw_err.txt")))
    assert (v.status, v.action) == (Status.UNHEALTHY, Action.REPLACE)
    assert v.reason().startswith("neuron-ls: 15 of 16 Neuron devices present (trn1.32xlarge)")
    assert "neuron-monitor: mem_ecc_uncorrected=1 on neuron_device 5 (HBM)" in v.reason()
    assert "NEURON_HW_ERR=DMA_ERROR" in v.reason()


def test_run_all_takes_the_instance_type_from_neuron_monitor(tools: Path) -> None:
    _cat(tools, "neuron-ls", JSON_MISSING)
    _cat(tools, "neuron-monitor", MON_OK)
    f = neuron.run_all()[0]
    assert (f.status, f.action) == (Status.UNHEALTHY, Action.REBOOT)
    assert "15 of 16 Neuron devices present (trn1.32xlarge)" in f.evidence


def test_run_all_bandwidth_runs_nccom_test_on_every_core(tools: Path, tmp_path: Path) -> None:
    argv = tmp_path / "argv"
    _cat(tools, "neuron-ls", TABLE_TRN1)
    _cat(tools, "neuron-monitor", MON_OK)
    write_tool(tools, "nccom-test", f"echo \"$@\" > '{argv}'\ncat '{FIXTURES / SWEEP}'")
    findings = neuron.run_all(run_bandwidth=True, min_busbw_gbps=50)
    assert argv.read_text().split() == ["-r", "32", "-b", "32MB", "-e", "256MB", "-f", "2", "-n", "5", "-w", "2",
                                        "-d", "fp32", "allr"]
    bw = findings[-1]
    assert (bw.probe, bw.status, bw.action) == ("nccom-test", Status.DEGRADED, Action.NONE)
    assert "busbw 47.09 GB/s at 1 GiB" in bw.evidence
    write_tool(tools, "nccom-test", f"cat '{FIXTURES / SWEEP}'\nexit 3")
    assert_failed(neuron.probe_nccom_test(nworkers=32), "exited 3 after a complete table")
    _cat(tools, "nccom-test", "nccom-test_fail_driver.txt", "\nexit 1")
    f = only(neuron.probe_nccom_test())
    assert (f.status, f.action) == (Status.UNHEALTHY, Action.REBOOT) and "Neuron DKMS Driver" in f.evidence


def test_neuron_ls_falls_back_from_json_to_the_table(tools: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    write_tool(tools, "neuron-ls", f"echo \"$@\" >> '{calls}'\n"
                              "case \"$1\" in --*) echo \"neuron-ls: unknown option $1\" >&2; exit 2;; esac\n"
                              f"cat '{FIXTURES / TABLE_TOPOLOGY}'")
    f = only(neuron.probe_neuron_ls(instance_type="trn1.32xlarge"))
    assert f.status is Status.HEALTHY and "16 of 16" in f.evidence
    assert calls.read_text().splitlines() == ["--output-format json", "--json-output", ""]
    write_tool(tools, "neuron-ls", "echo 'neuron-ls: driver not loaded' >&2\nexit 1")
    assert_failed(neuron.probe_neuron_ls(), "neuron-ls exited 1: neuron-ls: driver not loaded")
    write_tool(tools, "neuron-ls", "exec sleep 30")
    assert_failed(neuron.probe_neuron_ls(timeout_s=0.5), "neuron-ls timed out after 0.5 s")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_neuron_monitor_is_read_until_the_first_report_then_killed(tools: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    write_tool(tools, "neuron-monitor", f"echo $$ > '{pidfile}'\ncat '{FIXTURES / MON_STREAM}'\nexec sleep 30")
    began = time.monotonic()
    f = only(neuron.probe_neuron_monitor(timeout_s=20))
    assert time.monotonic() - began < 10, "it did not wait for the stream to end"
    assert f.status is Status.HEALTHY, f
    assert _gone(int(pidfile.read_text())), "the streaming tool is killed"

    write_tool(tools, "neuron-monitor", f"echo $$ > '{pidfile}'\nexec sleep 30")
    began = time.monotonic()
    assert_failed(neuron.probe_neuron_monitor(timeout_s=1), "neuron-monitor printed no complete report in 1 s")
    assert time.monotonic() - began < 10 and _gone(int(pidfile.read_text()))

    write_tool(tools, "neuron-monitor", "echo 'neuron-monitor: cannot open config' >&2\nexit 1")
    assert_failed(neuron.probe_neuron_monitor(), "stderr: neuron-monitor: cannot open config")

    (tools / "neuron-monitor").unlink()
    assert_failed(neuron.probe_neuron_monitor(), "neuron-monitor not installed")

    _cat(tools, "neuron-monitor", MON_NO_DRIVER)  # pretty-printed, then exits
    f = only(neuron.probe_neuron_monitor())
    assert (f.status, f.action) == (Status.UNHEALTHY, Action.REBOOT)


def test_without_neuron_tools_run_all_says_no_neuron_devices(tools: Path, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    findings = neuron.run_all(instance_type="trn1.32xlarge", run_bandwidth=True)
    assert findings == [no_devices("neuron-ls", "Neuron")]
    assert (findings[0].status, findings[0].evidence) == (Status.HEALTHY,
                                                          "no Neuron devices found (neuron-ls not installed)")
    assert neuron.run_all(kernel_log="step 1\nNCCL WARN Timeout waiting for RX") == findings
    assert neuron.run_all(kernel_log=fixture("neuron_runtime_errors_verbatim.log")) == findings
    # a kernel that reports a Neuron hardware error says there is a device after all
    with_errors = neuron.run_all(kernel_log=fixture("dmesg_neuron_hw_err.txt"))
    assert with_errors[0] == findings[0] and verdict(with_errors).action is Action.REPLACE


@pytest.mark.parametrize("itype", ["trn2.48xlarge", "trn2u.48xlarge", "trn2n.48xlarge"])
def test_every_trainium2_family_counts_logical_cores_at_its_default_config(itype: str) -> None:
    """16 devices of 4 logical NeuronCores (LNC 2: 128 physical) where neuron-ls prints no
    config: whole on every Trainium2 machine, not only the trn2 family."""
    devices = [{**d, "nc_count": 4, "neuroncore_ids": list(range(4 * i, 4 * i + 4))}
               for i, d in enumerate((json.loads(fixture(JSON_OK)) * 2)[:16])]
    for i, d in enumerate(devices):
        d["neuron_device"] = i
    f = only(neuron.check_neuron_ls(json.dumps(devices), instance_type=itype))
    assert (f.status, f.action) == (Status.HEALTHY, Action.NONE), f.evidence
