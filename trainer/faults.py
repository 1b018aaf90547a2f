"""Fault injection for tests and chaos drills, driven by one environment variable.

``TSUP_FAULT`` holds comma-separated faults ``ACTION@STEP`` or ``ACTION@STEP:RANK``
(all ranks when RANK is left out), acted on right after step STEP has completed (and
after its checkpoint, if one was due):

    hang@25        stop making progress but stay alive: the heartbeat thread keeps
                   reporting step 25, so only a step-progress timeout catches it
    crash@25:1     rank 1 raises InjectedFault: a caught error, exit code 1, Exit sent
    nan@60         the loss of step 60 becomes NaN before the backward pass, so the
                   gradients, the update and every later step are NaN: a numeric blow-up.
                   Transient: it fires once per run (a marker in ``TSUP_FAULT_STATE``, a
                   directory every attempt shares), so a rerun of step 60 is clean
    spike@60:30    the data of steps 60 to 89 (by the nominal stream position, samples
                   (60-1) x B up to (89) x B for global batch B) is bad: its loss is scaled
                   by SPIKE_FACTOR before the backward pass, every time that data is read,
                   in every attempt. Skipping that data window is the only cure
    device@50:1    rank 1's accelerator fails after step 50: it raises DeviceFault (exit
                   code 4). Once per run (a marker in ``TSUP_FAULT_STATE``): the device is
                   broken, not the step, so a rerun of step 50 on another node is clean
    kill-in-save@40:1
                   rank 1 SIGKILLs itself in the middle of the checkpoint save of step
                   40: its shards are written, the checkpoint is not committed yet. Once
                   per run (a marker in ``TSUP_FAULT_STATE``): a fault during a save
    tamper-ckpt@40 the checkpoint of step 40 holds one weight of rank 0's shard (or rank
                   RANK's) changed by 1e-3, the live model untouched: a checkpoint that
                   loads, but not as saved (a silent corruption). Once per run
    slow@40:1      from step 40 on, the node of rank 1 computes at half speed: each of
                   its ranks burns as much CPU again as its step took (SLOW_FACTOR), a
                   straggler. The node stays slow for the rest of the run (a marker in
                   ``TSUP_FAULT_STATE`` names it), so a later attempt on it is slow from
                   its first step; an attempt on other nodes is not. Rank 0 by default
    slow-save@10:40
                   from step 10 on, every persistent checkpoint save (synchronous or in
                   the background) is held to 40 MB/s per rank (SLOW_SAVE_MB_S when left
                   out): a rank whose share is written sooner waits out the rest before
                   the commit, as on slow or busy storage. In every attempt
    hold@75        every rank waits up to HOLD_S after step 75 before the next: a drill's
                   fault from outside (the supervisor's ``--chaos kill-node@75``, which
                   adds it) lands at its step, not steps later or never because a busy
                   supervisor heard of step 75 late. Once per run: the attempt that first
                   completes step 75 holds (a marker in ``TSUP_FAULT_STATE`` names it),
                   the attempt that resumes after the fault goes through

Unset means no faults. A fault fires in whichever attempt completes STEP, so an attempt
that resumes from a checkpoint before STEP meets it again unless TSUP_FAULT is cleared
(``nan`` excepted).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from wire.errors import DeviceFault, UsageError

_ACTIONS = ("hang", "crash", "nan", "spike", "slow", "device", "kill-in-save", "tamper-ckpt", "slow-save",
            "hold")
SPIKE_FACTOR = 8.0
_AFTER_STEP = ("crash", "hang", "device", "hold")  # the actions after_step takes
SLOW_FACTOR = 2.0
SLOW_SAVE_MB_S = 40
_SLOW_MARKER = "slow-node"
HOLD_S = 5.0  # how long a hold waits for the supervisor's fault (its tick is 0.25 s)


class InjectedFault(RuntimeError):
    """Raised by a ``crash`` fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    action: str
    step: int
    rank: int | None  # None: every rank; for spike, the window's length in steps; for slow-save, MB/s

    def __str__(self) -> str:
        return f"{self.action}@{self.step}" + (f":{self.rank}" if self.rank is not None else "")


# Told of every fault as it fires (the trainer publishes it: protocol.FaultInjected):
# report(fault, detail).
Report = Callable[[Fault, str], None]


def _ignore(_fault: Fault, _detail: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class FaultPlan:
    faults: tuple[Fault, ...] = ()
    state_dir: Path | None = None  # where a once-per-run fault leaves its marker
    attempt: str = "1"  # TSUP_ATTEMPT: which attempt a hold's marker belongs to

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FaultPlan:
        spec = environ.get("TSUP_FAULT", "").strip()
        plan = cls.parse(spec) if spec else cls()
        state = environ.get("TSUP_FAULT_STATE", "").strip()
        return cls(plan.faults, Path(state) if state else None, environ.get("TSUP_ATTEMPT", "1"))

    def spike_fault(self, first_sample: int, global_batch: int) -> Fault | None:
        """The ``spike`` whose bad data the batch that starts at ``first_sample`` is."""
        for f in self.faults:
            if f.action == "spike":
                start = (f.step - 1) * global_batch
                if start <= first_sample < start + (f.rank or 1) * global_batch:
                    return f
        return None

    def slowdown(self, step: int, rank: int, node: str) -> float:
        """How much slower this rank computes at this step (1.0: normal speed, ``slow``).

        The rank the fault names turns its node slow (the marker in ``state_dir`` names
        the node); from then on the node is slow, whichever ranks run on it."""
        marker = self.state_dir / _SLOW_MARKER if self.state_dir is not None else None
        if marker is not None and marker.is_file():
            return SLOW_FACTOR if marker.read_text() == node else 1.0
        for f in self.faults:
            if f.action == "slow" and step >= f.step and rank == (f.rank or 0):
                if marker is not None:
                    _claim(marker, node)
                return SLOW_FACTOR
        return 1.0

    def poisons(self, step: int) -> Fault | None:
        """The ``nan@STEP`` that turns this step's loss NaN, if any: on the first rank to
        claim the run's marker only; the gradients' all-reduce carries it to every rank."""
        fault = next((f for f in self.faults if f.action == "nan" and f.step == step), None)
        if fault is None or (self.state_dir is not None and not _claim(self.state_dir / f"nan@{step}", "")):
            return None
        return fault

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        faults = []
        for item in spec.split(","):
            action, _, where = item.strip().partition("@")
            step_text, _, rank_text = where.partition(":")
            try:
                step = int(step_text)
                rank = int(rank_text) if rank_text else None
            except ValueError:
                step = -1
                rank = None
            if action not in _ACTIONS or step < 0:
                raise UsageError(f"TSUP_FAULT: expected ACTION@STEP[:RANK] with ACTION one "
                                 f"of {', '.join(_ACTIONS)}, got {item!r}")
            faults.append(Fault(action, step, rank))
        return cls(tuple(faults))

    def in_save(self, step: int, rank: int, report: Report = _ignore) -> None:
        """Called by the save of step ``step`` between writing this rank's shards and the
        commit: a ``kill-in-save`` for this step and rank SIGKILLs the process here."""
        for fault in self.faults:
            if fault.action != "kill-in-save" or fault.step != step or fault.rank not in (None, rank):
                continue
            if self.state_dir is not None and not _claim(self.state_dir / f"kill-in-save@{step}", str(rank)):
                continue
            report(fault, f"rank {rank} is killed (SIGKILL) in the middle of the save of step {step}")
            time.sleep(0.5)  # the telemetry thread publishes the report before the process goes
            os.kill(os.getpid(), signal.SIGKILL)

    def save_pace(self, step: int) -> tuple[Fault, float] | None:
        """The ``slow-save`` that holds the save of ``step`` to a pace, with that pace in
        bytes per second per rank; None when saves run at the storage's own pace."""
        for fault in self.faults:
            if fault.action == "slow-save" and step >= fault.step:
                return fault, (fault.rank or SLOW_SAVE_MB_S) * 1e6
        return None

    def tampers(self, step: int, rank: int) -> Fault | None:
        """A ``tamper-ckpt`` for the save of this step on this rank (rank 0 by default),
        once per run."""
        for fault in self.faults:
            if fault.action != "tamper-ckpt" or fault.step != step or (fault.rank or 0) != rank:
                continue
            if self.state_dir is None or _claim(self.state_dir / f"tamper-ckpt@{step}", str(rank)):
                return fault
        return None

    def after_step(self, step: int, rank: int, report: Report = _ignore) -> None:
        """Act on the faults planned for this step and rank (may never return), telling
        ``report`` first."""
        for fault in self.faults:
            if fault.step != step or fault.rank not in (None, rank) or fault.action not in _AFTER_STEP:
                continue
            if fault.action == "crash":
                error: Exception = InjectedFault(f"injected crash after step {step} on rank {rank}")
                report(fault, str(error))
                raise error
            if fault.action == "device":
                if self.state_dir is None or _claim(self.state_dir / f"device@{step}", str(rank)):
                    error = DeviceFault(f"injected: CUDA error: uncorrectable ECC error encountered "
                                        f"after step {step} on rank {rank}")
                    report(fault, str(error))
                    raise error
                continue
            if fault.action == "hold":
                if self._holds(step):
                    print(f"chaos: holding after step {step} for up to {HOLD_S:g} s: a fault from "
                          "outside is due at this step", flush=True)
                    time.sleep(HOLD_S)
                continue
            report(fault, f"rank {rank} hangs after step {step}")
            while True:  # hang: the training thread sleeps, the heartbeat thread goes on
                time.sleep(3600)

    def _holds(self, step: int) -> bool:
        """Whether this attempt holds after ``step``: every rank of the attempt that first
        got there does (whichever rank claimed the marker wrote its attempt in it)."""
        if self.state_dir is None:
            return True
        marker = self.state_dir / f"hold@{step}"
        if _claim(marker, self.attempt):
            return True
        for _ in range(50):  # the claimer writes its attempt just after creating the file
            try:
                text = marker.read_text()
            except OSError:
                return False
            if text:
                return text == self.attempt
            time.sleep(0.01)
        return False


def _claim(marker: Path, text: str) -> bool:
    """Create ``marker`` holding ``text``; False when another process got there first."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return True


def burn_cpu(seconds: float) -> None:
    """Spin for ``seconds`` of this thread's CPU time (a slow device, for drills)."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass
