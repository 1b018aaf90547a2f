"""One trial of bench/mttr.py, and its phases, wherever the ranks run: the supervisor
under a fault (``supervisor_trial``), the phases of a launch the benchmark made itself
(``trainer_phases``), and the summaries of a kind's trials. bench/mttr.py's docstring
says what each phase is; bench/_mttr_slurm.py runs the same trials on the Slurm box.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from _harness import (
    AttemptTimes,
    SupervisorRun,
    Tap,
    attempt_times,
    chain,
    faulty_rank,
    median_of,
    rank0_log,
    restore_load_s,
    rounded,
    say,
    stop_plain,
    wait_until,
    world_of,
)

from supervisor.launchers.base import Launcher, LaunchSpec

PHASES = ("detect_s", "teardown_s", "schedule_s", "start_s", "init_s", "restore_s", "first_step_s", "total_s",
          "restore_load_s", "steps_redone", "supervisor_saw_first_step_s", "standby_waited_s")


def trainer_phases(origin: tuple[str, float | None], t: AttemptTimes) -> dict[str, float | None]:
    """start, init, restore (when the attempt restored) and first step, from ``origin``."""
    points = [origin, ("start", t.up)]
    if t.restore_begin is not None:
        points += [("init", t.restore_begin), ("restore", t.train_begin)]
    else:
        points += [("init", t.train_begin)]
    return chain([*points, ("first_step", t.first_step)])


def timed_launch(launcher: Launcher, spec: LaunchSpec, tap: Tap, until_step: int,
                 timeout_s: float) -> dict[str, Any]:
    """Launch ``spec``'s ranks (``python -m trainer --resume auto``: a cold start), wait
    for ``until_step`` of its attempt, kill them; the phases from the launch."""
    load = load_now()
    launched = time.time()
    info = launcher.start(spec)
    try:
        ok = tap.wait_step(spec.run_id, until_step, timeout_s, attempt=spec.attempt)
    finally:
        stop_plain(launcher, info)
    t = attempt_times(tap, spec.run_id, spec.attempt, len(spec.nodes) * spec.ranks_per_node)
    log = rank0_log(spec.log_dir)
    return {"completed": ok, "loadavg_1m": load, **trainer_phases(("launch", launched), t),
            "total_s": rounded(t.first_step - launched) if t.first_step else None,
            "restore_load_s": restore_load_s(log) if log and t.restore_begin else None}


def chaos_arg(kind: str, step: int, rank: int) -> str:
    return f"{kind}@{step}:{rank}" if kind in ("crash", "device") else f"{kind}@{step}"


def supervisor_trial(kind: str, spec: Path, workdir: Path, tap: Tap, fault_step: int,
                     timeout_s: float, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One fault under ``training-supervisor run`` (with ``env`` added to its environment),
    cancelled at the first resumed step."""
    tap.clear()
    load = load_now()
    run = SupervisorRun(spec, workdir / "state", [chaos_arg(kind, fault_step, faulty_rank(spec))], env=env)
    try:
        resumed = wait_until(lambda: resumed_in(tap, "run-1", 1) or (False if run.proc.poll() is not None
                                                                    else None), timeout_s)
        time.sleep(1.0)  # let the supervisor record what it saw of the first step (run.recovered)
        run.cancel()
    finally:
        run.close()
    if not resumed:
        say(f"  {kind}: no resumed step within {timeout_s:.0f} s; supervisor said: {run.stderr_tail()}")
    row = supervisor_phases(run, tap, fault_attempt=1, world=world_of(spec))
    return {"recovered": bool(resumed), "loadavg_1m": load, **row}


def resumed_in(tap: Tap, run_id: str, fault_attempt: int) -> bool | None:
    return True if any(m.attempt > fault_attempt for m in tap.steps(run_id)) else None


def supervisor_phases(run: SupervisorRun, tap: Tap, fault_attempt: int, world: int) -> dict[str, Any]:
    db = run.db()
    injected = db.first("chaos.injected")
    fault_at = tap.first_fault_ts("run-1", fault_attempt) or (injected.ts if injected else None)
    detected = db.first("fault.detected", lambda e: e.data.get("attempt") == fault_attempt)
    recovered = db.first("run.recovered")
    old, new = db.attempts.get(fault_attempt, {}), db.attempts.get(fault_attempt + 1, {})
    t = attempt_times(tap, "run-1", fault_attempt + 1, world)
    phases = chain([("fault", fault_at), ("detect", detected.ts if detected else None),
                    ("teardown", old.get("ended_at")), ("schedule", new.get("started_at")),
                    ("start", t.up), ("init", t.restore_begin), ("restore", t.train_begin),
                    ("first_step", t.first_step)])
    log = run.rank0_log(fault_attempt + 1)
    fault_step = injected.data.get("step") if injected else None
    return {**phases, **totals_of(fault_at, t, fault_step, new.get("resume_step")),
            "restore_load_s": restore_load_s(log) if log else None,
            "supervisor_saw_first_step_s": rounded(recovered.ts - fault_at) if recovered and fault_at
            else None,
            "fault": injected.data.get("action") if injected else None,
            "new_nodes": json.loads(new["nodes"]) if new.get("nodes") else None,
            # Made of warm standbys (the Slurm launcher says so; the local one records none).
            "warm": bool(json.loads(new["launch_info"]).get("warm")) if new.get("launch_info") else None,
            "standby_waited_s": standby_waited_s(run.state_dir / "runs" / "run-1" / "attempts"
                                                 / str(fault_attempt + 1))}


_TOOK = re.compile(r"standby: pid \d+ is rank \d+ of attempt \S+ "
                   r"\(warm in [0-9.]+ s, then waited ([0-9.]+) s\)")


def standby_waited_s(log_dir: Path) -> float | None:
    """How long the least rested of an attempt's standbys had waited, warm, for its
    assignment (trainer/standby.py says so in the rank's log): 0 means one was still
    importing when the fault came, and its import is then part of ``init_s``. None: no
    rank of the attempt was a standby."""
    waits = [float(m.group(1)) for log in log_dir.glob("rank-*.log")
             for m in _TOOK.finditer(log.read_text(errors="replace")[:20_000])]
    return min(waits) if waits else None


def totals_of(fault_at: float | None, t: AttemptTimes, fault_step: int | None,
            resume_step: int | None) -> dict[str, Any]:
    """The whole recovery, and the steps it ran again (from the checkpoint to the step
    the fault struck at)."""
    redone = fault_step - resume_step if fault_step is not None and resume_step is not None else None
    return {"total_s": rounded(t.first_step - fault_at) if t.first_step and fault_at else None,
            "fault_step": fault_step, "resume_step": resume_step,
            "steps_redone": redone if t.first_step else None}


def load_now() -> float:
    """This machine's 1-minute load average as a trial starts (other users' work shows here)."""
    return round(os.getloadavg()[0], 2)


def summary_of(rows: list[dict[str, Any]], ok_key: str = "recovered") -> dict[str, Any]:
    """Every trial, and the median of each field over the trials that got there."""
    ok = [r for r in rows if r.get(ok_key)]
    return {"trials": len(rows), ok_key: len(ok),
            "median": {k: median_of(ok, k) for k in PHASES if any(k in r for r in rows)},
            "runs": rows}


def brief_of(row: Mapping[str, Any]) -> str:
    if not row.get("recovered"):
        return f"not recovered (gave up after {row.get('gave_up_after_s', '?')} s)"
    return ", ".join(f"{k} {row[k]}" for k in ("detect_s", "total_s") if row.get(k) is not None)
