"""A new attempt's ranks resume: from the persistent checkpoint ``--resume`` names
(``auto``: the newest complete one), resharded when the world size changed, or from a
save of the memory tier (``memory:ATTEMPT:STEP``: trainer/memory_tier.py). The restore
is said in the log and on telemetry: its pace sets the supervisor's allowance for the next.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from trainer import checkpoint, distributed, memory_tier
from trainer import checkpoint_layout as layout
from trainer.config import TrainConfig, config_digest
from trainer.telemetry import Telemetry
from wire import TIER_MEMORY, TIER_PERSISTENT, Phase
from wire.errors import UsageError


@dataclass(frozen=True, slots=True)
class Resumed:
    where: str  # the checkpoint's path, or memory_tier.resume_name's
    step: int
    consumed: int  # samples consumed: the data stream's position
    last_loss: float | None


def restore(resume: str, config: TrainConfig, ctx: distributed.DistContext, telemetry: Telemetry,
            model: nn.Module, optimizer: torch.optim.Optimizer, *, memory: memory_tier.MemoryTier | None,
            io_threads: int, say: Callable[[str], None]) -> Resumed | None:
    """Load the checkpoint ``resume`` names into ``model`` and ``optimizer`` (None: there is
    none, a fresh start). UsageError for a name that is no checkpoint."""
    in_memory = memory_tier.parse_resume(resume)
    if in_memory is not None:
        assert memory is not None
        return _from_memory(*in_memory, config, ctx, telemetry, model, optimizer, memory, say)
    root = Path(config.checkpoint.dir).absolute()
    choice: tuple[str | None, str | None] = (None, None)  # (path, error message)
    if ctx.is_main:
        try:
            path = layout.resolve_resume(resume, root)
            choice = (str(path) if path else None, None)
        except UsageError as e:
            choice = (None, str(e))
    path_text, error = distributed.broadcast_from_main(choice)
    if error is not None:
        raise UsageError(error)
    if path_text is None:
        return None
    path = Path(path_text).absolute()
    meta = layout.TrainerMeta.read(path)
    size = layout.bytes_per_rank(path, meta.world_size)
    telemetry.set_phase(Phase.RESTORE, 0, size=size)
    meta.check_compatible(world_size=ctx.world_size, model=config.model,
                          model_shape=asdict(config.shape), reshard=True)
    if meta.world_size != ctx.world_size:
        batch = config.batch_layout(ctx.world_size)
        say(f"resharding {path.name} from {meta.world_size} to {ctx.world_size} ranks: "
            f"the global batch of {config.global_batch_size} is now {ctx.world_size} x "
            f"{batch.accumulation} x {batch.micro}")
    if meta.config_digest != config_digest(config) and ctx.is_main:
        print(f"trainer: warning: {path} was written with different training settings "
              f"(config digest {meta.config_digest}, now {config_digest(config)})",
              file=sys.stderr, flush=True)
    started = time.monotonic()
    times = checkpoint.load(path, model, optimizer, io_threads=io_threads)
    resumed = Resumed(where=str(path), step=meta.step, consumed=meta.consumed_samples,
                      last_loss=meta.last_loss)
    _said(resumed, TIER_PERSISTENT, time.monotonic() - started, times.size or size, times, ctx, telemetry,
          say)
    return resumed


def _from_memory(attempt: int, step: int, config: TrainConfig, ctx: distributed.DistContext,
                 telemetry: Telemetry, model: nn.Module, optimizer: torch.optim.Optimizer,
                 memory: memory_tier.MemoryTier, say: Callable[[str], None]) -> Resumed:
    size = memory.bytes_held(attempt, step, ctx.rank)
    telemetry.set_phase(Phase.RESTORE, 0, size=size)
    started = time.monotonic()
    meta = layout.TrainerMeta(**memory.restore(attempt, step, model, optimizer))
    meta.check_compatible(world_size=ctx.world_size, model=config.model,
                          model_shape=asdict(config.shape), reshard=False)
    resumed = Resumed(where=memory_tier.resume_name(attempt, step), step=meta.step,
                      consumed=meta.consumed_samples, last_loss=meta.last_loss)
    times = memory.restored_times
    peers = memory.restored_from_peers
    sent = f", {peers} rank(s)' state sent over from the node holding its replica" if peers else ""
    _said(resumed, TIER_MEMORY, time.monotonic() - started, times.size or size, times, ctx, telemetry, say,
          f"; attempt {attempt}'s save in node memory{sent}")
    return resumed


def _said(resumed: Resumed, tier: str, seconds: float, size: int, times: checkpoint.RestoreTimes,
          ctx: distributed.DistContext, telemetry: Telemetry, say: Callable[[str], None],
          note: str = "") -> None:
    """Resumed: said in the log and on telemetry (the restore's pace sets the supervisor's
    allowance for the next one)."""
    telemetry.restored(resumed.step)
    if ctx.is_main:
        telemetry.checkpoint_restored(step=resumed.step, path=resumed.where, tier=tier, duration_s=seconds,
                                      size=size)
    pace = f"{size} bytes, {size / seconds / 1e9:.3f} GB/s a rank; " if size and seconds > 0 else ""
    say(f"resumed from {resumed.where} at step {resumed.step} in {seconds:.3f} s ({pace}{times}{note})")
