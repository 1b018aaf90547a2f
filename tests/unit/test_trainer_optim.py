"""trainer.optim: warm-up and cosine schedule, weight-decay groups."""

from __future__ import annotations

import pytest
import torch

from trainer.config import OptimizerConfig
from trainer.model import Transformer
from trainer.optim import build_optimizer, lr_at
from trainer.shapes import SHAPES

CONFIG = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)


def test_linear_warmup_then_cosine_to_min_lr() -> None:
    assert lr_at(1, config=CONFIG, total_steps=100) == pytest.approx(1e-4)
    assert lr_at(5, config=CONFIG, total_steps=100) == pytest.approx(5e-4)
    assert lr_at(10, config=CONFIG, total_steps=100) == pytest.approx(1e-3)
    assert lr_at(55, config=CONFIG, total_steps=100) == pytest.approx(5.5e-4)  # half-way
    assert lr_at(100, config=CONFIG, total_steps=100) == pytest.approx(1e-4)
    assert lr_at(150, config=CONFIG, total_steps=100) == pytest.approx(1e-4)  # stays at min
    values = [lr_at(s, config=CONFIG, total_steps=100) for s in range(10, 101)]
    assert values == sorted(values, reverse=True)


def test_no_warmup() -> None:
    config = OptimizerConfig(lr=1e-3, min_lr=0.0, warmup_steps=0)
    assert lr_at(1, config=config, total_steps=1) == pytest.approx(0.0)
    assert lr_at(1, config=config, total_steps=3) == pytest.approx(0.75e-3)


def test_norm_weights_get_no_weight_decay() -> None:
    model = Transformer(SHAPES["tiny"], rope_len=8)
    optimizer = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decayed["params"])
    assert all(p.ndim == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert isinstance(optimizer, torch.optim.AdamW)
