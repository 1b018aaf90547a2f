"""The Neuron probes: each runs a tool (an argv list, a timeout, never a shell) and hands its
output to its parser."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence

from health.model import Finding, Status, excerpt, no_devices, probe_failed
from health.neuron.logs import classify_log
from health.neuron.ls import INSTANCE_TYPES, LsInfo, check_neuron_ls, parse_neuron_ls
from health.neuron.monitor import check_neuron_monitor, first_report
from health.neuron.nccom import check_nccom_test
from health.neuron.values import json_obj, json_str
from health.runner import ToolResult, find_tool, run_tool

_MAX_OUTPUT = 8 << 20  # bytes of neuron-monitor output read at most

NCCOM_TEST_ARGS = ("-b", "32MB", "-e", "256MB", "-f", "2", "-n", "5", "-w", "2", "-d", "fp32", "allr")

NCCOM_TEST_TIMEOUT_S = 50.0

NEURON_MONITOR_TIMEOUT_S = 15.0

NEURON_LS_TIMEOUT_S = 10.0



def _run_neuron_ls(timeout_s: float) -> ToolResult:
    """The first of the neuron-ls forms that exits 0 with output (see the module docstring)."""
    result = run_tool(["neuron-ls", "--output-format", "json"], timeout_s)
    if result.missing or not result.ran:
        return result
    for argv in (["neuron-ls", "--json-output"], ["neuron-ls"]):
        if result.returncode == 0 and result.stdout.strip():
            return result
        result = run_tool(argv, timeout_s)
        if not result.ran:
            return result
    return result


def _ls_findings(result: ToolResult, *, expected_devices: int | None, expected_cores: int | None,
                 instance_type: str | None) -> list[Finding]:
    if result.missing:
        return [no_devices("neuron-ls", "Neuron")]
    if not result.ran:
        return [probe_failed("neuron-ls", result.why)]
    if result.returncode != 0:
        return [probe_failed("neuron-ls", f"{' '.join(result.argv)} exited {result.returncode}: "
                                          f"{excerpt(result.stderr or result.stdout) or 'no output'}")]
    return check_neuron_ls(result.stdout, expected_devices=expected_devices, expected_cores=expected_cores,
                           instance_type=instance_type)


def probe_neuron_ls(*, expected_devices: int | None = None, expected_cores: int | None = None,
                    instance_type: str | None = None,
                    timeout_s: float = NEURON_LS_TIMEOUT_S) -> list[Finding]:
    return _ls_findings(_run_neuron_ls(timeout_s), expected_devices=expected_devices,
                        expected_cores=expected_cores, instance_type=instance_type)


def read_first_report(argv: Sequence[str], timeout_s: float) -> ToolResult:
    """Run a tool that streams JSON reports forever (neuron-monitor): read its stdout until
    the first complete JSON object or ``timeout_s``, then kill it. Never a shell; the
    returned ``stdout`` is what was read. ``ran`` is True when a report came, or the tool
    exited by itself."""
    path = find_tool(argv[0])
    if path is None:
        return ToolResult(tuple(argv), True, False, None, "", "", f"{argv[0]} not installed")
    try:
        proc = subprocess.Popen([path, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        return ToolResult(tuple(argv), False, False, None, "", "", f"cannot run {argv[0]}: {e}")
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout_s
    got_report, open_streams = False, 2
    assert proc.stdout is not None and proc.stderr is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while open_streams and not got_report and len(out) < _MAX_OUTPUT:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                key.data.extend(chunk)
                if key.data is out and b"}" in chunk:
                    got_report = not isinstance(first_report(out.decode(errors="replace")), str)
    exited = proc.poll() is not None
    if not exited:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        returncode = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        returncode = None
    proc.stdout.close()
    proc.stderr.close()
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if got_report or exited or open_streams == 0:
        return ToolResult(tuple(argv), False, True, returncode if exited else None, stdout, stderr, "")
    why = (f"{argv[0]} printed {len(out)} bytes without a complete report" if len(out) >= _MAX_OUTPUT
           else f"{argv[0]} printed no complete report in {timeout_s:g} s")
    return ToolResult(tuple(argv), False, False, None, stdout, stderr, why)


def probe_neuron_monitor(*, expected_devices: int | None = None,
                         timeout_s: float = NEURON_MONITOR_TIMEOUT_S) -> list[Finding]:
    return _monitor_findings(read_first_report(["neuron-monitor"], timeout_s), expected_devices)


def _monitor_findings(result: ToolResult, expected_devices: int | None) -> list[Finding]:
    if result.missing:  # neuron-ls decides whether there are devices; this one just cannot look
        return [probe_failed("neuron-monitor", "neuron-monitor not installed (aws-neuronx-tools)")]
    if not result.ran:
        return [probe_failed("neuron-monitor", result.why)]
    findings = check_neuron_monitor(result.stdout, expected_devices=expected_devices)
    if findings[0].status is Status.UNKNOWN and result.stderr.strip():
        why = findings[0].evidence.removeprefix("unknown: probe failed: ")
        return [probe_failed("neuron-monitor", f"{why}; stderr: {excerpt(result.stderr)}")]
    return findings


def probe_nccom_test(*, nworkers: int = 2, min_busbw_gbps: float | None = None,
                     baseline_gbps: float | None = None, tolerance: float = 0.8,
                     timeout_s: float = NCCOM_TEST_TIMEOUT_S) -> list[Finding]:
    result = run_tool(["nccom-test", "-r", str(nworkers), *NCCOM_TEST_ARGS], timeout_s)
    if result.missing:
        return [probe_failed("nccom-test", "nccom-test not installed (aws-neuronx-tools)")]
    if not result.ran:
        return [probe_failed("nccom-test", result.why)]
    findings = check_nccom_test(result.stdout + ("\n" + result.stderr if result.returncode else ""),
                                min_busbw_gbps=min_busbw_gbps, baseline_gbps=baseline_gbps,
                                tolerance=tolerance)
    if result.returncode != 0 and findings[0].status in (Status.HEALTHY, Status.DEGRADED):
        return [probe_failed("nccom-test", f"exited {result.returncode} after a complete table: "
                                           f"{excerpt(result.stderr) or findings[0].evidence}")]
    return findings


def run_all(*, expected_devices: int | None = None, instance_type: str | None = None,
            min_busbw_gbps: float | None = None, run_bandwidth: bool = False,
            kernel_log: str | None = None) -> list[Finding]:
    """Every Neuron probe on this node: neuron-ls, neuron-monitor, nccom-test (``run_bandwidth``)
    and the kernel log (``kernel_log``, the text of a dmesg dump). The instance type, when not
    given, is the one neuron-monitor reports (EC2 metadata).

    Without neuron-ls (a GPU or CPU node) one finding says no Neuron devices were found; only
    ``NEURON_HW_ERR`` kernel lines, if any, are added to it (the kernel saying there is a
    Neuron device after all)."""
    if find_tool("neuron-ls") is None:
        findings = [no_devices("neuron-ls", "Neuron")]
        hw_err = [ln for ln in (kernel_log or "").splitlines() if "NEURON_HW_ERR=" in ln]
        if hw_err:
            findings += classify_log("\n".join(hw_err))
        return findings
    ls = _run_neuron_ls(NEURON_LS_TIMEOUT_S)
    monitor = read_first_report(["neuron-monitor"], NEURON_MONITOR_TIMEOUT_S)
    if instance_type is None and monitor.ran:  # EC2 metadata, as neuron-monitor reports it
        report = first_report(monitor.stdout)
        info = {} if isinstance(report, str) else json_obj(report.get("instance_info"))
        instance_type = None if json_str(info.get("error")) else json_str(info.get("instance_type")) or None
    findings = _ls_findings(ls, expected_devices=expected_devices, expected_cores=None,
                            instance_type=instance_type)
    known = INSTANCE_TYPES.get(instance_type) if instance_type else None
    expected = expected_devices if expected_devices is not None else (known[0] if known else None)
    findings += _monitor_findings(monitor, expected)
    if run_bandwidth:
        parsed = parse_neuron_ls(ls.stdout) if ls.ran else "neuron-ls did not run"
        cores = sum(parsed.cores_by_device.values()) if isinstance(parsed, LsInfo) else 0
        findings += probe_nccom_test(nworkers=max(cores, 2), min_busbw_gbps=min_busbw_gbps)
    if kernel_log is not None:
        findings += classify_log(kernel_log)
    return findings
