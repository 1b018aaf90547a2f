"""The supervisor keeping a real model training on one GPU, and what each of its saves,
restores and recoveries cost, beside the limits of the machine it ran on.

    python bench/gpu_recovery.py                 # llama3.2-1b in bf16 on one GPU (about 4 min)
    python bench/gpu_recovery.py --cpu           # a small shape on this machine's CPU (the smoke test)

Prints one JSON object on stdout, progress on stderr. It runs ``training-supervisor run``
(the embedded supervisor: local launcher, its own MQTT broker, SQLite in a state
directory) on this spec, the default policy unless ``--policy KEY=VALUE`` says otherwise:

    [resources]  launcher = "local", nodes = 1, ranks_per_node = 1, spares = 1, standby = true
    [trainer]    model = "llama3.2-1b", steps = 120, global_batch_size = 8, micro_batch_size = 2,
                 seq_len = 2048 (bf16 compute, fp32 master weights and AdamW state: 18 GB a rank)
    [trainer.checkpoint]  every_steps = 40, keep = 1, asynchronous = true, memory_every_steps = 40

with two faults: ``kill-rank@75`` SIGKILLs the rank (its node lives on: the next attempt
runs on the same node from that node's memory save of step 40, as new as the persistent
one and read from no storage, a warm standby taking the rank), then ``kill-node@115``
takes the node, its memory with it (the next attempt runs on the spare, from the
persistent checkpoint of step 80). Each fault comes 35 steps (about 15 s) after the last
save began: on an H200 a save of 18 GB is whole in 5 to 12 s, so the newest save is
whole when the fault comes (in the first GPU run, with saves every 10 steps, a fault 7
steps after one found it unfinished, and the run went back 17 steps). The memory tier
saves as often as the persistent one: each writes 18 GB beside training, and a save that
comes before the previous one is written waits for it (``--memory-every`` to try
others). With ``--cpu`` the model is a 3.3 M-parameter shape (40 MB of state), 18 steps,
memory every 2 and persistent every 6, faults at 10 and 15.

Figures (each from the run's own records: the trainer's rank-0 logs, its SQLite, the
summary; ``ratio`` is the figure over its limit, 1.0 at the limit):

- ``train``: step time and MFU (medians of attempt 1's steps after the first 3), tokens/s;
- ``first_steps_s``: each attempt's first 4 step times (what the attempt's set-up costs
  the steps after its first: the staging buffers are laid out then);
- ``saves``: per save, what it blocked training (``blocked_s``, against the device-to-host
  copy of a rank's state at the pinned rate: ``copy_limit_s``) and the whole save
  (``whole_s``, and its GB/s);
- ``restores``: per restore, seconds and GB/s of a rank's state against host-to-device
  (from pinned memory: the limit either tier's bytes reach the device at), and where the
  seconds went: the live state laid out (a fresh optimizer's moments made), the bytes
  read (and verified) and copied in, the state handed to the model and optimizer;
- ``recoveries``: SIGKILL to the first resumed step, per fault, and the ``cold_start_s``
  (attempt 1's launch to its first step) they compare with;
- ``standby``: a warm standby's time to import and to make its device ready;
- ``limits``: this machine's device-to-host and host-to-device GB/s (pinned and pageable),
  host memcpy GB/s (one thread and ``--threads``), BLAKE3 GB/s on one thread, and the
  host memory and /dev/shm it had, measured in the same run before training.

The state directory (checkpoints included) is under /dev/shm unless ``--state-dir``
says otherwise, so that storage is not the bottleneck; 18 GB of state takes up to about
110 GB of host memory at the peaks (two pinned staging copies, the memory tier's save
and the one being written, the persistent checkpoint and the one being written).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GB = 1e9
GPU = {"model": "llama3.2-1b", "steps": 120, "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 2048,
       "every": 40, "memory_every": 40, "faults": ("kill-rank@75", "kill-node@115")}
CPU = {"model": "tiny", "overrides": {"hidden_size": 256, "intermediate_size": 704, "n_layers": 4,
                                       "n_heads": 4, "n_kv_heads": 4},
       "steps": 18, "global_batch_size": 4, "micro_batch_size": 4, "seq_len": 64,
       "every": 6, "memory_every": 2, "faults": ("kill-rank@10", "kill-node@15")}
_SAVED = re.compile(r"^checkpoint step (\d+) committed to \S+ in (\S+) s "
                    r"\(beside training; it blocked (\S+) s")
_MEMORY = re.compile(r"^memory checkpoint step (\d+) whole in (\S+) s \(training blocked (\S+) s")
_RESUMED = re.compile(r"^resumed from (\S+) at step (\d+) in (\S+) s \((\d+) bytes, \S+ GB/s a rank; "
                      r"state laid out in (\S+) s, read and copied in (\S+) s, applied in (\S+) s")
_STEP_TIME = re.compile(r"^step \d+/\d+ .* step_time_s (\S+)")
_STANDBY = re.compile(r"^standby: pid \d+ warm in (\S+) s \((\S+) ready in (\S+) s[,)]")


def say(text: str) -> None:
    print(f"gpu_recovery: {text}", file=sys.stderr, flush=True)


# --- the machine's limits ----------------------------------------------------------------


def _best_s(fn: Any, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def limits(size: int, threads: int) -> dict[str, Any]:
    """This machine's copy and hash rates for ``size`` bytes (a rank's state, at most 2 GB
    here: the rates hold for more)."""
    import torch

    n = min(size, 2 << 30)
    out: dict[str, Any] = {"bytes": n}
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    torch.set_num_threads(1)
    out["memcpy_gb_s"] = round(n / _best_s(lambda: dst.copy_(src)) / GB, 2)
    torch.set_num_threads(threads)
    out["memcpy_threads_gb_s"] = round(n / _best_s(lambda: dst.copy_(src)) / GB, 2)
    out["threads"] = threads
    torch.set_num_threads(1)
    view = memoryview(src.numpy())
    try:
        import blake3
    except ImportError:  # the trainer then hashes with SHA-256
        import hashlib

        out["blake3_gb_s"] = None
        out["sha256_gb_s"] = round(n / _best_s(lambda: hashlib.sha256(view).digest(), 2) / GB, 2)
    else:
        out["blake3_gb_s"] = round(n / _best_s(lambda: blake3.blake3(view).digest(), 2) / GB, 2)
    if torch.cuda.is_available():
        device = torch.empty(n, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(n, dtype=torch.uint8)

        def timed(copy: Any) -> float:
            def run() -> None:
                copy()
                torch.cuda.synchronize()
            return round(n / _best_s(run) / GB, 2)

        out["device"] = torch.cuda.get_device_name()
        out["d2h_pinned_gb_s"] = timed(lambda: pinned.copy_(device, non_blocking=True))
        out["d2h_pageable_gb_s"] = timed(lambda: pageable.copy_(device))
        out["h2d_pinned_gb_s"] = timed(lambda: device.copy_(pinned, non_blocking=True))
        out["h2d_pageable_gb_s"] = timed(lambda: device.copy_(pageable))
        del device, pinned, pageable
        torch.cuda.empty_cache()
    else:
        out["device"] = "cpu"
    lines = Path("/proc/meminfo").read_text().splitlines()
    meminfo = dict(line.split(":", 1) for line in lines if ":" in line)
    out["host_memory_gb"] = round(int(meminfo["MemTotal"].split()[0]) * 1024 / GB, 1)
    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
    out["shm_gb"] = round(shm.total / GB, 1) if shm else None
    return out


# --- the supervised run ----------------------------------------------------------------


def spec_text(shape: dict[str, Any], policy: dict[str, str]) -> str:
    overrides = shape.get("overrides")
    model_overrides = ("model_overrides = { " + ", ".join(f"{k} = {v}" for k, v in overrides.items()) + " }\n"
                       if overrides else "")
    return textwrap.dedent(f"""\
        name = "gpu-recovery"
        [resources]
        launcher = "local"
        nodes = 1
        ranks_per_node = 1
        spares = 1
        standby = true
        [trainer]
        model = "{shape['model']}"
        """) + model_overrides + textwrap.dedent(f"""\
        steps = {shape['steps']}
        global_batch_size = {shape['global_batch_size']}
        micro_batch_size = {shape['micro_batch_size']}
        seq_len = {shape['seq_len']}
        seed = 7
        [trainer.checkpoint]
        every_steps = {shape['every']}
        keep = 1
        asynchronous = true
        memory_every_steps = {shape['memory_every']}
        [policy]
        """) + "".join(f"{k} = {v}\n" for k, v in policy.items())


def supervise(spec: Path, state: Path, faults: tuple[str, ...], timeout_s: float,
              log: Path) -> dict[str, Any]:
    """Runs the supervisor to the end; its progress goes to ``log`` as it comes (so that a
    run stopped from outside still leaves it)."""
    argv = [sys.executable, "-m", "cli.daemon", "run", str(spec), "--state-dir", str(state), "--json"]
    for fault in faults:
        argv += ["--chaos", fault]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "TSUP_ALLOW_ROOT_RUNS": "true"}
    with log.open("w") as err_file:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err_file,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, timed_out = proc.communicate()[0], True
    err = log.read_text(errors="replace")
    if timed_out:
        raise SystemExit(f"the supervised run did not end in {timeout_s:.0f} s:\n{err[-4000:]}")
    if not out.strip():
        raise SystemExit(f"the supervised run printed no summary (exit {proc.returncode}):\n{err[-4000:]}")
    summary: dict[str, Any] = json.loads(out)
    summary["exit_code"] = proc.returncode
    return summary


def _logs(state: Path, run_id: str) -> dict[int, list[str]]:
    """Rank 0's log lines, per attempt."""
    out: dict[int, list[str]] = {}
    for log in (state / "runs" / run_id / "attempts").glob("*/rank-0000.*.log"):
        out[int(log.parent.name)] = log.read_text(errors="replace").splitlines()
    return out


def figures(state: Path, summary: dict[str, Any], lim: dict[str, Any]) -> dict[str, Any]:
    run_id = summary["run_id"]
    logs = _logs(state, run_id)
    db = sqlite3.connect(state / "supervisor.db")
    try:
        steps = db.execute("SELECT step, step_time_s, mfu, tokens_per_s FROM metrics "
                           "WHERE attempt = 1 AND step > 3 ORDER BY step").fetchall()
    finally:
        db.close()
    train = {"step_time_s": _median([s[1] for s in steps]),
             "mfu": _median([s[2] for s in steps if s[2] is not None]),
             "tokens_per_s": _median([s[3] for s in steps if s[3] is not None]), "steps_timed": len(steps)}
    # Each attempt's first steps, which pay for what an attempt sets up once (the staging
    # buffers are laid out after its first step).
    first_steps = {a: [float(m[1]) for m in map(_STEP_TIME.match, lines) if m][:4]
                   for a, lines in sorted(logs.items())}
    resumed = [(a, m) for a, lines in sorted(logs.items()) for m in map(_RESUMED.match, lines) if m]
    size = max((int(m[4]) for _, m in resumed), default=0)
    d2h, h2d = lim.get("d2h_pinned_gb_s"), lim.get("h2d_pinned_gb_s") or lim["memcpy_gb_s"]
    copy_limit = size / (d2h * GB) if size and d2h else None
    saves = []
    for attempt, lines in sorted(logs.items()):
        for line in lines:
            for tier, pattern in (("persistent", _SAVED), ("memory", _MEMORY)):
                m = pattern.match(line)
                if m:
                    whole, blocked = float(m[2]), float(m[3])
                    saves.append({"attempt": attempt, "tier": tier, "step": int(m[1]), "blocked_s": blocked,
                                  "whole_s": whole,
                                  "whole_gb_s": round(size / whole / GB, 3) if size and whole > 0 else None,
                                  "copy_limit_s": _round(copy_limit),
                                  "ratio": _round(blocked / copy_limit) if copy_limit else None})
    restores = []
    for attempt, m in resumed:
        seconds, nbytes = float(m[3]), int(m[4])
        tier = "memory" if m[1].startswith("memory:") else "persistent"
        gb_s = nbytes / seconds / GB if seconds > 0 else None
        restores.append({"attempt": attempt, "tier": tier, "from": m[1], "step": int(m[2]),
                         "seconds": seconds, "bytes": nbytes, "gb_s": _round(gb_s), "limit_gb_s": h2d,
                         "layout_s": float(m[5]), "read_s": float(m[6]), "apply_s": float(m[7]),
                         "ratio": _round(gb_s / h2d) if gb_s and h2d else None})
    history = {a["number"]: a for a in summary["attempt_history"]}
    first = history.get(1, {})
    launched, stepped = first.get("started_at"), first.get("first_step_at")
    cold = stepped - launched if launched and stepped else None
    recoveries = []
    for f in summary["faults"]:
        if f.get("injected_at") is None or f.get("recovered_at") is None:
            continue
        nxt = history.get(f["attempt"] + 1, {})
        recoveries.append({"kind": f["kind"], "step": f["step"], "nodes": f["nodes"],
                           "detect_s": _round(f["detected_at"] - f["injected_at"]),
                           "kill_to_first_step_s": _round(f["recovered_at"] - f["injected_at"]),
                           "resumed_from": nxt.get("resume_from"), "on": nxt.get("nodes")})
    standby = [{"warm_s": float(m[1]), "device": m[2], "device_ready_s": float(m[3])}
               for log in (state / "runs" / run_id / "attempts").glob("standby.log")
               for m in map(_STANDBY.match, log.read_text(errors="replace").splitlines()) if m]
    return {"train": train, "first_steps_s": first_steps, "state_bytes_per_rank": size, "saves": saves,
            "restores": restores, "recoveries": recoveries, "cold_start_s": _round(cold),
            "standby": standby[:4]}


def _keep_logs(state: Path, into: Path) -> None:
    """The run's log files (not its checkpoints) into ``into``/logs.tar.gz."""
    import tarfile

    with tarfile.open(into / "logs.tar.gz", "w:gz") as tar:
        for log in sorted(state.glob("runs/*/attempts/**/*.log")):
            tar.add(log, arcname=str(log.relative_to(state)))


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="a small shape on CPU (also without a GPU)")
    parser.add_argument("--state-dir", type=Path, help="default: a new directory under /dev/shm")
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 2),
                        help="threads of the multi-threaded memcpy limit")
    parser.add_argument("--policy", action="append", default=[], metavar="KEY=VALUE",
                        help="a [policy] key of the spec (repeatable); default policy otherwise")
    parser.add_argument("--memory-every", type=int, default=None,
                        help="the spec's memory_every_steps (default: the shape's)")
    parser.add_argument("--steps", type=int, default=None, help="the shape's steps (default: the shape's)")
    parser.add_argument("--faults", default=None,
                        help="comma-separated chaos faults, or 'none' (default: the shape's)")
    parser.add_argument("--timeout-s", type=float, default=1500)
    parser.add_argument("--keep", action="store_true", help="keep the state directory")
    parser.add_argument("--logs", type=Path, default=None,
                        help="a directory for the supervisor's log and the ranks' logs (logs.tar.gz), "
                             "kept also when the run fails")
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    shape = dict(GPU if gpu else CPU)
    if args.memory_every is not None:
        shape["memory_every"] = args.memory_every
    if args.steps is not None:
        shape["steps"] = args.steps
    if args.faults is not None:
        shape["faults"] = tuple(f for f in args.faults.split(",") if f and f != "none")
    policy = dict(kv.split("=", 1) for kv in args.policy)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else None
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="tsup-gpu-recovery-", dir=base))
    out: dict[str, Any] = {"gpu": gpu, "shape": {k: v for k, v in shape.items() if k != "faults"},
                           "faults": list(shape["faults"]), "policy": policy or "default",
                           "state_dir": str(state)}
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    try:
        say("measuring this machine's copy and hash rates ...")
        out["limits"] = limits(18 * 10**9 if gpu else 40 * 10**6, args.threads)
        spec = state / "spec.toml"
        state.mkdir(parents=True, exist_ok=True)
        spec.write_text(spec_text(shape, policy))
        say(f"supervising {shape['model']} for {shape['steps']} steps with {', '.join(shape['faults'])} ...")
        started = time.monotonic()
        summary = supervise(spec, state, shape["faults"], args.timeout_s,
                            (args.logs or state) / "supervisor.log")
        out["wall_s"] = round(time.monotonic() - started, 1)
        for key in ("state", "reason", "attempts", "drained_nodes", "ettr"):
            out[key] = summary[key]
        out["faults_seen"] = [{"kind": f["kind"], "step": f["step"], "summary": f["summary"]}
                              for f in summary["faults"]]
        out |= figures(state, summary, out["limits"])
    finally:
        if args.logs:
            _keep_logs(state, args.logs)
        if not args.keep and args.state_dir is None:
            shutil.rmtree(state, ignore_errors=True)
    print(json.dumps(out, indent=2))
    if out.get("state") != "SUCCEEDED":
        sys.exit(1)


if __name__ == "__main__":
    main()
