"""Training options that must not change what is learnt: activation checkpointing
(recomputing the same operations) is bit-exact; torch.compile of each block computes the
same losses up to rounding. One process, the tiny model, real training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def train(tmp_path: Path, name: str, options: str) -> dict[str, Any]:
    directory = tmp_path / name
    directory.mkdir()
    config = directory / "config.toml"
    config.write_text(f"steps = 12\nglobal_batch_size = 8\nmicro_batch_size = 4\n{options}\n"
                      f'output_dir = "{directory / "out"}"\n[checkpoint]\ndir = "{directory / "ck"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TSUP_", "RANK", "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.run([sys.executable, "-m", "trainer", "--config", str(config)], env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result: dict[str, Any] = json.loads((directory / "out" / "result.json").read_text())
    return result


def test_activation_checkpointing_full_and_selective_are_bit_exact(tmp_path: Path) -> None:
    plain = train(tmp_path, "none", "")
    for mode in ("full", "selective"):
        recomputed = train(tmp_path, mode, f'activation_checkpointing = "{mode}"')
        assert recomputed["model_digest"] == plain["model_digest"], mode
        assert recomputed["config_digest"] == plain["config_digest"]  # not a trajectory setting


def test_compiled_blocks_learn_the_same_up_to_rounding(tmp_path: Path) -> None:
    plain = train(tmp_path, "eager", "")
    compiled = train(tmp_path, "compiled", "compile = true")
    assert compiled["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-4)
