"""The Neuron backend's training loop: ``train_neuron(config, resume=...)`` on every rank.

Started by ``python -m trainer`` under torchrun, one rank per NeuronCore
(wire/neuron_launch.py). The Neuron SDK (torch-neuronx, which brings torch-xla, and
neuronx-distributed) is imported when training starts, so that the rest of the trainer
works without it; missing, it is a configuration error (exit 2), never a retry.

The order of work, as in trainer/train.py:

1. init: the ``xla`` process group, NxD's parallel state from ``[neuron]``
   (trainer/neuron/layout.py checks the numbers first), the model built on NxD's
   parallel layers, AdamW wrapped by NxD (ZeRO-1 and gradient clipping inside);
2. restore: the NxD checkpoint ``--resume`` names (``nxd.load_checkpoint``);
3. train: the first ``COMPILE_STEPS`` steps of an attempt trace and compile their
   graphs and are announced as the ``compile`` phase (a compile takes minutes, and the
   supervisor allows ``compile_timeout_s`` for it); a checkpoint every ``every_steps``
   (``nxd.save_checkpoint``, asynchronous with ``checkpoint.asynchronous``);
4. done: rank 0 writes ``<output_dir>/result.json``.

Metrics leave through ``xm.add_step_closure``: the host reads a step's loss once the
device has run it, without stalling the next step. Each rank reports the loss of its own
data-parallel replica. Under ``neuron_parallel_compile`` (``NEURON_EXTRACT_GRAPHS_ONLY``)
the loop traces ``EXTRACT_GRAPHS_STEPS`` steps and writes nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from trainer import atomic
from trainer.config import TrainConfig, config_digest
from trainer.data import BatchReader, open_source
from trainer.distributed import LaunchEnv
from trainer.neuron import checkpoints
from trainer.neuron.layout import batch_split, check_neuron_config, parallel_layout
from trainer.optim import lr_at, set_lr
from trainer.telemetry import Telemetry
from wire import Phase
from wire.errors import EXIT_OK, ConfigError, exit_code_for
from wire.files import RESULT_FILE, nxd_tag
from wire.neuron_launch import EXTRACT_GRAPHS_STEPS, precision_env

COMPILE_STEPS = 2  # step 1 creates the optimizer state: its graph differs from step 2's


def import_sdk() -> tuple[ModuleType, ModuleType, ModuleType]:
    """(torch_xla.core.xla_model, neuronx_distributed, its parallel_state), or ConfigError."""
    try:
        import neuronx_distributed as nxd
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" process group)
        from neuronx_distributed.parallel_layers import parallel_state
    except ImportError as e:
        raise ConfigError(f"backend: 'neuron' needs the Neuron SDK (torch-neuronx, neuronx-distributed), "
                          f"which this Python cannot import ({e}); train on a Trainium node with the "
                          f"Neuron SDK installed, or use backend = 'torch'") from e
    return xm, nxd, parallel_state


def train_neuron(config: TrainConfig, *, resume: str = "auto") -> None:
    """Run (or continue) training to ``config.steps``; see the module docstring."""
    check_neuron_config(config, None)
    xm, nxd, parallel_state = import_sdk()
    for key, value in precision_env(config.dtype).items():  # read when torch-xla starts its device
        os.environ.setdefault(key, value)
    if config.neuron.compile_cache_dir:
        os.environ["NEURON_COMPILE_CACHE_URL"] = config.neuron.compile_cache_dir
    launch = LaunchEnv.from_environ(os.environ)
    telemetry = Telemetry.started_for(os.environ, launch, heartbeat_interval_s=config.heartbeat_interval_s)
    runner: _Runner | None = None
    exit_code, reason = EXIT_OK, "finished"
    try:
        torch.distributed.init_process_group("xla")
        runner = _Runner(config, launch, telemetry, xm, nxd, parallel_state)
        runner.run(resume)
    except BaseException as exc:
        exit_code, reason = exit_code_for(exc), f"{type(exc).__name__}: {exc}"
        raise
    finally:
        telemetry.close(exit_code=exit_code, final_step=runner.step if runner else 0, reason=reason)


class _Runner:
    def __init__(self, config: TrainConfig, launch: LaunchEnv, telemetry: Telemetry,
                 xm: Any, nxd: Any, parallel_state: Any) -> None:
        self.config, self.launch, self.telemetry, self.xm, self.nxd = config, launch, telemetry, xm, nxd
        neuron = config.neuron
        self.layout = parallel_layout(launch.world_size, neuron, config.shape,
                                      ranks_per_node=launch.local_world_size)
        self.batch = batch_split(config, self.layout)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=neuron.tensor_parallel_size,
                                                 pipeline_model_parallel_size=neuron.pipeline_parallel_size)
        from trainer.neuron.model import DecoderLayer, NeuronLlama  # NxD's layers: the SDK is there now

        pipeline = None
        if neuron.pipeline_parallel_size > 1:
            pipeline = {"transformer_layer_cls": DecoderLayer, "num_microbatches": neuron.num_microbatches,
                        "output_loss_value_spec": (True,), "input_names": ["input_ids", "labels"],
                        "auto_partition": True, "use_zero1_optimizer": neuron.zero1}
        clip = config.optimizer.grad_clip
        nxd_config = nxd.neuronx_distributed_config(
            tensor_parallel_size=neuron.tensor_parallel_size,
            pipeline_parallel_size=neuron.pipeline_parallel_size, pipeline_config=pipeline,
            sequence_parallel=neuron.sequence_parallel,
            optimizer_config={"zero_one_enabled": neuron.zero1, "grad_clipping": clip > 0,
                              "max_grad_norm": clip},
            activation_checkpoint_config=DecoderLayer if config.activation_checkpointing == "full" else None)
        torch.manual_seed(config.seed)
        self.model = nxd.initialize_parallel_model(
            nxd_config, lambda: NeuronLlama(config.shape, self.layout, seq_len=config.seq_len,
                                            sequence_parallel=neuron.sequence_parallel))
        opt = config.optimizer
        decayed = [p for p in self.model.parameters() if p.dim() >= 2]
        kept = [p for p in self.model.parameters() if p.dim() < 2]  # norm gains: no decay
        self.optimizer = nxd.initialize_parallel_optimizer(
            nxd_config, torch.optim.AdamW,
            [{"params": decayed, "weight_decay": opt.weight_decay}, {"params": kept, "weight_decay": 0.0}],
            lr=opt.lr, betas=opt.betas, eps=opt.eps)
        source = open_source(config.data, seed=config.seed, vocab_size=config.shape.vocab_size,
                             seq_len=config.seq_len)
        self.reader = BatchReader(source, seed=config.seed, global_batch=config.global_batch_size,
                                  rank=parallel_state.get_data_parallel_rank(),
                                  world_size=self.layout.data_parallel_size)
        self.device = xm.xla_device()
        self.root = Path(config.checkpoint.dir)
        self.extract_only = os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY") == "1"
        self.step = 0
        self.consumed = 0
        self.last_loss: float | None = None
        self.is_main = launch.rank == 0

    def run(self, resume: str) -> None:
        config = self.config
        start = self._restore(resume)
        last = min(config.steps, start + EXTRACT_GRAPHS_STEPS) if self.extract_only else config.steps
        began = time.monotonic()
        for step in range(start + 1, last + 1):
            compiling = step <= start + COMPILE_STEPS
            self.telemetry.set_phase(Phase.COMPILE if compiling else Phase.TRAIN, self.step)
            self._train_step(step)
            every = config.checkpoint.every_steps
            if not self.extract_only and (step == config.steps or (every and step % every == 0)):
                self._save(step)
        self.xm.wait_device_ops()
        self.telemetry.set_phase(Phase.DONE, self.step)
        if self.is_main and not self.extract_only:
            atomic.write_json(Path(config.output_dir) / RESULT_FILE, {
                "final_step": self.step, "final_loss": self.last_loss, "model_digest": None,
                "steps_run_this_attempt": self.step - start, "world_size": self.launch.world_size,
                "model": config.model, "config_digest": config_digest(config),
                "run_id": self.telemetry.identity.run, "attempt": self.telemetry.identity.attempt,
                "wall_time_s": time.monotonic() - began})

    def _restore(self, resume: str) -> int:
        path = checkpoints.resolve_resume(resume, self.root)
        if path is None:
            return 0
        self.telemetry.set_phase(Phase.RESTORE, 0)
        user = self.nxd.load_checkpoint(str(path.parent), tag=path.name, model=self.model,
                                        optimizer=self.optimizer)
        self.step, self.consumed, self.last_loss = user["step"], user["consumed_samples"], user["last_loss"]
        self.telemetry.restored(self.step)
        return self.step

    def _train_step(self, step: int) -> None:
        config, batch = self.config, self.batch
        lr = lr_at(step, config=config.optimizer, total_steps=config.steps)
        set_lr(self.optimizer, lr)
        for start, end in config.data.skip:  # the supervisor's data window after a loss spike
            if start <= self.consumed < end:
                self.consumed = end
        rows = torch.from_numpy(self.reader.rank_batch(self.consumed)).long()
        started = time.monotonic()
        if config.neuron.pipeline_parallel_size > 1:
            # NxD's pipeline splits the batch into num_microbatches itself and runs forward
            # and backward; it returns the mean loss.
            tokens = rows.to(self.device)
            total = self.model.run_train(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).detach()
        else:
            total = torch.zeros((), device=self.device)
            for micro in rows.chunk(batch.accumulation):
                tokens = micro.to(self.device)
                loss = self.model(tokens[:, :-1], tokens[:, 1:]) / batch.accumulation
                loss.backward()
                total = total + loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.xm.mark_step()  # the step's graph is cut here and runs on the device
        self.step, self.consumed = step, self.consumed + config.global_batch_size
        tokens_per_step = config.global_batch_size * config.seq_len
        self.xm.add_step_closure(self._report, (step, total, self.optimizer.grad_norm, lr, started,
                                                tokens_per_step))

    def _report(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None, lr: float,
                started: float, tokens: int) -> None:
        elapsed = time.monotonic() - started
        self.last_loss = float(loss.item())
        norm = None if grad_norm is None else float(grad_norm.item())
        self.telemetry.step_completed(step=step, loss=self.last_loss, grad_norm=norm, lr=lr,
                                      step_time_s=elapsed, tokens_per_s=tokens / max(elapsed, 1e-9))
        if self.is_main and step % self.config.log_every_steps == 0:
            print(f"step {step} loss {self.last_loss:.4f} lr {lr:.3g} grad_norm {norm} "
                  f"step_time {elapsed:.2f}s", flush=True)

    def _save(self, step: int) -> None:
        self.telemetry.set_phase(Phase.CHECKPOINT, step)
        began = time.monotonic()
        asynchronous = self.config.checkpoint.asynchronous
        self.nxd.save_checkpoint(str(self.root), nxd_tag(step), model=self.model,
                                 optimizer=self.optimizer, num_kept_ckpts=self.config.checkpoint.keep,
                                 user_content={"step": step, "consumed_samples": self.consumed,
                                               "last_loss": self.last_loss},
                                 async_save=asynchronous)
        if not asynchronous:  # an asynchronous save is complete when NxD writes `done`: the scan sees it
            path = checkpoints.paths(self.root, step).directory
            self.telemetry.checkpoint_committed(step=step, path=str(path),
                                                duration_s=time.monotonic() - began)
        self.telemetry.set_phase(Phase.TRAIN, step)
