"""Exact telemetry from a trainer the supervisor did not write: a handful of calls, no torch.

    from trainer.client import Reporter

    tsup = Reporter()                    # from the rank's environment (torchrun's and the supervisor's)
    tsup.phase("compile")                # init, compile, restore, train, checkpoint, eval
    for step in range(start + 1, steps + 1):
        loss = train_step()
        tsup.step(step, loss=loss, grad_norm=grad_norm, lr=lr)
        if step % 100 == 0:
            save(step)
            tsup.checkpoint(step, path)
    tsup.close()                         # at exit; it runs by itself at interpreter exit too

With it the supervisor judges the trainer by the same rules as its own (trainer/
telemetry.py does the work): hangs from step times, NaN and spikes from the loss, and
stragglers. Outside a supervised run (no ``TSUP_MQTT_URL`` in the environment) every
call does nothing, so the same script runs anywhere. A step call never blocks: messages
go to a bounded queue that a background thread publishes.
"""

from __future__ import annotations

import atexit
import math
import os
import time
from collections.abc import Mapping

from trainer.telemetry import Telemetry
from wire import Phase


class Reporter:
    """One rank's reporter. Its rank comes from torchrun's RANK, LOCAL_RANK, WORLD_SIZE
    and LOCAL_WORLD_SIZE (0, 0, 1 and 1 when they are not set)."""

    def __init__(self, environ: Mapping[str, str] | None = None, *,
                 heartbeat_interval_s: float = 1.0) -> None:
        env = os.environ if environ is None else environ

        def number(name: str, default: str) -> int:
            return int(env.get(name, default))

        self._telemetry = Telemetry.from_env(
            env, rank=number("RANK", "0"), local_rank=number("LOCAL_RANK", "0"),
            world_size=number("WORLD_SIZE", "1"), local_world_size=number("LOCAL_WORLD_SIZE", "1"),
            heartbeat_interval_s=heartbeat_interval_s)
        self._step = 0
        self._last_at: float | None = None
        self._closed = False
        if self._telemetry.enabled:
            self._telemetry.start()
            atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        """Whether the supervisor is listening (False: every call does nothing)."""
        return self._telemetry.enabled

    def phase(self, name: str) -> None:
        """The phase the rank is in; slow ones (init, compile, restore, checkpoint, eval)
        get their own allowance before a hang is called. ValueError for an unknown one."""
        self._telemetry.set_phase(Phase(name), self._step)

    def resumed(self, step: int) -> None:
        """The rank continues after ``step``, restored from a checkpoint."""
        self._step = step
        self._telemetry.restored(step)

    def step(self, step: int, *, loss: float, grad_norm: float | None = None, lr: float = math.nan,
             tokens_per_s: float = math.nan, step_time_s: float | None = None) -> None:
        """A training step done. ``step_time_s`` defaults to the time since the last call."""
        now = time.monotonic()
        if step_time_s is None:
            step_time_s = now - self._last_at if self._last_at is not None else math.nan
        self._last_at, self._step = now, step
        self._telemetry.set_phase(Phase.TRAIN, step)
        norm = None if grad_norm is None else float(grad_norm)  # None: not measured (never "NaN")
        self._telemetry.step_completed(step=step, loss=float(loss), grad_norm=norm, lr=float(lr),
                                       step_time_s=step_time_s, tokens_per_s=float(tokens_per_s))

    def checkpoint(self, step: int, path: str, *, duration_s: float = math.nan) -> None:
        """A checkpoint of ``step`` is complete at ``path``."""
        self._telemetry.checkpoint_committed(step=step, path=str(path), duration_s=duration_s)

    def close(self, exit_code: int = 0, reason: str = "") -> None:
        """Send what is queued and say goodbye (at most a few seconds); once."""
        if self._closed:
            return
        self._closed = True
        self._telemetry.close(exit_code=exit_code, final_step=self._step, reason=reason)
