"""Recovery benchmark on this machine: detection, time to training again, ETTR.

Runs the example spec (or SPEC) with `training-supervisor run --json`, fault-free and
with each fault kind, and prints one JSON object:

    python bench/recovery.py [--spec examples/tiny-llama.toml] [--repeat 1] [--launcher slurm]
                             [--scenarios fault-free,kill-rank,kill-node,freeze-node] [--fault-step 50]

``--scenarios`` picks some of the runs (default all four); ``--fault-step`` is the step
every fault goes in at (default 50: the spec must run longer than that).

With ``--launcher slurm`` every run goes to a Slurm box of three nodes that the
benchmark starts for itself (scripts/slurm-box) and stops at the end, unless
SLURM_CONF already names a cluster; the fault scenarios then kill or freeze a node
with its slurmd.

For each faulty run it reports, per fault, detection_s (from the chaos injection to
the supervisor's detection), recovery_s (from detection to the next attempt's first
step) and the run's ETTR next to the fault-free one's. Numbers come from the state
directory's SQLite, so they are the supervisor's own records.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SCENARIOS = {  # the --chaos kinds of each run, each at --fault-step
    "fault-free": [],
    "kill-rank": ["kill-rank"],
    "kill-node": ["kill-node"],
    "freeze-node": ["freeze-node"],
}


def run_once(spec: Path, chaos: list[str], launcher: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tsup-bench-") as tmp:
        args = [sys.executable, "-m", "slurmbox.tsup", "run", str(spec), "--state-dir", tmp, "--json",
                "--quiet", "--api-port", "-1", "--launcher", launcher]
        for c in chaos:
            args += ["--chaos", c]
        began = time.perf_counter()
        proc = subprocess.run(args, capture_output=True, text=True, check=False, cwd=REPO)
        wall_s = time.perf_counter() - began
        if proc.returncode != 0:
            raise SystemExit(f"run failed ({proc.returncode}): {proc.stderr[-2000:]}")
        summary = json.loads(proc.stdout)
        conn = sqlite3.connect(Path(tmp) / "supervisor.db")
        query = "SELECT ts FROM events WHERE kind = 'chaos.injected' ORDER BY id"
        injected = [ts for (ts,) in conn.execute(query)]
        step_times = [t for (t,) in conn.execute("SELECT step_time_s FROM metrics")]
        conn.close()
    faults = []
    for f, t_inj in zip(summary["faults"], injected, strict=False):
        faults.append({
            "kind": f["kind"],
            "detection_s": round(f["detected_at"] - t_inj, 3),
            "recovery_s": round(f["recovered_at"] - f["detected_at"], 3) if f["recovered_at"] else None,
        })
    return {
        "state": summary["state"], "ettr": round(summary["ettr"], 4), "wall_s": round(wall_s, 2),
        "attempts": summary["attempts"], "injected": len(injected), "faults": faults,
        "step_time_p50_s": round(statistics.median(step_times), 4),
        "goodput": {k: round(v, 3) if isinstance(v, float) else v for k, v in summary["goodput"].items()},
        "model_digest": summary["model_digest"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=REPO / "examples" / "tiny-llama.toml")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--launcher", choices=("local", "slurm"), default="local")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated subset of {','.join(SCENARIOS)} (default all)")
    parser.add_argument("--fault-step", type=int, default=50, help="the step every fault goes in at")
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    if not scenarios or set(scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios: expected a comma-separated choice of {', '.join(SCENARIOS)}")
    results: dict[str, list[dict[str, Any]]] = {}
    box_dir = None
    if args.launcher == "slurm" and "SLURM_CONF" not in os.environ:
        from slurmbox import box  # stdlib only

        box_dir = Path(tempfile.mkdtemp(prefix="tsup-bench-box-"))
    try:
        for name in scenarios:
            chaos = [f"{kind}@{args.fault_step}" for kind in SCENARIOS[name]]
            runs = []
            for _ in range(args.repeat):
                if box_dir is not None:  # a fresh cluster per run: the last one lost a node
                    os.environ["SLURM_CONF"] = str(box.up(box_dir, 3).conf)
                try:
                    runs.append(run_once(args.spec, chaos, args.launcher))
                finally:
                    if box_dir is not None:
                        box.down(box_dir)
            results[name] = runs
            print(f"{name}: done", file=sys.stderr, flush=True)
    finally:
        if box_dir is not None:
            shutil.rmtree(box_dir, ignore_errors=True)
    digests = {r["model_digest"] for runs in results.values() for r in runs}
    report = {"spec": str(args.spec), "launcher": args.launcher, "same_model_digest": len(digests) == 1,
              "runs": results}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
