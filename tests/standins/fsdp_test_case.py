"""A stand-in for awsome-distributed-training's FSDP test case (3.test_cases/pytorch/FSDP/
src/train.py), in its shape and nothing of the supervisor's: one torchrun per node,
FSDP2 with AdamW and a warm-up scheduler, DCP checkpoints named
``{model_type}-{total_steps}steps`` every ``--checkpoint_freq`` steps, a
``--resume_from_checkpoint`` that is a directory to search (the newest checkpoint with a
``.metadata`` wins; none: "No Checkpoints Found" and step 0), and rank 0 logging
``Batch %d Loss: %.5f, Speed: %.2f samples/sec, lr: %.6f`` (the 0-based batch index)
through ``logging`` in the test case's format.

Each step's data is drawn from the step number, so a resumed run sees the batches a
run that never failed would. Faults a user's job may meet, once per run (a marker file
in ``--fault_dir``): ``--nan_at N`` turns the loss of step N into NaN, ``--spike_at N``
makes the data of steps N to N+7 eight times worse. ``--out`` gets the final weights
(rank 0, a full state dict).

A finished process leaves through ``os._exit`` once its process group is destroyed and its
output flushed, as the reference trainer does: torch's own teardown of gloo's threads at
interpreter exit now and then aborts a rank that is done ("terminate called without an
active exception", SIGABRT, about one run in a dozen of the train.sh scenarios), and what
these scenarios test is the supervisor, not that teardown.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

logging.basicConfig(format="%(asctime)s [%(levelname)s] %(name)s: %(message)s", level=logging.INFO,
                    stream=sys.stdout)
logger = logging.getLogger(__name__)
BATCH = 8


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max_steps", type=int, default=60)
    ap.add_argument("--checkpoint_freq", type=int, default=10)
    ap.add_argument("--checkpoint_dir", default="./checkpoints")
    ap.add_argument("--resume_from_checkpoint", default=None)
    ap.add_argument("--model_type", default="llama_v3")
    ap.add_argument("--step_sleep", type=float, default=0.1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--fault_dir", default=None)
    ap.add_argument("--nan_at", type=int, default=0)
    ap.add_argument("--spike_at", type=int, default=0)
    return ap.parse_args()


class Once:
    """Faults that fire in one attempt of a run only: every rank reads at start whether an
    earlier attempt fired them (rank 0 leaves a marker), so that all ranks agree."""

    def __init__(self, fault_dir: str | None) -> None:
        self.dir = Path(fault_dir or ".")
        self.fired = {name for name in ("nan", "spike") if (self.dir / f"fired-{name}").exists()}

    def __call__(self, name: str) -> bool:
        if name in self.fired:
            return False
        if dist.get_rank() == 0:
            (self.dir / f"fired-{name}").touch()
        return True


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer,
             sched: torch.optim.lr_scheduler.LRScheduler, step: int) -> dict[str, object]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict(), "total_steps": step}


def load_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer,
                    sched: torch.optim.lr_scheduler.LRScheduler, directory: str, model_type: str) -> int:
    """The test case's search: its newest checkpoint with a .metadata file."""
    found = sorted(Path(directory).glob(f"{model_type}-*steps"),
                   key=lambda p: int(re.findall(r"(\d+)steps", p.name)[0]))
    for ck in reversed(found):
        if not (ck / ".metadata").exists():
            logger.warning("%s not found. Skipping this incomplete checkpoint", ck / ".metadata")
            continue
        logger.info("Loading checkpoint from %s ...", ck)
        state = state_of(model, opt, sched, 0)
        dcp.load(state, checkpoint_id=str(ck))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])  # type: ignore[arg-type]
        logger.info("Checkpoint loaded from %s.", ck)
        return int(state["total_steps"])  # type: ignore[call-overload]
    logger.info("No Checkpoints Found")
    return 0


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    once = Once(args.fault_dir)
    start = 0
    if args.resume_from_checkpoint:
        start = load_checkpoint(model, opt, sched, args.resume_from_checkpoint, args.model_type)
    for total_steps in range(start + 1, args.max_steps + 1):
        batch_idx = total_steps - 1
        began = time.perf_counter()
        g = torch.Generator().manual_seed(1000 * total_steps + rank)
        x = torch.randn(BATCH, 16, generator=g)
        y = x.sum(1, keepdim=True)
        if args.spike_at and args.spike_at <= total_steps < args.spike_at + 8 and once("spike"):
            y = y * 8.0
        loss = ((model(x) - y) ** 2).mean()
        if total_steps == args.nan_at and once("nan"):
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg)
        if rank == 0:
            speed = BATCH * world / (time.perf_counter() - began)
            logger.info("Batch %d Loss: %.5f, Speed: %.2f samples/sec, lr: %.6f", batch_idx,
                        loss_avg.item() / world, speed, sched.get_last_lr()[0])
        if total_steps % args.checkpoint_freq == 0:
            sub_dir = os.path.join(args.checkpoint_dir, f"{args.model_type}-{total_steps}steps")
            dcp.save(state_of(model, opt, sched, total_steps), checkpoint_id=sub_dir)
        time.sleep(args.step_sleep)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and args.out:
        torch.save(full, args.out)
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
