"""``neuron-ls``'s JSON or table: the devices and NeuronCores against the instance type's (a pure parser;
the rules: the table in health/neuron/__init__.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from health.model import Action, Finding, Status, excerpt, probe_failed
from health.neuron.values import json_int

# Instance family -> default logical NeuronCore config (else 1). trn2u and trn2n are Trainium2
# machines too: their neuron-ls may not print the config either.
DEFAULT_LNC: dict[str, int] = {"trn2": 2, "trn2u": 2, "trn2n": 2}

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


@dataclass(frozen=True, slots=True)
class LsInfo:
    cores_by_device: dict[int, int]  # neuron_device index -> NeuronCores it reports
    instance_type: str | None
    lnc: int | None


def check_neuron_ls(text: str, *, expected_devices: int | None = None, expected_cores: int | None = None,
                    instance_type: str | None = None) -> list[Finding]:
    """Count Neuron devices and NeuronCores in ``neuron-ls`` output (JSON or table) and
    compare them with the expectation. See the module docstring for the rule."""
    parsed = parse_neuron_ls(text)
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


def parse_neuron_ls(text: str) -> LsInfo | str:
    """The devices in neuron-ls output, or why it cannot be read."""
    body = text.strip()
    if not body:
        return "neuron-ls printed nothing"
    if body[0] in "[{":
        return _parse_neuron_ls_json(body)
    if "|" in body or "+--" in body:
        return _parse_neuron_ls_table(body)
    return f"unrecognised neuron-ls output: {excerpt(body.splitlines()[0])!r}"


def _parse_neuron_ls_json(body: str) -> LsInfo | str:
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
    lnc = json_int(top.get("logical_neuroncore_config"))
    itype = top.get("instance_type")
    for i, dev in enumerate(doc):
        if not isinstance(dev, dict):
            return f"neuron-ls JSON entry {i} is not an object"
        index = json_int(dev.get("neuron_device"))
        count = json_int(dev.get("nc_count"))
        ids = dev.get("neuroncore_ids")
        if count is None and isinstance(ids, list):
            count = len(ids)
        if index is None or count is None:
            return f"neuron-ls JSON entry {i} has no neuron_device / nc_count"
        if index in cores:
            return f"neuron-ls JSON lists neuron_device {index} twice"
        cores[index] = count
        lnc = lnc or json_int(dev.get("logical_neuroncore_config"))
    return LsInfo(cores, itype if isinstance(itype, str) and itype else None, lnc)


_BORDER = re.compile(r"^\+[-+=]+\+$")
_META = re.compile(r"^(instance-type|logical-neuroncore-config)\s*:\s*(\S+)\s*$")


def _parse_neuron_ls_table(body: str) -> LsInfo | str:
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
            return f"neuron-ls table row is malformed (truncated?): {excerpt(ln)!r}"
        if not cells[dev_col]:
            continue  # a further process row of the device above (--show-all-procs)
        index, count = json_int(cells[dev_col]), json_int(cells[core_col])
        if index is None or count is None:
            return f"neuron-ls table row has no device number / core count: {excerpt(ln)!r}"
        cores[index] = count
    if len(borders) < 3:
        return "neuron-ls table is not closed by a border (truncated?)"
    if not cores:
        return "neuron-ls table has a header but no device rows"
    return LsInfo(cores, meta.get("instance-type"), json_int(meta.get("logical-neuroncore-config")))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


