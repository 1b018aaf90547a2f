"""How long a checkpoint holds up training, per tier: synchronous, asynchronous, memory.

    python bench/checkpoint_tiers.py [--ranks 2] [--steps 10] [--every 3]
    python bench/checkpoint_tiers.py --quick      # the tiny model: seconds, a smoke test

The tier part of the trainer's overhead measurements (bench/overhead.py measures
telemetry and today's synchronous save on the tiny model). Runs the reference trainer
(``python -m trainer``, gloo on CPU) as ``--ranks`` local processes on a model large
enough that a synchronous save takes seconds here (``MODEL``: 116 M parameters, 466 MB
in fp32; with AdamW's two moments 1.4 GB of state, 0.7 GB per rank of 2), once per mode:

- ``none``: no checkpoint before the last step (the reference for the wall time);
- ``sync``: a persistent DCP save every ``--every`` steps on the training thread
  (barrier, write, manifest hashes, barrier, commit), as before this tier work;
- ``async``: the same checkpoints with ``checkpoint.asynchronous``: the training thread
  copies its shards, a background thread writes and commits them;
- ``memory``: the memory tier every ``--every`` steps (``memory_every_steps``): the
  training thread copies its shards; a background thread serializes them to /dev/shm
  and swaps replicas with the next node's rank. On this one host the "next node" is a
  process beside it: the replica goes over loopback, not a network.

Per save, four figures:

- ``reported_s``: what the trainer says it blocked: the whole save for ``sync``, the copy
  for the others (rank 0's log line, the same number as the telemetry's duration_s);
- ``whole_save_s``: from the copy to the commit (persistent) or to the barrier after the
  replica exchange (memory), background work included (rank 0's log line);
- ``stall_s``: derived from rank 0's progress lines, stamped on arrival here: the gap
  from step N's line to step N + 1's, less step N + 1's own step time and less the
  median of the same gap over steps without a save. It holds everything the save cost
  the training thread, including a background thread competing for the 2 cores;
- ``wall_excess_s``: (the mode's wall time from its first step line to its last, less
  the ``none`` run's) / saves: what a save cost the run, background work included.

The final step's save is not counted (nothing follows it).

Then restores, each a trainer started to resume and stop at once, its time and the bytes
of a rank's state from rank 0's log line (``resumed from ... in X s (N bytes, ...)``):

- ``persistent``: the ``sync`` mode's final checkpoint, read by every rank with its
  threads, each file verified against the manifest as it is read;
- ``memory``: a memory save of step 1 (left by a run that crashes at step 2), mapped
  from /dev/shm and copied into the model and optimizer;

with where the time went (``layout_s``: the live state laid out to load into, a fresh
optimizer's moments made; ``read_s``: the bytes read, verified and copied in;
``apply_s``: handed to the model and optimizer), beside ``memcpy_gb_s``, this machine's
copy of one rank's state size between host
buffers already touched, on one thread, measured in the same run (the best of three):
the limit a restore into host memory is held to.

Output: one JSON object on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from supervisor.ports import free_port  # noqa: E402
from trainer import memory_tier  # noqa: E402

MODEL = {"model": "llama2-7b", "model_overrides": {"hidden_size": 1024, "intermediate_size": 2816,
                                                     "n_layers": 4, "n_heads": 16, "n_kv_heads": 16}}
MODES = ("none", "sync", "async", "memory")
# Rank 0's progress line: "step 3/10 loss ... step_time_s 0.412 ..." (fields may be added between).
_STEP = re.compile(r"^step (\d+)/\d+ .*?\bstep_time_s (\S+)")
# Per mode: (step, the time training was blocked, the whole save's time) from rank 0's log.
_REPORTED = {
    "sync": re.compile(r"^checkpoint step (\d+) committed to \S+ in ((\S+)) s"),
    "async": re.compile(r"^checkpoint step (\d+) committed to \S+ in (\S+) s "
                        r"\(beside training; it blocked (\S+) s"),
    "memory": re.compile(r"^memory checkpoint step (\d+) whole in (\S+) s \(training blocked (\S+) s"),
}


def _memory_root() -> Path:
    return memory_tier.default_root(f"bench-{os.getpid()}")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def config_for(mode: str, directory: Path, steps: int, every: int, model: dict[str, Any]) -> Path:
    ck: dict[str, Any] = {"dir": str(directory / "ck"), "keep": 2, "every_steps": 0}
    if mode in ("sync", "async"):
        ck["every_steps"] = every
        ck["asynchronous"] = mode == "async"
    if mode == "memory":  # node memory: /dev/shm, as on a real node (trainer/memory_tier.py)
        ck |= {"memory_every_steps": every, "memory_dir": str(_memory_root())}
    config = {**model, "steps": steps, "global_batch_size": 2, "seq_len": 32, "seed": 7,
              "output_dir": str(directory / "out"), "checkpoint": ck}
    path = directory / f"{mode}.json"
    path.write_text(json.dumps(config))
    return path


def run_mode(mode: str, config: Path, ranks: int, *, resume: str = "none",
             env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the trainer; return rank 0's lines with their arrival times, and exit codes."""
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TSUP_")}
        env |= {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TSUP_NODE": f"node{rank}",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        argv = [sys.executable, "-m", "trainer", "--config", str(config), "--resume", resume]
        procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                      cwd=REPO))
    lines: list[tuple[float, str]] = []
    assert procs[0].stdout is not None
    for line in procs[0].stdout:
        lines.append((time.monotonic(), line.rstrip("\n")))
    codes = [p.wait() for p in procs]
    return {"lines": lines, "exit_codes": codes}


def analyse(mode: str, lines: list[tuple[float, str]], every: int, steps: int) -> dict[str, Any]:
    at: dict[int, float] = {}
    step_time: dict[int, float] = {}
    for t, line in lines:
        m = _STEP.match(line)
        if m:
            at[int(m[1])], step_time[int(m[1])] = t, float(m[2])
    reported: dict[int, float] = {}
    whole: dict[int, float] = {}
    pattern = _REPORTED.get(mode)
    for _, line in lines:
        m = pattern.match(line) if pattern else None
        if m:
            reported[int(m[1])], whole[int(m[1])] = float(m[3]), float(m[2])
    saves = [n for n in range(every, steps, every)] if mode != "none" else []
    gaps = {n: at[n + 1] - at[n] - step_time[n + 1] for n in range(2, steps) if n in at and n + 1 in at}
    ordinary = [g for n, g in gaps.items() if n not in saves]
    base = statistics.median(ordinary) if ordinary else 0.0
    stalls = [round(gaps[n] - base, 3) for n in saves if n in gaps]
    return {
        "saves": saves,
        "reported_s": [round(reported[n], 3) for n in saves if n in reported],
        "whole_save_s": [round(whole[n], 3) for n in saves if n in whole],
        "stall_s": stalls,
        "stall_p50_s": round(statistics.median(stalls), 3) if stalls else None,
        "wall_s": round(at[max(at)] - at[min(at)], 3) if at else None,
        "step_time_p50_s": round(statistics.median(step_time.values()), 3) if step_time else None,
    }


_RESUMED = re.compile(r"^resumed from \S+ at step \d+ in (\S+) s \((\d+) bytes, \S+ GB/s a rank; "
                      r"state laid out in (\S+) s, read and copied in (\S+) s, applied in (\S+) s")


def restore(what: str, config: Path, ranks: int, resume: str) -> dict[str, Any]:
    """Resume from ``resume`` and stop at once: the restore's time and GB/s on rank 0."""
    result = run_mode(what, config, ranks, resume=resume)
    lines = [line for _, line in result["lines"]]
    if result["exit_codes"] != [0] * ranks:
        tail = "\n".join(lines[-20:])
        raise SystemExit(f"restore {what}: the trainer exited {result['exit_codes']}:\n{tail}")
    said = next((m for m in map(_RESUMED.match, lines) if m), None)
    if said is None:
        raise SystemExit(f"restore {what}: no 'resumed from' line:\n" + "\n".join(lines[-20:]))
    seconds, size = float(said[1]), int(said[2])
    return {"seconds": seconds, "gb_s": round(size / seconds / 1e9, 3), "bytes_per_rank": size,
            "layout_s": float(said[3]), "read_s": float(said[4]), "apply_s": float(said[5])}


def memcpy_gb_s(size: int) -> float:
    """GB/s of one thread copying ``size`` bytes between host buffers already touched (best of 3)."""
    import torch

    torch.set_num_threads(1)
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return size / best / 1e9


def restores(root: Path, model: dict[str, Any], ranks: int, every: int) -> dict[str, Any]:
    """Both tiers' restores (see the module docstring); the sync mode's checkpoints are in ``root``."""
    out: dict[str, Any] = {}
    checkpoints = sorted((root / "sync" / "ck").glob("step_*"))
    final = checkpoints[-1]
    config = config_for("none", root / "sync", int(final.name.removeprefix("step_")), every, model)
    say(f"restore: persistent, from {final.name} ...")
    out["persistent"] = restore("persistent", config, ranks, str(final))
    directory = root / "memory-restore"
    directory.mkdir()
    crashing = config_for("memory", directory, 2, 1, model)
    say("restore: memory, a save of step 1 left by a crash at step 2 ...")
    crashed = run_mode("memory-save", crashing, ranks, env_extra={"TSUP_FAULT": "crash@2"})
    if crashed["exit_codes"] != [1] * ranks:
        raise SystemExit(f"memory-save: expected the injected crash (exit 1), got {crashed['exit_codes']}")
    out["memory"] = restore("memory", config_for("memory", directory, 1, 1, model), ranks,
                            memory_tier.resume_name(1, 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the tiny model: a smoke test, no measurement")
    args = parser.parse_args()
    model = {"model": "tiny"} if args.quick else MODEL
    out: dict[str, Any] = {"ranks": args.ranks, "steps": args.steps, "every": args.every, "model": model,
                           "cpu_cores": os.cpu_count(), "modes": {}}
    root = Path(tempfile.mkdtemp(prefix="tsup-tiers-"))
    try:
        for mode in MODES:
            directory = root / mode
            directory.mkdir()
            say(f"{mode}: training {args.steps} steps on {args.ranks} ranks ...")
            started = time.monotonic()
            result = run_mode(mode, config_for(mode, directory, args.steps, args.every, model), args.ranks)
            if result["exit_codes"] != [0] * args.ranks:
                tail = "\n".join(line for _, line in result["lines"][-20:])
                raise SystemExit(f"{mode}: the trainer exited {result['exit_codes']}:\n{tail}")
            out["modes"][mode] = analyse(mode, result["lines"], args.every, args.steps)
            out["modes"][mode]["run_s"] = round(time.monotonic() - started, 1)
            if mode != "sync":  # its checkpoints are restored from below
                shutil.rmtree(directory, ignore_errors=True)
            shutil.rmtree(_memory_root(), ignore_errors=True)
            say(f"{mode}: {out['modes'][mode]}")
        none_wall = out["modes"]["none"]["wall_s"]
        for mode in MODES[1:]:
            m = out["modes"][mode]
            m["wall_excess_s"] = round((m["wall_s"] - none_wall) / len(m["saves"]), 3) if m["saves"] else None
        out["restore"] = restores(root, model, args.ranks, args.every)
        out["memcpy_gb_s"] = round(memcpy_gb_s(out["restore"]["memory"]["bytes_per_rank"]), 2)
        for tier in out["restore"].values():
            tier["ratio_to_memcpy"] = round(tier["gb_s"] / out["memcpy_gb_s"], 3)
        say(f"restore: {out['restore']}, memcpy {out['memcpy_gb_s']} GB/s")
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(_memory_root(), ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
