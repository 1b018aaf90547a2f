"""The all-reduce probe's report, read back: what rank 0 of ``python -m health.allreduce
--json`` prints (health/allreduce.py), checked for consistency. Pure and free of torch:
the controller reads the link test's reports with it (health/links.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from health.model import excerpt

PROBE = "allreduce"


@dataclass(frozen=True, slots=True)
class Report:
    """Rank 0's ``--json`` report, checked: its rows (bytes, busbw GB/s, wrong elements)
    and the bus bandwidth at the largest size."""

    backend: str
    world_size: int
    rows: tuple[tuple[int, float, int], ...]
    largest: int  # bytes
    busbw_gbps: float  # at the largest size

    @property
    def wrong(self) -> int:
        return sum(w for _, _, w in self.rows)


def read_report(text: str) -> Report | str:
    """The report in ``text`` (the last JSON object of rank 0's output), or why there is
    none: the run failed, printed nothing, was cut off, or says something inconsistent."""
    doc = _last_json_object(text)
    if isinstance(doc, str):
        return doc
    if doc.get("error"):
        return f"the all-reduce run failed: {excerpt(str(doc['error']))}"
    backend, world, results = doc.get("backend"), doc.get("world_size"), doc.get("results")
    if (not isinstance(backend, str) or not isinstance(world, int) or isinstance(world, bool)
            or not isinstance(results, list) or not results):
        return "not an all-reduce report (backend, world_size, results)"
    if world < 2:
        return f"world_size {world}: a single rank moves nothing over a bus"
    rows: list[tuple[int, float, int]] = []  # bytes, busbw, wrong
    for i, r in enumerate(results):
        row = _row(r)
        if isinstance(row, str):
            return f"results[{i}] {row}: {excerpt(str(r))}"
        rows.append(row)
    nbytes, busbw, _ = max(rows, key=lambda row: row[0])
    stated = doc.get("busbw_gbps_at_largest")
    if not (_is_num(stated) and math.isclose(float(stated), busbw, rel_tol=1e-6, abs_tol=1e-9)):
        return (f"busbw_gbps_at_largest {stated!r} is not the busbw at the largest size "
                f"({busbw!r} at {nbytes} B)")
    return Report(backend=backend, world_size=world, rows=tuple(rows), largest=nbytes, busbw_gbps=busbw)


def _row(r: object) -> tuple[int, float, int] | str:
    """(bytes, busbw, wrong) of one result, or what is wrong with it."""
    if not isinstance(r, dict):
        return "is not an object"
    nbytes, t_us, busbw, wrong = r.get("bytes"), r.get("time_us"), r.get("busbw_gbps"), r.get("wrong", 0)
    if not (isinstance(nbytes, int) and _is_num(t_us) and _is_num(busbw) and isinstance(wrong, int)):
        return "lacks bytes/time_us/busbw_gbps"
    if isinstance(nbytes, bool) or isinstance(wrong, bool):
        return "has a boolean where a count belongs"
    if nbytes <= 0 or float(t_us) <= 0 or float(busbw) < 0 or wrong < 0:
        return "has a non-positive size or time"
    return nbytes, float(busbw), wrong


def _last_json_object(text: str) -> dict[str, Any] | str:
    body = text.strip()
    if not body:
        return "the all-reduce probe printed nothing"
    candidates = [body, *reversed([ln.strip() for ln in body.splitlines() if ln.strip().startswith("{")])]
    for c in candidates:
        try:
            doc = json.loads(c)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return f"no complete JSON object in the output (truncated?): {excerpt(body.splitlines()[-1])!r}"


def _is_num(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
