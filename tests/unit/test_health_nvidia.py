"""health/nvidia/ and the pure parts of health/allreduce.py: every NVIDIA fixture through its
parser, garbage through every parser, the Xid table, the largest-size rule, and the runners with
stand-in tools.

Fixtures live in tests/fixtures/health/nvidia/ (copies of the team's reference outputs; the ones
built by hand have SYNTHESIZED in their names). Variants are derived from them in the tests. The
runner tests put tiny `#!/bin/sh` stand-ins in $TSUP_HEALTH_TOOLS; nothing here needs a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from health import allreduce, nvidia
from health.model import Action, Finding, Status, no_devices, verdict
from tests.conftest import REPO
from tests.unit.conftest import write_tool
from tests.unit.health_helpers import assert_failed, only

FIXTURES = REPO / "tests" / "fixtures" / "health" / "nvidia"
U, D, H = Status.UNHEALTHY, Status.DEGRADED, Status.HEALTHY

SMI = "nvidia-smi_query_gpu_health_SYNTHESIZED.csv"
ROWS = "nvidia-smi_query_remapped_rows_SYNTHESIZED.csv"
XID = "dmesg_nvidia_xid.txt"
XID_MORE = "dmesg_nvidia_xid_more_SYNTHESIZED.txt"
DCGM3 = "dcgmi_diag_r2_dcgm3x_fail_SYNTHESIZED.txt"
DCGM4 = "dcgmi_diag_r2_dcgm4x_pass_SYNTHESIZED.txt"
DCGM_JSON = "dcgmi_diag_r2_json_SYNTHESIZED.json"
NCCL_FULL = "nccl-tests_all_reduce_perf_1xp5_full_SYNTHESIZED.txt"
NCCL_ROWS = "nccl-tests_all_reduce_perf_2xp5_verbatim_rows.txt"
NCCL_WRONG = "nccl-tests_all_reduce_perf_wrong_SYNTHESIZED.txt"
NCCL_ERROR = "nccl-tests_nccl_error_SYNTHESIZED.txt"
HYPERPOD = "hyperpod_health_logs_verbatim.txt"
NEURON_DMESG = "dmesg_neuron_hw_err.txt"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def healthy_smi() -> str:
    """The GPU query fixture with GPU 3's ECC errors and GPU 7's slowdown gone."""
    text = fixture(SMI)
    text = text.replace("Enabled, 0, 2, 5, [N/A]", "Enabled, 0, 0, 0, [N/A]")
    return text.replace("71.03 W, Active", "71.03 W, Not Active")


def healthy_rows() -> str:
    return "\n".join(ln.replace("Yes", "No") for ln in fixture(ROWS).splitlines())


def set_cell(text: str, gpu: int, field: str, value: str) -> str:
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].split(",")]
    col = next(i for i, h in enumerate(header) if h.split(" [")[0] == field)
    cells = [c.strip() for c in lines[gpu + 1].split(",")]
    cells[col] = value
    lines[gpu + 1] = ", ".join(cells)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# nvidia-smi --query-gpu

def test_nvidia_smi_fixture() -> None:
    findings = nvidia.check_nvidia_smi(fixture(SMI), expected_gpus=8)
    assert [(f.status, f.action) for f in findings] == [(U, Action.REPLACE), (D, Action.NONE)]
    assert findings[0].evidence == (
        "GPU 3 (00000000:86:00.0): ecc.errors.uncorrected.volatile.total=2 (uncorrectable ECC errors since "
        "the last reset); ecc.errors.uncorrected.aggregate.total=5 (lifetime uncorrectable ECC errors: no "
        "reboot clears them)")
    assert findings[1].evidence.startswith("GPU 7 (00000000:CA:00.0): clocks_event_reasons.hw_slowdown=Active")
    v = verdict(findings)
    assert (v.status, v.action) == (U, Action.REPLACE)


def test_nvidia_smi_healthy_and_recorded() -> None:
    f = only(nvidia.check_nvidia_smi(healthy_smi(), expected_gpus=8))
    assert (f.status, f.action) == (H, Action.NONE)
    assert f.evidence == ("8 GPUs of 8 expected (NVIDIA H100 80GB HBM3): no uncorrected ECC error, nothing "
                          "pending; recorded: GPU 2 ecc.errors.corrected.volatile.total=12")
    assert "no expected count given" in only(nvidia.check_nvidia_smi(healthy_smi())).evidence


def test_nvidia_smi_gpu_count() -> None:
    missing = "\n".join(ln for ln in healthy_smi().splitlines() if not ln.startswith("5,"))
    f = only(nvidia.check_nvidia_smi(missing, expected_gpus=8))
    assert (f.status, f.action) == (U, Action.REPLACE)
    assert f.evidence == "7 of 8 GPUs present (NVIDIA H100 80GB HBM3)"
    f = only(nvidia.check_nvidia_smi(healthy_smi(), expected_gpus=4))
    assert (f.status, f.action) == (D, Action.NONE) and "8 GPUs present, expected 4" in f.evidence
    f = only(nvidia.check_nvidia_smi("No devices were found\n", expected_gpus=8))
    assert (f.status, f.action) == (U, Action.REPLACE)
    assert f.evidence == "0 of 8 GPUs present; nvidia-smi: No devices were found"
    f = only(nvidia.check_nvidia_smi("No devices were found\n"))
    assert (f.status, f.action) == (U, Action.REBOOT) and "installed but sees no GPU" in f.evidence
    assert only(nvidia.check_nvidia_smi("No devices were found\n", expected_gpus=0)).status is H


@pytest.mark.parametrize(("field", "value", "status", "action", "evidence"), [
    ("ecc.errors.uncorrected.volatile.total", "1", U, Action.REBOOT, "since the last reset"),
    ("ecc.errors.uncorrected.aggregate.total", "3", U, Action.REPLACE, "no reboot clears them"),
    ("retired_pages.pending", "Yes", U, Action.REBOOT, "retired_pages.pending=Yes (a page retirement waits"),
    ("retired_pages.dbe", "2", U, Action.REPLACE, "retired_pages.dbe=2 (pages retired for double-bit"),
    ("retired_pages.sbe", "61", D, Action.NONE, "retired_pages.sbe=61 (over 60 single-bit"),
    ("retired_pages.sbe", "60", H, Action.NONE, "8 GPUs"),
    ("ecc.mode.current", "Disabled", D, Action.NONE, "ecc.mode.current=Disabled"),
    ("clocks_event_reasons.hw_slowdown", "Active", D, Action.NONE, "hw_slowdown=Active"),
    ("ecc.errors.uncorrected.volatile.total", "[N/A]", H, Action.NONE, "8 GPUs"),
    ("ecc.errors.uncorrected.volatile.total", "[Not Supported]", H, Action.NONE, "8 GPUs"),
    ("retired_pages.dbe", "N/A", H, Action.NONE, "8 GPUs"),
])
def test_nvidia_smi_rules(field: str, value: str, status: Status, action: Action, evidence: str) -> None:
    f = only(nvidia.check_nvidia_smi(set_cell(healthy_smi(), 4, field, value), expected_gpus=8))
    assert (f.status, f.action) == (status, action), f
    assert evidence in f.evidence
    if status is not H:
        assert f.evidence.startswith("GPU 4 (00000000:97:00.0): ")


def test_nvidia_smi_forms_without_header_units_or_new_field_names() -> None:
    lines = fixture(SMI).splitlines()
    noheader = "\n".join(lines[1:])
    assert [(f.status, f.action) for f in nvidia.check_nvidia_smi(noheader, expected_gpus=8)] == [
        (U, Action.REPLACE), (D, Action.NONE)]
    nounits = fixture(SMI).replace("power.draw [W]", "power.draw").replace(" W,", ",")
    assert verdict(nvidia.check_nvidia_smi(nounits)).action is Action.REPLACE
    old_driver = healthy_smi().replace("clocks_event_reasons", "clocks_throttle_reasons")
    old_driver = set_cell(old_driver, 1, "clocks_throttle_reasons.hw_slowdown", "Active")
    f = only(nvidia.check_nvidia_smi(old_driver))
    assert f.status is D and "GPU 1 " in f.evidence
    # a query of only some fields, in another order
    some = "pci.bus_id, retired_pages.pending, index\n00000000:53:00.0, Yes, 0\n00000000:64:00.0, No, 1"
    f = only(nvidia.check_nvidia_smi(some, expected_gpus=2))
    assert (f.status, f.action) == (U, Action.REBOOT) and f.evidence.startswith("GPU 0 (00000000:53:00.0)")


def test_nvidia_smi_driver_and_lost_gpus() -> None:
    text = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
            "latest NVIDIA driver is installed and running.")
    f = only(nvidia.check_nvidia_smi(text, expected_gpus=8))
    assert (f.status, f.action) == (U, Action.REBOOT) and "NVIDIA driver is not usable" in f.evidence
    rows = healthy_smi().splitlines()
    lost = "\n".join([*rows[:5], *rows[6:],
                      "Unable to determine the device handle for GPU0000:97:00.0: Unknown Error"])
    findings = nvidia.check_nvidia_smi(lost, expected_gpus=8)
    assert [(f.status, f.action) for f in findings] == [(U, Action.REBOOT), (U, Action.REPLACE)]
    assert "a GPU is lost: Unable to determine the device handle for GPU0000:97:00.0" in findings[0].evidence
    assert findings[1].evidence.startswith("7 of 8 GPUs present")
    cell = only(nvidia.check_nvidia_smi(set_cell(healthy_smi(), 2, "ecc.mode.current", "[GPU is lost]")))
    assert (cell.status, cell.action) == (U, Action.REBOOT) and "GPU 2" in cell.evidence


def _truncated_smi() -> str:
    text = fixture(SMI)
    return text[:text.index("00000000:B9:00.0") + 5]


@pytest.mark.parametrize(("text", "why"), [
    ("", "nvidia-smi printed nothing"),
    ("   \n\n", "nvidia-smi printed nothing"),
    ("Segmentation fault", "not nvidia-smi CSV output: 'Segmentation fault'"),
    ("<html><body>502 Bad Gateway</body></html>", "not nvidia-smi CSV output"),
    ("index, name, pci.bus_id, serial, uuid, ecc.mode.current", "a CSV header but no GPU rows (truncated?)"),
    ("__TRUNC__", "row 7 has 3 values, the header 15 (truncated?)"),
    ("0, 1, 2", "CSV without a header has 3 columns, the query has 15"),
    ("name, memory.total [MiB]\nNVIDIA H100, 81559 MiB", "the query has no health field"),
    ("index, ecc.errors.uncorrected.volatile.total\n0, many", "GPU 0: ecc.errors.uncorrected.volatile.total="
                                                              "'many' is not a count"),
    ("index, retired_pages.pending\n0, maybe", "retired_pages.pending='maybe' is neither Yes nor No"),
    ("index, index\n0, 0", "names a column twice"),
])
def test_nvidia_smi_garbage_is_unknown(text: str, why: str) -> None:
    assert_failed(nvidia.check_nvidia_smi(_truncated_smi() if text == "__TRUNC__" else text), why)


# --------------------------------------------------------------------------------------------
# nvidia-smi --query-remapped-rows

def test_remapped_rows_fixture() -> None:
    findings = nvidia.check_remapped_rows(fixture(ROWS))
    assert [(f.status, f.action) for f in findings] == [(U, Action.REBOOT), (U, Action.REBOOT),
                                                        (U, Action.REPLACE)]
    assert [f.evidence.split(":")[0] for f in findings] == ["GPU 00000000", "GPU 00000000", "GPU 00000000"]
    assert findings[0].evidence == "GPU 00000000:75:00.0: remapped_rows.pending=Yes (a row remap waits for a reset)"
    assert findings[1].evidence.startswith("GPU 00000000:86:00.0: remapped_rows.pending=Yes")
    assert findings[2].evidence == ("GPU 00000000:B9:00.0: remapped_rows.failure=Yes (row remapping failed: "
                                    "replace the GPU)")
    assert verdict(findings).action is Action.REPLACE


def test_remapped_rows_healthy_and_unsupported() -> None:
    f = only(nvidia.check_remapped_rows(healthy_rows()))
    assert f.status is H
    assert f.evidence == ("8 GPUs: no row remap pending, no remapping failure; recorded: GPU 00000000:75:00.0 "
                          "remapped_rows.correctable=1, GPU 00000000:86:00.0 remapped_rows.uncorrectable=2")
    na = "gpu_bus_id, remapped_rows.correctable, remapped_rows.uncorrectable, remapped_rows.pending, " \
         "remapped_rows.failure\n00000000:53:00.0, [N/A], [N/A], [N/A], [N/A]"
    assert "not supported on 1 GPUs" in only(nvidia.check_remapped_rows(na)).evidence
    assert only(nvidia.check_remapped_rows("Remapped rows: Not Supported")).status is H
    noheader = "\n".join(fixture(ROWS).splitlines()[1:])
    assert verdict(nvidia.check_remapped_rows(noheader)).action is Action.REPLACE


@pytest.mark.parametrize(("text", "why"), [
    ("", "nvidia-smi printed nothing"),
    ("garbage", "not nvidia-smi CSV output"),
    ("gpu_bus_id, remapped_rows.correctable, remapped_rows.uncorrectable, remapped_rows.pending, "
     "remapped_rows.failure", "a CSV header but no GPU rows"),
    ("gpu_bus_id, remapped_rows.correctable, remapped_rows.uncorrectable, remapped_rows.pending, "
     "remapped_rows.failure\n00000000:53:00.0, 0, 0, No", "row 1 has 4 values, the header 5 (truncated?)"),
    ("gpu_bus_id, temperature.gpu\n00000000:53:00.0, 34", "no remapped_rows.pending/failure column"),
    ("No devices were found", "nvidia-smi: No devices were found"),
    ("gpu_bus_id, remapped_rows.pending, remapped_rows.failure\n00000000:53:00.0, Yes?, No",
     "remapped_rows.pending='Yes?' is neither Yes nor No"),
])
def test_remapped_rows_garbage_is_unknown(text: str, why: str) -> None:
    assert_failed(nvidia.check_remapped_rows(text), why)


# --------------------------------------------------------------------------------------------
# Xid

def test_xid_verbatim_fixture() -> None:
    findings = nvidia.classify_xids(fixture(XID))
    assert [(f.status, f.action) for f in findings] == [(D, Action.REBOOT), (U, Action.REBOOT), (U, Action.REBOOT)]
    assert findings[0].evidence.startswith("Xid 63 on PCI:0000:10:1c: ECC page retirement or row remap recorded")
    assert findings[1].evidence == ("Xid 79 on PCI:0000:2b:00: GPU has fallen off the bus (again after a reboot: "
                                    "replace): GPU has fallen off the bus.")
    assert findings[2].evidence.startswith("Xid 71 on PCI:0000:b9:00: NVLink fatal error: NVLink: fatal error "
                                           "detected on link 6")
    v = verdict(findings)
    assert (v.status, v.action) == (U, Action.REBOOT)


def test_xid_more_fixture() -> None:
    got = [(f.evidence.split(":")[0], f.status, f.action) for f in nvidia.classify_xids(fixture(XID_MORE))]
    assert got == [("Xid 48 on PCI", U, Action.REBOOT), ("Xid 94 on PCI", D, Action.RESTART),
                   ("Xid 95 on PCI", U, Action.REBOOT), ("Xid 64 on PCI", U, Action.REBOOT),
                   ("Xid 74 on PCI", U, Action.REBOOT), ("Xid 13 on PCI", D, Action.RESTART)]
    evidence = [f.evidence for f in nvidia.classify_xids(fixture(XID_MORE))]
    assert "Xid 48 on PCI:0000:86:00: double-bit (uncorrectable) ECC error: An uncorrectable double bit" in evidence[0]
    assert evidence[5].endswith("Graphics Exception: ESR 0x504648=0x102000e 0x504650=0x0")  # pid=, name= dropped


def test_xid_inside_a_health_agent_event_and_other_logs() -> None:
    f = only(nvidia.classify_xids(fixture(HYPERPOD)))
    assert (f.status, f.action) == (U, Action.REBOOT)
    assert f.evidence.endswith("NVLink: fatal error detected on link 6(0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0)")
    f = only(nvidia.classify_xids(fixture(NEURON_DMESG)))
    assert (f.status, f.evidence) == (H, "no NVIDIA Xid in 6 kernel log lines")
    # an NVSwitch SXid is not a GPU Xid
    assert only(nvidia.classify_xids("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal")).status is H


def _xid_line(code: int, text: str = "pid=22910, name=python3, detail", pci: str = "PCI:0000:53:00") -> str:
    return f"[Tue Mar  3 10:12:01 2026] NVRM: Xid ({pci}): {code}, {text}"


@pytest.mark.parametrize(("code", "status", "action"), [
    # drain: the node needs a reboot (GPU reset) or new hardware
    (48, U, Action.REBOOT), (64, U, Action.REBOOT), (71, U, Action.REBOOT), (74, U, Action.REBOOT),
    (79, U, Action.REBOOT), (95, U, Action.REBOOT), (109, U, Action.REBOOT), (119, U, Action.REBOOT),
    (120, U, Action.REBOOT), (143, U, Action.REBOOT), (151, U, Action.REBOOT), (54, U, Action.REPLACE),
    # application faults: restart the job, never a drain
    (13, D, Action.RESTART), (31, D, Action.RESTART), (43, D, Action.RESTART), (45, D, Action.RESTART),
    (94, D, Action.RESTART),
    # watch only
    (63, D, Action.REBOOT), (92, D, Action.NONE), (999, D, Action.NONE),
])
def test_xid_table(code: int, status: Status, action: Action) -> None:
    f = only(nvidia.classify_xids(_xid_line(code)))
    assert (f.status, f.action) == (status, action), f
    assert f.evidence.startswith(f"Xid {code} on PCI:0000:53:00") and f.evidence.endswith(": detail")
    drains = verdict([f]).status is U
    assert drains == (status is U)
    if code == 999:
        assert "not in the table" in f.evidence


def test_app_faults_never_drain() -> None:
    log = "\n".join(_xid_line(c) for c in (13, 31, 43, 13, 31, 13))
    v = verdict(nvidia.classify_xids(log))
    assert (v.status, v.action) == (D, Action.NONE)
    assert all(f.action is Action.RESTART for f in v.findings)
    assert "Xid 13 on PCI:0000:53:00 (x3)" in v.findings[0].evidence


def test_xid_table_is_consistent() -> None:
    for code, rule in nvidia.XID_ACTIONS.items():
        if rule.status is U:
            assert rule.action in (Action.REBOOT, Action.REPLACE), code
        else:
            assert rule.status is D, code
        if rule.action is Action.RESTART:
            assert rule.status is D, code
    for code in (13, 31, 43, 94):
        assert nvidia.XID_ACTIONS[code].action is Action.RESTART


def test_xid_per_gpu_and_154() -> None:
    log = "\n".join([_xid_line(79, "GPU has fallen off the bus.", "PCI:0000:2b:00"),
                     _xid_line(79, "GPU has fallen off the bus.", "PCI:0000:3c:00")])
    assert [f.evidence.split(":", 3)[:3] for f in nvidia.classify_xids(log)] == [
        ["Xid 79 on PCI", "0000", "2b"], ["Xid 79 on PCI", "0000", "3c"]]
    reboot = _xid_line(154, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)")
    reset = _xid_line(154, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)")
    cleared = _xid_line(154, "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)")
    assert [(f.status, f.action) for f in nvidia.classify_xids(reboot)] == [(U, Action.REBOOT)]
    assert "node reboot required" in nvidia.classify_xids(reboot)[0].evidence
    assert [(f.status, f.action) for f in nvidia.classify_xids(reset)] == [(U, Action.REBOOT)]
    assert [(f.status, f.action) for f in nvidia.classify_xids(cleared)] == [(D, Action.NONE)]


@pytest.mark.parametrize(("text", "why"), [
    ("", "the kernel log is empty"),
    ("\n \n", "the kernel log is empty"),
    ("\x00\x01\x02NVRM", "binary data"),
    ("[  1.0] NVRM: Xid (PCI:0000:2b:00): ", "an Xid line without a code (truncated?)"),
    ("[  1.0] NVRM: Xid (PCI:0000:2b", "an Xid line without a code (truncated?)"),
])
def test_xid_garbage_is_unknown(text: str, why: str) -> None:
    assert_failed(nvidia.classify_xids(text), why)


def test_xid_truncated_line_next_to_real_ones() -> None:
    findings = nvidia.classify_xids(fixture(XID) + "\nNVRM: Xid (PCI:0000:2b:00): ")
    assert findings[-1].status is Status.UNKNOWN and verdict(findings).status is U


def test_unrelated_text_has_no_xid() -> None:
    f = only(nvidia.classify_xids("the quick brown fox\nkernel: eth0 link up\n"))
    assert (f.status, f.evidence) == (H, "no NVIDIA Xid in 2 kernel log lines")


# --------------------------------------------------------------------------------------------
# dcgmi diag

def _row(name: str, info: str) -> str:
    return f"| {name:<25} | {info:<46} |"


def _wrapped(name: str, message: str) -> list[str]:
    """A message as dcgmi prints it: 45 characters a row, the name on the first only."""
    chunks = [message[i:i + 45] for i in range(0, len(message), 45)]
    return [_row(name if i == 0 else "", c) for i, c in enumerate(chunks)]


def _dcgm4_memory(test_status: str, gpu3: str, message: str | None) -> str:
    """The 4.x fixture with the memory test's row, GPU3's row and a message for GPU3 replaced."""
    lines = fixture(DCGM4).splitlines()
    at = lines.index(_row("memory", "Pass"))
    lines[at] = _row("memory", test_status)
    gpu3_at = lines.index(_row("", "GPU3: Pass"), at)
    lines[gpu3_at] = _row("", f"GPU3: {gpu3}")
    if message:
        lines[gpu3_at + 1:gpu3_at + 1] = _wrapped("Warning: GPU3", message)
    return "\n".join(lines)


def test_dcgmi_3x_fixture() -> None:
    f = only(nvidia.check_dcgmi_diag(fixture(DCGM3)))
    assert (f.status, f.action) == (U, Action.REPLACE)
    assert f.evidence == ("GPU Memory (Hardware): Fail on GPU 0: GPU 0 Thermal violations totaling 13.3 seconds "
                          "started at 9.7 seconds into the test for GPU 0 Verify that the cooling on this "
                          "machine i")
    only(nvidia.check_dcgmi_diag(fixture(DCGM3), 226))


def test_dcgmi_4x_fixture() -> None:
    f = only(nvidia.check_dcgmi_diag(fixture(DCGM4), 0))
    assert (f.status, f.action) == (H, Action.NONE)
    assert f.evidence == "4 tests passed on 8 GPUs (DCGM 4.2.3): software, memory, pcie, memory_bandwidth"


def test_dcgmi_json_fixture() -> None:
    f = only(nvidia.check_dcgmi_diag(fixture(DCGM_JSON)))
    # a pending row remap is cleared by a reset: reboot, not replace
    assert (f.status, f.action) == (U, Action.REBOOT)
    assert f.evidence == ("memory (Hardware): Fail on GPU 0: GPU 0 has uncorrectable memory errors and row "
                          "remappings are pending")
    f = only(nvidia.check_dcgmi_diag(fixture(DCGM_JSON), 205))
    assert (f.status, f.action) == (U, Action.REPLACE)  # ISOLATE


def test_dcgmi_4x_failure_warning_and_wrapping() -> None:
    message = "GPU 3 memory test found 12 bad words at bank 7 and at bank 9, rerun then RMA"
    assert message[44] == " "  # the first cut falls on a space: it must survive
    f = only(nvidia.check_dcgmi_diag(_dcgm4_memory("Fail", "Fail", message), 226))
    assert (f.status, f.action) == (U, Action.REPLACE)
    assert f.evidence == f"memory (Hardware): Fail on GPU 3: {message}"
    # 4.x prints a warned entity as "Fail" under a "Warn" test row
    f = only(nvidia.check_dcgmi_diag(_dcgm4_memory("Warn", "Fail", "GPU 3 ran hot: 91 C"), 0))
    assert (f.status, f.action) == (D, Action.NONE)
    assert f.evidence == "memory (Hardware): Warn on GPU 3: GPU 3 ran hot: 91 C"
    # a Deployment (software) failure: reboot, not replace
    text = fixture(DCGM4).replace(_row("software", "Pass"), _row("software", "Fail"))
    text = text.replace(_row("", "GPU1: Pass"), _row("", "GPU1: Fail"), 1)
    f = only(nvidia.check_dcgmi_diag(text, 226))
    assert (f.status, f.action) == (U, Action.REBOOT) and f.evidence == "software (Deployment): Fail on GPU 1"


def test_dcgmi_3x_json_and_text_forms() -> None:
    doc = {"DCGM GPU Diagnostic": {"version": "3.3.7", "test_categories": [
        {"category": "Deployment", "tests": [
            {"name": "Persistence Mode", "results": [{"status": "Fail", "warnings": [
                {"warnings": "Persistence mode for GPU 0 is disabled", "error_id": 20}]}]}]},
        {"category": "Hardware", "tests": [
            {"name": "GPU Memory", "results": [{"gpu_id": "0", "status": "Pass"}, {"gpu_id": "1", "status": "Pass"}]}]},
    ]}}
    f = only(nvidia.check_dcgmi_diag(json.dumps(doc), 226))
    assert (f.status, f.action) == (U, Action.REBOOT)
    assert f.evidence == "Persistence Mode (Deployment): Fail: Persistence mode for GPU 0 is disabled"
    doc["DCGM GPU Diagnostic"]["test_categories"].pop(0)  # type: ignore[index]
    f = only(nvidia.check_dcgmi_diag(json.dumps(doc), 0))
    assert f.status is H and f.evidence == "1 tests passed on 2 GPUs (DCGM 3.3.7): GPU Memory"
    lines = fixture(DCGM3).splitlines()
    warn = "\n".join(lines).replace(_row("", "Fail - GPU: 0"), _row("", "Warn - GPU: 0"))
    assert only(nvidia.check_dcgmi_diag(warn)).status is D
    all_fail = "\n".join(lines).replace(_row("PCIe", "Pass - All"), _row("PCIe", "Fail - All"))
    got = [(f.evidence.split(":")[0], f.action) for f in nvidia.check_dcgmi_diag(all_fail)]
    assert got == [("PCIe (Integration)", Action.REPLACE), ("GPU Memory (Hardware)", Action.REPLACE)]


def test_dcgmi_exit_codes() -> None:
    f = only(nvidia.check_dcgmi_diag(fixture(DCGM4), 205))
    assert (f.status, f.action) == (U, Action.REPLACE) and "exited 205 (DCGM_ST_NVVS_ISOLATE_ERROR" in f.evidence
    assert_failed(nvidia.check_dcgmi_diag(fixture(DCGM4), 226), "dcgmi exited 226 (DCGM_ST_NVVS_ERROR")
    assert_failed(nvidia.check_dcgmi_diag("Error: unable to establish a connection to the specified host: "
                                          "localhost\n", 235),
                  "no dcgmi diag table: 'Error: unable to establish a connection to the specified host: "
                  "localhost' (exit 235 (DCGM_ST_CONNECTION_NOT_VALID")
    f = only(nvidia.check_dcgmi_diag("Error: the diagnostic failed\n", 205))
    assert (f.status, f.action) == (U, Action.REPLACE)
    assert_failed(nvidia.check_dcgmi_diag(json.dumps({"DCGM Diagnostic": {
        "version": "4.2.3", "runtime_error": "nvvs failed to start: no GPUs"}}), 226),
        "dcgmi could not run the diagnostic: nvvs failed to start: no GPUs")


def _dcgm_truncated() -> str:
    text = fixture(DCGM4)
    return text[:text.index("| pcie")]


@pytest.mark.parametrize(("text", "why"), [
    ("", "dcgmi printed nothing"),
    ("command not found", "no dcgmi diag table: 'command not found'"),
    ("Successfully ran diagnostic for group.\n", "no dcgmi diag table"),
    ("__TRUNC__", "not closed by its border (truncated?)"),
    ('{"DCGM Diagnostic": {"test_categories": [', "dcgmi JSON does not parse (truncated?)"),
    ('{"hello": "world"}', "not dcgmi diag JSON (no test_categories; top level: hello)"),
    ('{"DCGM Diagnostic": {"test_categories": []}}', "dcgmi JSON lists no test"),
    ('{"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": "memory", '
     '"results": [{"entity_id": 0, "status": "Maybe"}]}]}]}}', "memory: unknown status 'Maybe'"),
    ("__BADRESULT__", "test 'memory' has no result: 'Probably fine'"),
    ("__SKIPPED__", "no test ran (4 skipped or not run)"),
])
def test_dcgmi_garbage_is_unknown(text: str, why: str) -> None:
    text = {"__TRUNC__": _dcgm_truncated(),
            "__BADRESULT__": fixture(DCGM4).replace(_row("memory", "Pass"), _row("memory", "Probably fine")),
            "__SKIPPED__": "\n".join(_row(ln[2:27].strip(), "Skip") if ln.startswith("| ") and ln[2] != " "
                                     and "Version" not in ln and "Detected" not in ln and "Diagnostic" not in ln
                                     else ln.replace("Pass", "Skip") for ln in fixture(DCGM4).splitlines()),
            }.get(text, text)
    assert_failed(nvidia.check_dcgmi_diag(text, 0), why)


# --------------------------------------------------------------------------------------------
# nccl-tests

@pytest.mark.parametrize(("name", "kwargs", "status", "action", "evidence"), [
    (NCCL_FULL, {}, H, Action.NONE,
     "busbw 477.03/477.25 GB/s (out-of-place/in-place) at 8 GiB (largest of 5 sizes); no floor given"),
    (NCCL_FULL, {"min_busbw_gbps": 400}, H, Action.NONE, "at or over the floor 400.00 GB/s"),
    (NCCL_FULL, {"min_busbw_gbps": 500}, D, Action.NONE, "busbw 477.03/477.25 GB/s (out-of-place/in-place) "
                                                          "at 8 GiB (largest of 5 sizes): under the floor 500.00"),
    (NCCL_FULL, {"baseline_gbps": 600}, D, Action.NONE, "under the floor 480.00 GB/s"),
    (NCCL_FULL, {"baseline_gbps": 600, "tolerance": 0.75}, H, Action.NONE, "floor 450.00"),
    (NCCL_FULL, {"min_busbw_gbps": 300, "baseline_gbps": 600}, D, Action.NONE, "floor 480.00"),
    (NCCL_ROWS, {"min_busbw_gbps": 437}, H, Action.NONE, "busbw 487.09/487.26 GB/s (out-of-place/in-place) at "
                                                          "16 GiB (largest of 9 sizes)"),
    (NCCL_WRONG, {"min_busbw_gbps": 100}, U, Action.REPLACE,
     "#wrong=3 at 512 MiB out-of-place: all-reduce returned corrupt data"),
    (NCCL_ERROR, {}, U, Action.REBOOT, "all_reduce_perf failed: ip-10-1-2-3: Test NCCL failure common.cu:1005 "
                                       "'unhandled system error (run with NCCL_DEBUG=INFO for details) / '"),
])
def test_nccl_tests_fixtures(name: str, kwargs: dict[str, float], status: Status, action: Action,
                             evidence: str) -> None:
    f = only(nvidia.check_nccl_tests(fixture(name), **kwargs))
    assert (f.status, f.action) == (status, action), f
    assert evidence in f.evidence, f.evidence


def _avg_busbw(text: str) -> float:
    values = [float(t.split()[i]) for t in text.splitlines() if t.strip() and t.split()[0].isdigit()
              for i in (7, 11)]
    return sum(values) / len(values)


def test_nccl_tests_judges_the_largest_size_not_the_average() -> None:
    rows = fixture(NCCL_ROWS)
    assert _avg_busbw(rows) < 250  # small sizes drag the average far below the 487 GB/s at 16 GiB
    f = only(nvidia.check_nccl_tests(rows + "\n# Avg bus bandwidth    : 200.5 \n", min_busbw_gbps=400))
    assert f.status is H and "487.09/487.26" in f.evidence

    # the other way round: a high average, a slow largest size, the rows out of order
    lines = fixture(NCCL_FULL).splitlines()
    big = next(i for i, ln in enumerate(lines) if ln.strip().startswith("8589934592"))
    lines[big] = lines[big].replace("477.03", "120.00").replace("477.25", "130.00")
    lines.insert(big - 2, lines.pop(big))  # the largest size is no longer the last row
    text = "\n".join(lines).replace("275.635", "612.000")
    f = only(nvidia.check_nccl_tests(text, min_busbw_gbps=400))
    assert f.status is D, f
    assert f.evidence.startswith("busbw 120.00/130.00 GB/s (out-of-place/in-place) at 8 GiB")
    # the lower column decides
    one_slow = fixture(NCCL_FULL).replace("477.25", "390.00")
    assert only(nvidia.check_nccl_tests(one_slow, min_busbw_gbps=400)).status is D


def test_nccl_tests_prefixes_validation_off_and_out_of_bounds() -> None:
    srun = "\n".join(f"0: {ln}" for ln in fixture(NCCL_FULL).splitlines())
    assert only(nvidia.check_nccl_tests(srun, min_busbw_gbps=400)).evidence.startswith("busbw 477.03/477.25")
    mpi = "\n".join(f"[1,0]<stdout>:{ln}" for ln in fixture(NCCL_ROWS).splitlines())
    assert "487.09/487.26" in only(nvidia.check_nccl_tests(mpi)).evidence
    lines = fixture(NCCL_ROWS).splitlines()
    no_check = [" ".join("N/A" if i in (8, 12) else t for i, t in enumerate(ln.split())) for ln in lines[2:]]
    unchecked = "\n".join(lines[:2] + no_check)
    f = only(nvidia.check_nccl_tests(unchecked))
    assert f.status is H and "results not validated (-c 0)" in f.evidence
    oob = fixture(NCCL_FULL).replace("# Out of bounds values : 0 OK", "# Out of bounds values : 2 FAILED")
    f = only(nvidia.check_nccl_tests(oob))
    assert (f.status, f.action) == (U, Action.REPLACE) and "Out of bounds values : 2 FAILED" in f.evidence
    cuda = "ip-10-1-2-3: Test CUDA failure common.cu:892 'out of memory'\n .. ip-10-1-2-3 pid 1: Test failure x"
    assert "Test CUDA failure common.cu:892 'out of memory'" in only(nvidia.check_nccl_tests(cuda)).evidence


def _nccl_cut_mid_row() -> str:
    text = fixture(NCCL_FULL)
    return text[:text.index("  8589934592") + 40]


def _nccl_cut_before_largest() -> str:
    text = fixture(NCCL_FULL)
    return text[:text.index("  8589934592")]


@pytest.mark.parametrize(("text", "why"), [
    ("", "all_reduce_perf printed nothing"),
    ("hello\nworld", "no all_reduce_perf table (a '# size count ... busbw' header): 'hello'"),
    ("size(B)  count(elems)  type  time(us)  algbw(GB/s)  busbw(GB/s)\n33554432 8388608 uint8 824 40.69 40.69",
     "no all_reduce_perf table"),  # nccom-test (Neuron) output is not nccl-tests output
    ("__HEADER_ONLY__", "an all_reduce_perf table header but no rows (cut?)"),
    ("__CUT_ROW__", "columns, the header 13 (cut?): '8589934592 2147483648"),
    ("__CUT_SWEEP__", "the run started but never concluded (output cut?)"),
    ("__NO_FOOTER_MAXBYTES__", "the sweep stops at 512 MiB of maxBytes 8 GiB (output cut?)"),
    ("#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong\n"
     "8 2 float sum -1 18.6 0.00 fast 0 18.3 0.00 0.00 0", "a busbw value is not a number"),
    ("#  size count type redop root time algbw busbw #wrong time algbw busbw #wrong\n"
     "8 2 float sum -1 18.6 0.00 0.00 x 18.3 0.00 0.00 0", "a #wrong value is not a count"),
])
def test_nccl_tests_garbage_is_unknown(text: str, why: str) -> None:
    header = "\n".join(fixture(NCCL_ROWS).splitlines()[:2])
    no_footer = _nccl_cut_before_largest().replace("# Collective test starting: all_reduce_perf\n", "")
    text = {"__HEADER_ONLY__": header, "__CUT_ROW__": _nccl_cut_mid_row(),
            "__CUT_SWEEP__": _nccl_cut_before_largest(), "__NO_FOOTER_MAXBYTES__": no_footer}.get(text, text)
    assert_failed(nvidia.check_nccl_tests(text, min_busbw_gbps=1), why)


# --------------------------------------------------------------------------------------------
# health.allreduce: the pure parts (the real ranks run in tests/integration/)

def test_bus_bandwidth_follows_nccl_tests() -> None:
    assert allreduce.algorithm_bandwidth(10**9, 1.0) == 1.0
    assert allreduce.bus_bandwidth(10**9, 1.0, 2) == 1.0  # 2 * (2 - 1) / 2
    assert allreduce.bus_bandwidth(10**9, 0.5, 8) == pytest.approx(3.5)  # 2 GB/s * 14 / 8
    assert allreduce.bus_bandwidth(10**9, 1.0, 1) == 0.0  # one rank moves nothing
    # nccl-tests' own row: 8 GiB in 31512 us on 8 GPUs -> algbw 272.59, busbw 477.03
    assert allreduce.algorithm_bandwidth(8589934592, 31512e-6) == pytest.approx(272.59, abs=0.01)
    assert allreduce.bus_bandwidth(8589934592, 31512e-6, 8) == pytest.approx(477.03, abs=0.01)
    for bad in ((10, 0.0, 2), (10, -1.0, 2), (-1, 1.0, 2), (10, 1.0, 0), (10, float("nan"), 2)):
        with pytest.raises(ValueError):
            allreduce.bus_bandwidth(*bad)


def test_parse_size() -> None:
    assert [allreduce.parse_size(s) for s in ("64K", "1M", "16m", "1G", "4096", "2MiB")] == [
        65536, 1 << 20, 16 << 20, 1 << 30, 4096, 2 << 20]
    for bad in ("", "1T", "-1M", "2", "lots"):
        with pytest.raises(ValueError):
            allreduce.parse_size(bad)


def report(*rows: tuple[int, float], world: int = 8, wrong: int = 0, largest: float | None = None) -> str:
    results = [{"bytes": n, "time_us": 100.0, "algbw_gbps": 0.0, "busbw_gbps": busbw, "wrong": wrong}
               for n, busbw in rows]
    at_largest = max(rows)[1] if largest is None else largest
    return json.dumps({"probe": "allreduce", "backend": "nccl", "world_size": world, "device": "cuda",
                       "results": results, "busbw_gbps_at_largest": at_largest})


def test_check_allreduce() -> None:
    text = report((1 << 20, 60.0), (1 << 30, 470.0))
    f = only(allreduce.check_allreduce(text, min_busbw_gbps=400))
    assert (f.probe, f.status) == ("allreduce", H)
    assert f.evidence == ("busbw 470.00 GB/s at 1 GiB (largest of 2 sizes; nccl, 8 ranks): at or over the floor "
                          "400.00 GB/s")
    assert only(allreduce.check_allreduce(text, baseline_gbps=600)).status is D  # floor 480
    assert only(allreduce.check_allreduce(text)).evidence.endswith("; no floor given")
    # the largest size decides, not the best one
    slow_largest = report((64 << 20, 480.0), (1 << 30, 150.0))
    f = only(allreduce.check_allreduce(slow_largest, min_busbw_gbps=400))
    assert f.status is D and f.evidence.startswith("busbw 150.00 GB/s at 1 GiB")
    f = only(allreduce.check_allreduce(report((1 << 20, 60.0), wrong=3)))
    assert (f.status, f.action) == (U, Action.REPLACE) and "3 wrong elements" in f.evidence
    noisy = "UserWarning: something\n" + text + "\n"
    assert only(allreduce.check_allreduce(noisy)).status is H


@pytest.mark.parametrize(("text", "why"), [
    ("", "the all-reduce probe printed nothing"),
    ("Traceback (most recent call last):", "no complete JSON object in the output (truncated?)"),
    ('{"probe": "allreduce", "backend": "gloo", "results": [', "no complete JSON object"),
    ('{"probe": "allreduce", "error": "RuntimeError: connection refused"}',
     "the all-reduce run failed: RuntimeError: connection refused"),
    ('{"probe": "allreduce", "backend": "gloo", "world_size": 2, "results": []}', "not an all-reduce report"),
    ("__WORLD1__", "world_size 1: a single rank moves nothing over a bus"),
    ("__MISMATCH__", "busbw_gbps_at_largest 60.0 is not the busbw at the largest size"),
    ('{"backend": "gloo", "world_size": 2, "results": [{"bytes": 1024}], "busbw_gbps_at_largest": 1}',
     "results[0] lacks bytes/time_us/busbw_gbps"),
    ('{"backend": "gloo", "world_size": 2, "results": [{"bytes": 1024, "time_us": 0, "busbw_gbps": 1}], '
     '"busbw_gbps_at_largest": 1}', "results[0] has a non-positive size or time"),
])
def test_check_allreduce_garbage_is_unknown(text: str, why: str) -> None:
    text = {"__WORLD1__": report((1 << 20, 0.0), world=1),
            "__MISMATCH__": report((1 << 20, 60.0), (1 << 30, 470.0), largest=60.0)}.get(text, text)
    assert_failed(allreduce.check_allreduce(text, min_busbw_gbps=1), why)


def test_the_probes_never_import_torch() -> None:
    code = "import sys, health.nvidia, health.allreduce; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def test_allreduce_without_a_launcher_says_so(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert allreduce.main(["--sizes", "64K", "--json"]) == 2
    assert "not set: run under torchrun" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# runners, with stand-in tools

def _smi(tools: Path, tmp_path: Path, gpu_csv: str, rows_csv: str, extra: str = "") -> Path:
    """A stand-in nvidia-smi that answers both queries and records its argv."""
    (tmp_path / "gpu.csv").write_text(gpu_csv)
    (tmp_path / "rows.csv").write_text(rows_csv)
    argv = tmp_path / "smi-argv"
    write_tool(tools, "nvidia-smi", f"echo \"$@\" >> '{argv}'\n{extra}"
                               f"case \"$1\" in --query-gpu=*) cat '{tmp_path / 'gpu.csv'}';; "
                               f"--query-remapped-rows=*) cat '{tmp_path / 'rows.csv'}';; *) exit 9;; esac")
    return argv


def test_run_all_with_stand_in_tools(tools: Path, tmp_path: Path) -> None:
    argv = _smi(tools, tmp_path, healthy_smi(), healthy_rows())
    findings = nvidia.run_all(expected_gpus=8, kernel_log="[ 1.0] kernel: eth0 up\n")
    assert [(f.probe, f.status) for f in findings] == [("nvidia-smi", H), ("remapped-rows", H), ("xid", H)]
    assert argv.read_text().splitlines() == [
        f"--query-gpu={','.join(nvidia.GPU_QUERY_FIELDS)} --format=csv",
        f"--query-remapped-rows={','.join(nvidia.REMAPPED_ROWS_FIELDS)} --format=csv"]
    header = tuple(c.strip().split(" [")[0] for c in fixture(SMI).splitlines()[0].split(","))
    assert header == nvidia.GPU_QUERY_FIELDS  # the documented query is the fixture's header

    _smi(tools, tmp_path, fixture(SMI), fixture(ROWS))
    v = verdict(nvidia.run_all(expected_gpus=8, kernel_log=fixture(XID)))
    assert (v.status, v.action) == (U, Action.REPLACE)
    reason = v.reason()
    assert reason.startswith("nvidia-smi: GPU 3 (00000000:86:00.0): ecc.errors.uncorrected.volatile.total=2")
    assert "remapped-rows: GPU 00000000:B9:00.0: remapped_rows.failure=Yes" in reason
    assert "xid: Xid 79 on PCI:0000:2b:00" in reason


def test_run_all_dcgmi_and_nccl_tests(tools: Path, tmp_path: Path) -> None:
    _smi(tools, tmp_path, healthy_smi(), healthy_rows())
    dcgmi_argv, nccl_argv = tmp_path / "dcgmi-argv", tmp_path / "nccl-argv"
    write_tool(tools, "dcgmi", f"echo \"$@\" > '{dcgmi_argv}'\ncat '{FIXTURES / DCGM_JSON}'\nexit 226")
    write_tool(tools, "all_reduce_perf", f"echo \"$@\" > '{nccl_argv}'\ncat '{FIXTURES / NCCL_FULL}'")
    findings = nvidia.run_all(expected_gpus=8, run_dcgmi=True, run_bandwidth=True, min_busbw_gbps=500)
    assert [(f.probe, f.status, f.action) for f in findings] == [
        ("nvidia-smi", H, Action.NONE), ("remapped-rows", H, Action.NONE),
        ("dcgmi-diag", U, Action.REBOOT), ("nccl-tests", D, Action.NONE)]
    assert dcgmi_argv.read_text().split() == ["diag", "-r", "1", "-j"]
    assert nccl_argv.read_text().split() == ["-b", "32M", "-e", "1G", "-f", "2", "-g", "8", "-w", "5", "-n", "20"]
    assert "under the floor 500.00" in findings[3].evidence

    write_tool(tools, "all_reduce_perf", f"cat '{FIXTURES / NCCL_FULL}'\nexit 3")
    assert_failed(nvidia.probe_nccl_tests(gpus=8), "exited 3 after a complete table")
    write_tool(tools, "all_reduce_perf", f"cat '{FIXTURES / NCCL_ERROR}'\nexit 3")
    assert only(nvidia.probe_nccl_tests(gpus=8)).status is U
    (tools / "all_reduce_perf").unlink()
    assert_failed(nvidia.probe_nccl_tests(gpus=8), "all_reduce_perf not installed (nccl-tests)")
    (tools / "dcgmi").unlink()
    assert_failed(nvidia.probe_dcgmi(2), "dcgmi not installed (DCGM)")
    write_tool(tools, "dcgmi", f"cat '{FIXTURES / DCGM4}'")
    assert only(nvidia.probe_dcgmi(2)).status is H
    write_tool(tools, "dcgmi", "exec sleep 30")
    assert_failed(nvidia.probe_dcgmi(1, timeout_s=0.5), "dcgmi timed out after 0.5 s")
    assert_failed(nvidia.probe_dcgmi(7), "no dcgmi diag level 7")


def test_nvidia_smi_runner_falls_back_to_the_old_field_name(tools: Path, tmp_path: Path) -> None:
    old = healthy_smi().replace("clocks_event_reasons", "clocks_throttle_reasons")
    argv = _smi(tools, tmp_path, old, healthy_rows(),
                extra='case "$1" in *clocks_event_reasons*) echo \'Field "clocks_event_reasons.hw_slowdown" '
                      'is not a valid field to query.\'; exit 2;; esac\n')
    findings = nvidia.probe_nvidia_smi(expected_gpus=8)
    assert [f.status for f in findings] == [H, H], findings
    calls = argv.read_text().splitlines()
    assert len(calls) == 3 and "clocks_throttle_reasons.hw_slowdown" in calls[1]


def test_nvidia_smi_runner_failures(tools: Path, tmp_path: Path) -> None:
    write_tool(tools, "nvidia-smi", "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                               "driver. Make sure that the latest NVIDIA driver is installed and running.\"\nexit 9")
    findings = nvidia.probe_nvidia_smi(expected_gpus=8)
    assert [(f.probe, f.status, f.action) for f in findings] == [("nvidia-smi", U, Action.REBOOT),
                                                                 ("remapped-rows", U, Action.REBOOT)]
    write_tool(tools, "nvidia-smi", f"cat '{tmp_path / 'gpu.csv'}'\necho 'nvidia-smi: internal error' >&2\nexit 15")
    (tmp_path / "gpu.csv").write_text(healthy_smi())
    assert_failed(nvidia.probe_nvidia_smi(expected_gpus=8)[:1], "nvidia-smi --query-gpu exited 15: nvidia-smi: "
                                                                "internal error")
    write_tool(tools, "nvidia-smi", "exec sleep 30")
    assert_failed(nvidia.probe_nvidia_smi(timeout_s=0.5)[:1], "nvidia-smi timed out after 0.5 s")


def test_without_nvidia_tools_run_all_says_no_nvidia_devices(tools: Path, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    findings = nvidia.run_all(expected_gpus=8, run_dcgmi=True, run_bandwidth=True, min_busbw_gbps=400)
    assert findings == [no_devices("nvidia-smi", "NVIDIA")]
    assert (findings[0].status, findings[0].evidence) == (H, "no NVIDIA devices found (nvidia-smi not installed)")
    assert verdict(findings).status is H
    assert nvidia.run_all(kernel_log=fixture(NEURON_DMESG)) == findings
    # a kernel that reports an Xid says there is a GPU after all
    with_xid = nvidia.run_all(kernel_log=fixture(XID))
    assert with_xid[0] == findings[0] and verdict(with_xid).status is U


@pytest.mark.parametrize("check", [
    lambda t: nvidia.check_nvidia_smi(t, expected_gpus=8), nvidia.check_remapped_rows, nvidia.classify_xids,
    nvidia.check_dcgmi_diag, nvidia.check_nccl_tests, allreduce.check_allreduce,
])
@pytest.mark.parametrize("text", ["", "\x00\xff", "{", "|", "# size count busbw", "0, 1", "+--+--+",
                                  "[1,0]<stdout>:", "null", "[]", '{"results": {}}', "9" * 5000])
def test_no_parser_raises_or_calls_garbage_healthy(check: Callable[[str], list[Finding]], text: str) -> None:
    findings = check(text)
    assert findings and all(isinstance(f, Finding) for f in findings)
    if check is not nvidia.classify_xids:  # a log without an Xid line is a healthy log
        assert verdict(findings).status is not H, findings
