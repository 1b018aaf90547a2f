"""The Neuron backend's pure parts: the [neuron] table, the parallel layout and batch split,
NxD checkpoint names (as the supervisor's scanner reads them), the trn1.32xlarge launch,
and the clear failure when the Neuron SDK is missing. No Neuron SDK needed."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.runfiles import checkpoint_scan
from tests.conftest import REPO, require
from trainer.config import config_digest, config_from_dict
from trainer.neuron import checkpoints
from trainer.neuron.config import NeuronConfig
from trainer.neuron.layout import batch_split, check_neuron_config, parallel_layout
from trainer.shapes import SHAPES
from wire import neuron_launch as launch
from wire.errors import EXIT_DO_NOT_RETRY, ConfigError, UsageError
from wire.files import nxd_step_of, nxd_tag

# --- the [neuron] table ----------------------------------------------------------------


def test_a_neuron_table_is_read_from_the_config() -> None:
    config = config_from_dict({"backend": "neuron", "model": "llama2-7b", "steps": 10,
                               "neuron": {"tensor_parallel_size": 32, "pipeline_parallel_size": 2,
                                          "num_microbatches": 4, "zero1": False}})
    assert config.backend == "neuron"
    assert config.neuron == NeuronConfig(tensor_parallel_size=32, pipeline_parallel_size=2,
                                         num_microbatches=4, zero1=False)


def test_the_neuron_defaults_are_the_seeds_recipe() -> None:
    neuron = config_from_dict({}).neuron
    assert (neuron.tensor_parallel_size, neuron.pipeline_parallel_size) == (8, 1)
    assert neuron.sequence_parallel and neuron.zero1


def test_bad_neuron_values_are_named_by_their_key_path() -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict({"neuron": {"tensor_parallel_size": 0, "zero1": "yes", "tensr_parallel_size": 8}})
    assert sorted(e.value.errors) == [
        "neuron.tensor_parallel_size: expected a positive integer, got 0",
        "neuron.zero1: expected true or false, got 'yes'",
        "neuron: unknown key 'tensr_parallel_size' (did you mean 'tensor_parallel_size'?)",
    ]


def test_microbatches_without_a_pipeline_are_refused() -> None:
    with pytest.raises(ConfigError, match="num_microbatches: only used with pipeline_parallel_size > 1"):
        NeuronConfig(num_microbatches=4)


def test_an_unknown_backend_is_refused_and_neuron_is_known() -> None:
    with pytest.raises(ConfigError, match="backend: expected one of 'torch', 'neuron', got 'jax'"):
        config_from_dict({"backend": "jax"})


def test_the_neuron_table_changes_the_digest_of_a_neuron_run_only() -> None:
    def digest(tp: int, backend: str) -> str:
        return config_digest(config_from_dict({"backend": backend, "neuron": {"tensor_parallel_size": tp}}))
    assert digest(32, "neuron") != digest(8, "neuron")
    assert digest(32, "torch") == digest(8, "torch")  # the torch backend never reads it


# --- layout ----------------------------------------------------------------------------


def test_16_trn1_nodes_at_tp_8_are_64_replicas_of_consecutive_tp_groups() -> None:
    layout = parallel_layout(512, NeuronConfig(tensor_parallel_size=8), SHAPES["llama2-7b"], ranks_per_node=32)
    assert layout.data_parallel_size == 64
    assert (layout.heads_per_rank, layout.kv_heads_per_rank, layout.kv_replication) == (4, 4, 1)
    tp = layout.tensor_parallel_groups()
    assert len(tp) == 64 and tp[0] == range(0, 8) and tp[-1] == range(504, 512)
    dp = layout.data_parallel_groups()
    assert len(dp) == 8 and list(dp[3])[:3] == [3, 11, 19] and len(dp[3]) == 64
    assert layout.pipeline_parallel_groups() == [range(r, 512, 512) for r in range(512)]


def test_pipeline_stages_are_the_outermost_rank_dimension() -> None:
    layout = parallel_layout(64, NeuronConfig(tensor_parallel_size=8, pipeline_parallel_size=4, num_microbatches=4),
                             SHAPES["llama2-70b"])
    assert layout.data_parallel_size == 2 and layout.layers_per_stage == 20
    assert layout.pipeline_parallel_groups()[5] == range(5, 64, 16)
    assert layout.data_parallel_groups()[0] == range(0, 16, 8)  # stage 0, TP rank 0: replicas 0 and 1
    every_rank = sorted(r for group in layout.tensor_parallel_groups() for r in group)
    assert every_rank == list(range(64))


def test_fewer_kv_heads_than_tp_ranks_are_replicated() -> None:
    layout = parallel_layout(512, NeuronConfig(tensor_parallel_size=32), SHAPES["llama3.1-8b"])
    assert (layout.kv_replication, layout.kv_heads_per_rank, layout.heads_per_rank) == (4, 1, 1)


def test_a_layout_that_does_not_fit_names_every_problem() -> None:
    with pytest.raises(ConfigError) as e:
        parallel_layout(500, NeuronConfig(tensor_parallel_size=32, pipeline_parallel_size=3),
                        SHAPES["llama3.2-3b"], ranks_per_node=32)
    assert e.value.errors == [
        "neuron.tensor_parallel_size: world size 500 is not a multiple of tensor_parallel_size x "
        "pipeline_parallel_size = 32 x 3",
        "neuron.tensor_parallel_size: 32 does not divide the model's query heads (24)",
        "neuron.pipeline_parallel_size: 3 does not divide the model's 28 layers",
    ]


def test_kv_heads_and_tp_must_divide_one_another() -> None:
    shape = dataclasses.replace(SHAPES["llama2-7b"], hidden_size=6144, n_heads=48, n_kv_heads=12)
    with pytest.raises(ConfigError, match="8 and the model's 12 key/value heads must divide one another"):
        parallel_layout(32, NeuronConfig(tensor_parallel_size=8), shape)


def test_tp_must_stay_inside_a_node() -> None:
    with pytest.raises(ConfigError, match="64 does not divide the 32 ranks of a node"):
        parallel_layout(512, NeuronConfig(tensor_parallel_size=64), SHAPES["llama2-70b"], ranks_per_node=32)


def test_the_batch_splits_over_replicas_not_ranks() -> None:
    config = config_from_dict({"backend": "neuron", "model": "llama2-7b", "global_batch_size": 1024,
                               "micro_batch_size": 1, "seq_len": 4096, "steps": 10})
    batch = batch_split(config, parallel_layout(512, config.neuron, config.shape))
    assert (batch.per_rank, batch.micro, batch.accumulation) == (16, 1, 16)
    with pytest.raises(ConfigError, match="global_batch_size: 1000 is not divisible by the data-parallel size 64"):
        batch_split(config_from_dict({"backend": "neuron", "model": "llama2-7b", "global_batch_size": 1000}),
                    parallel_layout(512, config.neuron, config.shape))


def test_check_config_refuses_the_torch_backends_features() -> None:
    config = config_from_dict({"backend": "neuron", "compile": True, "checkpoint": {"memory_every_steps": 5}})
    with pytest.raises(ConfigError) as e:
        check_neuron_config(config, None)
    assert [line.split(":")[0] for line in e.value.errors] == ["checkpoint.memory_every_steps", "compile"]


# --- checkpoint names, as the supervisor reads them ---------------------------------------


def _save(root: Path, step: int, *, finished: bool) -> Path:
    """A save laid out by the names the backend uses (what NxD writes there)."""
    paths = checkpoints.paths(root, step)
    paths.model.mkdir(parents=True)
    paths.optimizer.mkdir()
    paths.begin_marker.write_text("")
    (paths.model / "dp_rank_00_tp_rank_00_pp_rank_00.pt").write_bytes(b"weights")
    if finished:
        paths.done_marker.write_text("")
    return paths.directory


def test_the_scanner_recognises_the_backends_checkpoints(tmp_path: Path) -> None:
    done = _save(tmp_path, 40, finished=True)
    cut_short = _save(tmp_path, 80, finished=False)
    assert done.name == "step_40"
    verdicts = checkpoint_scan.scan(tmp_path, "nxd")
    assert [(v.step, v.ok, v.layout) for v in verdicts] == [(80, False, "nxd"), (40, True, "nxd")]
    best, rejected = checkpoint_scan.pick(tmp_path)  # any layout: nxd claims them
    assert best is not None and best.path == done and [v.path for v in rejected] == [cut_short]
    assert checkpoints.newest_complete(tmp_path) == done


def test_resume_names_a_complete_checkpoint_or_fails(tmp_path: Path) -> None:
    done = _save(tmp_path, 40, finished=True)
    unfinished = _save(tmp_path, 80, finished=False)
    assert checkpoints.resolve_resume("auto", tmp_path) == done
    assert checkpoints.resolve_resume(str(done), tmp_path) == done
    assert checkpoints.resolve_resume("none", tmp_path) is None
    with pytest.raises(UsageError, match=r"not a complete checkpoint \(expected an NxD step_N"):
        checkpoints.resolve_resume(str(unfinished), tmp_path)


def test_tags_are_not_zero_padded() -> None:
    assert nxd_tag(7) == "step_7" and nxd_step_of("step_7") == 7
    assert nxd_step_of("step_7.tmp") is None


# --- the trn1.32xlarge launch ------------------------------------------------------------


def test_a_trn1_node_launch_for_16_nodes() -> None:
    argv = launch.torchrun_argv(nnodes=16, node_rank=3, master_addr="10.0.0.1", master_port=44000,
                                program=launch.trainer_program("llama.toml", "auto"))
    assert argv == ["torchrun", "--nproc_per_node=32", "--nnodes=16", "--node_rank=3", "--master_addr=10.0.0.1",
                    "--master_port=44000", "-m", "trainer", "--config", "llama.toml", "--resume", "auto"]
    assert launch.precompile_argv(argv) == ["neuron_parallel_compile", *argv]
    same_on_every_node = launch.torchrun_argv(nnodes=16, master_addr="a", master_port=1, program=[])
    assert not any(a.startswith("--node_rank") for a in same_on_every_node)


def test_the_node_environment_takes_the_seeds_values_where_they_give_one() -> None:
    """Seed 004 (the HLAT post, 004_0f1bb56388bab5b8.txt): "We used the compiling flag
    --distribution-strategy=llm-training ... We also used --model-type=transformer ... We set
    the Neuron environment variable NEURON_FUSE_SOFTMAX=1 ... Finally, we used
    NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS=3 to reduce training latency"."""
    env = launch.NODE_ENV
    assert env["NEURON_CC_FLAGS"].split() == ["--model-type=transformer", "--distribution-strategy=llm-training"]
    assert env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "3" and env["NEURON_FUSE_SOFTMAX"] == "1"
    # This project's own, each marked so beside its value (wire/neuron_launch.py).
    assert {k: env[k] for k in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "MALLOC_ARENA_MAX")} == {
        "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1", "MALLOC_ARENA_MAX": "128"}
    source = (REPO / "wire" / "neuron_launch.py").read_text()
    assert "# This project's choices, no seed gives them:" in source
    assert launch.precision_env("bfloat16") == {"XLA_DOWNCAST_BF16": "1"} and launch.precision_env("float32") == {}


# --- without the SDK ----------------------------------------------------------------------


def test_training_without_the_neuron_sdk_is_a_config_error(tmp_path: Path) -> None:
    require("torch (the trainer extra)", importlib.util.find_spec("torch") is not None)
    if subprocess.run([sys.executable, "-c", "import neuronx_distributed"], capture_output=True).returncode == 0:
        pytest.skip("the Neuron SDK is installed here")
    path = tmp_path / "neuron.json"
    path.write_text(json.dumps({"backend": "neuron", "steps": 2, "output_dir": str(tmp_path / "out"),
                                "checkpoint": {"dir": str(tmp_path / "ck")}}))
    proc = subprocess.run([sys.executable, "-m", "trainer", "--config", str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == EXIT_DO_NOT_RETRY, proc.stderr
    assert "backend: 'neuron' needs the Neuron SDK (torch-neuronx, neuronx-distributed)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
