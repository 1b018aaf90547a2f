"""nvidia-smi's GPU query and remapped-rows query: a pure parser each (the rules: the table in
health/nvidia/__init__.py)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from health.model import Action, Finding, Status, excerpt, probe_failed

_U, _D, _H = Status.UNHEALTHY, Status.DEGRADED, Status.HEALTHY


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


_NO_DRIVER = re.compile(r"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
                        r"|couldn't communicate with the NVIDIA driver|Failed to initialize NVML.*")
_NO_DEVICES = re.compile(r"^No devices were found\s*$", re.MULTILINE)
_GPU_LOST = re.compile(r"Unable to determine the device handle for GPU.*|.*\bGPU is lost\b.*", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Table:
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
                        evidence=f"the NVIDIA driver is not usable: {excerpt(_line_of(body, m.start()))}")]
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
    table = (Table(GPU_QUERY_FIELDS, ()) if none_found
             else parse_csv("\n".join(ln for ln in body.splitlines() if ln.strip() not in lost),
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
                                evidence=f"a GPU is lost: {excerpt(lost[0])}"))
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
    table = parse_csv(body, REMAPPED_ROWS_FIELDS, "nvidia-smi")
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


def parse_csv(body: str, known: Sequence[str], tool: str) -> Table | str:
    """nvidia-smi CSV: a header (names, optional ``[unit]``) then rows; or rows only, whose
    columns must then be ``known``. Returns the table, or why it cannot be read."""
    lines = [ln.strip() for ln in body.splitlines() if ln.strip()]
    if not lines:
        return f"{tool} printed no CSV"
    first = [c.strip() for c in lines[0].split(",")]
    if len(first) < 2:
        return f"not {tool} CSV output: {excerpt(lines[0])!r}"
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
                    f"{excerpt(lines[0])!r}")
    if len(set(fields)) != len(fields):
        return "the CSV header names a column twice"
    rows = []
    for n, line in enumerate(data, 1):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            return (f"row {n} has {len(cells)} values, the header {len(fields)} (truncated?): "
                    f"{excerpt(line)!r}")
        rows.append(dict(zip(fields, cells, strict=True)))
    if has_header and not rows:
        return "a CSV header but no GPU rows (truncated?)"
    return Table(fields, tuple(rows))


def _field_name(cell: str) -> str:
    return re.sub(r"\s*\[[^\]]*\]$", "", cell.strip()).lower()


def _line_of(body: str, pos: int) -> str:
    start = body.rfind("\n", 0, pos) + 1
    end = body.find("\n", pos)
    return body[start:end if end >= 0 else len(body)]
