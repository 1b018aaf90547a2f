"""AdamW and its learning-rate schedule.

The schedule is a pure function of the step number, and the train loop writes the lr
into the optimizer before every step, so resuming needs no scheduler state: the step
counter in the checkpoint is the schedule position.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import OptimizerConfig


def lr_at(step: int, *, config: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (1-based).

    Linear warm-up from lr / warmup_steps at step 1 to lr at step warmup_steps, then a
    cosine from lr down to min_lr, reached at step total_steps.
    """
    if step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr + (config.lr - config.min_lr) * cosine


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only.

    Decaying the RMSNorm gains towards zero would fight the normalization, so 1-D
    parameters (all of them norm weights here) get no decay, as in the Llama recipes.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=True: one fused kernel launch per group instead of one per parameter; it
    # also pins the implementation so a resumed run computes exactly what the first did.
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             foreach=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
