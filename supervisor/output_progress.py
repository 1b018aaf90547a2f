"""Progress and fatal errors read from a trainer's own output, for trainers that send no
telemetry (a ``[command]``: the users' torchrun scripts, NxD, NxD Training / NeMo).

Each attempt's log files are read as they grow: ``rank-<r>...log`` holds rank r's
output, ``node-<k>...log`` a node's (launch "node": its torchrun's and its ranks'), and
its lines count as the node's first rank's. A line a progress pattern matches is a
step; it becomes the same ``StepMetrics`` message the reference trainer sends, applied
to the telemetry view, so that the same rules judge it: the adaptive hang limit (step
times are the time between two reads that saw new steps, divided by the steps between),
NaN or infinite losses, loss and grad-norm spikes (rank 0's lines), progress for goodput.

The patterns (``PATTERNS``): the spec's own ``progress_pattern`` first (named groups
``step``, and optionally ``loss`` and ``grad_norm``), then the formats the seeds' trainers
print out of the box.

Neuron's compiler lines (``COMPILING``) put the rank in its compile phase, which has its
own allowance (``compile_timeout_s``): a precompile pass or a graph compile of an hour is
not a hang.

A line a fatal signature matches (``fatal_signature``: Neuron runtime and hardware
errors, CUDA's uncorrectable ECC error, NCCL's errors) is kept as its rank's ``fatal``
line: when the attempt fails, attribution drains the node that printed a device error,
and names (without draining) one that printed an error of the collectives.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from health import neuron, nvidia
from health.model import Action, Status
from supervisor import user_files
from trainer import protocol as p

READ_MAX_BYTES = 1 << 20  # per file and poll: a burst of output is read over several ticks
_LINE_MAX = 64 << 10  # a longer "line" (a progress bar redrawn with \r, binary noise) is cut


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    pattern: re.Pattern[str]
    steps_done: int = 0  # added to the printed step: a 0-based counter's is one short


_NUM = r"[-+\w.]+"  # a printed number, "nan" and "inf" included

# Formats of the seeds' trainers, as their sources print them. ``steps_done`` is what the
# printed number is short of the steps completed (0-based counters).
PATTERNS: tuple[Format, ...] = (
    # awsome-distributed-training 3.test_cases/pytorch/FSDP (src/train.py), global rank 0
    # after each optimizer step: "Batch %d Loss: %.5f, Speed: %.2f samples/sec, lr: %.6f"
    # with the 0-based batch index.
    Format("fsdp-test-case", re.compile(rf"Batch (?P<step>\d+) Loss: (?P<loss>{_NUM}), Speed:"),
           steps_done=1),
    # neuronx-distributed's Llama examples (logger.py), the root rank: "LOG <asctime> -
    # (epoch, step) step_loss : %.4f learning_rate : ... throughput : ... [grad-norm : x]"
    Format("nxd", re.compile(rf"\(\d+, (?P<step>\d+)\) step_loss : (?P<loss>{_NUM})"
                             rf"(?:.*grad-norm : (?P<grad_norm>{_NUM}))?")),
    # neuronx-distributed's pipeline examples: "step N step_time Xs throughput ... step loss L grad norm G"
    Format("nxd-pp", re.compile(rf"\bstep (?P<step>\d+) step_time .*step loss (?P<loss>{_NUM})"
                                rf"(?: grad norm (?P<grad_norm>{_NUM}))?")),
    # NxD Training / NeMo: Lightning's progress bar postfix, where global_step (0-based)
    # is the step in progress: "reduced_train_loss=6.790, ..., global_step=3.000, ...,
    # gradient_norm=6.590]"
    Format("nemo", re.compile(r"reduced_train_loss=(?P<loss>[-+\w.]+?)[,\]].*?global_step=(?P<step>\d+)"
                              r"(?:\.\d+)?(?:.*?gradient_norm=(?P<grad_norm>[-+\w.]+?)[,\]])?"),
           steps_done=1),
)


# Errors a GPU job prints; Neuron's are health.neuron's table (the node probe's own).
_GPU_SIGNATURES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"uncorrectable ECC error encountered"), "device"),
    (re.compile(r"\bnccl(?:System|Internal|UnhandledCuda|Remote)Error\b|"
                r"Watchdog caught collective operation timeout"), "peer"),
)


def fatal_signature(line: str) -> str | None:
    """What a line says failed: "device" (this node's accelerator: drain it), "peer" (the
    collectives: this node or another; blame, never drain), or None."""
    for pattern, kind in _GPU_SIGNATURES:
        if pattern.search(line):
            return kind
    xid = nvidia.xid_rule(line) if "Xid" in line else None
    if xid is not None:  # the node's only where the Xid table drains it (not 13, 31, 43, 63, 94, ...)
        rule = xid[1]
        return "device" if rule.status is Status.UNHEALTHY and rule.action is not Action.NONE else None
    for sig in neuron.SIGNATURES:
        if sig.status is not Status.HEALTHY and sig.pattern.search(line):
            return "device" if sig.action is not Action.NONE else "peer"
    return None


@dataclass(frozen=True, slots=True)
class ProgressLine:
    step: int
    loss: float | None
    grad_norm: float | None


# Neuron compiling (torch-neuronx's compiler wrapper, a neuron_parallel_compile pass):
# the rank is in its compile phase, with its own allowance, until its next step.
COMPILING = re.compile(r"\|\|NEURON_CC_WRAPPER\|\|: Call compiler|\|\|NEURON_PARALLEL_COMPILE\|\||"
                       r"Compiler status PASS")


def parse_progress(line: str, formats: tuple[Format, ...]) -> ProgressLine | None:
    for f in formats:
        m = f.pattern.search(line)
        if m is None:
            continue
        groups = m.groupdict()
        try:
            step = int(float(groups["step"])) + f.steps_done
        except (KeyError, TypeError, ValueError):
            continue
        return ProgressLine(step, _number(groups.get("loss")), _number(groups.get("grad_norm")))
    return None


def formats_for(progress_pattern: str | None) -> tuple[Format, ...]:
    own = (Format("progress_pattern", re.compile(progress_pattern)),) if progress_pattern else ()
    return own + PATTERNS


def _number(text: str | None) -> float | None:
    """A printed number; "nan", "inf" and "-inf" as what they say (None: not printed)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(slots=True)
class _File:
    offset: int = 0
    partial: bytes = b""


@dataclass(frozen=True, slots=True)
class Fatal:
    kind: str  # "device" or "peer" (fatal_signature)
    line: str


@dataclass(slots=True)
class _Rank:
    step: int = 0
    step_read_at: float | None = None  # when the read that saw ``step`` happened


@dataclass(slots=True)
class AttemptOutput:
    """What was read so far of one attempt's output."""

    files: dict[str, _File] = field(default_factory=dict)
    ranks: dict[int, _Rank] = field(default_factory=dict)
    fatal: dict[int, Fatal] = field(default_factory=dict)  # rank -> its first fatal line
    phases: dict[int, str] = field(default_factory=dict)  # rank -> "compile" or "train", as its output says
    # When a progress line was last read, new step or not: a counter that starts again
    # (the FSDP test case's batch index, each epoch) still shows training going on.
    line_at: float | None = None

    @property
    def understood(self) -> bool:
        """Its lines say what the trainer does (steps, a compile): they, not any output, are progress."""
        return bool(self.phases)


@dataclass(frozen=True, slots=True)
class ReadStep:
    """A step read from the output, as the message the reference trainer would have sent
    (a NaN loss or a None grad norm where the line printed none), and which of loss and
    grad_norm it printed."""

    msg: p.StepMetrics
    printed: frozenset[str]


def read_output(state: AttemptOutput, log_dir: Path, *, run_id: str, attempt: int, ranks_per_node: int,
                formats: tuple[Format, ...], now: float) -> list[ReadStep]:
    """Read what the attempt's ranks wrote since the last call; the steps it shows, to
    apply to the telemetry view. Fatal lines are kept in ``state.fatal``, the phase the
    output shows in ``state.phases``."""
    out: list[ReadStep] = []
    try:
        names = sorted(os.listdir(log_dir))
    except OSError:
        return out
    for name in names:
        rank = _rank_of(name, ranks_per_node)
        if rank is None:
            continue
        lines = _new_lines(state.files.setdefault(name, _File()), log_dir / name)
        seen: list[ProgressLine] = []
        for line in lines:
            if (x := parse_progress(line, formats)) is not None:
                seen.append(x)
                state.phases[rank] = "train"
                state.line_at = now
            elif COMPILING.search(line):
                state.phases[rank] = "compile"
            if rank not in state.fatal and (kind := fatal_signature(line)) is not None:
                state.fatal[rank] = Fatal(kind, line.strip()[:500])
        r = state.ranks.setdefault(rank, _Rank())
        new = [x for x in seen if x.step > r.step]
        if not new:
            continue
        step_time = 0.0  # not timed: the first steps read (left out of the step-time p99)
        if r.step_read_at is not None and r.step > 0:
            step_time = (now - r.step_read_at) / (new[-1].step - r.step)
        for x in new:
            msg = p.StepMetrics(run=run_id, attempt=attempt, rank=rank, ts=now, step=x.step,
                                loss=math.nan if x.loss is None else x.loss,
                                grad_norm=x.grad_norm,
                                lr=math.nan, step_time_s=step_time, tokens_per_s=math.nan)
            printed = frozenset(k for k, v in (("loss", x.loss), ("grad_norm", x.grad_norm)) if v is not None)
            out.append(ReadStep(msg, printed))
        r.step, r.step_read_at = new[-1].step, now
    return out


def _rank_of(name: str, ranks_per_node: int) -> int | None:
    """``rank-0003.local-2.log`` -> 3; ``node-0001.local-2.log`` -> the node's first rank."""
    m = re.match(r"^(rank|node)-(\d+)\b.*\.log$", name)
    if m is None:
        return None
    index = int(m.group(2))
    return index if m.group(1) == "rank" else index * ranks_per_node


def _new_lines(f: _File, path: Path) -> list[str]:
    try:  # the run's user's file: never a link, a FIFO or a device (supervisor/user_files.py)
        data = user_files.read_bytes(path, READ_MAX_BYTES, offset=f.offset)
    except OSError:
        return []
    f.offset += len(data)
    data = f.partial + data
    *complete, f.partial = re.split(rb"[\r\n]", data)
    if len(f.partial) > _LINE_MAX:
        f.partial = b""
    return [line[:_LINE_MAX].decode(errors="replace") for line in complete if line]
