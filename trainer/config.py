"""The trainer's configuration: nested dataclasses validated on construction (stdlib only).

``python -m trainer --check-config FILE`` goes through this module without importing
torch, so it must stay stdlib only (plus wire, trainer.shapes and trainer.neuron.config).

A config file is TOML (``.toml``) or JSON (``.json``) whose tables mirror the
dataclasses below; every key is optional. Loading collects every problem it finds, one
line each, prefixed with the dotted key path::

    optimizer.lr: expected a positive number, got -1
    unknown key 'optimizr' (did you mean 'optimizer'?)

Relative paths (``checkpoint.dir``, ``output_dir``, ``data.path``) are relative to the
trainer process's working directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, cast, get_args, get_origin, get_type_hints

from trainer.config_checks import is_number, need_choice, need_int, need_number, raise_if, skip_ranges
from trainer.neuron.config import NeuronConfig
from trainer.shapes import SHAPES, ModelShape
from wire.batch import BatchLayout, split_batch
from wire.errors import ConfigError

# ---- the config tree ----------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW with linear warm-up then cosine decay to ``min_lr`` at the last step.

    The defaults are the seeds' Llama pre-training recipe: lr 3e-4 -> 3e-5, 2000
    warm-up steps, weight decay 0.1, betas (0.9, 0.95), eps 1e-5, grad clip 1.0. A config
    file (config_from_dict) of the ``tiny`` model gets tiny_defaults instead for the keys
    it leaves out: a 10x larger lr and a short warm-up, which suit a 0.1 M parameter model
    and runs of a few hundred steps (2000 warm-up steps would be longer than the run).
    """

    lr: float = 3e-4  # peak learning rate, reached at the end of warm-up
    min_lr: float = 3e-5  # learning rate at the last step
    warmup_steps: int = 2000
    weight_decay: float = 0.1  # applied to matrices and embeddings, not to norm weights
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-5
    grad_clip: float = 1.0  # max global L2 norm of the gradients; 0 disables clipping

    def __post_init__(self) -> None:
        p: list[str] = []
        need_number(p, "lr", self.lr, positive=True)
        need_number(p, "min_lr", self.min_lr, minimum=0.0)
        if not p and self.min_lr > self.lr:
            p.append(f"min_lr: must not exceed lr {self.lr}, got {self.min_lr}")
        need_int(p, "warmup_steps", self.warmup_steps, 0)
        need_number(p, "weight_decay", self.weight_decay, minimum=0.0)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            p.append(f"betas: expected two numbers, got {self.betas!r}")
        else:
            for i, beta in enumerate(self.betas):
                need_number(p, f"betas[{i}]", beta, minimum=0.0, below=1.0)
        need_number(p, "eps", self.eps, positive=True)
        need_number(p, "grad_clip", self.grad_clip, minimum=0.0)
        raise_if(p)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where training samples come from.

    ``synthetic``: ``num_samples`` sequences drawn from a Markov chain seeded by the run's
    ``seed``: nothing is downloaded, and the loss falls because the chain is learnable.
    ``tokens``: a flat binary file of token ids (``dtype``, native byte order), cut into
    windows of ``seq_len + 1`` tokens that overlap by one token.
    ``arrow``: a data set directory written by Hugging Face ``Dataset.save_to_disk`` (or
    of ``*.arrow`` files) whose ``column`` (default ``input_ids``) holds each document's
    token ids. ``text``: the same with raw text (``column`` default ``text``), tokenized
    at start with the ``tokenizer.json`` at ``tokenizer``. Both pack the documents in
    order, ``eos_id`` after each non-empty one (for ``text``, default: the tokenizer's
    end-of-text token; for ``arrow``, none: such sets usually end documents with EOS
    already), into windows that overlap by one token (trainer/packing.py).
    ``streaming``: read an ``arrow`` or ``text`` set in order without indexing it first,
    shuffling blocks of ``shuffle_block`` samples instead of whole epochs.

    Validation data, never trained on: ``validation_path`` (a set of the same kind), or
    the last ``validation_fraction`` of the samples (not with ``streaming``).
    Relative paths are relative to the trainer's working directory.
    """

    kind: str = "synthetic"
    path: str | None = None  # the token file, or the data set directory (arrow, text)
    dtype: str = "uint16"  # element type of the token file: "uint16" or "uint32"
    num_samples: int = 4096  # size of the synthetic data set, in sequences
    column: str | None = None  # the documents' column (arrow, text); None: the kind's default
    tokenizer: str | None = None  # tokenizer.json, or a directory holding one (text)
    eos_id: int | None = None  # token id put after every document (arrow, text)
    streaming: bool = False  # arrow, text: read in order, no index (trainer/packing.py)
    shuffle_block: int = 1024  # streaming: samples shuffled together
    validation_path: str | None = None  # held-out data of the same kind as path
    validation_fraction: float = 0.0  # or: this share of the samples, from the end
    # Sample ranges [start, end) of the data stream to step over (the supervisor's data
    # window skip after a loss spike, as PaLM did); positions are samples consumed.
    skip: Any = ()

    def __post_init__(self) -> None:
        p: list[str] = []
        self.skip = skip_ranges(p, self.skip)
        need_choice(p, "kind", self.kind, ("synthetic", "tokens", "arrow", "text"))
        need_choice(p, "dtype", self.dtype, ("uint16", "uint32"))
        need_int(p, "num_samples", self.num_samples, 1)
        documents = self.kind in ("arrow", "text")
        kind = self.kind if self.kind in ("synthetic", "tokens", "arrow", "text") else None
        self._check_path(p, "path", self.path, needed=self.kind != "synthetic", kind=kind,
                         used_by=("tokens", "arrow", "text"))
        self._check_path(p, "tokenizer", self.tokenizer, needed=self.kind == "text", kind=kind,
                         used_by=("text",))
        if self.column is not None and (not isinstance(self.column, str) or not self.column):
            p.append(f"column: expected a column name, got {self.column!r}")
        elif self.column is not None and not documents:
            p.append("column: only used when kind is 'arrow' or 'text'")
        if self.eos_id is not None:
            need_int(p, "eos_id", self.eos_id, 0)
            if not documents:
                p.append("eos_id: only used when kind is 'arrow' or 'text'")
        if not isinstance(self.streaming, bool):
            p.append(f"streaming: expected true or false, got {self.streaming!r}")
        elif self.streaming and not documents:
            p.append("streaming: only possible when kind is 'arrow' or 'text'")
        need_int(p, "shuffle_block", self.shuffle_block, 1)
        self._check_path(p, "validation_path", self.validation_path, needed=False, kind=kind,
                         used_by=("tokens", "arrow", "text"))
        need_number(p, "validation_fraction", self.validation_fraction, minimum=0.0, below=1.0)
        if self.validation_fraction and self.validation_path is not None:
            p.append("validation_fraction: set validation_path or validation_fraction, not both")
        elif self.validation_fraction and self.streaming is True:
            p.append("validation_fraction: not possible with streaming (the set's size is "
                     "unknown); use validation_path")
        raise_if(p)

    def document_column(self) -> str:
        """The column an arrow or text data set is read from."""
        return self.column or ("text" if self.kind == "text" else "input_ids")

    @staticmethod
    def _check_path(problems: list[str], key: str, value: object, *, needed: bool,
                    kind: str | None, used_by: tuple[str, ...]) -> None:
        """A path: ``needed`` for this kind, else allowed only for ``used_by`` (kind None: unknown)."""
        if value is not None and (not isinstance(value, str) or not value):
            problems.append(f"{key}: expected a path, got {value!r}")
        elif kind is None:
            return  # data.kind's own error says what is wrong
        elif value is None and needed:
            problems.append(f"{key}: required when kind = {kind!r}")
        elif value is not None and kind not in used_by:
            listed = " or ".join(repr(k) for k in used_by)
            problems.append(f"{key}: only used when kind is {listed}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When and where to save; see trainer/checkpoint_layout.py for the on-disk layout."""

    dir: str = "checkpoints"
    every_steps: int = 50  # save after every N-th step; 0 = only after the last step
    keep: int = 3  # complete checkpoints kept; older ones are deleted after each save
    # True: the persistent save runs beside training (trainer/checkpoint.py); the
    # training thread waits only for a copy of its shards.
    asynchronous: bool = False
    # The in-memory tier (trainer/memory_tier.py): every N-th step; 0 = off.
    memory_every_steps: int = 0
    # Its node-local directory; "" = $TSUP_MEMORY_DIR, else /dev/shm/tsup-memory-<uid>/<run>.
    memory_dir: str = ""
    # Threads a rank writes, reads and hashes its checkpoint files with (both tiers);
    # 0 = the node's cores shared out over its ranks, 2 to 8 (trainer/checkpoint_io.py).
    io_threads: int = 0

    def __post_init__(self) -> None:
        p: list[str] = []
        if not isinstance(self.dir, str) or not self.dir:
            p.append(f"dir: expected a directory path, got {self.dir!r}")
        need_int(p, "every_steps", self.every_steps, 0)
        need_int(p, "keep", self.keep, 1)
        if not isinstance(self.asynchronous, bool):
            p.append(f"asynchronous: expected true or false, got {self.asynchronous!r}")
        need_int(p, "memory_every_steps", self.memory_every_steps, 0)
        if not isinstance(self.memory_dir, str):
            p.append(f"memory_dir: expected a directory path, got {self.memory_dir!r}")
        need_int(p, "io_threads", self.io_threads, 0)
        raise_if(p)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    # The training stack: "torch" (FSDP2, trainer/train.py) or "neuron" (neuronx-distributed
    # on Trainium, trainer/neuron/, laid out by the [neuron] table).
    backend: str = "torch"
    model: str = "tiny"  # a name from trainer.shapes.SHAPES
    # Individual ModelShape fields to override, e.g. {n_layers = 4}.
    model_overrides: dict[str, int | float] = field(default_factory=dict)
    seed: int = 1234  # seeds the weights, the synthetic data and the sample order
    steps: int = 100  # total optimizer steps of the run (not of one attempt)
    global_batch_size: int = 16  # samples per optimizer step over all ranks
    micro_batch_size: int | None = None  # samples per pass per rank; None = no accumulation
    seq_len: int = 64  # tokens per sample fed to the model
    # Compute dtype; "bfloat16" keeps float32 master weights and reduces gradients in
    # float32. "auto": bfloat16 on CUDA, float32 on CPU.
    dtype: str = "auto"
    device: str = "auto"  # "auto" = cuda if available, else cpu
    output_dir: str = "output"  # where result.json goes
    heartbeat_interval_s: float = 1.0
    log_every_steps: int = 1  # rank 0 prints a progress line every N steps
    dist_timeout_s: float = 600.0  # collective timeout: a dead peer fails the run after this
    # Recompute activations in the backward pass instead of keeping them: "full" (every
    # transformer block), "selective" (every other block), "none".
    activation_checkpointing: str = "none"
    compile: bool = False  # torch.compile each transformer block (needs a C++ compiler on CPU)
    # Mean loss over held-out samples every N steps (0 = never), on ``validation_samples``
    # samples of the data's validation split.
    validation_every_steps: int = 0
    validation_samples: int = 64
    # The device's peak dense FLOP/s per rank, in TFLOP/s, for MFU; 0 = the stated peak of
    # the device (trainer/flops.py), where it is known.
    peak_tflops: float = 0.0
    # TensorBoard event files (rank 0), when the tensorboard package is installed;
    # "" = <output_dir>/tensorboard.
    tensorboard_dir: str = ""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    neuron: NeuronConfig = field(default_factory=NeuronConfig)
    # Derived from model + model_overrides; not a config key.
    shape: ModelShape = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p: list[str] = []
        need_choice(p, "backend", self.backend, ("torch", "neuron"))
        need_int(p, "seed", self.seed, 0)
        need_int(p, "steps", self.steps, 1)
        need_int(p, "global_batch_size", self.global_batch_size, 1)
        if self.micro_batch_size is not None:
            need_int(p, "micro_batch_size", self.micro_batch_size, 1)
        need_int(p, "seq_len", self.seq_len, 1)
        need_choice(p, "dtype", self.dtype, ("auto", "float32", "bfloat16"))
        need_choice(p, "device", self.device, ("auto", "cpu", "cuda"))
        if not isinstance(self.output_dir, str) or not self.output_dir:
            p.append(f"output_dir: expected a directory path, got {self.output_dir!r}")
        need_number(p, "heartbeat_interval_s", self.heartbeat_interval_s, positive=True)
        need_int(p, "log_every_steps", self.log_every_steps, 1)
        need_number(p, "dist_timeout_s", self.dist_timeout_s, positive=True)
        need_choice(p, "activation_checkpointing", self.activation_checkpointing,
                     ("none", "selective", "full"))
        if not isinstance(self.compile, bool):
            p.append(f"compile: expected true or false, got {self.compile!r}")
        need_int(p, "validation_every_steps", self.validation_every_steps, 0)
        need_int(p, "validation_samples", self.validation_samples, 1)
        need_number(p, "peak_tflops", self.peak_tflops, minimum=0.0)
        if not isinstance(self.tensorboard_dir, str):
            p.append(f"tensorboard_dir: expected a directory path, got {self.tensorboard_dir!r}")
        self.shape = SHAPES["tiny"]  # placeholder so the object is whole even when invalid
        if self.model not in SHAPES:
            p.append(f"model: unknown shape {self.model!r}; known: {', '.join(SHAPES)}")
        else:
            p.extend(self._resolve_shape())
        if not p and self.seq_len > self.shape.max_seq_len:
            p.append(f"seq_len: {self.seq_len} exceeds the model's context "
                     f"{self.shape.max_seq_len}")
        if (not p and self.validation_every_steps and self.data.validation_path is None
                and not self.data.validation_fraction):
            p.append("validation_every_steps: needs held-out data: data.validation_path or "
                     "data.validation_fraction")
        if (not p and self.micro_batch_size is not None
                and self.micro_batch_size > self.global_batch_size):
            p.append(f"micro_batch_size: {self.micro_batch_size} exceeds global_batch_size "
                     f"{self.global_batch_size}")
        raise_if(p)

    def _resolve_shape(self) -> list[str]:
        base = SHAPES[self.model]
        if not isinstance(self.model_overrides, dict):
            return [f"model_overrides: expected a table, got {self.model_overrides!r}"]
        names = [f.name for f in dataclasses.fields(ModelShape)]
        unknown = [k for k in self.model_overrides if k not in names]
        if unknown:
            return [_unknown_key(k, names, "model_overrides") for k in unknown]
        overrides: dict[str, Any] = dict(self.model_overrides)
        for name in ("rope_theta", "norm_eps"):  # TOML writes 10000 for 10000.0
            if is_number(overrides.get(name)):
                overrides[name] = float(overrides[name])
        try:
            self.shape = dataclasses.replace(base, **overrides)
        except ConfigError as e:
            return e.prefixed("model_overrides").errors
        return []

    def batch_layout(self, world_size: int) -> BatchLayout:
        """Split the global batch over ``world_size`` ranks; ConfigError if it cannot."""
        return split_batch(self.global_batch_size, self.micro_batch_size, world_size,
                           f"the world size {world_size}")


# ---- loading ------------------------------------------------------------------------------

# Fields that only change how a run is operated, not the numbers it computes; they are
# left out of config_digest so that, for example, moving the checkpoint dir is harmless.
_OPERATIONAL_FIELDS = frozenset({"checkpoint", "output_dir", "heartbeat_interval_s",
                                 "log_every_steps", "dist_timeout_s", "device",
                                 "activation_checkpointing", "compile", "validation_every_steps",
                                 "validation_samples", "peak_tflops", "tensorboard_dir"})


def load_config(path: str | Path) -> TrainConfig:
    """Read and validate a ``.toml`` or ``.json`` config file."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text.decode())
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"{path}: expected a .toml or .json file")
    except (ValueError, UnicodeDecodeError) as e:  # TOMLDecodeError and JSONDecodeError
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table at the top level")
    return config_from_dict(data)


def tiny_defaults(optimizer: dict[str, Any]) -> dict[str, Any]:
    """The optimizer table of a ``tiny`` config with the keys it leaves out filled in (see
    OptimizerConfig): the recipe's shape at a scale where a few hundred steps learn, lr
    3e-3, warm-up 10 steps, and min_lr a tenth of lr."""
    out = {"lr": 3e-3, "warmup_steps": 10, **optimizer}
    if "min_lr" not in out and is_number(out["lr"]) and out["lr"] > 0:
        out["min_lr"] = out["lr"] / 10
    return out


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build a TrainConfig from plain data (parsed TOML/JSON); ConfigError lists all problems."""
    if data.get("model", "tiny") == "tiny" and isinstance(data.get("optimizer", {}), dict):
        data = {**data, "optimizer": tiny_defaults(data.get("optimizer", {}))}
    config: TrainConfig = _build(TrainConfig, data, "")
    return config


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain data that config_from_dict turns back into an equal config."""
    out = _to_plain(config)
    assert isinstance(out, dict)
    return out


def config_digest(config: TrainConfig) -> str:
    """sha256 of the settings that shape the training trajectory (hex, 16 chars)."""
    plain = {k: v for k, v in config_to_dict(config).items() if k not in _OPERATIONAL_FIELDS
             and (k != "neuron" or config.backend == "neuron")}  # the [neuron] table: its backend's only
    canonical = json.dumps(plain, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name))
                for f in dataclasses.fields(value) if f.init}
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _unknown_key(key: str, known: list[str], where: str) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{where + ': ' if where else ''}unknown key {key!r}{hint}"


def _build(cls: type[Any], data: dict[str, Any], where: str) -> Any:
    """Construct dataclass ``cls`` from ``data``; ``where`` is the dotted path for errors."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            problems.append(_unknown_key(key, list(fields), where))
            continue
        path = f"{where}.{key}" if where else key
        try:
            kwargs[key] = _convert(value, hints[key], path)
        except ConfigError as e:
            problems.extend(e.errors)
    try:
        # Build even when a child failed (with that child at its default), so that the
        # parent's own checks run and report their problems in the same pass.
        return_value = cls(**kwargs)
    except ConfigError as e:
        problems.extend(e.prefixed(where).errors if where else e.errors)
        return_value = None
    raise_if(problems)
    return return_value


def _convert(value: Any, annotation: Any, path: str) -> Any:
    """Turn parsed TOML/JSON into the annotated type where the two differ.

    Only shapes the dataclass checks cannot see are handled here: nested tables,
    ints where floats are expected, arrays for tuples. Value ranges are the
    dataclasses' business.
    """
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, options[0], path) if len(options) == 1 else value
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table, got {value!r}")
        return _build(cast(type[Any], annotation), value, path)
    if annotation is float and is_number(value):
        return float(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected an array, got {value!r}")
        items = get_args(annotation)
        return tuple(_convert(v, items[0], path) for v in value) if items else tuple(value)
    return value
