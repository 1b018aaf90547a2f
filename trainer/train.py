"""The training loop: build, restore, train, checkpoint, finish.

``train(config, resume=...)`` is the whole life of one attempt on one rank. Every rank
runs it; they agree on everything through collectives, and rank 0 alone prints progress,
commits checkpoints and writes result.json. The order of work:

1. init: process group, telemetry, model (built on ``meta``, sharded with FSDP2, then
   materialized and initialized), AdamW, data;
2. restore (optional): the checkpoint ``--resume`` names; rank 0 decides which and tells
   the others, so they cannot disagree about a directory that is changing;
3. train: steps ``step + 1 .. config.steps``, a checkpoint every ``every_steps`` and after
   the last step (on a background thread when ``checkpoint.asynchronous``), and one in
   memory every ``memory_every_steps`` (trainer/memory_tier.py);
4. done: the model digest, then rank 0 writes ``<output_dir>/result.json`` atomically.
   That file appears only after a fully successful finish (a stale one is deleted at
   start), so its presence is the supervisor's proof of success.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer import atomic, checkpoint, checkpoint_io, distributed, flops, memory_tier
from trainer import checkpoint_layout as layout
from trainer.config import TrainConfig, config_digest
from trainer.data import BatchReader, open_source, open_validation_source
from trainer.digest import model_digest
from trainer.faults import SPIKE_FACTOR, Fault, FaultPlan, burn_cpu
from trainer.model import Transformer
from trainer.optim import build_optimizer, lr_at, set_lr
from trainer.persist import PersistentSaves
from trainer.restore import restore
from trainer.result import StepStats, TrainResult
from trainer.telemetry import Telemetry
from trainer.tracking import StepLog, print_line
from wire import TIER_MEMORY, Phase
from wire.errors import EXIT_OK, exit_code_for
from wire.files import RESULT_FILE

_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The forward/backward dtype: ``auto`` is bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _COMPUTE_DTYPES[name]


def train(config: TrainConfig, *, resume: str = "auto",
          environ: Mapping[str, str] | None = None) -> TrainResult:
    """Run (or continue) training to ``config.steps``; see the module docstring.

    ``resume``: ``auto`` (newest complete checkpoint in ``checkpoint.dir``, if any),
    ``none`` (start fresh), or the path of a complete checkpoint.
    Raises wire.errors.DoNotRetry subclasses for problems a retry cannot fix.
    """
    environ = os.environ if environ is None else environ
    launch = distributed.LaunchEnv.from_environ(environ)
    faults = FaultPlan.from_env(environ)
    telemetry = Telemetry.started_for(environ, launch, heartbeat_interval_s=config.heartbeat_interval_s)
    runner: _Runner | None = None
    exit_code, reason = EXIT_OK, "finished"
    try:
        ctx = distributed.init(launch, config.device, config.dist_timeout_s)
        memory_root = Path(config.checkpoint.memory_dir or environ.get("TSUP_MEMORY_DIR")
                           or memory_tier.default_root(telemetry.identity.run))
        runner = _Runner(config, ctx, telemetry, faults,
                         memory_root if config.checkpoint.memory_every_steps or resume.startswith("memory:")
                         else None)
        return runner.run(resume)
    except BaseException as exc:
        exit_code, reason = exit_code_for(exc), f"{type(exc).__name__}: {exc}"
        raise
    finally:
        try:
            if runner is not None:
                runner.close()
            distributed.shutdown()
        finally:  # Exit goes out even if tearing down the process group fails
            telemetry.close(exit_code=exit_code, final_step=runner.step if runner else 0,
                            reason=reason)


class _Runner:
    """One attempt's state on one rank; ``run`` is the only entry point."""

    def __init__(self, config: TrainConfig, ctx: distributed.DistContext,
                 telemetry: Telemetry, faults: FaultPlan, memory_root: Path | None) -> None:
        self.config, self.ctx, self.telemetry, self.faults = config, ctx, telemetry, faults
        self.batch = config.batch_layout(ctx.world_size)
        self.step = 0  # optimizer steps completed
        self.consumed = 0  # samples consumed, the data stream position
        self.last_loss: float | None = None
        self.started = time.monotonic()
        # SIGUSR1 asks for a checkpoint at the next step (Slurm sends it ahead of a time
        # limit, ``sbatch --signal=USR1@S``); the ranks agree on the step in the loss's
        # all-reduce, so all of them save together.
        self._save_asked = False
        self._save_asked_now = False
        self._injected: set[str] = set()  # chaos faults this rank has reported (once each)
        self.log = StepLog(config, is_main=ctx.is_main)
        if threading.current_thread() is threading.main_thread():  # the only place handlers may be set
            signal.signal(signal.SIGUSR1, self._on_usr1)
        torch.manual_seed(config.seed)  # nothing should draw from it; pin it regardless

        if ctx.is_main:  # a result.json from an earlier attempt must not outlive it
            output = Path(config.output_dir)
            output.mkdir(parents=True, exist_ok=True)
            (output / RESULT_FILE).unlink(missing_ok=True)

        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, config.optimizer)
        # The tiers' background work has process groups of its own (created here, by every
        # rank in the same order): the training thread's collectives never wait behind it.
        identity = telemetry.identity
        # Threads that write, read and hash a rank's checkpoint files (trainer/checkpoint_io.py).
        self.io_threads = (config.checkpoint.io_threads
                           or checkpoint_io.io_threads(ctx.launch.local_world_size))
        self.memory = None if memory_root is None else memory_tier.MemoryTier(
            memory_root, identity.node, identity.attempt, ctx.launch.local_world_size, device=ctx.device,
            io_threads=self.io_threads)
        self.saves = PersistentSaves(config, ctx, telemetry, io_threads=self.io_threads, say=self._say,
                                     before_commit=self._in_save)
        source = open_source(config.data, seed=config.seed,
                             vocab_size=config.shape.vocab_size, seq_len=config.seq_len)
        self.reader = BatchReader(source, seed=config.seed,
                                  global_batch=config.global_batch_size,
                                  rank=ctx.rank, world_size=ctx.world_size)
        self.validation = (open_validation_source(config.data, seed=config.seed,
                                                  vocab_size=config.shape.vocab_size, seq_len=config.seq_len,
                                                  training=source)
                           if config.validation_every_steps else None)
        self.flops_per_token = flops.training_flops_per_token(config.shape, config.seq_len)
        self.peak_tflops = (config.peak_tflops
                            or _stated_peak(ctx.device, compute_dtype(config.dtype, ctx.device)))

    def _build_model(self) -> Transformer:
        """Built on ``meta`` (shapes only: sharding first keeps memory per rank low), with
        activation checkpointing and torch.compile per block as configured, sharded with
        FSDP2, then materialized and initialized."""
        config = self.config
        with torch.device("meta"):
            model = Transformer(config.shape, rope_len=config.seq_len)
        model.prepare_blocks(activation_checkpointing=config.activation_checkpointing, compile=config.compile)
        distributed.shard_model(model, self.ctx.mesh, compute_dtype(config.dtype, self.ctx.device))
        model.to_empty(device=self.ctx.device)
        model.init_weights(config.seed)
        return model

    def run(self, resume: str) -> TrainResult:
        config = self.config
        self._say(f"trainer: model {config.model} ({config.shape.parameter_count() / 1e6:.2f} M "
                  f"params), {self.ctx.world_size} rank(s) on {self.ctx.device.type}, global "
                  f"batch {config.global_batch_size} = {self.ctx.world_size} x "
                  f"{self.batch.accumulation} x {self.batch.micro}, {config.steps} steps")
        resumed_from = self._restore(resume)
        first_step = self.step
        self.telemetry.set_phase(Phase.TRAIN, self.step)
        while self.step < config.steps:
            stats = self._train_step(self.step + 1)
            if self.step == first_step + 1:  # the optimizer's state exists now: copies of it can be laid out
                self._prepare_staging()
            if self._validation_due():
                stats = replace(stats, val_loss=self._validate())
            self._report(stats)
            self._poll_background()
            if self._memory_due():
                self._save_to_memory()
            if self._checkpoint_due() or self._save_asked_now:
                if self._save_asked_now and not self._checkpoint_due():
                    self._say(f"checkpoint at step {self.step} asked for by SIGUSR1 (a time limit ahead)")
                self._save()
            self.faults.after_step(self.step, self.ctx.rank,
                                   lambda fault, detail: self._fault_fired(fault, self.step, detail))
        self._fence()  # no step follows the last one's saves
        if self.saves.busy or (self.memory is not None and self.memory.busy):
            with self._checkpoint_phase():  # the final checkpoint is on storage before the run is done
                self.saves.wait()
                if self.memory is not None:
                    self.memory.wait()
        self.log.close()
        self.telemetry.set_phase(Phase.DONE, self.step)
        digest = model_digest(self.model, is_main=self.ctx.is_main)
        result = TrainResult(
            final_step=self.step, model_digest=digest, final_loss=self.last_loss,
            steps_run_this_attempt=self.step - first_step,
            resumed_from=resumed_from,
            consumed_samples=self.consumed, world_size=self.ctx.world_size,
            model=config.model, parameters=config.shape.parameter_count(),
            config_digest=config_digest(config), run_id=self.telemetry.identity.run,
            attempt=self.telemetry.identity.attempt,
            last_checkpoint=self.saves.last_path or resumed_from,
            wall_time_s=round(time.monotonic() - self.started, 3))
        if self.ctx.is_main:
            atomic.write_json(Path(config.output_dir) / RESULT_FILE, asdict(result))
            self._say(f"done: step {self.step}, loss {_fmt(self.last_loss)}, digest {digest}")
        distributed.barrier()  # no rank reports success before result.json exists
        if self.memory is not None:
            self.memory.drop()  # a finished run needs no memory checkpoint
        return result

    def close(self) -> None:
        """Stop the background savers (their work is lost if it was not waited for)."""
        self.log.close()
        self._fence()  # a writer waiting to learn what its copy cost training learns it now
        if self.memory is not None:
            self.memory.close()
        self.saves.close()

    def _fence(self) -> None:
        """The state is about to change: the copies of the saves in flight must be done
        (trainer/staging.py)."""
        if self.memory is not None:
            self.memory.fence()
        self.saves.fence()

    def _prepare_staging(self) -> None:
        """Lay out the host buffers the saves beside training copy into, ahead of the first
        save and on threads of their own (trainer/staging.py)."""
        if self.memory is not None and self.config.checkpoint.memory_every_steps:
            self.memory.prepare(self.model, self.optimizer)
        self.saves.prepare(self.model, self.optimizer)

    def _restore(self, resume: str) -> str | None:
        """Resume from the checkpoint ``resume`` names (trainer/restore.py): where from, or None."""
        resumed = restore(resume, self.config, self.ctx, self.telemetry, self.model, self.optimizer,
                          memory=self.memory, io_threads=self.io_threads, say=self._say)
        if resumed is None:
            return None
        self.step, self.consumed, self.last_loss = resumed.step, resumed.consumed, resumed.last_loss
        return resumed.where

    def _train_step(self, step: int) -> StepStats:
        """One optimizer step. Besides the wall time (equal on every rank: they wait for
        each other in the collectives) it measures the rank's busy time, the compute that
        is its own. On CPU that is the training thread's CPU time in the step: the compute
        runs on this thread (``set_num_threads(1)``), while a rank waiting in a gloo
        collective sleeps, and gloo's and the telemetry's threads are not counted (with
        the process's CPU time, equal ranks differed by up to 25 % on a loaded machine).
        Other devices report NaN until their kernel times are measured."""
        started = time.perf_counter()
        cpu_started = time.thread_time()
        model, config = self.model, self.config
        self._skip_data()
        first_sample = self.consumed
        spike = self.faults.spike_fault(first_sample, config.global_batch_size)
        scale = SPIKE_FACTOR if spike else 1.0
        if spike and self.ctx.is_main:
            self._fault_fired(spike, step, f"the data of step {step} (samples from {first_sample}) is bad: "
                                           f"loss x {SPIKE_FACTOR:g}")
        rows = torch.from_numpy(self.reader.rank_batch(self.consumed)).to(self.ctx.device)
        lr = lr_at(step, config=config.optimizer, total_steps=config.steps)
        set_lr(self.optimizer, lr)
        loss_sum = torch.zeros((), device=self.ctx.device)
        passes = self.batch.accumulation
        for i, micro in enumerate(torch.split(rows, self.batch.micro)):
            # Reduce-scatter gradients only once per step, after the last micro-batch.
            distributed.set_gradient_sync(model, i == passes - 1)
            logits = model(micro[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   micro[:, 1:].reshape(-1))
            if i == 0 and (nan := self.faults.poisons(step)):
                self._fault_fired(nan, step, f"the loss of step {step} turns NaN on rank {self.ctx.rank}")
                loss = loss * float("nan")
            if scale != 1.0:
                loss = loss * scale
            torch.autograd.backward(loss / passes)
            loss_sum += loss.detach()
        slowdown = self.faults.slowdown(step, self.ctx.rank, self.telemetry.identity.node)
        if slowdown != 1.0:  # a straggler drill: compute this step's work slowdown times over
            slow = next((f for f in self.faults.faults if f.action == "slow"),
                        Fault("slow", step, self.ctx.rank))
            self._fault_fired(slow, step,
                              f"node {self.telemetry.identity.node} computes at 1/{slowdown:g} speed")
            burn_cpu((slowdown - 1.0) * (time.thread_time() - cpu_started))
        # max_norm=inf measures the norm without clipping (scales gradients by exactly 1).
        max_norm = config.optimizer.grad_clip or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        self._fence()  # a save's copy made beside this step is done before the step changes the state
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        asked, self._save_asked = self._save_asked, False
        # One all-reduce (which also syncs the device): the loss, the SIGUSR1 flag, and the
        # parameters' squared norm.
        loss_total, asked_total, param_sq = distributed.global_sums(
            [loss_sum / passes, float(asked), distributed.local_square_sum(list(model.parameters()))],
            self.ctx.device)
        loss_value, self._save_asked_now = loss_total / self.ctx.world_size, asked_total > 0
        grad_norm_value = distributed.to_float(grad_norm)
        self.step, self.consumed = step, self.consumed + config.global_batch_size
        self.last_loss = loss_value
        elapsed = time.perf_counter() - started
        busy = time.thread_time() - cpu_started if self.ctx.device.type == "cpu" else math.nan
        tokens_per_s = config.global_batch_size * config.seq_len / elapsed
        return StepStats(loss=loss_value, grad_norm=grad_norm_value, lr=lr,
                         step_time_s=elapsed, tokens_per_s=tokens_per_s, first_sample=first_sample,
                         busy_s=busy, param_norm=math.sqrt(param_sq),
                         mfu=flops.mfu(tokens_per_s, self.flops_per_token, self.ctx.world_size,
                                       self.peak_tflops))

    def _skip_data(self) -> None:
        """Step over the sample ranges the config says to skip (data.skip)."""
        for start, end in self.config.data.skip:
            if start <= self.consumed < end:
                self._say(f"step {self.step + 1}: skipping samples {self.consumed} to {end} (data.skip)")
                self.consumed = end

    def _on_usr1(self, signum: int, frame: object) -> None:
        self._save_asked = True  # only a flag: the loop acts on it between steps

    def _validation_due(self) -> bool:
        every = self.config.validation_every_steps
        return self.validation is not None and (self.step % every == 0 or self.step == self.config.steps)

    @torch.no_grad()
    def _validate(self) -> float:
        """The mean next-token loss over the first ``validation_samples`` samples of the
        validation split, shared out over the ranks (rank r takes samples r, r + world,
        ...), the same number whatever the world size."""
        assert self.validation is not None
        count = min(self.config.validation_samples, self.validation.num_samples)
        mine = torch.arange(self.ctx.rank, count, self.ctx.world_size, dtype=torch.int64)
        total = torch.zeros((), device=self.ctx.device)
        micro = self.batch.micro
        # Every rank runs the same number of passes (FSDP2's all-gathers are collectives):
        # a rank with fewer samples runs its last passes on nothing but padding, unweighted.
        passes = math.ceil(math.ceil(count / self.ctx.world_size) / micro)
        for i in range(passes):
            indices = mine[i * micro:(i + 1) * micro]
            weight = len(indices)
            if not weight:
                indices = torch.zeros(1, dtype=torch.int64)
            rows = torch.from_numpy(self.validation.samples(indices.numpy())).to(self.ctx.device)
            logits = self.model(rows[:, :-1])
            losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                                     reduction="none").view(len(indices), -1).mean(dim=1)
            if weight:
                total += losses.sum()
        # Without a backward pass FSDP2 leaves the root's parameters (embedding, head)
        # gathered after the forward: give that memory back before training goes on.
        reshard = getattr(self.model, "reshard", None)
        if reshard is not None:
            reshard()
        summed = distributed.global_sums([total], self.ctx.device)[0]
        return summed / count

    def _report(self, s: StepStats) -> None:
        self.telemetry.step_completed(step=self.step, loss=s.loss, grad_norm=s.grad_norm,
                                      lr=s.lr, step_time_s=s.step_time_s,
                                      tokens_per_s=s.tokens_per_s, first_sample=s.first_sample,
                                      busy_s=s.busy_s, param_norm=s.param_norm, mfu=s.mfu,
                                      val_loss=s.val_loss)
        self.log.step(self.step, s)

    def _checkpoint_due(self) -> bool:
        every = self.config.checkpoint.every_steps
        return self.step == self.config.steps or (every > 0 and self.step % every == 0)

    def _memory_due(self) -> bool:
        every = self.config.checkpoint.memory_every_steps
        return (self.memory is not None and every > 0 and self.step % every == 0
                and self.step < self.config.steps and self.last_loss is not None
                and math.isfinite(self.last_loss))

    def _poll_background(self) -> None:
        """A background save that failed fails the attempt at the next step."""
        if self.memory is not None:
            self.memory.poll()
        self.saves.poll()

    def _save_to_memory(self) -> None:
        assert self.memory is not None
        meta = self._meta()
        with self._checkpoint_phase(self.memory.size):  # the wait for the previous save, and the copy
            self.memory.save(self.step, asdict(meta), self.model, self.optimizer, self._memory_whole)

    @contextlib.contextmanager
    def _checkpoint_phase(self, size: int = 0) -> Iterator[None]:
        """Training waits for checkpoint work (a save, the copy of one, the previous one
        still being written): the checkpoint phase, its allowance for ``size`` bytes at
        the pace the supervisor measured; then training again."""
        self.telemetry.set_phase(Phase.CHECKPOINT, self.step, size=size)
        try:
            yield
        finally:
            self.telemetry.set_phase(Phase.TRAIN, self.step)

    def _memory_whole(self, saved: memory_tier.Saved) -> None:
        """On the memory tier's thread: every rank's save of ``saved.step`` and its replica
        are in memory."""
        if self.ctx.is_main:
            where = memory_tier.resume_name(self.telemetry.identity.attempt, saved.step)
            self.telemetry.checkpoint_committed(step=saved.step, tier=TIER_MEMORY, path=where,
                                                duration_s=saved.blocking_s, total_s=saved.total_s,
                                                size=saved.size)
            self._say(f"memory checkpoint step {saved.step} whole in {saved.total_s:.3f} s "
                      f"(training blocked {saved.blocking_s:.3f} s)")

    def _meta(self) -> layout.TrainerMeta:
        config = self.config
        return layout.TrainerMeta(
            step=self.step, consumed_samples=self.consumed, world_size=self.ctx.world_size,
            model=config.model, model_shape=asdict(config.shape),
            config_digest=config_digest(config), last_loss=self.last_loss)

    def _save(self) -> None:
        if self.last_loss is None or not math.isfinite(self.last_loss):
            # A model that produced a NaN or infinite loss is not worth keeping: the
            # supervisor rolls back to the newest checkpoint before it.
            self._say(f"step {self.step}: loss {_fmt(self.last_loss)} is not finite: no checkpoint")
            return
        meta = self._meta()
        tamper = self.faults.tampers(self.step, self.ctx.rank)
        if tamper is not None:
            self._fault_fired(tamper, self.step, f"the checkpoint of step {self.step} is saved with one "
                                                 f"weight of rank {self.ctx.rank}'s shard changed")
        state = checkpoint.stage(self.model, self.optimizer, tamper=tamper is not None)
        with self._checkpoint_phase(checkpoint.state_bytes(state)):
            self.saves.save(meta, state)

    def _in_save(self, step: int, started: float, size: int) -> None:
        """Chaos drills between a save's writes and its commit: a rank killed there, or
        storage slower than this machine's (``slow-save``: the save waits out the time
        its ``size`` bytes take at the drill's pace)."""
        self.faults.in_save(step, self.ctx.rank, lambda fault, detail: self._fault_fired(fault, step, detail))
        slow = self.faults.save_pace(step)
        if slow is not None:
            fault, pace = slow
            self._fault_fired(fault, step, f"checkpoint saves are held to {pace / 1e6:g} MB/s per rank")
            time.sleep(max(0.0, size / pace - (time.monotonic() - started)))

    def _fault_fired(self, fault: Fault, step: int, detail: str) -> None:
        """A chaos drill's fault fired here: said in the log and on telemetry, once per
        fault and attempt (a spike's bad data is read step after step)."""
        key = fault.action if fault.action in ("spike", "slow") else str(fault)
        if key in self._injected:
            return
        self._injected.add(key)
        print_line(f"chaos: {fault} fired at step {step} on rank {self.ctx.rank}: {detail}")
        self.telemetry.fault_injected(action=str(fault), step=step, detail=detail)

    def _say(self, line: str) -> None:
        self.log.say(line)


def _stated_peak(device: torch.device, dtype: torch.dtype) -> float:
    """The device's peak TFLOP/s per rank, from trainer/flops.py's table (0: unknown)."""
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    if device.type == "cuda":
        peak = flops.gpu_peak_tflops(torch.cuda.get_device_name(device), name)
    else:
        peak = flops.cpu_peak_tflops(torch.get_num_threads())
    return peak or 0.0


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"

