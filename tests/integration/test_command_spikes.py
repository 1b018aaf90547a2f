"""A persistent loss spike in a trainer the supervisor did not write.

The trainer is a plain torchrun-style script (the FSDP test case's log line and
checkpoint layout) whose data has a bad stretch: the batches of data steps 30 to 49 have
four times the noise, so the loss it prints jumps and stays up. Its lines carry no
sample position, so the supervisor cannot name samples to skip; it can tell a trainer
whose command names ``{skip_to_step}`` which step of its data to read next.

- With the placeholder, the run rolls back to the checkpoint before the spike and the
  next attempt reads on from past the window the supervisor recorded: it ends with the
  same weights as a fault-free run told, from its start, to leave out the same steps.
- Without it, the rollback replays the same batches into the same spike: the second
  time the spike is reported and trained through, and the run ends without a crash loop.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests.e2e.conftest import command_spec, db_rows, summary_of, tsup

SCRIPT = textwrap.dedent('''
    import argparse, json, os, time
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    BAD = range(30, 50)  # data steps whose batches are noisier: a spike while they last

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data_step", type=int, default=None, help="the data step the next step reads")
    ap.add_argument("--leave_out", default=None, help="A:B: data steps [A, B) never read (the reference run)")
    ap.add_argument("--resume_from_checkpoint", default=None)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    start = 0
    if args.resume_from_checkpoint:
        state = {"model": model.state_dict(), "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.resume_from_checkpoint)
        model.load_state_dict(state["model"])
        start = int(state["step"])
    first = start + 1 if args.data_step is None else args.data_step
    a, b = map(int, args.leave_out.split(":")) if args.leave_out else (0, 0)
    for step in range(start + 1, args.steps + 1):
        d = first + step - start - 1
        if a <= d:
            d += b - a
        g = torch.Generator().manual_seed(d)
        x = torch.randn(64, 8, generator=g)
        noise = torch.randn(64, 1, generator=g) * (4.0 if d in BAD else 1.0)
        loss = ((model(x) - x.sum(1, keepdim=True) - noise) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            dcp.save({"model": model.state_dict(), "step": torch.tensor(step)},
                     checkpoint_id=os.path.join(args.save_dir, f"llama_v3-{step}steps"))
        print(f"Batch {step - 1} Loss: {loss.item():.5f}, Speed: 80.00 samples/sec, lr: 0.020000", flush=True)
        time.sleep(0.05)
    with open(args.out, "w") as f:
        json.dump({"weight": model.weight.flatten().tolist(), "bias": model.bias.tolist()}, f)
    dist.destroy_process_group()
''')

STEPS = 90
# Acted on after 5 spiking steps; 30 steps of data stepped over from the spike's first.
POLICY = {"spike_persist_steps": 5, "spike_skip_steps": 30, "spike_window": 10, "failures_without_progress": 3}


def supervised(tmp_path: Path, name: str, *extra: str) -> tuple[dict[str, Any], Path]:
    script = tmp_path / "user_train.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script), "--steps", str(STEPS), "--save_dir", "{checkpoint_dir}",
            "--out", "{run_dir}/final.json", *extra]
    spec = command_spec(tmp_path / f"{name}.toml", name, argv, resources={"nodes": 1, "ranks_per_node": 1},
                        policy=POLICY, checkpoint_layout="dcp", steps=STEPS,
                        resume=["--resume_from_checkpoint={checkpoint}"])
    state = tmp_path / f"state-{name}"
    proc = tsup("run", spec, "--state-dir", state, "--json", timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return summary_of(proc), state


def weights(state: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((state / "runs" / "run-1" / "final.json").read_text())
    return data


def test_a_spike_skipped_through_skip_to_step_ends_as_a_run_that_never_read_that_data(tmp_path: Path) -> None:
    s, state = supervised(tmp_path, "skips", "--data_step", "{skip_to_step}")
    assert s["state"] == "SUCCEEDED" and s["attempts"] == 2, s
    [fault] = s["faults"]
    assert fault["kind"] == "spike" and fault["step"] == 30, s
    [(start, end)] = db_rows(state, "SELECT start, \"end\" FROM data_skips")
    assert start == 21 and end == 60, "the spike's 30 steps, widened back to the step after the checkpoint"
    said = [m for (m,) in db_rows(state, "SELECT message FROM events WHERE kind = 'data.skip'")]
    assert any("reads the data of step 60 next" in m for m in said), said
    assert not db_rows(state, "SELECT 1 FROM events WHERE kind = 'spike.persists'")

    reference, ref_state = supervised(tmp_path, "reference", "--leave_out", f"{start}:{end}")
    assert reference["state"] == "SUCCEEDED" and reference["attempts"] == 1 and not reference["faults"], reference
    assert weights(state) == weights(ref_state)


def test_a_spike_a_trainer_cannot_skip_is_rolled_back_once_and_then_trained_through(tmp_path: Path) -> None:
    s, state = supervised(tmp_path, "cannot")
    assert s["state"] == "SUCCEEDED" and s["attempts"] == 2, s
    [fault] = s["faults"]
    assert fault["kind"] == "spike" and "the trainer cannot skip data" in fault["summary"], s
    assert not db_rows(state, "SELECT 1 FROM data_skips")
    [(message,)] = db_rows(state, "SELECT message FROM events WHERE kind = 'spike.persists'")
    # The replay judges its first steps against the 10 before them: from step 31 at the earliest.
    assert re.match(r"loss spike from step 3[01]\b", message) and "not rolling back again" in message, message
