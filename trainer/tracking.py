"""Rank 0's view of training for people: the console and TensorBoard.

Every step's numbers go to telemetry (trainer/telemetry.py) on every rank regardless;
this module is what a person watching the run sees:

- the console: a line every ``log_every_steps`` steps (and after the last step) in the
  ``key value`` form logs are grepped for; on a terminal, a progress bar with the same
  numbers instead, and the other lines printed above it;
- TensorBoard: scalars under ``train/`` and ``val/``, one point per step, in
  ``tensorboard_dir`` (default ``<output_dir>/tensorboard``), when the ``tensorboard``
  package is installed. Without it the run says so once and goes on.
"""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainer.config import TrainConfig

if TYPE_CHECKING:
    from trainer.result import StepStats


class _Bar(Protocol):
    def update(self, n: int) -> Any: ...
    def set_postfix_str(self, s: str) -> Any: ...
    def close(self) -> Any: ...


class StepLog:
    def __init__(self, config: TrainConfig, *, is_main: bool) -> None:
        self._config, self._is_main = config, is_main
        self._writer: Any = None
        # Where the writer opens at the attempt's first step (see step); None once tried.
        self._board: Path | None = Path(config.tensorboard_dir or Path(config.output_dir) / "tensorboard")
        self._bar: _Bar | None = None
        self._bar_step = 0  # the bar's position: a resumed run's first step moves it there
        if not is_main:
            return
        if sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=config.steps, unit="step", dynamic_ncols=True)

    def say(self, line: str) -> None:
        """A line for the log (rank 0 only), above the progress bar if there is one."""
        if not self._is_main:
            return
        if self._bar is not None:
            from tqdm import tqdm

            tqdm.write(line)
        else:
            print_line(line)

    def step(self, step: int, s: StepStats) -> None:
        if not self._is_main:
            return
        numbers = (f"loss {s.loss:.4f} grad_norm {s.grad_norm:.4f} lr {s.lr:.3e} "
                   f"param_norm {s.param_norm:.3f} step_time_s {s.step_time_s:.3f} "
                   f"tokens_per_s {s.tokens_per_s:.0f} mfu {_percent(s.mfu)}")
        if math.isfinite(s.val_loss):
            numbers += f" val_loss {s.val_loss:.4f}"
        if self._bar is not None:
            self._bar.update(step - self._bar_step)
            self._bar_step = step
            self._bar.set_postfix_str(numbers)
        elif (step % self._config.log_every_steps == 0 or step == self._config.steps
              or math.isfinite(s.val_loss)):
            print_line(f"step {step}/{self._config.steps} {numbers}")
        if self._writer is None and self._board is not None:
            # Opened at the attempt's first step: points an earlier attempt wrote from this
            # step on (redone after a resume) are purged, so each step has one point.
            self._writer, self._board = _tensorboard_writer(self._board, purge_step=step), None
        if self._writer is not None:
            for key, value in (("train/loss", s.loss), ("train/grad_norm", s.grad_norm), ("train/lr", s.lr),
                               ("train/param_norm", s.param_norm), ("train/tokens_per_s", s.tokens_per_s),
                               ("train/mfu", s.mfu), ("val/loss", s.val_loss)):
                if math.isfinite(value):
                    self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _tensorboard_writer(directory: Path, purge_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        print("trainer: tensorboard is not installed: no TensorBoard events "
              "(pip install tensorboard)", flush=True)
        return None
    return SummaryWriter(log_dir=str(directory), purge_step=purge_step)


def _percent(value: float) -> str:
    return f"{value:.2%}" if math.isfinite(value) else "n/a"


_OUT = threading.Lock()


def print_line(text: str) -> None:
    """One whole line on stdout. print() writes the text and its newline apart, so a
    background save's line could land between a step's text and its newline, and a
    reader of the log (the daemon, a bench) would find neither line."""
    with _OUT:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
