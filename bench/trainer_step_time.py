"""Step time and checkpoint save time of the reference trainer on local CPU ranks.

Spawns ``--ranks`` trainer processes with torchrun-style environment variables (gloo on
CPU), trains the ``tiny`` model for ``--steps`` steps with a checkpoint every
``--checkpoint-every`` steps, and prints one JSON object: step time percentiles (from
rank 0's progress lines, the first ``--warmup`` steps left out), checkpoint save times,
and the wall time of the whole run including process start.

    PYTHONPATH=. python bench/trainer_step_time.py --ranks 4 --steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.ports import free_port  # noqa: E402

STEP_LINE = re.compile(r"^step (\d+)/\d+ .* step_time_s ([0-9.]+) ")
SAVE_LINE = re.compile(r"^checkpoint step (\d+) committed to .* in ([0-9.]+) s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="trainer-bench-") as tmp:
        config = Path(tmp) / "bench.toml"
        config.write_text(
            f"steps = {args.steps}\nglobal_batch_size = {args.global_batch}\n"
            f'output_dir = "{tmp}/out"\n'
            f'[checkpoint]\ndir = "{tmp}/ckpt"\nevery_steps = {args.checkpoint_every}\n'
        )
        port = free_port()
        procs = []
        started = time.monotonic()
        for rank in range(args.ranks):
            env = {k: v for k, v in os.environ.items() if not k.startswith("TSUP_")}
            env.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), PYTHONPATH=str(REPO))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "trainer", "--config", str(config), "--resume", "none"],
                env=env, cwd=tmp, text=True,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
        out, _ = procs[0].communicate()
        codes = [procs[0].returncode] + [p.wait() for p in procs[1:]]
        wall_s = time.monotonic() - started

    steps = [(int(m[1]), float(m[2])) for m in map(STEP_LINE.match, out.splitlines()) if m]
    saves = [float(m[2]) for m in map(SAVE_LINE.match, out.splitlines()) if m]
    times = [t for step, t in steps if step > args.warmup]
    print(json.dumps({
        "ranks": args.ranks, "cpu_cores": os.cpu_count(), "steps": len(steps),
        "exit_codes": codes,
        "step_time_ms": {"p50": round(1e3 * statistics.median(times), 1),
                         "p90": round(1e3 * percentile(times, 0.9), 1),
                         "max": round(1e3 * max(times), 1)} if times else None,
        "first_step_ms": round(1e3 * steps[0][1], 1) if steps else None,
        "checkpoint_save_ms": [round(1e3 * s, 1) for s in saves],
        "wall_s": round(wall_s, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
