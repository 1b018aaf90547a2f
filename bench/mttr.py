"""Mean time to recover, phase by phase: the supervisor per fault kind, next to the
trainer's cold start (the floor) and to torchrun --max-restarts with the same faults.

    .venv/bin/python bench/mttr.py --quick        # ~4 min on 2 cores: fewer kinds, 1 trial
    .venv/bin/python bench/mttr.py                # every kind, 5 trials each (~50 min on 2 cores)
    .venv/bin/python bench/mttr.py --kinds kill-rank,nan --trials 3 --parts supervisor

Prints one JSON object on stdout (progress on stderr). Everything runs on this host in a
temp dir that is removed afterwards; every process started is killed on the way out.

Setup. The spec is examples/tiny-llama.toml (2 nodes x 2 ranks + 1 spare, checkpoint
every 20 steps) with ``[telemetry] mqtt_url`` pointing at a private mosquitto that the
benchmark starts: the supervisor, the torchrun workers and the cold-start ranks all
publish their telemetry there, and the benchmark subscribes to it (``Tap`` in
bench/_harness.py). The fault goes in at step ``--fault-step`` (30), so every recovery
resumes from the step-20 checkpoint; a trial ends at the first step after the fault
(then the run is cancelled: what follows is not recovery).

Clocks. Supervisor instants come from its SQLite (``<state>/supervisor.db``, the
daemon's own time stamps); trainer instants come from the trainer's telemetry messages,
whose ``ts`` is the rank's time.time() when it made the message (not when anyone
received it); torchrun instants come from its agent's log lines (glog time stamps,
LOGLEVEL=INFO). One host, one clock.

Phases of one recovery (each a duration in seconds; they add up to ``total_s``):

    detect_s      fault -> the fault is detected. Fault: for signal faults the moment the
                  signal was sent (the supervisor's ``chaos.injected`` event; for torchrun
                  the benchmark's own kill); for trainer faults (crash, device, nan) the
                  trainer's ``fault`` telemetry message, made as the fault fired.
                  Detected: the supervisor's ``fault.detected`` event; torchrun's first
                  word on it: "Sending process N closing signal SIGTERM" (it stops the
                  surviving workers first) or "failed (exitcode ...)".
    teardown_s    -> the old attempt is over, all its processes gone: the attempts
                  table's ``ended_at`` (the supervisor ends an attempt once every rank is
                  observed gone); torchrun's "Rendezvous'ing worker group" line, logged
                  once its old workers are stopped (near 0: by the time it logs the failure
                  it has already stopped them, inside detect_s).
    schedule_s    -> the next attempt is launched: ``attempts.started_at`` (set when the
                  launcher has spawned the ranks; includes choosing nodes and writing the
                  attempt's config); torchrun's "Starting worker group" (its c10d
                  rendezvous in between).
    start_s       -> every rank of the new attempt is up: the last rank's first telemetry
                  message (made as train() starts: Python up, torch imported).
    init_s        -> rank 0 enters phase ``restore``: process group formed, model built
                  and sharded.
    restore_s     -> rank 0 enters phase ``train``: checkpoint loaded (restore_load_s is
                  the part the trainer itself timed around the DCP load, from rank 0's log
                  line "resumed from ... in X s").
    first_step_s  -> rank 0 reports the first step of the new attempt.
    total_s       fault -> that first step (the MTTR of one trial).

A phase that could not be observed is null; a trial that did not recover has
``recovered: false``. Per kind the JSON gives every trial and the median of each field.

Fault kinds (supervisor: ``--chaos``, supervisor/chaos.py; trainer-side ones through
TSUP_FAULT, trainer/faults.py). Rank 3 is the highest rank of the example's 4, the one
the supervisor's chaos picks by default; with another ``--spec`` the faulty rank is its
highest rank, and every rank count below is the spec's:

    kill-rank     SIGKILL rank 3
    hang-rank     SIGSTOP rank 3: found by the hang rule (no step progress for
                  max(8 s, 3 x p99 step time) once 20 steps were timed)
    kill-node     SIGKILL both ranks of node 2 (its process group); the spare takes over
    freeze-node   SIGSTOP both ranks of node 2: found by silence (10 s without heartbeats)
    crash         rank 3 raises after step 30 (exit 1). It fires again in every attempt
                  that reaches step 30 (a crash loop), so only the first recovery is
                  measured: it ends at step 21, before the fault can fire again
    device        rank 3's accelerator fails after step 30 (exit 4), once per run (a
                  marker in TSUP_FAULT_STATE): the once-only crash; the node is drained
    nan           the loss of step 30 turns NaN (once per run): detected from the step
                  metrics, rolled back to the step-20 checkpoint

Cold start (``cold_start``): the floor. Four ranks of ``python -m trainer`` launched by
the supervisor's own local launcher class without the supervisor (same environment, same
process layout): ``fresh`` from launch to the first step, and ``resumed`` from launch to
the first step after loading the step-20 checkpoint the fresh run left; phases as above,
``start_s`` counted from the launch. ``total_s`` of ``resumed`` is what any recovery must
pay at least; ``supervisor_overhead_vs_cold_resume_s`` and
``torchrun_overhead_vs_cold_resume_s`` give, per kind, the median total_s less it.

The supervisor talks to the private mosquitto here (a spec's ``[telemetry] mqtt_url``),
not to its default embedded broker, so that the benchmark hears the same messages it does.

torchrun (``torchrun``): ``python -m torch.distributed.run --standalone --nproc-per-node
4 --max-restarts 3`` (default monitor interval, 0.1 s) running ``python -m trainer
--config C --resume auto`` with C the config the supervisor writes for this spec
(supervisor/runfiles/trainer_cmd.py). Each worker runs under ``sh -c`` only to set TSUP_ATTEMPT
from TORCHELASTIC_RESTART_COUNT, so its telemetry names its restart. torchrun gets
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with its default (the rendezvous store shared with
the workers) every restart of this gloo trainer failed here (bench/_harness.py says why),
so without it there would be nothing to measure. Kinds: kill-rank
(the benchmark SIGKILLs worker rank 3 at step 30), crash and device (TSUP_FAULT, as
above), hang-rank (SIGSTOP worker rank 3: torchrun only watches exit codes, so it is
reported ``recovered: false`` after waiting ``--hang-wait-s``; the other ranks sit in a
gloo collective until the trainer's dist_timeout_s, 600 s by default, if ever; run
``--hang-trials`` times, 1 by default, as it has one outcome). kill-node, freeze-node and
nan are listed with the reason torchrun cannot recover from them here.

Warm standby (``warm``): the supervisor with ``[resources] standby = true``: the new
attempt's ranks are processes that were started, torch imported, before the fault, and
waited on a pipe for their assignment (trainer/standby.py). Same phases; ``start_s`` is
then from the launch to the last standby's first telemetry as a rank. The standbys are
started 5 s after the attempt and need 15-25 s here to import torch and pay the first
uses of a rank's init and step ahead (trainer/standby.py: ``warm_paths``), beside the
training ranks on 2 cores, so these trials put the fault at ``--warm-fault-step`` (150,
the run then 160 steps: the same 10 steps after a checkpoint that step 30 is after step
20; at step 50, and at step 70 now and then, they were still warming, and the
assignment waited for them). ``standby_waited_s`` says how long the least rested standby
had waited for it (0: it was not yet waiting). ``warm_vs_cold_resume`` gives, per kind, the
median total_s over the cold start's, resumed.

Warm standby and the memory tier (``memory``): the same, with the memory tier every 5
steps and persistent saves beside training (``memory_every_steps = 5``, ``asynchronous =
true``); the fault at ``--memory-fault-step`` (153: 3 steps after the memory save of step
150, 13 after the persistent one of step 140). A killed rank's node keeps its memory; a killed
node's ranks are restored from their replicas on the other node (trainer/memory_tier.py).
``steps_redone`` shows what the tier saves; ``memory_vs_cold_resume`` as above.

The Slurm box (``slurm``, ``slurm_box`` in the JSON): the cold start, kill-rank and
kill-node under the supervisor, and the same with the memory tier, on a real Slurm
cluster of three hosts in network namespaces of this one (bench/_mttr_slurm.py says
how). It needs root and Slurm's daemons; without them it says why it did not run.

--quick: 1 trial; supervisor kinds kill-rank and hang-rank, torchrun kill-rank and
hang-rank (waiting 30 s), cold start once. The JSON says which kinds were left out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

import _mttr_slurm
from _harness import (
    DETECTED,
    EXAMPLE_SPEC,
    LAUNCHED,
    TORN_DOWN,
    Tap,
    Torchrun,
    attempt_times,
    chain,
    exit_on_sigterm,
    faulty_rank,
    mosquitto,
    plain_spec,
    restore_load_s,
    rounded,
    say,
    spec_shape,
    steps_past,
    wait_until,
    workspace,
    world_of,
    write_spec,
    write_trainer_config,
)
from _mttr_trials import (
    brief_of,
    chaos_arg,
    load_now,
    resumed_in,
    summary_of,
    supervisor_trial,
    timed_launch,
    totals_of,
)

from supervisor.launchers.local import LocalLauncher

KINDS = ("kill-rank", "hang-rank", "kill-node", "freeze-node", "crash", "device", "nan")
QUICK_KINDS = ("kill-rank", "hang-rank")
TRAINER_KINDS = ("crash", "device", "nan")
TORCHRUN_KINDS = ("kill-rank", "crash", "device", "hang-rank")
TORCHRUN_CANNOT = {
    "kill-node": "one torchrun agent per node: a lost node takes its agent along, and the other nodes' "
                 "agents wait in rendezvous for a replacement node that nothing provides (single-node "
                 "here, so not simulated)",
    "freeze-node": "like hang-rank, and worse: a frozen node freezes its agent too; nothing in torchrun "
                   "watches for silence",
    "nan": "torchrun watches exit codes only; a NaN loss ends no process, so training goes on with NaN "
           "(the trainer just refuses to checkpoint it)",
}



# --- cold start -------------------------------------------------------------------------


def _cold_trial(spec: Path, workdir: Path, tap: Tap, url: str, run_id: str,
                timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fresh start, run on until the first checkpoint is committed (it is saved before
    the next step begins); then a second launch that resumes from it."""
    shape = spec_shape(spec)
    config = write_trainer_config(spec, workdir)
    fresh = _cold_launch(config, shape, tap, url, run_id, 1, shape["every_steps"] + 1, timeout_s)
    resumed = _cold_launch(config, shape, tap, url, run_id, 2, 1, timeout_s)
    return fresh, resumed


def _cold_launch(config: Path, shape: Mapping[str, Any], tap: Tap, url: str, run_id: str, attempt: int,
                 until_step: int, timeout_s: float) -> dict[str, Any]:
    """The ranks launched as the local launcher does, until ``until_step``."""
    launch = plain_spec(config, run_id, attempt, shape["nodes"], shape["ranks_per_node"], url)
    return timed_launch(LocalLauncher(), launch, tap, until_step, timeout_s)


# --- the supervisor -----------------------------------------------------------------------


# --- torchrun -----------------------------------------------------------------------------


def _torchrun_trial(kind: str, spec: Path, workdir: Path, tap: Tap, url: str, fault_step: int,
                    max_restarts: int, wait_s: float, timeout_s: float) -> dict[str, Any]:
    """One fault under torchrun; ``wait_s``: how long after it to wait for a resumed step."""
    run_id = "torchrun"
    config = write_trainer_config(spec, workdir / "run")
    env = {"TSUP_MQTT_URL": url, "TSUP_RUN_ID": run_id}
    if kind in TRAINER_KINDS:
        env |= {"TSUP_FAULT": chaos_arg(kind, fault_step, faulty_rank(spec)),
                "TSUP_FAULT_STATE": str(workdir / "fault-state")}
    tap.clear()
    load = load_now()
    job = Torchrun(config, workdir, nproc=world_of(spec), max_restarts=max_restarts, env=env)
    fault_at: float | None = None
    fault_step_seen: int | None = None
    try:
        if tap.wait_step(run_id, fault_step, timeout_s, attempt=1):
            fault_at = _inject_torchrun(kind, tap, run_id, faulty_rank(spec))
            fault_step_seen = fault_step if kind in TRAINER_KINDS else tap.max_step(run_id, 1)
        resumed = fault_at is not None and wait_until(
            lambda: resumed_in(tap, run_id, 1) or (False if job.exited() else None), wait_s)
    finally:
        job.close()
    detected = job.first_line(DETECTED, job.launched_at)
    torn_down = job.first_line(TORN_DOWN, detected) if detected else None
    launched = job.first_line(LAUNCHED, torn_down) if torn_down else None
    t = attempt_times(tap, run_id, 2, world_of(spec))
    log = job.rank0_log(2)
    gave_up = {} if resumed else {"gave_up_after_s": wait_s}
    return {"recovered": bool(resumed), "loadavg_1m": load, **gave_up,
            **chain([("fault", fault_at), ("detect", detected), ("teardown", torn_down),
                     ("schedule", launched), ("start", t.up), ("init", t.restore_begin),
                     ("restore", t.train_begin), ("first_step", t.first_step)]),
            **totals_of(fault_at, t, fault_step_seen,
                        t.first_step_number - 1 if t.first_step_number else None),
            "restore_load_s": restore_load_s(log) if log else None,
            "torchrun_noticed": detected is not None}


def _inject_torchrun(kind: str, tap: Tap, run_id: str, rank: int) -> float | None:
    """Send the fault (or wait for the trainer's own); the instant it went in."""
    if kind in TRAINER_KINDS:
        return wait_until(lambda: tap.first_fault_ts(run_id, 1), 30)
    pid = tap.pid_of(run_id, 1, rank)
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL if kind == "kill-rank" else signal.SIGSTOP)
    return time.time()


# --- summaries ----------------------------------------------------------------------------


def _overheads(kinds: Mapping[str, Mapping[str, Any]], floor: float | None) -> dict[str, float | None]:
    out = {}
    for kind, res in kinds.items():
        total = res.get("median", {}).get("total_s")
        out[kind] = rounded(total - floor) if total is not None and floor is not None else None
    return out


# --- main ---------------------------------------------------------------------------------


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 trial, kill-rank and hang-rank only (minutes)")
    p.add_argument("--trials", type=int, default=None, help="trials per kind (default 5; --quick 1)")
    p.add_argument("--kinds", default=None, help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--parts", default="cold,supervisor,warm,memory,torchrun,slurm",
                   help="which of cold,supervisor,warm,memory,torchrun,slurm")
    p.add_argument("--spec", type=Path, default=EXAMPLE_SPEC)
    p.add_argument("--slurm-variants", default="cold,supervisor,memory,warm,warm-memory",
                   help="the Slurm box's: which of cold,supervisor,memory,warm,warm-memory")
    p.add_argument("--fault-step", type=int, default=30)
    p.add_argument("--warm-fault-step", type=int, default=150,
                   help="the fault's step with warm standbys (the run goes 10 steps past it)")
    p.add_argument("--memory-fault-step", type=int, default=153,
                   help="the fault's step with the memory tier (the run goes 10 steps past it)")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts")
    p.add_argument("--hang-wait-s", type=float, default=None,
                   help="how long torchrun gets to recover from a hang (default 120; --quick 30)")
    p.add_argument("--hang-trials", type=int, default=1, help="torchrun hang-rank trials (one outcome)")
    p.add_argument("--trial-timeout-s", type=float, default=300, help="give up on a trial after this")
    return p.parse_args()


def main() -> None:
    exit_on_sigterm()
    args = _args()
    trials = args.trials or (1 if args.quick else 5)
    kinds = tuple(args.kinds.split(",")) if args.kinds else (QUICK_KINDS if args.quick else KINDS)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    parts = set(args.parts.split(","))
    hang_wait = args.hang_wait_s or (30.0 if args.quick else 120.0)
    report: dict[str, Any] = {
        "bench": "mttr", "quick": args.quick, "trials_per_kind": trials, "kinds": list(kinds),
        "kinds_left_out": [k for k in KINDS if k not in kinds], "fault_step": args.fault_step,
        "faulty_rank": faulty_rank(args.spec), "spec": str(args.spec),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": version("torch")}}
    began = time.monotonic()
    with workspace("tsup-mttr-") as root, mosquitto(root) as url:
        spec = write_spec(args.spec, root / "spec.toml", mqtt_url=url)
        report["spec_shape"] = spec_shape(spec)
        warm = write_spec(args.spec, root / "warm.toml", mqtt_url=url, standby=True,
                          steps=steps_past(args.spec, args.warm_fault_step))
        memory = write_spec(args.spec, root / "memory.toml", mqtt_url=url, standby=True, memory_every_steps=5,
                            steps=steps_past(args.spec, args.memory_fault_step))
        tap = Tap(url)
        try:
            report |= _measure(args, parts, kinds, trials, hang_wait, (spec, warm, memory), root, tap, url)
        finally:
            tap.close()
        if "slurm" in parts:
            steps = {"fault_step": args.fault_step, "warm_fault_step": args.warm_fault_step,
                     "memory_fault_step": args.memory_fault_step}
            report["slurm_box"] = _mttr_slurm.measure(
                args.spec, root, kinds=kinds, trials=trials, variants=tuple(args.slurm_variants.split(",")),
                fault_steps=steps, timeout_s=args.trial_timeout_s)
    report["bench_wall_s"] = round(time.monotonic() - began, 1)
    print(json.dumps(report, indent=2))


def _measure(args: argparse.Namespace, parts: set[str], kinds: tuple[str, ...], trials: int, hang_wait: float,
             specs: tuple[Path, Path, Path], root: Path, tap: Tap, url: str) -> dict[str, Any]:
    """Rounds of trials: each round runs the cold start and then every kind under the
    supervisor (cold and warm) and under torchrun once, so that a change in the machine's
    load over the run spreads over every kind instead of landing on a few."""
    spec, warm_spec, memory_spec = specs
    tr_kinds = [k for k in kinds if k in TORCHRUN_KINDS] if "torchrun" in parts else []
    sup_kinds = list(kinds) if "supervisor" in parts else []
    cold: dict[str, list[dict[str, Any]]] = {"fresh": [], "resumed": []}
    sup: dict[str, list[dict[str, Any]]] = {k: [] for k in sup_kinds}
    warm: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds} if "warm" in parts else {}
    memory: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds} if "memory" in parts else {}
    tr: dict[str, list[dict[str, Any]]] = {k: [] for k in tr_kinds}
    for i in range(1, trials + 1):
        if "cold" in parts:
            say(f"round {i}/{trials}: cold start")
            fresh, resumed = _cold_trial(spec, root / f"cold-{i}", tap, url, f"cold-{i}",
                                         args.trial_timeout_s)
            cold["fresh"].append(fresh)
            cold["resumed"].append(resumed)
            say(f"  -> fresh {fresh.get('total_s')} s, resumed {resumed.get('total_s')} s")
        for k in sup_kinds:
            say(f"round {i}/{trials}: supervisor {k}")
            sup[k].append(supervisor_trial(k, spec, root / f"sup-{k}-{i}", tap, args.fault_step,
                                           args.trial_timeout_s))
            say(f"  -> {brief_of(sup[k][-1])}")
        for k, rows in warm.items():
            say(f"round {i}/{trials}: supervisor {k}, warm standby")
            rows.append(supervisor_trial(k, warm_spec, root / f"warm-{k}-{i}", tap, args.warm_fault_step,
                                         args.trial_timeout_s))
            say(f"  -> {brief_of(rows[-1])}")
        for k, rows in memory.items():
            say(f"round {i}/{trials}: supervisor {k}, warm standby and the memory tier")
            rows.append(supervisor_trial(k, memory_spec, root / f"memory-{k}-{i}", tap,
                                         args.memory_fault_step, args.trial_timeout_s))
            say(f"  -> {brief_of(rows[-1])}")
        for k in tr_kinds:
            if k == "hang-rank" and i > args.hang_trials:
                continue
            say(f"round {i}/{trials}: torchrun {k}")
            wait_s = hang_wait if k == "hang-rank" else args.trial_timeout_s
            tr[k].append(_torchrun_trial(k, spec, root / f"torchrun-{k}-{i}", tap, url, args.fault_step,
                                         args.max_restarts, wait_s, args.trial_timeout_s))
            say(f"  -> {brief_of(tr[k][-1])}")
    return _report(parts, kinds, cold, sup, tr, warm, memory)


def _report(parts: set[str], kinds: tuple[str, ...], cold: dict[str, list[dict[str, Any]]],
            sup: dict[str, list[dict[str, Any]]], tr: dict[str, list[dict[str, Any]]],
            warm: dict[str, list[dict[str, Any]]], memory: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "cold" in parts:
        out["cold_start"] = {name: summary_of(rows, "completed") for name, rows in cold.items()}
    floor = out.get("cold_start", {}).get("resumed", {}).get("median", {}).get("total_s")
    if "supervisor" in parts:
        out["supervisor"] = {k: summary_of(rows) for k, rows in sup.items()}
        out["supervisor_overhead_vs_cold_resume_s"] = _overheads(out["supervisor"], floor)
    for part, rows_of in (("warm", warm), ("memory", memory)):
        if rows_of:
            name = "warm_standby" if part == "warm" else "warm_standby_memory_tier"
            out[name] = {k: summary_of(rows) for k, rows in rows_of.items()}
            totals = {k: v.get("median", {}).get("total_s") for k, v in out[name].items()}
            out[f"{part}_vs_cold_resume"] = {k: round(t / floor, 3) if floor and t else None
                                             for k, t in totals.items()}
    if "torchrun" in parts:
        out["torchrun"] = {k: summary_of(tr[k]) if k in tr else {"run": False, "why": TORCHRUN_CANNOT[k]}
                           for k in kinds}
        out["torchrun_overhead_vs_cold_resume_s"] = _overheads(
            {k: v for k, v in out["torchrun"].items() if "median" in v}, floor)
    loads = [r["loadavg_1m"] for rows in (*cold.values(), *sup.values(), *tr.values(), *warm.values(),
                                          *memory.values()) for r in rows]
    out["loadavg_1m_max"] = max(loads, default=None)
    if loads and max(loads) > (os.cpu_count() or 1):
        out["note"] = (f"the 1-min load average reached {max(loads)} on {os.cpu_count()} CPUs during the "
                       "trials (other processes on this machine): start_s and init_s, all CPU-bound process "
                       "start-up, vary most with it; compare kinds by detect_s to schedule_s")
    return out


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
