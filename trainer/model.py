"""A Llama-style decoder-only transformer.

Pre-norm blocks of RMSNorm -> grouped-query attention with RoPE -> residual, then
RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and an untied output head.
The query/key/value projections are one fused matrix (``attn.qkv``) and so are the
MLP's gate and up projections (``mlp.gate_up``), as in the Llama 2 Trainium recipe.

Construct under ``torch.device("meta")`` to get a model with shapes but no storage (for
parameter counts, or to shard before materializing), then ``to_empty`` and
``init_weights``. Weights depend only on (seed, parameter name), never on how the
model is sharded, so every world size starts from the same model.

Not modelled: Llama 3.1's RoPE frequency scaling for long contexts (it matters only
beyond 8k tokens) and tied embeddings (Llama 3.2 ties them; this model never does).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from trainer.shapes import ModelShape

INIT_STD = 0.02  # std of the normal init of every matrix and embedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 even under bf16: the mean of squares loses precision.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, each (seq_len, head_dim), float32.

    Channel pair (i, i + head_dim/2) rotates by position * theta^(-2i/head_dim), the
    "rotate half" layout; the first and second halves repeat the same angles.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64)
                         / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (batch, heads, seq, head_dim) by the tables' first seq rows."""
    seq = x.shape[-2]
    cos, sin = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            shape.n_heads, shape.n_kv_heads, shape.head_dim)
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split = (q_width, kv_width, kv_width)
        self.qkv = nn.Linear(shape.hidden_size, sum(self.split), bias=False)
        self.out = nn.Linear(q_width, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        # (batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)
        q = q.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # enable_gqa lets each group of n_heads / n_kv_heads query heads share one k/v head
        # without materializing repeated k and v.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(batch, seq, -1))
        return out


class SwiGLU(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gate_up = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down(F.silu(gate) * up)
        return out


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.attn = Attention(shape)
        self.mlp_norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.mlp = SwiGLU(shape)
        # Activation checkpointing: keep only the block's input for the backward pass and
        # recompute the rest there (less memory, about a third more compute). The same
        # operations run again, so the result is the same, bit for bit.
        self.recompute = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            out: torch.Tensor = checkpoint(self._forward, x, cos, sin, use_reentrant=False)
            return out
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class Transformer(nn.Module):
    rope_cos: torch.Tensor  # (rope_len, head_dim) float32 buffers, see rope_tables
    rope_sin: torch.Tensor

    def __init__(self, shape: ModelShape, rope_len: int | None = None) -> None:
        """``rope_len``: longest sequence the RoPE tables cover (default: the context)."""
        super().__init__()
        self.shape = shape
        self.rope_len = rope_len or shape.max_seq_len
        self.embed = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Block(shape) for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.norm_eps)
        self.output = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        # Derived from the shape, so not persistent: checkpoints and digests skip them.
        cos, sin = rope_tables(self.rope_len, shape.head_dim, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq)."""
        cos, sin = self.rope_cos, self.rope_sin
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.output(self.norm(x))
        return logits

    def blocks(self) -> list[Block]:
        """The transformer blocks, typed (``self.layers`` holds nn.Module for mypy)."""
        return [layer for layer in self.layers if isinstance(layer, Block)]

    def prepare_blocks(self, *, activation_checkpointing: str, compile: bool) -> None:
        """Before sharding. Activation checkpointing: ``full``, every block recomputes its
        activations in the backward pass; ``selective``, every other block (half the
        memory saving for half the extra compute); ``none``, no block. ``compile``:
        torch.compile each block (each compiles once; FSDP2 then wraps it)."""
        for i, block in enumerate(self.blocks()):
            block.recompute = activation_checkpointing == "full" or (
                activation_checkpointing == "selective" and i % 2 == 0)
            if compile:
                block.compile()

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """(Re)initialize every parameter and buffer in place, on whatever device they are.

        Matrices and embeddings: normal(0, 0.02); the projections that write into the
        residual stream (``attn.out``, ``mlp.down``) get std 0.02 / sqrt(2 * n_layers) so
        the residual's variance does not grow with depth; norm weights: 1.
        """
        cos, sin = rope_tables(self.rope_len, self.shape.head_dim, self.shape.rope_theta,
                               device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                _init_normal(param, name, self.init_std(name), seed)

    def init_std(self, name: str) -> float:
        if name.endswith(("attn.out.weight", "mlp.down.weight")):
            return INIT_STD / math.sqrt(2 * self.shape.n_layers)
        return INIT_STD


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _init_normal(param: torch.Tensor, name: str, std: float, seed: int) -> None:
    """Fill ``param`` (a plain tensor or a sharded DTensor) from its own random stream.

    The whole tensor is drawn on the parameter's device and each rank keeps its shard,
    so the values do not depend on the sharding; one full parameter at a time is the
    memory cost (the largest is the embedding: vocab x hidden).
    """
    local = param.to_local() if isinstance(param, DTensor) else param
    generator = torch.Generator(device=local.device).manual_seed(_param_seed(seed, name))
    full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
    full.normal_(0.0, std, generator=generator)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so each just slices
        # its own shard locally instead of receiving it from rank 0.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(shard.to(param.dtype))
    else:
        param.copy_(full.to(param.dtype))
