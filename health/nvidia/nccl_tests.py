"""nccl-tests' ``all_reduce_perf`` output: a pure parser (the bus bandwidth at the largest size,
against a floor)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from health.model import Action, Finding, Status, excerpt, probe_failed

_U, _D, _H = Status.UNHEALTHY, Status.DEGRADED, Status.HEALTHY


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
                        evidence=f"all_reduce_perf failed: {excerpt(quote)}")]
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


def nccl_busbw(text: str) -> float | str:
    """The bus bandwidth (GB/s) at the largest size of a run that passed, the lower of its
    out-of-place and in-place figures (``check_nccl_tests``'s); or why there is none: the
    run failed, returned wrong data or was cut off. The link test's figure for a pair
    (health/links.py), from the output of its rank 0 (``srun --mpi=pmix``: one task a
    GPU, one process prints)."""
    [finding] = check_nccl_tests(text)
    if finding.status is not _H:
        return finding.evidence
    lines = [_NCCL_PREFIX.sub("", ln, count=1).rstrip() for ln in text.splitlines()]
    rows = _nccl_rows(lines)
    assert not isinstance(rows, str)  # check_nccl_tests read them
    largest = max(r.size for r in rows)
    return min(b for r in rows if r.size == largest for b in r.busbw)


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
            return f"a table row has {len(tokens)} columns, the header {len(header)} (cut?): {excerpt(s)!r}"
        try:
            busbw = tuple(float(tokens[i]) for i, h in enumerate(header) if h == "busbw")
        except ValueError:
            return f"a busbw value is not a number: {excerpt(s)!r}"
        wrong: list[int] = []
        for i, h in enumerate(header):
            if h == "#wrong":
                if tokens[i].upper() == "N/A":
                    continue
                if not tokens[i].isdigit():
                    return f"a #wrong value is not a count: {excerpt(s)!r}"
                wrong.append(int(tokens[i]))
        rows.append(_NcclRow(int(tokens[0]), busbw, tuple(wrong)))
    if header is None:
        first = next((ln.strip() for ln in lines if ln.strip()), "")
        return f"no all_reduce_perf table (a '# size count ... busbw' header): {excerpt(first)!r}"
    if not rows:
        return "an all_reduce_perf table header but no rows (cut?)"
    return rows


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"
