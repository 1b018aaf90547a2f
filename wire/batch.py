"""How a global batch splits over data-parallel replicas and micro-batches: the trainer
lays its steps out by it, and the supervisor checks a run's spec by it before anything
is launched.
"""

from __future__ import annotations

from dataclasses import dataclass

from wire.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """How one optimizer step's global batch splits over ranks and micro-batches."""

    per_rank: int  # samples each rank processes per optimizer step
    micro: int  # samples per forward/backward pass
    accumulation: int  # forward/backward passes per optimizer step


def split_batch(global_batch: int, micro_batch: int | None, replicas: int, what: str) -> BatchLayout:
    """Split a global batch over ``replicas`` data-parallel replicas (``what`` names their
    count in errors), each in micro-batches of ``micro_batch`` samples (None: one pass);
    ConfigError if it cannot."""
    if global_batch % replicas:
        raise ConfigError(f"global_batch_size: {global_batch} is not divisible by {what}")
    per_rank = global_batch // replicas
    micro = per_rank if micro_batch is None else micro_batch
    if per_rank % micro:
        raise ConfigError(f"micro_batch_size: {micro} does not divide the per-rank batch "
                          f"{per_rank} (global_batch_size / {what})")
    return BatchLayout(per_rank=per_rank, micro=micro, accumulation=per_rank // micro)
