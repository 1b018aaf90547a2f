"""``trainer.train.train`` called in-process: one rank, no launcher, no broker.

Covers what the 2-rank scenario in test_trainer_resume.py does not: gradient
accumulation, bfloat16, the token-file data path, and resuming a finished run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainer.config import TrainConfig, config_from_dict
from trainer.result import TrainResult
from trainer.train import train


def make_config(tmp_path: Path, **overrides: Any) -> TrainConfig:
    data: dict[str, Any] = {
        "steps": 6, "global_batch_size": 8, "seq_len": 32,
        "output_dir": str(tmp_path / "out"),
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 3},
        "optimizer": {"warmup_steps": 2},
    }
    data.update(overrides)
    return config_from_dict(data)


def run(config: TrainConfig, resume: str = "none") -> TrainResult:
    return train(config, resume=resume, environ={})  # no launcher and no telemetry


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    whole = run(make_config(tmp_path / "a"))
    accumulated = run(make_config(tmp_path / "b", micro_batch_size=2))
    # Same samples and the same mean gradient, summed in another order: equal up to
    # float32 rounding, not bit for bit.
    assert whole.final_loss is not None and accumulated.final_loss is not None
    assert accumulated.final_loss == pytest.approx(whole.final_loss, rel=1e-4)
    assert whole.model_digest != accumulated.model_digest


def test_bfloat16_trains(tmp_path: Path) -> None:
    result = run(make_config(tmp_path, dtype="bfloat16", steps=4))
    assert result.final_step == 4
    assert result.final_loss is not None and result.final_loss < 5.6


def test_token_file_data(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 256, size=4096, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    result = run(make_config(tmp_path, data={"kind": "tokens", "path": str(path)}, steps=2))
    assert result.final_step == 2


def test_resuming_a_finished_run_runs_no_steps(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    first = run(config)
    again = run(config, resume="auto")
    assert again.steps_run_this_attempt == 0
    assert again.resumed_from == str(tmp_path / "ckpt" / "step_00000006")
    assert (again.model_digest, again.final_loss) == (first.model_digest, first.final_loss)
    written = json.loads((tmp_path / "out" / "result.json").read_text())
    assert written["model_digest"] == first.model_digest
    assert written["steps_run_this_attempt"] == 0
