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
print out of the box, last the training progress bar of NxD Training and NeMo (Lightning's
tqdm bar, ``parse_progress_bar``): its step, its rate as the step time (the trainer's own
timing, so a first step of ten minutes sets the hang limit before a second is read), the
loss and grad norm of its postfix.

Neuron's compiler lines (``COMPILING``) put the rank in its compile phase, which has its
own allowance (``compile_timeout_s``): a precompile pass or a graph compile of an hour is
not a hang.

A line a fatal signature matches (``fatal_signature``: Neuron runtime and hardware
errors, CUDA's uncorrectable ECC error, NCCL's errors, errors of the job's configuration)
is kept as its rank's ``fatal`` line: when the attempt fails, attribution drains the node
that printed a device error, names (without draining) one that printed an error of the
collectives, and fails the run at once on a configuration error.

A tick's read is bounded: at most ``READ_MAX_BYTES`` a file and ``READ_BUDGET_S`` an
attempt (the files left go first next tick), every pattern linear in the line
(supervisor/linear_match.py). How far each file was read is kept in the store every
``OFFSETS_EVERY_S`` (``AttemptOutput.offsets``, ``resume``): a restarted daemon reads on
from there, not from the start of weeks of output.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import wire as p
from health import neuron, nvidia
from health.model import Action, Status
from supervisor import user_files
from supervisor.linear_match import PatternSet

READ_MAX_BYTES = 1 << 20  # per file and poll: a burst of output is read over several ticks
READ_BUDGET_S = 0.25  # per attempt and poll: the files left unread are read first next tick
MAX_FILES = 8192  # logs of an attempt read (a rank's or a node's each): more are not looked at
OFFSETS_EVERY_S = 30.0  # how often the offsets read so far are kept in the store
_LINE_MAX = 64 << 10  # a longer "line" (a progress bar redrawn with \r, binary noise) is cut


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    pattern: str  # matched by RE2 (supervisor/linear_match.py)
    steps_done: int = 0  # added to the printed step: a 0-based counter's is one short


_NUM = r"[-+\w.]+"  # a printed number, "nan" and "inf" included

# Formats of the seeds' trainers, as their sources print them. ``steps_done`` is what the
# printed number is short of the steps completed (0-based counters).
SEED_FORMATS: tuple[Format, ...] = (
    # awsome-distributed-training 3.test_cases/pytorch/FSDP (src/train.py), global rank 0
    # after each optimizer step: "Batch %d Loss: %.5f, Speed: %.2f samples/sec, lr: %.6f"
    # with the 0-based batch index.
    Format("fsdp-test-case", rf"Batch (?P<step>\d+) Loss: (?P<loss>{_NUM}), Speed:", steps_done=1),
    # neuronx-distributed's Llama examples (logger.py), the root rank: "LOG <asctime> -
    # (epoch, step) step_loss : %.4f learning_rate : ... throughput : ... [grad-norm : x]"
    Format("nxd", rf"\(\d+, (?P<step>\d+)\) step_loss : (?P<loss>{_NUM})"
                  rf"(?:.*grad-norm : (?P<grad_norm>{_NUM}))?"),
    # neuronx-distributed's pipeline examples: "step N step_time Xs throughput ... step loss L grad norm G"
    Format("nxd-pp", rf"\bstep (?P<step>\d+) step_time .*step loss (?P<loss>{_NUM})"
                     rf"(?: grad norm (?P<grad_norm>{_NUM}))?"),
)

# NxD Training / NeMo (PyTorch Lightning): the training loop's tqdm progress bar, redrawn
# with \r into the job's output (seed 003's llama.out):
#   "Epoch 0:  11%|█         | 10/91 [1:44:15<14:04:32, 625.59s/it]"
# then, once metrics are logged to the bar, tqdm's postfix ", key=value, ..." inside the
# brackets. With no known total tqdm prints "Epoch 0: 10it [1:44:15, 625.59s/it]"; a
# bar_format without the rate (NeMo's) prints none. The rate is tqdm's "{rate:5.2f}it/s",
# or "s/it" when a step takes over a second; Lightning 2's bar always prints it/s, so a
# slow step is "0.02it/s" there ("18.79s/it" with Lightning 1.8, NxD Training before 2.23).
# The count is the batch within the epoch (one batch is one optimizer step in NxD Training's
# data modules), starting again each epoch. Only the training bar, "Epoch N": a validation
# bar or a data set's "Map: 100%|..." is not a step.
_BAR = (
    r"\bEpoch (?P<epoch>\d+)[^:|\[]*: *"
    r"(?:\d+%\|[^|]*\| *(?P<n>\d+)/(?P<total>\d+|\?)|(?P<count>\d+)it)"
    r" \[(?:\d+:)*\d+(?:<(?:(?:\d+:)*\d+|\?))?"
    r"(?:, *(?:(?P<rate>\d+(?:\.\d+)?)|\?)(?P<unit>s/it|it/s))?"
    r"(?P<postfix>, [^\]]*)?\]")
# The postfix's values as Lightning writes them: tqdm's format_num ("{:.3g}" where that is
# shorter, so 2000.0 is "2e+3" and 12000.0 "1.2e+4"), padded with zeros ("6.790").
_POSTFIX_ITEM = re.compile(r"(?:^|, )(?P<key>[\w./-]+)=(?P<value>[^,\]]*)")
_STEP_KEYS = ("global_step",)  # NeMo's: 0-based, the step in progress
_LOSS_KEYS = ("reduced_train_loss", "train_loss", "loss")
_GRAD_NORM_KEYS = ("gradient_norm", "grad_norm")


# Errors a GPU job prints; Neuron's are health.neuron's table (the node probe's own).
_GPU_SIGNATURES: tuple[tuple[str, str], ...] = (
    (r"uncorrectable ECC error encountered", "device"),
    (r"\bnccl(?:System|Internal|UnhandledCuda|Remote)Error\b|"
     r"Watchdog caught collective operation timeout", "peer"),
)


# Errors of the job's own configuration: the same on any node and in every attempt, so the
# run fails at the first one, with the trainer's words, instead of being relaunched into it.
# Errors that one node's setup may cause (a missing library, FI_EFA_FORK_SAFE, the
# open-files limit) are not here: another node may not have them.
_CONFIG_SIGNATURES: tuple[str, ...] = (
    # Neuron's collectives: the TP/DP layout's replica groups do not fit the devices (seed
    # 003, DP 2 x TP 16 on one trn1.32xlarge: "ERROR   ENC:enc_init_comm   [rank 0] failed (2)
    # to init a collective algorithm for provided replica group.")
    r"failed \(\d+\) to init a collective algorithm",
    # Hydra (NxD Training's and NeMo's configs): CONF_FILE names no config
    r"\bCannot find primary config\b",
    # NxD Training's examples/train.sh, the same: "Error: YAML file './conf/X.yaml' not found!"
    r"^Error: YAML file '.*' not found!$",
    # neuronx-distributed's and Megatron's ensure_divisibility: a model dimension that the
    # tensor-parallel degree does not divide ("{} is not divisible by {}")
    r"AssertionError: \d+ is not divisible by \d+",
)


@dataclass(frozen=True, slots=True)
class ProgressLine:
    step: int
    loss: float | None
    grad_norm: float | None
    step_time_s: float | None = None  # where the line prints a rate (a progress bar's s/it)


# Neuron compiling (torch-neuronx's compiler wrapper, a neuron_parallel_compile pass):
# the rank is in its compile phase, with its own allowance, until its next step.
# NxD Training's tutorials show the parallel compile's lines as "||NEURON_PARALLEL_COMPILE||"
# and as "||PARALLEL_COMPILE||".
COMPILING = (r"\|\|NEURON_CC_WRAPPER\|\|: (?:Call compiler|Extracting graphs)|"
             r"\|\|(?:NEURON_)?PARALLEL_COMPILE\|\||Compiler status PASS")


class OutputPatterns:
    """Every pattern a line of output is tried against, as one set (supervisor/linear_match.py):
    the progress formats (the spec's own first), the progress bar, the compile lines, the
    fatal signatures (the job's configuration's, the GPU's, Xids, Neuron's table)."""

    def __init__(self, formats: tuple[Format, ...]) -> None:
        self.formats = formats
        patterns = [f.pattern for f in formats]
        self._bar, self._compiling = len(patterns), len(patterns) + 1
        patterns += [_BAR, COMPILING]
        self._config = range(len(patterns), len(patterns) + len(_CONFIG_SIGNATURES))
        patterns += _CONFIG_SIGNATURES
        self._gpu = {len(patterns) + i: kind for i, (_, kind) in enumerate(_GPU_SIGNATURES)}
        patterns += [pattern for pattern, _ in _GPU_SIGNATURES]
        self._xid, self._xid_plain = len(patterns), len(patterns) + 1
        patterns += [nvidia.XID_PATTERN, nvidia.XID_PLAIN_PATTERN]
        self._neuron = {len(patterns) + i: sig for i, sig in enumerate(_NEURON)}
        patterns += [sig.pattern.pattern for sig in _NEURON]
        self._set = PatternSet(patterns)

    def read(self, line: str) -> tuple[ProgressLine | None, bool, str | None]:
        """What ``line`` says: (the step it shows, whether it is a compile line, the fatal
        signature it matches: see ``fatal_signature``)."""
        hits = self._set.matching(line)
        if not hits:
            return None, False, None
        return self._progress(line, hits), self._compiling in hits, self._fatal(line, hits)

    def _progress(self, line: str, hits: frozenset[int]) -> ProgressLine | None:
        for i, f in enumerate(self.formats):
            if i not in hits:
                continue
            groups = self._set.search(i, line).groupdict()
            try:
                step = int(float(groups["step"])) + f.steps_done
            except (KeyError, TypeError, ValueError):
                continue
            return ProgressLine(step, _number(groups.get("loss")), _number(groups.get("grad_norm")))
        return _bar_step(self._set.search(self._bar, line).groupdict()) if self._bar in hits else None

    def _fatal(self, line: str, hits: frozenset[int]) -> str | None:
        if any(i in hits for i in self._config):
            return "config"
        for i, kind in self._gpu.items():
            if i in hits:
                return kind
        xid = self._xid if self._xid in hits else self._xid_plain if self._xid_plain in hits else None
        if xid is not None:  # the node's only where the Xid table drains it (not 13, 31, 43, 63, 94, ...)
            groups = self._set.search(xid, line).groups()
            rule = nvidia.xid_of(int(groups[-2]), groups[-1])
            return "device" if rule.status is Status.UNHEALTHY and rule.action is not Action.NONE else None
        for i, sig in self._neuron.items():
            if i in hits:
                return "device" if sig.action is not Action.NONE else "peer"
        return None


# Neuron's signatures that are errors (health.neuron's table, the node probe's own).
_NEURON = tuple(sig for sig in neuron.SIGNATURES if sig.status is not Status.HEALTHY)


def parse_progress(line: str, patterns: OutputPatterns) -> ProgressLine | None:
    """The step a line shows: the spec's own pattern and the seeds' formats first, then a
    Lightning progress bar."""
    return patterns.read(line)[0]


def fatal_signature(line: str, patterns: OutputPatterns | None = None) -> str | None:
    """What a line says failed: "config" (the job's configuration: no restart can fix it),
    "device" (this node's accelerator: drain it), "peer" (the collectives: this node or
    another; blame, never drain), or None."""
    return (patterns or PATTERNS).read(line)[2]


def _bar_step(bar: dict[str, str | None]) -> ProgressLine | None:
    """A Lightning progress bar's redraw (``_BAR``'s groups) as a step: NeMo's ``global_step`` where
    the postfix has it (it counts across epochs and resumes), else the bar's count, made
    global with its epoch where the bar knows the epoch's length. A bar at 0 without a
    ``global_step`` is none: Lightning resets its bar to 0 at each epoch's start, a resumed
    run's too, before it jumps to the batch it resumes at (``Epoch 1: 0/16``, then 15/16)."""
    postfix = {x["key"]: x["value"].strip() for x in _POSTFIX_ITEM.finditer(bar["postfix"] or "")}
    step: int | None = None
    for key in _STEP_KEYS:
        if (value := _number(postfix.get(key))) is not None and math.isfinite(value):
            step = round(value) + 1
            break
    if step is None:
        count = int(bar["n"] or bar["count"] or 0)
        if count == 0:
            return None
        epoch, total = bar["epoch"], bar["total"]
        step = count + (int(epoch) * int(total) if epoch and total and total != "?" else 0)
    return ProgressLine(step, _first_number(postfix, _LOSS_KEYS), _first_number(postfix, _GRAD_NORM_KEYS),
                        _step_time(bar["rate"], bar["unit"]))


def _first_number(postfix: dict[str, str], keys: tuple[str, ...]) -> float | None:
    return next((x for k in keys if (x := _number(postfix.get(k))) is not None), None)


def _step_time(rate: str | None, unit: str | None) -> float | None:
    """The longest step time a printed rate allows ("0.02it/s" is anything from 0.015 to
    0.025 it/s): a hang limit built on it may be long, never short."""
    if rate is None or unit is None:
        return None
    half = 0.5 * 10.0 ** -len(rate.partition(".")[2])
    if unit == "s/it":
        return float(rate) + half
    return 1.0 / (float(rate) - half) if float(rate) > half else None


@functools.lru_cache(maxsize=64)
def formats_for(progress_pattern: str | None) -> OutputPatterns:
    """The patterns of a run whose spec says ``progress_pattern`` (checked by the spec: one RE2 runs)."""
    if not progress_pattern:
        return PATTERNS
    return OutputPatterns((Format("progress_pattern", progress_pattern), *SEED_FORMATS))


def _number(text: str | None) -> float | None:
    """A printed number; "nan", "inf" and "-inf" as what they say (None: not printed)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


PATTERNS = OutputPatterns(SEED_FORMATS)


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
    turn: int = 0  # the file a read begins with: one that ran out of time goes first next tick

    def offsets(self) -> dict[str, int]:
        """How far each file was read, to the end of its last whole line: what a restarted
        daemon reads on from (``resume``)."""
        return {name: f.offset - len(f.partial) for name, f in self.files.items()}

    def resume(self, offsets: str) -> None:
        """Read on from ``offsets`` (``offsets()`` as JSON, kept in the store), not from the
        start: a restarted daemon neither re-reads weeks of output nor replays its steps.
        What is not such a JSON object of at most ``MAX_FILES`` names is ignored."""
        try:
            kept = json.loads(offsets)
        except ValueError:
            return
        if not isinstance(kept, dict) or len(kept) > MAX_FILES:
            return
        for name, offset in kept.items():
            if isinstance(name, str) and isinstance(offset, int) and offset >= 0:
                self.files.setdefault(name, _File(offset=offset))

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
                formats: OutputPatterns, now: float, base: Path | None = None,
                budget_s: float = READ_BUDGET_S, reader: user_files.Reader = user_files.HERE,
                ) -> list[ReadStep]:
    """Read what the attempt's ranks wrote since the last call; the steps it shows, to
    apply to the telemetry view. Fatal lines are kept in ``state.fatal``, the phase the
    output shows in ``state.phases``. Files are read until ``budget_s`` is spent; the
    next call begins with the first one left unread. ``reader``: who reads them (the
    run's user's worker, supervisor/runfiles/user_tree.py; here by default), from ``base`` (the
    daemon's directory above) without following a link below it."""
    out: list[ReadStep] = []
    deadline = time.monotonic() + budget_s
    try:
        names = reader.listdir(base, log_dir)
    except OSError:
        return out
    ranked = [(name, rank) for name in names
              if (rank := _rank_of(name, ranks_per_node)) is not None][:MAX_FILES]
    first = state.turn % len(ranked) if ranked else 0
    for i, (name, rank) in enumerate(ranked[first:] + ranked[:first]):
        if i and time.monotonic() > deadline:
            state.turn = first + i  # the rest first, next tick
            break
        lines = _new_lines(state.files.setdefault(name, _File()), log_dir / name, base, reader)
        seen: list[ProgressLine] = []
        for line in lines:
            x, compiling, kind = formats.read(line)
            if x is not None:
                seen.append(x)
                state.phases[rank] = "train"
                state.line_at = now
            elif compiling:
                state.phases[rank] = "compile"
            if kind is not None and _outranks(kind, state.fatal.get(rank)):
                state.fatal[rank] = Fatal(kind, line.strip()[:500])
        r = state.ranks.setdefault(rank, _Rank())
        new = [x for x in seen if x.step > r.step]
        if not new:
            continue
        read_pace = 0.0  # not timed: the first steps read (left out of the step-time p99)
        if r.step_read_at is not None and r.step > 0:
            read_pace = (now - r.step_read_at) / (new[-1].step - r.step)
        for x in new:  # a rate the line prints is the trainer's own timing: it comes first
            msg = p.StepMetrics(run=run_id, attempt=attempt, rank=rank, ts=now, step=x.step,
                                loss=math.nan if x.loss is None else x.loss,
                                grad_norm=x.grad_norm, lr=math.nan,
                                step_time_s=read_pace if x.step_time_s is None else x.step_time_s,
                                tokens_per_s=math.nan)
            printed = frozenset(k for k, v in (("loss", x.loss), ("grad_norm", x.grad_norm)) if v is not None)
            out.append(ReadStep(msg, printed))
        r.step, r.step_read_at = new[-1].step, now
    return out


def _outranks(kind: str, kept: Fatal | None) -> bool:
    """A rank's first fatal line is kept, unless a configuration error follows the errors
    of the collectives it caused (Neuron prints "failed to init ENC comm" and the like
    around the layout's own error)."""
    return kept is None or (kind == "config" and kept.kind == "peer")


def _rank_of(name: str, ranks_per_node: int) -> int | None:
    """``rank-0003.local-2.log`` -> 3; ``node-0001.local-2.log`` -> the node's first rank."""
    m = re.match(r"^(rank|node)-(\d+)\b.*\.log$", name)
    if m is None:
        return None
    index = int(m.group(2))
    return index if m.group(1) == "rank" else index * ranks_per_node


def _new_lines(f: _File, path: Path, base: Path | None, reader: user_files.Reader) -> list[str]:
    try:  # the run's user's file: never a link, a FIFO or a device (supervisor/user_files.py)
        data = reader.read_bytes(path, READ_MAX_BYTES, base=base, offset=f.offset)
    except user_files.TreeStalled:
        raise  # not an answer: the tick's error, read again next tick
    except OSError:
        return []
    f.offset += len(data)
    data = f.partial + data
    *complete, f.partial = re.split(rb"[\r\n]", data)
    if len(f.partial) > _LINE_MAX:
        f.partial = b""
    return [line[:_LINE_MAX].decode(errors="replace") for line in complete if line]
