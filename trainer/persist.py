"""A rank's saves to storage (the persistent tier): on the training thread, or, with
``[checkpoint] asynchronous``, one at a time on a thread of their own.

An asynchronous save first waits for the one before it (a rank has one save in flight),
then copies the state into reused host buffers (trainer/staging.py) beside the next
step, and writes and commits it from there (trainer/checkpoint.py). Its copy is fenced
before the state changes: the training loop calls ``fence`` before each optimizer step.
A save that failed on its thread fails the attempt at the next ``poll``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from trainer import checkpoint, distributed
from trainer import checkpoint_layout as layout
from trainer.config import TrainConfig
from trainer.staging import StagedCopy, Staging
from trainer.telemetry import Telemetry

# Called between a save's writes and its commit, with the step, when the save began
# (time.monotonic) and its bytes: the chaos drills' hook (trainer/train.py).
BeforeCommit = Callable[[int, float, int], None]


class PersistentSaves:
    def __init__(self, config: TrainConfig, ctx: distributed.DistContext, telemetry: Telemetry, *,
                 io_threads: int, say: Callable[[str], None], before_commit: BeforeCommit) -> None:
        self.config, self.ctx, self.telemetry = config, ctx, telemetry
        self.io_threads, self._say, self._before_commit = io_threads, say, before_commit
        self.last_path: str | None = None  # the newest save committed by this attempt
        self._pending: Future[None] | None = None
        self._copy: StagedCopy | None = None  # the asynchronous save's copy, until fenced
        asynchronous = config.checkpoint.asynchronous
        # Its own process group: the training thread's collectives never wait behind a save's.
        self._group = distributed.background_group() if asynchronous else None
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
                        if asynchronous else None)
        self._staging = Staging(ctx.device, threads=io_threads) if asynchronous else None

    @property
    def busy(self) -> bool:
        """A save is in flight on its thread."""
        return self._pending is not None

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Lay out the host buffers an asynchronous save copies into, ahead of the first save."""
        if self._staging is not None:
            self._staging.prepare(checkpoint.stage(model, optimizer))

    def save(self, meta: layout.TrainerMeta, state: dict[str, object]) -> None:
        """Save ``state``: here and now, or (asynchronous) once the previous save is done,
        from a copy made beside the next step."""
        if self._worker is None:
            self._persist(meta, state)
            return
        started = time.perf_counter()  # training is blocked from here: the wait counts too
        self.wait()  # one save in flight: the previous one is on storage first
        waited = time.perf_counter() - started
        assert self._staging is not None
        self._copy = self._staging.begin(state)  # beside the next step: fenced before it
        self._pending = self._worker.submit(self._persist, meta, state, self._copy, waited)

    def fence(self) -> None:
        """The state is about to change: the copy of the save in flight must be done."""
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.fence()

    def poll(self) -> None:
        """Raise what a finished save on its thread raised."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Stop the save thread (a save not waited for is lost) and free the host buffers."""
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
        if self._staging is not None:
            self._staging.close()

    def _persist(self, meta: layout.TrainerMeta, state: dict[str, object], copy: StagedCopy | None = None,
                 waited_s: float = 0.0) -> None:
        """Write and commit a persistent checkpoint: on the training thread, or on the
        checkpoint thread from ``copy`` (an asynchronous save: training waited ``waited_s``
        for the previous one, and whatever of the copy was left at the next step)."""
        config = self.config
        step, started = meta.step, time.monotonic()
        if copy is not None:
            state = copy.done()
        size = checkpoint.state_bytes(state)
        saved = checkpoint.save(Path(config.checkpoint.dir).absolute(), meta, state,
                                keep=config.checkpoint.keep, is_main=self.ctx.is_main,
                                before_commit=lambda: self._before_commit(step, started, size),
                                group=self._group, io_threads=self.io_threads,
                                attempt=self.telemetry.identity.attempt)
        self.last_path = str(saved.path)
        if self.ctx.is_main:
            blocked = saved.duration_s if copy is None else waited_s + copy.blocked_s()
            whole = time.monotonic() - started + (0.0 if copy is None else copy.begun_s)
            self.telemetry.checkpoint_committed(step=step, path=str(saved.path), duration_s=blocked,
                                                total_s=whole, size=size)
            pruned = f", pruned {len(saved.deleted)}" if saved.deleted else ""
            beside = "" if copy is None else f" (beside training; it blocked {blocked:.3f} s)"
            self._say(f"checkpoint step {step} committed to {saved.path} "
                      f"in {saved.duration_s:.3f} s{beside}{pruned}")
