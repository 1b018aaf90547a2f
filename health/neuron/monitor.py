"""``neuron-monitor``'s first complete report: ECC, hardware errors, timeouts (a pure parser)."""

from __future__ import annotations

import json
from collections.abc import Callable

from health.model import Action, Finding, Status, excerpt, probe_failed
from health.neuron.ls import INSTANCE_TYPES
from health.neuron.values import json_int, json_obj, json_str

# Corrected ECC errors are "recoverable" (the monitor's "transient" class): record them only
# (docs/probe-formats.md §1.2). No Neuron threshold is published: this one is ours, per device per
# report, and only ever DEGRADED.
ECC_CORRECTED_DEGRADED = 100


_ECC = {  # counter -> (memory, action when > 0)
    "mem_ecc_uncorrected": ("HBM", Action.REPLACE),
    "sram_ecc_uncorrected": ("SRAM", Action.REPLACE),
    "mem_ecc_repairable_uncorrected": ("HBM, repairable: reload the driver or reboot", Action.REBOOT),
}


def check_neuron_monitor(text: str, *, expected_devices: int | None = None,
                         corrected_degraded_at: int = ECC_CORRECTED_DEGRADED) -> list[Finding]:
    """Judge the first complete neuron-monitor report in ``text`` (one pretty-printed report,
    or a JSON-lines stream). See the module docstring for the rule."""
    report = first_report(text)
    if isinstance(report, str):
        return [probe_failed("neuron-monitor", report)]
    hw_info = json_obj(report.get("neuron_hardware_info"))
    system = json_obj(report.get("system_data"))
    counters = json_obj(system.get("neuron_hw_counters"))
    hw_error = json_str(hw_info.get("error"))
    if hw_error:
        also = json_str(counters.get("error"))
        also = f"; neuron_hw_counters.error: {also}" if also else ""
        return [Finding(probe="neuron-monitor", status=Status.UNHEALTHY, action=Action.REBOOT,
                        evidence=f"neuron_hardware_info.error: {excerpt(hw_error)}{also}")]
    if not counters:
        return [probe_failed("neuron-monitor", "the report has no system_data.neuron_hw_counters "
                                               "(metric group disabled in the config?)")]
    counters_error = json_str(counters.get("error"))
    if counters_error:
        return [probe_failed("neuron-monitor", f"neuron_hw_counters.error: {excerpt(counters_error)}")]
    devices = counters.get("neuron_devices")
    if not isinstance(devices, list) or not devices:
        return [probe_failed("neuron-monitor", "neuron_hw_counters lists no devices")]

    findings: list[Finding] = []
    instance = json_str(json_obj(report.get("instance_info")).get("instance_type"))
    count = json_int(hw_info.get("neuron_device_count"))
    known = INSTANCE_TYPES.get(instance)
    expected = expected_devices if expected_devices is not None else (known[0] if known else None)
    where = f" ({instance})" if instance else ""
    if expected is not None and count is not None and count < expected:
        findings.append(Finding(probe="neuron-monitor", status=Status.UNHEALTHY, action=Action.REBOOT,
                                evidence=f"neuron_device_count={count} of {expected} Neuron devices{where}"))

    corrected: list[str] = []
    ue_actions: set[Action] = set()  # the actions the uncorrected counters called for
    for i, dev in enumerate(devices):
        if not isinstance(dev, dict):
            return [probe_failed("neuron-monitor", f"neuron_hw_counters.neuron_devices[{i}] is not an "
                                                   f"object")]
        index = json_int(dev.get("neuron_device_index"))
        name = f"neuron_device {index if index is not None else i}"
        for key, raw in dev.items():
            if key == "neuron_device_index" or "ecc" not in key:
                continue
            value = json_int(raw)
            if value is None:
                return [probe_failed("neuron-monitor", f"{key} on {name} is not a count: {raw!r}")]
            if value <= 0:
                continue
            if "uncorrected" in key:
                # unknown counters (newer drivers) by their name: "repairable" ones a reboot clears
                fallback = "mem_ecc_repairable_uncorrected" if "repairable" in key else (
                    "sram_ecc_uncorrected" if "sram" in key else "mem_ecc_uncorrected")
                memory, action = _ECC.get(key, _ECC[fallback])
                ue_actions.add(action)
                findings.append(Finding(probe="neuron-monitor", status=Status.UNHEALTHY, action=action,
                                        evidence=f"{key}={value} on {name} ({memory})"))
            elif "corrected" in key:
                memory = "SRAM" if "sram" in key else "HBM"
                if value >= corrected_degraded_at:
                    findings.append(Finding(
                        probe="neuron-monitor", status=Status.DEGRADED,
                        evidence=f"{key}={value} on {name} ({memory}; corrected, at or over "
                                 f"{corrected_degraded_at})"))
                else:
                    corrected.append(f"{key}={value} on {name}")

    runtimes = report.get("neuron_runtime_data")
    runtimes = runtimes if isinstance(runtimes, list) else []
    for rt in runtimes:
        findings += _runtime_findings(json_obj(rt), ue_actions)

    if any(f.status is not Status.HEALTHY for f in findings):
        return findings
    n_dev = count if count is not None else len(devices)
    note = f"; recorded: {', '.join(corrected[:4])}" if corrected else ""
    return [Finding(probe="neuron-monitor", status=Status.HEALTHY,
                    evidence=f"{n_dev} Neuron devices{where}, no uncorrected ECC errors; {len(runtimes)} "
                             f"runtime(s), no hardware errors{note}")]


def _runtime_findings(rt: dict[str, object], ue_actions: set[Action]) -> list[Finding]:
    tag = json_str(rt.get("neuron_runtime_tag")) or str(rt.get("pid", "?"))
    who = f"runtime {tag}"
    error = json_str(rt.get("error"))
    if error:
        return [Finding(probe="neuron-monitor", status=Status.DEGRADED,
                        evidence=f"cannot read {who}: {excerpt(error)}")]
    stats = json_obj(json_obj(rt.get("report")).get("execution_stats"))
    errors = json_obj(stats.get("error_summary"))
    summary = json_obj(stats.get("execution_summary"))
    out: list[Finding] = []
    hardware = json_int(errors.get("hardware")) or 0
    if hardware > 0:
        # Hardware errors are "such as uncorrectable ECC": replace, unless the counters show
        # only a repairable HBM error, which a driver reload or reboot clears.
        action = Action.REBOOT if ue_actions == {Action.REBOOT} else Action.REPLACE
        out.append(Finding(probe="neuron-monitor", status=Status.UNHEALTHY, action=action,
                           evidence=f"execution_stats.error_summary.hardware={hardware} ({who})"))
    timed_out = json_int(summary.get("timed_out")) or 0
    if timed_out > 0:
        out.append(Finding(probe="neuron-monitor", status=Status.DEGRADED,
                           evidence=f"execution_summary.timed_out={timed_out} ({who}): a hang here or on a "
                                    f"peer"))
    return out


def _looks_like_report(doc: dict[str, object]) -> bool:
    return any(k in doc for k in ("neuron_hardware_info", "system_data", "neuron_runtime_data"))


def first_report(text: str) -> dict[str, object] | str:
    """The first complete JSON object that looks like a neuron-monitor report, or why none."""
    body = text.strip()
    if not body:
        return "neuron-monitor printed nothing"
    first = _first_json_object(body, _looks_like_report)
    if first is None:
        return f"no complete JSON report in the output (truncated?): {excerpt(body.splitlines()[0])!r}"
    if not _looks_like_report(first):
        return f"not a neuron-monitor report (keys: {', '.join(list(first)[:6]) or 'none'})"
    return first


def _first_json_object(body: str, wanted: Callable[[dict[str, object]], bool]) -> dict[str, object] | None:
    """The first JSON object of ``body`` that is ``wanted``; else the first one at all (None:
    none). A stream of JSON lines whose first line was cut decodes an inner object of that
    line first: the whole lines after it are tried before that one is taken."""
    found: list[dict[str, object]] = []
    start = body.find("{")
    if start >= 0:
        try:
            doc, _ = json.JSONDecoder().raw_decode(body, start)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            if wanted(doc):
                return doc
            found.append(doc)
    for line in body.splitlines():  # JSON lines whose first line was cut
        if line.lstrip().startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                if wanted(doc):
                    return doc
                found.append(doc)
    return found[0] if found else None


