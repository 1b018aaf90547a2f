"""trainer.config: validation names the bad key, and --check-config stays torch-free."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainer.config import (
    TrainConfig,
    config_digest,
    config_from_dict,
    config_to_dict,
    load_config,
)
from wire.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def errors_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return info.value.errors


def test_empty_config_is_the_tiny_default() -> None:
    config = config_from_dict({})
    assert config.model == "tiny"
    assert config.shape.hidden_size == 64 and config.shape.n_layers == 2
    assert config.data.kind == "synthetic"
    assert config.optimizer.betas == (0.9, 0.95)


def test_bad_value_error_names_the_key_path() -> None:
    assert errors_of({"optimizer": {"lr": -1}}) == [
        "optimizer.lr: expected a positive number, got -1"]


def test_unknown_keys_are_named_with_a_suggestion() -> None:
    assert errors_of({"optimizr": {}}) == ["unknown key 'optimizr' (did you mean 'optimizer'?)"]
    assert errors_of({"checkpoint": {"evry_steps": 5}}) == [
        "checkpoint: unknown key 'evry_steps' (did you mean 'every_steps'?)"]


def test_every_problem_is_reported_at_once() -> None:
    errors = errors_of({"steps": 0, "optimizer": {"lr": 0, "betas": [0.9, 1.5]},
                        "data": {"kind": "tokens"}, "dtype": "float16"})
    assert errors == [
        "optimizer.lr: expected a positive number, got 0",
        "optimizer.betas[1]: expected a number < 1.0, got 1.5",
        "data.path: required when kind = 'tokens'",
        "steps: expected a positive integer, got 0",
        "dtype: expected one of 'auto', 'float32', 'bfloat16', got 'float16'",
    ]


def test_wrong_types_are_rejected() -> None:
    assert errors_of({"seed": "7"}) == ["seed: expected an integer, got '7'"]
    assert errors_of({"steps": True}) == ["steps: expected an integer, got True"]
    assert errors_of({"optimizer": 3}) == ["optimizer: expected a table, got 3"]


def test_named_shapes_and_overrides() -> None:
    config = config_from_dict({"model": "llama3.1-8b", "seq_len": 2048,
                               "model_overrides": {"n_layers": 2, "rope_theta": 10000}})
    assert config.shape.n_layers == 2
    assert config.shape.n_kv_heads == 8
    assert config.shape.rope_theta == 10000.0
    assert errors_of({"model": "llama9"})[0].startswith("model: unknown shape 'llama9'")
    assert errors_of({"model_overrides": {"hiden_size": 8}}) == [
        "model_overrides: unknown key 'hiden_size' (did you mean 'hidden_size'?)"]
    assert errors_of({"model_overrides": {"n_kv_heads": 3}}) == [
        "model_overrides.n_kv_heads: n_heads 4 is not divisible by 3"]


def test_seq_len_must_fit_the_context() -> None:
    assert errors_of({"seq_len": 65}) == ["seq_len: 65 exceeds the model's context 64"]


def test_batch_layout_splits_over_ranks_and_micro_batches() -> None:
    config = config_from_dict({"global_batch_size": 16, "micro_batch_size": 2})
    layout = config.batch_layout(4)
    assert (layout.per_rank, layout.micro, layout.accumulation) == (4, 2, 2)
    with pytest.raises(ConfigError, match="global_batch_size: 16 is not divisible by the "
                                          "world size 3"):
        config.batch_layout(3)
    with pytest.raises(ConfigError, match="micro_batch_size: 2 does not divide"):
        config.batch_layout(16)


def test_round_trip_and_digest() -> None:
    config = config_from_dict({"steps": 7, "optimizer": {"lr": 1e-3}})
    assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config
    moved = config_from_dict({"steps": 7, "optimizer": {"lr": 1e-3},
                              "checkpoint": {"dir": "/elsewhere"}, "output_dir": "/x"})
    assert config_digest(moved) == config_digest(config)  # operational fields don't count
    assert config_digest(config_from_dict({"steps": 7})) != config_digest(config)


def test_toml_and_json_files(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('model = "tiny"\n[optimizer]\nlr = 0.001\n')
    assert load_config(toml).optimizer.lr == 0.001
    js = tmp_path / "c.json"
    js.write_text('{"optimizer": {"lr": 0.002}}')
    assert load_config(js).optimizer.lr == 0.002
    broken = tmp_path / "b.toml"
    broken.write_text("steps = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError, match="steps: expected a positive integer"):
        TrainConfig(steps=-3)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_check_config_cli_exit_codes(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text("global_batch_size = 8\n")
    result = run_cli("--check-config", str(good))
    assert (result.returncode, result.stdout) == (0, "ok\n")
    result = run_cli("--check-config", str(good), "--world-size", "3")
    assert result.returncode == 2
    assert result.stdout.startswith("global_batch_size: 8 is not divisible")
    bad = tmp_path / "bad.toml"
    bad.write_text("optimizr = 1\nsteps = -1\n")
    result = run_cli("--check-config", str(bad))
    assert result.returncode == 2
    assert result.stdout.splitlines() == [
        "unknown key 'optimizr' (did you mean 'optimizer'?)",
        "steps: expected a positive integer, got -1"]


def test_check_config_does_not_import_torch(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("steps = 3\n")
    probe = (
        "import sys\n"
        "from trainer.__main__ import main\n"
        f"rc = main(['--check-config', {str(config)!r}])\n"
        "assert rc == 0\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'paho'))\n"
        "print('heavy:', heavy)\n"
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stdout
    assert elapsed < 5  # ~0.1 s on a laptop; generous for loaded CI machines


def test_print_config_cli(tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text('{"model": "llama2-7b", "seq_len": 4096}')
    result = run_cli("--print-config", str(config))
    assert result.returncode == 0, result.stdout
    resolved = json.loads(result.stdout)
    assert resolved["shape"]["hidden_size"] == 4096
    assert resolved["parameters"] == 6_738_415_616
    assert resolved["config"]["seq_len"] == 4096


def test_validation_needs_held_out_data() -> None:
    with pytest.raises(ConfigError, match="validation_every_steps: needs held-out data"):
        config_from_dict({"validation_every_steps": 10})


def test_a_tiny_config_gets_the_tiny_optimizer_defaults_and_a_named_shape_the_recipe() -> None:
    tiny = config_from_dict({"optimizer": {"lr": 1e-3}})
    assert (tiny.optimizer.lr, tiny.optimizer.min_lr, tiny.optimizer.warmup_steps) == (1e-3, 1e-4, 10)
    assert config_from_dict({}).optimizer.min_lr == pytest.approx(3e-4)
    llama = config_from_dict({"model": "llama3.2-1b", "seq_len": 64})
    o = llama.optimizer
    assert (o.lr, o.min_lr, o.warmup_steps, o.betas, o.eps, o.weight_decay, o.grad_clip) == (
        3e-4, 3e-5, 2000, (0.9, 0.95), 1e-5, 0.1, 1.0)
    assert llama.dtype == "auto"
