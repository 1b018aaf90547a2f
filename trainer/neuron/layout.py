"""How a world of ranks is cut into tensor-, pipeline- and data-parallel groups (pure).

NxD's ``parallel_state.initialize_model_parallel`` numbers ranks with tensor parallelism
fastest, then data parallelism, then pipeline stages (Megatron's order)::

    rank = stage * (dp * tp) + replica * tp + tp_rank

so a TP group is ``tp`` consecutive ranks (on one node, where its per-layer all-reduces
belong), a pipeline is every ``world / pp``-th rank, and a data-parallel group holds the
ranks of one stage with the same TP rank. ``parallel_layout`` checks that a model shape
fits the numbers, and says why not in the config's own key names:

- the world size must be a multiple of TP x PP (the rest is data parallelism);
- TP splits query heads, the MLP width and the vocabulary, so it must divide each;
- key/value heads (grouped-query attention): TP must divide them, or they must divide
  TP. In the second case each KV head is replicated on ``tp / n_kv_heads`` ranks (NxD's
  ``kv_size_multiplier``): llama3.1-8b's 8 KV heads on TP 32 are each held 4 times;
- PP cuts the layers into equal stages, so it must divide the layer count;
- TP must fit in a node (it all-reduces in every layer): on trn1.32xlarge, 32 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import TrainConfig
from trainer.neuron.config import NeuronConfig
from trainer.shapes import ModelShape
from wire.batch import BatchLayout, split_batch
from wire.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelLayout:
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    kv_replication: int  # ranks holding each key/value head (1: no replication)
    heads_per_rank: int  # query heads on each TP rank
    kv_heads_per_rank: int  # key/value heads on each TP rank, replicas included
    layers_per_stage: int

    def tensor_parallel_groups(self) -> list[range]:
        tp = self.tensor_parallel_size
        return [range(g * tp, (g + 1) * tp) for g in range(self.world_size // tp)]

    def pipeline_parallel_groups(self) -> list[range]:
        stride = self.world_size // self.pipeline_parallel_size
        return [range(i, self.world_size, stride) for i in range(stride)]

    def data_parallel_groups(self) -> list[range]:
        per_stage = self.world_size // self.pipeline_parallel_size
        return [range(stage * per_stage + t, (stage + 1) * per_stage, self.tensor_parallel_size)
                for stage in range(self.pipeline_parallel_size) for t in range(self.tensor_parallel_size)]


def parallel_layout(world_size: int, neuron: NeuronConfig, shape: ModelShape, *,
                    ranks_per_node: int | None = None) -> ParallelLayout:
    """The layout of ``world_size`` ranks; ConfigError naming every number that does not fit."""
    tp, pp = neuron.tensor_parallel_size, neuron.pipeline_parallel_size
    p: list[str] = []
    if world_size % (tp * pp):
        p.append(f"neuron.tensor_parallel_size: world size {world_size} is not a multiple of "
                 f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp}")
    if ranks_per_node is not None and (tp > ranks_per_node or ranks_per_node % tp):
        p.append(f"neuron.tensor_parallel_size: {tp} does not divide the {ranks_per_node} ranks of a "
                 f"node; a tensor-parallel group must stay inside one node")
    for what, count in (("query heads", shape.n_heads), ("intermediate_size", shape.intermediate_size),
                        ("vocab_size", shape.vocab_size)):
        if count % tp:
            p.append(f"neuron.tensor_parallel_size: {tp} does not divide the model's {what} ({count})")
    kv = shape.n_kv_heads
    if kv % tp and tp % kv:
        p.append(f"neuron.tensor_parallel_size: {tp} and the model's {kv} key/value heads must divide "
                 f"one another (each rank holds whole heads; fewer heads than ranks are replicated)")
    if shape.n_layers % pp:
        p.append(f"neuron.pipeline_parallel_size: {pp} does not divide the model's {shape.n_layers} layers")
    if p:
        raise ConfigError(p)
    replication = max(1, tp // kv)
    return ParallelLayout(world_size=world_size, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          data_parallel_size=world_size // (tp * pp), kv_replication=replication,
                          heads_per_rank=shape.n_heads // tp, kv_heads_per_rank=kv * replication // tp,
                          layers_per_stage=shape.n_layers // pp)


def batch_split(config: TrainConfig, layout: ParallelLayout) -> BatchLayout:
    """The global batch over the data-parallel replicas (not over every rank: the TP and
    PP ranks of a replica see the same samples); with PP, each replica's micro-batch
    is cut into ``num_microbatches`` pieces that flow through the stages."""
    dp = layout.data_parallel_size
    batch = split_batch(config.global_batch_size, config.micro_batch_size, dp,
                        f"the data-parallel size {dp} (world size {layout.world_size} / (tensor x pipeline "
                        f"parallel size))")
    pieces = config.neuron.num_microbatches
    if batch.micro % pieces:
        raise ConfigError(f"neuron.num_microbatches: {pieces} does not divide the micro-batch of "
                          f"{batch.micro} sample(s) per replica")
    return batch


def check_neuron_config(config: TrainConfig, world_size: int | None) -> None:
    """``--check-config`` for ``backend = "neuron"``: the settings the backend does not
    have, and with a world size, the layout and the batch split; ConfigError lists them."""
    p: list[str] = []
    if config.checkpoint.memory_every_steps:
        p.append("checkpoint.memory_every_steps: the memory tier is the torch backend's; use 0 with "
                 "backend = 'neuron'")
    if config.activation_checkpointing == "selective":
        p.append("activation_checkpointing: 'selective' (every other block) is the torch backend's; "
                 "use 'full' or 'none' with backend = 'neuron'")
    if config.compile:
        p.append("compile: torch.compile is the torch backend's; Neuron compiles every graph itself")
    if config.validation_every_steps:
        p.append("validation_every_steps: validation is the torch backend's; use 0 with backend = 'neuron'")
    if config.device != "auto":
        p.append(f"device: backend = 'neuron' trains on NeuronCores; use 'auto', got {config.device!r}")
    if p:
        raise ConfigError(p)
    if world_size is not None:
        batch_split(config, parallel_layout(world_size, config.neuron, config.shape))
