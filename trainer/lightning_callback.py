"""A PyTorch Lightning callback that reports a Lightning trainer to the supervisor: its
steps with loss, grad norm and learning rate, its phases (init, restore, train, eval,
checkpoint) and its committed checkpoints, through ``trainer.client.Reporter``. NxD
Training and NeMo are Lightning-based; so are many users' own trainers.

    from trainer.lightning_callback import SupervisorCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[SupervisorCallback(), ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path=resume_from)   # the spec's resume: ["--ckpt={checkpoint}"]

Works with ``lightning`` and with the older ``pytorch_lightning`` package (NeMo's, NxD
Training's). A step is an optimizer step (``trainer.global_step``): with gradient
accumulation, one report per accumulated step. The loss is the training step's (the
``loss`` of what it returned). Outside a supervised run every call does nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.client import Reporter

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # NeMo and NxD Training use the older package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment]


class SupervisorCallback(Callback):
    def __init__(self, reporter: Reporter | None = None) -> None:
        super().__init__()
        self.reporter = reporter if reporter is not None else Reporter()
        self._grad_norm: float | None = None
        self._reported_step = -1
        self._saving_step: int | None = None  # the step of the checkpoint being written
        self._committed: set[str] = set()

    # --- phases ---------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.reporter.phase("init")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step > 0:  # restored from ckpt_path
            self.reporter.resumed(int(trainer.global_step))
            self._reported_step = int(trainer.global_step)
        self.reporter.phase("train")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.reporter.phase("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._report_saved(trainer)
        if not trainer.sanity_checking:
            self.reporter.phase("train")

    # --- steps ------------------------------------------------------------------------

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad.detach().norm(2) for p in pl_module.parameters() if p.grad is not None]
        self._grad_norm = float(torch.linalg.vector_norm(torch.stack(grads))) if grads else None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._report_saved(trainer)
        step = int(trainer.global_step)
        if step <= self._reported_step:
            return  # an accumulation micro-batch: the optimizer has not stepped
        self._reported_step = step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        lrs = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]
        self.reporter.step(step, loss=math.nan if loss is None else float(loss), grad_norm=self._grad_norm,
                           lr=float(lrs[0]) if lrs else math.nan)
        self._grad_norm = None

    # --- checkpoints --------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.reporter.phase("checkpoint")
        self._saving_step = int(trainer.global_step)

    def _report_saved(self, trainer: Any) -> None:
        """A checkpoint callback's newest file, once written, is a committed checkpoint.
        (Lightning runs checkpoint callbacks after the others: a save of this step shows at
        the next hook.)"""
        if self._saving_step is None:
            return
        for cb in getattr(trainer, "checkpoint_callbacks", []):
            for path in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")):
                if path and path not in self._committed:
                    self._committed.add(path)
                    self.reporter.checkpoint(self._saving_step, path)
        self.reporter.phase("train")
        self._saving_step = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._report_saved(trainer)
        self.reporter.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.reporter.close(exit_code=1, reason=f"{type(exception).__name__}: {exception}"[:500])
