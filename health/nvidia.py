"""NVIDIA GPU probes: parsers over nvidia-smi, the kernel log (Xid), dcgmi diag and nccl-tests
output, and thin runners.

Every ``check_*`` (and ``classify_xids``) is a pure parser: text in, ``Finding``s out; it never
raises, and empty, truncated or unrecognised output is ``probe_failed`` (UNKNOWN), never healthy.
The runners (``probe_*``, ``run_all``) only run a tool (an argv list, a timeout, never a shell)
and hand its output to the parser. Formats, field meanings and actions follow
``docs/probe-formats.md`` §2 (nccl-tests src/util.cu and common.cu, NVIDIA/DCGM dcgmi/Diag.cpp, the
Xid buckets of NVIDIA's r590 Xid catalog as used by awsome-distributed-training's health checks).

==============  ============================  =================================================  ===========
probe           reads                         rule -> status                                     action
==============  ============================  =================================================  ===========
nvidia-smi      ``--query-gpu=`` CSV (the     fewer GPUs than ``expected_gpus`` -> UNHEALTHY     REPLACE
                ``GPU_QUERY_FIELDS``, with    more than expected -> DEGRADED (wrong              NONE
                or without header/units;      expectation); per GPU:
                ``[N/A]``/``[Not Supported]`` ``ecc.errors.uncorrected.volatile.total`` > 0
                = no data, rule skipped)      -> UNHEALTHY (a reset retires/remaps the memory)   REBOOT
                                              ``retired_pages.pending`` = Yes -> UNHEALTHY       REBOOT
                                              ``ecc.errors.uncorrected.aggregate.total`` > 0 or
                                              ``retired_pages.dbe`` > 0 -> UNHEALTHY (lifetime
                                              counts no reboot clears; ADT isolates on dbe)      REPLACE
                                              ``retired_pages.sbe`` > ``SBE_RETIRED_DEGRADED``,
                                              ECC disabled, ``hw_slowdown`` Active -> DEGRADED   NONE
                                              a lost GPU, no driver, or no GPU at all and no
                                              expected count -> UNHEALTHY                        REBOOT
remapped-rows   ``--query-remapped-rows=``    ``remapped_rows.failure`` = Yes -> UNHEALTHY       REPLACE
                CSV (``REMAPPED_ROWS_         ``remapped_rows.pending`` = Yes -> UNHEALTHY       REBOOT
                FIELDS``)                     (the remap takes effect at the next GPU reset)
                                              remapped rows without pending/failure: recorded    NONE
xid             a kernel log (dmesg) with     each Xid through ``XID_ACTIONS`` (one table,
                ``NVRM: Xid (PCI:...): N,``   below); an unknown code -> DEGRADED; one finding   per row
                lines                         per code and PCI address, which it quotes
dcgmi-diag      ``dcgmi diag -r N`` table     a failed test -> UNHEALTHY with the test, GPUs
                (DCGM 3.x aggregated          and message: Deployment (software) tests           REBOOT
                ``Fail - GPU: 0``, 4.x        Hardware/Integration/Stress tests                  REPLACE
                ``GPU0: Fail`` rows) or       (a message saying a remap/retirement is pending    REBOOT;
                ``-j`` JSON (3.x and 4.x      exit 205, ISOLATE, makes every failure             REPLACE)
                keys)                         a warning (``Warn``) -> DEGRADED                   NONE
                                              exit 235/242/other with no failure -> UNKNOWN
nccl-tests      ``all_reduce_perf`` output    ``Test NCCL failure`` / ``Test CUDA failure`` /
                (srun ``-l`` and OpenMPI      ``Test failure`` lines -> UNHEALTHY                REBOOT
                prefixes stripped)            ``#wrong`` > 0 in any row or "Out of bounds
                                              values : N FAILED" -> UNHEALTHY (corruption)       REPLACE
                                              busbw at the LARGEST size (the lower of the
                                              out-of-place and in-place columns; never "Avg
                                              bus bandwidth") under the floor
                                              (``max(min_busbw_gbps, baseline * tolerance)``)
                                              -> DEGRADED                                        NONE
==============  ============================  =================================================  ===========

The Xid table ``XID_ACTIONS`` (code: meaning -> status/action). Slurm cannot reset one GPU, so
the catalog's "GPU reset" and "node reboot" buckets are both REBOOT here; "reboot, then replace
if it comes back" is the operator's (or supervisor's) escalation, not this module's:

- UNHEALTHY/REPLACE: 54 (auxiliary power / mechanical: ISOLATE in the catalog).
- UNHEALTHY/REBOOT (drain): 48 double-bit ECC error; 64 row-remapping failure; 71 and 74 NVLink
  errors; 79 GPU fallen off the bus; 95 uncontained ECC error; 109 context-switch timeout;
  110 security fault; 119 GSP RPC timeout; 120 GSP error; 136, 140, 143, 155, 156, 158 (the
  catalog's GPU-reset bucket); 151 and 168 (bare-metal restart / boot re-attempt); 154 when its
  text asks for a reset, a reboot or a drain.
- DEGRADED/RESTART (an application fault: restart the job, never a drain): 13 graphics engine
  exception, 31 GPU memory page fault, 43 GPU stopped processing (the faulting channel was
  reset), 45 preemptive cleanup after an earlier error, 94 contained ECC error, 126.
- DEGRADED (watch, not a drain by itself): 63 ECC page retirement / row remap recorded (takes
  effect at the next reset: the remapped-rows query says whether it is pending; action REBOOT as a
  hint only: a DEGRADED finding never drains); 92 high single-bit ECC error rate; any code not in
  the table; 154 whose new recovery action is "None".

63, 92 and 94 are memory events but not drains: docs/probe-formats.md §2.3 (none of them alone
drains a node) and the catalog's buckets (63 and 92 IGNORE, 94 RESTART_APP) say so; the memory
itself is judged by the ECC counters and the remapped-rows query above, which do drain.

Tools and the exact argv (looked up in ``$TSUP_HEALTH_TOOLS`` first, then ``PATH``):

- ``nvidia-smi --query-gpu=<GPU_QUERY_FIELDS> --format=csv`` (10 s); on a driver that predates
  ``clocks_event_reasons`` ("is not a valid field to query") once more with
  ``clocks_throttle_reasons.hw_slowdown``.
- ``nvidia-smi --query-remapped-rows=<REMAPPED_ROWS_FIELDS> --format=csv`` (10 s); GPUs without
  row remapping (pre-Ampere) print N/A or say "not supported": HEALTHY, nothing to judge.
- ``dcgmi diag -r <level> -j`` (only with ``run_dcgmi``), ``DCGMI_TIMEOUT_S[level]``.
- ``all_reduce_perf -b 32M -e 1G -f 2 -g <GPUs> -w 5 -n 20`` (nccl-tests, only with
  ``run_bandwidth``), 50 s: judged at 1 GiB. Without nccl-tests, ``python -m health.allreduce``
  under torchrun measures the same bus bandwidth with torch.distributed.

Only nvidia-smi decides whether the node has NVIDIA GPUs (absent: ``no_devices``); with
nvidia-smi present, a missing dcgmi or all_reduce_perf that was asked for is UNKNOWN, and so is a
non-zero exit after output that parsed healthy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from health.model import Action, Finding, Status, no_devices, probe_failed
from health.runner import ToolResult, find_tool, run_tool

_U, _D, _H = Status.UNHEALTHY, Status.DEGRADED, Status.HEALTHY
_EXCERPT = 160

# --------------------------------------------------------------------------------------------
# nvidia-smi

# The query, in this order (the header of nvidia-smi_query_gpu_health_SYNTHESIZED.csv).
GPU_QUERY_FIELDS = (
    "index", "name", "pci.bus_id", "serial", "uuid", "ecc.mode.current",
    "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.uncorrected.aggregate.total", "retired_pages.pending", "retired_pages.sbe",
    "retired_pages.dbe", "temperature.gpu", "power.draw", "clocks_event_reasons.hw_slowdown",
)
REMAPPED_ROWS_FIELDS = (
    "gpu_bus_id", "remapped_rows.correctable", "remapped_rows.uncorrectable", "remapped_rows.pending",
    "remapped_rows.failure",
)
# Other spellings nvidia-smi accepts (and prints back in the header) -> the names used here.
_ALIASES = {
    "gpu_bus_id": "pci.bus_id",
    "retired_pages.single_bit_ecc.count": "retired_pages.sbe",
    "retired_pages.double_bit.count": "retired_pages.dbe",
    "clocks_throttle_reasons.hw_slowdown": "clocks_event_reasons.hw_slowdown",
    "clocks.throttle_reasons.hw_slowdown": "clocks_event_reasons.hw_slowdown",
    "clocks.event_reasons.hw_slowdown": "clocks_event_reasons.hw_slowdown",
}
# Fields a rule reads; a query with none of them is not the health query.
_JUDGED = frozenset({
    "ecc.mode.current", "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.pending", "retired_pages.sbe", "retired_pages.dbe", "clocks_event_reasons.hw_slowdown",
    "remapped_rows.pending", "remapped_rows.failure", "remapped_rows.correctable",
    "remapped_rows.uncorrectable",
})
# Retired single-bit pages above this: DEGRADED (ADT's MONITOR rule: "SBE retired pages > 60").
SBE_RETIRED_DEGRADED = 60
_NA = frozenset({"[n/a]", "n/a", "[not supported]", "not supported"})

NVIDIA_SMI_TIMEOUT_S = 10.0
DCGMI_TIMEOUT_S = {1: 60.0, 2: 900.0, 3: 2400.0, 4: 9000.0}  # ADT: level 2 2.5-10.5 min, 4 up to 2.25 h
NCCL_TESTS_TIMEOUT_S = 50.0
NCCL_TESTS_ARGS = ("-b", "32M", "-e", "1G", "-f", "2")
NCCL_TESTS_ITERS = ("-w", "5", "-n", "20")

_NO_DRIVER = re.compile(r"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
                        r"|couldn't communicate with the NVIDIA driver|Failed to initialize NVML.*")
_NO_DEVICES = re.compile(r"^No devices were found\s*$", re.MULTILINE)
_GPU_LOST = re.compile(r"Unable to determine the device handle for GPU.*|.*\bGPU is lost\b.*", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class _Table:
    fields: tuple[str, ...]
    rows: tuple[dict[str, str], ...]


@dataclass(slots=True)
class _GpuVerdict:
    label: str
    problems: list[tuple[Status, Action, str]] = field(default_factory=list)
    recorded: list[str] = field(default_factory=list)


def _smi_unusable(probe: str, body: str) -> list[Finding]:
    """What every nvidia-smi query says first when it has nothing to judge: no output at
    all (probe failed), or no working driver (unhealthy, reboot). Empty: go on."""
    if not body:
        return [probe_failed(probe, "nvidia-smi printed nothing")]
    m = _NO_DRIVER.search(body)
    if m:
        return [Finding(probe=probe, status=_U, action=Action.REBOOT,
                        evidence=f"the NVIDIA driver is not usable: {_excerpt(_line_of(body, m.start()))}")]
    return []


def check_nvidia_smi(text: str, *, expected_gpus: int | None = None) -> list[Finding]:
    """Judge ``nvidia-smi --query-gpu=<GPU_QUERY_FIELDS> --format=csv[,noheader][,nounits]``
    output (any subset of the fields, found by the header; without a header the columns must
    be exactly ``GPU_QUERY_FIELDS``). See the module docstring for the rule."""
    probe = "nvidia-smi"
    body = text.strip()
    unusable = _smi_unusable(probe, body)
    if unusable:
        return unusable
    # nvidia-smi's own complaints (one line, no commas) next to the rows of the other GPUs
    lost = [ln.strip() for ln in body.splitlines() if _GPU_LOST.search(ln) and "," not in ln]
    none_found = bool(_NO_DEVICES.search(body))
    table = (_Table(GPU_QUERY_FIELDS, ()) if none_found
             else _parse_csv("\n".join(ln for ln in body.splitlines() if ln.strip() not in lost),
                             GPU_QUERY_FIELDS, "nvidia-smi"))
    if isinstance(table, str):
        return [probe_failed(probe, table)]
    if table.rows and not _JUDGED & set(table.fields):
        columns = ", ".join(table.fields[:8])
        return [probe_failed(probe, f"the query has no health field (columns: {columns})")]

    findings: list[Finding] = []
    n = len(table.rows)
    names = sorted({r.get("name", "") for r in table.rows} - {""})
    what = f" ({', '.join(names)})" if names else ""
    said = "; nvidia-smi: No devices were found" if none_found else ""
    if lost:
        findings.append(Finding(probe=probe, status=_U, action=Action.REBOOT,
                                evidence=f"a GPU is lost: {_excerpt(lost[0])}"))
    if expected_gpus is not None and n < expected_gpus:
        findings.append(Finding(probe=probe, status=_U, action=Action.REPLACE,
                                evidence=f"{n} of {expected_gpus} GPUs present{what}{said}"))
    elif expected_gpus is not None and n > expected_gpus:
        findings.append(Finding(probe=probe, status=_D,
                                evidence=f"{n} GPUs present, expected {expected_gpus}{what}: check the "
                                         f"expected count"))
    elif n == 0 and not lost and expected_gpus is None:
        findings.append(Finding(probe=probe, status=_U, action=Action.REBOOT,
                                evidence=f"nvidia-smi is installed but sees no GPU{said}"))

    recorded: list[str] = []
    for i, row in enumerate(table.rows):
        gpu = _judge_gpu(row, i)
        findings += _gpu_findings(probe, gpu)
        recorded += gpu.recorded
    if any(f.status is not _H for f in findings):
        return findings
    expected = f" of {expected_gpus} expected" if expected_gpus is not None else " (no expected count given)"
    note = f"; recorded: {', '.join(recorded[:4])}" if recorded else ""
    return [Finding(probe=probe, status=_H,
                    evidence=f"{n} GPUs{expected}{what}: no uncorrected ECC error, nothing pending{note}")]


def check_remapped_rows(text: str) -> list[Finding]:
    """Judge ``nvidia-smi --query-remapped-rows=<REMAPPED_ROWS_FIELDS> --format=csv[,noheader]``
    (A100/H100 and later): a remapping failure needs a new GPU, a pending remap a reset."""
    probe = "remapped-rows"
    body = text.strip()
    unusable = _smi_unusable(probe, body)
    if unusable:
        return unusable
    if _NO_DEVICES.search(body):
        return [probe_failed(probe, "nvidia-smi: No devices were found")]
    if re.search(r"not supported", body, re.IGNORECASE) and "remapped_rows" not in body:
        return [Finding(probe=probe, status=_H, evidence="row remapping not supported on these GPUs "
                                                         "(pre-Ampere): nothing to judge")]
    table = _parse_csv(body, REMAPPED_ROWS_FIELDS, "nvidia-smi")
    if isinstance(table, str):
        return [probe_failed(probe, table)]
    if not {"remapped_rows.pending", "remapped_rows.failure"} & set(table.fields):
        return [probe_failed(probe, f"no remapped_rows.pending/failure column "
                                    f"(columns: {', '.join(table.fields[:8])})")]
    if not table.rows:
        return [probe_failed(probe, "a header but no GPU rows (truncated?)")]
    findings: list[Finding] = []
    recorded: list[str] = []
    all_na = True
    for i, row in enumerate(table.rows):
        gpu = _judge_gpu(row, i)
        all_na = all_na and all(row.get(f, "").lower() in _NA for f in _JUDGED & set(row))
        findings += _gpu_findings(probe, gpu)
        recorded += gpu.recorded
    if any(f.status is not _H for f in findings):
        return findings
    if all_na:
        return [Finding(probe=probe, status=_H, evidence=f"row remapping not supported on {len(table.rows)} "
                                                         f"GPUs (all N/A): nothing to judge")]
    note = f"; recorded: {', '.join(recorded[:4])}" if recorded else ""
    return [Finding(probe=probe, status=_H,
                    evidence=f"{len(table.rows)} GPUs: no row remap pending, no remapping failure{note}")]


def _gpu_findings(probe: str, gpu: _GpuVerdict) -> list[Finding]:
    """One finding per GPU with problems: the worst status and action, every reason."""
    if not gpu.problems:
        return []
    out = [p for p in gpu.problems if p[0] is Status.UNKNOWN]
    judged = [p for p in gpu.problems if p[0] is not Status.UNKNOWN]
    findings = [probe_failed(probe, f"{gpu.label}: {why}") for _, _, why in out]
    if judged:
        order = (_H, _D, _U)
        actions = (Action.NONE, Action.RESTART, Action.REBOOT, Action.REPLACE)
        status = max((s for s, _, _ in judged), key=order.index)
        action = max((a for s, a, _ in judged if s is status), key=actions.index)
        findings.insert(0, Finding(probe=probe, status=status, action=action,
                                   evidence=f"{gpu.label}: {'; '.join(why for _, _, why in judged)}"))
    return findings


def _judge_gpu(row: dict[str, str], i: int) -> _GpuVerdict:
    index = row.get("index", "")
    bus = row.get("pci.bus_id", "")
    label = f"GPU {index or i}" + (f" ({bus})" if bus else "") if index or not bus else f"GPU {bus}"
    gpu = _GpuVerdict(label)
    lost = [k for k, v in row.items() if "gpu is lost" in v.lower()]
    if lost:
        gpu.problems.append((_U, Action.REBOOT, f"{lost[0]}={row[lost[0]]} (the GPU is lost)"))
        return gpu

    def count(key: str) -> int | None:
        raw = row.get(key)
        if raw is None or raw.lower() in _NA:
            return None
        value = raw.split()[0] if raw.split() else raw
        if value.isdigit():
            return int(value)
        gpu.problems.append((Status.UNKNOWN, Action.NONE, f"{key}={raw!r} is not a count"))
        return None

    def flag(key: str, yes: str, no: str) -> bool | None:
        raw = row.get(key)
        if raw is None or raw.lower() in _NA:
            return None
        if raw.lower() == yes.lower():
            return True
        if raw.lower() == no.lower():
            return False
        gpu.problems.append((Status.UNKNOWN, Action.NONE, f"{key}={raw!r} is neither {yes} nor {no}"))
        return None

    def problem(status: Status, action: Action, key: str, value: object, why: str) -> None:
        gpu.problems.append((status, action, f"{key}={value} ({why})"))

    ue_volatile = count("ecc.errors.uncorrected.volatile.total")
    if ue_volatile:
        problem(_U, Action.REBOOT, "ecc.errors.uncorrected.volatile.total", ue_volatile,
                "uncorrectable ECC errors since the last reset")
    ue_aggregate = count("ecc.errors.uncorrected.aggregate.total")
    if ue_aggregate:
        problem(_U, Action.REPLACE, "ecc.errors.uncorrected.aggregate.total", ue_aggregate,
                "lifetime uncorrectable ECC errors: no reboot clears them")
    dbe = count("retired_pages.dbe")
    if dbe:
        problem(_U, Action.REPLACE, "retired_pages.dbe", dbe, "pages retired for double-bit errors")
    if flag("retired_pages.pending", "Yes", "No"):
        problem(_U, Action.REBOOT, "retired_pages.pending", "Yes", "a page retirement waits for a reset")
    if flag("remapped_rows.failure", "Yes", "No"):
        problem(_U, Action.REPLACE, "remapped_rows.failure", "Yes", "row remapping failed: replace the GPU")
    if flag("remapped_rows.pending", "Yes", "No"):
        problem(_U, Action.REBOOT, "remapped_rows.pending", "Yes", "a row remap waits for a reset")
    sbe = count("retired_pages.sbe")
    if sbe is not None and sbe > SBE_RETIRED_DEGRADED:
        problem(_D, Action.NONE, "retired_pages.sbe", sbe,
                f"over {SBE_RETIRED_DEGRADED} single-bit retirements")
    if flag("ecc.mode.current", "Enabled", "Disabled") is False:
        problem(_D, Action.NONE, "ecc.mode.current", "Disabled", "memory errors go unseen")
    if flag("clocks_event_reasons.hw_slowdown", "Active", "Not Active"):
        problem(_D, Action.NONE, "clocks_event_reasons.hw_slowdown", "Active",
                "hardware slowdown: thermal or power brake, a straggler")
    short = label.split(" (", maxsplit=1)[0]
    for key in ("ecc.errors.corrected.volatile.total", "remapped_rows.correctable",
                "remapped_rows.uncorrectable"):
        value = count(key)
        if value:
            gpu.recorded.append(f"{short} {key}={value}")
    return gpu


def _parse_csv(body: str, known: Sequence[str], tool: str) -> _Table | str:
    """nvidia-smi CSV: a header (names, optional ``[unit]``) then rows; or rows only, whose
    columns must then be ``known``. Returns the table, or why it cannot be read."""
    lines = [ln.strip() for ln in body.splitlines() if ln.strip()]
    if not lines:
        return f"{tool} printed no CSV"
    first = [c.strip() for c in lines[0].split(",")]
    if len(first) < 2:
        return f"not {tool} CSV output: {_excerpt(lines[0])!r}"
    names = [_field_name(c) for c in first]
    has_header = all(re.fullmatch(r"[a-z_][a-z0-9_.]*", n) for n in names)
    if has_header:
        fields = tuple(_ALIASES.get(n, n) for n in names)
        data = lines[1:]
    else:
        fields = tuple(_ALIASES.get(n, n) for n in known)
        data = lines
        if len(first) != len(fields):
            return (f"CSV without a header has {len(first)} columns, the query has {len(fields)}: "
                    f"{_excerpt(lines[0])!r}")
    if len(set(fields)) != len(fields):
        return "the CSV header names a column twice"
    rows = []
    for n, line in enumerate(data, 1):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            return (f"row {n} has {len(cells)} values, the header {len(fields)} (truncated?): "
                    f"{_excerpt(line)!r}")
        rows.append(dict(zip(fields, cells, strict=True)))
    if has_header and not rows:
        return "a CSV header but no GPU rows (truncated?)"
    return _Table(fields, tuple(rows))


def _field_name(cell: str) -> str:
    return re.sub(r"\s*\[[^\]]*\]$", "", cell.strip()).lower()


def _line_of(body: str, pos: int) -> str:
    start = body.rfind("\n", 0, pos) + 1
    end = body.find("\n", pos)
    return body[start:end if end >= 0 else len(body)]


# --------------------------------------------------------------------------------------------
# Xid


@dataclass(frozen=True, slots=True)
class XidRule:
    status: Status
    action: Action
    meaning: str


def _x(status: Status, action: Action, meaning: str) -> XidRule:
    return XidRule(status, action, meaning)


_RESET_BUCKET = "needs a GPU reset (the catalog's RESET bucket)"

# The one Xid table: code -> what the node needs. See the module docstring for the grouping.
XID_ACTIONS: dict[int, XidRule] = {
    13: _x(_D, Action.RESTART, "graphics engine exception: an application fault"),
    31: _x(_D, Action.RESTART, "GPU memory page fault: an application's illegal access"),
    43: _x(_D, Action.RESTART, "GPU stopped processing: the faulting application's channel was reset"),
    45: _x(_D, Action.RESTART, "preemptive cleanup after an earlier error: the application was stopped"),
    94: _x(_D, Action.RESTART, "contained ECC error: only the application that touched the memory is hit"),
    126: _x(_D, Action.RESTART, "an application-level fault (the catalog's RESTART_APP bucket)"),
    63: _x(_D, Action.REBOOT, "ECC page retirement or row remap recorded: takes effect at the next reset"),
    92: _x(_D, Action.NONE, "high single-bit ECC error rate (corrected): watch"),
    48: _x(_U, Action.REBOOT, "double-bit (uncorrectable) ECC error"),
    64: _x(_U, Action.REBOOT, "row remapping failure (again after a reboot: replace)"),
    71: _x(_U, Action.REBOOT, "NVLink fatal error"),
    74: _x(_U, Action.REBOOT, "NVLink error"),
    79: _x(_U, Action.REBOOT, "GPU has fallen off the bus (again after a reboot: replace)"),
    95: _x(_U, Action.REBOOT, "uncontained ECC error"),
    109: _x(_U, Action.REBOOT, "context switch timeout"),
    110: _x(_U, Action.REBOOT, "security fault"),
    119: _x(_U, Action.REBOOT, "GSP RPC timeout"),
    120: _x(_U, Action.REBOOT, "GSP error"),
    136: _x(_U, Action.REBOOT, _RESET_BUCKET),
    140: _x(_U, Action.REBOOT, _RESET_BUCKET),
    143: _x(_U, Action.REBOOT, _RESET_BUCKET),
    155: _x(_U, Action.REBOOT, _RESET_BUCKET),
    156: _x(_U, Action.REBOOT, _RESET_BUCKET),
    158: _x(_U, Action.REBOOT, _RESET_BUCKET),
    151: _x(_U, Action.REBOOT, "the GPU needs a bare-metal (VM) restart"),
    168: _x(_U, Action.REBOOT, "GPU boot re-attempt: restart the node"),
    54: _x(_U, Action.REPLACE, "auxiliary power not connected / mechanical fault (ISOLATE)"),
    154: _x(_U, Action.REBOOT, "GPU recovery action changed"),  # refined by its text, see _xid_154
}
_UNKNOWN_XID = _x(_D, Action.NONE, "not in the table: look it up in NVIDIA's Xid catalog")

_XID = re.compile(r"\bXid\s*\(([^)]*)\)\s*:\s*(\d+)\b\s*,?\s*(.*)")
_XID_MENTION = re.compile(r"NVRM:\s*Xid\b")
_XID_NOISE = re.compile(r"^(?:pid=[^,]*,\s*)?(?:name=[^,]*,\s*)?")


def classify_xids(text: str) -> list[Finding]:
    """Every ``NVRM: Xid (PCI:...): N, ...`` line through ``XID_ACTIONS``: one finding per code
    and PCI address (the first message quoted, the count when more)."""
    probe = "xid"
    if "\x00" in text:
        return [probe_failed(probe, "the log holds binary data (NUL bytes), not text")]
    lines = text.splitlines()
    if not text.strip():
        return [probe_failed(probe, "the kernel log is empty (dmesg not readable?)")]
    seen: dict[tuple[int, str], tuple[XidRule, str, int]] = {}
    cut: list[str] = []
    for line in lines:
        m = _XID.search(line)
        if not m:
            if _XID_MENTION.search(line):
                cut.append(line.strip())
            continue
        where, code, message = m.group(1).strip(), int(m.group(2)), _xid_message(m.group(3))
        rule = _xid_154(message) if code == 154 else XID_ACTIONS.get(code, _UNKNOWN_XID)
        key = (code, where)
        _, first, count = seen.get(key, (rule, message, 0))
        seen[key] = (rule, first, count + 1)
    findings = []
    for (code, where), (rule, message, count) in seen.items():
        times = f" (x{count})" if count > 1 else ""
        quote = f": {message}" if message else ""
        findings.append(Finding(probe=probe, status=rule.status, action=rule.action,
                                evidence=f"Xid {code} on {where}{times}: {rule.meaning}{quote}"))
    if cut:
        findings.append(probe_failed(probe, f"an Xid line without a code (truncated?): {_excerpt(cut[0])!r}"))
    if not findings:
        return [Finding(probe=probe, status=_H, evidence=f"no NVIDIA Xid in {len(lines)} kernel log lines")]
    return findings


_XID_PLAIN = re.compile(r"\bXid[ :]+(\d+)\b\s*,?\s*(.*)")  # "Xid 79", "Xid: 79" (a message quoting one)


# The two forms, for a reader that matches them with an engine of its own (the daemon's,
# supervisor/output_progress.py): the kernel's (groups: the device, the code, the message)
# and the plain one (the code, the message).
XID_PATTERN, XID_PLAIN_PATTERN = _XID.pattern, _XID_PLAIN.pattern


def xid_rule(line: str) -> tuple[int, XidRule] | None:
    """The Xid a line reports (the kernel's ``Xid (PCI:...): N, ...``, or a plain ``Xid N``)
    and its rule in ``XID_ACTIONS``; None when the line reports none."""
    m = _XID.search(line)
    if m:
        return int(m.group(2)), xid_of(int(m.group(2)), m.group(3))
    plain = _XID_PLAIN.search(line)
    if not plain:
        return None
    return int(plain.group(1)), xid_of(int(plain.group(1)), plain.group(2))


def xid_of(code: int, raw_message: str) -> XidRule:
    """The rule of Xid ``code`` reported with ``raw_message`` (what follows the code)."""
    message = _xid_message(raw_message)
    return _xid_154(message) if code == 154 else XID_ACTIONS.get(code, _UNKNOWN_XID)


def _xid_message(raw: str) -> str:
    text = _XID_NOISE.sub("", raw.strip(), count=1)
    text = text.split('\\"', 1)[0]  # the line quoted inside JSON (HyperPod's health agent)
    return _excerpt(text)


def _xid_154(message: str) -> XidRule:
    """Xid 154 reports the driver's recovery action; the action is in its text."""
    m = re.search(r"to 0x[0-9a-fA-F]+ \(([^)]*)\)", message)
    new = m.group(1) if m else message
    if re.search(r"\bNone\b", new) and m:
        return _x(_D, Action.NONE, "GPU recovery action cleared (None)")
    if re.search(r"reboot", new, re.IGNORECASE):
        return _x(_U, Action.REBOOT, "GPU recovery action: node reboot required")
    if re.search(r"reset|drain", new, re.IGNORECASE):
        return _x(_U, Action.REBOOT, "GPU recovery action: GPU reset / drain required")
    return _x(_D, Action.NONE, "GPU recovery action changed (action not recognised)")


# --------------------------------------------------------------------------------------------
# dcgmi diag

# dcgmi exits with the dcgmReturn_t as an unsigned byte (dcgm_structs.h; docs/probe-formats.md §2.4).
DCGMI_EXIT_CODES: dict[int, str] = {
    205: "DCGM_ST_NVVS_ISOLATE_ERROR: an error with ISOLATE priority",
    226: "DCGM_ST_NVVS_ERROR: a test reported an error",
    235: "DCGM_ST_CONNECTION_NOT_VALID: nv-hostengine not running?",
    242: "DCGM_ST_NO_DATA",
}
_ISOLATE_EXIT = 205
_DCGM_STATUSES = ("pass", "fail", "warn", "skip", "not run")
_SOFTWARE = frozenset({"deployment", "metadata", "software"})
_PENDING = re.compile(r"pending", re.IGNORECASE)
_REMAP = re.compile(r"remap|retire", re.IGNORECASE)
_INFO_WIDTH = 45  # DATA_INFO_TAG_LEN in dcgmi/Diag.cpp: long messages wrap every 45 characters


@dataclass(slots=True)
class _DiagTest:
    name: str
    category: str
    summary: str = ""  # the test's own status where the tool gives one (4.x row, JSON test_summary)
    statuses: list[str] = field(default_factory=list)  # 3.x aggregated rows, entity-less JSON results
    entities: dict[str, str] = field(default_factory=dict)  # "GPU 0" -> status
    messages: list[str] = field(default_factory=list)  # Warning / Error texts (not Info)

    def worst(self) -> str:
        if self.summary:
            return self.summary
        found = [*self.statuses, *self.entities.values()]
        return next((s for s in ("fail", "warn", "pass", "skip", "not run") if s in found), "")


def check_dcgmi_diag(text: str, returncode: int | None = None) -> list[Finding]:
    """Judge ``dcgmi diag -r N`` output: the text table (DCGM 3.x and 4.x) or ``-j`` JSON, and
    dcgmi's exit code when known. See the module docstring for the rule."""
    probe = "dcgmi-diag"
    body = text.strip()
    parsed: list[_DiagTest] | str
    version = ""
    if not body:
        parsed = "dcgmi printed nothing"
    elif body[0] == "{":
        parsed, version = _diag_json(body)
    else:
        parsed, version = _diag_table(body)
    exit_note = _dcgmi_exit(returncode)
    if isinstance(parsed, str):
        if returncode == _ISOLATE_EXIT:
            return [Finding(probe=probe, status=_U, action=Action.REPLACE,
                            evidence=f"dcgmi exited {exit_note}; the output cannot be read: {parsed}")]
        return [probe_failed(probe, parsed + (f" (exit {exit_note})" if returncode else ""))]

    findings: list[Finding] = []
    ran = [t for t in parsed if t.worst() in ("pass", "fail", "warn")]
    for t in parsed:
        worst = t.worst()
        if worst not in ("fail", "warn"):
            continue
        # 4.x shows a warned entity as "Fail" under a "Warn" test row
        bad = ([e for e, s in t.entities.items() if s == worst]
               or [e for e, s in t.entities.items() if s == "fail"])
        on = f" on {', '.join(bad)}" if bad else ""
        message = "; ".join(m for m in t.messages if m)
        said = f": {_excerpt(message)}" if message else ""
        where = f"{t.name} ({t.category})" if t.category else t.name
        if worst == "warn":
            findings.append(Finding(probe=probe, status=_D, evidence=f"{where}: Warn{on}{said}"))
            continue
        soft = t.category.lower() in _SOFTWARE
        pending = bool(_PENDING.search(message) and _REMAP.search(message))
        action = (Action.REPLACE if returncode == _ISOLATE_EXIT
                  else Action.REBOOT if soft or pending else Action.REPLACE)
        findings.append(Finding(probe=probe, status=_U, action=action, evidence=f"{where}: Fail{on}{said}"))
    if any(f.status is _U for f in findings):
        return findings
    if returncode == _ISOLATE_EXIT:
        return [*findings, Finding(probe=probe, status=_U, action=Action.REPLACE,
                                   evidence=f"dcgmi exited {exit_note}, the output shows no failed test")]
    if returncode:
        return [*findings, probe_failed(probe, f"dcgmi exited {exit_note} though no test failed")]
    if not ran:
        return [*findings, probe_failed(probe, f"no test ran ({len(parsed)} skipped or not run)")]
    if findings:
        return findings
    gpus = sorted({e for t in parsed for e in t.entities}, key=_natural)
    on = f" on {len(gpus)} GPUs" if gpus else ""
    ver = f" (DCGM {version})" if version else ""
    return [Finding(probe=probe, status=_H,
                    evidence=f"{len(ran)} tests passed{on}{ver}: {', '.join(t.name for t in ran[:8])}")]


def _dcgmi_exit(returncode: int | None) -> str:
    if returncode is None:
        return "?"
    meaning = DCGMI_EXIT_CODES.get(returncode)
    return f"{returncode} ({meaning})" if meaning else str(returncode)


def _natural(s: str) -> tuple[str, int]:
    m = re.match(r"(\D*)(\d+)", s)
    return (m.group(1), int(m.group(2))) if m else (s, -1)


_SECTION = re.compile(r"^[|+]-+\s+(\w+)\s+-+\+-+[|+]$")
_BORDER = re.compile(r"^\+-+\+-+\+$")
_RESULT = re.compile(r"^(Pass|Fail|Warn|Skip|Not Run)\b\s*(?:-\s*(.*?))?\s*$", re.IGNORECASE)
_ENTITY_RESULT = re.compile(r"^([A-Za-z_]+?)\s*(\d+):\s*(Pass|Fail|Warn|Skip|Not Run)\s*$", re.IGNORECASE)
_MESSAGE_NAME = re.compile(r"^(Warning|Error|Info)\b", re.IGNORECASE)


def _diag_table(body: str) -> tuple[list[_DiagTest] | str, str]:
    lines = [ln.rstrip() for ln in body.splitlines()]
    try:
        start = next(i for i, ln in enumerate(lines) if re.match(r"^\|\s*Diagnostic\s*\|\s*Result\s*\|$", ln))
    except StopIteration:
        errors = [ln.strip() for ln in lines if ln.strip().startswith("Error")]
        first = errors[0] if errors else next((ln for ln in lines if ln.strip()), "")
        return f"no dcgmi diag table: {_excerpt(first)!r}", ""
    tests: list[_DiagTest] = []
    category, version = "", ""
    current: _DiagTest | None = None
    fragments: list[str] | None = None  # the Warning/Error/Info row being read, as wrapped
    keep = False  # whether that message goes into the evidence (Info does not)
    closed = False

    def flush() -> None:
        nonlocal fragments
        if current is not None and fragments is not None and keep:
            current.messages.append(_unwrap(fragments))
        fragments = None

    for ln in lines[start + 1:]:
        s = ln.strip()
        if not s:
            continue
        sec = _SECTION.match(s)
        if sec:
            flush()
            category, current = sec.group(1), None
            continue
        if re.match(r"^\+=+\+=+\+$", s):
            continue
        if _BORDER.match(s):
            flush()
            closed = True
            break
        if not (s.startswith("|") and s.endswith("|") and s.count("|") >= 3):
            return f"a line inside the dcgmi table is not a row (truncated?): {_excerpt(s)!r}", version
        name_raw, info_raw = s[1:-1].split("|", 1)
        name, info = name_raw.strip(), info_raw.strip()
        value = info_raw[1:] if info_raw.startswith(" ") else info_raw  # the padded 46-wide value
        if not category or category.lower() == "metadata":
            version = info if name == "DCGM Version" else version
            continue
        if name and _MESSAGE_NAME.match(name):
            flush()
            if current is None:
                return f"a {name} row before any test: {_excerpt(s)!r}", version
            fragments, keep = [value], not name.lower().startswith("info")
            continue
        if name:
            flush()
            m = _RESULT.match(info)
            if not m:
                return f"test {name!r} has no result: {_excerpt(info)!r}", version
            current = _DiagTest(name, category)
            status, rest = m.group(1).lower(), m.group(2)
            if rest is None:
                current.summary = status  # 4.x, and every Deployment row
            else:
                current.statuses.append(status)  # 3.x: "Pass - All", "Fail - GPU: 0"
                _entities(current, status, rest)
            tests.append(current)
            continue
        # a continuation row: a message wrapped at 45 characters, an entity result (4.x:
        # "GPU0: Pass"), or a further aggregated result (3.x: "Fail - GPU: 0")
        if current is None:
            return f"a continuation row before any test: {_excerpt(s)!r}", version
        ent, agg = _ENTITY_RESULT.match(info), _RESULT.match(info)
        if ent:
            flush()
            current.entities[f"{ent.group(1).upper()} {ent.group(2)}"] = ent.group(3).lower()
        elif fragments is not None:
            fragments.append(value)
        elif agg:
            current.statuses.append(agg.group(1).lower())
            _entities(current, agg.group(1).lower(), agg.group(2) or "")
        else:
            return f"an unreadable row under {current.name!r}: {_excerpt(s)!r}", version
    if not closed:
        return "the dcgmi table is not closed by its border (truncated?)", version
    if not tests:
        return "the dcgmi table lists no test", version
    return tests, version


def _unwrap(fragments: list[str]) -> str:
    """Re-join a message dcgmi cut every 45 characters: a fragment keeps its 45th character even
    when that is a space; a shorter one (another layout) is taken as ending at a word."""
    text = "".join(f[:_INFO_WIDTH] if len(f) > _INFO_WIDTH else f.rstrip() + " " for f in fragments[:-1])
    return " ".join((text + fragments[-1]).split())


def _entities(test: _DiagTest, status: str, rest: str) -> None:
    """3.x aggregated results: ``Pass - All``, ``Fail - GPU: 0``, ``Pass - GPUs: 1, 2``."""
    m = re.match(r"GPUs?:\s*(.*)$", rest.strip())
    if m:
        for gid in re.findall(r"\d+", m.group(1)):
            test.entities[f"GPU {gid}"] = status


def _diag_json(body: str) -> tuple[list[_DiagTest] | str, str]:
    try:
        doc: object = json.loads(body)
    except ValueError as e:
        return f"dcgmi JSON does not parse (truncated?): {e}", ""
    roots = list(_diag_roots(doc))
    error = _find_key(doc, "runtime_error")
    if error:
        return f"dcgmi could not run the diagnostic: {_excerpt(str(error))}", ""
    if not roots:
        keys = ", ".join(list(doc)[:6]) if isinstance(doc, dict) else type(doc).__name__
        return f"not dcgmi diag JSON (no test_categories; top level: {keys})", ""
    tests: list[_DiagTest] = []
    version = ""
    for root in roots:
        version = version or str(root.get("version", ""))
        cats = root.get("test_categories")
        if not isinstance(cats, list):
            return "test_categories is not a list", version
        for cat in cats:
            if not isinstance(cat, dict) or not isinstance(cat.get("tests"), list):
                return "a test category without a list of tests", version
            cname = str(cat.get("category", ""))
            for t in cat["tests"]:
                if not isinstance(t, dict) or not isinstance(t.get("results"), list):
                    return f"a test in {cname or '?'} without results", version
                test = _DiagTest(str(t.get("name", "?")), cname)
                summary = t.get("test_summary")
                if isinstance(summary, dict) and isinstance(summary.get("status"), str):
                    test.summary = summary["status"].strip().lower()
                    if test.summary not in _DCGM_STATUSES:
                        return f"{test.name}: unknown test_summary status {summary['status']!r}", version
                for r in t["results"]:
                    if not isinstance(r, dict) or not isinstance(r.get("status"), str):
                        return f"a result of {test.name} without a status", version
                    status = r["status"].strip().lower()
                    if status not in _DCGM_STATUSES:
                        return f"{test.name}: unknown status {r['status']!r}", version
                    warnings = _json_warnings(r.get("warnings"))
                    if status == "pass" and warnings:
                        status = "warn"  # a pass that says something: worth a look
                    entity = _json_entity(r)
                    if entity:
                        test.entities[entity] = status
                    else:
                        test.statuses.append(status)
                    test.messages += warnings
                tests.append(test)
    if not tests:
        return "dcgmi JSON lists no test", version
    return tests, version


def _diag_roots(doc: object) -> list[dict[str, object]]:
    """Every object holding ``test_categories`` (one per iteration with ``--iterations``)."""
    out: list[dict[str, object]] = []
    if isinstance(doc, dict):
        if "test_categories" in doc:
            out.append(doc)
        else:
            for v in doc.values():
                out += _diag_roots(v)
    elif isinstance(doc, list):
        for v in doc:
            out += _diag_roots(v)
    return out


def _find_key(doc: object, key: str) -> object:
    if isinstance(doc, dict):
        if doc.get(key):
            return doc[key]
        for v in doc.values():
            found = _find_key(v, key)
            if found:
                return found
    return None


def _json_entity(r: dict[str, object]) -> str:
    group = str(r.get("entity_group", "GPU") or "GPU").upper()
    for key in ("entity_id", "gpu_id", "gpu_ids"):
        value = r.get(key)
        if value is not None and str(value).strip():
            return f"{group} {str(value).strip()}"
    return ""


def _json_warnings(value: object) -> list[str]:
    """``warnings``: a string (2.x), a list of strings, or of objects with ``warning`` (or, in
    3.x deployment results, ``warnings``)."""
    if isinstance(value, str):
        return [_excerpt(value)] if value.strip() else []
    out = []
    if isinstance(value, list):
        for item in value:
            w = (item.get("warning") or item.get("warnings") or "") if isinstance(item, dict) else item
            if isinstance(w, str) and w.strip():
                out.append(_excerpt(w))
    return out


# --------------------------------------------------------------------------------------------
# nccl-tests

_NCCL_PREFIX = re.compile(r"^(?:\s*\d+:\s|\[\d+,\d+\]<std(?:out|err)>:)")
_NCCL_FAILURE = re.compile(r"Test (?:NCCL|CUDA) failure.*|Test failure .*")
_NCCL_OOB = re.compile(r"Out of bounds values\s*:\s*(\d+)\s+(OK|FAILED)", re.IGNORECASE)
_NCCL_PREAMBLE = re.compile(r"maxBytes\s+(\d+)\s+step:\s*(\d+)\((factor|bytes)\)")


@dataclass(frozen=True, slots=True)
class _NcclRow:
    size: int
    busbw: tuple[float, ...]  # out-of-place, in-place
    wrong: tuple[int, ...]  # empty when validation is off (N/A) or the old "error" column


def check_nccl_tests(text: str, *, min_busbw_gbps: float | None = None, baseline_gbps: float | None = None,
                     tolerance: float = 0.8) -> list[Finding]:
    """Judge nccl-tests ``all_reduce_perf`` output: errors, ``#wrong``, and the bus bandwidth at
    the largest size against ``max(min_busbw_gbps, baseline_gbps * tolerance)``."""
    probe = "nccl-tests"
    if not text.strip():
        return [probe_failed(probe, "all_reduce_perf printed nothing")]
    lines = [_NCCL_PREFIX.sub("", ln, count=1).rstrip() for ln in text.splitlines()]
    failures = [m.group(0).strip() for ln in lines if (m := _NCCL_FAILURE.search(ln))]
    if failures:
        first = next((ln for ln in lines if _NCCL_FAILURE.search(ln) and "failure" in ln and "Test " in ln
                      and ("NCCL" in ln or "CUDA" in ln)), None)
        quote = (first or failures[0]).strip()
        return [Finding(probe=probe, status=_U, action=Action.REBOOT,
                        evidence=f"all_reduce_perf failed: {_excerpt(quote)}")]
    rows = _nccl_rows(lines)
    if isinstance(rows, str):
        return [probe_failed(probe, rows)]
    joined = "\n".join(lines)
    if "Collective test starting" in joined and "Collective test concluded" not in joined:
        return [probe_failed(probe, "the run started but never concluded (output cut?)")]
    largest = max(r.size for r in rows)
    pre = _NCCL_PREAMBLE.search(joined)
    if pre:
        max_bytes, step, kind = int(pre.group(1)), int(pre.group(2)), pre.group(3)
        nxt = largest * step if kind == "factor" else largest + step
        if step > (1 if kind == "factor" else 0) and nxt <= max_bytes:
            return [probe_failed(probe, f"the sweep stops at {_size(largest)} of maxBytes {_size(max_bytes)} "
                                        f"(output cut?)")]
    wrong = [(r.size, i, w) for r in rows for i, w in enumerate(r.wrong) if w]
    oob = _NCCL_OOB.search(joined)
    if wrong:
        size, i, w = wrong[0]
        more = f" ({len(wrong)} results wrong)" if len(wrong) > 1 else ""
        return [Finding(probe=probe, status=_U, action=Action.REPLACE,
                        evidence=f"#wrong={w} at {_size(size)} {('out-of-place', 'in-place')[i % 2]}{more}: "
                                 f"all-reduce returned corrupt data")]
    if oob and oob.group(2).upper() == "FAILED":
        return [Finding(probe=probe, status=_U, action=Action.REPLACE,
                        evidence=f"Out of bounds values : {oob.group(1)} FAILED: all-reduce returned "
                                 f"corrupt data")]
    at_largest = [r for r in rows if r.size == largest]
    columns = [min(col) for col in zip(*(r.busbw for r in at_largest), strict=True)]
    busbw = min(columns)
    shown = "/".join(f"{b:.2f}" for b in columns)
    kinds = " (out-of-place/in-place)" if len(columns) == 2 else ""
    sizes = len({r.size for r in rows})
    unchecked = "" if any(r.wrong for r in rows) else "; results not validated (-c 0)"
    at = f"busbw {shown} GB/s{kinds} at {_size(largest)} (largest of {sizes} sizes){unchecked}"
    floors = [f for f in (min_busbw_gbps, baseline_gbps * tolerance if baseline_gbps is not None else None)
              if f is not None]
    if not floors:
        return [Finding(probe=probe, status=_H, evidence=f"{at}; no floor given")]
    floor = max(floors)
    if busbw < floor:
        return [Finding(probe=probe, status=_D, evidence=f"{at}: under the floor {floor:.2f} GB/s")]
    return [Finding(probe=probe, status=_H, evidence=f"{at}: at or over the floor {floor:.2f} GB/s")]


def _nccl_rows(lines: list[str]) -> list[_NcclRow] | str:
    header: list[str] | None = None
    rows: list[_NcclRow] = []
    for ln in lines:
        s = ln.strip()
        if s.startswith("#"):
            tokens = s.lstrip("#").split()
            if {"size", "count", "busbw"} <= set(tokens):
                header = tokens
            continue
        tokens = s.split()
        if header is None or len(tokens) < 2 or not (tokens[0].isdigit() and tokens[1].isdigit()):
            continue
        if len(tokens) != len(header):
            return f"a table row has {len(tokens)} columns, the header {len(header)} (cut?): {_excerpt(s)!r}"
        try:
            busbw = tuple(float(tokens[i]) for i, h in enumerate(header) if h == "busbw")
        except ValueError:
            return f"a busbw value is not a number: {_excerpt(s)!r}"
        wrong: list[int] = []
        for i, h in enumerate(header):
            if h == "#wrong":
                if tokens[i].upper() == "N/A":
                    continue
                if not tokens[i].isdigit():
                    return f"a #wrong value is not a count: {_excerpt(s)!r}"
                wrong.append(int(tokens[i]))
        rows.append(_NcclRow(int(tokens[0]), busbw, tuple(wrong)))
    if header is None:
        first = next((ln.strip() for ln in lines if ln.strip()), "")
        return f"no all_reduce_perf table (a '# size count ... busbw' header): {_excerpt(first)!r}"
    if not rows:
        return "an all_reduce_perf table header but no rows (cut?)"
    return rows


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _EXCERPT else text[:_EXCERPT - 3] + "..."


# --------------------------------------------------------------------------------------------
# runners


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
    said = _excerpt(result.stderr or result.stdout) or "no output"
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
                                           f"{_excerpt(result.stderr) or findings[0].evidence}")]
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
        xids = [ln for ln in (kernel_log or "").splitlines() if _XID_MENTION.search(ln) or _XID.search(ln)]
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
        table = _parse_csv(gpu.stdout.strip(), GPU_QUERY_FIELDS, "nvidia-smi") if gpu.ran else "did not run"
        gpus = len(table.rows) if isinstance(table, _Table) else (expected_gpus or 0)
        findings += probe_nccl_tests(gpus=gpus, min_busbw_gbps=min_busbw_gbps)
    if kernel_log is not None:
        findings += classify_xids(kernel_log)
    return findings
