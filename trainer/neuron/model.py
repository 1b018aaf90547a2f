"""The Llama decoder on NxD's parallel layers (needs neuronx-distributed; imported by
trainer/neuron/train.py only after it found the SDK).

The same architecture as trainer/model.py (RMSNorm, RoPE, grouped-query attention,
SwiGLU, fused qkv and gate_up projections, untied head), with its matrices split over
the tensor-parallel group: column-parallel in (qkv, gate_up, the head), row-parallel
out (o, down). Activations are sequence-first, ``[seq, batch, hidden]``: with sequence
parallelism each TP rank holds ``seq / tp`` positions between the matmuls, and the
column-parallel layers gather the sequence that the row-parallel ones scatter again.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
from neuronx_distributed.parallel_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
from neuronx_distributed.parallel_layers.mappings import scatter_to_sequence_parallel_region
from torch import nn

from trainer.neuron.layout import ParallelLayout
from trainer.shapes import ModelShape

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, sequence_parallel: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        # Each TP rank normalizes its own positions: NxD all-reduces this gain's gradient
        # over the TP group when the attribute says so.
        self.weight.sequence_parallel_enabled = sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by the positions' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    """One transformer block; with activation_checkpointing = "full" NxD recomputes it."""

    def __init__(self, shape: ModelShape, layout: ParallelLayout, sequence_parallel: bool) -> None:
        super().__init__()
        self.head_dim = shape.hidden_size // shape.n_heads
        self.heads, self.kv_heads = layout.heads_per_rank, layout.kv_heads_per_rank
        sp = sequence_parallel
        out_init = functools.partial(nn.init.normal_, std=INIT_STD / math.sqrt(2 * shape.n_layers))
        self.attention_norm = RMSNorm(shape.hidden_size, shape.norm_eps, sp)
        self.qkv = GQAQKVColumnParallelLinear(
            shape.hidden_size, [shape.n_heads * self.head_dim, shape.n_kv_heads * self.head_dim],
            bias=False, gather_output=False, sequence_parallel_enabled=sp,
            kv_size_multiplier=layout.kv_replication)
        self.o = RowParallelLinear(shape.n_heads * self.head_dim, shape.hidden_size, bias=False,
                                   input_is_parallel=True, sequence_parallel_enabled=sp, init_method=out_init)
        self.mlp_norm = RMSNorm(shape.hidden_size, shape.norm_eps, sp)
        # stride 2: each rank holds its slice of gate and its slice of up, side by side.
        self.gate_up = ColumnParallelLinear(shape.hidden_size, 2 * shape.intermediate_size, bias=False,
                                            gather_output=False, stride=2, sequence_parallel_enabled=sp)
        self.down = RowParallelLinear(shape.intermediate_size, shape.hidden_size, bias=False,
                                      input_is_parallel=True, sequence_parallel_enabled=sp,
                                      init_method=out_init)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.attention_norm(x))  # each [seq, batch, heads on this rank x head_dim]
        seq, batch = q.shape[0], q.shape[1]
        q, k, v = (t.view(seq, batch, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.permute(2, 0, 1, 3).reshape(seq, batch, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        out: torch.Tensor = x + self.down(F.silu(gate) * up)
        return out


class NeuronLlama(nn.Module):
    """``forward(input_ids, labels)`` returns the mean loss (what NxD's pipeline runs)."""

    def __init__(self, shape: ModelShape, layout: ParallelLayout, *, seq_len: int,
                 sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.embed = ParallelEmbedding(shape.vocab_size, shape.hidden_size,
                                       init_method=functools.partial(nn.init.normal_, std=INIT_STD))
        self.layers = nn.ModuleList(DecoderLayer(shape, layout, sequence_parallel)
                                    for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.norm_eps, sequence_parallel)
        self.head = ColumnParallelLinear(shape.hidden_size, shape.vocab_size, bias=False, gather_output=False,
                                         sequence_parallel_enabled=sequence_parallel)
        head_dim = shape.hidden_size // shape.n_heads
        inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [seq, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids).transpose(0, 1).contiguous()  # [seq, batch, hidden]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.head(self.norm(x))  # [seq, batch, vocab on this rank]
        loss: torch.Tensor = parallel_cross_entropy(logits.float(), labels.transpose(0, 1).contiguous())
        return loss.mean()
