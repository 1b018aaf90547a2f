"""The NVIDIA probes: each runs a tool (an argv list, a timeout, never a shell) and hands its
output to its parser."""

from __future__ import annotations

from health.model import Finding, Status, excerpt, no_devices, probe_failed
from health.nvidia.dcgmi import check_dcgmi_diag
from health.nvidia.nccl_tests import check_nccl_tests
from health.nvidia.smi import (
    GPU_QUERY_FIELDS,
    REMAPPED_ROWS_FIELDS,
    Table,
    check_nvidia_smi,
    check_remapped_rows,
    parse_csv,
)
from health.nvidia.xid import classify_xids, mentions_xid
from health.runner import ToolResult, find_tool, run_tool

_U, _D, _H = Status.UNHEALTHY, Status.DEGRADED, Status.HEALTHY
NVIDIA_SMI_TIMEOUT_S = 10.0
DCGMI_TIMEOUT_S = {1: 60.0, 2: 900.0, 3: 2400.0, 4: 9000.0}  # ADT: level 2 2.5-10.5 min, 4 up to 2.25 h
NCCL_TESTS_TIMEOUT_S = 50.0
NCCL_TESTS_ARGS = ("-b", "32M", "-e", "1G", "-f", "2")
NCCL_TESTS_ITERS = ("-w", "5", "-n", "20")


def _gpu_query(timeout_s: float) -> ToolResult:
    fields = ",".join(GPU_QUERY_FIELDS)
    result = run_tool(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], timeout_s)
    if result.ran and result.returncode != 0 and "is not a valid field" in result.stdout + result.stderr:
        old = fields.replace("clocks_event_reasons.", "clocks_throttle_reasons.")
        result = run_tool(["nvidia-smi", f"--query-gpu={old}", "--format=csv"], timeout_s)
    return result


def _smi_findings(result: ToolResult, check: str, expected_gpus: int | None) -> list[Finding]:
    probe = "nvidia-smi" if check == "gpu" else "remapped-rows"
    if result.missing:
        return [no_devices("nvidia-smi", "NVIDIA")]
    if not result.ran:
        return [probe_failed(probe, result.why)]
    out = result.stdout if result.returncode == 0 else f"{result.stdout}\n{result.stderr}"
    findings = (check_nvidia_smi(out, expected_gpus=expected_gpus) if check == "gpu"
                else check_remapped_rows(out))
    if result.returncode == 0:
        return findings
    # a failed run counts only for what it says is wrong (no driver, a lost GPU) or unsupported
    if any(f.status is _U for f in findings) or "not supported" in findings[0].evidence:
        return findings
    said = excerpt(result.stderr or result.stdout) or "no output"
    query = result.argv[1].split("=")[0] if len(result.argv) > 1 else ""
    return [probe_failed(probe, f"nvidia-smi {query} exited {result.returncode}: {said}")]


def probe_nvidia_smi(*, expected_gpus: int | None = None,
                     timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> list[Finding]:
    """The GPU health query, then the remapped-rows query (see the module docstring)."""
    gpu = _gpu_query(timeout_s)
    findings = _smi_findings(gpu, "gpu", expected_gpus)
    if gpu.missing:
        return findings
    rows = run_tool(["nvidia-smi", f"--query-remapped-rows={','.join(REMAPPED_ROWS_FIELDS)}", "--format=csv"],
                    timeout_s)
    return findings + _smi_findings(rows, "rows", None)


def probe_dcgmi(level: int = 1, *, timeout_s: float | None = None) -> list[Finding]:
    """``dcgmi diag -r <level> -j``: level 1 takes seconds, 2 minutes, 3 and 4 much longer."""
    if level not in DCGMI_TIMEOUT_S:
        return [probe_failed("dcgmi-diag", f"no dcgmi diag level {level} (1 to 4)")]
    result = run_tool(["dcgmi", "diag", "-r", str(level), "-j"],
                      timeout_s if timeout_s is not None else DCGMI_TIMEOUT_S[level])
    if result.missing:
        return [probe_failed("dcgmi-diag", "dcgmi not installed (DCGM)")]
    if not result.ran:
        return [probe_failed("dcgmi-diag", result.why)]
    out = result.stdout if result.stdout.strip() else result.stderr
    return check_dcgmi_diag(out, result.returncode)


def probe_nccl_tests(*, gpus: int, min_busbw_gbps: float | None = None, baseline_gbps: float | None = None,
                     tolerance: float = 0.8, timeout_s: float = NCCL_TESTS_TIMEOUT_S) -> list[Finding]:
    """``all_reduce_perf -b 32M -e 1G -f 2 -g <gpus> -w 5 -n 20`` on this node's GPUs."""
    if gpus < 1:
        return [probe_failed("nccl-tests", "no GPU to run all_reduce_perf on")]
    result = run_tool(["all_reduce_perf", *NCCL_TESTS_ARGS, "-g", str(gpus), *NCCL_TESTS_ITERS], timeout_s)
    if result.missing:
        return [probe_failed("nccl-tests", "all_reduce_perf not installed (nccl-tests); "
                                           "python -m health.allreduce under torchrun measures the same")]
    if not result.ran:
        return [probe_failed("nccl-tests", result.why)]
    findings = check_nccl_tests(result.stdout + ("\n" + result.stderr if result.returncode else ""),
                                min_busbw_gbps=min_busbw_gbps, baseline_gbps=baseline_gbps,
                                tolerance=tolerance)
    if result.returncode != 0 and findings[0].status in (_H, _D):
        return [probe_failed("nccl-tests", f"exited {result.returncode} after a complete table: "
                                           f"{excerpt(result.stderr) or findings[0].evidence}")]
    return findings


def run_all(*, expected_gpus: int | None = None, kernel_log: str | None = None, run_dcgmi: bool = False,
            run_bandwidth: bool = False, min_busbw_gbps: float | None = None) -> list[Finding]:
    """Every NVIDIA probe on this node: nvidia-smi (GPU and remapped-rows queries), dcgmi diag
    level 1 (``run_dcgmi``), nccl-tests (``run_bandwidth``) and the kernel log (``kernel_log``,
    the text of a dmesg dump).

    Without nvidia-smi (a Trainium or CPU node) one finding says no NVIDIA devices were found;
    only Xid kernel lines, if any, are added to it (the kernel saying there is a GPU after all)."""
    if find_tool("nvidia-smi") is None:
        findings = [no_devices("nvidia-smi", "NVIDIA")]
        xids = [ln for ln in (kernel_log or "").splitlines() if mentions_xid(ln)]
        if xids:
            findings += classify_xids("\n".join(xids))
        return findings
    gpu = _gpu_query(NVIDIA_SMI_TIMEOUT_S)
    findings = _smi_findings(gpu, "gpu", expected_gpus)
    rows = run_tool(["nvidia-smi", f"--query-remapped-rows={','.join(REMAPPED_ROWS_FIELDS)}", "--format=csv"],
                    NVIDIA_SMI_TIMEOUT_S)
    findings += _smi_findings(rows, "rows", None)
    if run_dcgmi:
        findings += probe_dcgmi(1)
    if run_bandwidth:
        table = parse_csv(gpu.stdout.strip(), GPU_QUERY_FIELDS, "nvidia-smi") if gpu.ran else "did not run"
        gpus = len(table.rows) if isinstance(table, Table) else (expected_gpus or 0)
        findings += probe_nccl_tests(gpus=gpus, min_busbw_gbps=min_busbw_gbps)
    if kernel_log is not None:
        findings += classify_xids(kernel_log)
    return findings
