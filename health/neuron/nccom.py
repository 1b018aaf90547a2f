"""``nccom-test``'s all-reduce table: the bus bandwidth at the largest size against a floor (a pure
parser)."""

from __future__ import annotations

import json
import re

from health.model import Action, Finding, Status, excerpt, probe_failed
from health.neuron.values import json_int, json_obj

JUDGED_SIZE = 32 << 20  # a largest size under this is latency-bound: at most DEGRADED

FAR_BELOW = 0.5  # nccom-test busbw under this fraction of the floor: UNHEALTHY, not DEGRADED


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
                            evidence=f"nccom-test failed: {excerpt(line.strip())}")]
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


def nccom_busbw(text: str) -> float | str:
    """The bus bandwidth (GB/s) at the largest size of an nccom-test run that passed
    (``check_nccom_test``'s), or why there is none: the link test's figure for a pair of
    Trainium nodes (health/links.py; the multi-node form, ``-N 2 --hosts``)."""
    [finding] = check_nccom_test(text)
    if finding.status is not Status.HEALTHY:
        return finding.evidence
    body = text.strip()
    rows = _nccom_rows_json(body) if body[0] == "{" else _nccom_rows_text(body)
    assert not isinstance(rows, str)  # check_nccom_test read them
    return max(rows)[1]


def _nccom_rows_text(body: str) -> list[tuple[int, float]] | str:
    lines = body.splitlines()
    header_at = next((i for i, ln in enumerate(lines) if "size(B)" in ln and "busbw" in ln), None)
    if header_at is None:
        return f"no nccom-test result table: {excerpt(lines[0])!r}"
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
            return f"nccom-test result row is malformed: {excerpt(ln.strip())!r}"
        try:
            rows.append((int(parts[size_col]), float(parts[bw_col])))
        except ValueError:
            return f"nccom-test result row is malformed: {excerpt(ln.strip())!r}"
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
    results = json_obj(doc).get("results")
    if not isinstance(results, list) or not results:
        return "nccom-test JSON report has no results"
    rows: list[tuple[int, float]] = []
    for i, r in enumerate(results):
        row = json_obj(r)
        size, bw = json_int(row.get("size(B)")), row.get("busbw(GB/s)")
        if size is None or isinstance(bw, bool) or not isinstance(bw, int | float):
            return f"nccom-test JSON result {i} has no size(B) / busbw(GB/s)"
        rows.append((size, float(bw)))
    return rows


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
