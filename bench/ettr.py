"""ETTR under one fixed fault schedule, three ways: the supervisor, torchrun
--max-restarts, and no supervision at all (a plain launch and a manual restart).

    .venv/bin/python bench/ettr.py --quick        # 120 steps, ~4 min on 2 cores
    .venv/bin/python bench/ettr.py                # 600 steps, ~15 min on 2 cores
    .venv/bin/python bench/ettr.py --manual-restart-delay-s 1800 --torchrun-hang-wait-s 600

Prints one JSON object on stdout (progress on stderr). Everything runs on this host in a
temp dir that is removed afterwards; every process started is killed on the way out.

The run. examples/tiny-llama.toml (2 nodes x 2 ranks + 1 spare) with ``steps`` and
``checkpoint.every_steps`` replaced (600 and 40; --quick 120 and 20) and telemetry on a
private mosquitto that the benchmark subscribes to (bench/_harness.py). The schedule:

    kill-rank   at 25 % of the steps: SIGKILL rank 3
    hang-rank   at 60 % of the steps: SIGSTOP rank 3 (alive, silent in a collective)

each moved to the middle of its checkpoint interval (600 steps: 140 and 380; 120 steps:
30 and 70), so every way loses about half an interval per fault and no way wins or
loses a race with a checkpoint save at the boundary. The fault goes in when rank 0 has
reported that step (the supervisor's own ``--chaos``; for the other ways the benchmark
watching the same telemetry), into the attempt running then. Rank 3 is the highest of
the example's 4, the one the supervisor's chaos picks by default; with another ``--spec``
the faults strike its highest rank, and torchrun starts as many ranks as it has.

The three ways:

    supervisor  ``training-supervisor run SPEC --chaos kill-rank@A --chaos hang-rank@B``
    torchrun    ``torchrun --standalone --nproc-per-node 4 --max-restarts 3`` running
                ``python -m trainer --config C --resume auto`` (C: the config the
                supervisor writes for this spec, supervisor/runfiles/trainer_cmd.py; each worker
                under ``sh -c`` only to tell its telemetry TORCHELASTIC_RESTART_COUNT; and
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which no torchrun restart of
                the gloo trainer succeeds here: see bench/_harness.py). It restarts after
                the kill; it cannot see the hang, so the run never finishes: the benchmark
                waits ``--torchrun-hang-wait-s`` (300 s; --quick 60) for any progress after
                the hang, then stops it and reports ``finished: false, capped: true`` and
                ``ettr`` over the wall time up to that moment (it only falls with a longer
                wait; the true value of a run that never ends is 0).
    none        the same ranks started by the supervisor's local launcher class without
                the supervisor. A fault ends a segment (a hang does too: nothing kills
                it by itself); a person then restarts it by hand, modelled as
                ``--manual-restart-delay-s`` (600 s, an assumption: from the fault to the
                relaunch, i.e. noticing, finding the cause and relaunching), and the
                relaunch resumes from the newest checkpoint (``--resume auto``). Only the
                segments run for real: wall_s = the segments' measured time (launch to
                fault, the last one launch to exit) + faults x the delay.

Fields, per way:

    finished        the run reached its last step and exited successfully
    wall_s          launch -> end: from starting the command (training-supervisor run /
                    torchrun / the first segment) to its exit (capped: to when the
                    benchmark gave up); supervisor daemon start-up and shutdown included
    productive_s    time in kept steps: per step number, the step time (the trainer's own
                    step_time_s) of the copy that the latest attempt ran; copies redone
                    after a rollback do not count (supervisor/goodput.py counts the same)
    ettr            productive_s / wall_s
    kept_steps      step numbers in the final trajectory (= final_step)
    lost_steps      step executions thrown away (run again after a restart)
    restarts        attempts after the first
    final_step      the last step reached
    model_digest    result.json's digest where the run finished (equal across ways: the
                    resumes are bit-exact on CPU)

plus: for the supervisor ``supervisor_ettr`` and ``supervisor_wall_s`` (its own account,
from the first attempt's start to the run's end, without its daemon's start-up); for
torchrun ``capped`` and ``gave_up_after_hang_s``; for none ``segments`` (each measured
segment), ``measured_s`` and ``modelled_wait_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from _harness import (
    EXAMPLE_SPEC,
    SupervisorRun,
    Tap,
    Torchrun,
    all_exited,
    exit_on_sigterm,
    faulty_rank,
    goodput,
    mosquitto,
    plain_spec,
    result_digest,
    say,
    spec_shape,
    stop_plain,
    wait_until,
    workspace,
    world_of,
    write_spec,
    write_trainer_config,
)

from supervisor.launchers.local import LocalLauncher

SCHEDULE = (("kill-rank", 0.25), ("hang-rank", 0.60))
Fault = tuple[str, int]  # (kind, step)


def schedule(steps: int, every: int) -> list[Fault]:
    """The faults' steps: each fraction of the run, moved to the middle of its
    checkpoint interval."""
    return [(kind, int(frac * steps) // every * every + every // 2) for kind, frac in SCHEDULE]


def _ettr(wall_s: float, gp: dict[str, Any]) -> dict[str, Any]:
    ettr = round(gp["productive_s"] / wall_s, 4) if wall_s else None
    return {"wall_s": round(wall_s, 2), **gp, "ettr": ettr}


# --- the supervisor ------------------------------------------------------------------------


def supervised(spec: Path, root: Path, tap: Tap, faults: list[Fault], timeout_s: float) -> dict[str, Any]:
    say("supervisor: training-supervisor run " + " ".join(f"--chaos {k}@{s}" for k, s in faults))
    tap.clear()
    run = SupervisorRun(spec, root / "supervisor", [f"{k}@{s}" for k, s in faults])
    try:
        exited = run.wait(timeout_s)
    finally:
        run.close()
    end = run.exited_at or time.time()
    summary = run.summary() or {}
    if summary.get("state") != "SUCCEEDED":
        say(f"supervisor: run {summary.get('state')}: {run.stderr_tail()}")
    gp = summary.get("goodput", {})
    return {"finished": exited and summary.get("state") == "SUCCEEDED",
            **_ettr(end - run.launched_at, goodput(tap, "run-1")),
            "restarts": max(0, int(summary.get("attempts", 1)) - 1),
            "model_digest": summary.get("model_digest"),
            "supervisor_ettr": round(gp["ettr"], 4) if gp.get("ettr") is not None else None,
            "supervisor_wall_s": round(gp["wall_s"], 2) if "wall_s" in gp else None,
            "faults_detected": [f.get("kind") for f in summary.get("faults", [])]}


# --- torchrun --------------------------------------------------------------------------------


def under_torchrun(spec: Path, root: Path, tap: Tap, url: str, faults: list[Fault], max_restarts: int,
                   hang_wait_s: float, timeout_s: float) -> dict[str, Any]:
    say(f"torchrun: --max-restarts {max_restarts}, faults " + ", ".join(f"{k}@{s}" for k, s in faults))
    run_id, workdir = "torchrun", root / "torchrun"
    config = write_trainer_config(spec, workdir / "run")
    tap.clear()
    job = Torchrun(config, workdir, nproc=world_of(spec), max_restarts=max_restarts,
                   env={"TSUP_MQTT_URL": url, "TSUP_RUN_ID": run_id})
    try:
        capped_at = _drive(tap, run_id, job, faults, faulty_rank(spec), hang_wait_s, timeout_s)
        end = capped_at or time.time()
    finally:
        job.close()
    finished = capped_at is None and job.proc.returncode == 0
    return {"finished": finished, **_ettr(end - job.launched_at, goodput(tap, run_id)),
            "restarts": max(0, tap.max_attempt(run_id) - 1),
            "model_digest": result_digest(workdir / "run") if finished else None,
            "capped": capped_at is not None, "gave_up_after_hang_s": hang_wait_s if capped_at else None,
            "exit_code": job.proc.returncode if capped_at is None else None}


def _drive(tap: Tap, run_id: str, job: Torchrun, faults: list[Fault], rank: int, hang_wait_s: float,
           timeout_s: float) -> float | None:
    """Inject the faults as the steps come, then wait for torchrun to exit; the moment
    the benchmark gave up on a hang torchrun did not get over (None: it did not)."""
    for kind, step in faults:
        attempt = _inject_at(tap, run_id, kind, step, rank, job, timeout_s)
        if attempt is None:
            return None
        if kind == "hang-rank" and not _progress_after(tap, run_id, attempt, job, hang_wait_s):
            say(f"torchrun: no progress {hang_wait_s:.0f} s after the hang; giving up")
            return time.time()
    wait_until(lambda: True if job.exited() else None, timeout_s)
    return None


def _inject_at(tap: Tap, run_id: str, kind: str, step: int, rank: int, job: Torchrun,
               timeout_s: float) -> int | None:
    """Wait for ``step``, then signal ``rank`` of the attempt running; that attempt."""
    reached = wait_until(lambda: True if tap.max_step(run_id) >= step else (False if job.exited() else None),
                         timeout_s)
    attempt = tap.max_attempt(run_id)
    pid = tap.pid_of(run_id, attempt, rank)
    if not reached or pid is None:
        say(f"torchrun: step {step} not reached; no {kind}")
        return None
    os.kill(pid, signal.SIGKILL if kind == "kill-rank" else signal.SIGSTOP)
    say(f"torchrun: {kind} at step {tap.max_step(run_id)} (attempt {attempt}, pid {pid})")
    return attempt


def _progress_after(tap: Tap, run_id: str, attempt: int, job: Torchrun, wait_s: float) -> bool:
    """Did a later attempt report a step (or torchrun end) within ``wait_s``?"""
    later = wait_until(lambda: True if any(m.attempt > attempt for m in tap.steps(run_id)) or job.exited()
                       else None, wait_s)
    return bool(later)


# --- no supervision -------------------------------------------------------------------------


def unsupervised(spec: Path, root: Path, tap: Tap, url: str, faults: list[Fault], delay_s: float,
                 timeout_s: float) -> dict[str, Any]:
    say(f"none: plain launches, a manual restart modelled as {delay_s:.0f} s after each fault")
    run_id, shape = "plain", spec_shape(spec)
    config = write_trainer_config(spec, root / "plain")
    launcher = LocalLauncher()
    tap.clear()
    segments: list[dict[str, Any]] = []
    finished = False
    for attempt in range(1, len(faults) + 2):
        fault = faults[attempt - 1] if attempt <= len(faults) else None
        launch = plain_spec(config, run_id, attempt, shape["nodes"], shape["ranks_per_node"], url)
        started = time.time()
        info = launcher.start(launch)
        try:
            ended_by = _segment(launcher, info, tap, run_id, attempt, fault, faulty_rank(spec), timeout_s)
        finally:
            ended = time.time()
            stop_plain(launcher, info)
        segments.append({"attempt": attempt, "ran_s": round(ended - started, 2), "ended_by": ended_by})
        say(f"none: segment {attempt} ran {ended - started:.1f} s, ended by {ended_by}")
        if ended_by != fault_name(fault):
            finished = ended_by == "exit 0"
            break
    measured = sum(s["ran_s"] for s in segments)
    waits = delay_s * sum(1 for s in segments if s["ended_by"] in {fault_name(f) for f in faults})
    return {"finished": finished, **_ettr(measured + waits, goodput(tap, run_id)),
            "restarts": len(segments) - 1,
            "model_digest": result_digest(root / "plain") if finished else None,
            "modelled": True, "manual_restart_delay_s": delay_s, "measured_s": round(measured, 2),
            "modelled_wait_s": waits, "segments": segments}


def fault_name(fault: Fault | None) -> str:
    return f"{fault[0]}@{fault[1]}" if fault else "-"


def _segment(launcher: LocalLauncher, info: str, tap: Tap, run_id: str, attempt: int, fault: Fault | None,
             rank: int, timeout_s: float) -> str:
    """Run one segment until its fault goes in, or until every rank exited; what ended it."""
    if fault is None:
        if wait_until(lambda: True if all_exited(launcher, info) else None, timeout_s, 0.2) is None:
            return "timeout"
        codes = {r.exit_code for r in launcher.observe(info)}
        return "exit 0" if codes == {0} else f"exit {sorted(c for c in codes if c is not None)}"
    kind, step = fault
    if not tap.wait_step(run_id, step, timeout_s, attempt=attempt):
        return "timeout"
    launcher.kill_rank(info, rank, signal.SIGKILL if kind == "kill-rank" else signal.SIGSTOP)
    return fault_name(fault)


# --- main ------------------------------------------------------------------------------------


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="120 steps, checkpoint every 20, torchrun hang wait 60 s")
    p.add_argument("--spec", type=Path, default=EXAMPLE_SPEC)
    p.add_argument("--steps", type=int, default=None, help="run length (default 600; --quick 120)")
    p.add_argument("--every-steps", type=int, default=None,
                   help="checkpoint interval (default 40; --quick 20)")
    p.add_argument("--manual-restart-delay-s", type=float, default=600.0,
                   help="no supervision: fault -> relaunch by a person (an assumption; default 600)")
    p.add_argument("--torchrun-hang-wait-s", type=float, default=None,
                   help="torchrun's time after the hang before the run is capped (default 300; --quick 60)")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts")
    p.add_argument("--ways", default="supervisor,torchrun,none", help="which of supervisor,torchrun,none")
    p.add_argument("--timeout-s", type=float, default=1800, help="give up on one way after this")
    return p.parse_args()


def main() -> None:
    exit_on_sigterm()
    args = _args()
    steps = args.steps or (120 if args.quick else 600)
    every = args.every_steps or (20 if args.quick else 40)
    hang_wait = args.torchrun_hang_wait_s or (60.0 if args.quick else 300.0)
    faults = schedule(steps, every)
    ways = args.ways.split(",")
    report: dict[str, Any] = {
        "bench": "ettr", "quick": args.quick, "spec": str(args.spec),
        "schedule": [{"kind": k, "step": s, "of_steps": steps} for k, s in faults],
        "manual_restart_delay_s": args.manual_restart_delay_s, "torchrun_hang_wait_s": hang_wait,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": version("torch")}}
    began = time.monotonic()
    with workspace("tsup-ettr-") as root, mosquitto(root) as url:
        spec = write_spec(args.spec, root / "spec.toml", mqtt_url=url, steps=steps, every_steps=every)
        report["spec_shape"] = spec_shape(spec)
        tap = Tap(url)
        try:
            runs: dict[str, Callable[[], dict[str, Any]]] = {
                "supervisor": lambda: supervised(spec, root, tap, faults, args.timeout_s),
                "torchrun": lambda: under_torchrun(spec, root, tap, url, faults, args.max_restarts, hang_wait,
                                                   args.timeout_s),
                "none": lambda: unsupervised(spec, root, tap, url, faults, args.manual_restart_delay_s,
                                             args.timeout_s)}
            results: dict[str, Any] = {}
            for way in (w for w in runs if w in ways):
                # other processes on this machine slow every phase down: their load, for the reader
                load = round(os.getloadavg()[0], 2)
                results[way] = {**runs[way](), "loadavg_1m_at_start": load}
        finally:
            tap.close()
    report["ways"] = results
    digests = {r["model_digest"] for r in results.values() if r.get("finished")}
    report["same_model_digest"] = len(digests) == 1 if digests else None
    report["bench_wall_s"] = round(time.monotonic() - began, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
