"""What an attempt of the reference trainer reports: ``result.json`` at its end (the
supervisor's proof of success, wire/files.py) and each step's numbers (the step log and
telemetry)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainResult:
    """What result.json holds (rank 0's copy has the digest; other ranks get None)."""

    final_step: int
    model_digest: str | None
    final_loss: float | None  # the loss of the final step, even if an earlier attempt ran it
    steps_run_this_attempt: int
    resumed_from: str | None  # the checkpoint directory (or memory:A:N) this attempt started from
    consumed_samples: int
    world_size: int
    model: str
    parameters: int
    config_digest: str
    run_id: str
    attempt: int
    last_checkpoint: str | None
    wall_time_s: float  # this attempt, from model build to result.json


@dataclass(frozen=True, slots=True)
class StepStats:
    loss: float  # mean over all ranks and micro-batches
    grad_norm: float  # global L2 norm before clipping
    lr: float
    step_time_s: float  # data + forward + backward + optimizer + loss all-reduce
    tokens_per_s: float  # over all ranks
    first_sample: int = 0  # the data stream position this step's batch began at
    busy_s: float = math.nan  # this rank's own compute time (see _train_step)
    param_norm: float = math.nan  # global L2 norm of the parameters after the step
    mfu: float = math.nan  # model FLOPs utilization over all ranks (trainer/flops.py)
    val_loss: float = math.nan  # set on the steps that ran validation
