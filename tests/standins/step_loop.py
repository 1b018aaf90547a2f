"""A trainer without torch, in the shape of the seeds' jobs: their checkpoint layouts,
their resume arguments and their progress lines, nothing of the supervisor's.

    --form nxd    step_N/ with a `done` marker; --loading_step N or latest_if_exists
                  (neuronx-distributed's run_llama_nxd.py); "LOG <date> - (0, N) step_loss : ..."
    --form nemo   <dir>/hf_llama/<version>/checkpoints/hf_llama--step=N-consumed_samples=M.0.ckpt/
                  with `done`, the version $NEMO_EXPM_VERSION (NxD Training's train_setup.sh:
                  the Slurm job id; a new one per start without it), always resuming from
                  its own version's newest *.ckpt by modification time, complete or not
                  (NxD Training's check_resume); Lightning's progress bar, redrawn with \\r,
                  global_step counted from 0
    --form fsdp   llama_v3-Nsteps/ with .metadata; --resume_from_checkpoint DIR searched for
                  the newest (the FSDP test case); "Batch %d Loss: ..." counted from 0

Its model is one number, updated from each step's data; ``--out`` gets it and the step
it started from. ``--compile_s N`` first compiles for N seconds, printing the Neuron
compiler's lines; ``--restore_s N`` makes a checkpoint load take N seconds. Faults, once per run (a marker in ``--fault_dir``): ``--crash_at N``
exits 1 after step N; ``--nan_at N`` prints a NaN loss for step N, after that step's
checkpoint is saved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

NEMO_NAME = "hf_llama"


def step_value(value: int, step: int) -> int:
    return (value * 31 + step) % 1_000_003


def save(form: str, root: Path, version: str, step: int, value: int) -> None:
    if form == "nxd":
        d = root / f"step_{step}"
    elif form == "nemo":
        d = root / NEMO_NAME / version / "checkpoints" / f"{NEMO_NAME}--step={step}-consumed_samples={step * 16}.0.ckpt"
    else:
        d = root / f"llama_v3-{step}steps"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"step": step, "value": value}))
    (d / (".metadata" if form == "fsdp" else "done")).write_text("complete\n")


def load(path: Path) -> tuple[int, int]:
    state = json.loads((path / "state.json").read_text())
    return int(state["step"]), int(state["value"])


def newest(form: str, root: Path, version: str = "") -> Path | None:
    """The form's own search: its newest complete checkpoint under ``root``; for nemo, the
    newest *.ckpt of its own version by modification time, complete or not."""
    if form == "nemo":
        found_any = sorted((root / NEMO_NAME / version / "checkpoints").rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        return found_any[-1] if found_any else None
    if form == "nxd":
        found = [(int(p.name[5:]), p) for p in root.glob("step_*") if (p / "done").exists()]
    else:
        found = [(int(p.name.split("-")[-1][:-5]), p) for p in root.glob("llama_v3-*steps")
                 if (p / ".metadata").exists()]
    return max(found)[1] if found else None


def progress_line(form: str, step: int, loss: float) -> str:
    if form == "nxd":
        return (f"LOG {time.asctime()} - (0, {step}) step_loss : {loss:.4f} learning_rate : 1.00e-04 "
                f"throughput : 12.50 seq/s \n")
    if form == "nemo":  # tqdm's bar as Lightning draws it, a batch of 100 an epoch
        pct = min(step, 100)
        return (f"Epoch 0: {pct:3d}%|{'#' * (pct // 10):<10}| {step}/100 [00:01<00:10, 9.5it/s, v_num=1, "
                f"reduced_train_loss={loss:.3f}, lr=1e-4, global_step={step - 1}.000, consumed_samples={step * 16}.0, "
                f"gradient_norm=1.250]\r")
    return (f"2026-11-25 10:00:00,000 [INFO] __main__: Batch {step - 1} Loss: {loss:.5f}, Speed: 80.00 "
            f"samples/sec, lr: 0.000100\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--form", choices=("nxd", "nemo", "fsdp"), required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--checkpoint_dir", required=True)
    ap.add_argument("--loading_step", default=None)  # nxd: N or latest_if_exists
    ap.add_argument("--resume_from_checkpoint", default=None)  # fsdp: a directory to search
    ap.add_argument("--out", required=True)
    ap.add_argument("--fault_dir", required=True)
    ap.add_argument("--crash_at", type=int, default=0)
    ap.add_argument("--nan_at", type=int, default=0)
    ap.add_argument("--step_sleep", type=float, default=0.05)
    ap.add_argument("--compile_s", type=float, default=0)
    ap.add_argument("--restore_s", type=float, default=0)
    args = ap.parse_args()
    root = Path(args.checkpoint_dir)
    version = os.environ.get("NEMO_EXPM_VERSION") or time.strftime("%Y-%m-%d_%H-%M-%S") + f"_{time.monotonic_ns()}"
    fired = {name for name in ("crash", "nan") if (Path(args.fault_dir) / f"fired-{name}").exists()}

    path: Path | None = None
    if args.form == "nxd" and args.loading_step == "latest_if_exists":
        path = newest("nxd", root)
    elif args.form == "nxd" and args.loading_step is not None:
        path = root / f"step_{int(args.loading_step)}"
    elif args.form == "nemo":
        path = newest("nemo", root, version)
    elif args.resume_from_checkpoint is not None:
        path = newest("fsdp", Path(args.resume_from_checkpoint))
    for k in range(int(args.compile_s)):
        print(f"2026-11-25 10:00:{k:02d}.000558:  14283  INFO ||NEURON_CC_WRAPPER||: Call compiler with cmd: "
              f"neuronx-cc compile --target=trn1 --framework=XLA /tmp/neuroncc_compile_workdir/{k}/model.hlo.pb",
              flush=True)
        time.sleep(1.0)
    if path is not None:
        time.sleep(args.restore_s)
    start, value = load(path) if path is not None else (0, 0)
    print(f"resumed from {path} at step {start}" if path else "No Checkpoints Found", flush=True)

    for step in range(start + 1, args.steps + 1):
        value = step_value(value, step)
        time.sleep(args.step_sleep)
        if step % args.every == 0:
            save(args.form, root, version, step, value)
        nan = step == args.nan_at and "nan" not in fired
        sys.stdout.write(progress_line(args.form, step, float("nan") if nan else 1.0 + 10.0 / step))
        sys.stdout.flush()
        if nan:
            (Path(args.fault_dir) / "fired-nan").touch()
        if step == args.crash_at and "crash" not in fired:
            (Path(args.fault_dir) / "fired-crash").touch()
            print(f"\ncrashing after step {step}", flush=True)
            return 1
    Path(args.out).write_text(json.dumps({"value": value, "started_at": start}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
