"""An attempt's srun, as the controller sees it (supervisor/slurm/launcher.py): the
process found again after a daemon restart (``find_srun``), how each of its tasks
ended, from srun's own lines at the end of its log (``task_exits``): the exit code, or
the signal that ended it (negative), and what that makes of a rank (``rank_state``). An
attempt made of warm standbys has a step a node (``steps_of``).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import psutil

from supervisor import user_files
from supervisor.domain import ProcState

# "srun: error: node1: task 1: Exited with exit code 3", "...: tasks 0-1: Killed"
TASK_LINE = re.compile(r"srun: error: (\S+): tasks? ([0-9,\-]+): (.+)$")
SRUN_LOG_TAIL = 1 << 20  # srun's own lines about its tasks come last


def task_exits(log_path: Path, base: Path | None = None) -> dict[int, int]:
    """Per-task endings srun reported: task -> exit code (negative: the signal). ``base``:
    the daemon's directory the log is reached from, no link below it followed."""
    out: dict[int, int] = {}
    try:  # the run's user's directory: a regular file only, and only its end (read every tick)
        size = user_files.size_of(log_path, base=base)
        text = user_files.read_bytes(log_path, SRUN_LOG_TAIL, base=base,
                                     offset=max(0, size - SRUN_LOG_TAIL)).decode(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        m = TASK_LINE.search(line)
        if m is None:
            continue
        what = m.group(3)
        code_m = re.search(r"exit code (\d+)", what)
        if code_m:
            code = int(code_m.group(1))
        elif "Killed" in what:
            code = -signal.SIGKILL
        elif "Terminated" in what:
            code = -signal.SIGTERM
        elif "Segmentation" in what:
            code = -signal.SIGSEGV
        elif "Aborted" in what:
            code = -signal.SIGABRT
        else:
            code = 1
        for rank in _task_numbers(m.group(2)):
            out[rank] = code
    return out


def _task_numbers(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def find_srun(step_name: str, job: str, uid: int) -> psutil.Process | None:
    """The srun of this host that starts ``step_name`` in allocation ``job`` as ``uid``
    (anyone can start an srun whose command line says so)."""
    flags = {f"--job-name={step_name}", f"--jobid={job}"}
    for p in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            cmd = p.info["cmdline"] or []
            uids = p.info["uids"]
            if (cmd and os.path.basename(cmd[0]) == "srun" and flags <= set(cmd)
                    and uids is not None and uids.real == uid and uids.effective == uid):
                return p
        except psutil.Error:
            continue
    return None


def start_time_of(pid: int) -> float:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0


def steps_of(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The attempt's steps, each with its srun, its log and (made of standbys) the task that
    is each of its ranks: one, the attempt's own, unless its ranks were standbys, one step
    a node (supervisor/slurm/standby.py)."""
    if "parts" in info:
        return list(info["parts"])
    return [{"step": info["step"], "srun_pid": info["srun_pid"], "srun_ct": info["srun_ct"],
             "log": info["log"], "tasks": None}]


def rank_state(exit_code: int | None, srun_code: int | None, srun_alive: bool, step_listed: bool | None, *,
                failed_named: bool) -> tuple[ProcState, int | None]:
    """A rank's state from its step's: the exit srun named for it; while srun or the step
    lives, unknown (telemetry knows better); srun ended without naming it: exited 0, or
    with srun's own code when srun named no task (no step could be created)."""
    if exit_code is not None:
        return ProcState.EXITED, exit_code
    if srun_alive or step_listed:
        return ProcState.UNKNOWN, None
    if srun_code is not None and srun_code >= 0:
        return ProcState.EXITED, 0 if failed_named else srun_code
    if step_listed is None and srun_code is None:
        return ProcState.UNKNOWN, None
    return ProcState.VANISHED, None
