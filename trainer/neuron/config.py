"""The ``[neuron]`` table of the trainer config (stdlib only, like trainer/config.py).

It says how the Neuron backend spreads the model over NeuronCores; the model, batch and
optimizer stay in the shared tables. Whether the numbers fit a world size is
trainer/neuron/layout.py's question, asked when the world size is known.
"""

from __future__ import annotations

from dataclasses import dataclass

from wire.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class NeuronConfig:
    """Parallelism for ``backend = "neuron"``; the defaults are the seeds' Llama 2 7B
    recipe on trn1.32xlarge (TP 8, no PP, sequence parallel, ZeRO-1)."""

    tensor_parallel_size: int = 8  # ranks that split every layer's matrices
    pipeline_parallel_size: int = 1  # stages the layers are cut into
    # Micro-batches a pipeline splits each data-parallel replica's batch into; only
    # meaningful with pipeline_parallel_size > 1.
    num_microbatches: int = 1
    # Split the activations between TP ranks along the sequence outside the matmuls
    # (norms, dropout, residuals), saving activation memory.
    sequence_parallel: bool = True
    zero1: bool = True  # shard the optimizer state over the data-parallel ranks
    # Where compiled graphs are kept; "" = $NEURON_COMPILE_CACHE_URL, else Neuron's own
    # default. Node-local disk is best: compiles of many nodes contend on shared storage.
    compile_cache_dir: str = ""

    def __post_init__(self) -> None:
        p: list[str] = []
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "num_microbatches"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                p.append(f"{key}: expected a positive integer, got {value!r}")
        for key in ("sequence_parallel", "zero1"):
            if not isinstance(getattr(self, key), bool):
                p.append(f"{key}: expected true or false, got {getattr(self, key)!r}")
        if not isinstance(self.compile_cache_dir, str):
            p.append(f"compile_cache_dir: expected a directory path, got {self.compile_cache_dir!r}")
        if not p and self.pipeline_parallel_size == 1 and self.num_microbatches != 1:
            p.append(f"num_microbatches: only used with pipeline_parallel_size > 1, got "
                     f"{self.num_microbatches}")
        if p:
            raise ConfigError(p)
