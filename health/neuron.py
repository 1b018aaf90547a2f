"""Neuron (Trainium / Inferentia) probes: parsers over the Neuron tools' output, and thin runners.

Every ``check_*`` is a pure parser: text in, ``Finding``s out; it never raises, and empty,
truncated or unrecognised output is ``probe_failed`` (UNKNOWN), never healthy. The runners
(``probe_*``, ``run_all``) only run a tool (an argv list, a timeout, never a shell) and hand
its output to the parser. Formats, field meanings and actions follow
``docs/probe-formats.md`` §1 (the Neuron SDK docs: neuron-ls.rst, neuron-monitor-user-guide.rst,
nccom-test.rst, nrt-troubleshoot.rst, the Neuron node-problem-detector rules).

==============  ==========================  ===================================================  ===========
probe           reads                       rule -> status                                       action
==============  ==========================  ===================================================  ===========
neuron-ls       ``neuron-ls`` JSON (``-j``  devices (and NeuronCores) against the expectation
                or ``--output-format        (``expected_devices``/``_cores``, else
                json``), else the table     ``INSTANCE_TYPES`` for the instance type given or
                (old and new column sets,   printed): fewer, or a gap in the device indices
                ``--topology``)             -> UNHEALTHY (HyperPod's agent reboots on a count     REBOOT
                                            mismatch); more than expected -> DEGRADED (the
                                            expectation is wrong)                                NONE
neuron-monitor  the first complete JSON     ``neuron_hardware_info.error`` set (no driver), or
                report (pretty JSON or      fewer devices than the instance type -> UNHEALTHY    REBOOT
                JSON lines)                 ``mem_ecc_uncorrected`` / ``sram_ecc_uncorrected``
                                            > 0 on a device -> UNHEALTHY                         REPLACE
                                            ``mem_ecc_repairable_uncorrected`` > 0 -> UNHEALTHY  REBOOT
                                            ``error_summary.hardware`` > 0 -> UNHEALTHY          REPLACE
                                            corrected ECC >= ``ECC_CORRECTED_DEGRADED`` on a
                                            device, ``execution_summary.timed_out`` > 0, a
                                            runtime it could not read -> DEGRADED                NONE
                                            hw counters unreadable -> UNKNOWN                    NONE
nccom-test      the all-reduce table        busbw at the LARGEST size (never "Avg bus
                (spaces or tabs,            bandwidth") under the floor (``min_busbw_gbps``,
                ``time(us)`` or             ``baseline_gbps * tolerance``: the higher)
                ``time:avg(us)``, optional  -> DEGRADED                                          NONE
                ``algorithm`` column) or    under ``far_below`` x the floor -> UNHEALTHY
                ``--report-to-json-file``   (HyperPod's deep check replaces such a node)         REPLACE
                JSON                        "Neuron DKMS Driver is not running!", "Failure
                                            running neuron-bench", "N errors found - test
                                            failed" -> UNHEALTHY                                 REBOOT
neuron-log      a runtime log or a kernel   each line against ``SIGNATURES`` (one table)         per row
                log (dmesg), as text
==============  ==========================  ===================================================  ===========

The log table ``SIGNATURES`` (first column of the row = its ``name``), status -> meaning:

- UNHEALTHY/REPLACE: hardware faults the Neuron docs answer with "terminate this instance": SRAM
  and HBM uncorrectable errors (NRT 1202, 1201), DMA abort (1203), a hang on compute
  ("execution timeout ... waiting for execution completion notification"), and every kernel
  ``NEURON_HW_ERR=`` line (SRAM/NC/HBM uncorrectable, DMA error; "permanent" in the NPD rules).
- UNHEALTHY/REBOOT: the repairable HBM error (NRT 1205: "reload the neuron driver or reboot"),
  a driver that is missing or not running, an unknown ``NEURON_HW_ERR`` type.
- DEGRADED/NONE: the node may be involved but cannot be blamed from its own log: a hang in
  collectives (NRT 1200, "missing collectives status": the doc says find the faulty PEER),
  "connection closed by remote peer", EFA/OFI initialisation failures, NRT_TIMEOUT, a generic
  NRT_EXEC_COMPLETED_WITH_ERR / NRT_HW_ERROR (look for the specific message), NeuronCores held
  by another process. Worth a look; never a drain.
- HEALTHY/NONE: recognised and not the node's fault: retrying timeouts while a peer compiles,
  the benign EFA ``DEREG_MR`` after a process exit, and job/configuration errors (bad
  collective layout, libnccom path, FI_EFA_FORK_SAFE, "Too many open files", DGE
  notifications, software NRT codes such as NRT_EXEC_OOB and NRT_EXEC_SW_NQ_OVERFLOW 1204).

Lines that match nothing produce nothing; a log with no known signature gives one HEALTHY
finding ("no known error signature"). A probe never remembers: "reboot, then replace if it
comes back" is the operator's (or the supervisor's) escalation, not this module's.

Tools and the exact argv (looked up in ``$TSUP_HEALTH_TOOLS`` first, then ``PATH``):

- ``neuron-ls --output-format json`` (Neuron >= 2.34), then ``neuron-ls --json-output`` (older),
  then ``neuron-ls`` (the table), 10 s each; the first that exits 0 with output is parsed.
- ``neuron-monitor`` (no config: every metric group, a report every 5 s); read until the first
  complete JSON report, then killed; 15 s at most.
- ``nccom-test -r <NeuronCores> -b 32MB -e 256MB -f 2 -n 5 -w 2 -d fp32 allr`` (only with
  ``run_bandwidth``), 50 s; bandwidth is judged at 256 MB, the largest size (docs/probe-formats.md §1.3).
  A largest size under 32 MiB is latency-bound: under the floor there is at most DEGRADED.

Only neuron-ls decides whether the node has Neuron devices (absent: ``no_devices``); with
neuron-ls present, a missing neuron-monitor or nccom-test is UNKNOWN (the probe asked for
could not run), and so is a non-zero exit after output that parsed healthy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from health.model import Action, Finding, Status, no_devices, probe_failed
from health.runner import ToolResult, find_tool, run_tool

# Instance type -> (Neuron devices, physical NeuronCores). neuron-ls and neuron-monitor count
# LOGICAL NeuronCores: physical / the logical NeuronCore config (LNC: 1 on trn1 and inf2, 2 by
# default on trn2, where neuron-ls prints it as ``logical-neuroncore-config``). Sources: trn1-arch,
# inf2-arch, trn2-arch in the Neuron docs (Trainium2: 8 physical NeuronCore-v3 per device).
INSTANCE_TYPES: dict[str, tuple[int, int]] = {
    "trn1.2xlarge": (1, 2),
    "trn1.32xlarge": (16, 32),
    "trn1n.32xlarge": (16, 32),
    "trn2.48xlarge": (16, 128),
    "trn2u.48xlarge": (16, 128),
    "trn2n.48xlarge": (16, 128),  # as printed by the neuron-ls doc's trn2 example
    "inf2.xlarge": (1, 2),
    "inf2.8xlarge": (1, 2),
    "inf2.24xlarge": (6, 12),
    "inf2.48xlarge": (12, 24),
}
# Instance family -> default logical NeuronCore config (else 1). trn2u and trn2n are Trainium2
# machines too: their neuron-ls may not print the config either.
DEFAULT_LNC: dict[str, int] = {"trn2": 2, "trn2u": 2, "trn2n": 2}

# Corrected ECC errors are "recoverable" (the monitor's "transient" class): record them only
# (docs/probe-formats.md §1.2). No Neuron threshold is published: this one is ours, per device per
# report, and only ever DEGRADED.
ECC_CORRECTED_DEGRADED = 100
FAR_BELOW = 0.5  # nccom-test busbw under this fraction of the floor: UNHEALTHY, not DEGRADED
JUDGED_SIZE = 32 << 20  # a largest size under this is latency-bound: at most DEGRADED

NEURON_LS_TIMEOUT_S = 10.0
NEURON_MONITOR_TIMEOUT_S = 15.0
NCCOM_TEST_TIMEOUT_S = 50.0
NCCOM_TEST_ARGS = ("-b", "32MB", "-e", "256MB", "-f", "2", "-n", "5", "-w", "2", "-d", "fp32", "allr")

_EXCERPT = 160
_MAX_OUTPUT = 8 << 20  # bytes of neuron-monitor output read at most


# --------------------------------------------------------------------------------------------
# neuron-ls


@dataclass(frozen=True, slots=True)
class _LsInfo:
    cores_by_device: dict[int, int]  # neuron_device index -> NeuronCores it reports
    instance_type: str | None
    lnc: int | None


def check_neuron_ls(text: str, *, expected_devices: int | None = None, expected_cores: int | None = None,
                    instance_type: str | None = None) -> list[Finding]:
    """Count Neuron devices and NeuronCores in ``neuron-ls`` output (JSON or table) and
    compare them with the expectation. See the module docstring for the rule."""
    parsed = _parse_neuron_ls(text)
    if isinstance(parsed, str):
        return [probe_failed("neuron-ls", parsed)]
    itype = instance_type or parsed.instance_type
    known = INSTANCE_TYPES.get(itype) if itype else None
    exp_devices = expected_devices if expected_devices is not None else (known[0] if known else None)
    if expected_cores is not None:
        exp_cores: int | None = expected_cores
    elif known and itype:
        exp_cores = known[1] // (parsed.lnc or DEFAULT_LNC.get(itype.split(".")[0], 1))
    else:
        exp_cores = None
    where = f" ({itype})" if itype else ""
    if instance_type and parsed.instance_type and instance_type != parsed.instance_type:
        where = f" ({instance_type} expected; neuron-ls says {parsed.instance_type})"
    if itype and not known and expected_devices is None:
        where = f" ({itype}: not in the known instance types)"
    devices = sorted(parsed.cores_by_device)
    n, cores = len(devices), sum(parsed.cores_by_device.values())

    if n == 0:
        exp = f", expected {exp_devices}" if exp_devices else ""
        return [Finding(probe="neuron-ls", status=Status.UNHEALTHY, action=Action.REBOOT,
                        evidence=f"no Neuron devices present{exp}{where} (driver not loaded?)")]
    if exp_devices is not None and n < exp_devices:
        missing = sorted(set(range(exp_devices)) - set(devices))
        gone = f"; missing: {_ids(missing)}" if missing else ""
        return [Finding(probe="neuron-ls", status=Status.UNHEALTHY, action=Action.REBOOT,
                        evidence=f"{n} of {exp_devices} Neuron devices present{where}{gone}")]
    gaps = sorted(set(range(devices[-1] + 1)) - set(devices))
    if gaps:
        return [Finding(probe="neuron-ls", status=Status.UNHEALTHY, action=Action.REBOOT,
                        evidence=f"{n} Neuron devices present{where}, device indices have gaps; "
                                 f"missing: {_ids(gaps)}")]
    if exp_devices is not None and n > exp_devices:
        return [Finding(probe="neuron-ls", status=Status.DEGRADED,
                        evidence=f"{n} Neuron devices present, expected {exp_devices}{where}: "
                                 f"check the expected instance type")]
    per_device = sorted(set(parsed.cores_by_device.values()))
    if exp_cores is not None and cores < exp_cores:
        return [Finding(probe="neuron-ls", status=Status.UNHEALTHY, action=Action.REBOOT,
                        evidence=f"{cores} of {exp_cores} NeuronCores present on {n} devices"
                                 f"{where}")]
    if len(per_device) > 1:
        odd = [d for d, c in parsed.cores_by_device.items() if c == per_device[0]]
        return [Finding(probe="neuron-ls", status=Status.UNHEALTHY, action=Action.REBOOT,
                        evidence=f"neuron_device {_ids(odd)} report {per_device[0]} NeuronCores, "
                                 f"others {per_device[-1]}{where}")]
    if exp_cores is not None and cores > exp_cores:
        return [Finding(probe="neuron-ls", status=Status.DEGRADED,
                        evidence=f"{cores} NeuronCores present, expected {exp_cores}{where}: "
                                 f"check the logical NeuronCore config")]
    if exp_devices is None:
        return [Finding(probe="neuron-ls", status=Status.HEALTHY,
                        evidence=f"{n} Neuron devices, {cores} NeuronCores{where} "
                                 f"(no expected count given)")]
    return [Finding(probe="neuron-ls", status=Status.HEALTHY,
                    evidence=f"{n} of {exp_devices} Neuron devices present, {cores} "
                             f"NeuronCores{where}")]


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(map(str, ids[:16])) + (" ..." if len(ids) > 16 else "")


def _parse_neuron_ls(text: str) -> _LsInfo | str:
    """The devices in neuron-ls output, or why it cannot be read."""
    body = text.strip()
    if not body:
        return "neuron-ls printed nothing"
    if body[0] in "[{":
        return _parse_neuron_ls_json(body)
    if "|" in body or "+--" in body:
        return _parse_neuron_ls_table(body)
    return f"unrecognised neuron-ls output: {_excerpt(body.splitlines()[0])!r}"


def _parse_neuron_ls_json(body: str) -> _LsInfo | str:
    try:
        doc: object = json.loads(body)
    except ValueError as e:
        return f"neuron-ls JSON does not parse (truncated?): {e}"
    top: dict[str, object] = {}
    if isinstance(doc, dict):
        # ``--output-format json`` (Neuron >= 2.34): an object with instance-wide fields at the
        # top level and the devices in a list (its key is not documented yet: find it).
        top = doc
        lists = [v for v in doc.values() if isinstance(v, list) and v
                 and all(isinstance(d, dict) and "neuron_device" in d for d in v)]
        if not lists:
            empty = [k for k in ("neuron_devices", "devices") if doc.get(k) == []]
            if not empty:
                return "neuron-ls JSON object has no list of devices"
            lists = [[]]
        doc = lists[0]
    if not isinstance(doc, list):
        return f"neuron-ls JSON is a {type(doc).__name__}, not a list of devices"
    cores: dict[int, int] = {}
    lnc = _int(top.get("logical_neuroncore_config"))
    itype = top.get("instance_type")
    for i, dev in enumerate(doc):
        if not isinstance(dev, dict):
            return f"neuron-ls JSON entry {i} is not an object"
        index = _int(dev.get("neuron_device"))
        count = _int(dev.get("nc_count"))
        ids = dev.get("neuroncore_ids")
        if count is None and isinstance(ids, list):
            count = len(ids)
        if index is None or count is None:
            return f"neuron-ls JSON entry {i} has no neuron_device / nc_count"
        if index in cores:
            return f"neuron-ls JSON lists neuron_device {index} twice"
        cores[index] = count
        lnc = lnc or _int(dev.get("logical_neuroncore_config"))
    return _LsInfo(cores, itype if isinstance(itype, str) and itype else None, lnc)


_BORDER = re.compile(r"^\+[-+=]+\+$")
_META = re.compile(r"^(instance-type|logical-neuroncore-config)\s*:\s*(\S+)\s*$")


def _parse_neuron_ls_table(body: str) -> _LsInfo | str:
    lines = [ln.strip() for ln in body.splitlines()]
    meta = {m.group(1): m.group(2) for m in map(_META.match, lines) if m}
    borders = [i for i, ln in enumerate(lines) if _BORDER.match(ln)]
    if not borders:
        return "neuron-ls table has no +----+ border"
    start = borders[0]
    if len(borders) < 2:
        return "neuron-ls table header is not closed (truncated?)"
    header_end = borders[1]
    header_rows = [_cells(ln) for ln in lines[start + 1:header_end]]
    if not header_rows or any(len(r) != len(header_rows[0]) for r in header_rows):
        return "neuron-ls table header is malformed"
    names = [" ".join(filter(None, parts)).upper() for parts in zip(*header_rows, strict=True)]
    if "NEURON DEVICE" not in names or "NEURON CORES" not in names:
        return f"neuron-ls table has no NEURON DEVICE / NEURON CORES column: {names}"
    dev_col, core_col = names.index("NEURON DEVICE"), names.index("NEURON CORES")
    rows = lines[header_end + 1:borders[2] if len(borders) > 2 else len(lines)]
    cores: dict[int, int] = {}
    for ln in rows:
        cells = _cells(ln)
        if not ln.startswith("|") or len(cells) != len(names):
            return f"neuron-ls table row is malformed (truncated?): {_excerpt(ln)!r}"
        if not cells[dev_col]:
            continue  # a further process row of the device above (--show-all-procs)
        index, count = _int(cells[dev_col]), _int(cells[core_col])
        if index is None or count is None:
            return f"neuron-ls table row has no device number / core count: {_excerpt(ln)!r}"
        cores[index] = count
    if len(borders) < 3:
        return "neuron-ls table is not closed by a border (truncated?)"
    if not cores:
        return "neuron-ls table has a header but no device rows"
    return _LsInfo(cores, meta.get("instance-type"), _int(meta.get("logical-neuroncore-config")))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


# --------------------------------------------------------------------------------------------
# neuron-monitor

_ECC = {  # counter -> (memory, action when > 0)
    "mem_ecc_uncorrected": ("HBM", Action.REPLACE),
    "sram_ecc_uncorrected": ("SRAM", Action.REPLACE),
    "mem_ecc_repairable_uncorrected": ("HBM, repairable: reload the driver or reboot", Action.REBOOT),
}


def check_neuron_monitor(text: str, *, expected_devices: int | None = None,
                         corrected_degraded_at: int = ECC_CORRECTED_DEGRADED) -> list[Finding]:
    """Judge the first complete neuron-monitor report in ``text`` (one pretty-printed report,
    or a JSON-lines stream). See the module docstring for the rule."""
    report = _first_report(text)
    if isinstance(report, str):
        return [probe_failed("neuron-monitor", report)]
    hw_info = _obj(report.get("neuron_hardware_info"))
    system = _obj(report.get("system_data"))
    counters = _obj(system.get("neuron_hw_counters"))
    hw_error = _str(hw_info.get("error"))
    if hw_error:
        also = _str(counters.get("error"))
        also = f"; neuron_hw_counters.error: {also}" if also else ""
        return [Finding(probe="neuron-monitor", status=Status.UNHEALTHY, action=Action.REBOOT,
                        evidence=f"neuron_hardware_info.error: {_excerpt(hw_error)}{also}")]
    if not counters:
        return [probe_failed("neuron-monitor", "the report has no system_data.neuron_hw_counters "
                                               "(metric group disabled in the config?)")]
    counters_error = _str(counters.get("error"))
    if counters_error:
        return [probe_failed("neuron-monitor", f"neuron_hw_counters.error: {_excerpt(counters_error)}")]
    devices = counters.get("neuron_devices")
    if not isinstance(devices, list) or not devices:
        return [probe_failed("neuron-monitor", "neuron_hw_counters lists no devices")]

    findings: list[Finding] = []
    instance = _str(_obj(report.get("instance_info")).get("instance_type"))
    count = _int(hw_info.get("neuron_device_count"))
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
        index = _int(dev.get("neuron_device_index"))
        name = f"neuron_device {index if index is not None else i}"
        for key, raw in dev.items():
            if key == "neuron_device_index" or "ecc" not in key:
                continue
            value = _int(raw)
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
        findings += _runtime_findings(_obj(rt), ue_actions)

    if any(f.status is not Status.HEALTHY for f in findings):
        return findings
    n_dev = count if count is not None else len(devices)
    note = f"; recorded: {', '.join(corrected[:4])}" if corrected else ""
    return [Finding(probe="neuron-monitor", status=Status.HEALTHY,
                    evidence=f"{n_dev} Neuron devices{where}, no uncorrected ECC errors; {len(runtimes)} "
                             f"runtime(s), no hardware errors{note}")]


def _runtime_findings(rt: dict[str, object], ue_actions: set[Action]) -> list[Finding]:
    tag = _str(rt.get("neuron_runtime_tag")) or str(rt.get("pid", "?"))
    who = f"runtime {tag}"
    error = _str(rt.get("error"))
    if error:
        return [Finding(probe="neuron-monitor", status=Status.DEGRADED,
                        evidence=f"cannot read {who}: {_excerpt(error)}")]
    stats = _obj(_obj(rt.get("report")).get("execution_stats"))
    errors = _obj(stats.get("error_summary"))
    summary = _obj(stats.get("execution_summary"))
    out: list[Finding] = []
    hardware = _int(errors.get("hardware")) or 0
    if hardware > 0:
        # Hardware errors are "such as uncorrectable ECC": replace, unless the counters show
        # only a repairable HBM error, which a driver reload or reboot clears.
        action = Action.REBOOT if ue_actions == {Action.REBOOT} else Action.REPLACE
        out.append(Finding(probe="neuron-monitor", status=Status.UNHEALTHY, action=action,
                           evidence=f"execution_stats.error_summary.hardware={hardware} ({who})"))
    timed_out = _int(summary.get("timed_out")) or 0
    if timed_out > 0:
        out.append(Finding(probe="neuron-monitor", status=Status.DEGRADED,
                           evidence=f"execution_summary.timed_out={timed_out} ({who}): a hang here or on a "
                                    f"peer"))
    return out


def _looks_like_report(doc: dict[str, object]) -> bool:
    return any(k in doc for k in ("neuron_hardware_info", "system_data", "neuron_runtime_data"))


def _first_report(text: str) -> dict[str, object] | str:
    """The first complete JSON object that looks like a neuron-monitor report, or why none."""
    body = text.strip()
    if not body:
        return "neuron-monitor printed nothing"
    first = _first_json_object(body, _looks_like_report)
    if first is None:
        return f"no complete JSON report in the output (truncated?): {_excerpt(body.splitlines()[0])!r}"
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


def _obj(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def _str(value: object) -> str:
    return value.strip() if isinstance(value, str) else ""


# --------------------------------------------------------------------------------------------
# nccom-test

_DRIVER_DOWN = re.compile(r"Neuron DKMS Driver is not running")
_BENCH_FAILED = re.compile(r"Failure running neuron-bench.*")
_TEST_FAILED = re.compile(r"\d+ errors? found - test failed")


def check_nccom_test(text: str, *, min_busbw_gbps: float | None = None, baseline_gbps: float | None = None,
                     tolerance: float = 0.8, far_below: float = FAR_BELOW) -> list[Finding]:
    """Bus bandwidth at the largest message size of an nccom-test all-reduce run (the table
    or ``--report-to-json-file`` JSON), against ``max(min_busbw_gbps, baseline_gbps * tolerance)``."""
    body = text.strip()
    if not body:
        return [probe_failed("nccom-test", "nccom-test printed nothing")]
    for pattern in (_DRIVER_DOWN, _BENCH_FAILED, _TEST_FAILED):
        m = pattern.search(body)
        if m:
            line = next(ln for ln in body.splitlines() if pattern.search(ln))
            return [Finding(probe="nccom-test", status=Status.UNHEALTHY, action=Action.REBOOT,
                            evidence=f"nccom-test failed: {_excerpt(line.strip())}")]
    rows = _nccom_rows_json(body) if body[0] == "{" else _nccom_rows_text(body)
    if isinstance(rows, str):
        return [probe_failed("nccom-test", rows)]
    size, busbw = max(rows)
    floors = [f for f in (min_busbw_gbps, baseline_gbps * tolerance if baseline_gbps is not None else None)
              if f is not None]
    at = f"busbw {busbw:.2f} GB/s at {_size(size)} (largest size of {len(rows)})"
    if not floors:
        return [Finding(probe="nccom-test", status=Status.HEALTHY, evidence=f"{at}; no floor given")]
    floor = max(floors)
    if busbw < floor * far_below and size >= JUDGED_SIZE:
        return [Finding(probe="nccom-test", status=Status.UNHEALTHY, action=Action.REPLACE,
                        evidence=f"{at}: under {far_below:g} x the floor {floor:.2f} GB/s")]
    if busbw < floor:
        small = f" (sizes under {_size(JUDGED_SIZE)} are latency-bound)" if size < JUDGED_SIZE else ""
        return [Finding(probe="nccom-test", status=Status.DEGRADED,
                        evidence=f"{at}: under the floor {floor:.2f} GB/s{small}")]
    return [Finding(probe="nccom-test", status=Status.HEALTHY, evidence=f"{at}; floor {floor:.2f} GB/s")]


def _nccom_rows_text(body: str) -> list[tuple[int, float]] | str:
    lines = body.splitlines()
    header_at = next((i for i, ln in enumerate(lines) if "size(B)" in ln and "busbw" in ln), None)
    if header_at is None:
        return f"no nccom-test result table: {_excerpt(lines[0])!r}"
    names = lines[header_at].split()
    size_col = names.index("size(B)")
    bw_col = next((i for i, n in enumerate(names) if n.startswith("busbw")), -1)
    rows: list[tuple[int, float]] = []
    footer = False
    for ln in lines[header_at + 1:]:
        parts = ln.split()
        if not parts:
            continue
        if ln.strip().startswith("Avg bus bandwidth"):
            footer = True
            break
        if len(parts) < len(names) or not parts[size_col].isdigit():
            return f"nccom-test result row is malformed: {_excerpt(ln.strip())!r}"
        try:
            rows.append((int(parts[size_col]), float(parts[bw_col])))
        except ValueError:
            return f"nccom-test result row is malformed: {_excerpt(ln.strip())!r}"
    if not rows:
        return "nccom-test result table has a header but no rows"
    if not footer:
        return "nccom-test output has no 'Avg bus bandwidth' line (truncated?)"
    return rows


def _nccom_rows_json(body: str) -> list[tuple[int, float]] | str:
    try:
        doc: object = json.loads(body)
    except ValueError as e:
        return f"nccom-test JSON report does not parse (truncated?): {e}"
    results = _obj(doc).get("results")
    if not isinstance(results, list) or not results:
        return "nccom-test JSON report has no results"
    rows: list[tuple[int, float]] = []
    for i, r in enumerate(results):
        row = _obj(r)
        size, bw = _int(row.get("size(B)")), row.get("busbw(GB/s)")
        if size is None or isinstance(bw, bool) or not isinstance(bw, int | float):
            return f"nccom-test JSON result {i} has no size(B) / busbw(GB/s)"
        rows.append((size, float(bw)))
    return rows


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------------------------
# logs: the one signature table


@dataclass(frozen=True, slots=True)
class Signature:
    name: str
    pattern: re.Pattern[str]
    status: Status
    action: Action
    meaning: str


# NRT status codes (nrt_status.rst) that the runtime logs by name ("Failure: NRT_EXEC_OOB in
# nrt_execute()") or by number ("completed with err: 5"): code -> (name, status, action, meaning).
NRT_CODES: dict[int, tuple[str, Status, Action, str]] = {
    5: ("NRT_TIMEOUT", Status.DEGRADED, Action.NONE, "an execution timed out (a hang here or on a peer)"),
    6: ("NRT_HW_ERROR", Status.DEGRADED, Action.NONE,
        "hardware error reported: look for the specific message"),
    1002: ("NRT_EXEC_BAD_INPUT", Status.HEALTHY, Action.NONE, "bad input to the model: a job error"),
    1003: ("NRT_EXEC_COMPLETED_WITH_NUM_ERR", Status.HEALTHY, Action.NONE, "numerical error: a job error"),
    1004: ("NRT_EXEC_COMPLETED_WITH_ERR", Status.DEGRADED, Action.NONE,
           "execution completed with an error: look for the specific message"),
    1005: ("NRT_EXEC_NC_BUSY", Status.HEALTHY, Action.NONE, "NeuronCore busy: a job error"),
    1006: ("NRT_EXEC_OOB", Status.HEALTHY, Action.NONE, "out-of-bounds access: a software error"),
    1200: ("NRT_EXEC_HW_ERR_COLLECTIVES", Status.DEGRADED, Action.NONE,
           "hang in collectives: the faulty node may be a peer"),
    1201: ("NRT_EXEC_HW_ERR_HBM_UE", Status.UNHEALTHY, Action.REPLACE, "uncorrectable HBM error"),
    1202: ("NRT_EXEC_HW_ERR_NC_UE", Status.UNHEALTHY, Action.REPLACE,
           "uncorrectable NeuronCore (SRAM) error"),
    1203: ("NRT_EXEC_HW_ERR_DMA_ABORT", Status.UNHEALTHY, Action.REPLACE, "DMA engine abort"),
    1204: ("NRT_EXEC_SW_NQ_OVERFLOW", Status.HEALTHY, Action.NONE,
           "notification queue overflow: a software error"),
    1205: ("NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE", Status.UNHEALTHY, Action.REBOOT,
           "repairable uncorrectable HBM error: reload the driver or reboot"),
    1206: ("NRT_NETWORK_PROXY_FAILURE", Status.DEGRADED, Action.NONE,
           "network proxy failure (EFA or a peer)"),
}


def _sig(name: str, pattern: str, status: Status, action: Action, meaning: str) -> Signature:
    return Signature(name, re.compile(pattern), status, action, meaning)


_U, _D, _H = Status.UNHEALTHY, Status.DEGRADED, Status.HEALTHY
_KNOWN_HW_ERR = r"(?:SRAM_UNCORRECTABLE_ERROR|NC_UNCORRECTABLE_ERROR|HBM_UNCORRECTABLE_ERROR|DMA_ERROR)\b"
_REPAIRABLE = r"(?:reload the neuron driver|reboot your EC2 instance)"
_NRT_NUMBER = r"\b(?i:completed with err(?:or)?|nrt[ _]status(?: code)?)\s*[:=]?\s*"  # "... with err: 5"

SIGNATURES: tuple[Signature, ...] = (
    # hardware: replace
    _sig("sram-ue", r"Uncorrectable memory error is detected", _U, Action.REPLACE,
         "uncorrectable SRAM error (NRT 1202)"),
    _sig("hbm-ue", rf"Uncorrectable HBM memory error is detected(?!.*{_REPAIRABLE})", _U, Action.REPLACE,
         "uncorrectable HBM error (NRT 1201)"),
    _sig("dma-abort", r"DMA [TR]X engine \d+ is in an abort state", _U, Action.REPLACE,
         "DMA engine abort (NRT 1203)"),
    _sig("compute-hang", r"(?:execution|inference) timeout \(\d+ ms\) on Neuron Device \d+ NC \d+"
                         r".*waiting for execution completion notification", _U, Action.REPLACE,
         "hang on compute (execution timeout)"),
    _sig("kernel-sram-ue", r"NEURON_HW_ERR=SRAM_UNCORRECTABLE_ERROR\b", _U, Action.REPLACE,
         "kernel: SRAM uncorrectable error"),
    _sig("kernel-nc-ue", r"NEURON_HW_ERR=NC_UNCORRECTABLE_ERROR\b", _U, Action.REPLACE,
         "kernel: NeuronCore uncorrectable error"),
    _sig("kernel-hbm-ue", r"NEURON_HW_ERR=HBM_UNCORRECTABLE_ERROR\b", _U, Action.REPLACE,
         "kernel: HBM uncorrectable error"),
    _sig("kernel-dma", r"NEURON_HW_ERR=DMA_ERROR\b", _U, Action.REPLACE, "kernel: DMA error"),
    _sig("kernel-hw-terminate", rf"NEURON_HW_ERR=(?!{_KNOWN_HW_ERR})\w+.*action=TERMINATE_INSTANCE", _U,
         Action.REPLACE, "kernel: Neuron hardware error, action=TERMINATE_INSTANCE"),
    # soft hardware / driver state: reboot
    _sig("hbm-ue-repairable", rf"Uncorrectable HBM memory error is detected.*{_REPAIRABLE}", _U,
         Action.REBOOT, "repairable uncorrectable HBM error (NRT 1205): reload the driver or reboot"),
    _sig("kernel-hw-other", rf"NEURON_HW_ERR=(?!{_KNOWN_HW_ERR})\w+(?!.*action=TERMINATE_INSTANCE)", _U,
         Action.REBOOT, "kernel: unknown Neuron hardware error"),
    _sig("driver-not-running", r"Neuron DKMS Driver is not running", _U, Action.REBOOT,
         "the Neuron driver is not running"),
    _sig("driver-missing", r"Unable to determine Neuron Driver version", _U, Action.REBOOT,
         "the Neuron driver is missing"),
    # the node may be involved, its own log cannot tell: never a drain
    _sig("collectives-hang", r"missing collectives status|suspected hang in collectives", _D, Action.NONE,
         "hang in collectives (NRT 1200): the faulty node may be a peer"),
    _sig("stuck-after-collectives", r"is stuck after all collectives operation", _D, Action.NONE,
         "execution stuck after its collectives: a hang here or on a peer"),
    _sig("peer-closed", r"connection closed by remote peer", _D, Action.NONE,
         "another rank died: restart from the checkpoint, look at the peer"),
    _sig("bootstrap", r"failed neuronBootstrapRecv", _D, Action.NONE, "bootstrap with the peers failed"),
    _sig("efa-init", r"OFI plugin initNet\(\) failed", _D, Action.NONE,
         "EFA not initialised (configuration, or an EFA fault: check the EFA count)"),
    _sig("efa-channels", r"has less channels than this replica group", _D, Action.NONE,
         "too few EFA channels (configuration, or missing EFA devices)"),
    _sig("cores-busy", r"NeuronCore\(s\) not available", _D, Action.NONE,
         "NeuronCores held by another process (a leftover run?)"),
    # recognised, not the node's fault
    _sig("rx-timeout", r"Timeout waiting for RX", _H, Action.NONE,
         "transient: a peer may still be compiling"),
    _sig("incoming-timeout", r"Timeout waiting for incoming connection", _H, Action.NONE,
         "transient: a peer may still be compiling"),
    _sig("connect-retry", r"Connect to \S+ failed - retrying", _H, Action.NONE,
         "transient: a peer is not listening yet"),
    _sig("efa-dereg", r"Failed to process command DEREG_MR", _H, Action.NONE, "benign after a process exit"),
    _sig("libnccom", r"Error opening libnccom\.so", _H, Action.NONE,
         "configuration: libnccom.so not on LD_LIBRARY_PATH"),
    _sig("fork-safe", r"requires setting FI_EFA_FORK_SAFE=1", _H, Action.NONE,
         "configuration: set FI_EFA_FORK_SAFE=1"),
    _sig("open-files", r"Too many open files", _H, Action.NONE, "configuration: raise the open-files ulimit"),
    _sig("collective-layout", r"failed \(\d+\) to init a collective algorithm", _H, Action.NONE,
         "configuration: the replica groups (TP/DP layout) do not fit"),
    _sig("dge-timeout", r"potentially caused by DGE notifications enabled", _H, Action.NONE,
         "configuration: disable DGE notifications (NEURON_RT_ENABLE_DGE_NOTIFICATIONS=0)"),
    # NRT status codes, by name or number
    *(_sig(f"nrt-{code}", rf"\b{name}\b|{_NRT_NUMBER}\(?{code}\b", status, action,
           f"{name} ({code}): {meaning}")
      for code, (name, status, action, meaning) in NRT_CODES.items()),
)

_PREFIXES = (
    re.compile(r"^\d{4}-\w{3}-\d{2} [\d:.]+\s+\d+:\d+\s+"),  # runtime log: time, pid:tid
    re.compile(r"^(?:ERROR|WARN\w*|INFO|DEBUG)\s+[A-Z]+:\S+\s+"),  # then level, MOD:function
    re.compile(r"^\[\s*[\d.]+\]\s*"),  # dmesg timestamp
)


def classify_log(text: str) -> list[Finding]:
    """Neuron runtime and kernel error signatures in a log, each mapped through ``SIGNATURES``:
    one finding per signature seen (the first line quoted, the count when more)."""
    if "\x00" in text:
        return [probe_failed("neuron-log", "the log holds binary data (NUL bytes), not text")]
    seen: dict[str, tuple[Signature, str, int]] = {}
    lines = text.splitlines()
    for line in lines:
        for sig in SIGNATURES:
            if sig.pattern.search(line):
                first, count = seen[sig.name][1:] if sig.name in seen else (line, 0)
                seen[sig.name] = (sig, first, count + 1)
    if not seen:
        return [Finding(probe="neuron-log", status=Status.HEALTHY,
                        evidence=f"no known error signature in {len(lines)} lines")]
    findings = []
    for sig, line, count in seen.values():
        times = f" (x{count})" if count > 1 else ""
        findings.append(Finding(probe="neuron-log", status=sig.status, action=sig.action,
                                evidence=f"{sig.meaning}{times}: {_message(line)}"))
    return findings


def _message(line: str) -> str:
    text = line.strip()
    for prefix in _PREFIXES:
        text = prefix.sub("", text, count=1)
    return _excerpt(text)


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _EXCERPT else text[:_EXCERPT - 3] + "..."


# --------------------------------------------------------------------------------------------
# runners


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
                                          f"{_excerpt(result.stderr or result.stdout) or 'no output'}")]
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
                    got_report = not isinstance(_first_report(out.decode(errors="replace")), str)
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
        return [probe_failed("neuron-monitor", f"{why}; stderr: {_excerpt(result.stderr)}")]
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
                                           f"{_excerpt(result.stderr) or findings[0].evidence}")]
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
        report = _first_report(monitor.stdout)
        info = {} if isinstance(report, str) else _obj(report.get("instance_info"))
        instance_type = None if _str(info.get("error")) else _str(info.get("instance_type")) or None
    findings = _ls_findings(ls, expected_devices=expected_devices, expected_cores=None,
                            instance_type=instance_type)
    known = INSTANCE_TYPES.get(instance_type) if instance_type else None
    expected = expected_devices if expected_devices is not None else (known[0] if known else None)
    findings += _monitor_findings(monitor, expected)
    if run_bandwidth:
        parsed = _parse_neuron_ls(ls.stdout) if ls.ran else "neuron-ls did not run"
        cores = sum(parsed.cores_by_device.values()) if isinstance(parsed, _LsInfo) else 0
        findings += probe_nccom_test(nworkers=max(cores, 2), min_busbw_gbps=min_busbw_gbps)
    if kernel_log is not None:
        findings += classify_log(kernel_log)
    return findings
