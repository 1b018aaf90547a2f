"""The link test on the Slurm box: how long it takes, what it measures, and whether it
ever names a node that is not slow (health/links.py, supervisor/slurm/nodes.py).

Each trial runs the supervisor's own link test over every node of a fresh allocation of
the box (``probe_links``, as a preflight does: each pair of a ring of the nodes one
``srun`` of two tasks, ``python -m health.allreduce`` over gloo) and judges it
(``health.links.judge``). ``--throttled N`` trials first slow the last node's link to
``--rate`` both ways (``tc`` tbf), then run the same test; a verdict is correct when it
names exactly the throttled node, and none when none is. ``--runs N`` then supervises N
whole runs of the tiny example on the box (``[health] preflight``, whose link test runs
over the run's three nodes before it trains; 20 steps each), none throttled: a run that
drains a node is a false verdict of the whole path. Prints one JSON object:

    {"nodes": 3, "clean": {"trials": 10, "false_verdicts": 0, "seconds": {...}, "busbw_gbps": {...}},
     "throttled": {"trials": 3, "named": 3, ...}, "runs": {"runs": 10, "drained_nothing": 10, ...}}

Needs root (network namespaces) and Slurm's daemons (``make test`` installs them).

    python bench/link_test.py --nodes 3 --trials 10 --throttled 3 --runs 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import REPO, say

sys.path.insert(0, str(REPO))  # slurmbox/: the source checkout's development box

from health import links
from slurmbox import box as slurm_box
from supervisor.link_steps import LinkTest
from supervisor.slurm.allocation import Alloc
from supervisor.slurm.cluster import slurm_cluster
from supervisor.slurm.commands import SlurmCommands


def _job(commands: SlurmCommands, nodes: int, timeout_s: float = 60) -> str:
    """An allocation of every node of the box that holds them until cancelled."""
    reply = commands.run(["sbatch", "--parsable", f"--nodes={nodes}", "--job-name=link-bench",
                          "--output=/dev/null", "--wrap", "sleep 3600"])
    if not reply.ok:
        raise RuntimeError(f"sbatch: {reply.why}")
    job = reply.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = commands.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
        if state == "RUNNING":
            return job
        time.sleep(0.2)
    raise RuntimeError(f"job {job} did not start within {timeout_s:g} s")


def trial(box: Any, throttle: str | None, rate: str, timeout_s: float) -> dict[str, Any]:
    cluster = slurm_cluster(slurm_conf=str(box.conf), state_dir=Path(box.dir) / "state")
    commands = cluster.commands
    job = _job(commands, len(box.nodes))
    info = Alloc(job=job, seq=1).dump()
    try:
        if throttle is not None:
            slurm_box.throttle_node(box, throttle, rate)
        began = time.monotonic()
        test = LinkTest(over=tuple(box.nodes), fraction=links.FRACTION)
        results = cluster.nodes.probe_links(test, allocation_info=info, timeout_s=timeout_s)
        seconds = time.monotonic() - began
    finally:
        if throttle is not None:
            slurm_box.unthrottle_node(box, throttle)
        commands.run(["scancel", job])
    found = links.judge(box.nodes, results)
    named = sorted(n for n, f in found.items() if f is not None and f.status.value == "unhealthy")
    return {"seconds": round(seconds, 2), "named": named,
            "pairs": {f"{r.nodes[0]}-{r.nodes[1]}": r.busbw_gbps if r.busbw_gbps is not None else r.why
                      for r in results}}


def _figures(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4),
            "max": round(max(values), 4)} if values else {}


def summary(trials: list[dict[str, Any]], throttled: str | None) -> dict[str, Any]:
    expected = [throttled] if throttled else []
    busbw = [v for t in trials for v in t["pairs"].values() if isinstance(v, float)]
    return {"trials": len(trials), "correct": sum(t["named"] == expected for t in trials),
            "false_verdicts": sum(bool(set(t["named"]) - set(expected)) for t in trials),
            "seconds": _figures([t["seconds"] for t in trials]), "busbw_gbps": _figures(busbw),
            "each": trials}


def supervised_run(box: Any, number: int, steps: int = 20) -> dict[str, Any]:
    """One run of the tiny example on the box with the preflight (and its link test) on:
    its end state, the nodes it drained, how long it took."""
    work = Path(tempfile.mkdtemp(prefix=f"tsup-link-run{number}-"))
    spec = work / "spec.toml"
    example = (REPO / "examples" / "tiny-llama.toml").read_text()
    spec.write_text(example.replace('launcher = "local"', 'launcher = "slurm"')
                    .replace("steps = 80", f"steps = {steps}") + "\n[health]\npreflight = true\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURM_CONF": str(box.conf), "TSUP_ALLOW_ROOT_RUNS": "true"}
    began = time.monotonic()
    argv = [sys.executable, "-m", "slurmbox.tsup", "run", str(spec), "--state-dir", str(work / "state"),
            "--json"]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=600)
    seconds = time.monotonic() - began
    try:
        s = json.loads(proc.stdout)
    except ValueError:
        return {"state": f"no summary (exit {proc.returncode})", "drained": [], "seconds": round(seconds, 1),
                "stderr": proc.stderr[-1000:]}
    for node in s["drained_nodes"]:  # the box is the next run's too
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False, env=box.env,
                       timeout=30, capture_output=True)
    return {"state": s["state"], "drained": s["drained_nodes"], "seconds": round(seconds, 1),
            "attempts": s["attempts"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--trials", type=int, default=10, help="trials without a throttle")
    ap.add_argument("--throttled", type=int, default=3, help="trials with the last node's link throttled")
    ap.add_argument("--rate", default="4mbit", help="the throttle's rate (tc's words)")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="each pair's limit")
    ap.add_argument("--runs", type=int, default=0,
                    help="whole supervised runs with the preflight, none throttled")
    args = ap.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="tsup-link-box-"))
    box = slurm_box.up(directory, args.nodes)
    try:
        out: dict[str, Any] = {"nodes": args.nodes, "rate": args.rate, "measured": True}
        for name, count, throttle in (("clean", args.trials, None),
                                      ("throttled", args.throttled, box.nodes[-1])):
            done = []
            for i in range(count):
                say(f"link test {name} {i + 1}/{count}")
                done.append(trial(box, throttle, args.rate, args.timeout_s))
            out[name] = summary(done, throttle)
        if args.runs:
            runs = []
            for i in range(args.runs):
                say(f"supervised run {i + 1}/{args.runs} with the preflight's link test")
                runs.append(supervised_run(box, i + 1))
            out["runs"] = {"runs": len(runs), "drained_nothing": sum(not r["drained"] for r in runs),
                           "succeeded": sum(r["state"] == "SUCCEEDED" for r in runs),
                           "seconds": _figures([r["seconds"] for r in runs]), "each": runs}
    finally:
        slurm_box.down(directory)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
