"""All-reduce bus bandwidth with torch.distributed, for nodes without nccl-tests.

Run one process per GPU under torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK``)::

    torchrun --standalone --nproc_per_node=8 -m health.allreduce --sizes 64M,256M,1G --json

Backend ``nccl`` when CUDA is available (each rank on ``cuda:LOCAL_RANK``), else ``gloo`` on
the CPU; ``--backend`` forces one. Across nodes, a gloo rank binds to the interface its
route to ``MASTER_ADDR`` leaves by, unless ``GLOO_SOCKET_IFNAME`` names one (gloo would
otherwise take the address the host's name resolves to, which the other nodes may not
reach). For every size: ``--warmup`` untimed all-reduces, then
``--iters`` timed ones of a float32 tensor (SUM, in place); the time of a size is the mean per
iteration on the slowest rank (a collective ends when its last rank does). Then one checked
all-reduce: rank r contributes r + 1 everywhere, every element must come back as n(n + 1)/2;
the elements that do not are counted as ``wrong`` (nccl-tests' ``#wrong``).

Bandwidth follows the nccl-tests convention (its doc/PERFORMANCE.md), GB = 1e9 bytes:

- ``algbw = bytes / time``: the tensor size over the time of one all-reduce;
- ``busbw = algbw * 2 * (n - 1) / n`` for n ranks: a ring all-reduce moves every byte
  2(n - 1)/n times over the slowest link, so busbw is comparable across rank counts and with
  the hardware's link bandwidth (nccl-tests' ``busbw`` column).

Rank 0 prints one JSON object with ``--json``::

    {"probe": "allreduce", "backend": "nccl", "world_size": 8, "device": "cuda", "dtype": "float32",
     "iters": 20, "warmup": 5,
     "results": [{"bytes": 67108864, "time_us": 321.4, "algbw_gbps": 208.8, "busbw_gbps": 365.4,
                  "wrong": 0}, ...],
     "busbw_gbps_at_largest": 470.1}

(or ``{"probe": "allreduce", "error": "..."}`` when the run failed), and a table otherwise;
``health/allreduce_report.py`` reads it back (without torch, for the controller).
``check_allreduce`` grades that JSON the way ``health.nvidia.check_nccl_tests`` grades
all_reduce_perf: the bus bandwidth at the LARGEST size (smaller sizes are latency-bound).
With ``--min-busbw-gbps`` rank 0 grades its own run and exits 0 healthy, 1 degraded, 2
unhealthy or unknown; otherwise every rank exits 0 after a run and 2 when it failed.

torch is imported inside the functions that need it, never when this module is imported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from health.allreduce_report import PROBE, read_report
from health.model import EXIT_CODES, Action, Finding, Status, probe_failed, verdict

DEFAULT_SIZES = "1M,16M,64M"
DTYPE_BYTES = 4  # float32
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def algorithm_bandwidth(nbytes: int, seconds: float) -> float:
    """GB/s (1e9 bytes) of one all-reduce of ``nbytes`` that took ``seconds``."""
    if nbytes < 0 or not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"need bytes >= 0 and a positive time, got {nbytes} B in {seconds} s")
    return nbytes / seconds / 1e9


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth in GB/s: ``algbw * 2 * (world - 1) / world``."""
    if world < 1:
        raise ValueError(f"need at least one rank, got {world}")
    return algorithm_bandwidth(nbytes, seconds) * 2 * (world - 1) / world


def parse_size(text: str) -> int:
    """``64K``, ``1M``, ``1G`` (binary, as nccl-tests reads ``-b``/``-e``) or plain bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 64K, 16M, 1G)")
    n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if n < DTYPE_BYTES:
        raise ValueError(f"size {text!r} is under one float32 element")
    return n


def check_allreduce(text: str, *, min_busbw_gbps: float | None = None, baseline_gbps: float | None = None,
                    tolerance: float = 0.8) -> list[Finding]:
    """Grade rank 0's ``--json`` output: wrong elements -> UNHEALTHY/REPLACE (corrupt data);
    busbw at the largest size under ``max(min_busbw_gbps, baseline_gbps * tolerance)`` ->
    DEGRADED; a failed, empty, truncated or inconsistent report -> UNKNOWN."""
    report = read_report(text)
    if isinstance(report, str):
        return [probe_failed(PROBE, report)]
    rows, nbytes, busbw = report.rows, report.largest, report.busbw_gbps
    where = f"{report.backend}, {report.world_size} ranks"
    bad = [(n, w) for n, _, w in rows if w]
    if bad:
        n, w = bad[0]
        return [Finding(probe=PROBE, status=Status.UNHEALTHY, action=Action.REPLACE,
                        evidence=f"{w} wrong elements after an all-reduce of {_size(n)} ({where}): "
                                 f"corrupt data")]
    sizes = len({n for n, _, _ in rows})
    at = f"busbw {busbw:.2f} GB/s at {_size(nbytes)} (largest of {sizes} sizes; {where})"
    floors = [f for f in (min_busbw_gbps, baseline_gbps * tolerance if baseline_gbps is not None else None)
              if f is not None]
    if not floors:
        return [Finding(probe=PROBE, status=Status.HEALTHY, evidence=f"{at}; no floor given")]
    floor = max(floors)
    if busbw < floor:
        return [Finding(probe=PROBE, status=Status.DEGRADED,
                        evidence=f"{at}: under the floor {floor:.2f} GB/s")]
    return [Finding(probe=PROBE, status=Status.HEALTHY,
                    evidence=f"{at}: at or over the floor {floor:.2f} GB/s")]


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"




# --------------------------------------------------------------------------------------------
# the measurement (torch, imported lazily)


def measure(sizes: Sequence[int], *, iters: int, warmup: int, backend: str,
            budget_s: float | None = None) -> dict[str, Any]:
    """Run the all-reduces on an initialised process group; every rank returns the same
    report. ``budget_s``: the timed all-reduces of a size fit in about that long (fewer
    than ``iters`` on a slow link, at least one), from one timed first."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    results = []
    for size in sizes:
        count = max(size // DTYPE_BYTES, 1)
        nbytes = count * DTYPE_BYTES
        buf = torch.zeros(count, dtype=torch.float32, device=device)  # zeros stay zeros: no overflow
        for _ in range(warmup):
            dist.all_reduce(buf)
        sync()
        dist.all_reduce(torch.zeros(1, device=device))  # line the ranks up before the clock starts
        sync()
        rounds = iters if budget_s is None else _rounds_in(budget_s, iters, buf, sync)
        began = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(buf)
        sync()
        elapsed = torch.tensor([(time.perf_counter() - began) / rounds], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = float(elapsed.item())

        buf.fill_(rank + 1)
        dist.all_reduce(buf)
        wrong = int((buf != world * (world + 1) / 2).sum().item())
        dist.all_reduce(w := torch.tensor([wrong], dtype=torch.int64, device=device))
        results.append({"bytes": nbytes, "iters": rounds, "time_us": round(seconds * 1e6, 3),
                        "algbw_gbps": algorithm_bandwidth(nbytes, seconds),
                        "busbw_gbps": bus_bandwidth(nbytes, seconds, world), "wrong": int(w.item())})
        del buf
    largest = max(results, key=lambda r: r["bytes"])
    return {"probe": PROBE, "backend": backend, "world_size": world, "device": device.type,
            "dtype": "float32", "iters": iters, "warmup": warmup, "results": results,
            "busbw_gbps_at_largest": largest["busbw_gbps"]}


def _rounds_in(budget_s: float, most: int, buf: Any, sync: Any) -> int:
    """How many all-reduces of ``buf`` fit in ``budget_s``, from one timed on every rank
    (the slowest rank's time: every rank must run as many)."""
    import torch
    import torch.distributed as dist

    began = time.perf_counter()
    dist.all_reduce(buf)
    sync()
    once = torch.tensor([time.perf_counter() - began], dtype=torch.float64, device=buf.device)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)
    return max(1, min(most, int(budget_s / max(float(once.item()), 1e-9))))


def _table(report: dict[str, Any]) -> str:
    lines = [f"# all-reduce ({report['backend']}, {report['world_size']} ranks, {report['device']}, float32, "
             f"{report['iters']} iters)",
             f"#{'size(B)':>13} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}"]
    lines += [f"{r['bytes']:>14} {r['time_us']:>11.1f} {r['algbw_gbps']:>12.2f} {r['busbw_gbps']:>12.2f} "
              f"{r['wrong']:>7}" for r in report["results"]]
    lines.append(f"# busbw at the largest size: {report['busbw_gbps_at_largest']:.2f} GB/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m health.allreduce", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"comma-separated message sizes, e.g. 64K,1M,1G (default {DEFAULT_SIZES})")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces per size (default 20)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed all-reduces per size first (default 5)")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="auto: nccl when CUDA is available, else gloo")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout (default 300)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="fit each size's timed all-reduces in about this long (at most --iters)")
    parser.add_argument("--min-busbw-gbps", type=float, default=None,
                        help="grade the run on rank 0: exit 0 healthy, 1 degraded, 2 unhealthy/unknown")
    parser.add_argument("--json", action="store_true", help="rank 0 prints one JSON object")
    args = parser.parse_args(argv)
    try:
        sizes = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError as e:
        parser.error(str(e))
    if not sizes or args.iters < 1 or args.warmup < 0:
        parser.error("need at least one size, --iters >= 1 and --warmup >= 0")
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        print(f"health.allreduce: {', '.join(missing)} not set: run under torchrun", file=sys.stderr)
        return 2
    rank = int(os.environ["RANK"])
    try:
        report = _run(sizes, args.iters, args.warmup, args.backend, args.timeout_s, args.budget_s)
    except Exception as e:  # report it as the probe's failure, on the rank that saw it
        why = f"{type(e).__name__}: {e}"
        print(f"health.allreduce: rank {rank}: {why}", file=sys.stderr)
        if rank == 0 and args.json:
            print(json.dumps({"probe": PROBE, "error": why}), flush=True)
        return 2
    if rank != 0:
        return 0
    print(json.dumps(report) if args.json else _table(report), flush=True)
    if args.min_busbw_gbps is None:
        return 0
    v = verdict(check_allreduce(json.dumps(report), min_busbw_gbps=args.min_busbw_gbps))
    if not args.json:
        print(f"{v.status.value}: {v.reason()}")
    return EXIT_CODES[v.status]


def interface_towards(address: str) -> str | None:
    """The interface this host sends to ``address`` from (None: loopback, or not found).
    Gloo otherwise binds to the address the host's name resolves to, which on many
    clusters (and on separate network namespaces) the other nodes cannot reach."""
    import psutil

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))  # a datagram socket sends nothing on connect: it picks a route
        except OSError:
            return None
        source = s.getsockname()[0]
    if source.startswith("127."):
        return None
    return next((name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.family == socket.AF_INET and a.address == source for a in addrs)), None)


def _run(sizes: Sequence[int], iters: int, warmup: int, backend: str, timeout_s: float,
         budget_s: float | None) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = interface_towards(os.environ["MASTER_ADDR"])
        if ifname is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--backend nccl needs CUDA, and torch sees no GPU")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        return measure(sizes, iters=iters, warmup=warmup, backend=backend, budget_s=budget_s)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
